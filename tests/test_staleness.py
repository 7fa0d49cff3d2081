"""Staleness end to end, through a real IPython shell running cells with the extension loaded.

Each scenario defines an experiment whose `forward` reaches `act` (directly or further down), trains a
handle, edits something in a later cell, and checks which handle runs which code: the old handle keeps its
programs and says so; the rebuilt one recompiles exactly the programs whose closure drifted.
"""

import os
import sys
import textwrap

import numpy as np
import pytest
from IPython.core.interactiveshell import InteractiveShell

import nitro_ipy
from nitro_ipy._compiler import _cache
from nitro_ipy._training import _ahead

BASE = """
import dataclasses, functools, importlib
import jax, jax.numpy as jnp, numpy as np, optax
import nitro_ipy
from nitro_ipy import Device, GraphConst, Nitro

{defs}

@dataclasses.dataclass
class E:
    lr: Device[float] = 1e-2

    def init(self, rng):
        return {{"w": jnp.ones((2,))}}

    def forward(self, params, *, x):
        return {forward}

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)

    def optimizer(self):
        return optax.sgd(self.lr)

X = np.ones((8, 2), np.float32)
data = {{"train": {{"x": X, "y": np.zeros(8, np.float32)}}}}
n = Nitro(E(lr=0.0), data=data, batch_size=4, progress=False)  # lr 0: outputs move only with code
n.train()
before = n.predict({{"x": X[:2]}})
"""

STALE_LINE = "! this handle's compiled programs had dependency methods redefined"


@pytest.fixture
def ip(tmp_path):
    shell = InteractiveShell.instance()
    shell.reset(new_session=False)  # the process's one shell: start from no name an earlier test left
    shell.run_line_magic("load_ext", "nitro_ipy")
    sys.path.insert(0, str(tmp_path))
    saved = dict(shell.user_ns)
    yield shell
    sys.path.remove(str(tmp_path))
    sys.modules.pop("mymod", None)
    for name in list(shell.user_ns):
        if name not in saved:
            del shell.user_ns[name]
    shell.run_line_magic("unload_ext", "nitro_ipy")
    shell.reset(new_session=False)  # also the output history (`Out`, `_`), which holds displayed handles
    # and the last error's traceback, whose frames hold the handles of the cell that raised
    for holder, name in ((shell.InteractiveTB, "tb"), (sys, "last_traceback"), (sys, "last_value"), (sys, "last_exc")):
        if getattr(holder, name, None) is not None:
            setattr(holder, name, None)


def run(ip, capsys, source: str) -> str:
    result = ip.run_cell(textwrap.dedent(source))
    out = capsys.readouterr().out
    assert result.error_in_exec is None and result.error_before_exec is None, out
    return out


def scenario(ip, capsys, defs, forward, edit, drifted, *, factor=3.0):
    """Run the base cell, the edit cell, then check both handles; returns the output of the edit cell."""
    run(ip, capsys, BASE.format(defs=textwrap.dedent(defs), forward=forward))
    assert nitro_ipy.cache_stats() == (2, 3, 3)  # grad, opt (2 steps: 2 misses, 2 hits), predict
    before_kinds = {id(e): e.kind for e in _cache.live_entries()}
    # Counted from before the edit: compile ahead (on, as for users) may compile the rebuild's programs
    # in the background after the edit's cell, or the rebuild compiles them: two misses either way.
    misses = nitro_ipy.cache_stats().misses
    out_edit = run(ip, capsys, edit)

    out = run(ip, capsys, "n.train(); old = n.predict({'x': X[:2]})")
    assert out.count(STALE_LINE) == 2, out  # once per entry point: train, predict
    poisoned = ", ".join(drifted)
    # The cache-level line, once: at the end of the edit's cell (compile ahead scans there), or else
    # when the handle runs next.
    assert f"poisoned; redefined: {poisoned}." in out_edit + out, out
    assert f"{STALE_LINE}: {poisoned} (grad, predict)" in out, out
    np.testing.assert_array_equal(ip.user_ns["old"], ip.user_ns["before"])  # the old program still runs

    out = run(ip, capsys, "n2 = n.rebuild(); n2.train(); new = n2.predict({'x': X[:2]})")
    assert STALE_LINE not in out and "poisoned" not in out, out
    np.testing.assert_allclose(ip.user_ns["new"], factor * ip.user_ns["before"], rtol=1e-6)
    recompiled = sorted(e.kind for e in _cache.live_entries() if id(e) not in before_kinds)
    assert recompiled == ["grad", "predict"]  # never the optimizer
    assert nitro_ipy.cache_stats().misses == misses + 2
    return out_edit


