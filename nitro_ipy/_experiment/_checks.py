"""Validations of what a user hands nitro_ipy, run at setup or at trace time, each raising our error:
what is wrong, what arrived, the fix, naming the field, hook, leaf path or column.

One module so every check is found (and extended) in one place: `_binding` calls the setup checks,
`_programs`' builders the trace-time ones, the handle and the loop the rest.
"""

import inspect
from typing import NamedTuple

import jax
import numpy as np

from .._base._errors import NitroTypeError, NitroValueError
from ._fields import short_repr

ON_NONFINITE = ("raise", "skip")


def check_on_nonfinite(mode) -> str:
    """`Nitro(..., on_nonfinite=...)`: `"raise"` or `"skip"`."""
    if mode not in ON_NONFINITE:
        raise NitroValueError(
            f"`on_nonfinite` must be \"raise\" (stop at a non-finite step, keeping the last finite "
            f"parameters) or \"skip\" (skip such steps and count them); got {mode!r}."
        )
    return mode


def check_positive_int(name: str, value, also: str = "") -> None:
    """`batch_size`, `max_epochs`, `accum`, `train(epochs)`: an int (numpy's too), not a bool, at least 1."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise NitroValueError(f"`{name}` must be a positive integer{also}; got {value!r}.")


def kind(dtype) -> str:
    """numpy's kind letter of `dtype`, with `"f"` for the floats `ml_dtypes` adds (bfloat16, the float8s),
    whose own kind is `"V"`."""
    dtype = np.dtype(dtype)
    return "f" if dtype.kind == "V" and jax.numpy.issubdtype(dtype, jax.numpy.floating) else dtype.kind


def numeric_array(value) -> np.ndarray | None:
    """`value` as a numpy array when it is a number or numeric array (bool, int, float, complex, the
    `ml_dtypes` floats such as bfloat16), else None (a string, None, an object numpy cannot convert):
    what a Device field may hold."""
    try:
        arr = np.asarray(value)
    except Exception:  # noqa: BLE001 - numpy refused it: not numeric, which the caller's error says
        return None
    return arr if kind(arr.dtype) in "biufc" else None


class Source(NamedTuple):
    """Where a Device value comes from, for the words of a refusal: the field's own value at setup
    (`Nitro(e)`), `n.set(...)`, or a schedule's value at a step."""

    field: str  # "`Cls.lr`" (or "`lr`" where the user named only the field)
    origin: str  # "field" | "set" | "schedule"
    step: int | None = None

    def got(self, value) -> str:
        if self.origin == "schedule":
            return f"schedule for Device field {self.field} returned {short_repr(value)} at step {self.step}"
        return f"Device field {self.field} would be {short_repr(value)}"


