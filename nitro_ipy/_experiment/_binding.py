"""Binding an experiment to a handle: what `Nitro` fixes at setup and never looks up again.

`bind` takes the class as it is *now* in its namespace, rebinds the experiment to it, binds the hooks,
routes batch fields to them, converts the Device fields, fingerprints the GraphConst values (once each)
and validates the schedules. The result is a frozen `Binding`: a handle is a fixed point from there on,
and `rebuild()` is how an edit gets in.
"""

import dataclasses
import enum
import functools
import types
from typing import Callable

import jax
import numpy as np
import optax

from .. import _closure
from .._base._errors import NitroTypeError, NitroValueError
from .._base._fingerprint import (
    Unfingerprintable,
    code_fingerprint,
    fingerprint,
    function_fingerprint,
)
from .._base._live import live_class
from .._base._world import world
from ._carry import edited_schedules, live_experiment, live_schedules
from ._checks import (
    Source,
    check_positional_not_a_field,
    check_schedules_arg,
    device_value,
)
from ._data import check_splits
from ._fields import (
    CompileView,
    GraphConstPrints,
    field_kinds,
    graphconst_prints,
    short_repr,
)
from ._hooks import batch_fields, hook, metric_hooks
from ._model import reserved_params


def _default_optimizer(self):
    return optax.adam(1e-3)


@dataclasses.dataclass(frozen=True, slots=True)
class Route:
    """Which batch fields a hook wants: the required ones, and optional ones sent when a split has them."""

    required: tuple
    optional: tuple
    takes_all: bool

    def pick(self, available) -> tuple:
        """The fields of `available` (a split or a batch) this hook is called with, in call order."""
        if self.takes_all:
            return tuple(available)
        return self.required + tuple(f for f in self.optional if f in available)


