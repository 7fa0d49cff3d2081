"""`nitro_ipy.jit` has `jax.jit`'s API and errors: each test here is a difference JAX's own jit tests found
(`tools/jax_jit_suite.py`), checked against `jax.jit` side by side where JAX's behaviour is the answer.

(test_jit.py holds the honesty corpus, through a real shell; these are plain calls, no shell.)"""

import functools
import gc
import logging
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nitro_ipy
from nitro_ipy._compiler import _jit


def _both(make):
    """`make(jit)` for `jax.jit` and for `nitro_ipy.jit`: (theirs, ours)."""
    return make(jax.jit), make(nitro_ipy.jit)


def test_a_jax_jit_pointed_at_nitro_ipy_jit_does_not_recurse(monkeypatch):
    # JAX's suite run through nitro_ipy, and the extension's adoption, point `jax.jit` at `nitro_ipy.jit`.
    monkeypatch.setattr(jax, "jit", nitro_ipy.jit)
    f = jax.jit(lambda x: x * 3)
    np.testing.assert_allclose(f(jnp.ones(2)), [3.0, 3.0])
    assert "mul" in f.lower(jnp.ones(2)).as_text()
    assert nitro_ipy.cache_stats().misses == 1


def test_the_function_and_what_it_holds_go_with_the_last_reference():
    # JAX's test_jit_reference_dropping: no reference cycle, so no wait for the garbage collector.
    gc.disable()
    try:
        x = jnp.ones(10)
        f = (lambda x: lambda: x)(x)
        g = nitro_ipy.jit(f)
        x = weakref.ref(x)
        g()
        g()
        del f
        assert x() is not None
        g()
        del g
        assert x() is None
    finally:
        gc.enable()


def test_every_jit_of_a_function_shares_its_traces_as_jax_jit_does():
    traces = []

    def f(x):
        traces.append(flag)
        return x + 1

    flag = True
    np.testing.assert_allclose(nitro_ipy.jit(f)(2), 3)
    flag = False  # no cell ran: JAX's cache and ours both serve the program traced before
    for _ in range(3):
        np.testing.assert_allclose(nitro_ipy.jit(f)(3), 4)  # inline, as `jax.jit(f)(x)` is written in loops
    assert traces == [True]
    nitro_ipy.jit(f, static_argnums=0)(3)  # other options: its own trace, as with JAX
    assert traces == [True, False]
    assert nitro_ipy.cache_stats().misses == 2
    assert len([k for k in _jit._shared if k == id(f)]) == 1
    ref, _ = _jit._shared[id(f)]
    del f
    gc.collect()
    # This function's shared state let go of it (other tests' functions named `f` may still be alive).
    assert ref() is None and all(r is not ref for r, _ in _jit._shared.values())


def test_decoration_raises_jax_s_own_errors():
    def gen(x):
        yield x

    method = staticmethod(lambda x: x)
    cases = {
        "generator": lambda jit: jit(gen),
        "not callable": lambda jit: jit(3),
        "staticmethod": lambda jit: jit(method),  # (one object: JAX's message shows its repr)
        "static and donated names intersect": lambda jit: jit(lambda x: x, static_argnames="x", donate_argnames="x"),
        "static and donated numbers intersect": lambda jit: jit(lambda x: x, static_argnums=0, donate_argnums=0),
    }
    for name, case in cases.items():
        with pytest.raises(Exception) as theirs:
            case(jax.jit)
        with pytest.raises(type(theirs.value)) as ours:
            case(nitro_ipy.jit)
        assert str(ours.value) == str(theirs.value), name


def test_a_callable_that_cannot_be_weakly_referenced_fails_at_the_call_as_with_jax():
    class Slots:
        __slots__ = ()

        def __call__(self, x):
            return x + 1

    f = nitro_ipy.jit(Slots())  # building it does not fail (nor crash: a second `jax.jit` of it would)
    with pytest.raises(TypeError, match="cannot create weak reference"):
        f(1)


def test_keyword_and_positional_calls_trace_as_jax_jit_does():
    def traces(jit):
        side = []

        def f(x, y, z):
            side.append(isinstance(y, jax.core.Tracer))
            return 100 * x + 10 * y + z

        g = jit(f)
        out = [g(1, 2, 3), g(1, 2, 3), g(1, 2, z=3), g(1, 2, z=3), g(1, y=2, z=3)]
        assert [int(o) for o in out] == [123] * 5
        counts = len(side)
        side.clear()
        h = jit(lambda x, y: f(x, y, 0), static_argnums=1, static_argnames=())  # `y` static by position only
        h(1, 2)
        h(1, y=2)  # by keyword, `y` is traced, as JAX reads it
        return counts, side

    theirs, ours = _both(traces)
    assert theirs == ours == (3, [False, True])