def device_value(value, want: np.ndarray | None, source: Source, *, finite: bool = True) -> np.ndarray:
    """`value` as the numpy array Device field `source.field` is traced as; the one coercion of a Device
    value, whatever gives it (setup, `n.set`, a schedule, a checkpoint's recorded value).

    `want` is the field's current array (its dtype and shape), or None at setup, where the value sets
    them (numeric, JAX's canonical dtype, a Python bool stays bool). Refused, naming the field, what
    arrived and the fix: a value that is not a number or numeric array; a complex value for a real field;
    a non-finite float (it turns every parameter into NaN); another shape than the field's (a scalar
    broadcasts); a value an integer field would cut. `finite=False` leaves the finiteness to the step
    guard (`_training/_guard.py`), which checks a schedule's later values on the device, where the
    handle's `on_nonfinite=` decides what a non-finite value does.
    """
    arr = numeric_array(value)
    schedule = source.origin == "schedule"
    if arr is None:
        if want is None:
            raise NitroTypeError(
                f"Device field {source.field} must hold a number or numeric array; got "
                f"{type(value).__qualname__} ({short_repr(value)}). Mark it `GraphConst[...]` if it shapes "
                f"the graph, or `Host[...]` if compiled code does not need it."
            )
        expect = f"a {want.dtype} {'scalar' if want.shape == () else f'array of shape {want.shape}'}"
        if schedule:
            raise NitroTypeError(
                f"schedule for Device field {source.field} returned {type(value).__qualname__} "
                f"({short_repr(value)}) at step {source.step}; it must return {expect}, e.g. "
                f"`lambda step: 1e-3 * 0.99 ** step`."
            )
        raise NitroTypeError(
            f"Device field {source.field} holds a {want.dtype} array of shape {want.shape}; got "
            f"{type(value).__qualname__} ({short_repr(value)})."
        )
    if want is None:
        dtype = np.dtype(bool) if isinstance(value, bool) else jax.dtypes.canonicalize_dtype(arr.dtype)
        want = np.empty(arr.shape, dtype)
    if kind(arr.dtype) == "c" and kind(want.dtype) != "c":
        what = "returned" if schedule else "would be"
        at = f" at step {source.step}" if schedule else ""
        raise NitroTypeError(
            f"{'schedule for ' if schedule else ''}Device field {source.field} {what} a complex value "
            f"({short_repr(value)}){at}; the field is {want.dtype}: "
            f"{'return' if schedule else 'pass'} a real number (`.real`, `abs(...)`)."
        )
    if arr.shape != want.shape and arr.shape != ():  # a scalar broadcasts
        if schedule:
            expect = f"a {want.dtype} {'scalar' if want.shape == () else f'array of shape {want.shape}'}"
            raise NitroValueError(
                f"schedule for `{source.field.strip('`').rsplit('.', 1)[-1]}` returned shape {arr.shape} at "
                f"step {source.step}; the field has shape {want.shape}: return {expect}."
            )
        raise NitroValueError(
            f"Device field {source.field} has shape {want.shape}; got shape {arr.shape}. A new shape would "
            f"move the programs' keys: make a new experiment with it instead."
        )
    if finite and kind(arr.dtype) in "fc" and not np.isfinite(arr).all():
        raise NitroValueError(
            f"{source.got(value)}, which is not finite; a non-finite hyperparameter turns every parameter "
            f"into NaN. {'Return' if schedule else 'Pass'} a finite value."
        )
    cast = np.asarray(arr, want.dtype)
    if want.dtype.kind in "biu" and not np.array_equal(cast, arr):
        if schedule:
            raise NitroValueError(
                f"schedule for Device field {source.field} returned {short_repr(value)} at step "
                f"{source.step}; the field is {want.dtype} (its value was a whole number), so every step would "
                f"use {short_repr(cast.tolist())}. Give the field a float value "
                f"(`{source.field.strip('`').rsplit('.', 1)[-1]}=1.0`, not "
                f"`{source.field.strip('`').rsplit('.', 1)[-1]}=1`), or return whole numbers."
            )
        raise NitroValueError(
            f"Device field {source.field} is {want.dtype}; {short_repr(value)} would be cut to "
            f"{short_repr(cast.tolist())}. Pass a whole number."
        )
    return cast if cast.shape == want.shape else np.array(np.broadcast_to(cast, want.shape))


# ---------------------------------------------------------------- setup
def check_schedules_arg(schedules) -> dict:
    """`schedules=` is `{Device field: fn(step)}` (None for none)."""
    if schedules is None:
        return {}
    if not isinstance(schedules, dict):
        raise NitroTypeError(
            f"`schedules` must be a dict `{{device_field: fn(step) -> value}}`, e.g. "
            f"`schedules={{\"lr\": lambda step: 1e-3 * 0.99 ** step}}`; got {type(schedules).__qualname__} "
            f"({short_repr(schedules)})."
        )
    return dict(schedules)


def check_column(split: str, name: str, arr: np.ndarray, value) -> None:
    """A batch field is numeric or bool: object, string and categorical columns never reach a device."""
    if kind(arr.dtype) in "biufc":
        return
    got = getattr(value, "dtype", arr.dtype)
    raise NitroTypeError(
        f"field `{name}` of split `{split}` has dtype {got} ({short_repr(value)}); batch fields must be "
        f"numeric or bool arrays. Encode it first: `np.asarray(col, np.float32)` for numbers stored as "
        f"objects, integer codes for categories (`pandas.Categorical(col).codes`, "
        f"`np.unique(col, return_inverse=True)[1]`), or keep it out of the split."
    )


def check_optimizer(cls, tx) -> None:
    """The `optimizer` hook returns an `optax.GradientTransformation` (something with init/update)."""
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise NitroTypeError(
            f"hook `{cls.__qualname__}.optimizer` must return an `optax.GradientTransformation`; got "
            f"{type(tx).__qualname__} ({short_repr(tx)}). Return the optimizer, not its learning rate: "
            f"`def optimizer(self): return optax.adam(self.lr)`."
        )


