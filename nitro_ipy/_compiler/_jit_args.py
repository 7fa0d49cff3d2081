"""Arguments of a `nitro_ipy.jit` call (`_jit.py`): which are static, as `jax.jit` decides it, and the
call of a program adopted from the cache or the store: the dynamic arguments only, under the JAX
configuration it was compiled under."""

from __future__ import annotations

import inspect

from .._base import _compat
from . import _context


def _as_tuple(x, kind) -> tuple | None:
    if x is None:
        return None
    if isinstance(x, kind):
        return (x,)
    return tuple(x)


def short_repr(value, n: int = 60) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001
        text = f"<{type(value).__qualname__}>"
    return text if len(text) <= n else text[: n - 3] + "..."


class StaticArgs:
    """Which arguments of a call are static, as `jax.jit` decides it: `static_argnums` and
    `static_argnames`, each inferred from the other through the function's signature."""

    def __init__(self, fun, settings: dict):
        nums = _as_tuple(settings.get("static_argnums"), int)
        names = _as_tuple(settings.get("static_argnames"), str)
        try:
            params = list(inspect.signature(fun).parameters.values())
        except (TypeError, ValueError):
            params = []
        self.positional = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        either = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
        if nums is not None and names is None:
            names = tuple(self.positional[i] for i in nums if -len(self.positional) <= i < len(self.positional)
                          and self.positional[i] in either)
        elif names is not None and nums is None:
            nums = tuple(i for i, n in enumerate(self.positional) if n in names and n in either)
        self.nums, self.names = nums or (), frozenset(names or ())
        self.any = bool(self.nums or self.names)

    def split(self, args: tuple, kwargs: dict):
        """`(dynamic positional args, their labels, dynamic keyword args, [(label, static value)])`."""
        if not self.any:
            labels = [self.positional[i] if i < len(self.positional) else f"arg{i}" for i in range(len(args))]
            return args, labels, kwargs, []
        static_pos = {i % len(args) for i in self.nums if -len(args) <= i < len(args)} if args else set()
        dyn, labels, statics = [], [], []
        for i, a in enumerate(args):
            label = self.positional[i] if i < len(self.positional) else f"arg{i}"
            if i in static_pos:
                statics.append((label, a))
            else:
                dyn.append(a)
                labels.append(label)
        dyn_kwargs = {}
        for k, v in kwargs.items():
            if k in self.names:
                statics.append((k, v))
            else:
                dyn_kwargs[k] = v
        return dyn, labels, dyn_kwargs, statics


class Adopted:
    """An adopted program for a function with static arguments: called with the dynamic ones, when the
    static ones equal those it was compiled for (else `TypeError`, and the inner `jax.jit` takes over)."""

    __slots__ = ("compiled", "static", "statics")

    def __init__(self, compiled, static: StaticArgs, statics: list):
        self.compiled, self.static, self.statics = compiled, static, statics

    def __call__(self, *args, **kwargs):
        dyn, _labels, dyn_kwargs, statics = self.static.split(args, kwargs)
        if statics != self.statics:
            raise TypeError("static arguments differ from the adopted program's")
        return self.compiled(*dyn, **dyn_kwargs)


class Pinned:
    """An adopted program, for the JAX configuration it was compiled under (`_context.py`). Called under
    another one (`jax.enable_x64(True)` around a call) it raises `TypeError`, and the inner `jax.jit`
    takes over, keyed on the configuration as JAX keys it. Under `debug_nans`/`debug_infs`, a NaN or
    infinite output is re-run de-optimized and raises JAX's `FloatingPointError` naming the primitive,
    as `jax.jit` does (an AOT executable alone lets JAX's internal error escape). Holds the function
    weakly (`fun()`), as the state that holds it does."""

    __slots__ = ("call", "context", "fun")

    def __init__(self, call, context, fun):
        self.call, self.context, self.fun = call, context, fun

    def __call__(self, *args, **kwargs):
        if _context.current() != self.context:
            raise TypeError("the JAX configuration differs from the adopted program's")
        try:
            return self.call(*args, **kwargs)
        except _compat.INTERNAL_FLOATING_POINT_ERROR as err:
            _compat.raise_deoptimized(err, self.fun(), args, kwargs)
