"""Binding an experiment's hooks through its live class, and reading which batch fields each wants."""

import inspect
import types

from .._base._errors import NitroTypeError
from ._model import RESERVED

_REQUIRED = {
    "init": "def init(self, rng): return params",
    "forward": "def forward(self, params, *, x): return outputs",
    "loss": "def loss(self, outputs, *, y): return scalar",
}


def metrics(residency: str = "host"):
    """Mark a method as a metric hook: `m(self, outputs, **fields) -> {name: (sum, count)}`.

    `"host"` (default) runs it in numpy on transferred outputs, part of no program; `"device"` compiles it
    into a program of its own. A method named `metrics` is a host metric hook without the decorator.
    """
    if callable(residency):  # used bare: @metrics
        residency.__nitro_metric__ = "host"
        return residency
    if residency not in ("host", "device"):
        raise NitroTypeError(f'metric residency must be "host" or "device"; got {residency!r}.')

    def mark(fn):
        fn.__nitro_metric__ = residency
        return fn

    return mark


def hook(cls, name: str, required: bool = True):
    """The plain function `cls` defines as hook `name` (None if absent and not `required`)."""
    fn = inspect.getattr_static(cls, name, None)
    if isinstance(fn, (staticmethod, classmethod)):
        raise NitroTypeError(f"hook `{cls.__qualname__}.{name}` must be a plain method; got a {type(fn).__name__}.")
    if fn is None:
        if required:
            raise NitroTypeError(
                f"`{cls.__qualname__}` has no `{name}` hook; add `{_REQUIRED.get(name, name)}`."
            )
        return None
    if not isinstance(fn, types.FunctionType):
        raise NitroTypeError(f"hook `{cls.__qualname__}.{name}` must be a method; got {type(fn).__qualname__}.")
    return fn


def batch_fields(cls, fn, n_positional: int) -> tuple[tuple[str, ...], tuple[str, ...], bool]:
    """`(required, optional, takes_all)` batch fields of hook `fn`, after its `n_positional` leading
    parameters (`self, params` or `self, outputs`). Keyword-only reserved parameters (`rng`, `train`,
    `state`: `_model.reserved_params`) are not batch fields."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < n_positional and not any(p.kind is p.VAR_POSITIONAL for p in params):
        shape = {"init": "(self, rng)", "forward": "(self, params, *, x)",
                 "loss": "(self, outputs, *, y)"}.get(fn.__name__, "(self, outputs, **fields)")
        raise NitroTypeError(
            f"hook `{cls.__qualname__}.{fn.__name__}{sig}` takes too few positional parameters; "
            f"expected `{fn.__name__}{shape}`."
        )
    rest = [p for p in params[n_positional:] if not (p.kind is p.KEYWORD_ONLY and p.name in RESERVED)]
    required, optional, takes_all = [], [], False
    for p in rest:
        if p.kind is p.VAR_KEYWORD:
            takes_all = True
        elif p.kind is p.VAR_POSITIONAL:
            continue
        elif p.kind is p.POSITIONAL_ONLY:
            raise NitroTypeError(
                f"hook `{cls.__qualname__}.{fn.__name__}`: batch field `{p.name}` is positional-only; "
                f"batch fields are passed by keyword."
            )
        elif p.default is p.empty:
            required.append(p.name)
        else:
            optional.append(p.name)
    return tuple(required), tuple(optional), takes_all


def metric_hooks(cls) -> dict[str, tuple]:
    """`{name: (function, residency)}` for the method named `metrics` and every `@metrics(...)` method."""
    found = {}
    for name in dir(cls):
        attr = inspect.getattr_static(cls, name, None)
        if not isinstance(attr, types.FunctionType):
            continue
        residency = getattr(attr, "__nitro_metric__", None)
        if residency is None and name == "metrics":
            residency = "host"
        if residency is not None:
            found[name] = (attr, residency)
    return found