def check_positional_not_a_field(cls, fn, hook_name: str, slot: str, splits: dict) -> None:
    """`forward(self, x)`: the slot after `self` receives `params` (or `outputs` for `loss`); a batch
    field's name there means the field was meant, and would never be sent."""
    positional = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2:
        return
    name = positional[1].name
    fields = {f for split in splits.values() for f in split}
    if name in fields and name != slot:
        want = {"forward": "forward(self, params, *, x)", "loss": "loss(self, outputs, *, y)"}.get(
            hook_name, f"{hook_name}(self, outputs, **fields)")
        raise NitroTypeError(
            f"hook `{cls.__qualname__}.{hook_name}{inspect.signature(fn)}`: its second parameter receives "
            f"the {slot}, but `{name}` is a batch field of your data. Take {slot} first and the batch "
            f"fields by keyword: `def {want}`."
        )


# ---------------------------------------------------------------- trace time
def check_loss(value, where: str = "`loss`"):
    """The loss hook returned a real scalar (traced); refused with the shape it got and the fix."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None:
        try:
            arr = np.asarray(value)
            shape, dtype = arr.shape, arr.dtype
        except Exception:
            shape = None
    if shape is None or dtype is None or np.dtype(dtype).kind not in "biuf":
        raise NitroTypeError(
            f"the {where} hook must return a real scalar; got {type(value).__qualname__} "
            f"({short_repr(value)}). Return e.g. `jnp.mean((outputs - y) ** 2)`."
        )
    if tuple(shape) != ():
        raise NitroTypeError(
            f"the {where} hook must return a scalar; got an array of shape {tuple(shape)} ({dtype}). "
            f"Reduce it over the batch: `jnp.mean(...)` (check broadcasting too: outputs (N, 1) against "
            f"targets (N,) gives (N, N))."
        )
    return value


def check_metric_result(hook_name: str, result) -> dict:
    """A metric hook returned `{name: (sum, count)}` with `count` None or of a shape `sum` divides by."""
    if not isinstance(result, dict):
        raise NitroTypeError(
            f"metric hook `{hook_name}` must return `{{name: (sum, count)}}`; got {type(result).__qualname__}."
        )
    for name, pair in result.items():
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise NitroTypeError(
                f"metric `{name}` from hook `{hook_name}` must be a `(sum, count)` pair (count None to "
                f"never divide); got {short_repr(pair)}."
            )
        s, c = pair
        if c is None:
            continue
        s_shape, c_shape = np.shape(s), np.shape(c)
        try:
            np.broadcast_shapes(s_shape, c_shape)
            ok = len(c_shape) <= len(s_shape)
        except ValueError:
            ok = False
        if not ok:
            raise NitroTypeError(
                f"metric `{name}` from hook `{hook_name}`: count of shape {c_shape} does not fit sum of "
                f"shape {s_shape}; return a count that is a scalar (`outputs.shape[0]`) or of the sum's "
                f"shape."
            )
    return result


def check_metric_sum_shape(hook_name: str, name: str, before, now) -> None:
    """Sums of one metric keep their shape from batch to batch (a per-example vector does not)."""
    if np.shape(before) != np.shape(now):
        raise NitroTypeError(
            f"metric `{name}` from hook `{hook_name}` returned a sum of shape {np.shape(now)} after "
            f"{np.shape(before)} on an earlier batch: a per-example value, whose shape follows the batch. "
            f"Reduce it over the batch (`jnp.sum(..., axis=0)`) so the sum adds up across batches."
        )


def check_metric_count(split: str, name: str, count) -> None:
    """A metric divided by a zero count would be NaN or infinite: refused, naming the metric."""
    c = np.asarray(count)
    if np.any(c == 0):
        raise NitroValueError(
            f"metric `{name}` counted 0 examples over split `{split}`, so its mean is undefined (it would "
            f"be NaN or infinite). Return `count=None` to report the sum, or check the mask it counts."
        )


def check_not_empty(split_name: str, n_rows: int, what: str) -> None:
    if n_rows == 0:
        raise NitroValueError(
            f"split `{split_name}` has 0 examples, so {what} has nothing to average (it would be NaN). "
            f"Give the split at least one example, or leave it out of `data`."
        )
