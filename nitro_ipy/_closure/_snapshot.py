"""Identity snapshots: the fast path of a scan that follows no redefinition.

A snapshot of a value lists, flat and depth first, the objects whose identity guarantees that the value's
fingerprint has not changed. Its layout is defined once, by `_STRUCTURES`:

    snapshot(v) = [v, *header(v), *snapshot(part) for part in parts(v)]

- atoms (ints, strings, None, ...), modules, concrete JAX arrays and library callables are leaves:
  `[v]` (a library object's name does not change, and that is its fingerprint);
- tuples and frozensets (up to 32 items): no header, their items as parts;
- lists and dicts (up to 32 items): mutable, so the header is their length and the parts their items
  (keys and values, for a dict);
- `functools.partial`: its function, arguments and keywords as parts;
- functions: header code, qualified name, defaults, keyword defaults; parts the non-empty defaults and
  the closure cells' contents (`MISSING` for an empty cell);
- small NumPy arrays: header a `_Content` digest of the bytes (an array changes in place);
- anything else (large or object arrays, objects, deeper than 4 levels) has no snapshot: it is
  fingerprinted by content on every scan.

Elements are held weakly where Python allows (`Ref`), so a snapshot never keeps a rebound value alive.
`snapshot` builds one, `matches` walks a live value against one, and `fast_form` tells the scan plan which
snapshots need no walk at all.
"""

from __future__ import annotations

import functools
import hashlib
import types
import weakref
from typing import NamedTuple

import numpy as np

from .._base._compat import is_concrete_array
from ._records import MISSING
from ._values import is_library_callable

_ATOMS = frozenset({int, float, complex, str, bytes, bool, type(None), type(Ellipsis)})
_MAX_ITEMS = 32
_SIZED = (tuple, frozenset, list, dict)  # containers, bounded by `_MAX_ITEMS`
_MAX_DEPTH = 4
# Above this size hashing dominates either way, and a fingerprint is taken at record time already.
_CONTENT_BYTES = 1 << 16


class Ref(weakref.ref):
    """A snapshot element held weakly (so a snapshot never keeps a rebound value alive)."""

    __slots__ = ()


class _Content:
    """A NumPy array's dtype, shape and a digest of its bytes: an array changes in place, so its
    identity proves nothing, but this is far cheaper to compare than a fingerprint. Held strongly (no
    weak references to it: it lives in the snapshot only)."""

    __slots__ = ("dtype", "shape", "digest")

    def __init__(self, a):
        self.dtype, self.shape = a.dtype, a.shape
        self.digest = hashlib.blake2b(a.tobytes(), digest_size=16).digest()

    def __eq__(self, other) -> bool:
        return (
            type(other) is _Content
            and self.dtype is other.dtype  # builtin dtypes are shared objects; others fall back safely
            and self.shape == other.shape
            and self.digest == other.digest
        )


# Header elements compared by value (a length, an array's content); every other element by identity.
_BY_VALUE = frozenset({int, _Content})
_NO_HEADER = ()


def _flat_items(d: dict):
    for k, v in d.items():
        yield k
        yield v


def _items(v):
    return _NO_HEADER, v


def _list(v):
    return (len(v),), v


def _dict(v):
    return (len(v),), _flat_items(v)


def _partial(v):
    return _NO_HEADER, (v.func, v.args, v.keywords)


def _function(v):
    defaults, kwdefaults, closure = v.__defaults__, v.__kwdefaults__, v.__closure__
    header = (v.__code__, v.__qualname__, defaults, kwdefaults)
    if not (defaults or kwdefaults or closure):
        return header, _NO_HEADER  # a plain function
    parts = [part for part in (defaults, kwdefaults) if part]
    for cell in closure or ():
        try:
            parts.append(cell.cell_contents)
        except ValueError:  # an empty cell
            parts.append(MISSING)
    return header, parts


def _array(v):
    return (_Content(v),), _NO_HEADER


# The layout's one definition: type -> `(header, parts)` of a value with inner structure. Every other
# type is a leaf (or has no snapshot: `_take` decides).
_STRUCTURES = {
    tuple: _items,
    frozenset: _items,
    list: _list,
    dict: _dict,
    functools.partial: _partial,
    types.FunctionType: _function,
    np.ndarray: _array,
}
_structure_of = _STRUCTURES.get


