"""`nitro_ipy.jit` through a real IPython shell with the extension loaded: the corpus of edits plain
`jax.jit` misses (each must give the new result, after exactly one compile and one line naming what
changed), the no-op edits (nothing compiles), and `jax.jit`'s own behaviours (statics, donation, pytrees,
methods, composition)."""

import gc
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from IPython.core.interactiveshell import InteractiveShell

import nitro_ipy
from nitro_ipy._compiler import _cache

HEAD = """
import functools, importlib
import jax, jax.numpy as jnp, numpy as np
from jax import lax
import nitro_ipy
X = jnp.ones(3)
"""

COMPILE_LINE = re.compile(r"^nitro_ipy: compiled jit \[__main__\.f\] in [\d.]+ s \(trace [\d.]+ s, XLA [\d.]+ s\) \((.*)\)$")


def reason(match) -> str:
    """A compile line's reason without where each edit was made and the path to it (`(In [3]; f → act)`,
    checked in tests/test_adopt.py, whose cells keep their history as a notebook's do)."""
    return re.sub(r" \([^()]*\)", "", match.group(1))


@pytest.fixture
def ip(tmp_path):
    shell = InteractiveShell.instance()
    shell.reset(new_session=False)
    shell.run_line_magic("load_ext", "nitro_ipy")
    sys.path.insert(0, str(tmp_path))
    saved = dict(shell.user_ns)
    yield shell
    sys.path.remove(str(tmp_path))
    sys.modules.pop("jitmod", None)
    for name in list(shell.user_ns):
        if name not in saved:
            del shell.user_ns[name]
    shell.run_line_magic("unload_ext", "nitro_ipy")
    shell.reset(new_session=False)
    for holder, name in ((shell.InteractiveTB, "tb"), (sys, "last_traceback"), (sys, "last_value"), (sys, "last_exc")):
        if getattr(holder, name, None) is not None:
            setattr(holder, name, None)
    gc.collect()  # the cells' classes and functions hold their namespace in cycles: their programs go now


def run(ip, capsys, source: str) -> str:
    result = ip.run_cell(textwrap.dedent(source))
    out = capsys.readouterr().out
    assert result.error_in_exec is None and result.error_before_exec is None, out
    return out


def nitro_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("nitro_ipy")]


def stale_scenario(ip, capsys, defs, body, edit, why, *, factor=3.0):
    """`f` (jitted, `return <body>`) runs, `edit` runs in a cell of its own, `f` runs again: the new
    result, one compile, one line saying `why`; then a third call compiles nothing."""
    run(ip, capsys, HEAD + textwrap.dedent(defs) + f"\n@nitro_ipy.jit\ndef f(x):\n    return {body}\n")
    out = run(ip, capsys, "before = f(X)")
    assert nitro_lines(out) == [], out  # a first compile is as quiet as jax.jit's
    assert nitro_ipy.cache_stats() == (0, 1, 1)
    out = run(ip, capsys, textwrap.dedent(edit))
    assert nitro_lines(out) == [], out  # the edit itself says nothing: the next call does, once
    out = run(ip, capsys, "after = f(X)")
    lines = nitro_lines(out)
    assert len(lines) == 1, out
    match = COMPILE_LINE.match(lines[0])
    assert match is not None and reason(match) == why, lines[0]
    np.testing.assert_allclose(ip.user_ns["after"], factor * np.asarray(ip.user_ns["before"]), rtol=1e-6)
    assert nitro_ipy.cache_stats().misses == 2
    out = run(ip, capsys, "again = f(X)")
    assert nitro_lines(out) == []
    assert nitro_ipy.cache_stats().misses == 2
    np.testing.assert_allclose(ip.user_ns["again"], ip.user_ns["after"])


def test_helper_two_levels_down(ip, capsys):
    defs = "def inner(z):\n    return z * 1.0\n\ndef act(z):\n    return inner(z) + 0.0\n"
    stale_scenario(ip, capsys, defs, "act(x)", "def inner(z):\n    return z * 3.0\n",
                   "recompiling against edited code: __main__.inner")


def test_global_constant(ip, capsys):
    stale_scenario(ip, capsys, "SCALE = 1.0\n", "x * SCALE", "SCALE = 3.0",
                   "recompiling against edited code: __main__.SCALE")


