"""The dependency records a closure lists, the sentinels every part shares, and the scan memo's keys."""

from __future__ import annotations

from typing import NamedTuple

MISSING = object()  # a name or attribute that is not there (`None` is a value like any other)
SKIP = object()  # a value not worth recording at all: a tracer (trace-internal, not external state)


class FuncDep(NamedTuple):
    """A user function the program depends on.

    `file_digest` is a hash of the source file's bytes at record time; `None` for notebook cells.
    """

    module: str
    qualname: str
    fingerprint: str
    filename: str
    file_digest: str | None

    @property
    def qualified(self) -> str:
        return f"{self.module}.{self.qualname}"


class ValueDep(NamedTuple):
    """A global `module.name` read by a dependency; `fingerprint` is `None` when it has none (untracked)."""

    module: str
    name: str
    fingerprint: str | None

    @property
    def qualified(self) -> str:
        return f"{self.module}.{self.name}"


class ClassAttrDep(NamedTuple):
    """An attribute `name` of class `module.cls_qualname` read through the compile view."""

    module: str
    cls_qualname: str
    name: str
    fingerprint: str | None

    @property
    def qualified(self) -> str:
        return f"{self.module}.{self.cls_qualname}.{self.name}"


class CellDep(NamedTuple):
    """A closure cell `var` of function `module.qualname`, as seen when the trace called it.

    Informational: drift of a closure's cells is caught through whatever holds the closure (a global, a
    class attribute, a GraphConst field); unfingerprintable cells are listed in `untracked`.
    """

    module: str
    qualname: str
    var: str
    fingerprint: str | None

    @property
    def qualified(self) -> str:
        return f"{self.module}.{self.qualname}.{self.var}"


# Keys of the memo one scan shares across closures, one constructor per kind of answer. The leading tag
# keeps kinds with equal fields apart (a function `f` and the global `f` of one namespace). A key names a
# namespace by `id`: the namespace is held by the closure that built the key, so the id stays unique.


def namespace_key(module: str, ns: dict) -> tuple:
    """The namespace `module` names now (`_resolve.live_namespace`)."""
    return ("namespace", module, id(ns))


def function_key(module: str, ns: dict, qualname: str) -> tuple:
    """The code fingerprints `module.qualname` resolves to now (`_resolve.live_function`)."""
    return ("function", module, id(ns), qualname)


def value_key(module: str, ns: dict, name: str) -> tuple:
    """The global `module.name` as it is now (a `_scan.Live`)."""
    return ("value", module, id(ns), name)


def class_attr_key(module: str, ns: dict, cls_qualname: str, name: str) -> tuple:
    """The class attribute `module.cls_qualname.name` as it is now (a `_scan.Live`)."""
    return ("class attr", module, id(ns), cls_qualname, name)


def disk_key(filename: str) -> tuple:
    """A source file's state on disk now (`_disk.disk_state`)."""
    return ("disk", filename)