def test_helper_two_levels_below_the_hook(ip, capsys):
    defs = """
    def inner(z):
        return z * 1.0

    def helper(z):
        return inner(z)
    """
    edit = """
    def inner(z):
        return z * 3.0
    """
    scenario(ip, capsys, defs, 'helper(x @ params["w"])', edit, ["__main__.inner"])


def test_redefined_hook_method(ip, capsys):
    run(ip, capsys, BASE.format(defs="", forward='x @ params["w"]'))
    before_ids = {id(e) for e in _cache.live_entries()}
    run(ip, capsys, BASE.split("X = np.ones")[0].format(defs="", forward='3.0 * (x @ params["w"])'))
    out = run(ip, capsys, "n.train(); old = n.predict({'x': X[:2]})")
    assert f"{STALE_LINE}: __main__.E.forward (grad, predict)" in out, out
    np.testing.assert_array_equal(ip.user_ns["old"], ip.user_ns["before"])
    run(ip, capsys, "n2 = n.rebuild(); n2.train(); new = n2.predict({'x': X[:2]})")
    np.testing.assert_allclose(ip.user_ns["new"], 3.0 * ip.user_ns["before"], rtol=1e-6)
    new_kinds = sorted(e.kind for e in _cache.live_entries() if id(e) not in before_ids)
    assert new_kinds == ["grad", "predict"]
    grad = [e for e in _cache.live_entries() if e.kind == "grad" and id(e) not in before_ids][0]
    assert grad.why == "hook `forward` was redefined"


def test_global_constant(ip, capsys):
    defs = """
    SCALE = 1.0

    def act(z):
        return z * SCALE
    """
    scenario(ip, capsys, defs, 'act(x @ params["w"])', "SCALE = 3.0", ["__main__.SCALE"])


def test_closure_from_a_factory(ip, capsys):
    defs = """
    def make(s):
        def scaled(z):
            return z * s
        return scaled

    act = make(1.0)
    """
    scenario(ip, capsys, defs, 'act(x @ params["w"])', "act = make(3.0)", ["__main__.act"])


def test_functools_partial(ip, capsys):
    defs = """
    def mul(z, s):
        return z * s

    act = functools.partial(mul, s=1.0)
    """
    scenario(ip, capsys, defs, 'act(x @ params["w"])', "act = functools.partial(mul, s=3.0)", ["__main__.act"])


def test_decorated_helper(ip, capsys):
    defs = """
    def traced(f):
        @functools.wraps(f)
        def wrapper(*args):
            return f(*args)
        return wrapper

    @traced
    def act(z):
        return z * 1.0
    """
    edit = """
    @traced
    def act(z):
        return z * 3.0
    """
    scenario(ip, capsys, defs, 'act(x @ params["w"])', edit, ["__main__.act"])


INNER_JIT = """
def inner(z):
    return z * 1.0

@jax.jit
def act(z):
    return inner(z)
"""
INNER_EDIT = """
def inner(z):
    return z * 3.0
"""


def test_helper_below_an_inner_jax_jit(ip, capsys):
    # JAX caches the inner jit's trace by identity: without clearing it, the rebuilt handle would
    # recompile the outer program around the old inner one.
    scenario(ip, capsys, INNER_JIT, 'act(x @ params["w"])', INNER_EDIT, ["__main__.inner"])


def test_lambda(ip, capsys):
    scenario(ip, capsys, "act = lambda z: z * 1.0", 'act(x @ params["w"])', "act = lambda z: z * 3.0",
             ["__main__.act"])


def _write_module(tmp_path, factor, comment=""):
    path = tmp_path / "mymod.py"
    path.write_text(f"{comment}\ndef act(z):\n    return z * {factor}\n")
    st = os.stat(path)
    os.utime(path, (st.st_atime, st.st_mtime + 10 * factor + len(comment)))  # a new mtime for autoreload
    return path


