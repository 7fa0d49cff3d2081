"""Arguments of a `nitro_ipy.jit` call (`_jit.py`): which are static, as `jax.jit` decides it, and the
call of a program adopted from the cache or the store, which takes the dynamic ones only."""

from __future__ import annotations

import inspect

from .._base._compat import trace_context


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
    """A program compiled before for this code and these arguments, called directly: while JAX's
    configuration is the one it was adopted under (a changed `jax_numpy_rank_promotion` or `jax_enable_x64`
    traces again, as JAX's own cache does) and, for a function with static arguments, with the dynamic
    ones when the static ones equal those it was compiled for. Else `TypeError`, and the inner `jax.jit`
    takes over for good."""

    __slots__ = ("compiled", "static", "statics", "context")

    def __init__(self, compiled, static: StaticArgs, statics: list):
        self.compiled, self.static, self.statics = compiled, static, statics
        self.context = trace_context()

    def __call__(self, *args, **kwargs):
        if trace_context() != self.context:
            raise TypeError("JAX's configuration differs from the adopted program's")
        if not self.statics:
            return self.compiled(*args, **kwargs)
        dyn, _labels, dyn_kwargs, statics = self.static.split(args, kwargs)
        if statics != self.statics:
            raise TypeError("static arguments differ from the adopted program's")
        return self.compiled(*dyn, **dyn_kwargs)
