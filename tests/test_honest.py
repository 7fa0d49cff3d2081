"""Honest under every edit (issue 11), end to end through a real IPython shell with the extension loaded.

Each stale case checks three handles: the old one (old value, the per-handle line), the rebuilt one
(current value, only the affected program kinds recompiled) and a fresh one (current value). Each no-op
case checks that nothing recompiles and nothing warns. The tables are corpus-style: one row per kind of
edit, each with the names the cache must report.
"""

import textwrap

import numpy as np
import pytest

import nitro_ipy
from nitro_ipy._compiler import _cache
from tests import test_staleness

STALE_LINE, run = test_staleness.STALE_LINE, test_staleness.run
ip = test_staleness.ip  # the staleness tests' shell fixture (assigned, so it is one fixture, not an import)

BASE = """
import dataclasses, enum, functools, importlib, threading, types
from typing import Any
import jax, jax.numpy as jnp, numpy as np, optax
import nitro_ipy
from nitro_ipy import Device, GraphConst, Nitro

{defs}

@dataclasses.dataclass
class E:
    lr: Device[float] = 1e-2
    {fields}

    def init(self, rng):
        return {init}

    def forward(self, params, *, x):
        return {forward}

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)

    def optimizer(self):
        return optax.sgd(self.lr)

X = np.ones((8, 2), np.float32)
data = {{"train": {{"x": X, "y": np.zeros(8, np.float32)}}}}
n = Nitro({make}, data=data, batch_size=4, progress=False)  # lr 0: outputs move only with code
n.train()
before = n.predict({{"x": X[:2]}})
"""

PLAIN = dict(fields="", init='{"w": jnp.ones((2,))}', make="E(lr=0.0)")


def base(ip, capsys, defs, forward, **parts):
    parts = {**PLAIN, **parts}
    run(ip, capsys, BASE.format(defs=textwrap.dedent(defs), forward=forward, **parts))
    assert nitro_ipy.cache_stats() == (2, 3, 3)  # grad, opt (2 steps: 2 misses, 2 hits), predict


def stale(ip, capsys, defs, forward, edit, drifted, *, factor=3.0, **parts):
    """Old handle: old value + per-handle line; rebuilt: current value, grad and predict recompiled (never
    the optimizer); fresh: current value."""
    base(ip, capsys, defs, forward, **parts)
    before = {id(e) for e in _cache.live_entries()}
    # Counted from before the edit: compile ahead may compile the rebuild's two programs in the
    # background after the edit's cell, or the rebuild compiles them: two misses either way.
    misses = nitro_ipy.cache_stats().misses
    run(ip, capsys, textwrap.dedent(edit))

    out = run(ip, capsys, "n.train(); old = n.predict({'x': X[:2]})")
    names = ", ".join(drifted)
    assert f"{STALE_LINE}: {names} (grad, predict)" in out, out
    assert out.count(STALE_LINE) == 2, out  # once per entry point
    np.testing.assert_array_equal(ip.user_ns["old"], ip.user_ns["before"])

    out = run(ip, capsys, "n2 = n.rebuild(); n2.train(); new = n2.predict({'x': X[:2]})")
    assert STALE_LINE not in out and "poisoned" not in out, out
    np.testing.assert_allclose(ip.user_ns["new"], factor * ip.user_ns["before"], rtol=1e-6)
    recompiled = sorted(e.kind for e in _cache.live_entries() if id(e) not in before)
    assert recompiled == ["grad", "predict"]
    assert nitro_ipy.cache_stats().misses == misses + 2

    make = parts.get("make", PLAIN["make"])
    out = run(ip, capsys, f"n3 = Nitro({make}, data=data, batch_size=4, progress=False); "
                          "fresh = n3.predict({'x': X[:2]})")
    assert STALE_LINE not in out, out
    np.testing.assert_allclose(ip.user_ns["fresh"], factor * ip.user_ns["before"], rtol=1e-6)
    assert nitro_ipy.cache_stats().misses == misses + 2  # served the rebuilt handle's program


