"""The optimizer at setup: refused where it would mean something else on the flat layout, or where a
Device field reaches a constructor that needs a Python number; then its initial state.

Both checks run before anything compiles, so the user sees the fix, not a trace.
"""

import types

import jax
import numpy as np

from ._checks import check_optimizer
from ._errors import NitroTypeError, NitroValueError

# Closure cells optax's path-aware transformations keep (`optax.masked`, `add_decayed_weights(mask=)`,
# `adamw(mask=)`, `multi_transform(param_labels=)`): on flat buffers they would see `{dtype: buffer}`.
_PATH_CELLS = ("mask", "param_labels")

FLAT_PATHS = (
    "the optimizer of `{owner}` looks at parameter paths (`{cell}`: `optax.masked`, a weight-decay "
    "`mask=`, or `multi_transform` labels), but `flat_params=True` hands it one flat buffer per dtype, "
    "where a mask or label by path would mean something else. Pass `Nitro(e, ..., flat_params=False)` "
    "so it sees the params tree."
)

DEVICE_IN_CONSTRUCTOR = (
    "the optimizer of `{owner}` passes the Device field {fields} to something that needs a Python number "
    "at construction (an optax schedule constructor such as `warmup_cosine_decay_schedule` compares its "
    "arguments in Python), and a Device field is a traced array there ({error}). Either mark it "
    "`GraphConst[float]` (baked in; a new value recompiles the optimizer), or keep it Device and "
    "drive it per step with `Nitro(e, schedules={{{first!r}: fn}})` instead of an optax schedule."
)


def path_cells(tx) -> list[str]:
    """The path-aware closure cells found anywhere in `tx`'s init and update functions."""
    found, seen = [], set()

    def walk(obj):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
                try:
                    value = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if name in _PATH_CELLS and value is not None and name not in found:
                    found.append(name)
                walk(value)
        elif isinstance(obj, (tuple, list)):
            for item in obj:
                walk(item)
        elif isinstance(obj, dict):
            for item in obj.values():
                walk(item)

    walk(tx.init)
    walk(tx.update)
    return found


def _concretization_errors() -> tuple:
    return tuple(e for e in (getattr(jax.errors, "TracerBoolConversionError", None),
                             getattr(jax.errors, "ConcretizationTypeError", None),
                             getattr(jax.errors, "TracerIntegerConversionError", None)) if e is not None)


def _trace(b, flat, dev: dict, concrete: str | None = None):
    """Build the optimizer with `dev` traced (but field `concrete`) and run init + one update abstractly."""
    # numpy, not a device array: a device array would be staged into the trace, and traced again
    fixed = {} if concrete is None else {concrete: np.asarray(dev[concrete])}

    def run(traced):
        tx = b.optimizer(b.view({**traced, **fixed}))
        state = tx.init(flat)
        return tx.update(flat, state, flat)

    jax.eval_shape(run, {k: v for k, v in dev.items() if k != concrete})


def init_optimizer(b, layout, trainable, dev: dict):
    """The optimizer's initial state over `layout.ravel(trainable)`, after the setup checks.

    **Arguments:**
    - `b`: the handle's `Binding`; `layout`: `FlatLayout` or `TreeLayout` over `trainable`.
    - `trainable`: the float params the optimizer sees; `dev`: the Device values.

    **Returns:** the optimizer state. Raises `NitroValueError` for a path-aware optimizer on the flat
    layout and `NitroTypeError` for a Device field a constructor needs as a Python number.
    """
    owner = b.cls.__qualname__
    flat = layout.ravel(trainable)
    tx = b.optimizer(b.view(dev))
    check_optimizer(b.cls, tx)
    if layout.signature[0] == "flat":
        cells = path_cells(tx)
        if cells:
            raise NitroValueError(FLAT_PATHS.format(owner=owner, cell=cells[0]))
    if dev:
        errors = _concretization_errors()
        try:
            _trace(b, flat, dev)
        except errors as err:
            culprits = []
            for name in dev:  # the fields whose concrete value makes the trace succeed
                try:
                    _trace(b, flat, dev, concrete=name)
                except errors:
                    continue
                culprits.append(name)
            culprits = culprits or list(dev)
            first = str(err).strip().splitlines()[0]
            raise NitroTypeError(DEVICE_IN_CONSTRUCTOR.format(
                owner=owner, fields=", ".join(f"`{c}`" for c in culprits), first=culprits[0],
                error=f"{type(err).__name__}: {first[:160]}")) from None
    return tx.init(flat)
