"""Field markers (`GraphConst`, `Device`, `Host`) and the compile view traced hooks receive as `self`."""

import copy
import dataclasses
import inspect
import re
import sys
import typing
from typing import Annotated

from .._base._errors import GraphConstHashError, HostFieldAccessError, NitroTypeError
from .._base._fingerprint import (
    Unfingerprintable,
    fingerprint,
    fingerprint_with_callables,
)
from .._base._memo import Memo


class _Marker:
    """The metadata a marker leaves inside `Annotated[T, marker]`."""

    __slots__ = ("kind",)

    def __init__(self, kind: str):
        self.kind = kind

    def __repr__(self):
        return f"<nitro_ipy marker {self.kind}>"


_GRAPHCONST, _DEVICE, _HOST = _Marker("GraphConst"), _Marker("Device"), _Marker("Host")
_MARKERS = {m.kind: m for m in (_GRAPHCONST, _DEVICE, _HOST)}


class _MarkerAlias:
    """`GraphConst[int]` is `Annotated[int, <marker>]`; a bare `GraphConst` means `GraphConst[Any]`."""

    def __init__(self, marker: _Marker, doc: str):
        self._marker = marker
        self.__doc__ = doc

    def __getitem__(self, tp):
        return Annotated[tp, self._marker]

    def __repr__(self):
        return f"nitro_ipy.{self._marker.kind}"


GraphConst = _MarkerAlias(
    _GRAPHCONST,
    "Structural field: baked into the compiled graph and part of the compile key (by content).",
)
Device = _MarkerAlias(
    _DEVICE,
    "Numeric field: converted to a device array at setup and traced, so changing it never recompiles.",
)
Host = _MarkerAlias(_HOST, "Host-only field (the default): never seen by compiled code, never in the key.")


def _marker_of(cls, name: str, annotation) -> _Marker:
    if isinstance(annotation, _MarkerAlias):
        return annotation._marker
    if isinstance(annotation, str):
        # `from __future__ import annotations` and names get_type_hints could not resolve.
        head = annotation.split("[", 1)[0].strip().rsplit(".", 1)[-1]
        if head in _MARKERS:
            return _MARKERS[head]
        return _HOST
    found = [m for m in getattr(annotation, "__metadata__", ()) if isinstance(m, _Marker)]
    if len(found) > 1:
        kinds = " and ".join(m.kind for m in found)
        raise NitroTypeError(
            f"field `{cls.__qualname__}.{name}` is marked both {kinds}; a field has one marker. "
            f"Use `GraphConst[T]` (in the compile key), `Device[T]` (traced input) or `Host[T]`."
        )
    if found:
        return found[0]
    if any(_has_marker(a) for a in typing.get_args(annotation)):
        raise NitroTypeError(
            f"field `{cls.__qualname__}.{name}` has a marker nested inside `{annotation}`; markers go "
            f"outermost: write `GraphConst[Optional[int]]`, not `Optional[GraphConst[int]]`."
        )
    return _HOST


def _has_marker(tp) -> bool:
    if isinstance(tp, _MarkerAlias) or any(isinstance(m, _Marker) for m in getattr(tp, "__metadata__", ())):
        return True
    return any(_has_marker(a) for a in typing.get_args(tp))


def _check_dataclass(cls_or_obj):
    cls = cls_or_obj if isinstance(cls_or_obj, type) else type(cls_or_obj)
    if not dataclasses.is_dataclass(cls):
        raise NitroTypeError(
            f"an experiment must be a dataclass; got `{cls.__module__}.{cls.__qualname__}`. "
            f"Decorate the class with `@dataclasses.dataclass` and mark its fields "
            f"`GraphConst[T]`, `Device[T]` or `Host[T]`."
        )
    return cls


_kinds_cache = Memo("field kinds", maxsize=1024)  # per experiment class


def field_kinds(cls_or_obj) -> dict[str, str]:
    """`{field name: "GraphConst" | "Device" | "Host"}` in declaration order."""
    cls = _check_dataclass(cls_or_obj)
    cached = _kinds_cache.get(cls)
    if cached is not None:
        return cached
    try:
        module = sys.modules.get(cls.__module__)
        hints = typing.get_type_hints(cls, globalns=vars(module) if module else None, include_extras=True)
    except Exception:
        hints = {}
    kinds = {}
    for f in dataclasses.fields(cls):
        kinds[f.name] = _marker_of(cls, f.name, hints.get(f.name, f.type)).kind
    _kinds_cache[cls] = kinds
    return kinds