def test_rebound_closure(ip, capsys):
    defs = "def make(s):\n    def scaled(z):\n        return z * s\n    return scaled\nact = make(1.0)\n"
    stale_scenario(ip, capsys, defs, "act(x)", "act = make(3.0)", "recompiling against edited code: __main__.act")


def test_partial(ip, capsys):
    defs = "def mul(z, s):\n    return z * s\nact = functools.partial(mul, s=1.0)\n"
    stale_scenario(ip, capsys, defs, "act(x)", "act = functools.partial(mul, s=3.0)",
                   "recompiling against edited code: __main__.act")


def test_lambda(ip, capsys):
    stale_scenario(ip, capsys, "act = lambda z: z * 1.0\n", "act(x)", "act = lambda z: z * 3.0",
                   "recompiling against edited code: __main__.act")


def test_helper_under_vmap(ip, capsys):
    stale_scenario(ip, capsys, "def act(z):\n    return z * 1.0\n", "jax.vmap(act)(x)",
                   "def act(z):\n    return z * 3.0\n", "recompiling against edited code: __main__.act")


def test_helper_inside_lax_scan(ip, capsys):
    defs = ("def act(z):\n    return z * 1.0\n\ndef body(c, z):\n    return c, act(z)\n")
    stale_scenario(ip, capsys, defs, "lax.scan(body, 0.0, x)[1]", "def act(z):\n    return z * 3.0\n",
                   "recompiling against edited code: __main__.act")


def test_global_array_edited_in_place(ip, capsys):
    stale_scenario(ip, capsys, "W = np.ones(3, np.float32)\n", "x * W", "W[:] = 3.0",
                   "recompiling against edited code: __main__.W")


def _write_module(tmp_path, factor):
    path = tmp_path / "jitmod.py"
    path.write_text(f"def act(z):\n    return z * {factor}\n")
    st = os.stat(path)
    os.utime(path, (st.st_atime, st.st_mtime + 10 * factor))  # a new mtime for autoreload
    return path


def test_module_file_reloaded(ip, capsys, tmp_path):
    _write_module(tmp_path, 1.0)
    run(ip, capsys, HEAD + "import jitmod\n@nitro_ipy.jit\ndef f(x):\n    return jitmod.act(x)\n")
    run(ip, capsys, "before = f(X)")
    _write_module(tmp_path, 3.0)
    out = run(ip, capsys, "same = f(X)")  # saved, not reloaded: the live code did not change
    assert "nitro_ipy: edited on disk, not loaded yet: jitmod.act." in out, out
    np.testing.assert_array_equal(ip.user_ns["same"], ip.user_ns["before"])
    assert nitro_ipy.cache_stats().misses == 1
    run(ip, capsys, "importlib.reload(jitmod)")
    out = run(ip, capsys, "after = f(X)")
    assert [reason(COMPILE_LINE.match(line)) for line in nitro_lines(out)] == [
        "recompiling against edited code: jitmod.act"], out
    np.testing.assert_allclose(ip.user_ns["after"], 3.0 * np.asarray(ip.user_ns["before"]))
    assert nitro_ipy.cache_stats().misses == 2


def test_autoreload_2(ip, capsys, tmp_path):
    _write_module(tmp_path, 1.0)
    run(ip, capsys, "%reload_ext autoreload\n%autoreload 2")
    try:
        run(ip, capsys, HEAD + "from jitmod import act\n@nitro_ipy.jit\ndef f(x):\n    return act(x)\n")
        run(ip, capsys, "before = f(X)")
        _write_module(tmp_path, 3.0)
        out = run(ip, capsys, "after = f(X)")
        assert len(nitro_lines(out)) == 1 and "recompiling against edited code:" in out, out
        np.testing.assert_allclose(ip.user_ns["after"], 3.0 * np.asarray(ip.user_ns["before"]))
        assert nitro_ipy.cache_stats().misses == 2
    finally:
        run(ip, capsys, "%autoreload 0")