def test_module_file_edit_then_reload(ip, capsys, tmp_path):
    _write_module(tmp_path, 1.0)
    defs = "import mymod"
    edit_reload = "importlib.reload(mymod)"
    run(ip, capsys, BASE.format(defs=defs, forward='mymod.act(x @ params["w"])'))
    _write_module(tmp_path, 3.0)
    out = run(ip, capsys, "n.train()")  # saved, not reloaded: the live code did not change
    assert "nitro_ipy: edited on disk, not loaded yet: mymod.act." in out, out
    assert STALE_LINE not in out and "poisoned" not in out
    out = run(ip, capsys, "n.train()")
    assert "edited on disk" not in out  # said once per edit, not every cell
    out_reload = run(ip, capsys, edit_reload)  # compile ahead's scan says the cache-level line here
    out = run(ip, capsys, "n.train(); old = n.predict({'x': X[:2]})")
    assert "poisoned; redefined: mymod.act." in out_reload + out, out
    assert f"{STALE_LINE}: mymod.act (grad, predict)" in out, out
    run(ip, capsys, "n2 = n.rebuild(); new = n2.predict({'x': X[:2]})")
    np.testing.assert_allclose(ip.user_ns["new"], 3.0 * ip.user_ns["before"], rtol=1e-6)
    np.testing.assert_array_equal(ip.user_ns["old"], ip.user_ns["before"])


@pytest.mark.parametrize("how", ["edited twice", "edited then reverted", "deleted", "renamed"])
def test_each_on_disk_state_of_an_imported_function_is_said_once(ip, capsys, tmp_path, how):
    # `from mymod import act` re-run after each change: the module is not reloaded, the live code is the
    # same. Each new version of the file is said once; a file back as it was loaded is no pending edit.
    path = _write_module(tmp_path, 1.0)
    run(ip, capsys, BASE.format(defs="from mymod import act", forward='act(x @ params["w"])'))
    line = "nitro_ipy: edited on disk, not loaded yet: mymod.act."
    outs = []
    if how.startswith("edited"):
        for factor in (3.0, 5.0 if how == "edited twice" else 1.0):
            _write_module(tmp_path, factor)
            outs.append(run(ip, capsys, "from mymod import act"))
    else:
        if how == "deleted":
            path.unlink()
        else:
            path.rename(tmp_path / "mymod_v2.py")
        outs.append(run(ip, capsys, "from mymod import act"))
    outs.append(run(ip, capsys, "n.train()"))
    said = {"edited twice": [1, 1, 0], "edited then reverted": [1, 0, 0], "deleted": [1, 0], "renamed": [1, 0]}
    assert [out.count(line) for out in outs] == said[how], outs
    assert not any(STALE_LINE in out or "poisoned" in out for out in outs), outs


def test_autoreload_2_swaps_code_in_place(ip, capsys, tmp_path):
    _write_module(tmp_path, 1.0)
    run(ip, capsys, "%reload_ext autoreload\n%autoreload 2")
    try:
        # `from mymod import act` binds the function object itself; autoreload updates it in place.
        run(ip, capsys, BASE.format(defs="from mymod import act\nact_before = act", forward='act(x @ params["w"])'))
        _write_module(tmp_path, 3.0)
        out = run(ip, capsys, "same = act is act_before; n.train(); old = n.predict({'x': X[:2]})")
        assert ip.user_ns["same"] is True  # the same function object, with new code
        # Both names: the module's function, and the notebook global bound to the same object.
        assert "poisoned; redefined: __main__.act, mymod.act." in out, out
        assert f"{STALE_LINE}: __main__.act, mymod.act (grad, predict)" in out, out
        np.testing.assert_array_equal(ip.user_ns["old"], ip.user_ns["before"])
        run(ip, capsys, "n2 = n.rebuild(); new = n2.predict({'x': X[:2]})")
        np.testing.assert_allclose(ip.user_ns["new"], 3.0 * ip.user_ns["before"], rtol=1e-6)
    finally:
        run(ip, capsys, "%autoreload 0")


