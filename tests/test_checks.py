"""Bad input meets our errors (what is wrong, what arrived, the fix, naming the field / hook / leaf /
column), at setup or at trace time, never a raw JAX or numpy error and never a silently wrong number."""

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest

import nitro_ipy
from nitro_ipy import Device, GraphConst, Nitro

from _experiments import Reg, data as _data  # the tiny regression most tests train, and its data




# ---------------------------------------------------------------- the loss is a real scalar
@dataclasses.dataclass
class VectorLoss(Reg):
    def loss(self, outputs, *, y):  # forgot the mean
        return (outputs - y) ** 2


@dataclasses.dataclass
class BroadcastLoss(Reg):
    def loss(self, outputs, *, y):  # mask (N,) against per-example (N, 1): (N, N), never reduced
        return jnp.where(y > -10, ((outputs - y) ** 2)[:, None], 0.0)


@pytest.mark.parametrize("cls,shape", [(VectorLoss, "(8,)"), (BroadcastLoss, "(8, 8)")])
def test_training_a_non_scalar_loss_is_our_error(cls, shape):
    n = Nitro(cls(), data={"train": _data(32)}, batch_size=8, progress=False)
    with pytest.raises(nitro_ipy.NitroTypeError, match=rf"the `loss` hook must return a scalar; got an array "
                                                       rf"of shape {re.escape(shape)} \(float32\). Reduce it "
                                                       r"over the batch: `jnp.mean\(...\)`"):
        n.train()


@pytest.mark.parametrize("cls,shape", [(VectorLoss, "(1,)"), (BroadcastLoss, "(1, 1)")])
def test_validating_a_non_scalar_loss_never_gives_a_number(cls, shape):
    n = Nitro(cls(), data={"valid": _data(20)}, batch_size=8, progress=False)
    with pytest.raises(nitro_ipy.NitroTypeError, match=rf"got an array of shape {re.escape(shape)}"):
        n.validate()


def test_a_complex_or_non_array_loss_is_refused():
    @dataclasses.dataclass
    class Complex(Reg):
        def loss(self, outputs, *, y):
            return jnp.mean(outputs - y) * 1j

    with pytest.raises(nitro_ipy.NitroTypeError, match=r"the `loss` hook must return a real scalar; got"):
        Nitro(Complex(), data={"train": _data(16)}, batch_size=8, progress=False).train()


# ---------------------------------------------------------------- metrics
def test_metric_count_shape_must_fit_the_sum():
    @dataclasses.dataclass
    class BadCount(Reg):
        def metrics(self, outputs, *, y):
            return {"mae": (np.abs(outputs - y).sum(), np.ones(3))}

    with pytest.raises(nitro_ipy.NitroTypeError, match=r"metric `mae` from hook `metrics`: count of shape \(3,\) "
                                                       r"does not fit sum of shape \(\)"):
        Nitro(BadCount(), data={"valid": _data(16)}, batch_size=8, progress=False).validate()


@pytest.mark.parametrize("residency", ["host", "device"])
def test_a_per_example_metric_on_a_ragged_split_is_named(residency):
    @dataclasses.dataclass
    class PerExample(Reg):
        @nitro_ipy.metrics(residency)
        def err(self, outputs, *, y):
            return {"err": (jnp.abs(outputs - y), None)}

    n = Nitro(PerExample(), data={"valid": _data(20)}, batch_size=8, progress=False)
    with pytest.raises(nitro_ipy.NitroTypeError, match=r"metric `err` from hook `err` returned a sum of shape "
                                                       r"\(4,\) after \(8,\) on an earlier batch"):
        n.validate()


def test_a_device_metric_that_counts_nothing_is_refused_not_inf():
    @dataclasses.dataclass
    class Masked(Reg):
        @nitro_ipy.metrics("device")
        def big(self, outputs, *, y):
            mask = y > 100.0  # never true
            return {"big_max": (jnp.log(jnp.sum(mask)), jnp.sum(mask))}

    n = Nitro(Masked(), data={"valid": _data(16)}, batch_size=8, progress=False)
    with pytest.raises(nitro_ipy.NitroValueError, match=r"metric `big_max` counted 0 examples over split `valid`"):
        n.validate()


