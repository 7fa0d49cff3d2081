"""Zero-change honesty through a real IPython shell with the extension loaded: `@jax.jit`,
`@eqx.filter_jit` and `@nnx.jit` over the user's own functions, unchanged, across a corpus of edits
(each stale case: exactly one new trace, counted inside the body, one line naming the edit, and the
result the current code computes eagerly), the no-op edits (no trace), the switch, and the line at load
naming what was jitted before."""

import gc
import os
import re
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from IPython.core.interactiveshell import InteractiveShell

HEAD = """
import functools, importlib
import jax, jax.numpy as jnp, numpy as np
from jax import lax
X = jnp.ones(3)
TRACES = []
"""

# How each library spells a plain, a static-argument and a donating jit.
DECORATORS = {
    "jax": {"plain": "@jax.jit", "static": "@functools.partial(jax.jit, static_argnames='n')",
            "donate": "@functools.partial(jax.jit, donate_argnums=0)"},
    "eqx": {"plain": "@eqx.filter_jit", "static": "@eqx.filter_jit", "donate": "@eqx.filter_jit(donate='all')"},
    "nnx": {"plain": "@nnx.jit", "static": "@functools.partial(nnx.jit, static_argnames='n')",
            "donate": "@functools.partial(nnx.jit, donate_argnums=0)"},
}
IMPORTS = {"jax": "", "eqx": "import equinox as eqx\n", "nnx": "from flax import nnx\n"}

# (id, definitions, f's parameters, f's body, the call's arguments, the edit, what the line names and the
# path to it from `f<i>` (through `body<i>`), kind)
CORPUS = [
    ("two-levels", "def inner(z):\n    return z * 1.0\ndef act(z):\n    return inner(z) + 0.0\n",
     "x", "act(x)", "X", "def inner(z):\n    return z * 3.0\n", "__main__.inner", "act → inner", "plain"),
    ("global-constant", "SCALE = 1.0\n", "x", "x * SCALE", "X", "SCALE = 3.0", "__main__.SCALE", "SCALE", "plain"),
    ("rebound-closure", "def make(s):\n    def scaled(z):\n        return z * s\n    return scaled\nact = make(1.0)\n",
     "x", "act(x)", "X", "act = make(3.0)", "__main__.act", "act", "plain"),
    ("lambda", "act = lambda z: z * 1.0\n", "x", "act(x)", "X", "act = lambda z: z * 3.0", "__main__.act", "act", "plain"),
    ("vmap", "def act(z):\n    return z * 1.0\n", "x", "jax.vmap(act)(x)", "X",
     "def act(z):\n    return z * 3.0\n", "__main__.act", "act", "plain"),
    ("scan", "def act(z):\n    return z * 1.0\ndef step(c, z):\n    return c, act(z)\n",
     "x", "lax.scan(step, 0.0, x)[1]", "X", "def act(z):\n    return z * 3.0\n", "__main__.act", "step → act",
     "plain"),
    ("array-in-place", "W = np.ones(3, np.float32)\n", "x", "x * W", "X", "W[:] = 3.0", "__main__.W", "W", "plain"),
    ("pytree", "def act(z):\n    return z * 1.0\n", "t", "act(t['a']) + t['b'][0]",
     "{'a': X, 'b': (X, X)}", "def act(z):\n    return z * 3.0\n", "__main__.act", "act", "plain"),
    ("static", "def act(z):\n    return z * 1.0\n", "x, n", "act(x) * n", "X, n=2",
     "def act(z):\n    return z * 3.0\n", "__main__.act", "act", "static"),
    ("donation", "def act(z):\n    return z * 1.0\n", "x", "act(x) + 1.0", "jnp.ones(3)",
     "def act(z):\n    return z * 3.0\n", "__main__.act", "act", "donate"),
]
NO_OPS = [
    ("rerun", "def act(z):\n    return z * SCALE\n"),  # the helper's cell re-run, unchanged
    ("comment", "def act(z):\n    # a comment now\n\n    return z * SCALE  # and here\n"),
    ("unused-function", "def unrelated(z):\n    return z + 1\n"),
]


def _lib(name):
    if name == "eqx":
        pytest.importorskip("equinox")
    elif name == "nnx":
        pytest.importorskip("flax.nnx")
    return name


