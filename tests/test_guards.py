"""Compile guards (issue 46): `no_compiles()` and `assert_max_compiles(n)` raise at the first compile past
their bound with the compile line, cover handles, `nitro_ipy.jit` and programs compiled ahead, and count
loads from the program store apart. Exact messages and counts; compile ahead on, as for users."""

import threading

import jax.numpy as jnp
import numpy as np
import pytest

import nitro_ipy
from nitro_ipy import CompileGuardError, Nitro, assert_max_compiles, no_compiles
from nitro_ipy._training import _ahead
from tests import test_store
from tests._experiments import Reg, data

store = test_store.store  # the program store in a temporary directory (a fixture, assigned)

DATA = {"train": data(32), "valid": data(8, seed=1)}


def handle(e=None, **kw):
    return Nitro(e or Reg(), data=DATA, batch_size=8, max_epochs=1, progress=False, **kw)


def test_no_compiles_raises_at_the_first_compile_with_its_line():
    n = handle()
    with pytest.raises(CompileGuardError) as err:
        with no_compiles():
            n.train()
    text = str(err.value)
    assert text.startswith("nitro_ipy.no_compiles(): a compile inside it:\n  nitro_ipy: compiled grad [forward, loss] in "), text
    assert "before it" not in text and "loaded from the program store" not in text
    assert n.step == 0  # raised before the first step ran
    # Outside the guard it trains; then a fresh handle of the same experiment compiles nothing.
    n.train()
    _ahead.wait(60)
    with no_compiles() as guard:
        handle().train()
    assert guard.compiles == [] and guard.loads == []


def test_the_line_says_what_moved():
    handle().train()
    with pytest.raises(CompileGuardError, match=r"compiled grad \[forward, loss\] in .*\(GraphConst `hidden`: 8 -> 16"):
        with no_compiles():
            handle(Reg(hidden=16)).train()


def test_assert_max_compiles_as_a_decorator_counts_every_program_it_runs():
    @assert_max_compiles(2)
    def train_only():
        Nitro(Reg(), data={"train": DATA["train"]}, batch_size=8, max_epochs=1, progress=False).train()

    train_only()  # grad and opt: 2, the bound
    nitro_ipy.cache_reset()

    @assert_max_compiles(2)
    def train_and_validate():
        handle().train()

    with pytest.raises(CompileGuardError) as err:
        train_and_validate()  # the evaluation program is the third (compiled ahead, taken here)
    lines = str(err.value).splitlines()
    assert lines[0] == "nitro_ipy.assert_max_compiles(2): compile 3 inside it, where at most 2 may run:"
    assert lines[1].startswith("  nitro_ipy: compiled eval [forward, loss] in "), lines
    assert lines[2] == "before it:"
    assert [line.split()[2] for line in lines[3:5]] == ["grad", "opt"]


def test_jit_functions_are_guarded():
    @nitro_ipy.jit
    def double(x):
        return x * 2

    with pytest.raises(CompileGuardError, match=r"^nitro_ipy.no_compiles\(\): a compile inside it:\n  nitro_ipy: compiled jit "):
        with no_compiles():
            double(jnp.ones(3))
    with no_compiles():
        np.testing.assert_array_equal(double(jnp.ones(3)), 2 * np.ones(3))
    with assert_max_compiles(1) as guard:
        double(jnp.ones(4))  # a new shape: one compile, within the bound
    assert len(guard.compiles) == 1


def test_another_thread_s_compiles_are_not_the_guard_s():
    @nitro_ipy.jit
    def triple(x):
        return x * 3

    with no_compiles():
        worker = threading.Thread(target=triple, args=(jnp.ones(3),))
        worker.start()
        worker.join()
    assert nitro_ipy.cache_stats().misses == 1


def test_loads_from_the_store_are_counted_apart(store):
    handle().train()
    _ahead.wait(60)
    nitro_ipy.cache_reset()
    with no_compiles() as guard:
        handle().train()  # every program loads from the store: no compile
    assert len(guard.loads) == 3 and guard.compiles == []
    assert all(" from disk in " in line for line in guard.loads), guard.loads
    nitro_ipy.cache_reset()
    with pytest.raises(CompileGuardError) as err:
        with no_compiles(loads=0):
            handle().train()
    assert str(err.value).startswith(
        "nitro_ipy.no_compiles(loads=0): a load from the program store inside it:\n  nitro_ipy: compiled grad [forward, loss] from disk in ")
    nitro_ipy.cache_reset()
    with pytest.raises(CompileGuardError) as err:
        with no_compiles():
            handle(Reg(hidden=16)).train()
    assert "loaded from the program store" not in str(err.value)  # nothing loaded before the compile


def test_bad_bounds_are_refused():
    with pytest.raises(TypeError, match=r"takes a count >= 0 for `n`; got -1"):
        assert_max_compiles(-1)
    with pytest.raises(TypeError, match=r"takes a count >= 0 for `loads`; got 1.5"):
        assert_max_compiles(1, loads=1.5)
