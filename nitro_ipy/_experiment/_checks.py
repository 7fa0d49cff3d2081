"""Validations of what a user hands nitro_ipy, run at setup or at trace time, each raising our error:
what is wrong, what arrived, the fix, naming the field, hook, leaf path or column.

One module so every check is found (and extended) in one place: `_binding` calls the setup checks,
`_programs`' builders the trace-time ones, the handle and the loop the rest.
"""

import inspect

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


def check_schedule_value(cls, name: str, fn, step: int, want: np.ndarray) -> np.ndarray:
    """The value schedule `fn` gives Device field `name` at `step`, as the field's dtype and shape;
    refused (naming the field, the value and the fix) unless it is a finite number or array of that
    shape that converts to the field's dtype without losing its kind (no complex into a float)."""
    field = f"`{cls.__qualname__}.{name}`"
    got = fn(step)  # its own exception propagates as it is: the user's traceback says the most
    arr = numeric_array(got)
    expect = f"a {want.dtype} {'scalar' if want.shape == () else f'array of shape {want.shape}'}"
    if arr is None:
        raise NitroTypeError(
            f"schedule for Device field {field} returned {type(got).__qualname__} ({short_repr(got)}) at "
            f"step {step}; it must return {expect}, e.g. `lambda step: 1e-3 * 0.99 ** step`."
        )
    if kind(arr.dtype) == "c" and kind(want.dtype) != "c":
        raise NitroTypeError(
            f"schedule for Device field {field} returned a complex value ({short_repr(got)}) at step "
            f"{step}; the field is {want.dtype}: return a real number (`.real`, `abs(...)`)."
        )
    if arr.shape != want.shape and arr.shape != ():  # a scalar broadcasts, as `n.set` does
        raise NitroValueError(
            f"schedule for `{name}` returned shape {arr.shape} at step {step}; the field has shape "
            f"{want.shape}: return {expect}."
        )
    if kind(arr.dtype) in "fc" and not np.isfinite(arr).all():
        raise NitroValueError(
            f"schedule for Device field {field} returned {short_repr(got)} at step {step}, which is not "
            f"finite; a non-finite hyperparameter turns every parameter into NaN. Return a finite value."
        )
    return check_whole(cls, name, got, np.array(np.broadcast_to(np.asarray(arr, want.dtype), want.shape)), step)


def check_whole(cls, name: str, got, value: np.ndarray, step: int) -> np.ndarray:
    """`value` (schedule `name`'s result `got` at `step`, cast to the field's dtype), refused when the
    field is an integer and the cast cut it: a field made from a whole-number value (`lr=1`) is int32,
    and `0.05` would train at 0 without a word."""
    if value.dtype.kind in "biu" and not np.array_equal(value, np.asarray(got)):
        raise NitroValueError(
            f"schedule for Device field `{cls.__qualname__}.{name}` returned {short_repr(got)} at step {step}; "
            f"the field is {value.dtype} (its value was a whole number), so every step would use "
            f"{short_repr(value.tolist())}. Give the field a float value (`{name}=1.0`, not `{name}=1`), "
            f"or return whole numbers."
        )
    return value


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
