import dataclasses
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import rel, tol  # by backend: a GPU multiplies float32 at TF32 precision

import nitro_ipy
from nitro_ipy import GraphConst, Nitro

import _experiments  # the tiny regression most tests train, and its data
from _experiments import data as _data


@dataclasses.dataclass
class Reg(_experiments.Reg):
    notes: str = ""


@dataclasses.dataclass
class RegDeviceMetric(Reg):
    @nitro_ipy.metrics("device")
    def mae(self, outputs, *, y):
        return {"mae": (jnp.sum(jnp.abs(outputs - y)), outputs.shape[0])}


@dataclasses.dataclass
class RegHostMetric(Reg):
    def metrics(self, outputs, *, y):
        return {"mae": (np.sum(np.abs(outputs - y)), len(y))}


def _misses_entries():
    s = nitro_ipy.cache_stats()
    return s.misses, s.entries


def test_construction_compiles_nothing():
    Nitro(Reg(), data={"train": _data(64)}, batch_size=16, progress=False)
    assert nitro_ipy.cache_stats() == (0, 0, 0)


@pytest.mark.parametrize(
    "cls, splits, expected",
    [
        (Reg, ("train",), 2),  # gradient + optimizer
        (Reg, ("train", "valid"), 3),  # + evaluation forward
        (RegHostMetric, ("train", "valid"), 3),  # a host metric is part of no program
        (RegDeviceMetric, ("train", "valid"), 4),  # + one device metric program
    ],
)
def test_acceptance_counts(cls, splits, expected):
    data = {"train": _data(128), "valid": _data(64, seed=1)}
    n = Nitro(cls(), data={s: data[s] for s in splits}, batch_size=16, max_epochs=1, progress=False)
    n.train()
    assert _misses_entries() == (expected, expected)
    n.train(epochs=2)  # more steps and epochs: nothing new compiles
    assert _misses_entries() == (expected, expected)


def test_ragged_valid_split_builds_device_metric_twice_and_forward_once():
    n = Nitro(RegDeviceMetric(), data={"train": _data(128), "valid": _data(70, seed=1)}, batch_size=16,
              progress=False)
    n.train()
    assert _misses_entries() == (5, 5)
    kinds = sorted(e.kind for e in nitro_ipy._compiler._cache.live_entries())
    assert kinds == ["eval", "grad", "metric:mae", "metric:mae", "opt"]


def test_steady_state_steps_are_hits():
    n = Nitro(Reg(), data={"train": _data(160)}, batch_size=16, progress=False)
    n.train()  # 10 steps: 2 misses, then 2 hits per step
    assert nitro_ipy.cache_stats() == (18, 2, 2)


def test_each_epoch_asks_the_optimizer_executable_once_whether_it_returns_its_inputs(monkeypatch):
    # The answer is a property of the executable, worked out at its first epoch and remembered (a
    # 242-array model paid 3.3 ms at every epoch's first step); a growing state still re-keys every step.
    from nitro_ipy._training import _loop

    asked = []
    work = _loop._returns_its_inputs
    monkeypatch.setattr(_loop, "_returns_its_inputs", lambda entry: asked.append(entry.kind) or work(entry))
    n = Nitro(Reg(), data={"train": _data(64)}, batch_size=16, progress=False)
    n.train(epochs=3)
    n.rebuild().train(epochs=2)  # the same executable, under another handle
    assert asked == ["opt"]
    assert _loop.returns_its_inputs(next(e for e in nitro_ipy._compiler._cache.live_entries() if e.kind == "opt"))
    assert nitro_ipy.cache_stats() == (2 * 4 * 5 - 2, 2, 2)


def test_ragged_validation_is_exact_and_padding_invisible():
    valid = _data(70, seed=3)
    n = Nitro(RegHostMetric(), data={"train": _data(64), "valid": valid}, batch_size=16, progress=False)
    got = n.validate()
    out = np.asarray(Reg().forward(n.params, x=valid["x"]))
    assert got["loss"] == pytest.approx(float(np.mean((out - valid["y"]) ** 2)), rel=rel(1e-5))
    assert got["mae"] == pytest.approx(float(np.mean(np.abs(out - valid["y"]))), rel=rel(1e-5))
    # device metric: same value through the compiled metric program at both widths
    n2 = Nitro(RegDeviceMetric(), data={"train": _data(64), "valid": valid}, batch_size=16, progress=False)
    assert n2.validate()["mae"] == pytest.approx(got["mae"], rel=rel(1e-5))


def test_training_learns():
    n = Nitro(Reg(hidden=16, lr=3e-2), data={"train": _data(512), "valid": _data(256, seed=1)}, batch_size=32,
              max_epochs=15, progress=False)
    before = n.validate()["loss"]
    records = n.train()
    assert len(records) == 15 and records[-1]["epoch"] == 15
    after = n.validate()["loss"]
    assert after < 0.25 * before
    assert records[-1]["valid_loss"] == pytest.approx(after)