def test_cache_size_and_clear_cache_as_jax_jit_has_them():
    traces = []

    def f(x, y):
        traces.append(1)
        return x + y

    g = nitro_ipy.jit(f)
    assert g._cache_size() == 0
    for _ in range(3):
        g(1, 2)
    assert g._cache_size() == 1 and len(traces) == 1 and nitro_ipy.cache_stats().entries == 1
    client = jax.devices()[0].client
    gc.collect()
    live = len(client.live_executables())
    g.clear_cache()
    gc.collect()
    assert len(client.live_executables()) < live  # the executable went (ours held it too)
    assert g._cache_size() == 0 and nitro_ipy.cache_stats().entries == 0
    g(1, 2)
    assert len(traces) == 2


def test_repr_attributes_and_names_are_jax_jit_s():
    def f(x: int) -> int:
        """Doc of f."""
        return x + 1

    f.some_value = 4
    theirs, ours = _both(lambda jit: jit(f))
    assert repr(ours) == repr(theirs) == f"<PjitFunction of {f!r}>"
    for attr in ("__doc__", "__name__", "__module__", "__qualname__", "__annotations__", "some_value"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    part = functools.partial(f)
    assert _both(lambda jit: jit(part).__getstate__()["function_name"]) == ("f", "f")
    # Called inside an outer trace, the equation (and the lowered module) is named after the function.
    names = _both(lambda jit: [e.params["name"] for e in jax.make_jaxpr(jit(part))(1).eqns])
    assert names[0] == names[1] == ["f"]
    assert "jit_f" in nitro_ipy.jit(part).lower(1).as_text()


def _helper(x):
    return x * 2


def _edited_helper(x):
    return x * 100


def test_lower_and_eval_shape_share_the_call_s_trace_and_an_edit_below_is_still_seen(monkeypatch):
    traces = []

    def f(x):
        traces.append(1)
        return _helper(x) + 1

    g = nitro_ipy.jit(f)
    assert g.eval_shape(jnp.ones(3)).shape == (3,)
    g.lower(jnp.ones(3))
    np.testing.assert_allclose(g(jnp.ones(3)), [3.0] * 3)
    assert len(traces) == 1  # one trace, shared by eval_shape, lower and the call, as with `jax.jit`
    assert nitro_ipy.cache_stats() == (0, 1, 1)  # the call's program is in the cache, with its closure
    monkeypatch.setitem(globals(), "_helper", _edited_helper)  # the edit
    nitro_ipy.bump_world()
    np.testing.assert_allclose(g(jnp.ones(3)), [101.0] * 3)
    assert len(traces) == 2


def test_an_adopted_program_is_not_served_under_another_configuration():
    def make():
        def add(x, y):
            return x + y
        return add

    x, y = jnp.ones((2, 3)), jnp.ones(3)
    nitro_ipy.jit(make())(x, y)  # compiled with rank promotion allowed
    nitro_ipy.bump_world()  # a cell ran
    again = nitro_ipy.jit(make())  # the same code again (a cell re-run): its program is adopted, no trace
    again(x, y)
    assert nitro_ipy.cache_stats().misses == 1 and type(again._s.call).__name__ == "Pinned"
    with jax.numpy_rank_promotion("raise"):
        with pytest.raises(ValueError) as ours:
            again(x, y)
        with pytest.raises(ValueError) as theirs:
            jax.jit(make())(x, y)
    assert str(ours.value) == str(theirs.value)
    np.testing.assert_allclose(again(x, y), 2 * np.ones((2, 3)))  # allowed again: JAX's program serves


def test_a_new_function_of_the_same_code_traces_as_with_jax_until_a_cell_runs():
    def make():
        def f(x):
            return x + 1
        return f

    for _ in range(2):  # one cell (or a script): each new function traces and compiles, as with `jax.jit`
        nitro_ipy.jit(make())(1)
    assert nitro_ipy.cache_stats() == (0, 2, 1)
    nitro_ipy.bump_world()  # the cell runs again: the same code's program is served, nothing compiles
    nitro_ipy.jit(make())(1)
    assert nitro_ipy.cache_stats() == (1, 2, 1)


def test_cache_miss_explanations_point_at_the_user_s_line(caplog):
    def double(x):
        return 2 * x

    f = nitro_ipy.jit(double)
    with jax.explain_cache_misses(True), caplog.at_level(logging.WARNING):
        f(jnp.ones(2))
        f(jnp.ones(3))  # a new shape: JAX explains the miss
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert text.count("TRACING CACHE MISS at ") == 2 and text.count("test_jit_api.py:") >= 3, text
    assert "_jit.py" not in text.replace("test_jit_api.py", ""), text
