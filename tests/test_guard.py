"""Non-finite steps never reach the parameters (`_guard`): checked on device inside the optimizer
program; the handle keeps the last finite parameters and optimizer state; the error names the step, the
cause and the fix; `on_nonfinite="skip"` skips and counts."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import nitro_ipy
from nitro_ipy import Nitro

BS = 8


from _experiments import Reg, data as _data  # the tiny regression most tests train, and its data


def row_of_step(n_rows: int, step: int, seed=0, epoch=0) -> int:
    """A row that lands in 1-based `step` of the epoch (the loop's seeded shuffle)."""
    perm = np.random.default_rng((seed, epoch)).permutation(n_rows)
    return int(perm[(step - 1) * BS])


class Stop(Exception):
    pass


def params_after(e, data, steps: int):
    """Reference: the parameters and optimizer state of a clean run stopped after `steps` steps."""
    def lr(step):
        if step == steps:
            raise Stop
        return e.lr

    n = Nitro(e, data={"train": data}, batch_size=BS, progress=False, schedules={"lr": lr})
    with pytest.raises(Stop):
        n.train()
    assert n.step == steps
    return jax.device_get((n.params, n.state))


def assert_tree_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("bad_step", [2, 5, 9])
def test_nan_batch_keeps_the_last_finite_parameters(bad_step):
    clean = _data(80)
    dirty = {k: v.copy() for k, v in clean.items()}
    dirty["x"][row_of_step(80, bad_step), 1] = np.nan
    ref_params, ref_state = params_after(Reg(), clean, bad_step - 1)
    nitro_ipy.cache_reset()
    n = Nitro(Reg(), data={"train": dirty, "valid": clean}, batch_size=BS, progress=False)
    with pytest.raises(nitro_ipy.NonFiniteLossError) as info:
        n.train()
    msg = str(info.value)
    assert msg.startswith(f"the training loss became nan at step {bad_step} (epoch 1); that step's update "
                          f"was not applied: `n.params` and the optimizer state are those after step "
                          f"{bad_step - 1}, the last finite one")
    assert "the batch's inputs are non-finite: field `x` (1 non-finite: nan)" in msg
    assert 'on_nonfinite="skip"' in msg
    assert n.step == bad_step - 1
    assert_tree_equal(jax.device_get(n.params), ref_params)
    assert_tree_equal(jax.device_get(n.state), ref_state)
    # usable afterwards: validation and predict run on the kept parameters, no new training program
    assert np.isfinite(n.validate()["loss"])
    assert np.isfinite(n.predict({"x": clean["x"][:5]})).all()
    s = nitro_ipy.cache_stats()
    assert s.misses == s.entries == 4  # grad, opt, eval, predict


def test_schedule_nan_at_a_later_step_names_the_device_field():
    lr = lambda step: float("nan") if step == 3 else 1e-2
    n = Nitro(Reg(), data={"train": _data(80)}, batch_size=BS, progress=False, schedules={"lr": lr})
    with pytest.raises(nitro_ipy.NonFiniteLossError) as info:
        n.train()
    msg = str(info.value)
    assert msg.startswith("Device field `lr` became non-finite at step 4 (epoch 1)")
    assert "Device field `lr` = nan (set by its schedule). Fix: make the schedule return a finite value at step 3." in msg
    assert n.step == 3
    assert all(np.isfinite(np.asarray(p)).all() for p in jax.tree.leaves(n.params))


def test_a_non_finite_gradient_under_a_finite_loss_names_the_parameter():
    @dataclasses.dataclass
    class SqrtAtZero(Reg):
        def loss(self, outputs, *, y):  # finite value, infinite gradient: d sqrt(u)/du at u = 0
            return jnp.mean((outputs - y) ** 2) + jnp.sqrt(jnp.sum(self_zero(outputs)))

    n = Nitro(SqrtAtZero(), data={"train": _data(40)}, batch_size=BS, progress=False)
    with pytest.raises(nitro_ipy.NonFiniteLossError) as info:
        n.train()
    msg = str(info.value)
    assert msg.startswith("the gradient of `params['w1']` became non-finite at step 1 (epoch 1)")
    assert "non-finite gradient in `params['w1']`, `params['w2']`" in msg
    assert "optax.clip_by_global_norm" in msg
    assert n.step == 0
    assert_tree_equal(jax.device_get(n.params), jax.device_get(Nitro(SqrtAtZero(), data={"train": _data(40)},
                                                                        progress=False).params))


def self_zero(outputs):
    return (outputs * 0.0) ** 2


def test_skip_counts_and_reports_the_skipped_steps(capsys):
    clean = _data(80)
    dirty = {k: v.copy() for k, v in clean.items()}
    bad = [2, 6]
    for s in bad:
        dirty["y"][row_of_step(80, s)] = np.inf
    n = Nitro(Reg(), data={"train": dirty}, batch_size=BS, on_nonfinite="skip")
    rows = n.train()
    assert rows[0]["skipped"] == 2 and np.isfinite(rows[0]["loss"])
    assert n.step == 10
    assert all(np.isfinite(np.asarray(p)).all() for p in jax.tree.leaves(n.params))
    assert "skipped 2 non-finite steps" in capsys.readouterr().out
    s = nitro_ipy.cache_stats()
    assert s.misses == s.entries == 2  # grad + opt: the check lives inside them
    # a second epoch starts its count afresh
    assert n.train()[0]["skipped"] == 2


def test_skip_gives_the_result_of_training_without_the_bad_batches():
    """Skipping a step is exactly not taking it: same params as the clean steps applied in order."""
    dirty = _data(24)
    r = row_of_step(24, 2)
    dirty["x"][r] = np.nan
    n = Nitro(Reg(), data={"train": dirty}, batch_size=BS, on_nonfinite="skip", progress=False)
    n.train()
    # by hand: steps 1 and 3 of the same shuffle with plain optax
    perm = np.random.default_rng((0, 0)).permutation(24)
    e = Reg()
    params = jax.device_get(Nitro(e, data={"train": dirty}, progress=False).params)
    tx = optax.adam(1e-2)
    flat = lambda p: jnp.concatenate([p["w1"].ravel(), p["w2"].ravel()])
    state = tx.init(flat(params))
    for s in (0, 2):
        idx = perm[s * BS:(s + 1) * BS]
        g = jax.grad(lambda p: e.loss(e.forward(p, x=dirty["x"][idx]), y=dirty["y"][idx]))(params)
        upd, state = tx.update(flat(g), state)
        params = {"w1": params["w1"] + upd[:32].reshape(4, 8), "w2": params["w2"] + upd[32:]}
    for k in params:
        np.testing.assert_allclose(np.asarray(n.params[k]), np.asarray(params[k]), rtol=1e-5, atol=1e-6)


@dataclasses.dataclass
class Normed(Reg):
    """Batch statistics as model state: a running mean of the hidden layer, updated by every training step."""

    def init(self, rng):
        return Reg.init(self, rng), {"mean": jnp.zeros(self.hidden), "seen": jnp.zeros((), jnp.int32)}

    def forward(self, params, *, x, state, train):
        h = x @ params["w1"]
        if train:
            mean, state = h.mean(0), {"mean": 0.9 * state["mean"] + 0.1 * h.mean(0), "seen": state["seen"] + 1}
        else:
            mean = state["mean"]
        return jnp.tanh(h - mean) @ params["w2"], state


@pytest.mark.parametrize("mode", ["skip", "raise"])
def test_a_bad_step_keeps_the_model_state_it_came_with(mode):
    """The step's batch statistics are as non-finite as its loss: a step the optimizer program does not
    apply leaves the model state as it was, so the handle holds the state of the last finite step too."""
    clean = _data(80)
    dirty = {k: v.copy() for k, v in clean.items()}
    dirty["x"][row_of_step(80, 10), 2] = np.nan  # the epoch's last step
    ref_params, ref_state = params_after(Normed(), clean, 9)
    n = Nitro(Normed(), data={"train": dirty, "valid": clean}, batch_size=BS, progress=False, on_nonfinite=mode)
    if mode == "raise":
        with pytest.raises(nitro_ipy.NonFiniteLossError, match=r"at step 10 \(epoch 1\)"):
            n.train()
    else:
        assert n.train()[0]["skipped"] == 1
    assert_tree_equal(n.params, ref_params)
    assert_tree_equal(n.state, ref_state)
    assert int(n.state["seen"]) == 9
    assert np.isfinite(n.validate()["loss"])


@pytest.mark.parametrize("per_execution", [1, 3])
def test_a_halting_bad_step_mid_epoch_keeps_params_and_state_of_one_step(per_execution):
    """With `"raise"` the steps dispatched after a bad one (before the loop's check) apply nothing, to the
    parameters or to the model state: the handle ends with both as they were after the last finite step,
    whatever got dispatched meanwhile (K steps a call too)."""
    clean = _data(80)
    dirty = {k: v.copy() for k, v in clean.items()}
    dirty["x"][row_of_step(80, 4), 2] = np.nan
    ref_params, ref_state = params_after(Normed(), clean, 3)
    n = Nitro(Normed(), data={"train": dirty, "valid": clean}, batch_size=BS, progress=False,
              steps_per_execution=per_execution)
    with pytest.raises(nitro_ipy.NonFiniteLossError, match=r"at step 4 \(epoch 1\)"):
        n.train()
    assert n.step == 3 and int(n.state["seen"]) == 3
    assert_tree_equal(n.params, ref_params)
    if per_execution == 1:
        assert_tree_equal(n.state, ref_state)
    else:  # steps 2 and 3 ran in the K-step program, whose fusion may round the running mean differently
        np.testing.assert_allclose(n.state["mean"], ref_state["mean"], rtol=1e-6, atol=1e-8)


def test_skipping_a_bad_step_mid_epoch_keeps_the_state_finite():
    dirty = _data(80)
    dirty["x"][row_of_step(80, 4), 0] = np.inf
    n = Nitro(Normed(), data={"train": dirty, "valid": _data(80)}, batch_size=BS, progress=False, on_nonfinite="skip")
    rows = n.train(2)
    assert [r["skipped"] for r in rows] == [1, 1]
    assert np.isfinite(np.asarray(n.state["mean"])).all() and int(n.state["seen"]) == 18
    assert all(np.isfinite(r["valid_loss"]) for r in rows)


def test_an_epoch_whose_every_step_was_skipped_reports_no_loss_rather_than_zero():
    dirty = _data(24)
    dirty["x"][:, 0] = np.nan
    n = Nitro(Reg(), data={"train": dirty, "valid": _data(24)}, batch_size=BS, on_nonfinite="skip", progress=False)
    row = n.train()[0]
    assert row["skipped"] == 3 and np.isnan(row["loss"])  # 0.0 would read as a perfect fit
    assert np.isfinite(row["valid_loss"])


def test_on_nonfinite_is_checked_at_setup():
    with pytest.raises(nitro_ipy.NitroValueError, match=r'`on_nonfinite` must be "raise" .* or "skip" .*; got \'ignore\''):
        Nitro(Reg(), data={"train": _data(16)}, on_nonfinite="ignore")


def test_rebuild_keeps_the_mode_and_training_continues_after_a_raise():
    lr = lambda step: float("inf") if step == 2 else 1e-2
    n = Nitro(Reg(), data={"train": _data(80)}, batch_size=BS, progress=False, schedules={"lr": lr})
    with pytest.raises(nitro_ipy.NonFiniteLossError):
        n.train()
    kept = jax.device_get(n.params)
    m = n.rebuild()
    assert m.step == 2 and m.on_nonfinite == "raise"
    assert_tree_equal(jax.device_get(m.params), kept)


def _observed_losses(n):
    """Wrap the handle's gradient program (the real compiled one) so each step's loss is kept, as the
    loop used to keep them on the host."""
    seen = []
    entry = next(e for e in n._programs.values() if e.kind == "grad")
    real = entry.call

    def call(*args):
        out = real(*args)
        seen.append(float(out[1]))
        return out

    entry.call = call
    return seen, lambda: setattr(entry, "call", real)


@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_the_epoch_loss_is_the_mean_of_its_finite_step_losses(mode):
    """The loss is summed on device into the guard (`_guard.loss_sum`): the epoch row's loss is the
    float64 mean of the steps' finite losses, skipped inf/NaN losses left out."""
    clean = _data(80)
    data = clean
    if mode == "skip":
        data = {k: v.copy() for k, v in clean.items()}
        data["y"][row_of_step(80, 3, epoch=1)] = np.inf
        data["x"][row_of_step(80, 7, epoch=1), 0] = np.nan
    n = Nitro(Reg(), data={"train": data}, batch_size=BS, progress=True, on_nonfinite=mode)
    n.train()  # epoch 0 compiles (and, with "skip", its rows land elsewhere in the shuffle)
    seen, restore = _observed_losses(n)
    try:
        row = n.train()[0]
    finally:
        restore()
    assert len(seen) == 10
    finite = [v for v in seen if np.isfinite(v)]
    if mode == "skip":
        assert row["skipped"] == 2 and len(finite) == 8
    assert row["loss"] == pytest.approx(np.mean(np.asarray(finite, np.float64)), rel=1e-6)


def test_the_guard_sums_losses_compensated_and_skips_non_finite_ones():
    """10 000 small losses after a large one: a plain float32 running sum loses 2% of them, the guard's
    compensated sum none; a NaN and an inf are not counted."""
    from nitro_ipy._training import _guard

    losses = np.array([1e4] + [1e-3] * 10_000 + [np.nan, np.inf], np.float32)

    @jax.jit
    def run(guard, losses):
        def one(g, loss):
            return _guard.decide(g, [loss], halt=False)[1], None
        return jax.lax.scan(one, guard, losses)[0]

    guard = jax.device_get(run(jnp.asarray(_guard.fresh(1)), losses))
    total, count = _guard.loss_sum(guard)
    assert count == 10_001 and _guard.bad_steps(guard) == 2
    assert total == pytest.approx(1e4 + 10.0, abs=1e-3)
    assert float(np.cumsum(losses[:-2], dtype=np.float32)[-1]) < 1e4 + 9.9  # what a plain sum would give


@pytest.mark.parametrize("layout", ["flat", "tree"])
def test_the_guard_s_parts_are_what_the_layout_s_ravel_gives_without_tracing_it(layout):
    from nitro_ipy._training import _guard
    from nitro_ipy._experiment._layout import FlatLayout, TreeLayout

    params = {"a": jnp.zeros((3, 2)), "b": jnp.zeros(4, jnp.bfloat16), "c": [jnp.zeros(()), jnp.zeros(5, jnp.float16)]}
    lay = (FlatLayout if layout == "flat" else TreeLayout)(params)
    traced = jax.eval_shape(lay.ravel, params)
    assert jax.tree.structure(lay.abstract(params)) == jax.tree.structure(traced)
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(lay.abstract(params))] == [
        (x.shape, x.dtype) for x in jax.tree.leaves(traced)]
    dev = {"lr": jnp.float32(0.1), "steps": jnp.int32(3)}
    assert _guard.n_parts(lay, params, dev) == len(_guard.labels(traced, dev)) == (5 if layout == "flat" else 6)