@pytest.fixture
def ip(tmp_path):
    shell = InteractiveShell.instance()
    shell.reset(new_session=False)
    shell.run_line_magic("load_ext", "nitro_ipy")
    sys.path.insert(0, str(tmp_path))
    saved = dict(shell.user_ns)
    yield shell
    sys.path.remove(str(tmp_path))
    sys.modules.pop("adoptmod", None)
    for name in list(shell.user_ns):
        if name not in saved:
            del shell.user_ns[name]
    shell.run_line_magic("unload_ext", "nitro_ipy")
    shell.reset(new_session=False)
    for holder, name in ((shell.InteractiveTB, "tb"), (sys, "last_traceback"), (sys, "last_value"), (sys, "last_exc")):
        if getattr(holder, name, None) is not None:
            setattr(holder, name, None)
    gc.collect()


def run(ip, capsys, source: str) -> str:
    result = ip.run_cell(textwrap.dedent(source), store_history=True)  # as a notebook does: `In [n]`
    out = capsys.readouterr().out
    assert result.error_in_exec is None and result.error_before_exec is None, out
    return out


def nitro_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("nitro_ipy")]


def compile_line(name: str) -> re.Pattern:
    return re.compile(rf"^nitro_ipy: compiled jit \[__main__\.{name}\] in [\d.]+ s \(trace [\d.]+ s, XLA [\d.]+ s\) "
                      r"\((.*)\)$")


def traces(ip) -> int:
    return len(ip.user_ns["TRACES"])


def jitted(lib: str, kind: str, params: str, body: str, name: str = "f") -> str:
    """`name`, jitted by `lib`, counting its traces, returning `body<name's suffix>(...)` (a plain function,
    so the test can compute what the current code gives eagerly)."""
    b = "body" + name[1:]
    return (f"def {b}({params}):\n    return {body}\n"
            f"{DECORATORS[lib][kind]}\ndef {name}({params}):\n    TRACES.append(1)\n    return {b}({params})\n")


@pytest.mark.parametrize("lib", ["jax", "eqx", "nnx"])
def test_the_corpus_of_stale_making_edits(ip, capsys, lib):
    _lib(lib)
    run(ip, capsys, HEAD + IMPORTS[lib])
    for i, (case, defs, params, body, args, edit, changed, path, kind) in enumerate(CORPUS):
        where, f, b, start = f"{lib}/{case}", f"f{i}", f"body{i}", traces(ip)
        run(ip, capsys, defs + jitted(lib, kind, params, body, f))
        assert type(ip.user_ns[f]).__name__ != "PjitFunction", where
        out = run(ip, capsys, f"before = {f}({args})")
        assert nitro_lines(out) == [] and traces(ip) == start + 1, (where, out)
        cell = ip.execution_count
        out = run(ip, capsys, edit)
        assert nitro_lines(out) == [], (where, out)
        out = run(ip, capsys, f"after = {f}({args}); expected = {b}({args})")
        lines = nitro_lines(out)
        assert len(lines) == 1 and traces(ip) == start + 2, (where, out)
        match = compile_line(f).match(lines[0])
        said = f"recompiling against edited code: {changed} (In [{cell}]; {f} → {b} → {path})"
        assert match is not None and match.group(1) == said, (where, lines)
        np.testing.assert_allclose(ip.user_ns["after"], ip.user_ns["expected"], rtol=1e-6, err_msg=where)
        assert not np.allclose(ip.user_ns["after"], ip.user_ns["before"]), where  # the edit moved the result
        out = run(ip, capsys, f"again = {f}({args})")
        assert nitro_lines(out) == [] and traces(ip) == start + 2, (where, out)
        np.testing.assert_allclose(ip.user_ns["again"], ip.user_ns["after"], err_msg=where)


@pytest.mark.parametrize("lib", ["jax", "eqx", "nnx"])
def test_no_op_edits_trace_nothing(ip, capsys, lib):
    _lib(lib)
    run(ip, capsys, HEAD + IMPORTS[lib] + "SCALE = 1.0\ndef act(z):\n    return z * SCALE\n"
        + jitted(lib, "plain", "x", "act(x)"))
    run(ip, capsys, "before = f(X)")
    for case, edit in NO_OPS:
        out = run(ip, capsys, edit)
        out += run(ip, capsys, "after = f(X)")
        assert nitro_lines(out) == [] and traces(ip) == 1, (case, out)
    np.testing.assert_array_equal(ip.user_ns["after"], ip.user_ns["before"])


