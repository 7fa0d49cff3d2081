"""What a logger receives: one `Event` per thing training did, its values as Python floats."""

import dataclasses
import numbers

import numpy as np

from .._experiment._fields import field_kinds, short_repr

KINDS = {
    "start": "a train() call began; `params` holds the experiment's fields as hyperparameters",
    "step": "a logged step (`log_every=k`): `step/loss`, `step/steps_per_s`, `schedule/<field>`",
    "epoch": "an epoch ended: `train/loss`, `train/steps_per_s`, `schedule/<field>` (and `train/skipped`)",
    "validation": "the epoch's validation: `valid/loss` and `valid/<metric>` for each scalar metric",
    "compile": "the handle took a program it had not run: `compile/<kind>` (trace + compile seconds)",
    "stale": "the handle runs programs an edit made stale; `params['names']` names what moved",
    "stop": "a train() call ended early (Ctrl-C, `run.stop()`, an error): `params['reason']`",
    "checkpoint": "a checkpoint was written: `params['path']`",
    "rebuild": "the handle was rebuilt (`n.rebuild()`); its curves go on at its step",
    "resume": "the handle resumed from a checkpoint (`params['path']`); its curves go on at its step",
}


@dataclasses.dataclass(frozen=True)
class Event:
    """One thing training did.

    **Fields:**
    - `kind`: one of `KINDS` (`"epoch"`, `"step"`, `"validation"`, `"compile"`, ...).
    - `step`: optimizer steps taken when it happened (true steps, with `steps_per_execution` too);
      `epoch`: epochs completed.
    - `values`: `{tag: float}`, the scalars to plot, e.g. `{"train/loss": 0.31}`.
    - `params`: `{name: int | float | str | bool}`: the hyperparameters of a `"start"` event
      (`"GraphConst/hidden"`, `"Device/lr"`, `"Host/notes"`), or what a text event says (`reason`, `path`).
    - `time`: `time.time()` when it happened.
    """

    kind: str
    step: int
    epoch: int
    values: dict = dataclasses.field(default_factory=dict)
    params: dict = dataclasses.field(default_factory=dict)
    time: float = 0.0

    def text(self) -> str:
        """One line: `epoch at step 40 (epoch 2): train/loss=0.31`."""
        parts = [f"{k}={v:.6g}" for k, v in self.values.items()] + [f"{k}={v}" for k, v in self.params.items()]
        return f"{self.kind} at step {self.step} (epoch {self.epoch})" + (": " + ", ".join(parts) if parts else "")


def scalar(value) -> float | None:
    """`value` as a Python float when it is one number (a numpy or JAX scalar, a size-1 array), else None."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    try:
        a = np.asarray(value)
    except Exception:  # noqa: BLE001 - not array-like: not a scalar
        return None
    if a.size == 1 and np.issubdtype(a.dtype, np.number):
        return float(a.reshape(()))
    return None


def hparams(e) -> dict:
    """The experiment's fields as hyperparameters, named by marker: `{"GraphConst/hidden": 64, ...}`.
    Numbers and strings stay as they are; anything else (a dataset, a model definition) is its short repr."""
    out = {}
    for name, kind in field_kinds(e).items():
        try:
            out[f"{kind}/{name}"] = _hparam(getattr(e, name, None))
        except Exception:  # noqa: BLE001 - a value whose repr fails is named, never a failed train()
            out[f"{kind}/{name}"] = "<unprintable>"
    return out


def _hparam(value):
    """A field's value as a hyperparameter: a number or string as it is, anything else its short repr."""
    if isinstance(value, (bool, str)) or (isinstance(value, numbers.Real) and not isinstance(value, np.ndarray)):
        return value if isinstance(value, (bool, str, int)) else float(value)
    if (number := scalar(value)) is not None and np.ndim(value) == 0:
        return number
    return short_repr(value)


def row_events(row: dict, step: int, epoch: int, extra: dict, now: float) -> list:
    """An epoch row (`n.history[-1]`) as its `"epoch"` event and, when it validated, its `"validation"`."""
    train, valid, params = dict(extra), {}, {}
    for key, value in row.items():
        if key == "epoch":
            continue
        if key == "stopped":
            params["stopped"] = str(value)
            continue
        number = scalar(value)
        if number is None:  # a confusion matrix: not a scalar curve
            continue
        if key.startswith("valid_"):
            valid[f"valid/{key[len('valid_'):]}"] = number
        else:
            train[f"train/{key}"] = number
    out = [Event("epoch", step, epoch, train, params, now)]
    if valid:
        out.insert(0, Event("validation", step, epoch, valid, {}, now))
    return out