@pytest.mark.parametrize(
    "edit",
    [
        "def act(z):\n    return z * SCALE\n",  # the same cell re-run
        "def act(z):\n    # a comment now\n\n    return z * SCALE  # and here\n",  # comments and blank lines
        "def unrelated(z):\n    return z + 1\nOTHER = 5\n",  # a function and a global the program never read
    ],
    ids=["rerun", "comment-only", "unrelated"],
)
def test_no_op_edits_poison_nothing(ip, capsys, edit):
    defs = "SCALE = 1.0\n\ndef act(z):\n    return z * SCALE\n"
    run(ip, capsys, BASE.format(defs=defs, forward='act(x @ params["w"])'))
    run(ip, capsys, edit)
    out = run(ip, capsys, "n.train(); n2 = n.rebuild(); n2.train(); same = n2.predict({'x': X[:2]})")
    assert STALE_LINE not in out and "poisoned" not in out, out
    assert nitro_ipy.cache_stats().misses == 3  # nothing recompiled
    assert _cache.poisoned_entries() == []


def test_deleted_function_counts_as_drifted(ip, capsys):
    defs = "def act(z):\n    return z * 1.0\n"
    run(ip, capsys, BASE.format(defs=defs, forward='act(x @ params["w"])'))
    out = run(ip, capsys, "del act\nn.train()")
    assert "poisoned; redefined: __main__.act." in out, out
    assert f"{STALE_LINE}: __main__.act (grad, predict)" in out, out


def test_no_scan_without_a_bump():
    # The memo: after a scan, an entry point with no bump since does no re-resolution at all.
    nitro_ipy.bump_world()
    _cache.ensure_fresh()
    scanned = _cache.scanned_world()
    _cache.ensure_fresh()
    assert _cache.scanned_world() == scanned == nitro_ipy.world()


def test_running_train_is_pinned_to_the_code_it_started_with(ip, capsys):
    defs = "def act(z):\n    return z * 1.0\n"
    run(ip, capsys, BASE.format(defs=defs, forward='act(x @ params["w"])'))
    # A schedule runs on the host every step: at the second step it redefines `act` and bumps the world,
    # as a save in an editor would while the loop runs.
    edit_mid_run = """
    def edit(step):
        if step == 1:
            exec("def act(z):\\n    return z * 3.0\\n", globals())
            nitro_ipy.bump_world()
        return 0.0

    n_pinned = Nitro(E(lr=0.0), data=data, batch_size=4, schedules={"lr": edit}, progress=False)
    misses_before = nitro_ipy.cache_stats().misses
    n_pinned.train()
    misses_during = nitro_ipy.cache_stats().misses - misses_before
    """
    out = run(ip, capsys, edit_mid_run)
    assert ip.user_ns["misses_during"] == 0  # both steps ran the cached programs resolved at step 1
    assert STALE_LINE not in out
    out = run(ip, capsys, "n_pinned.train()")  # the next entry point sees the edit
    assert f"{STALE_LINE}: __main__.act (grad)" in out, out


def test_poisoning_keeps_the_compiled_programs_of_the_users_other_jax_jit_functions(ip, capsys):
    # Only the traces of user functions are dropped after an edit: jax.clear_caches() would also throw
    # away the executables of every unrelated jitted function in the session.
    # (`other` is JAX's own, as a function jitted before the extension loaded is: the extension's honest
    # `jax.jit` would make it a `nitro_ipy.jit`, tests/test_adopt.py.)
    ip.run_cell("%nitro_honest_jit off\nimport jax, jax.numpy as jnp\nother = jax.jit(lambda v: v * 2.0 + 1.0)\n"
                "other(jnp.ones(3))\n%nitro_honest_jit on")
    scenario(ip, capsys, INNER_JIT, 'act(x @ params["w"])', INNER_EDIT, ["__main__.inner"])
    assert ip.user_ns["other"]._cache_size() == 1


@pytest.mark.parametrize("wrapper", [
    "jax.checkpoint(lambda z: inner(z))",
    "lambda z: jax.lax.scan(lambda c, _: (inner(c), None), z, None, length=1)[0]",
    "lambda z: jax.lax.cond(True, inner, jnp.negative, z)",
    "jax.vmap(lambda z: inner(z))",
    "jax.jit(jax.checkpoint(lambda z: inner(z)))",
])
def test_helper_below_a_cached_transformation(ip, capsys, wrapper):
    # Each transformation caches its trace of the wrapped user function by identity; the edit must reach
    # the rebuilt handle through every one of them, while the other handle's old program stays.
    defs = f"""
    def inner(z):
        return z * 1.0

    act = {wrapper}
    """
    edit = """
    def inner(z):
        return z * 3.0
    """
    scenario(ip, capsys, defs, 'act(x @ params["w"])', edit, ["__main__.inner"])