@pytest.mark.parametrize(
    "edit",
    [
        "def act(z):\n    return z * SCALE\n",  # the same cell re-run
        "def act(z):\n    # a comment now\n\n    return z * SCALE  # and here\n",
        "def unrelated(z):\n    return z + 1\n",  # a function the program never calls
        "OTHER = 5\n",  # a global it never reads
        "@nitro_ipy.jit\ndef f(x):\n    return act(x)\n",  # the jitted function's own cell re-run
    ],
    ids=["rerun", "comment-only", "unused-function", "unused-global", "jit-cell-rerun"],
)
def test_no_op_edits_compile_nothing(ip, capsys, edit):
    run(ip, capsys, HEAD + "SCALE = 1.0\ndef act(z):\n    return z * SCALE\n@nitro_ipy.jit\ndef f(x):\n    return act(x)\n")
    run(ip, capsys, "before = f(X)")
    run(ip, capsys, edit)
    out = run(ip, capsys, "after = f(X); after2 = f(X)")
    assert nitro_lines(out) == [], out
    assert nitro_ipy.cache_stats() == (2, 1, 1)
    assert _cache.poisoned_entries() == []


def test_jax_jit_misses_the_same_edit(ip, capsys):
    """The bar: plain `jax.jit` keeps the old result (why this exists). The extension makes `jax.jit`
    honest too (tests/test_adopt.py): off, it is JAX's own."""
    run(ip, capsys, "%nitro_honest_jit off")
    run(ip, capsys, HEAD + "def act(z):\n    return z * 1.0\ng = jax.jit(lambda x: act(x))\nbefore = g(X)")
    run(ip, capsys, "def act(z):\n    return z * 3.0\n")
    run(ip, capsys, "after = g(X)")
    np.testing.assert_array_equal(ip.user_ns["after"], ip.user_ns["before"])


def test_undoing_an_edit_compiles_nothing(ip, capsys):
    run(ip, capsys, HEAD + "SCALE = 1.0\n@nitro_ipy.jit\ndef f(x):\n    return x * SCALE\nbefore = f(X)")
    run(ip, capsys, "SCALE = 3.0")
    run(ip, capsys, "mid = f(X)")
    run(ip, capsys, "SCALE = 1.0")
    out = run(ip, capsys, "after = f(X)")
    assert nitro_lines(out) == [], out
    np.testing.assert_array_equal(ip.user_ns["after"], ip.user_ns["before"])
    assert nitro_ipy.cache_stats().misses == 2


def test_editing_the_jitted_function_says_so(ip, capsys):
    run(ip, capsys, HEAD + "@nitro_ipy.jit\ndef f(x):\n    return x * 1.0\nbefore = f(X)")
    run(ip, capsys, "@nitro_ipy.jit\ndef f(x):\n    return x * 3.0\n")
    out = run(ip, capsys, "after = f(X)")
    assert [reason(COMPILE_LINE.match(line)) for line in nitro_lines(out)] == ["function `__main__.f` was redefined"]
    np.testing.assert_allclose(ip.user_ns["after"], 3.0 * np.asarray(ip.user_ns["before"]))


def test_new_shape_and_new_static_value_say_which_argument_moved(ip, capsys):
    run(ip, capsys, HEAD + "@functools.partial(nitro_ipy.jit, static_argnames='n')\ndef f(x, n):\n    return x * n\n")
    run(ip, capsys, "f(X, n=2)")
    out = run(ip, capsys, "f(jnp.ones(4), n=2)")
    assert [reason(COMPILE_LINE.match(line)) for line in nitro_lines(out)] == ["argument `x` shape: [3] -> [4]"]
    out = run(ip, capsys, "f(jnp.ones(4), n=5)")
    assert [reason(COMPILE_LINE.match(line)) for line in nitro_lines(out)] == ["static argument `n`: 2 -> 5"]
    out = run(ip, capsys, "f(X, n=2); f(jnp.ones(4), n=5)")
    assert nitro_lines(out) == []
    assert nitro_ipy.cache_stats() == (2, 3, 3)


def test_a_function_recompiling_on_most_calls_gets_the_loop_warning(ip, capsys):
    run(ip, capsys, HEAD + "@nitro_ipy.jit\ndef f(x):\n    return x + 1\n")
    out = run(ip, capsys, "for i in range(1, 7):\n    f(jnp.ones(i))\n")
    loops = [line for line in nitro_lines(out) if "recompile loop" in line]
    assert loops == [
        "nitro_ipy: recompile loop: `__main__.f` compiled 4 programs in 4 calls (argument `x` shape: [1] -> [4]). "
        "Each new argument shape, dtype or static value compiles a program; pad shapes to a few sizes, and pass "
        "values that vary per call as arrays rather than as static arguments."
    ], out