@dataclasses.dataclass(frozen=True, slots=True)
class Binding:
    """An experiment bound to its live class: hooks, routes, fingerprints, Device values, splits."""

    experiment: object  # an instance of `cls` (rebound if the class cell was re-run)
    cls: type  # the live class the hooks were bound through
    owner: str  # `module.qualname`, the key's owner
    init: Callable
    forward: Callable
    loss: Callable | None
    optimizer: Callable
    metrics: dict  # {hook name: (function, residency)}
    hook_fps: dict  # {hook name: fingerprint} for every hook present
    routes: dict  # {hook name: Route}
    graphconst: GraphConstPrints
    hosts: tuple  # names of the Host fields, which the compile view refuses
    device_host: dict  # {Device field: strongly typed numpy value}
    schedules: dict  # {Device field: fn(step) -> value}
    splits: dict  # {split name: {batch field: array}}
    reserved: dict  # {hook name: frozenset of the reserved parameters (`rng`, `train`, `state`) it declares}
    schedule_memo: dict = dataclasses.field(default_factory=dict)  # `edited_schedules` per world
    mutable_memo: dict = dataclasses.field(default_factory=dict)  # `graphconst_moved`'s fields to watch

    @property
    def has_state(self) -> bool:
        """`forward` declares `state`: `init` returns `(params, state)`, `forward` `(outputs, new_state)`."""
        return "state" in self.reserved["forward"]

    @property
    def wants_rng(self) -> bool:
        return "rng" in self.reserved["forward"]

    def view(self, dev) -> CompileView:
        """The `self` traced hooks see, with Device values `dev` (traced arrays inside a program)."""
        return CompileView(self.cls, {**self.graphconst.values, **dev}, self.hosts, _closure.note_class_attr,
                           _closure.note_field_read)

    @property
    def viewer(self):
        """`view` as a function holding only what a view needs (the class, the GraphConst values, the
        Host names), not this binding, whose splits hold the data (`_reuse` keeps it past the handle)."""
        cls, consts, hosts = self.cls, self.graphconst.values, self.hosts
        return lambda dev: CompileView(cls, {**consts, **dev}, hosts, _closure.note_class_attr,
                                       _closure.note_field_read)

    @property
    def graphconst_sources(self) -> dict:
        """`{"GraphConst field `name`": value}`: where a large constant baked into a program may come from."""
        return {f"GraphConst field `{n}`": v for n, v in self.graphconst.values.items()}

    def graphconst_moved(self) -> tuple:
        """The GraphConst fields whose value changed in place since setup (a list appended to), each as
        "`name` (before -> now)": a drift like an edit's, which the entry points say (`_staleness`)."""
        memo = self.mutable_memo
        if "names" not in memo:  # only a value that can change in place is fingerprinted at each ask
            memo["names"] = tuple(n for n, v in self.graphconst.values.items() if may_change_in_place(v))
        moved = []
        for name in memo["names"]:
            value = self.graphconst.values[name]
            before, shown = self.graphconst.info[name]
            if fingerprint(value, name) != before:
                moved.append(f"`{name}` ({shown} -> {short_repr(value)})")
        return tuple(moved)

    def check_graphconst_unchanged(self) -> None:
        """Refuse to key a program once a GraphConst value changed in place since setup."""
        for name, value in self.graphconst.values.items():
            before, shown = self.graphconst.info[name]
            if fingerprint(value, name) != before:
                raise NitroValueError(
                    f"GraphConst field `{name}` of `{self.cls.__qualname__}` changed in place since this "
                    f"handle was built ({shown} -> {short_repr(value)}); the compile key holds the value it "
                    f"had then, so no program can be keyed for it now. Give the experiment a new value "
                    f"instead (`e = dataclasses.replace(e, {name}=...)`) and build a new handle "
                    f"(`Nitro(e, ...)`)."
                )

    def edited_schedules(self) -> tuple:
        """The schedules whose name holds other code now (memoized on `world()`: an entry point after no
        redefinition pays one comparison)."""
        now = world()
        memo = self.schedule_memo
        if memo.get("world") != now:
            memo["world"], memo["edited"] = now, edited_schedules(self.schedules)
        return memo["edited"]

    def split(self, name: str) -> dict:
        """Split `name`, or an error naming the splits this handle has and how to add one."""
        if name not in self.splits:
            have = ", ".join(f"`{k}`" for k in self.splits) or "no splits"
            raise NitroValueError(
                f"no `{name}` split: this handle has {have}. Pass it as `Nitro(e, data={{\"{name}\": "
                f"{{...}}}})` or return it from the experiment's `data(self)` hook."
            )
        return self.splits[name]

    def need_loss(self, what: str):
        """Refuse `what` (training, say) when the experiment has no `loss` hook."""
        if self.loss is None:
            raise NitroTypeError(
                f"`{self.cls.__qualname__}` has no `loss` hook, which {what} needs; add "
                f"`def loss(self, outputs, *, y): return scalar`."
            )

    def apply_schedules(self, dev: dict, step: int, *, first: bool = False):
        """Set each scheduled Device field of `dev` to its value at `step` (`device_value`), in place. A
        non-finite value is refused here at the first step of a `train()`, before anything compiles; at
        later steps the guard finds it on the device (`on_nonfinite=` decides)."""
        for name, fn in self.schedules.items():
            source = self.source(name, "schedule", step)
            dev[name] = device_value(fn(step), self.device_host[name], source, finite=first)

    def first_schedules(self, dev: dict, step: int):
        self.apply_schedules(dev, step, first=True)

    def source(self, name: str, origin: str, step: int | None = None) -> Source:
        """Where a value of Device field `name` comes from, for `device_value`'s words."""
        return Source(f"`{self.cls.__qualname__}.{name}`" if origin != "set" else f"`{name}`", origin, step)


_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, enum.Enum, np.dtype, type, types.FunctionType,
              types.BuiltinFunctionType, jax.Array)


def may_change_in_place(value, depth: int = 0) -> bool:
    """Whether `value` holds something mutable (a list, a dict, a writeable numpy array, a plain object):
    immutable scalars, JAX arrays, functions, and tuples, frozensets and frozen dataclasses of those
    cannot change without a new value. Asked once per GraphConst field (`Binding.graphconst_moved`)."""
    if depth > 20:
        return True
    if isinstance(value, _IMMUTABLE):
        return False
    if isinstance(value, np.ndarray):
        return bool(value.flags.writeable)
    if isinstance(value, (tuple, frozenset)):
        return any(may_change_in_place(v, depth + 1) for v in value)
    if isinstance(value, functools.partial):
        return any(may_change_in_place(v, depth + 1) for v in (*value.args, *value.keywords.values()))
    params = getattr(type(value), "__dataclass_params__", None)
    if params is not None and params.frozen:
        return any(may_change_in_place(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value))
    return True