def noop(ip, capsys, defs, forward, edit, **parts):
    """Nothing warns, nothing recompiles: the old handle, the rebuilt one, a fresh one."""
    base(ip, capsys, defs, forward, **parts)
    run(ip, capsys, textwrap.dedent(edit))
    make = parts.get("make", PLAIN["make"])
    out = run(ip, capsys, "n.train(); old = n.predict({'x': X[:2]}); n2 = n.rebuild(); n2.train(); "
                          f"n3 = Nitro({make}, data=data, batch_size=4, progress=False); n3.predict({{'x': X[:2]}})")
    assert STALE_LINE not in out and "poisoned" not in out and "compiled" not in out, out
    assert nitro_ipy.cache_stats().misses == 3
    assert _cache.poisoned_entries() == []


# ---------------------------------------------------------------- objects judged by their class's code

HEAD = """
@dataclasses.dataclass(frozen=True)
class Head:
    RATE = 1.0
    width: int = 2

    def __call__(self, z):
        return self.scale(z) * self.RATE

    def scale(self, z):
        return z * 1.0

    def unused(self):
        return "never traced"
"""
HEAD_PARTS = dict(fields="head: GraphConst[Any] = None", make="E(lr=0.0, head=Head())")
HEAD_FORWARD = 'self.head(x @ params["w"])'

STALE_EDITS = {
    # A GraphConst instance's method the trace used, edited by re-running the class cell.
    "graphconst-used-method": (HEAD, HEAD_FORWARD, HEAD.replace("z * 1.0", "z * 3.0"),
                               ["__main__.Head.scale"], HEAD_PARTS),
    "graphconst-class-constant": (HEAD, HEAD_FORWARD, HEAD.replace("RATE = 1.0", "RATE = 3.0"),
                                  ["__main__.Head.RATE"], HEAD_PARTS),
    "class-constant-of-a-global-class": (
        "class Consts:\n    SCALE = 1.0\n", 'Consts.SCALE * (x @ params["w"])',
        "class Consts:\n    SCALE = 3.0\n", ["__main__.Consts.SCALE"], {}),
    "enum-member": (
        "class Mode(enum.Enum):\n    A = 1.0\n", 'Mode.A.value * (x @ params["w"])',
        "class Mode(enum.Enum):\n    A = 3.0\n", ["__main__.Mode.A"], {}),
    "namespace-attribute": (
        "cfg = types.SimpleNamespace(scale=1.0)\n", 'cfg.scale * (x @ params["w"])',
        "cfg.scale = 3.0\n", ["__main__.cfg"], {}),
    "object-attribute": (
        "class Cfg:\n    pass\ncfg = Cfg()\ncfg.scale = 1.0\n", 'cfg.scale * (x @ params["w"])',
        "cfg.scale = 3.0\n", ["__main__.cfg"], {}),
    "untracked-global-rebound": (
        "class Opaque:\n    def __init__(self, s):\n        self.s, self.lock = s, threading.Lock()\nobj = Opaque(1.0)\n",
        'obj.s * (x @ params["w"])', "obj = Opaque(3.0)\n", ["__main__.obj"], {}),
    "dataclass-default-of-a-class-made-in-the-trace": (
        "@dataclasses.dataclass\nclass Scaler:\n    s: float = 1.0\n    def __call__(self, z):\n        return z * self.s\n",
        'Scaler()(x @ params["w"])',
        "@dataclasses.dataclass\nclass Scaler:\n    s: float = 3.0\n    def __call__(self, z):\n        return z * self.s\n",
        ["__main__.Scaler.s"], {}),
    # A function in a GraphConst field (as itself, or in a partial), edited by re-running its cell: only
    # the programs that call it recompile, never the optimizer (issue 46; the key's fields are compared
    # on what each program's trace read).
    "graphconst-function-value": ("def act(z):\n    return z * 1.0\n", 'self.act(x @ params["w"])',
                                  "def act(z):\n    return z * 3.0\n", ["__main__.act"],
                                  dict(fields="act: GraphConst[Any] = None", make="E(lr=0.0, act=act)")),
    "graphconst-partial-value": ("def act(z, k):\n    return z * k\n", 'self.act(x @ params["w"])',
                                 "def act(z, k):\n    return z * k * 3.0\n", ["__main__.act"],
                                 dict(fields="act: GraphConst[Any] = None",
                                      make="E(lr=0.0, act=functools.partial(act, k=1.0))")),
    "global-instance-method": (
        "class Act:\n    def __call__(self, z):\n        return z * 1.0\nact = Act()\n", 'act(x @ params["w"])',
        "class Act:\n    def __call__(self, z):\n        return z * 3.0\nact = Act()\n", ["__main__.Act.__call__"], {}),
}