def test_composes_inside_grad_vmap_outer_jit_and_scan(ip, capsys):
    run(ip, capsys, HEAD + "@nitro_ipy.jit\ndef f(x):\n    return jnp.sin(x) * 2.0\n")
    run(ip, capsys, textwrap.dedent("""
        g = jax.grad(lambda x: f(x).sum())(X)
        v = jax.vmap(f)(jnp.ones((2, 3)))
        o = jax.jit(lambda x: f(x) + 1.0)(X)
        s = lax.scan(lambda c, x: (c + f(x), None), 0.0, X)[0]
    """))
    ns = ip.user_ns
    np.testing.assert_allclose(ns["g"], 2.0 * np.cos(np.ones(3)), rtol=1e-6)
    np.testing.assert_allclose(ns["v"], 2.0 * np.sin(np.ones((2, 3))), rtol=1e-6)
    np.testing.assert_allclose(ns["o"], 2.0 * np.sin(np.ones(3)) + 1.0, rtol=1e-6)
    np.testing.assert_allclose(ns["s"], 3 * 2.0 * np.sin(1.0), rtol=1e-6)
    # Inlined into the outer traces: no program of its own. (The one entry is the outer `jax.jit`'s, honest
    # under the extension: tests/test_adopt.py.)
    assert nitro_ipy.cache_stats() == (0, 1, 1)


def test_inside_an_outer_nitro_jit_its_dependencies_join_the_outer_closure(ip, capsys):
    run(ip, capsys, HEAD + textwrap.dedent("""
        def act(z):
            return z * 1.0
        @nitro_ipy.jit
        def inner(x):
            return act(x)
        @nitro_ipy.jit
        def f(x):
            return inner(x) + 0.0
        before = f(X)
    """))
    assert nitro_ipy.cache_stats() == (0, 1, 1)
    assert "__main__.act" in _cache.live_entries()[0].closure.names()
    run(ip, capsys, "def act(z):\n    return z * 3.0\n")
    out = run(ip, capsys, "after = f(X)")
    assert [reason(COMPILE_LINE.match(line)) for line in nitro_lines(out)] == [
        "recompiling against edited code: __main__.act"], out
    np.testing.assert_allclose(ip.user_ns["after"], 3.0 * np.asarray(ip.user_ns["before"]))


def test_methods_partials_keywords_pytrees_and_donation(ip, capsys):
    run(ip, capsys, HEAD + textwrap.dedent("""
        class Model:
            scale = 2.0
            @functools.partial(nitro_ipy.jit, static_argnums=0)
            def apply(self, x):
                return x * self.scale
        m = Model()
        a = m.apply(X)

        @nitro_ipy.jit
        def f(params, x, *, bias):
            return {"out": params["w"] * x + bias, "pair": (x, params["b"])}
        p = {"w": jnp.full(3, 2.0), "b": jnp.zeros(())}
        out = f(p, X, bias=1.0)
        add_one = functools.partial(f, p)
        out2 = add_one(X, bias=1.0)

        @functools.partial(nitro_ipy.jit, donate_argnums=0)
        def step(buf, x):
            return buf + x
        buf = jnp.zeros(3)
        new = step(buf, X)
    """))
    ns = ip.user_ns
    np.testing.assert_allclose(ns["a"], 2.0 * np.ones(3))
    np.testing.assert_allclose(ns["out"]["out"], 3.0 * np.ones(3))
    assert set(ns["out"]) == {"out", "pair"} and len(ns["out"]["pair"]) == 2
    np.testing.assert_allclose(ns["out2"]["out"], ns["out"]["out"])
    np.testing.assert_allclose(ns["new"], np.ones(3))
    assert nitro_ipy.cache_stats().misses == 3  # the method, f (its partial reuses it), step
    assert sorted(e.hook_names[0] for e in _cache.live_entries()) == ["__main__.Model.apply", "__main__.f",
                                                                       "__main__.step"]


