"""Validations of what a user hands nitro_ipy, run at setup or at trace time, each raising our error:
what is wrong, what arrived, the fix, naming the field, hook, leaf path or column.

One module so every check is found (and extended) in one place: `_binding` calls the setup checks,
`_programs`' builders the trace-time ones, the handle and the loop the rest.
"""

import numpy as np

from ._errors import NitroTypeError, NitroValueError
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


def check_schedule_value(cls, name: str, fn, step: int, want: np.ndarray) -> np.ndarray:
    """The value schedule `fn` gives Device field `name` at `step`, as the field's dtype and shape;
    refused (naming the field, the value and the fix) unless it is a finite number or array of that
    shape that converts to the field's dtype without losing its kind (no complex into a float)."""
    field = f"`{cls.__qualname__}.{name}`"
    try:
        got = fn(step)
    except Exception as err:
        raise NitroValueError(
            f"schedule for Device field {field} raised at step {step}: {type(err).__name__}: {err}"
        ) from err
    arr = None
    if got is not None and not isinstance(got, (str, bytes)):
        try:
            arr = np.asarray(got)
        except Exception:
            arr = None
    expect = f"a {want.dtype} {'scalar' if want.shape == () else f'array of shape {want.shape}'}"
    if arr is None or arr.dtype.kind not in "biufc":
        raise NitroTypeError(
            f"schedule for Device field {field} returned {type(got).__qualname__} ({short_repr(got)}) at "
            f"step {step}; it must return {expect}, e.g. `lambda step: 1e-3 * 0.99 ** step`."
        )
    if arr.dtype.kind == "c" and want.dtype.kind != "c":
        raise NitroTypeError(
            f"schedule for Device field {field} returned a complex value ({short_repr(got)}) at step "
            f"{step}; the field is {want.dtype}: return a real number (`.real`, `abs(...)`)."
        )
    if arr.shape != want.shape:
        raise NitroValueError(
            f"schedule for `{name}` returned shape {arr.shape} at step {step}; the field has shape "
            f"{want.shape}: return {expect}."
        )
    if arr.dtype.kind in "fc" and not np.isfinite(arr).all():
        raise NitroValueError(
            f"schedule for Device field {field} returned {short_repr(got)} at step {step}, which is not "
            f"finite; a non-finite hyperparameter turns every parameter into NaN. Return a finite value."
        )
    return np.asarray(arr, want.dtype)