@pytest.mark.parametrize("case", list(STALE_EDITS))
def test_an_edit_the_program_depends_on_is_seen(ip, capsys, case):
    defs, forward, edit, drifted, parts = STALE_EDITS[case]
    stale(ip, capsys, defs, forward, edit, drifted, **parts)


FUNC = '''
def act(z):
    return z * 1.0
'''
NOOP_EDITS = {
    "docstring-only": (FUNC, 'act(x @ params["w"])', 'def act(z):\n    """Scale."""\n    return z * 1.0\n', {}),
    "docstring-changed": ('def act(z):\n    "One."\n    return z * 1.0\n', 'act(x @ params["w"])',
                          'def act(z):\n    """Two, longer."""\n    return z * 1.0\n', {}),
    "annotations": (FUNC, 'act(x @ params["w"])', "def act(z: jax.Array) -> jax.Array:\n    return z * 1.0\n", {}),
    "line-numbers-and-comments": (FUNC, 'act(x @ params["w"])', "\n\n\n# moved down\ndef act(z):\n    # same\n    return z * 1.0\n", {}),
    "rerun-unchanged": (FUNC, 'act(x @ params["w"])', FUNC, {}),
    "graphconst-unused-method": (HEAD, HEAD_FORWARD, HEAD.replace('"never traced"', '"edited, still untraced"'),
                                 HEAD_PARTS),
    "graphconst-class-rerun": (HEAD, HEAD_FORWARD, HEAD, HEAD_PARTS),
    "global-class-unused-method": (
        "class Consts:\n    SCALE = 1.0\n    def unused(self):\n        return 1\n", 'Consts.SCALE * (x @ params["w"])',
        "class Consts:\n    SCALE = 1.0\n    def unused(self):\n        return 2\n", {}),
    "namespace-unread-attribute": (
        "cfg = types.SimpleNamespace(scale=1.0)\n", 'cfg.scale * (x @ params["w"])',
        "cfg = types.SimpleNamespace(scale=1.0)\n", {}),
}


@pytest.mark.parametrize("case", list(NOOP_EDITS))
def test_an_edit_that_changes_no_program_is_no_alarm(ip, capsys, case):
    defs, forward, edit, parts = NOOP_EDITS[case]
    noop(ip, capsys, defs, forward, edit, **parts)


def test_a_program_traced_from_a_superseded_method_is_never_served(ip, capsys):
    """The old handle compiles a new kind (eval) after the class was edited: its trace runs the old
    method, so the program is stale at birth and a fresh handle never gets it."""
    base(ip, capsys, HEAD, HEAD_FORWARD, **HEAD_PARTS)
    run(ip, capsys, HEAD.replace("z * 1.0", "z * 3.0"))
    out = run(ip, capsys, "old_eval = n.evaluate('train')")  # a program kind the old handle never ran
    assert "compiled eval" in out, out
    eval_entry = [e for e in n_programs(ip) if e.kind == "eval"][0]
    assert eval_entry.poisoned and eval_entry.drifted == ("__main__.Head.scale",)
    out = run(ip, capsys, "n.evaluate('train')")
    assert f"{STALE_LINE}: __main__.Head.scale (eval, grad, predict)" in out, out
    out = run(ip, capsys, "n3 = Nitro(E(lr=0.0, head=Head()), data=data, batch_size=4, progress=False); "
                          "fresh_eval = n3.evaluate('train')")
    assert "compiled eval" in out and STALE_LINE not in out, out
    # loss of the fresh program (3 x outputs) against the old one's (1 x outputs): 9 times as large.
    assert ip.user_ns["fresh_eval"]["loss"] == pytest.approx(9.0 * ip.user_ns["old_eval"]["loss"])