def test_donation_as_jax_jit_does():
    def step(buf, x):
        return buf + x
    ours, theirs = nitro_ipy.jit(step, donate_argnums=0), jax.jit(step, donate_argnums=0)
    a, b = jnp.zeros(3), jnp.zeros(3)
    ours(a, jnp.ones(3))
    theirs(b, jnp.ones(3))
    assert a.is_deleted() == b.is_deleted()


def test_static_hashables_and_unhashable_statics_raise_as_jax_jit_does():
    def f(x, cfg):
        return x * cfg[1]
    ours, theirs = nitro_ipy.jit(f, static_argnums=1), jax.jit(f, static_argnums=1)
    np.testing.assert_allclose(ours(jnp.ones(2), ("a", 3)), theirs(jnp.ones(2), ("a", 3)))
    with pytest.raises(Exception) as theirs_err:
        theirs(jnp.ones(2), ["a", 3])
    with pytest.raises(type(theirs_err.value)) as ours_err:
        ours(jnp.ones(2), ["a", 3])
    assert str(ours_err.value) == str(theirs_err.value)
    with pytest.raises(TypeError):
        nitro_ipy.jit(3)


def test_keeps_the_wrapped_function_and_aot_methods():
    def f(x):
        """Adds one."""
        return x + 1
    jf = nitro_ipy.jit(f)
    assert jf.__wrapped__ is f and jf.__name__ == "f" and jf.__doc__ == "Adds one."
    lowered = jf.lower(jnp.ones(2))
    assert "add" in lowered.as_text()
    assert jf.trace(jnp.ones(2)).jaxpr is not None
    assert jf.eval_shape(jnp.ones(2)).shape == (2,)
    assert nitro_ipy.cache_stats() == (0, 0, 0)  # lowering is no call: nothing compiled into the cache
    np.testing.assert_allclose(jf(jnp.ones(2)), 2 * np.ones(2))
    assert nitro_ipy.cache_stats() == (0, 1, 1)


def test_nitro_stats_rows_are_named_by_the_function(ip, capsys):
    run(ip, capsys, HEAD + "@nitro_ipy.jit\ndef f(x):\n    return x + 1\nf(X); f(X); f(X)")
    out = run(ip, capsys, "%nitro_stats")
    assert "nitro_ipy cache: hits 2 | misses 1 | entries 1 |" in out, out
    assert re.search(r"^jit\s+__main__\.f\s+x\[3\]\s+[\d.]+\s+[\d.]+\s+2\s+live$", out, re.M), out


