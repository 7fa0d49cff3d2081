"""The device-resident step loop (issue 39): `steps_per_execution=K` runs K optimizer steps in one
`lax.scan` program with the per-step loop's results (rng, schedules, skipped steps, interrupts at K-step
granularity, exact program counts); every step program takes JAX's C++ dispatch path; the loop works
on one `_loop.StepState` and reads no private attribute of the handle."""

import ast
import dataclasses
import pathlib
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _experiments import Reg
from _experiments import data as _data

import nitro_ipy
from nitro_ipy import Nitro, TrainingInterrupted
from nitro_ipy._training import _loop

BS = 8


@dataclasses.dataclass
class Noisy(Reg):
    """`Reg` with a draw from the step's rng in every step (dropout-like), so the rng stream shows."""

    def forward(self, params, *, x, rng):
        return jnp.tanh((x + 0.3 * jax.random.normal(rng, x.shape)) @ params["w1"]) @ params["w2"]


def lr_schedule(step):
    return 1e-2 / (1 + 0.1 * step)


def trained(per_execution, data, *, epochs=1, e=None, **options):
    nitro_ipy.cache_reset()
    n = Nitro(Noisy() if e is None else e, data={"train": data}, batch_size=BS, progress=False,
              steps_per_execution=per_execution, **options)
    rows = n.train(epochs)
    return n, rows


def tol():
    return dict(rtol=1e-6, atol=1e-7) if jax.default_backend() == "cpu" else dict(rtol=1e-4, atol=1e-5)


def assert_close(a, b):
    la, lb = jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol())


@pytest.mark.parametrize("accum", [1, 2])
def test_k_steps_equal_the_per_step_loop_rng_schedules_and_epochs(accum):
    data = _data(8 * 23 * accum)  # 23 steps an epoch: 1 + 5 x 4 + 2 left over
    ref, ref_rows = trained(1, data, epochs=2, accum=accum, schedules={"lr": lr_schedule})
    n, rows = trained(4, data, epochs=2, accum=accum, schedules={"lr": lr_schedule})
    assert n.step == ref.step == 46
    assert_close(n.params, ref.params)
    assert_close(n.opt_state, ref.opt_state)
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in ref_rows], **tol())
    # the Device value after training is the last step's schedule value, as the per-step loop leaves it
    assert float(n._dev["lr"]) == float(ref._dev["lr"]) == np.float32(lr_schedule(45))


def test_k_steps_skip_the_same_non_finite_steps():
    data = _data(8 * 21)
    dirty = {k: v.copy() for k, v in data.items()}
    perm = np.random.default_rng((0, 0)).permutation(len(dirty["x"]))
    for step in (3, 7, 8, 16):  # 1-based steps of the epoch: inside K-step calls, one at a chunk's edge
        dirty["x"][perm[(step - 1) * BS], 0] = np.nan
    ref, ref_rows = trained(1, dirty, on_nonfinite="skip")
    n, rows = trained(4, dirty, on_nonfinite="skip")
    assert rows[0]["skipped"] == ref_rows[0]["skipped"] == 4
    assert_close(n.params, ref.params)
    np.testing.assert_allclose(rows[0]["loss"], ref_rows[0]["loss"], **tol())


def test_k_steps_raise_at_the_first_bad_step_with_the_last_finite_params():
    data = _data(8 * 21)
    dirty = {k: v.copy() for k, v in data.items()}
    perm = np.random.default_rng((0, 0)).permutation(len(dirty["x"]))
    dirty["x"][perm[(7 - 1) * BS], 0] = np.nan  # step 7: the 2nd K-step call's 2nd step
    errors, handles = [], []
    for k in (1, 4):
        nitro_ipy.cache_reset()
        n = Nitro(Noisy(), data={"train": dirty}, batch_size=BS, progress=False, steps_per_execution=k)
        with pytest.raises(nitro_ipy.NonFiniteLossError) as err:
            n.train()
        errors.append(str(err.value))
        handles.append(n)
    assert errors[0] == errors[1] and "at step 7 (epoch 1)" in errors[1]
    assert handles[0].step == handles[1].step == 6
    assert_close(handles[1].params, handles[0].params)


def test_exact_program_counts_with_k():
    data = _data(8 * 23)
    nitro_ipy.cache_reset()
    n = Nitro(Noisy(), data={"train": data, "valid": _data(16)}, batch_size=BS, progress=False,
              steps_per_execution=4)
    n.train(3)
    stats = nitro_ipy.cache_stats()
    # grad + opt (an epoch's first step and the 2 left over), the 4-step program, eval: one compile each
    assert stats.misses == stats.entries == 4
    assert sorted(k.kind for k in n._programs) == ["eval", "grad", "opt", "steps"]
    # every call a hit but each program's first: per epoch 3 grad and 3 opt calls (step one, the 2 left
    # over), 5 K-step calls, 2 eval batches
    grad = opt = 3 * 3 - 1
    steps, evals = 3 * 5 - 1, 3 * 2 - 1
    assert stats.hits == grad + opt + steps + evals == 35
    # K dividing what follows the first step: no remainder, still the per-step pair for step one
    nitro_ipy.cache_reset()
    n = Nitro(Noisy(), data={"train": _data(8 * 9)}, batch_size=BS, progress=False, steps_per_execution=4)
    n.train(2)
    assert nitro_ipy.cache_stats().misses == 3 and n.step == 18


