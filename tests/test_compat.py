"""One test per JAX/XLA internal in `_compat.py`: when JAX moves one, the failing test names it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nitro_ipy._base import _compat


def _traced(fn, *args):
    return jax.jit(fn).trace(*args).jaxpr


def test_custom_derivative_wrappers_are_recognised_with_their_parts():
    @jax.custom_jvp
    def f(x):
        return x

    @jax.custom_vjp
    def g(x):
        return x

    g.defvjp(lambda x: (x, None), lambda _, ct: (ct,))
    assert _compat.is_custom_derivative(f) and _compat.is_custom_derivative(g)
    assert not _compat.is_custom_derivative(jax.jit(lambda x: x)) and not _compat.is_custom_derivative(len)
    assert f.fun is not None and g.fwd is not None and g.bwd is not None
    assert set(_compat.CUSTOM_DERIVATIVE_PARTS) == {"fun", "jvp", "fwd", "bwd"}


def test_equation_tracebacks_hand_out_this_files_code():
    def user_fn(x):
        return jnp.sin(x) * 2

    assert _compat.tracebacks_usable()
    eqn = next(iter(_compat.jaxpr_eqns([_traced(user_fn, 1.0)])))
    codes = _compat.traceback_codes(_compat.equation_traceback(eqn))
    assert user_fn.__code__ in codes


def test_jaxpr_walk_reaches_scan_cond_and_inner_jit_bodies():
    inner = jax.jit(lambda x: jnp.cos(x))

    def fn(x):
        y = jax.lax.cond(x > 0, jnp.exp, jnp.log1p, x)
        z, _ = jax.lax.scan(lambda c, _: (inner(c), None), y, None, length=2)
        return z

    names = {e.primitive.name for e in _compat.jaxpr_eqns([_traced(fn, 1.0)])}
    assert {"exp", "log1p", "cos", "cond", "scan"} <= names


def test_compiled_avals_describe_arguments_and_outputs():
    compiled = jax.jit(lambda a, b: (a + 1, b.sum())).trace(np.zeros((2, 3), np.float32), np.ones(4)).lower().compile()
    ins, outs = _compat.compiled_in_avals(compiled), _compat.compiled_out_avals(compiled)
    assert [tuple(a.shape) for a in ins] == [(2, 3), (4,)]
    assert [tuple(o.shape) for o in jax.tree.leaves(outs)] == [(2, 3), ()]


def test_unknown_compile_option_is_read_from_xlas_refusal():
    lowered = jax.jit(lambda x: x + 1).trace(1.0).lower()
    with pytest.raises(Exception) as err:
        lowered.compile(compiler_options={"nitro_ipy_no_such_option": True})
    assert _compat.unknown_compile_option(err.value) == "nitro_ipy_no_such_option"
    assert _compat.unknown_compile_option(ValueError("something else")) is None


def test_the_option_names_we_set_are_known_to_this_xla_or_dropped_cleanly():
    lowered = jax.jit(lambda x: x @ x).trace(np.ones((4, 4), np.float32)).lower()
    for name, value in ((_compat.YNN_FUSION_OPTION, ""), (_compat.OPTIMIZATION_LEVEL_OPTION, 1),
                        (_compat.FUSION_EMITTERS_OPTION, False)):
        try:
            lowered.compile(compiler_options={name: value})
        except Exception as err:  # only ever "unknown": a known option with a bad value is our bug
            assert _compat.unknown_compile_option(err) == name


def test_ambient_mesh_is_the_one_set_mesh_made_current():
    assert _compat.ambient_mesh() is None
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    with jax.set_mesh(mesh):
        assert _compat.ambient_mesh() is mesh
    assert _compat.ambient_mesh() is None
    if hasattr(jax.sharding, "use_mesh"):
        with jax.sharding.use_mesh(mesh):
            assert _compat.ambient_mesh() is mesh


def test_cpu_collectives_option_is_a_config_option():
    assert _compat.CPU_COLLECTIVES_OPTION in jax.config.values  # the two-process test sets it to "gloo"


def test_auto_axes_turns_explicit_axes_auto():
    mesh = jax.make_mesh((1,), ("data",))
    auto = _compat.auto_axes(mesh)
    assert auto.axis_names == ("data",) and list(auto.devices.flat) == list(mesh.devices.flat)
    if hasattr(jax.sharding, "AxisType"):
        assert auto.axis_types == (jax.sharding.AxisType.Auto,)
        assert _compat.auto_axes(auto) is auto


def test_serialize_compiled_round_trips_an_executable():
    from nitro_ipy._base._compat import deserialize_compiled, serialize_compiled

    compiled = jax.jit(lambda p, x: {"y": p["w"] @ x}).trace({"w": jnp.ones((2, 2))}, jnp.ones(2)).lower().compile()
    payload, in_tree, out_tree = serialize_compiled(compiled)
    assert isinstance(payload, bytes) and payload
    loaded = deserialize_compiled(payload, in_tree, out_tree)
    assert loaded({"w": jnp.eye(2) * 3}, jnp.arange(2.0))["y"].tolist() == [0.0, 3.0]


def test_compiled_device_ids_names_the_devices_a_program_was_compiled_for():
    from nitro_ipy._base._compat import compiled_device_ids, deserialize_compiled, serialize_compiled

    device = jax.devices()[-1]  # on a multi-device process, not the default one
    x = jax.device_put(jnp.ones(2), device)
    compiled = jax.jit(lambda x: x * 2).trace(x).lower().compile()
    assert compiled_device_ids(compiled) == [device.id]
    payload, in_tree, out_tree = serialize_compiled(compiled)
    loaded = deserialize_compiled(payload, in_tree, out_tree, [device.id])
    assert compiled_device_ids(loaded) == [device.id] and loaded(x).tolist() == [2.0, 2.0]


def test_enable_jax_compilation_cache_points_jax_at_a_directory_and_leaves_a_users_own(tmp_path):
    from jax._src import compilation_cache

    from nitro_ipy._base._compat import enable_jax_compilation_cache

    try:
        assert enable_jax_compilation_cache(str(tmp_path / "a")) is True
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "a")
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
        jax.jit(lambda x: x * 7 + 1)(jnp.ones(5)).block_until_ready()
        assert any((tmp_path / "a").iterdir())  # JAX wrote its cache entry there
        assert enable_jax_compilation_cache(str(tmp_path / "b")) is False  # someone else's dir: left alone
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "a")
    finally:
        jax.config.update("jax_compilation_cache_dir", None)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        compilation_cache.reset_cache()


def test_own_compile_keeps_out_of_jax_cache_and_tells_a_served_executable(tmp_path):
    from jax._src import compilation_cache

    from nitro_ipy._base._compat import enable_jax_compilation_cache, own_compile

    def lowered(k):
        return jax.jit(lambda x: jnp.sin(x) * k).lower(jnp.ones(7))

    try:
        enable_jax_compilation_cache(str(tmp_path))
        with own_compile(write_jax_cache=False) as served:
            lowered(3.0).compile()
        assert served == {"from_jax_cache": False}
        assert list(tmp_path.iterdir()) == []  # not written
        with own_compile(write_jax_cache=True) as served:
            lowered(5.0).compile()
        assert served == {"from_jax_cache": False} and len(list(tmp_path.iterdir())) == 1
        with own_compile(write_jax_cache=False) as served:
            out = lowered(5.0).compile()
        assert served == {"from_jax_cache": True}  # the same HLO: JAX's cache served it
        assert float(out(jnp.ones(7))[0]) == pytest.approx(5 * np.sin(1.0))
        lowered(5.0).compile()  # outside `own_compile`, a hit is no one's business
        with own_compile(write_jax_cache=False) as served:
            pass
        assert served == {"from_jax_cache": False}
    finally:
        jax.config.update("jax_compilation_cache_dir", None)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        compilation_cache.reset_cache()


def test_concrete_arrays_are_told_from_tracers():
    seen = []

    def fn(x):
        seen.append(_compat.is_concrete_array(x))
        return x

    jax.jit(fn).trace(np.ones(2, np.float32))
    assert seen == [False]
    assert _compat.is_concrete_array(jax.numpy.ones(2))
    assert not _compat.is_concrete_array(np.ones(2))


def test_jax_jit_is_jax_s_own_whatever_jax_jit_is_pointed_at(monkeypatch):
    own = jax.jit
    monkeypatch.setattr(jax, "jit", lambda *a, **k: pytest.fail("nitro_ipy looked jax.jit up"))
    assert _compat.jax_jit is own
    assert float(_compat.jax_jit(lambda x: x + 1)(1.0)) == 2.0


def test_trace_context_moves_with_the_configuration_jax_traces_under():
    before = _compat.trace_context()
    assert before == _compat.trace_context() and len(before) > 0
    with jax.numpy_rank_promotion("raise"):
        assert _compat.trace_context() != before
    assert _compat.trace_context() == before


def test_excluded_files_are_not_user_frames():
    from jax._src import source_info_util

    _compat.exclude_from_tracebacks(__file__ + ".excluded")
    assert not source_info_util.is_user_filename(__file__ + ".excluded")
    assert source_info_util.is_user_filename(__file__)