def test_rebuilt_or_fresh_handle_on_unchanged_code_compiles_nothing():
    data = {"train": _data(64), "valid": _data(32, seed=1)}
    n = Nitro(Reg(), data=data, batch_size=16, progress=False)
    n.train()
    n.rebuild().train()
    Nitro(Reg(), data=data, batch_size=16, progress=False).train()
    assert _misses_entries() == (3, 3)


def test_key_rules_graphconst_misses_device_and_host_hit():
    data = {"train": _data(64)}
    Nitro(Reg(), data=data, batch_size=16, progress=False).train()
    Nitro(Reg(lr=0.5, notes="other"), data=data, batch_size=16, progress=False).train()
    assert _misses_entries() == (2, 2)
    Nitro(Reg(hidden=4), data=data, batch_size=16, progress=False).train()
    assert _misses_entries() == (4, 4)
    why = [e.why for e in nitro_ipy._compiler._cache.live_entries() if e.kind == "grad"][-1]
    assert why.startswith("GraphConst `hidden`: 8 -> 4")


def test_rebuild_carries_state_and_leaves_old_handle_whole():
    n = Nitro(Reg(), data={"train": _data(64)}, batch_size=16, progress=False)
    n.train()
    m = n.rebuild()
    assert m.step == n.step == 4 and m.epoch == 1
    np.testing.assert_array_equal(np.asarray(m.params["w1"]), np.asarray(n.params["w1"]))
    m.train()
    n.train()  # the old handle's buffers were copied, not donated away by `m`
    assert n.step == m.step == 8


def test_rebuild_goes_through_no_private_constructor_keyword():
    with pytest.raises(TypeError):
        Nitro(Reg(), data={"train": _data(64)}, _carry=None)
    n = Nitro(Reg(), data={"train": _data(64)}, batch_size=16, progress=False)
    m = n.rebuild()
    assert m._options == n._options and m._binding is not n._binding  # re-bound, same settings


def test_interrupt_gate_holds_ctrl_c_only_while_deferred():
    from nitro_ipy._training._loop import InterruptGate

    gate = InterruptGate()
    with gate.installed():
        gate.defer = True
        os.kill(os.getpid(), signal.SIGINT)
        assert gate.pending  # held, not raised
        gate.defer = False
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs before the next bytecode


def test_every_program_key_comes_from_its_spec():
    from nitro_ipy._training._programs import SPECS

    n = Nitro(Reg(), data={"train": _data(64), "valid": _data(32, 1)}, batch_size=16, progress=False)
    n.train()
    n.predict({"x": _data(8)["x"]})
    for key in n._programs:
        spec = SPECS[key.kind.split(":")[0]]
        assert key.args[0] and [name for name, _ in key.hooks] == [h for h in spec.hooks if h in n._binding.hook_fps]
        assert [name for name, _ in key.options] == list(spec.options)


def test_accum_matches_one_big_batch():
    @dataclasses.dataclass
    class Sgd(Reg):
        def optimizer(self):
            return optax.sgd(self.lr)

    data = {"train": _data(32)}
    one = Nitro(Sgd(), data=data, batch_size=32, progress=False)
    two = Nitro(Sgd(), data=data, batch_size=16, accum=2, progress=False)
    one.train()
    two.train()
    assert one.step == two.step == 1
    for k in ("w1", "w2"):
        np.testing.assert_allclose(np.asarray(one.params[k]), np.asarray(two.params[k]), **tol(1e-5, 1e-6))
    grad_keys = [e.key for e in nitro_ipy._compiler._cache.live_entries() if e.kind == "grad"]
    assert [dict(k.options)["accum"] for k in grad_keys] == [1, 2]


def test_schedule_sets_device_field_without_recompiling():
    seen = []

    def lr(step):
        seen.append(step)
        return 0.0 if step >= 2 else 1e-2  # a Python float: coerced to the field's dtype

    n = Nitro(Reg(), data={"train": _data(96)}, batch_size=16, schedules={"lr": lr}, progress=False)
    n.train()
    assert seen == [0, 1, 2, 3, 4, 5]
    assert _misses_entries() == (2, 2)
    frozen = np.asarray(n.params["w1"]).copy()
    n.train()  # lr is 0 from step 2 on: adam with lr 0 leaves params unchanged
    np.testing.assert_array_equal(np.asarray(n.params["w1"]), frozen)
    assert _misses_entries() == (2, 2)