MODELS = {
    "eqx": "import equinox as eqx\nclass Model(eqx.Module):\n    w: jax.Array\n"
           "    def __call__(self, z):\n        return act(self.w * z)\nmodel = Model(jnp.ones(3))\n",
    "nnx": "from flax import nnx\nclass Model(nnx.Module):\n    def __init__(self):\n        self.w = nnx.Param(jnp.ones(3))\n"
           "    def __call__(self, z):\n        return act(self.w[...] * z)\nmodel = Model()\n",
}


@pytest.mark.parametrize(("lib", "model"), [("jax", "eqx"), ("eqx", "eqx"), ("nnx", "nnx")])
def test_a_model_whose_call_reads_an_edited_helper(ip, capsys, lib, model):
    _lib(lib), _lib(model)
    run(ip, capsys, HEAD + IMPORTS[lib] + "def act(z):\n    return z * 1.0\n" + MODELS[model]
        + jitted(lib, "plain", "m, x", "m(x) + 1.0"))
    run(ip, capsys, "before = f(model, X)")
    cell = ip.execution_count
    run(ip, capsys, "def act(z):\n    return z * 3.0\n")
    out = run(ip, capsys, "after = f(model, X); expected = body(model, X)")
    lines = nitro_lines(out)
    assert len(lines) == 1 and traces(ip) == 2, out
    assert compile_line("f").match(lines[0]).group(1) == (
        f"recompiling against edited code: __main__.act (In [{cell}]; f → … → Model.__call__ → act)"), lines
    np.testing.assert_allclose(ip.user_ns["after"], ip.user_ns["expected"], rtol=1e-6)
    np.testing.assert_allclose(ip.user_ns["after"], 3.0 * np.asarray(ip.user_ns["before"]) - 2.0, rtol=1e-6)


def _write_module(tmp_path, factor):
    path = tmp_path / "adoptmod.py"
    path.write_text(f"def act(z):\n    return z * {factor}\n")
    st = os.stat(path)
    os.utime(path, (st.st_atime, st.st_mtime + 10 * factor))  # a new mtime for autoreload
    return path


@pytest.mark.parametrize("lib", ["jax", "eqx", "nnx"])
def test_a_module_file_reloaded_and_autoreloaded(ip, capsys, tmp_path, lib):
    _lib(lib)
    _write_module(tmp_path, 1.0)
    run(ip, capsys, HEAD + IMPORTS[lib] + "import adoptmod\n" + jitted(lib, "plain", "x", "adoptmod.act(x)"))
    run(ip, capsys, "before = f(X)")
    _write_module(tmp_path, 3.0)
    run(ip, capsys, "importlib.reload(adoptmod)")
    out = run(ip, capsys, "after = f(X)")
    assert [compile_line("f").match(line).group(1) for line in nitro_lines(out)] == [
        "recompiling against edited code: adoptmod.act (adoptmod.py:1; f → body → act)"], out
    np.testing.assert_allclose(ip.user_ns["after"], 3.0 * np.asarray(ip.user_ns["before"]), rtol=1e-6)
    run(ip, capsys, "%reload_ext autoreload\n%autoreload 2")
    try:
        _write_module(tmp_path, 5.0)
        out = run(ip, capsys, "later = f(X)")
        assert len(nitro_lines(out)) == 1 and "recompiling against edited code: adoptmod.act" in out, out
        np.testing.assert_allclose(ip.user_ns["later"], 5.0 * np.asarray(ip.user_ns["before"]), rtol=1e-6)
        assert traces(ip) == 3
    finally:
        run(ip, capsys, "%autoreload 0")


