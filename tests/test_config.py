"""JAX's configuration is in every program's key: each case compared with plain `jax.jit` under the same
configuration, in this process and across two processes sharing a store.

Cost: two child processes (about 4 s each) in `test_store_*`; the rest compiles a handful of tiny programs."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nitro_ipy
from nitro_ipy import Nitro
from nitro_ipy._base import _report
from nitro_ipy._compiler import _cache, _context
from nitro_ipy._training import _ahead


@pytest.fixture
def lines():
    got = []
    previous = _report.set_sink(got.append)
    yield lambda: [m.text for m in got]
    _report.set_sink(previous)


def make_scale():
    """A function made anew each time (a cell re-run): equal code, a new object."""

    def scale(x):
        return x * jnp.arange(3.0)  # float32 constant with x64 off, float64 with it on

    return scale


X = jnp.ones(3, jnp.float32)


# ---------------------------------------------------------------- what the key holds
def test_the_key_holds_every_entry_of_jax_trace_context_and_each_setting_moves_it():
    from jax._src import config

    here = _context.current()
    names = [n for n, _ in here.pairs]
    assert len(names) == len(config.trace_context()) + 2  # every entry JAX's jit caches key on, plus debug
    assert tuple(names) == tuple(config.trace_context_names()) + ("jax_debug_nans", "jax_debug_infs")
    assert _cache.Key("k", "o", (), ("t", ()), "", ()).context == here  # every key made carries it
    # Each boolean setting of the trace context, flipped, moves the key and is named: a new JAX adding
    # one is covered with no change here.
    flipped = 0
    for name, value in zip(config.trace_context_names(), config.trace_context()):
        state = config.config_states.get(name)
        if state is None or not isinstance(value, bool):
            continue
        with state(not value):
            moved = _context.current()
        assert moved != here, name
        assert _context.diff(here, moved) == [f"config `{name}`: {value!r} -> {not value!r}"]
        flipped += 1
    assert flipped >= 20
    for state, name in ((jax.debug_nans, "jax_debug_nans"), (jax.debug_infs, "jax_debug_infs")):
        with state(True):
            assert _context.diff(here, _context.current()) == [f"config `{name}`: False -> True"]
            assert _context.current().debug and not _context.current().storable


def test_a_setting_a_later_import_registers_leaves_the_key_until_it_is_turned_on():
    """Importing Flax registers two Pallas settings in JAX's trace context (JAX 0.12): a process that
    imported it and one that did not, under the same configuration, make the same key (and the same
    store file name); its entries are still named, and turning the new setting on moves the key. Before,
    the names fell back to positions once the context grew (`trace_context[32]: False -> True`), and the
    keys of the two processes differed."""
    from jax._src import config

    before = _context.current()
    probe = config.bool_state(name=f"jax_nitro_ipy_probe_{len(config.trace_context())}", default=False,
                              help="a setting registered after nitro_ipy was imported (tests)",
                              include_in_trace_context=True)
    after = _context.current()
    assert [n for n, _ in after.pairs][-3:] == [probe.name, "jax_debug_nans", "jax_debug_infs"]
    assert after == before and repr(after) == repr(before)
    with jax.enable_x64(True):
        assert _context.diff(after, _context.current()) == ["config `jax_enable_x64`: False -> True"]
    with probe(True):
        on = _context.current()
    assert on != after and _context.diff(after, on) == [f"config `{probe.name}`: False -> True"]


# ---------------------------------------------------------------- nitro_ipy.jit against jax.jit
def test_jit_x64_around_a_recreated_function_computes_what_jax_jit_does(lines):
    assert nitro_ipy.jit(make_scale())(X).dtype == jnp.float32
    nitro_ipy.bump_world()  # a cell ran (within one, a new function of the same code traces, as with JAX)
    held = nitro_ipy.jit(make_scale())
    held(X)  # the program above, adopted from the cache (no trace)
    with jax.enable_x64(True):
        expected = jax.jit(make_scale())(X)
        again = held(X)  # the adopted program is for x64 off: the same function compiles for x64 on
        nitro_ipy.bump_world()
        got = nitro_ipy.jit(make_scale())(X)  # adopts that one
    assert expected.dtype == got.dtype == again.dtype == jnp.float64
    np.testing.assert_array_equal(got, expected)
    assert nitro_ipy.jit(make_scale())(X).dtype == jnp.float32  # off again: the first program, reused
    assert nitro_ipy.cache_stats().misses == nitro_ipy.cache_stats().entries == 2
    assert any("(config `jax_enable_x64`: False -> True)" in line for line in lines()), lines()


def _add(x, y):
    return x + y


def test_jit_rank_promotion_raise_is_enforced_as_jax_jit_does():
    a, b = jnp.ones((2, 3)), jnp.ones(3)
    held = nitro_ipy.jit(_add)
    held(a, b)  # compiled with implicit rank promotion allowed
    with jax.numpy_rank_promotion("raise"):
        with pytest.raises(ValueError, match="jax_numpy_rank_promotion=.raise."):
            jax.jit(_add)(a, b)
        with pytest.raises(ValueError, match="jax_numpy_rank_promotion=.raise."):
            nitro_ipy.jit(_add)(a, b)  # a new jit of the same function: not served the program above
        with pytest.raises(ValueError, match="jax_numpy_rank_promotion=.raise."):
            held(a, b)
    np.testing.assert_array_equal(held(a, b), a + b)


def _log(x):
    return jnp.log(x) * 2


def _floating_point_error(call) -> str:
    with pytest.raises(FloatingPointError) as err:
        call()
    assert type(err.value) is FloatingPointError  # JAX's own, not its internal error
    return str(err.value)


def test_jit_debug_nans_raises_jax_floating_point_error_naming_the_primitive():
    bad = -jnp.ones(3)
    held = nitro_ipy.jit(_log)
    held(X)
    with jax.debug_nans(True):
        expected = _floating_point_error(lambda: jax.jit(_log)(bad))
        assert expected == "invalid value (nan) encountered in log"
        assert _floating_point_error(lambda: held(bad)) == expected  # the hot path
        nitro_ipy.jit(_log)(X)
        adopted = nitro_ipy.jit(_log)
        adopted(X)  # adopts the program compiled under debug_nans
        assert _floating_point_error(lambda: adopted(bad)) == expected
        misses = nitro_ipy.cache_stats().misses
        held(X)
        adopted(X)
        assert nitro_ipy.cache_stats().misses == misses  # the de-optimized re-runs compiled nothing


# ---------------------------------------------------------------- the handle against jax.jit
@dataclasses.dataclass
class Scaled:
    def init(self, rng):
        return {"w": jnp.ones((3,), jnp.float32)}

    def forward(self, params, *, x):
        return x * params["w"] * jnp.arange(3.0)

    def loss(self, outputs, *, y):
        return jnp.mean((jnp.log(outputs.sum(-1)) - y) ** 2)


DATA = {"train": {"x": np.ones((4, 3), np.float32), "y": np.zeros(4, np.float32)}}


def _reference(params, x):
    return Scaled().forward(params, x=x)


def test_a_handle_built_under_x64_computes_what_jax_jit_does(lines):
    x = DATA["train"]["x"]
    assert Nitro(Scaled(), data=DATA, batch_size=4).predict({"x": x}).dtype == np.float32
    with jax.enable_x64(True):
        n = Nitro(Scaled(), data=DATA, batch_size=4)
        expected = jax.jit(_reference)(n.params, x)
        got = n.predict({"x": x})
    assert expected.dtype == got.dtype == np.float64
    np.testing.assert_array_equal(got, expected)
    assert nitro_ipy.cache_stats().misses == nitro_ipy.cache_stats().entries == 2
    assert lines()[-1].endswith("(config `jax_enable_x64`: False -> True)"), lines()


def test_a_handle_under_debug_nans_raises_jax_floating_point_error_naming_the_primitive():
    bad = {"train": {"x": -np.ones((4, 3), np.float32), "y": np.zeros(4, np.float32)}}
    with jax.debug_nans(True):
        expected = _floating_point_error(lambda: jax.jit(_reference)({"w": jnp.ones(3)}, jnp.log(bad["train"]["x"])))
        assert expected == "invalid value (nan) encountered in log"
        n = Nitro(Scaled(), data=bad, batch_size=4, max_epochs=1)
        assert _floating_point_error(lambda: n.predict({"x": jnp.log(bad["train"]["x"])})) == expected
        # Training: the gradient program's loss takes a log of negative sums. JAX's error comes before
        # the handle's non-finite guard could see the step: nothing was applied.
        assert _floating_point_error(n.train) == expected
        assert n.step == 0
        np.testing.assert_array_equal(n.params["w"], np.ones(3, np.float32))


# ---------------------------------------------------------------- two processes sharing a store
CHILD = textwrap.dedent('''
    import dataclasses, json
    import jax, jax.numpy as jnp, numpy as np
    import nitro_ipy
    from nitro_ipy import Nitro

    def scale(x):
        return x * jnp.arange(3.0)

    @dataclasses.dataclass
    class Scaled:
        def init(self, rng):
            return {"w": jnp.ones((3,), jnp.float32)}

        def forward(self, params, *, x):
            return x * params["w"] * jnp.arange(3.0)

    x = np.ones((2, 3), np.float32)
    n = Nitro(Scaled())

    def run():
        mine = {"jit": nitro_ipy.jit(scale)(x).dtype.name, "predict": n.predict({"x": x}).dtype.name}
        jax_says = {"jit": jax.jit(scale)(x).dtype.name,
                    "predict": jax.jit(lambda p, x: Scaled().forward(p, x=x))(n.params, x).dtype.name}
        return {"mine": mine, "jax": jax_says, "loaded": nitro_ipy._compiler._store.loaded_count}

    result = {"default": run()}
    if jax.config.jax_enable_x64:  # the first process's configuration, in this one: its programs load
        nitro_ipy.bump_world()  # (a new cell: the jitted function looks its program up again)
        with jax.enable_x64(False):
            result["x64 off"] = run()
    print("RESULT", json.dumps(result))
''')


def _child(tmp_path, store, x64: bool):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "NITRO_IPY_CACHE_DIR": str(store), "JAX_ENABLE_X64": "1" if x64 else "0"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    compiles = [(line.split()[2], "from disk" in line) for line in lines if line.startswith("nitro_ipy: compiled ")]
    return compiles, json.loads(next(line for line in lines if line.startswith("RESULT "))[7:])


def test_store_a_program_stored_under_x64_off_is_not_loaded_under_x64_on(tmp_path):
    store = tmp_path / "cache"
    store.mkdir(mode=0o700)
    f32 = {"jit": "float32", "predict": "float32"}
    f64 = {"jit": "float64", "predict": "float64"}
    compiles, result = _child(tmp_path, store, x64=False)
    assert result == {"default": {"mine": f32, "jax": f32, "loaded": 0}}
    assert compiles == [("predict", False)]
    compiles, result = _child(tmp_path, store, x64=True)  # the same store, JAX_ENABLE_X64=1
    assert result["default"] == {"mine": f64, "jax": f64, "loaded": 0}  # compiled, not loaded
    assert result["x64 off"] == {"mine": f32, "jax": f32, "loaded": 2}  # the first process's programs
    assert compiles == [("predict", False), ("jit", True), ("predict", True)]


# ---------------------------------------------------------------- compile ahead
FACTOR = 1.0


def _times_factor(x):
    return x * FACTOR


@dataclasses.dataclass
class Factored:
    def init(self, rng):
        return {"w": jnp.ones((3,), jnp.float32)}

    def forward(self, params, *, x):
        return _times_factor(x * params["w"]) * jnp.arange(3.0)


def test_compile_ahead_never_files_a_program_traced_under_another_configuration():
    """A thread-local setting (`jax.enable_x64(True)` around the edit) is not the background thread's:
    what it would trace there is not the program the key names, so it is not compiled ahead."""
    global FACTOR
    x = np.ones((2, 3), np.float32)
    try:
        with jax.enable_x64(True):
            n = Nitro(Factored())
            n.predict({"x": x})
            FACTOR = 2.0  # an edit, then the world bumped with compile ahead, as a script would
            nitro_ipy.bump_world(ahead=True)
            assert _ahead.wait(60)
            rebuilt = n.rebuild()
            got = rebuilt.predict({"x": x})
            expected = jax.jit(lambda p, x: Factored().forward(p, x=x))(rebuilt.params, x)
    finally:
        FACTOR = 1.0
    assert got.dtype == expected.dtype == np.float64
    np.testing.assert_array_equal(got, expected)


# ---------------------------------------------------------------- JAX's persistent cache in the store
def test_jax_cache_files_at_any_depth_count_toward_the_store_cap_and_go_with_it(tmp_path):
    """On a GPU, JAX keeps XLA's autotuning cache in a directory inside its cache directory
    (`jax_persistent_cache_enable_xla_caches`): those files are inside the store's bound too."""
    from nitro_ipy._compiler import _store

    programs, nested = tmp_path / "programs", tmp_path / "xla" / "xla_gpu_per_fusion_autotune_cache_dir"
    programs.mkdir()
    nested.mkdir(parents=True)
    files = [programs / "a.nxp", tmp_path / "xla" / "k-cache", nested / "fusion.textproto", programs / "b.nxp"]
    for age, path in enumerate(files):  # oldest first
        path.write_bytes(b"x" * 1000)
        os.utime(path, (1000 + age, 1000 + age))
    assert _store.evict(str(programs), cap=2000) == 2
    assert [p.exists() for p in files] == [False, False, True, True]
    assert _store.evict(str(programs), cap=1000) == 1
    assert [p.exists() for p in files] == [False, False, False, True]


def test_compile_ahead_compiles_nothing_for_a_handle_run_under_another_configuration():
    """The handle ran under `jax.enable_x64(True)`; the edit's world bump comes from outside that block:
    a replacement traced there would be the x64-off program, which no rebuild of this handle asks for."""
    global FACTOR
    x = np.ones((2, 3), np.float32)
    try:
        with jax.enable_x64(True):
            n = Nitro(Factored())
            n.predict({"x": x})
        FACTOR = 2.0
        nitro_ipy.bump_world(ahead=True)
        assert _ahead.wait(60)
        assert nitro_ipy.cache_stats()[1:] == (1, 0)  # the edit poisoned the one program; none compiled ahead
        with jax.enable_x64(True):
            got = n.rebuild().predict({"x": x})
    finally:
        FACTOR = 1.0
    assert got.dtype == np.float64 and nitro_ipy.cache_stats().misses == 2