# ---------------------------------------------------------------- signatures
def test_forward_taking_a_field_where_params_go_is_refused_at_setup():
    @dataclasses.dataclass
    class NoParams(Reg):
        def forward(self, x):
            return x.sum(1)

    with pytest.raises(nitro_ipy.NitroTypeError, match=r"hook `.*NoParams.forward\(self, x\)`: its second "
                                                       r"parameter receives the params, but `x` is a batch "
                                                       r"field .* `def forward\(self, params, \*, x\)`"):
        Nitro(NoParams(), data={"train": _data(16)})


def test_loss_without_outputs_suggests_the_loss_signature():
    @dataclasses.dataclass
    class Bare(Reg):
        def loss(self):
            return 0.0

    with pytest.raises(nitro_ipy.NitroTypeError, match=r"expected `loss\(self, outputs, \*, y\)`"):
        Nitro(Bare(), data={"train": _data(16)})


def test_optimizer_returning_a_float_is_refused_at_setup():
    @dataclasses.dataclass
    class LrOnly(Reg):
        def optimizer(self):
            return 1e-3

    with pytest.raises(nitro_ipy.NitroTypeError, match=r"hook `.*LrOnly.optimizer` must return an "
                                                       r"`optax.GradientTransformation`; got float \(0.001\)"):
        Nitro(LrOnly(), data={"train": _data(16)})


def _odd_init(leaf):
    @dataclasses.dataclass
    class Odd(Reg):
        def init(self, rng):
            return {"w1": jnp.zeros((4, 8)), "w2": jnp.zeros(8), "cfg": {"act": leaf}}

    return Odd


def test_init_leaf_that_is_neither_array_nor_static_is_named_by_path():
    with pytest.raises(nitro_ipy.NitroTypeError, match=r"^`params\['cfg'\]\['act'\]` is object \(<object "
                       r"object>\): neither an array \(trained or carried\) nor a static value"):
        Nitro(_odd_init(object())(), data={"train": _data(16)})


def test_a_string_leaf_is_static_data_in_the_key():
    # A string in params (an activation's name) is legal static data (issue 12): baked in, fingerprinted.
    Nitro(_odd_init("relu")(), data={"train": _data(16)}, batch_size=8, progress=False).train()
    Nitro(_odd_init("tanh")(), data={"train": _data(16)}, batch_size=8, progress=False).train()
    assert nitro_ipy.cache_stats().misses == nitro_ipy.cache_stats().entries == 4  # two keys of grad and opt


# ---------------------------------------------------------------- data
@pytest.mark.parametrize("column", [np.array(["a", "b"] * 8), np.array([1, "x"] * 8, dtype=object)])
def test_non_numeric_columns_are_refused_at_setup_naming_the_column(column):
    data = _data(16)
    data["label"] = column
    with pytest.raises(nitro_ipy.NitroTypeError, match=r"field `label` of split `train` has dtype .*; batch "
                                                       r"fields must be numeric or bool"):
        Nitro(Reg(), data={"train": data})


def test_empty_eval_split_is_an_error_not_nan():
    empty = {k: v[:0] for k, v in _data(4).items()}
    n = Nitro(Reg(), data={"train": _data(16), "valid": empty}, batch_size=8, progress=False)
    with pytest.raises(nitro_ipy.NitroValueError, match=r"split `valid` has 0 examples"):
        n.validate()


def test_predict_on_zero_rows_is_empty():
    n = Nitro(Reg(), data={"train": _data(16)}, batch_size=8, progress=False)
    out = n.predict({"x": np.zeros((0, 4), np.float32)})
    assert out.shape == (0,) and out.dtype == np.float32
    assert nitro_ipy.cache_stats().misses == 0  # traced for its shape, nothing compiled


