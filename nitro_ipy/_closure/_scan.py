"""The checks a drift scan runs: one record per dependency, its checker, and the plan that orders them.

A check answers "is this dependency still what was recorded?" once per scan: `Check.key` includes the
expected fingerprint, so closures recorded alike share one answer in the scan memo. The checkers take
their target's fields spread (`checker(*target, memo)`): the scan calls them in a loop, and locals are
the cheapest way to read a record.

The records are NamedTuples, built and read by name. A `ScanPlan` holds the per-check ones (`Check`,
its target, `SameGlobal`, `PlainGlobal`) as exact tuples (`tuple(record)`, in the record's own field
order), which the scan loops unpack under the field names: CPython unpacks an exact tuple, or spreads it
into a call, about three times faster than a tuple subclass.
"""

from __future__ import annotations

import types
import weakref
from typing import NamedTuple

from .._base._memo import Memo
from ._records import MISSING, class_attr_key, function_key, namespace_key, value_key
from ._resolve import live_namespace, lookup, resolve_function, static_attr
from ._snapshot import PlainFunction, SameObject, fast_form, matches
from ._values import attr_fingerprint, value_fingerprint


class FunctionTarget(NamedTuple):
    """A function by name: does `module.qualname` still resolve to code with fingerprint `expected`?"""

    nskey: tuple  # memo key of the live namespace
    module: str
    ns: dict  # the namespace the function ran in
    key: tuple  # memo key of the live function
    qualname: str
    expected: str


class ValueTarget(NamedTuple):
    """A global: is `module.name` still bound to a value with fingerprint `expected` (None: untracked)?"""

    nskey: tuple
    module: str
    ns: dict
    key: tuple  # memo key of the live value
    name: str
    expected: str | None
    snap: tuple | None  # the value's identity snapshot at record time


class AttrTarget(NamedTuple):
    """A class attribute read through the compile view: `module.cls_qualname.name`."""

    nskey: tuple
    module: str
    ns: dict
    key: tuple  # memo key of the live attribute
    cls_qualname: str
    name: str
    expected: str | None
    snap: tuple | None


class Check(NamedTuple):
    """One dependency's check: `checker(*target, memo)` says "still the same"; `name` is what drifted."""

    key: tuple  # the target's memo key plus the expected fingerprint: the answer's key in the scan memo
    checker: object
    target: tuple  # a FunctionTarget, ValueTarget or AttrTarget
    name: str


def function_check(dep, ns: dict) -> Check:
    """The check that `dep` (a `FuncDep`) still resolves, in namespace `ns`, to code of its fingerprint."""
    key = function_key(dep.module, ns, dep.qualname)
    target = FunctionTarget(namespace_key(dep.module, ns), dep.module, ns, key, dep.qualname, dep.fingerprint)
    return Check((*key, dep.fingerprint), check_function, target, dep.qualified)


def value_check(dep, ns: dict, snap) -> Check:
    """The check that global `dep` (a `ValueDep`) is still bound to a value of its fingerprint; `snap` is
    its identity snapshot at record time (None when there is none, as for a closure loaded from disk)."""
    key = value_key(dep.module, ns, dep.name)
    target = ValueTarget(namespace_key(dep.module, ns), dep.module, ns, key, dep.name, dep.fingerprint, snap)
    return Check((*key, dep.fingerprint), check_value, target, dep.qualified)


def class_attr_check(dep, ns: dict, snap) -> Check:
    """The check that class attribute `dep` (a `ClassAttrDep`) still has its fingerprint; `snap` as above."""
    key = class_attr_key(dep.module, ns, dep.cls_qualname, dep.name)
    target = AttrTarget(namespace_key(dep.module, ns), dep.module, ns, key, dep.cls_qualname, dep.name,
                        dep.fingerprint, snap)
    return Check((*key, dep.fingerprint), check_class_attr, target, dep.qualified)


class Live:
    """A value as it is now; its fingerprint is computed at most once per scan, and only when needed."""

    __slots__ = ("value", "attr", "_fp")

    def __init__(self, value, attr: bool):
        self.value, self.attr = value, attr
        self._fp = MISSING

    def same_as(self, expected: str, snap) -> bool:
        if snap is not None and matches(snap, self.value):
            return True  # the very same objects as at record time: content unchanged
        if self._fp is MISSING:
            self._fp = attr_fingerprint(self.value) if self.attr else value_fingerprint(self.value)
        return self._fp == expected


# A method (`Class.method`) resolved in full, and the objects that resolution went through, by the
# function's memo key: `(class ref, function ref, code ref, fingerprints)`. While the live namespace
# still binds the very class, whose own `__dict__` still holds the very plain function, with the
# very code object, the method resolves to the same fingerprints: an identity test instead of a lookup
# along the MRO, the unwrapping and the fingerprinting (what every post-cell scan would otherwise pay).
_methods_seen = Memo("methods resolved by identity")