HELPER = "def helper(z):\n    return z * 1.0\n"
EDITED = "def helper(z):\n    return z * 3.0\n"


def test_an_edit_reverted_before_the_rebuild_revives_the_old_programs(ip, capsys):
    run(ip, capsys, BASE.format(defs=HELPER, forward='helper(x @ params["w"])'))
    out_edit = run(ip, capsys, EDITED)  # compile ahead's scan says the cache-level line here
    out = run(ip, capsys, "n.predict({'x': X[:2]})")
    assert "poisoned; redefined: __main__.helper." in out_edit + out and STALE_LINE in out
    assert _ahead.wait(60)  # the edit's programs compiled ahead: counted before the revert
    misses = nitro_ipy.cache_stats().misses
    run(ip, capsys, HELPER)  # the same content as the original: the edit is undone
    out = run(ip, capsys, "n.train(); again = n.predict({'x': X[:2]}); n3 = Nitro(E(lr=0.0), data=data, batch_size=4, progress=False); n3.train(); fresh = n3.predict({'x': X[:2]})")
    assert STALE_LINE not in out and "compiled" not in out, out  # the old handle is current again
    assert nitro_ipy.cache_stats().misses == misses  # nothing recompiled: the old programs are served
    np.testing.assert_array_equal(ip.user_ns["again"], ip.user_ns["before"])
    np.testing.assert_array_equal(ip.user_ns["fresh"], ip.user_ns["before"])
    assert _cache.poisoned_entries() == []


def test_after_cache_reset_a_live_handle_still_learns_its_programs_went_stale(ip, capsys):
    run(ip, capsys, BASE.format(defs=HELPER, forward='helper(x @ params["w"])'))
    run(ip, capsys, "nitro_ipy.cache_reset()")
    run(ip, capsys, EDITED)
    out = run(ip, capsys, "n.predict({'x': X[:2]})")
    assert f"{STALE_LINE}: __main__.helper (grad, predict)" in out, out
    out = run(ip, capsys, "n2 = n.rebuild(); new = n2.predict({'x': X[:2]})")
    assert STALE_LINE not in out
    np.testing.assert_allclose(ip.user_ns["new"], 3.0 * ip.user_ns["before"], rtol=1e-6)


def test_an_edit_reverted_after_cache_reset_revives_the_old_handle_but_serves_no_new_one(ip, capsys):
    """`cache_reset()` let go of the old handle's programs: reverting an edit makes them current again
    for that handle (no warning), but a new handle still compiles its own (the reset holds)."""
    run(ip, capsys, BASE.format(defs=HELPER, forward='helper(x @ params["w"])'))
    run(ip, capsys, "nitro_ipy.cache_reset()")
    run(ip, capsys, EDITED)
    assert STALE_LINE in run(ip, capsys, "n.predict({'x': X[:2]})")
    run(ip, capsys, HELPER)
    out = run(ip, capsys, "again = n.predict({'x': X[:2]})")
    assert STALE_LINE not in out and "compiled" not in out, out
    assert nitro_ipy.cache_stats().entries == 0
    out = run(ip, capsys, "n3 = Nitro(E(lr=0.0), data=data, batch_size=4, progress=False); fresh = n3.predict({'x': X[:2]})")
    assert "compiled predict" in out, out
    assert nitro_ipy.cache_stats()[1:] == (1, 1)  # (misses, entries): the new handle's own
    np.testing.assert_array_equal(ip.user_ns["again"], ip.user_ns["before"])
    np.testing.assert_array_equal(ip.user_ns["fresh"], ip.user_ns["before"])