def test_flat_layout_keeps_optimizer_state_small():
    @dataclasses.dataclass
    class Deep(Reg):
        layers: GraphConst[int] = 20

        def init(self, rng):
            keys = jax.random.split(rng, self.layers)
            return [{"w": jax.random.normal(k, (4, 4)) * 0.3, "b": jnp.zeros(4)} for k in keys]

        def forward(self, params, *, x):
            for layer in params:
                x = jnp.tanh(x @ layer["w"] + layer["b"])
            return x.sum(-1)

    n = Nitro(Deep(), data={"train": _data(64)}, batch_size=16, progress=False)
    assert len(jax.tree.leaves(n.params)) == 40
    assert len(jax.tree.leaves(n.opt_state)) == 3  # adam: count, mu, nu, each one float32 buffer
    n.train()
    assert len(jax.tree.leaves(n.opt_state)) == 3
    tree = Nitro(Deep(), data={"train": _data(64)}, batch_size=16, progress=False, flat_params=False)
    assert len(jax.tree.leaves(tree.opt_state)) == 81


def test_predict_matches_forward_over_ragged_batches():
    n = Nitro(Reg(), data={"train": _data(64)}, batch_size=16, progress=False)
    x = _data(37, seed=5)["x"]
    out = n.predict({"x": x})
    assert out.shape == (37,)
    np.testing.assert_allclose(out, np.asarray(Reg().forward(n.params, x=x)), **tol(1e-5, 1e-6))
    n.predict({"x": x[:5]})
    assert [e.kind for e in nitro_ipy._compiler._cache.live_entries()] == ["predict"]


def test_function_forms_and_data_hook():
    @dataclasses.dataclass
    class WithData(RegHostMetric):
        def data(self):
            return {"train": _data(64), "valid": _data(32, seed=1), "test": _data(20, seed=2)}

    n = Nitro(WithData(), batch_size=16, progress=False)
    nitro_ipy.train(n)
    assert set(nitro_ipy.validate(n)) == {"loss", "mae"}
    assert nitro_ipy.evaluate(n, "test") == n.evaluate("test")
    assert nitro_ipy.predict(n, {"x": _data(3)["x"]}).shape == (3,)


def test_host_metric_sum_without_count():
    @dataclasses.dataclass
    class Confusion(Reg):
        def metrics(self, outputs, *, y):
            pred, true = (outputs > 0).astype(int), (y > 0).astype(int)
            m = np.zeros((2, 2), np.int64)
            np.add.at(m, (true, pred), 1)
            return {"confusion": (m, None)}

    valid = _data(50, seed=1)
    n = Nitro(Confusion(), data={"train": _data(64), "valid": valid}, batch_size=16, progress=False)
    m = n.validate()["confusion"]
    assert m.shape == (2, 2) and m.sum() == 50


def test_progress_reports_compiles(capsys):
    n = Nitro(Reg(), data={"train": _data(64)}, batch_size=16)
    n.train()
    out = capsys.readouterr().out
    assert "nitro_ipy: compiled grad [forward, loss] in " in out
    assert "nitro_ipy: compiled opt [optimizer] in " in out
    assert "nitro_ipy: epoch 1 | loss " in out


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_recompile_loop_is_reported_once(capsys):
    def growing():
        # A transformation whose state grows every step: the optimizer program's key moves each step.
        def init(params):
            return jnp.zeros((1,))

        def update(updates, state, params=None):
            return jax.tree.map(lambda g: -0.01 * g, updates), jnp.concatenate([state, jnp.zeros((1,))])

        return optax.GradientTransformation(init, update)

    @dataclasses.dataclass
    class Loop(Reg):
        def optimizer(self):
            return growing()

    n = Nitro(Loop(), data={"train": _data(80)}, batch_size=16, progress=False)
    n.train()
    out = capsys.readouterr().out
    assert nitro_ipy.cache_stats().misses == 1 + 5  # grad once, opt at every one of the 5 steps
    assert out.count("recompile loop") == 1
    assert "the `opt` program compiled again after step 1 (argument `opt_state` shape: [1] -> [2])" in out


# ---------------------------------------------------------------- bad input


def test_missing_hook_and_wrong_signature():
    @dataclasses.dataclass
    class NoForward:
        def init(self, rng):
            return {}

    with pytest.raises(nitro_ipy.NitroTypeError, match=r"has no `forward` hook; add `def forward\(self, params"):
        Nitro(NoForward(), data={"train": _data(16)})

    @dataclasses.dataclass
    class BadForward(Reg):
        def forward(self):
            return 0

    with pytest.raises(TypeError, match=r"hook `.*BadForward.forward\(self\)` takes too few positional"):
        Nitro(BadForward(), data={"train": _data(16)})


def test_batch_field_no_split_provides():
    @dataclasses.dataclass
    class WantsMask(Reg):
        def loss(self, outputs, *, y, mask):
            return jnp.mean(mask * (outputs - y) ** 2)

    with pytest.raises(nitro_ipy.NitroValueError) as err:
        Nitro(WantsMask(), data={"train": _data(16)})
    assert str(err.value).startswith(
        "hook `test_batch_field_no_split_provides.<locals>.WantsMask.loss` wants batch field `mask`, which "
        "split `train` does not provide (it has `x`, `y`)."
    )