def _method_by_identity(ns: dict, key: tuple, qualname: str):
    """The fingerprints of `qualname` (`Class.method`) in `ns` if its objects are the ones last resolved."""
    seen = _methods_seen.get(key) if "." in qualname else None
    if seen is None:
        return None
    cls_ref, fn_ref, code_ref, live = seen
    head, _, name = qualname.partition(".")
    cls = cls_ref()
    if cls is None or ns.get(head) is not cls:
        return None
    fn = cls.__dict__.get(name)
    if fn is None or fn is not fn_ref() or fn.__code__ is not code_ref() or "__wrapped__" in fn.__dict__:
        return None
    return live


def _remember_method(ns: dict, key: tuple, qualname: str, live) -> None:
    head, _, name = qualname.partition(".")
    if not name or "." in name or live is None:
        return
    cls = ns.get(head)
    fn = cls.__dict__.get(name) if isinstance(cls, type) else None
    if type(fn) is not types.FunctionType or "__wrapped__" in fn.__dict__:
        return  # a wrapper, a descriptor, an inherited method: resolved in full every time
    _methods_seen[key] = (weakref.ref(cls), weakref.ref(fn), weakref.ref(fn.__code__), live)


def check_function(nskey, module, ns, key, qualname, expected, memo) -> bool:
    live = memo.get(key, MISSING)
    if live is MISSING:
        live_ns = live_namespace(module, ns, memo, nskey)
        live = _method_by_identity(live_ns, key, qualname)
        if live is None:
            live = resolve_function(live_ns, qualname)
            _remember_method(live_ns, key, qualname, live)
        memo[key] = live
    return live is not None and expected in live


def check_value(nskey, module, ns, key, name, expected, snap, memo) -> bool:
    live = memo.get(key, MISSING)
    if live is MISSING:
        value = live_namespace(module, ns, memo, nskey).get(name, MISSING)
        if value is not MISSING and snap is not None and matches(snap, value):
            return True  # the very same objects as at record time: the common case, fast
        live = memo[key] = None if value is MISSING else Live(value, attr=False)
    if live is not None and expected is None:
        # Untracked: its contents are invisible, its identity is not (snapshots of old closures: None).
        return snap is None or matches(snap, live.value)
    return live is not None and (expected is None or live.same_as(expected, snap))


def check_class_attr(nskey, module, ns, key, cls_qualname, name, expected, snap, memo) -> bool:
    live = memo.get(key, MISSING)
    if live is MISSING:
        cls = lookup(live_namespace(module, ns, memo, nskey), cls_qualname)
        attr = static_attr(cls, name) if isinstance(cls, type) else MISSING
        live = memo[key] = None if attr is MISSING else Live(attr, attr=True)
    if live is not None and expected is None:
        return snap is None or matches(snap, live.value)
    return live is not None and (expected is None or live.same_as(expected, snap))


def memoized(check: tuple, memo: dict) -> bool:
    """A check's answer (a `Check`, exact or not), resolved in full at most once per scan."""
    key, checker, target, _name = check
    ok = memo.get(key, MISSING)
    if ok is MISSING:
        ok = memo[key] = checker(*target, memo)
    return ok


class SameGlobal(NamedTuple):
    """A global settled when it is still bound to `held` (the recorded object, or a `Ref` to it)."""

    name: str
    held: object
    check: Check


class PlainGlobal(NamedTuple):
    """A global bound to a plain function (no defaults, keyword defaults or cells)."""

    name: str
    function: object  # `Ref` to the function
    code: object  # `Ref` to its code
    qualname: str
    check: Check


class ScanGroup(NamedTuple):
    """The globals of one namespace that an identity test settles."""

    nskey: tuple
    module: str
    ns: dict  # the namespace recorded
    same: tuple  # SameGlobal, as exact tuples
    functions: tuple  # PlainGlobal, as exact tuples


class ScanPlan(NamedTuple):
    groups: tuple  # ScanGroup
    rest: tuple  # Check, as exact tuples: resolved through `memoized`


def scan_plan(checks: tuple) -> ScanPlan:
    """A closure's checks arranged once, so that a scan is a few tight loops.

    The value checks whose snapshot `fast_form` settles by identity go to a `ScanGroup` per namespace;
    the others (functions by name, class attributes, values with mutable parts, no snapshot, or objects
    gone already) go to `rest`.
    """
    groups: dict = {}
    rest = []
    for check in checks:
        target = check.target
        if check.checker is not check_value or target.snap is None:
            rest.append(check)
            continue
        form = fast_form(target.snap)
        if form is None:
            rest.append(check)
            continue
        group = groups.get(target.nskey)
        if group is None:  # lists while the plan is built, tuples in the plan
            group = groups[target.nskey] = ScanGroup(target.nskey, target.module, target.ns, [], [])
        if type(form) is SameObject:
            group.same.append(tuple(SameGlobal(target.name, form.held, _exact(check))))
        else:
            assert type(form) is PlainFunction
            group.functions.append(tuple(PlainGlobal(target.name, form.function, form.code, form.qualname, _exact(check))))
    return ScanPlan(
        tuple(g._replace(same=tuple(g.same), functions=tuple(g.functions)) for g in groups.values()),
        tuple(_exact(check) for check in rest),
    )


def _exact(check: Check) -> tuple:
    """`check` as an exact tuple, its target too (see the module docstring)."""
    key, checker, target, name = check
    return (key, checker, tuple(target), name)

