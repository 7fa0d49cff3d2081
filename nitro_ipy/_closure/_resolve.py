"""Finding a dependency again by name: unwrapping callables, static lookups, nested code, live namespaces."""

from __future__ import annotations

import functools
import types

from .._base import _origin
from .._base._compat import CUSTOM_DERIVATIVE_PARTS, is_custom_derivative
from .._base._fingerprint import code_fingerprint
from .._base._memo import Memo
from ._records import MISSING, function_key, namespace_key


def underlying(obj, limit: int = 64) -> list:
    """The plain functions behind `obj`: itself, or what a wrapper, method, property or partial holds."""
    out, stack, seen = [], [obj], set()
    while stack and len(seen) < limit:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, types.FunctionType):
            out.append(x)
            wrapped = x.__dict__.get("__wrapped__")  # functools.wraps: keep going to the wrapped function
            if wrapped is not None:
                stack.append(wrapped)
        elif isinstance(x, (staticmethod, classmethod, types.MethodType)):
            stack.append(x.__func__)
        elif isinstance(x, property):
            stack.extend((x.fget, x.fset, x.fdel))
        elif isinstance(x, (functools.partial, functools.cached_property)):
            stack.append(x.func)
        elif isinstance(x, type):
            continue
        else:
            # jax.jit / jax.checkpoint / other `__wrapped__` wrappers; custom_jvp and custom_vjp (`fun`
            # and their rules). A user object's attribute that raises is no dependency.
            for name in CUSTOM_DERIVATIVE_PARTS if is_custom_derivative(x) else ("__wrapped__",):
                try:
                    stack.append(getattr(x, name, None))
                except Exception:
                    pass
    return out


def static_attr(obj, name: str):
    """`name` looked up without running descriptors or `__getattr__` (classes: along the MRO)."""
    if isinstance(obj, type):
        for klass in obj.__mro__:
            d = klass.__dict__
            if name in d:
                return d[name]
        return MISSING
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        return d.get(name, MISSING)
    return MISSING


def lookup(ns: dict, dotted: str):
    """`a.b.c` looked up statically in `ns`, or `MISSING`."""
    head, *rest = dotted.split(".")
    obj = ns.get(head, MISSING)
    for part in rest:
        if obj is MISSING:
            break
        obj = static_attr(obj, part)
    return obj


def nested(code: types.CodeType):
    """Every code object nested (at any depth) in `code`'s constants: its functions, lambdas, classes."""
    stack = [code]
    while stack:
        for const in stack.pop().co_consts:
            if isinstance(const, types.CodeType):
                yield const
                stack.append(const)


# (id(code), qualname) -> (code, nested codes named qualname); the code is held so the id stays its own.
_nested_memo = Memo("nested code objects by qualified name")


def nested_codes(code: types.CodeType, qualname: str) -> tuple:
    """Code objects named `qualname` nested (at any depth) in `code`'s constants."""
    key = (id(code), qualname)
    hit = _nested_memo.get(key)
    if hit is not None and hit[0] is code:
        return hit[1]
    found = tuple(c for c in nested(code) if c.co_qualname == qualname)
    _nested_memo[key] = (code, found)
    return found


def resolve_function(ns: dict, qualname: str) -> frozenset | None:
    """Code fingerprints `qualname` resolves to in `ns` now, or None when it no longer resolves."""
    obj = ns.get(qualname)
    if type(obj) is types.FunctionType and "__wrapped__" not in obj.__dict__:
        return frozenset((code_fingerprint(obj.__code__),))  # the common case, fast
    outer, inner, _ = qualname.partition(".<locals>.")
    obj = lookup(ns, outer)
    if obj is MISSING:
        return None
    codes = [fn.__code__ for fn in underlying(obj)]
    if inner:
        codes = [c for outer_code in codes for c in nested_codes(outer_code, qualname)]
    return frozenset(code_fingerprint(c) for c in codes) or None


def live_namespace(module: str, recorded: dict, memo: dict, key=None) -> dict | None:
    """`_origin.live_namespace(module, recorded)`, memoized per scan.

    **Arguments:**
    - `module`, `recorded`: as for `_origin.live_namespace`.
    - `memo`: the scan memo.
    - `key`: the memo key, when the caller has it precomputed; default `namespace_key(module, recorded)`.
    """
    if key is None:
        key = namespace_key(module, recorded)
    ns = memo.get(key, MISSING)
    if ns is MISSING:
        ns = memo[key] = _origin.live_namespace(module, recorded)
    return ns


def live_function(module: str, recorded: dict, qualname: str, memo: dict):
    """Code fingerprints `module.qualname` resolves to now (memoized per scan), or None."""
    key = function_key(module, recorded, qualname)
    live = memo.get(key, MISSING)
    if live is MISSING:
        live = memo[key] = resolve_function(live_namespace(module, recorded, memo), qualname)
    return live


def cell_contents(closure) -> list:
    """The contents of each cell of a `__closure__` (`MISSING` for an empty one)."""
    out = []
    for cell in closure or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:  # an empty cell
            out.append(MISSING)
    return out


def cells_of(fn: types.FunctionType) -> list[tuple[str, object]]:
    """`(free variable, value)` of each filled closure cell of `fn`."""
    cells = zip(fn.__code__.co_freevars, cell_contents(fn.__closure__), strict=True)
    return [(k, v) for k, v in cells if v is not MISSING]