def test_unequal_split_lengths():
    data = _data(16)
    data["y"] = data["y"][:10]
    with pytest.raises(nitro_ipy.NitroValueError, match=r"split `train` have different lengths \(`x`: 16, `y`: 10\)"):
        Nitro(Reg(), data={"train": data})


def test_schedule_for_non_device_field():
    with pytest.raises(nitro_ipy.NitroValueError, match=r"schedule for `hidden`, which is not a Device field"):
        Nitro(Reg(), data={"train": _data(16)}, schedules={"hidden": lambda s: 4})


def test_non_finite_loss():
    @dataclasses.dataclass
    class Explodes(Reg):
        def loss(self, outputs, *, y):
            return jnp.mean(jnp.log(outputs * 0.0))  # log(0) = -inf

    n = Nitro(Explodes(), data={"train": _data(64)}, batch_size=16, progress=False)
    with pytest.raises(nitro_ipy.NonFiniteLossError, match=r"the training loss became -inf at step 1 \(epoch 1\)"):
        n.train()


def test_interrupt_mid_epoch_leaves_handle_usable():
    def lr(step):
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while step 3 is being dispatched
        return 1e-2

    n = Nitro(Reg(), data={"train": _data(160)}, batch_size=16, schedules={"lr": lr}, progress=False)
    with pytest.raises(KeyboardInterrupt):
        n.train()
    assert n.step == 4  # the step in flight finished and stored its results
    assert not any(x.is_deleted() for x in jax.tree.leaves((n.params, n.opt_state)))
    n.train()
    assert n.step == 10  # the cut epoch went on at its 5th batch, not from its first again
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@dataclasses.dataclass
class Scaled:
    scale: GraphConst[object] = None

    def init(self, rng):
        return {"w": jnp.ones((2,))}

    def forward(self, params, *, x):
        return x @ params["w"] * self.scale[0]


def test_a_graphconst_value_mutated_in_place_is_refused_before_any_program_is_keyed_for_it():
    e = Scaled(np.array([1.0], np.float32))
    x = {"x": np.ones((4, 2), np.float32)}
    n = Nitro(e, batch_size=4, progress=False)
    e.scale[0] = 1000.0  # the key still holds [1.0]
    with pytest.raises(nitro_ipy.NitroValueError) as err:
        n.predict(x)
    assert str(err.value) == (
        "GraphConst field `scale` of `Scaled` changed in place since this handle was built "
        "(array([1.], dtype=float32) -> array([1000.], dtype=float32)); the compile key holds the value it "
        "had then, so no program can be keyed for it now. Give the experiment a new value instead "
        "(`e = dataclasses.replace(e, scale=...)`) and build a new handle (`Nitro(e, ...)`)."
    )
    assert nitro_ipy.cache_stats() == (0, 0, 0)  # nothing compiled or stored under the old key
    fresh = Nitro(e, batch_size=4, progress=False)  # a new handle keys the value it sees
    np.testing.assert_allclose(fresh.predict(x), 2000.0)
    e.scale[0] = 1.0  # back to the value the first handle was keyed for: it works again
    np.testing.assert_allclose(n.predict(x), 2.0)


def test_params_and_state_you_keep_stay_valid_while_the_handle_trains_on():
    """Steps donate the params and optimizer state: arrays a user kept from `n.params`, `n.opt_state`,
    `Nitro(e, params=...)` or IPython's `Out` are copied away from first, and only then."""
    from nitro_ipy._training import _loop

    given = jax.tree.map(jnp.asarray, Nitro(_experiments.Reg(), data={"train": _data(32)}).params)
    n = Nitro(_experiments.Reg(), data={"train": _data(32)}, batch_size=8, progress=False, params=given)
    kept_given = jax.device_get(given)
    copies = _loop.stats["copies"]
    n.train(1)
    assert _loop.stats["copies"] == copies  # `given` is the user's: the handle took its own copy at setup
    best, moments = n.params, n.opt_state
    host = jax.device_get((best, moments))
    n.train(2)
    assert _loop.stats["copies"] == copies + 1  # copied once, before the first step after the read
    for kept, want in ((given, kept_given), ((best, moments), host)):
        for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), b)  # still readable, and unchanged
    assert not np.array_equal(np.asarray(n.params["w1"]), host[0]["w1"])  # the handle trained on
    del best, moments, given
    for _ in range(3):  # a read whose result is dropped (timing an epoch, say) copies nothing
        jax.block_until_ready((n.params, n.opt_state))
        n.train(1)
    assert _loop.stats["copies"] == copies + 1