def n_programs(ip):
    return list(ip.user_ns["n"]._programs.values())


def test_reverting_a_superseding_edit_revives_the_program(ip, capsys):
    base(ip, capsys, HEAD, HEAD_FORWARD, **HEAD_PARTS)
    run(ip, capsys, HEAD.replace("z * 1.0", "z * 3.0"))
    run(ip, capsys, "n.evaluate('train')")
    run(ip, capsys, HEAD)  # reverted
    out = run(ip, capsys, "n.train(); n.evaluate('train')")
    assert STALE_LINE not in out, out
    assert all(not e.poisoned for e in n_programs(ip))


# ---------------------------------------------------------------- rebuild(e), schedules, data(self)

def test_rebuild_onto_a_re_created_experiment_carries_the_training_state(ip, capsys):
    base(ip, capsys, "", 'x @ params["w"]')
    run(ip, capsys, "n.train(); step = n.step; w = np.asarray(n.params['w'])")
    # The cell re-run: a new class object, a new instance.
    run(ip, capsys, BASE.split("X = np.ones")[0].format(defs="", forward='3.0 * (x @ params["w"])', **PLAIN))
    out = run(ip, capsys, "n2 = n.rebuild(E(lr=0.0)); new = n2.predict({'x': X[:2]})")
    assert STALE_LINE not in out
    assert ip.user_ns["n2"].step == ip.user_ns["step"]
    np.testing.assert_array_equal(np.asarray(ip.user_ns["n2"].params["w"]), ip.user_ns["w"])
    np.testing.assert_allclose(ip.user_ns["new"], 3.0 * ip.user_ns["before"], rtol=1e-6)


def test_rebuild_refuses_parameters_that_no_longer_fit_with_the_diff(ip, capsys):
    base(ip, capsys, "", 'x @ params["w"]')
    run(ip, capsys, BASE.split("X = np.ones")[0].format(
        defs="", forward='x @ params["w"] + params["b"]', **{**PLAIN, "init": '{"w": jnp.ones((3,)), "b": jnp.zeros(())}'}))
    result = ip.run_cell("n.rebuild(E(lr=0.0))")
    capsys.readouterr()
    err = result.error_in_exec
    assert isinstance(err, nitro_ipy.NitroError), err
    assert str(err) == (
        "the training state of this handle does not fit `E` as it is now: its parameters differ from what "
        "`init` returns:\n"
        "  params['b']: new in `init` float32[], not in the carried parameters\n"
        "  params['w']: carried float32[2], `init` now gives float32[3]\n"
        "Start a fresh run with `Nitro(e, ...)`, or change `init` back so the parameters fit."
    )


SCHEDULED = BASE.replace(
    "n = Nitro({make}, data=data, batch_size=4, progress=False)",
    "n = Nitro({make}, data=data, batch_size=4, progress=False, schedules={{'lr': warmup}})",
)


def test_an_edited_schedule_is_named_and_rebound_on_rebuild(ip, capsys):
    defs = "def warmup(step):\n    return 0.0\n"
    run(ip, capsys, SCHEDULED.format(defs=defs, forward='x @ params["w"]', **PLAIN))
    out = run(ip, capsys, "n.train()")
    assert STALE_LINE not in out and "schedule" not in out
    run(ip, capsys, "def warmup(step):\n    return 0.25\n")
    out = run(ip, capsys, "n.train(); old = n.predict({'x': X[:2]})")
    assert out.count("! this handle's schedule `lr` (`__main__.warmup`) was redefined.") == 2, out
    np.testing.assert_array_equal(ip.user_ns["old"], ip.user_ns["before"])  # lr still 0: the old schedule
    misses = nitro_ipy.cache_stats().misses
    out = run(ip, capsys, "n2 = n.rebuild(); n2.train(); new = n2.predict({'x': X[:2]})")
    assert "schedule" not in out, out
    # lr 0.25 from the live schedule: one step takes w from 1 to 1 - 0.25 * 4 = 0, the minimum.
    np.testing.assert_array_equal(ip.user_ns["new"], np.zeros(2))
    assert nitro_ipy.cache_stats().misses == misses  # a schedule is host code: no program recompiles