def test_k_steps_interrupt_between_calls_and_resume_to_the_same_params():
    data = _data(8 * 23)
    ref, _ = trained(1, data, epochs=2, schedules={"lr": lr_schedule})
    fired = []

    def lr(step):
        if step == 14 and not fired:  # asked while the host stacks steps 13..16's values
            fired.append(step)
            signal.raise_signal(signal.SIGINT)
        return lr_schedule(step)

    nitro_ipy.cache_reset()
    n = Nitro(Noisy(), data={"train": data}, batch_size=BS, progress=False, steps_per_execution=4,
              schedules={"lr": lr})
    with pytest.raises(TrainingInterrupted):
        n.train(2)
    assert fired and n.step == 13 and n.epoch == 0  # step one, then three whole K-step calls: 1 + 3 x 4
    assert n._cursor == _loop.Cursor(13, n._cursor.total, 13)
    n.train(2)  # goes on from step 13, in the same order
    assert n.step == 46 and n.epoch == 2
    assert_close(n.params, ref.params)


def test_steps_per_execution_is_checked_at_setup():
    with pytest.raises(nitro_ipy.NitroValueError, match="steps_per_execution"):
        Nitro(Reg(), data={"train": _data(64)}, steps_per_execution=0)
    mesh = jax.make_mesh((1,), ("data",))
    with pytest.raises(nitro_ipy.NitroValueError, match="one device"):
        Nitro(Reg(), data={"train": _data(64)}, batch_size=8, steps_per_execution=4, mesh=mesh)


# ---------------------------------------------------------------- the C++ dispatch path
def on_fast_path(compiled) -> bool:
    """Whether an AOT `jax.stages.Compiled` that has run dispatches through JAX's C++ path: its call is
    a `PjitFunction` that cached its fast-path data. A program with host callbacks or unordered effects
    gets a Python fallback instead (`Compiled.__call__`, `MeshExecutable.create_cpp_call`)."""
    call = getattr(compiled, "_call", None)
    return type(call).__name__ == "PjitFunction" and call._cache_size() >= 1


@pytest.mark.parametrize("per_execution", [1, 4])
def test_every_step_program_takes_the_cpp_dispatch_path(per_execution):
    n, _ = trained(per_execution, _data(8 * 23), schedules={"lr": lr_schedule})
    kinds = {k.kind: e for k, e in n._programs.items()}
    assert set(kinds) == ({"grad", "opt", "steps"} if per_execution > 1 else {"grad", "opt"})
    for kind, entry in kinds.items():
        assert isinstance(entry.call, jax.stages.Compiled), kind
        assert on_fast_path(entry.call), f"the {kind} program takes JAX's slow Python dispatch path"


def test_the_fast_path_check_sees_a_host_callback():
    @dataclasses.dataclass
    class Printing(Reg):
        def loss(self, outputs, *, y):
            jax.debug.callback(lambda v: None, outputs[0])
            return jnp.mean((outputs - y) ** 2)

    nitro_ipy.cache_reset()
    n = Nitro(Printing(), data={"train": _data(64)}, batch_size=BS, progress=False)
    n.train()
    kinds = {k.kind: e for k, e in n._programs.items()}
    assert not on_fast_path(kinds["grad"].call) and on_fast_path(kinds["opt"].call)


# ---------------------------------------------------------------- one step state
def test_the_loop_reads_no_private_attribute_of_the_handle():
    """`_loop` works on the `StepState` it is given: no `n._x` access, no call back into the handle."""
    source = pathlib.Path(_loop.__file__).read_text()
    names = {node.id for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Name)}
    assert "n" not in names  # no handle variable at all
    private = [node.attr for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute)
               and isinstance(node.value, ast.Name) and node.value.id == "s" and node.attr.startswith("_")]
    assert private == []
    fields = {f.name for f in dataclasses.fields(_loop.StepState)}
    assert {"params", "model_state", "opt_state", "guard", "cursor", "dev", "step"} <= fields


def test_the_handle_owns_the_step_state_it_trains():
    n, _ = trained(1, _data(64))
    s = n._state
    assert s.params is n._params and s.opt_state is n._opt_state and s.step == n.step == 8
    assert isinstance(n._cursor, _loop.Cursor) and n._cursor == _loop.EPOCH_START
    n.step = 3
    assert s.step == 3


def test_nitro_stats_lists_the_k_step_program_and_its_calls():
    from nitro_ipy._compiler._stats import stats_table

    nitro_ipy.cache_reset()
    n = Nitro(Reg(), data={"train": _data(8 * 9)}, batch_size=BS, progress=False, steps_per_execution=4)
    n.train(1)  # 9 steps: the per-step pair once, then two 4-step calls
    table = stats_table()
    assert tuple(table.stats) == (1, 3, 3)
    rows = {r.kind: r for r in table.rows}
    assert sorted(rows) == ["grad", "opt", "steps"]
    assert rows["steps"].hooks == "forward, loss, optimizer" and rows["steps"].hits == 1
    assert "steps  forward, loss, optimizer" in repr(table)
