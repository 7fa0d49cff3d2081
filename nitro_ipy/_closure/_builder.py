"""Building a `Closure` from what a recording saw: the functions run, what they read, what that holds."""

from __future__ import annotations

import types

from .._fingerprint import code_fingerprint
from .._origin import class_namespace, is_cell_file, is_user_function, is_user_module
from ._bytecode import reads
from ._disk import FileBacked, file_digest
from ._model import Closure
from ._records import (
    MISSING,
    SKIP,
    CellDep,
    ClassAttrDep,
    FuncDep,
    ValueDep,
    class_attr_key,
    function_key,
    namespace_key,
    value_key,
)
from ._resolve import cells_of, live_namespace, lookup, resolve_function, underlying
from ._scan import AttrTarget, Check, FunctionTarget, ValueTarget, check_class_attr, check_function, check_value
from ._snapshot import snapshot
from ._values import attr_fingerprint, value_fingerprint


class Builder:
    def __init__(self):
        self.functions: dict[int, tuple] = {}  # id(code) -> (FuncDep, ns, anonymous)
        self.codes: list = []  # keeps the code objects alive while ids are in use
        self.values: dict[tuple, tuple] = {}  # (id(ns), name) -> (ValueDep, ns, snapshot)
        self.attrs: dict[tuple, tuple] = {}  # (id(cls), name) -> (ClassAttrDep, ns, anonymous, snapshot)
        self.cells: dict[tuple, CellDep] = {}  # (module, qualname, var) -> CellDep
        self.digests: dict[str, str | None] = {}
        self.executed: set[tuple[str, str]] = set()  # (module, qualname) the trace ran

    def function(self, code: types.CodeType, ns: dict, cells) -> None:
        """Add a user function (by code), the globals it reads and, recursively, what those hold."""
        if id(code) in self.functions:
            return
        module = ns.get("__name__") or "?"
        qualname = code.co_qualname
        filename = code.co_filename
        digest = None
        if not is_cell_file(filename):
            if filename not in self.digests:
                self.digests[filename] = file_digest(filename)
            digest = self.digests[filename]
        fp = code_fingerprint(code)
        dep = FuncDep(module, qualname, fp, filename, digest)
        # Resolvable by name now, to this very code? Otherwise it is anonymous (see README.md).
        live = resolve_function(live_namespace(module, ns, {}), qualname)
        self.functions[id(code)] = (dep, ns, live is None or fp not in live)
        self.codes.append(code)
        found = reads(code)
        for name in found.names:
            value = ns.get(name, MISSING)
            if value is not MISSING:
                self.value(ns, name, value)
        for name, attr in found.attrs:
            mod = ns.get(name)
            if isinstance(mod, types.ModuleType) and is_user_module(mod.__name__):
                value = mod.__dict__.get(attr, MISSING)
                if value is not MISSING:
                    self.value(mod.__dict__, attr, value)
        if cells and (module, qualname.rpartition(".<locals>.")[0]) in self.executed:
            cells = ()  # a closure the trace itself created: its cells hold trace-time values
        for var, value in cells or ():
            if var == "__class__":
                continue  # the class a method is defined in: covered by the method's own dependency
            cfp = value_fingerprint(value)
            if cfp is SKIP:
                continue
            self.cells[(module, qualname, var)] = CellDep(module, qualname, var, cfp)
            self.walk(value)

    @staticmethod
    def _unrecorded(table: dict, key: tuple, fingerprint_of, value) -> tuple | None:
        """`(fingerprint, snapshot)` of a value not in `table` yet, or None (recorded already, a tracer)."""
        if key in table:
            return None
        fp = fingerprint_of(value)
        if fp is SKIP:
            return None
        return fp, (snapshot(value) if fp is not None else None)

    def value(self, ns: dict, name: str, value) -> None:
        key = (id(ns), name)
        new = self._unrecorded(self.values, key, value_fingerprint, value)
        if new is not None:
            fp, snap = new
            self.values[key] = (ValueDep(ns.get("__name__") or "?", name, fp), ns, snap)
            self.walk(value)

    def class_attr(self, cls: type, name: str, attr) -> None:
        key = (id(cls), name)
        new = self._unrecorded(self.attrs, key, attr_fingerprint, attr)
        if new is not None:
            fp, snap = new
            ns = class_namespace(cls)
            dep = ClassAttrDep(cls.__module__, cls.__qualname__, name, fp)
            anonymous = ns is None or not isinstance(
                lookup(live_namespace(cls.__module__, ns, {}), cls.__qualname__), type
            )
            self.attrs[key] = (dep, ns, anonymous, snap)
            self.walk(attr)

    def walk(self, value) -> None:
        """Statically add the user functions `value` holds (JAX may not re-run their Python)."""
        if not callable(value) and not isinstance(value, (staticmethod, classmethod, property)):
            return
        if isinstance(value, type):
            return  # a class's methods are dependencies when called; its fingerprint covers the rest
        for fn in underlying(value):
            if is_user_function(fn):
                self.function(fn.__code__, fn.__globals__, cells_of(fn))

    def build(self) -> Closure:
        functions, values, untracked, anonymous, checks, files = [], [], set(), set(), [], []
        # A function bound to a global that is itself a tracked dependency needs no check of its own: the
        # global's fingerprint covers its code (and its defaults and cells).
        covered = {(id(ns), dep.name) for dep, ns, _snap in self.values.values() if dep.fingerprint}
        for dep, ns, anon in self.functions.values():
            functions.append(dep)
            if anon:
                anonymous.add(dep.qualified)
            elif (id(ns), dep.qualname) not in covered:
                key = function_key(dep.module, ns, dep.qualname)
                target = FunctionTarget(namespace_key(dep.module, ns), dep.module, ns, key, dep.qualname, dep.fingerprint)
                checks.append(Check((*key, dep.fingerprint), check_function, target, dep.qualified))
            if dep.file_digest is not None:
                files.append(FileBacked(dep, ns, anon))
        for dep, ns, snap in self.values.values():
            values.append(dep)
            if dep.fingerprint is None:
                untracked.add(dep.qualified)
            key = value_key(dep.module, ns, dep.name)
            target = ValueTarget(namespace_key(dep.module, ns), dep.module, ns, key, dep.name, dep.fingerprint, snap)
            checks.append(Check((*key, dep.fingerprint), check_value, target, dep.qualified))
        for dep, ns, anon, snap in self.attrs.values():
            values.append(dep)
            if dep.fingerprint is None:
                untracked.add(dep.qualified)
            if anon:
                anonymous.add(dep.qualified)
            else:
                key = class_attr_key(dep.module, ns, dep.cls_qualname, dep.name)
                target = AttrTarget(
                    namespace_key(dep.module, ns), dep.module, ns, key, dep.cls_qualname, dep.name,
                    dep.fingerprint, snap,
                )
                checks.append(Check((*key, dep.fingerprint), check_class_attr, target, dep.qualified))
        for dep in self.cells.values():
            values.append(dep)
            if dep.fingerprint is None:
                untracked.add(dep.qualified)
        functions.sort(key=lambda d: (d.module, d.qualname, d.fingerprint))
        values.sort(key=lambda d: (type(d).__name__, d.qualified))
        return Closure(functions, values, sorted(untracked), sorted(anonymous), checks, files)