def _names(cls_or_obj, kind):
    return tuple(n for n, k in field_kinds(cls_or_obj).items() if k == kind)


def graphconst_fields(cls_or_obj) -> tuple[str, ...]:
    """Names of the `GraphConst` fields of an experiment class or instance."""
    return _names(cls_or_obj, "GraphConst")


def device_fields(cls_or_obj) -> tuple[str, ...]:
    """Names of the `Device` fields of an experiment class or instance."""
    return _names(cls_or_obj, "Device")


def host_fields(cls_or_obj) -> tuple[str, ...]:
    """Names of the `Host` fields (explicit or unmarked) of an experiment class or instance."""
    return _names(cls_or_obj, "Host")


_HOST_FIELD_MSG = (
    "`{cls}.{name}` is a Host field, and compiled code never sees Host fields. "
    "If it shapes the graph (a width, a variant, a config), mark it `GraphConst[...]`; "
    "if it is a number you want traced (a rate, a coefficient), mark it `Device[...]`."
)


class CompileView:
    """What traced hooks receive as `self`: GraphConst and Device fields, methods and class attributes.

    Methods and class attributes come from `cls` (the live class the handle bound), so a hook calling
    `self.helper(...)` runs the helper the class defines now. Reading a Host field raises
    `HostFieldAccessError`.

    Every read of a field goes to `on_read(name)` (the dependency recorder's `note_field_read`), and a
    read of a class attribute to `on_attr(cls, name, attr)`: a program's key is matched on the GraphConst
    fields its trace read, so the view is the one way to them (its `repr` reads them all).
    """

    __slots__ = ("_nitro_cls", "_nitro_values", "_nitro_hosts", "_nitro_on_attr", "_nitro_on_read")

    def __init__(self, cls, values: dict, hosts: tuple, on_attr=None, on_read=None):
        object.__setattr__(self, "_nitro_cls", cls)
        object.__setattr__(self, "_nitro_values", values)
        object.__setattr__(self, "_nitro_hosts", hosts)
        object.__setattr__(self, "_nitro_on_attr", on_attr)
        object.__setattr__(self, "_nitro_on_read", on_read)

    def __getattr__(self, name):
        values = object.__getattribute__(self, "_nitro_values")
        if name in values:
            on_read = object.__getattribute__(self, "_nitro_on_read")
            if on_read is not None:
                on_read(name)
            return values[name]
        cls = object.__getattribute__(self, "_nitro_cls")
        if name in object.__getattribute__(self, "_nitro_hosts"):
            raise HostFieldAccessError(_HOST_FIELD_MSG.format(cls=cls.__qualname__, name=name))
        try:
            attr = inspect.getattr_static(cls, name)
        except AttributeError:
            raise AttributeError(f"`{cls.__qualname__}` has no attribute `{name}`") from None
        on_attr = object.__getattribute__(self, "_nitro_on_attr")
        if on_attr is not None:
            on_attr(cls, name, attr)
        if hasattr(attr, "__get__"):
            return attr.__get__(self, cls)
        return attr

    def __setattr__(self, name, value):
        raise AttributeError(f"the compile view is read-only; cannot set `{name}` inside a traced hook")

    def __repr__(self):
        cls = object.__getattribute__(self, "_nitro_cls")
        values = object.__getattribute__(self, "_nitro_values")
        on_read = object.__getattribute__(self, "_nitro_on_read")
        for name in values if on_read is not None else ():
            on_read(name)  # a repr shows every field: a program that prints the view depends on them all
        inner = ", ".join(f"{k}={v!r}" for k, v in values.items())
        return f"compile_view({cls.__qualname__}({inner}))"


def compile_view(e, device_values: dict | None = None, cls=None, on_attr=None) -> CompileView:
    """The view of experiment `e` that traced hooks see: GraphConst and Device fields only.

    `device_values` replaces the Device fields (the handle passes traced arrays here); `cls` is the class
    whose methods are bound (default: `type(e)`).
    """
    kinds = field_kinds(e)
    values = {n: getattr(e, n) for n, k in kinds.items() if k == "GraphConst"}
    for n, k in kinds.items():
        if k == "Device":
            values[n] = device_values[n] if device_values is not None else getattr(e, n)
    hosts = tuple(n for n, k in kinds.items() if k == "Host")
    return CompileView(cls or type(e), values, hosts, on_attr)


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def short_repr(value, limit: int = 60) -> str:
    """`repr(value)` on one line (a multi-line repr's runs of white space made one space, memory addresses
    left out: `<function act>`), cut to `limit` characters: how a value is shown in messages and miss
    explanations."""
    text = _ADDRESS.sub("", " ".join(repr(value).split()))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _combined_hash(cls, fingerprints: dict) -> str:
    # Seeded by the type's qualified name, so two experiment types with equal fields never share a key.
    return fingerprint(
        (f"{cls.__module__}.{cls.__qualname__}", tuple(fingerprints.items())), path=cls.__qualname__
    )