def test_the_data_hook_is_rebound_on_rebuild(ip, capsys):
    cell = """
    import dataclasses, jax.numpy as jnp, numpy as np, optax
    from nitro_ipy import Device, Nitro

    @dataclasses.dataclass
    class D:
        lr: Device[float] = 0.0

        def data(self):
            return {"train": {"x": np.full((4, 2), FILL, np.float32), "y": np.zeros(4, np.float32)}}

        def init(self, rng):
            return {"w": jnp.ones((2,))}

        def forward(self, params, *, x):
            return x @ params["w"]

        def loss(self, outputs, *, y):
            return jnp.mean((outputs - y) ** 2)
    """
    run(ip, capsys, "FILL = 1.0\n" + textwrap.dedent(cell) + "\nn = Nitro(D(), batch_size=4, progress=False)")
    run(ip, capsys, textwrap.dedent(cell).replace("FILL", "2.0 * FILL"))
    run(ip, capsys, "n2 = n.rebuild(); x2 = n2._binding.splits['train']['x']")
    np.testing.assert_array_equal(ip.user_ns["x2"], np.full((4, 2), 2.0, np.float32))


# ---------------------------------------------------------------- Flax Linen and Equinox, in a module file

def _write(tmp_path, source: str, stamp: int):
    import os

    path = tmp_path / "mymod.py"
    path.write_text(textwrap.dedent(source))
    st = os.stat(path)
    os.utime(path, (st.st_atime, st.st_mtime + stamp))  # a new mtime: the reload reads the new source


EQX = """
import equinox as eqx
import jax
import jax.numpy as jnp


class Lin(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return (x @ self.w) * 1.0

    def unused(self):
        return "never traced"
"""

FLAX = """
import flax.linen as nn
import jax.numpy as jnp


class Head(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = nn.Dense(1, use_bias=False, kernel_init=nn.initializers.ones)(x)[..., 0]
        return y * 1.0

    def unused(self):
        return "never traced"
"""

EQX_NESTED = """
import equinox as eqx
import jax
import jax.numpy as jnp


class Lin(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return (x @ self.w) * 1.0


class Outer(eqx.Module):
    inner: Lin
    act: object = jax.nn.relu

    def __call__(self, x):
        return self.inner(x)

    def unused(self):
        return "never traced"
"""

FLAX_PARTS = """
import flax.linen as nn
import jax.numpy as jnp


def act(y):
    return y * 1.0


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1, use_bias=False, kernel_init=nn.initializers.ones)(x)[..., 0]


class Head(nn.Module):
    def setup(self):
        self.block = Block()

    def __call__(self, x):
        return act(self.block(x))

    def unused(self):
        return "never traced"
"""

_FLAX_GC = dict(fields="model: GraphConst[Any] = None", init="self.model.init(rng, jnp.ones((1, 2)))",
                make="E(lr=0.0, model=mymod.Head())")

LIBRARY_MODELS = {
    # An Equinox module as the parameter pytree: its class is re-bound in the carried params.
    "equinox-in-params": (EQX, dict(init="mymod.Lin(jnp.ones((2,)))"), "params(x)", "Lin.__call__"),
    # A Flax Linen module definition in a GraphConst field: re-bound in the rebuilt experiment.
    "flax-linen-in-graphconst": (FLAX, _FLAX_GC, "self.model.apply(params, x)", "Head.__call__"),
    # An Equinox module nested in another, the edit in the inner one's method.
    "equinox-nested-module": (EQX_NESTED, dict(init="mymod.Outer(mymod.Lin(jnp.ones((2,))))"), "params(x)",
                              "Lin.__call__"),
    # A `setup()`-style Flax module calling a module-level helper: the edit is in the helper.
    "flax-setup-helper": (FLAX_PARTS, _FLAX_GC, "self.model.apply(params, x)", "act"),
}