def test_library_functions_get_jax_s_own_object_and_the_switch_restores_the_originals(ip, capsys):
    eqx = pytest.importorskip("equinox")
    from flax import nnx

    run(ip, capsys, HEAD + "import equinox as eqx\nfrom flax import nnx\n"
        "def helper(x):\n    return x * 1.0\ng = jax.jit(helper)\nlib = jax.jit(jnp.sin)\n"
        "grad = jax.jit(jax.grad(lambda x: helper(x).sum()))\nwrapped = nnx.jit(helper)\n")
    ns = ip.user_ns
    assert type(ns["lib"]).__name__ == "PjitFunction"  # a library's function: JAX's own object
    assert type(ns["g"]).__name__ == "_Jitted" and type(ns["grad"]).__name__ == "_Jitted"
    assert type(ns["wrapped"].jitted_fn).__name__ == "_Jitted"
    honest = jax.jit
    out = run(ip, capsys, "%nitro_honest_jit off")
    assert out == "nitro_ipy: honest jax.jit is off.\n"
    assert jax.jit is not honest and jax.jit.__module__ == "jax._src.api"
    assert not getattr(eqx.filter_jit, "__nitro_honest__", False) and not getattr(jax.jit, "__nitro_honest__", False)
    # Off, the bar this exists for: plain `jax.jit` keeps the old program after the edit, and says nothing.
    run(ip, capsys, "h = jax.jit(lambda x: helper(x))\nbefore = h(X)\nw = nnx.jit(helper)")
    assert type(ns["h"]).__name__ == "PjitFunction" and type(ns["w"].jitted_fn).__name__ == "PjitFunction"
    run(ip, capsys, "def helper(x):\n    return x * 3.0\n")
    out = run(ip, capsys, "after = h(X)")
    assert nitro_lines(out) == []
    np.testing.assert_array_equal(ns["after"], ns["before"])
    # On again: it names what was jitted meanwhile, which no edit can reach.
    out = run(ip, capsys, "%nitro_honest_jit on")
    assert nitro_lines(out) == [
        "nitro_ipy: h, w: jitted before the extension loaded; re-run their cells to make them honest "
        "(an edit of what they call cannot be seen).", "nitro_ipy: honest jax.jit is on."], out
    assert getattr(jax.jit, "__nitro_honest__", False) and getattr(eqx.filter_jit, "__nitro_honest__", False)
    assert nnx.jit.__module__.startswith("flax")  # NNX's own function: its inner `jax.jit` is the honest one
    with pytest.raises(Exception, match="nitro_honest_jit"):
        ip.run_line_magic("nitro_honest_jit", "maybe")
    ip.run_line_magic("unload_ext", "nitro_ipy")
    assert not getattr(jax.jit, "__nitro_honest__", False) and not getattr(eqx.filter_jit, "__nitro_honest__", False)
    ip.run_line_magic("load_ext", "nitro_ipy")
    assert getattr(jax.jit, "__nitro_honest__", False)


def test_the_load_line_names_the_functions_jitted_before_it(capsys):
    pytest.importorskip("equinox")
    shell = InteractiveShell.instance()
    shell.reset(new_session=False)
    try:
        run(shell, capsys, HEAD + "import equinox as eqx\n"
            "def loss(x):\n    return x.sum()\n@jax.jit\ndef train_step(x):\n    return loss(x)\n"
            "evaluate = eqx.filter_jit(lambda x: loss(x))\nlibrary = jax.jit(jnp.cos)\n")
        out = run(shell, capsys, "%load_ext nitro_ipy")
        assert nitro_lines(out) == [
            "nitro_ipy: train_step, evaluate: jitted before the extension loaded; re-run their cells to make "
            "them honest (an edit of what they call cannot be seen)."], out
        out = run(shell, capsys, "%reload_ext nitro_ipy")  # said at each load, until the cells are re-run
        assert len(nitro_lines(out)) == 1
        run(shell, capsys, "@jax.jit\ndef train_step(x):\n    return loss(x)\nevaluate = eqx.filter_jit(lambda x: loss(x))")
        out = run(shell, capsys, "%reload_ext nitro_ipy")
        assert nitro_lines(out) == []
    finally:
        shell.run_line_magic("unload_ext", "nitro_ipy")
        for name in ("train_step", "evaluate", "library", "loss"):
            shell.user_ns.pop(name, None)
        shell.reset(new_session=False)