# ---------------------------------------------------------------- schedules
def test_schedules_must_be_a_dict():
    with pytest.raises(nitro_ipy.NitroTypeError, match=r"`schedules` must be a dict .*; got list"):
        Nitro(Reg(), data={"train": _data(16)}, schedules=[lambda s: 1e-3])


@pytest.mark.parametrize("value,error,text", [
    (None, nitro_ipy.NitroTypeError, r"returned NoneType \(None\) at step 0; it must return a float32 scalar"),
    ("1e-3", nitro_ipy.NitroTypeError, r"returned str \('1e-3'\) at step 0"),
    (1e-3 + 1j, nitro_ipy.NitroTypeError, r"returned a complex value .* the field is float32"),
    (float("nan"), nitro_ipy.NitroValueError, r"returned nan at step 0, which is not finite"),
    ([1e-3, 1e-3], nitro_ipy.NitroValueError, r"returned shape \(2,\) at step 0; the field has shape \(\)"),
])
def test_a_schedule_is_checked_on_its_first_value_before_any_compile(value, error, text):
    n = Nitro(Reg(), data={"train": _data(16)}, batch_size=8, progress=False, schedules={"lr": lambda s: value})
    with pytest.raises(error, match=text):
        n.train()
    assert nitro_ipy.cache_stats().misses == 0


def test_a_schedule_s_scalar_broadcasts_to_an_array_field_as_set_does():
    @dataclasses.dataclass
    class Scaled(Reg):
        scale: Device[np.ndarray] = dataclasses.field(default_factory=lambda: np.ones(3, np.float32))

        def forward(self, params, *, x):
            return Reg.forward(self, params, x=x) * self.scale.mean()

    n = Nitro(Scaled(), data={"train": _data(32)}, batch_size=8, progress=False, schedules={"scale": lambda s: 0.5 + s})
    n.train()
    assert n._dev["scale"].tolist() == [3.5, 3.5, 3.5]  # the last step's (step 3) value, in every element
    assert nitro_ipy.cache_stats().misses == 2


@pytest.mark.parametrize("schedule,step", [(lambda s: 0.05, 0), (lambda s: 1.0 / (1 + s), 1)])
def test_a_schedule_cut_by_an_integer_field_is_refused_at_the_step_it_would_be(schedule, step):
    """`lr=1` makes an int32 field: a fraction would train at 0 without a word, as `n.set` already says."""
    n = Nitro(Reg(lr=1), data={"train": _data(32)}, batch_size=8, progress=False, schedules={"lr": schedule})
    with pytest.raises(nitro_ipy.NitroValueError, match=(
            rf"schedule for Device field `Reg.lr` returned {schedule(step)} at step {step}; the field is int32 "
            r"\(its value was a whole number\), so every step would use 0. Give the field a float value "
            r"\(`lr=1.0`, not `lr=1`\), or return whole numbers.")):
        n.train()
    assert n.step == step
    m = Nitro(Reg(lr=1), data={"train": _data(32)}, batch_size=8, progress=False, schedules={"lr": lambda s: 1 + s})
    m.train()  # whole numbers pass
    assert m.step == 4


# ---------------------------------------------------------------- one coercion of a Device value
# Setup, `n.set`, and a schedule's value at any step go through one coercion (`_checks.device_value`)
# with one set of rules; two of them used to skip the complex check, and setup took a NaN.
@pytest.mark.parametrize("origin", ["set", "later schedule step"])
def test_a_complex_value_for_a_real_device_field_is_refused_wherever_it_comes_from(origin):
    if origin == "set":
        n = Nitro(Reg(), data={"train": _data(32)}, batch_size=8, progress=False)
        with pytest.raises(nitro_ipy.NitroTypeError, match=(
                r"Device field `lr` would be a complex value \(\(0\.001\+1j\)\); the field is float32: pass a "
                r"real number")):
            n.set(lr=1e-3 + 1j)
        assert n._dev["lr"].dtype == np.float32
        return
    n = Nitro(Reg(), data={"train": _data(32)}, batch_size=8, progress=False,
              schedules={"lr": lambda s: 1e-3 + 1j if s == 2 else 1e-3})
    with pytest.raises(nitro_ipy.NitroTypeError, match=(
            r"schedule for Device field `Reg.lr` returned a complex value \(\(0\.001\+1j\)\) at step 2; the "
            r"field is float32: return a real number")):
        n.train()
    assert n.step == 2