def test_a_poisoned_program_is_released_once_no_handle_holds_it(ip, capsys):
    import gc
    import weakref

    run(ip, capsys, BASE.format(defs=HELPER, forward='helper(x @ params["w"])'))
    grad = next(e for e in _cache.live_entries() if e.kind == "grad")
    executable = weakref.ref(grad.call)
    del grad
    run(ip, capsys, EDITED)
    run(ip, capsys, "n = n.rebuild(); n.train()")  # the old handle is gone: nothing holds its programs
    ip.run_cell("Out.clear(); _ = __ = ___ = None")
    gc.collect()
    assert executable() is None  # the executable was released...
    summaries = [e for e in _cache.poisoned_entries() if e.kind == "grad"]
    assert [(e.call, e.closure, e.drifted) for e in summaries] == [(None, None, ("__main__.helper",))]
    text = repr(ip.run_line_magic("nitro_stats", ""))  # ...and is still listed, with what drifted
    assert text.splitlines()[0].endswith("| poisoned 2") and "poisoned (__main__.helper)" in text


METHOD_EDITS = {
    # The method replaced on the very class (no class cell re-run).
    "replaced": """
    def _scaled(self, params, *, x):
        return 3.0 * (x @ params["w"])
    E.forward = _scaled
    """,
    # Its code swapped in place, as `%autoreload 2` does: the same function object, another `__code__`.
    "code swapped": """
    def _scaled(self, params, *, x):
        return 3.0 * (x @ params["w"])
    E.forward.__code__ = _scaled.__code__
    """,
}


@pytest.mark.parametrize("how", sorted(METHOD_EDITS))
def test_a_method_edited_on_its_class_after_quiet_cells(ip, capsys, how):
    """The scan settles an unchanged method by identity (class, function, code); after cells that
    changed nothing, every way of editing the method on the same class is still seen."""
    run(ip, capsys, BASE.format(defs="", forward='x @ params["w"]'))
    for _ in range(3):
        run(ip, capsys, "pass")  # quiet cells: each scans, settling the methods by identity
    edit = textwrap.dedent(METHOD_EDITS[how])  # dedented before the unindented line joins it
    out = run(ip, capsys, edit + "\nn.train(); old = n.predict({'x': X[:2]})")
    assert f"{STALE_LINE}: __main__.E.forward (grad, predict)" in out, out
    np.testing.assert_array_equal(ip.user_ns["old"], ip.user_ns["before"])
    run(ip, capsys, "n2 = n.rebuild(); n2.train(); new = n2.predict({'x': X[:2]})")
    np.testing.assert_allclose(ip.user_ns["new"], 3.0 * ip.user_ns["before"], rtol=1e-6)


def test_a_quiet_cell_resolves_no_method_by_name(ip, capsys, monkeypatch):
    """After a cell that changed nothing, the post-cell scan settles the hook methods by identity: it
    resolves none of them by name again (what made the cell hook cost ~75 us)."""
    from nitro_ipy._closure import _scan

    run(ip, capsys, BASE.format(defs="", forward='x @ params["w"]'))
    run(ip, capsys, "pass")
    _cache.ensure_fresh()  # a first scan after the compiles: each method resolved in full, once
    resolved = []
    real = _scan.resolve_function
    monkeypatch.setattr(_scan, "resolve_function", lambda ns, qualname: resolved.append(qualname) or real(ns, qualname))
    run(ip, capsys, "pass")
    _cache.ensure_fresh()  # the scan a quiet cell's hook runs (done here: the hook's is compile-ahead's)
    assert _cache.scanned_world() == nitro_ipy._base._world.world()
    assert resolved == []
    run(ip, capsys, "E.forward = lambda self, params, *, x: 2.0 * (x @ params['w'])")
    _cache.ensure_fresh()
    # The edited hook is found through the class attribute it is read as (`record_hooks`), which
    # follows `E`'s lookup: no method is resolved by its own name, and the programs tracing it are poisoned.
    assert resolved == []
    assert sorted(e.kind for e in ip.user_ns["n"]._programs.values() if e.poisoned) == ["grad", "predict"]


SHAPED = BASE.format(defs="", forward='x @ params["w"] + jnp.sum(params["b"])').replace(
    "optax.sgd(self.lr)", "optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(self.lr))").replace(
    '{"w": jnp.ones((2,))}', '{"w": jnp.ones((2,)), "b": jnp.zeros((3,))}')  # two arrays: a clip each