def graphconst_field_hash(e) -> str:
    """Content hash of `e`'s GraphConst fields, seeded by the experiment type's qualified name.

    Device and Host fields never enter it, so converting a Device field to a device array (or giving it
    a new value) leaves it unchanged. Stable across processes.
    """
    cls = type(e)
    return _combined_hash(cls, {n: fingerprint(getattr(e, n), n) for n in graphconst_fields(cls)})


_HASHABLE_FIX = (
    "GraphConst values are part of the compile key and must be fingerprinted by content. Make it a "
    "frozen dataclass (`@dataclasses.dataclass(frozen=True)`), split it into flat GraphConst fields, "
    "or, if compiled code does not depend on it, mark it `Host[...]`."
)


@dataclasses.dataclass(frozen=True, slots=True)
class GraphConstPrints:
    """What a handle keeps of an experiment's GraphConst fields, from one fingerprint per value."""

    values: dict  # {name: value}, what the compile view shows
    hash: str  # `graphconst_field_hash(e)`: the key component
    info: dict  # {name: (fingerprint, short repr)}: what a miss explanation shows


def graphconst_prints(e) -> GraphConstPrints:
    """One pass over `e`'s GraphConst values: each is fingerprinted once, checked as
    `assert_graphconst_hashable` does, and the key hash and the explanation reprs derive from that."""
    values = {n: getattr(e, n) for n in graphconst_fields(e)}
    fingerprints = {name: _hashable_fingerprint(name, value) for name, value in values.items()}
    return GraphConstPrints(
        values=values,
        hash=_combined_hash(type(e), fingerprints),
        info={n: (fp, short_repr(values[n])) for n, fp in fingerprints.items()},
    )


def assert_graphconst_hashable(e) -> None:
    """Refuse a GraphConst value that does not fingerprint by content.

    A value and its `copy.deepcopy` must fingerprint equal and compare equal. Raises
    `GraphConstHashError` (a `TypeError`) naming the field and the path inside the value.
    """
    graphconst_prints(e)


def _hashable_fingerprint(name: str, value) -> str:
    """The fingerprint of GraphConst field `name`, once it is shown to be by content."""
    try:
        fp, callables = fingerprint_with_callables(value, name)
    except Unfingerprintable as err:
        raise GraphConstHashError(
            f"GraphConst field `{name}` cannot be part of the compile key: `{err.path}`: {err.what}. "
            + _HASHABLE_FIX
        ) from None
    try:
        # Callables are kept as they are, as `copy` does for plain functions: a deep-copied jit
        # wrapper or partial is a new identity with the same content, which proves nothing.
        twin = copy.deepcopy(value, {id(c): c for c in callables})
    except Exception as err:
        raise GraphConstHashError(
            f"GraphConst field `{name}` cannot be deep-copied ({type(err).__name__}: {err}). "
            + _HASHABLE_FIX
        ) from None
    if fingerprint(twin, name) != fp:
        raise GraphConstHashError(
            f"GraphConst field `{name}` fingerprints differently from its deepcopy. " + _HASHABLE_FIX
        )
    try:
        # The fingerprint is the authority; `==` only has to not contradict it. Containers of
        # arrays raise on `bool(==)`, which is no contradiction.
        # A value unequal to itself (a NaN float) has a non-reflexive `==`, not an identity one.
        equal = _is_arraylike(value) or bool(twin == value) or not bool(value == value)
    except Exception:
        equal = True
    if not equal:
        raise GraphConstHashError(
            f"GraphConst field `{name}` ({type(value).__qualname__}) does not compare equal to its "
            f"deepcopy, so its `==` is by identity. " + _HASHABLE_FIX
        )
    return fp


def _is_arraylike(v) -> bool:
    return hasattr(v, "shape") and hasattr(v, "dtype")
