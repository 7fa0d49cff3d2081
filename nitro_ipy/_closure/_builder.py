"""Building a `Closure` from what a recording saw: the functions run, what they read, what that holds."""

from __future__ import annotations

import types

from .._base._fingerprint import code_fingerprint
from .._base._origin import (
    class_namespace,
    is_cell_file,
    is_user_function,
    is_user_module,
)
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
)
from ._resolve import (
    cells_of,
    live_namespace,
    lookup,
    resolve_function,
    static_attr,
    underlying,
)
from ._scan import class_attr_check, function_check, value_check
from ._snapshot import identity, snapshot
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
        self.superseded: set[str] = set()  # functions run whose name resolves to other code now
        self.via_class: set[int] = set()  # ids of the codes of the class attributes read (a method, a hook)

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
        anonymous = live is None or fp not in live
        via_class = id(code) in self.via_class
        if via_class:
            # Read as a class attribute (`self.act`, a hook of the experiment class): that attribute's
            # check follows what the class resolves it to now. Its own name may mean other code by now
            # (a base class re-run that the subclass does not inherit from yet) without this one moving.
            anonymous = False
        elif anonymous and live is not None and (module, qualname) in self.executed and self._method(ns, qualname):
            # The trace ran a method its name no longer means (of a class redefined since the instance
            # was made): the program is stale at birth, never served as live. Checked by name all the
            # same, so that reverting the edit revives it. (A plain function run under another name, say
            # through a decorator without `functools.wraps`, is checked through what holds it.)
            self.superseded.add(dep.qualified)
            anonymous = False
        self.functions[id(code)] = (dep, ns, anonymous, via_class)
        self.codes.append(code)
        found = reads(code)
        for name in found.names:
            value = ns.get(name, MISSING)
            if value is not MISSING:
                self.value(ns, name, value)
        for name, attr in found.attrs:
            obj = ns.get(name)
            if isinstance(obj, types.ModuleType) and is_user_module(obj.__name__):
                value = obj.__dict__.get(attr, MISSING)
                if value is not MISSING:
                    self.value(obj.__dict__, attr, value)
            elif isinstance(obj, type) and is_user_module(obj.__module__):
                self.class_read(obj, attr, ns)  # `Consts.SCALE`, `Color.RED`
        # `self.RATE` in a method the trace ran: a class attribute of the method's (live) class. Not for a
        # superseded method, whose class is not the live one.
        if found.self_attrs and (module, qualname) in self.executed and dep.qualified not in self.superseded:
            owner = lookup(live_namespace(module, ns, {}), qualname.rpartition(".")[0]) if self._method(ns, qualname) else MISSING
            if isinstance(owner, type) and is_user_module(owner.__module__):
                for attr in found.self_attrs:
                    # A method is a dependency of its own once it runs (recorded against the code that
                    # ran). A dataclass field's default counts: an instance made inside the trace has it.
                    if not underlying(static_attr(owner, attr)):
                        self.class_read(owner, attr, ns)
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
        # A value without a content fingerprint is still held to its identity: rebinding it is drift.
        return fp, (snapshot(value) if fp is not None else identity(value))

    def value(self, ns: dict, name: str, value) -> None:
        key = (id(ns), name)
        new = self._unrecorded(self.values, key, value_fingerprint, value)
        if new is not None:
            fp, snap = new
            self.values[key] = (ValueDep(ns.get("__name__") or "?", name, fp), ns, snap)
            self.walk(value)

    @staticmethod
    def _method(ns: dict, qualname: str) -> bool:
        """Whether `qualname` names a method: `A.f` (or `A.B.f`) where `A` (`A.B`) is a class."""
        owner, dot, _ = qualname.rpartition(".")
        return bool(dot) and "<locals>" not in qualname and isinstance(lookup(ns, owner), type)

    def class_read(self, cls: type, name: str, ns: dict) -> None:
        """A class attribute read through the class or an instance (`Consts.SCALE`, `self.RATE`) by code
        running in `ns`."""
        attr = static_attr(cls, name)
        if attr is not MISSING and not isinstance(attr, types.MemberDescriptorType):
            self.class_attr(cls, name, attr, ns)

    def class_attr(self, cls: type, name: str, attr, seen_in: dict | None = None) -> None:
        key = (id(cls), name)
        new = self._unrecorded(self.attrs, key, attr_fingerprint, attr)
        if new is not None:
            fp, snap = new
            ns = class_namespace(cls)
            if seen_in is not None and lookup(ns or {}, cls.__qualname__) is not cls:
                # A class without methods names no namespace of its own (and `sys.modules["__main__"]`
                # may not be the shell's): the namespace of the code that read it does.
                ns = seen_in
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
        for dep, ns, anon, via_class in self.functions.values():
            functions.append(dep)
            if anon:
                anonymous.add(dep.qualified)
            elif (id(ns), dep.qualname) not in covered and not via_class:
                checks.append(function_check(dep, ns))
            if dep.file_digest is not None:
                files.append(FileBacked(dep, ns, anon))
        for dep, ns, snap in self.values.values():
            values.append(dep)
            if dep.fingerprint is None:
                untracked.add(dep.qualified)
            checks.append(value_check(dep, ns, snap))
        for dep, ns, anon, snap in self.attrs.values():
            values.append(dep)
            if dep.fingerprint is None:
                untracked.add(dep.qualified)
            if anon:
                anonymous.add(dep.qualified)
            else:
                checks.append(class_attr_check(dep, ns, snap))
        for dep in self.cells.values():
            values.append(dep)
            if dep.fingerprint is None:
                untracked.add(dep.qualified)
        functions.sort(key=lambda d: (d.module, d.qualname, d.fingerprint))
        values.sort(key=lambda d: (type(d).__name__, d.qualified))
        return Closure(functions, values, sorted(untracked), sorted(anonymous), checks, files, sorted(self.superseded))