@pytest.mark.parametrize("how", ["hook", "helper"])
def test_a_rebuild_onto_a_shape_dependent_optimizer_is_refused_with_the_fix(ip, capsys, monkeypatch, how):
    """An optimizer edit that keeps the state's structure (a global clip to a per-parameter one) is
    checked at the rebuild as at setup: on the flat layout it is refused, naming how to switch layouts;
    the same refusal whether the hook or a helper it calls was edited. A rebuild that leaves the
    optimizer alone does not trace it again."""
    from nitro_ipy._experiment import _optimizer

    if how == "helper":
        source = SHAPED.replace("optax.clip_by_global_norm(1.0)", "clip()")
        run(ip, capsys, "import optax\ndef clip():\n    return optax.clip_by_global_norm(1.0)\n" + source)
        edit = "def clip():\n    return optax.adaptive_grad_clip(1.0)\n"
    else:
        run(ip, capsys, SHAPED)
        edit = SHAPED.split("X = np.ones")[0].replace("optax.clip_by_global_norm(1.0)", "optax.adaptive_grad_clip(1.0)")
    traced = []
    monkeypatch.setattr(_optimizer, "shape_dependence", lambda tx, t: traced.append(1))  # counts the checks
    run(ip, capsys, "m = n.rebuild(); m.train()")  # nothing moved: not checked again
    assert traced == []
    monkeypatch.undo()
    run(ip, capsys, edit)
    result = ip.run_cell("m = n.rebuild()")
    capsys.readouterr()
    err = result.error_in_exec
    assert type(err).__name__ == "NitroValueError"
    assert str(err).startswith("the optimizer of `E` treats each parameter array by its own shape or norm")
    assert str(err).endswith(
        "`rebuild()` carries the optimizer state of the flat layout; to change the layout, start a handle "
        "from the trained parameters: `Nitro(e, ..., flat_params=False, params=n.params)` (the optimizer "
        "state starts afresh).")
    # the fix it names trains
    run(ip, capsys, "t = Nitro(E(lr=0.0), data=data, batch_size=4, progress=False, flat_params=False, params=n.params); t.train()")


FUNCTION_FIELD = """
import dataclasses, functools
from typing import Any
import jax, jax.numpy as jnp, numpy as np, optax
from nitro_ipy import Device, GraphConst, Nitro

def act(h, scale=1.0):
    return h * scale

@dataclasses.dataclass
class F:
    lr: Device[float] = 0.0
    acts: GraphConst[Any] = None

    def init(self, rng):
        return {"w": jnp.ones((2,))}

    def forward(self, params, *, x):
        return self.acts[0](x @ params["w"])

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)

X = np.ones((8, 2), np.float32)
data = {"train": {"x": X, "y": np.zeros(8, np.float32)}}
n = Nitro(F(acts=(HELD,)), data=data, batch_size=4, progress=False)
n.train()
before = n.predict({"x": X[:2]})
"""


@pytest.mark.parametrize("held", ["act", "functools.partial(act, scale=1.0)"])
def test_a_function_held_in_a_graphconst_field_is_the_live_one_after_a_rebuild(ip, capsys, held):
    """A user function (or a partial of one) in a GraphConst value, inside a tuple: the rebuilt handle's
    experiment holds the function its name gives now, as it holds the live class of an instance."""
    run(ip, capsys, FUNCTION_FIELD.replace("HELD", held))
    run(ip, capsys, "def act(h, scale=1.0):\n    return h * scale * 3.0\n")
    out = run(ip, capsys, "n2 = n.rebuild(); new = n2.predict({'x': X[:2]})")
    shown = "(<function act>,)" if held == "act" else "(functools.partial(<function act>, scale=1.0),)"
    assert "compiled predict [forward] in " in out and f"(GraphConst `acts`: {shown}, its function redefined)" in out, out
    np.testing.assert_allclose(ip.user_ns["new"], 3.0 * ip.user_ns["before"], rtol=1e-6)
    assert STALE_LINE not in out