def bind(e, data=None, schedules: dict | None = None) -> Binding:
    """Bind experiment `e` through its live class.

    **Arguments:**
    - `e`: the experiment, a dataclass with marked fields and hook methods.
    - `data`: the splits, or None for the experiment's `data(self)` hook (or no splits).
    - `schedules`: `{Device field: fn(step) -> value}`.

    **Returns:** a `Binding`. Raises the setup errors (`NitroTypeError`, `NitroValueError`,
    `GraphConstHashError`) with the fix in the message.
    """
    field_kinds(e)  # a non-dataclass is refused here, with the fix
    cls = live_class(type(e))
    if cls is not type(e):
        e = _rebind(e, cls)
    e = live_experiment(e)  # instances of user classes in GraphConst fields, re-bound likewise
    graphconst = graphconst_prints(e)
    kinds = field_kinds(cls)

    init = hook(cls, "init")
    forward = hook(cls, "forward")
    loss = hook(cls, "loss", required=False)
    optimizer = hook(cls, "optimizer", required=False) or _default_optimizer
    metrics = metric_hooks(cls)
    batch_fields(cls, init, 2)  # checks its signature; `init` takes no batch fields
    routes = {"forward": Route(*batch_fields(cls, forward, 2))}
    if loss is not None:
        routes["loss"] = Route(*batch_fields(cls, loss, 2))
    for name, (fn, _) in metrics.items():
        routes[name] = Route(*batch_fields(cls, fn, 2))
    hooks = (("init", init), ("forward", forward), ("loss", loss), ("optimizer", optimizer),
             *((n, f) for n, (f, _) in metrics.items()))
    hook_fps = {name: _hook_fingerprint(fn) for name, fn in hooks if fn is not None}
    reserved = {name: reserved_params(cls, name, fn) for name, fn in hooks[1:] if fn is not None}

    if data is None and hook(cls, "data", required=False) is not None:
        data = cls.data(e)
    splits = check_splits(data)
    _check_routes(cls, splits, routes, loss is not None)
    check_positional_not_a_field(cls, forward, "forward", "params", splits)
    if loss is not None:
        check_positional_not_a_field(cls, loss, "loss", "outputs", splits)

    device_host = {n: _device_value(cls, n, getattr(e, n)) for n, k in kinds.items() if k == "Device"}
    schedules = live_schedules(check_schedules_arg(schedules))  # a schedule edited since is called as it is now
    _check_schedules(cls, schedules, device_host)

    return Binding(
        experiment=e, cls=cls, owner=f"{cls.__module__}.{cls.__qualname__}",
        init=init, forward=forward, loss=loss, optimizer=optimizer, metrics=metrics,
        hook_fps=hook_fps, routes=routes, graphconst=graphconst,
        hosts=tuple(n for n, k in kinds.items() if k == "Host"),
        device_host=device_host, schedules=schedules, splits=splits, reserved=reserved,
    )


def _check_routes(cls, splits: dict, routes: dict, has_loss: bool):
    for split_name, split in splits.items():
        hooks = ["forward"]
        if split_name == "train":
            hooks += ["loss"] if has_loss else []
        else:
            hooks += [h for h in routes if h != "forward" and (h != "loss" or has_loss)]
        for h in hooks:
            missing = [f for f in routes[h].required if f not in split]
            if missing:
                raise NitroValueError(
                    f"hook `{cls.__qualname__}.{h}` wants batch field "
                    f"{', '.join(f'`{m}`' for m in missing)}, which split `{split_name}` does not provide "
                    f"(it has {', '.join(f'`{k}`' for k in split)}). Add the field to the split, or give "
                    f"the parameter a default in `{h}`."
                )


def _check_schedules(cls, schedules: dict, device_host: dict):
    for name, fn in schedules.items():
        if name not in device_host:
            raise NitroValueError(
                f"schedule for `{name}`, which is not a Device field of `{cls.__qualname__}` "
                f"(Device fields: {', '.join(map(repr, device_host)) or 'none'}); mark it `Device[float]` "
                f"so a schedule can set it without recompiling."
            )
        if not callable(fn):
            raise NitroTypeError(f"schedule for `{name}` must be callable as `fn(step)`; got {fn!r}.")


def _device_value(cls, name: str, value):
    """`value` as the numpy array a Device field is traced as (`device_value` at setup)."""
    return device_value(value, None, Source(f"`{cls.__qualname__}.{name}`", "field"))


def _hook_fingerprint(fn) -> str:
    try:
        return function_fingerprint(fn)
    except Unfingerprintable:
        return code_fingerprint(fn.__code__)  # a closure cell we cannot read by content: code only


def _rebind(e, cls):
    """An instance of the live class `cls` carrying `e`'s field values (the class cell was re-run)."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    return cls(**{n: getattr(e, n) for n in names if hasattr(e, n)})