def test_a_restarted_process_loads_the_program_without_tracing(tmp_path):
    script = textwrap.dedent("""
        import jax.numpy as jnp, nitro_ipy
        from nitro_ipy._compiler import _store
        def helper(x):
            return x * 2.0
        @nitro_ipy.jit
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


def test_through_a_real_kernel():
    """Cell files are `.../ipykernel_PID/HASH.py` in a kernel: the edit is caught there too, said once."""
    from test_kernel import Kernel, kernel_manager  # noqa: PLC0415 - the kernel tests' own client

    with kernel_manager() as km:
        km.start_kernel(cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        client = km.client()
        client.start_channels()
        try:
            client.wait_for_ready(timeout=120)
            k = Kernel(client)
            k.run("%load_ext nitro_ipy")
            k.run(HEAD + "def helper(x):\n    return x * 2.0\n@nitro_ipy.jit\ndef f(x):\n    return helper(x) + 1.0\n")
            assert k.value("f(X).tolist()") == [3.0, 3.0, 3.0]
            k.run("def helper(x):\n    return x * 100.0\n")
            messages = k.run("after = f(X).tolist()")
            said = " ".join(
                m["content"].get("text") or m["content"].get("data", {}).get("text/plain", "") for m in messages
                if m["msg_type"] in ("stream", "display_data"))
            assert said.count("recompiling against edited code: __main__.helper") == 1, said
            assert k.value("after") == [101.0, 101.0, 101.0]
            assert k.value("tuple(nitro_ipy.cache_stats())") == [0, 2, 1]
        finally:
            client.stop_channels()
            km.shutdown_kernel(now=True)


def test_the_panel_shows_jitted_functions(ip, capsys):
    from nitro_ipy._notebook._panel import Panel

    panel = Panel(min_interval=0)
    panel.attach()
    try:
        run(ip, capsys, HEAD + "def helper(x):\n    return x * 2.0\n@nitro_ipy.jit\ndef f(x):\n    return helper(x)\nf(X); f(X)")
        assert panel.text().startswith("nitro_ipy panel: hits 1 | misses 1 | entries 1 | poisoned 0 | "
                                       "latest compile: jit [__main__.f] in ")
        run(ip, capsys, "def helper(x):\n    return x * 3.0\n")
        run(ip, capsys, "f(X)")
        e = panel.latest_entry
        where = re.search(r"__main__\.helper \((In \[\d+\]);", panel.text()).group(1)  # (no history: see `reason`)
        assert panel.text() == (
            f"nitro_ipy panel: hits 1 | misses 2 | entries 1 | poisoned 1 | latest compile: jit [__main__.f] in "
            f"{e.trace_s + e.compile_s:.2f} s (recompiling against edited code: __main__.helper ({where}; f → helper))")
    finally:
        panel.detach()


def test_under_disable_jit_it_runs_eagerly_and_compiles_nothing():
    jf = nitro_ipy.jit(lambda x: x * 2)
    with jax.disable_jit():
        np.testing.assert_allclose(jf(jnp.ones(2)), 2 * np.ones(2))
        jf(jnp.ones(2))
    assert nitro_ipy.cache_stats() == (0, 0, 0)
    jf(jnp.ones(2))
    assert nitro_ipy.cache_stats() == (0, 1, 1)


def test_cache_reset_makes_the_next_call_compile_afresh():
    """The escape hatch for what nothing tracks (state mutated inside an object the trace read)."""

    class Box:
        def __init__(self):
            self.scale = 2.0

        def __hash__(self):  # hashes by identity: its contents are invisible
            return id(self)

    box = Box()
    jf = nitro_ipy.jit(lambda x: x * box.scale)
    np.testing.assert_allclose(jf(jnp.ones(2)), 2 * np.ones(2))
    box.scale = 5.0
    nitro_ipy.cache_reset()
    np.testing.assert_allclose(jf(jnp.ones(2)), 5 * np.ones(2))
    assert nitro_ipy.cache_stats() == (0, 1, 1)


def test_a_handle_whose_loss_calls_a_jitted_function_sees_an_edit_below_it(ip, capsys):
    run(ip, capsys, HEAD + textwrap.dedent("""
        import dataclasses, optax
        from nitro_ipy import Device, Nitro

        def act(z):
            return z * 1.0

        @nitro_ipy.jit
        def penalty(z):
            return jnp.mean(act(z) ** 2)

        @dataclasses.dataclass
        class E:
            lr: Device[float] = 0.0

            def init(self, rng):
                return {"w": jnp.ones((2, 1))}

            def forward(self, params, *, x):
                return (x @ params["w"])[:, 0]

            def loss(self, outputs, *, y):
                return penalty(outputs - y)

            def optimizer(self):
                return optax.sgd(self.lr)

        data = {"train": {"x": np.ones((8, 2), np.float32), "y": np.zeros(8, np.float32)}}
        n = Nitro(E(), data=data, batch_size=4, progress=False)
        n.train()
    """))
    assert [e.kind for e in _cache.live_entries()] == ["grad", "opt"]  # the jitted helper is inlined
    grad = _cache.live_entries()[0]
    assert "__main__.act" in grad.closure.names()
    run(ip, capsys, "def act(z):\n    return z * 3.0\n")
    out = run(ip, capsys, "n.train()")
    assert "! this handle's compiled programs had dependency methods redefined: __main__.act (grad)" in out, out
    assert grad.poisoned


def test_a_call_that_raises_counts_nothing():
    jf = nitro_ipy.jit(lambda a, b: a @ b)
    with pytest.raises(TypeError):
        jf(jnp.ones(3), jnp.ones(4))  # JAX's own shape error, from the trace
    with pytest.raises(TypeError):
        jf(jnp.ones(3), jnp.ones(4))
    assert nitro_ipy.cache_stats() == (0, 0, 0)
    jf(jnp.ones(3), jnp.ones(3))
    jf(jnp.ones(3), jnp.ones(3))
    assert nitro_ipy.cache_stats() == (1, 1, 1)