INHERITED = """
import dataclasses
import jax, jax.numpy as jnp, numpy as np, optax
import nitro_ipy
from nitro_ipy import Device, Nitro

@dataclasses.dataclass
class Base:
    lr: Device[float] = 0.0

    def init(self, rng):
        return {"w": jnp.ones((2,))}

    def act(self, h):
        return h

    def forward(self, params, *, x):
        return self.act(x @ params["w"])

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)

    def optimizer(self):
        return optax.sgd(self.lr)  # lr 0: outputs move only with code
"""
SUB = "@dataclasses.dataclass\nclass Sub(Base):\n    pass\n"
TRAIN_SUB = """
X = np.ones((8, 2), np.float32)
data = {"train": {"x": X, "y": np.zeros(8, np.float32)}}
n = Nitro(Sub(), data=data, batch_size=4, progress=False)
n.train()
before = n.predict({"x": X[:2]})
"""
TRIPLED = "    def {name}(self, *a, **k):\n        return Base.{name}(self, *a, **k) * 3.0\n"


@pytest.mark.parametrize("name", ["forward", "act"])
def test_a_subclass_cell_re_run_to_override_what_it_inherited_is_drift(ip, capsys, name):
    """A hook (`forward`) or a method a hook calls (`act`) that `Sub` inherited, now overridden by its
    re-run cell: the old handle says it is stale, and the rebuilt one runs the override."""
    run(ip, capsys, INHERITED + SUB + TRAIN_SUB)
    run(ip, capsys, SUB.replace("    pass\n", TRIPLED.format(name=name)))
    out = run(ip, capsys, "old = n.predict({'x': X[:2]})")
    assert f"{STALE_LINE}: __main__.Sub.{name} (" in out, out
    np.testing.assert_array_equal(ip.user_ns["old"], ip.user_ns["before"])
    out = run(ip, capsys, "new = n.rebuild().predict({'x': X[:2]})")
    np.testing.assert_allclose(ip.user_ns["new"], 3.0 * ip.user_ns["before"], rtol=1e-6)


@pytest.mark.parametrize("edited", ["loss", "act"])
def test_a_base_class_re_run_alone_moves_nothing_its_old_subclass_runs(ip, capsys, edited):
    """Python: a subclass keeps the base class object it was defined with, so re-running only the base
    class's cell changes nothing `Sub()` runs. Nothing is stale, a rebuild compiles nothing, and a fresh
    handle's acceptance check holds; re-running `Sub`'s cell then picks the edit up."""
    run(ip, capsys, INHERITED + SUB + TRAIN_SUB)
    edit = INHERITED.replace("(outputs - y) ** 2", "jnp.abs(outputs - y)") if edited == "loss" else \
        INHERITED.replace("        return h\n", "        return h * 3.0\n")
    run(ip, capsys, edit)
    out = run(ip, capsys, "n.train(); n2 = n.rebuild(); n2.train(); same = n2.predict({'x': X[:2]})")
    assert "stale" not in out and "poisoned" not in out and "compiled" not in out, out
    np.testing.assert_array_equal(ip.user_ns["same"], ip.user_ns["before"])
    run(ip, capsys, "nitro_ipy.cache_reset(); m = Nitro(Sub(), data=data, batch_size=4, progress=False); m.train(2)")
    s = nitro_ipy.cache_stats()
    assert s.misses == s.entries == 2
    out = run(ip, capsys, SUB + "k = n2.rebuild(); k.train(); new = k.predict({'x': X[:2]})")
    assert "compiled grad" in out and "stale" not in out, out
    if edited == "act":
        np.testing.assert_allclose(ip.user_ns["new"], 3.0 * ip.user_ns["before"], rtol=1e-6)


def test_the_stale_line_names_the_variable_the_handle_is_bound_to(ip, capsys):
    run(ip, capsys, BASE.format(defs="def helper(z):\n    return z\n", forward='helper(x @ params["w"])'))
    run(ip, capsys, "model_b = n\ndel n")
    run(ip, capsys, "def helper(z):\n    return z * 3.0\n")
    out = run(ip, capsys, "model_b.predict({'x': X[:2]})")
    assert out.count("rebuild it: `model_b = model_b.rebuild()`") == 1, out
    out = run(ip, capsys, "handles = [model_b]\ndel model_b\nhandles[0].predict({'x': X[:2]})")
    assert "rebuild it: `n = n.rebuild()`" in out, out  # bound to no name: the usual one