@pytest.mark.parametrize("case", list(LIBRARY_MODELS))
def test_a_library_model_edited_in_its_module_file_and_reloaded(ip, capsys, tmp_path, case):
    source, parts, forward, qualname = LIBRARY_MODELS[case]
    _write(tmp_path, source, 0)
    edit = source.replace("* 1.0", "* 3.0")
    stale(ip, capsys, "import mymod", forward, f"open(mymod.__file__, 'w').write({edit!r}); "
          "import os; os.utime(mymod.__file__, (1, os.stat(mymod.__file__).st_mtime + 20)); importlib.reload(mymod)",
          [f"mymod.{qualname}"], **parts)


@pytest.mark.parametrize("case", list(LIBRARY_MODELS))
def test_a_library_model_s_unused_method_edited_and_reloaded_is_no_alarm(ip, capsys, tmp_path, case):
    source, parts, forward, _ = LIBRARY_MODELS[case]
    _write(tmp_path, source, 0)
    edit = source.replace('"never traced"', '"edited, still untraced"')
    noop(ip, capsys, "import mymod", forward, f"open(mymod.__file__, 'w').write({edit!r}); "
         "import os; os.utime(mymod.__file__, (1, os.stat(mymod.__file__).st_mtime + 20)); importlib.reload(mymod)",
         **parts)


# ---------------------------------------------------------------- every kind of cell is user code

CELL_KINDS = {
    "%%time": "%%time\ndef act(z):\n    return z * 1.0\n",
    "%%capture": "%%capture\ndef act(z):\n    return z * 1.0\n",
    "exec": 'exec("def act(z):\\n    return z * 1.0\\n")\n',
}


@pytest.mark.parametrize("kind", list(CELL_KINDS))
def test_code_defined_in_every_kind_of_cell_is_tracked(ip, capsys, kind):
    """The helper is defined in a `%%time` (`<timed exec>`), `%%capture` or `exec` cell; the trace must
    record it as user code, or an edit of it after the rebuild would go unseen."""
    run(ip, capsys, CELL_KINDS[kind])
    stale(ip, capsys, "", 'act(x @ params["w"])', "def act(z):\n    return z * 3.0\n", ["__main__.act"])
    entry = [e for e in _cache.live_entries() if e.kind == "grad"][0]
    assert "__main__.act" in [d.qualified for d in entry.closure.functions]


SCRIPT = """
import dataclasses, sys
import jax.numpy as jnp, numpy as np, optax
import nitro_ipy
from nitro_ipy import Device, Nitro

def act(z):
    return z * 1.0

@dataclasses.dataclass
class E:
    lr: Device[float] = 0.0
    def init(self, rng):
        return {"w": jnp.ones((2,))}
    def forward(self, params, *, x):
        return act(x @ params["w"])
    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)
    def optimizer(self):
        return optax.sgd(self.lr)

X = np.ones((4, 2), np.float32)
n = Nitro(E(), data={"train": {"x": X, "y": np.zeros(4, np.float32)}}, batch_size=4, progress=False)
before = n.predict({"x": X[:1]})
def act(z):
    return z * 3.0
nitro_ipy.bump_world()
old = n.predict({"x": X[:1]})
new = n.rebuild().predict({"x": X[:1]})
print("RESULT", float(before[0]), float(old[0]), float(new[0]))
"""


@pytest.mark.parametrize("how", ["-c", "stdin"])
def test_the_plain_repl_and_python_c_are_user_code(how):
    """`python -c` (`<string>`) and code piped to the interpreter (`<stdin>`, as the plain REPL reads it):
    two fresh interpreters, about 4 s each."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-c", SCRIPT] if how == "-c" else [sys.executable, "-"]
    out = subprocess.run(cmd, input=None if how == "-c" else SCRIPT, env=env, capture_output=True, text=True,
                         check=True).stdout
    assert "! this handle's compiled programs had dependency methods redefined: __main__.act (predict)" in out, out
    assert out.strip().splitlines()[-1] == "RESULT 2.0 2.0 6.0"