def test_a_later_schedule_value_of_another_shape_is_refused_with_the_field_s_shape():
    n = Nitro(Reg(), data={"train": _data(32)}, batch_size=8, progress=False,
              schedules={"lr": lambda s: [1e-3, 1e-3] if s == 1 else 1e-3})
    with pytest.raises(nitro_ipy.NitroValueError, match=r"schedule for `lr` returned shape \(2,\) at step 1; the "
                                                       r"field has shape \(\): return a float32 scalar"):
        n.train()
    assert n.step == 1


@pytest.mark.parametrize("value", [float("nan"), float("inf"), np.array([1.0, np.nan], np.float32)])
def test_a_non_finite_device_value_is_refused_at_setup(value):
    @dataclasses.dataclass
    class Scaled(Reg):
        scale: Device[float] = 1.0

    with pytest.raises(nitro_ipy.NitroValueError, match=(
            r"Device field `.*Scaled.scale` would be .*, which is not finite; a non-finite hyperparameter "
            r"turns every parameter into NaN. Pass a finite value.")):
        Nitro(Scaled(scale=value), data={"train": _data(16)}, batch_size=8, progress=False)
    assert nitro_ipy.cache_stats().misses == 0


# ---------------------------------------------------------------- GraphConst
def test_a_nan_graphconst_float_fingerprints_by_content():
    @dataclasses.dataclass
    class NanConst(Reg):
        fill: GraphConst[float] = float("nan")

    n = Nitro(NanConst(), data={"train": _data(16)}, batch_size=8, progress=False)
    n.train()
    m = Nitro(NanConst(), data={"train": _data(16)}, batch_size=8, progress=False)
    m.train()
    s = nitro_ipy.cache_stats()
    assert s.misses == s.entries == 2  # the second handle hits: NaN is content, not identity





# ---------------------------------------------------------------- the ml_dtypes floats
@dataclasses.dataclass
class HalfIn(Reg):
    def forward(self, params, *, x):
        return Reg.forward(self, params, x=x.astype(jnp.float32))


def test_bfloat16_values_are_numbers_everywhere_a_number_is_taken():
    """bfloat16 (numpy kind "V") is a float: in a Device field, `n.set`, a schedule, a batch field, predict
    inputs, and the non-finite diagnosis."""
    bf16 = lambda a: np.asarray(a).astype(jnp.bfloat16)  # noqa: E731
    train = {"x": bf16(_data(32)["x"]), "y": _data(32)["y"]}
    n = Nitro(HalfIn(lr=jnp.asarray(1e-2, jnp.bfloat16)), data={"train": train}, batch_size=8, progress=False,
              schedules={"lr": lambda s: bf16(1e-2)})
    assert n.train()[0]["loss"] > 0
    assert n.predict({"x": train["x"][:3]}).shape == (3,)
    train["x"][0, 1] = np.nan
    m = Nitro(HalfIn(), data={"train": train}, batch_size=8, progress=False)
    m.set(lr=bf16(5e-3))
    with pytest.raises(nitro_ipy.NonFiniteLossError, match=r"field `x` \(1 non-finite: nan\)"):
        m.train()


@pytest.mark.parametrize("epochs", [0, -1, 1.5, True, "2"])
def test_train_refuses_an_epoch_count_that_is_not_a_positive_integer(epochs):
    n = Nitro(Reg(), data={"train": _data(16)}, batch_size=8, progress=False)
    with pytest.raises(nitro_ipy.NitroValueError, match=re.escape(
            f"`epochs` must be a positive integer (or None for `max_epochs`); got {epochs!r}.")):
        n.train(epochs)
    assert n.step == 0 and nitro_ipy.cache_stats().misses == 0
    assert n.train(np.int64(1))[0]["epoch"] == 1  # a numpy integer is an integer