def _hold(x):
    try:
        return Ref(x)
    except TypeError:  # ints, strings, tuples: small, held as they are
        return x


def _held(x):
    """A snapshot element's object (`MISSING` when a weakly held one is gone)."""
    if type(x) is Ref:
        x = x()
        return MISSING if x is None else x
    return x


def snapshot(v) -> tuple | None:
    """The identity snapshot of `v` (see the module docstring), or None when it has none."""
    out: list = []
    return tuple(out) if _take(v, 0, out) else None


def identity(v) -> tuple:
    """A snapshot of `v` as a leaf: its identity only (a value with no content fingerprint)."""
    return (_hold(v),)


def _take(v, depth: int, out: list) -> bool:
    t = type(v)
    if t in _ATOMS or t is types.ModuleType or v is MISSING:
        out.append(_hold(v))
        return True
    if depth >= _MAX_DEPTH:
        return False
    structure = _structure_of(t)
    if structure is None:
        if not (is_concrete_array(v) or is_library_callable(v)):
            return False  # an object: fingerprinted by content on every full check
        out.append(_hold(v))
        return True
    if t is np.ndarray:
        if v.dtype.hasobject or v.nbytes > _CONTENT_BYTES:
            return False
    elif t in _SIZED and len(v) > _MAX_ITEMS:
        return False
    header, parts = structure(v)
    out.append(_hold(v))
    out.extend(map(_hold, header))
    return all(_take(part, depth + 1, out) for part in parts)


def matches(frozen: tuple, v) -> bool:
    """Whether `snapshot(v)` would list the very objects `frozen` holds, found without building it.

    Walks `v` in the layout's order and stops at the first object that is not the recorded one. An object
    found where the recorded one was is that object, so a leaf needs no second look at what it is.
    """
    return _match(frozen, 0, v) == len(frozen)


def _match(frozen: tuple, i: int, v) -> int:
    """`matches` for `v`'s part of the snapshot, starting at `frozen[i]`: where it ends, or -1."""
    if i >= len(frozen):
        return -1
    held = frozen[i]
    if type(held) is Ref:
        held = held()
        if held is None:
            return -1  # gone, so `v` is not it
    if held is not v:
        return -1
    i += 1
    structure = _structure_of(type(v))
    if structure is None:
        return i  # a leaf
    header, parts = structure(v)
    try:
        for h in header:
            # The recorded element is `h` itself, a weak reference to it, or (a length, an array's
            # content) equal to it.
            x = frozen[i]
            if x is not h and (type(x) is not Ref or x() is not h) and not (type(h) in _BY_VALUE and x == h):
                return -1
            i += 1
    except IndexError:  # a snapshot of something else, shorter
        return -1
    for part in parts:
        i = _match(frozen, i, part)
        if i < 0:
            return -1
    return i


# The types whose snapshot lists parts that can change in place (items, code, defaults, cells, an
# array's `_Content`): a snapshot without any is settled by its first element's identity alone.
_MUTABLE_PARTS = frozenset({list, dict, functools.partial, types.FunctionType, _Content})


class SameObject(NamedTuple):
    """A snapshot settled by identity: the value is still `held` (the recorded object, or a `Ref` to it)."""

    held: object


class PlainFunction(NamedTuple):
    """A snapshot of a function without defaults, keyword defaults or cells: the same function object
    (`function`, a `Ref`) with the same code (`code`, a `Ref`) and qualified name."""

    function: Ref
    code: Ref
    qualname: str


def fast_form(frozen: tuple) -> SameObject | PlainFunction | None:
    """What settles `frozen` without a walk, or None (a mutable part, or an object gone already)."""
    objs = [_held(x) for x in frozen]
    if any(o is MISSING for o in objs):
        return None
    if not _MUTABLE_PARTS.intersection(map(type, objs)):
        return SameObject(frozen[0])
    if (
        len(frozen) == 5
        and type(objs[0]) is types.FunctionType
        and type(frozen[0]) is Ref
        and type(frozen[1]) is Ref
        and frozen[3] is None
        and frozen[4] is None
    ):
        return PlainFunction(frozen[0], frozen[1], frozen[2])
    return None