def test_through_a_real_kernel():
    """Cell files are `.../ipykernel_PID/HASH.py` in a kernel: plain `@jax.jit` is honest there too."""
    from test_kernel import Kernel, kernel_manager  # noqa: PLC0415 - the kernel tests' own client

    with kernel_manager() as km:
        km.start_kernel(cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        client = km.client()
        client.start_channels()
        try:
            client.wait_for_ready(timeout=120)
            k = Kernel(client)
            k.run("%load_ext nitro_ipy")
            k.run(HEAD + "def helper(x):\n    return x * 2.0\n@jax.jit\ndef f(x):\n    TRACES.append(1)\n"
                  "    return helper(x) + 1.0\n")
            assert k.value("f(X).tolist()") == [3.0, 3.0, 3.0]
            k.run("def helper(x):\n    return x * 100.0\n")
            messages = k.run("after = f(X).tolist()")
            said = " ".join(
                m["content"].get("text") or m["content"].get("data", {}).get("text/plain", "") for m in messages
                if m["msg_type"] in ("stream", "display_data"))
            # the edit is the kernel's 4th cell (after the load, the definitions, the first call): its cells are
            # `ipykernel_PID/HASH.py` files, numbered by IPython's compiler
            assert said.count("recompiling against edited code: __main__.helper (In [4]; f → helper)") == 1, said
            assert k.value("after") == [101.0, 101.0, 101.0]
            assert k.value("len(TRACES)") == 2
            k.run("# a comment-only cell\ndef helper(x):\n    return x * 100.0  # same code\n")
            assert k.value("(f(X).tolist(), len(TRACES))") == [[101.0, 101.0, 101.0], 2]
        finally:
            client.stop_channels()
            km.shutdown_kernel(now=True)


@pytest.mark.parametrize("lib", ["jax", "eqx", "nnx"])
def test_stats_list_the_adopted_functions_by_name(ip, capsys, lib):
    _lib(lib)
    run(ip, capsys, HEAD + IMPORTS[lib] + f"{DECORATORS[lib]['plain']}\ndef step(x):\n    return x + 1\n"
        "step(X); step(X); step(X)")
    out = run(ip, capsys, "%nitro_stats")
    assert "nitro_ipy cache: hits 2 | misses 1 | entries 1 |" in out, out
    assert re.search(r"^jit\s+__main__\.step\s+\S+\s+[\d.]+\s+[\d.]+\s+2\s+live$", out, re.M), out


def test_an_equinox_imported_after_the_switch_is_honest_too():
    code = ("import sys, nitro_ipy; nitro_ipy.set_honest_jit(True); assert 'equinox' not in sys.modules\n"
            "import equinox as eqx; assert eqx.filter_jit.__nitro_honest__\n"
            "nitro_ipy.set_honest_jit(False); assert not hasattr(eqx.filter_jit, '__nitro_honest__'); print('ok')")
    pytest.importorskip("equinox")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout == "ok\n", out.stderr


def test_jax_jit_of_a_user_function_keeps_jax_s_api(ip, capsys):
    run(ip, capsys, HEAD + "def f(x, n):\n    return x * n\ng = jax.jit(f, static_argnums=1)\n"
        "low = g.lower(X, 2).as_text()\nshape = g.eval_shape(X, 2).shape\nout = g(X, 2)\n")
    ns = ip.user_ns
    assert ns["g"].__wrapped__ is ns["f"] and "stablehlo" in ns["low"] or "func" in ns["low"]
    assert ns["shape"] == (3,)
    np.testing.assert_array_equal(ns["out"], 2 * np.ones(3))
    with pytest.raises(ValueError, match="Non-hashable static arguments"):
        ns["g"](ns["X"], np.ones(2))
    assert jax.jit.__wrapped__.__module__ == "jax._src.api"


def test_a_restarted_process_loads_an_adopted_program_without_tracing(tmp_path):
    """Plain `@jax.jit` code under the switch goes to the program store as `nitro_ipy.jit`'s does."""
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp, nitro_ipy
        from nitro_ipy._compiler import _store
        nitro_ipy.set_honest_jit(True)
        def helper(x):
            return x * 2.0
        @jax.jit
        def f(x):
            print("tracing")
            return helper(x) + 1.0
        print(float(f(jnp.ones(3))[0]), _store.loaded_count, tuple(nitro_ipy.cache_stats()))
    """)
    env = {**os.environ, "NITRO_IPY_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": os.pathsep.join(sys.path)}
    first = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    second = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert first.stdout.splitlines() == ["tracing", "3.0 0 (0, 1, 1)"], first.stdout + first.stderr
    assert second.stdout.splitlines() == ["3.0 1 (0, 1, 1)"], second.stdout + second.stderr  # no trace
