"""Closures as plain records: what the program store (`_store.py`) writes to disk, and the closure another
process rebuilds from them over its own live namespaces."""

from __future__ import annotations

import sys

from .._base import _origin
from ._disk import FileBacked
from ._model import Closure
from ._records import CellDep, ClassAttrDep, FuncDep, ValueDep
from ._scan import class_attr_check, function_check, value_check

_VALUE_TYPES = {"ValueDep": ValueDep, "ClassAttrDep": ClassAttrDep, "CellDep": CellDep}


def closure_records(closure: Closure) -> dict:
    """The dependency records of `closure` as plain lists (JSON): what `closure_from_records` rebuilds."""
    return {
        "functions": [list(dep) for dep in closure.functions],
        "values": [[type(dep).__name__, *dep] for dep in closure.values],
        "untracked": list(closure.untracked),
        "anonymous": list(closure.anonymous),
    }


def live_module_namespace(module: str) -> dict:
    """The live namespace of `module`: the notebook's user namespace for `__main__`; {} if not imported
    (every dependency in it then fails to resolve: drift)."""
    if module == "__main__":
        return _origin.user_namespaces()[0][1]
    ns = getattr(sys.modules.get(module), "__dict__", None)
    return ns if isinstance(ns, dict) else {}


def closure_from_records(records: dict) -> Closure:
    """A `Closure` over the live namespaces that checks the recorded fingerprints.

    The checks are the ones `Builder.build` makes at record time, with no identity snapshot: every value
    is compared by content fingerprint (there is no object of this process to be identical to)."""
    functions = [FuncDep(*r) for r in records["functions"]]
    values = [_VALUE_TYPES[r[0]](*r[1:]) for r in records["values"]]
    anonymous = set(records["anonymous"])
    spaces: dict = {}

    def ns_of(module):
        if module not in spaces:
            spaces[module] = live_module_namespace(module)
        return spaces[module]

    checks, files = [], []
    covered = {(v.module, v.name) for v in values if type(v) is ValueDep and v.fingerprint}
    for dep in functions:
        ns = ns_of(dep.module)
        anon = dep.qualified in anonymous
        if not anon and (dep.module, dep.qualname) not in covered:
            checks.append(function_check(dep, ns))
        if dep.file_digest is not None:
            files.append(FileBacked(dep, ns, anon))
    for dep in values:
        ns = ns_of(dep.module)
        if type(dep) is ValueDep:
            checks.append(value_check(dep, ns, None))
        elif type(dep) is ClassAttrDep and dep.qualified not in anonymous:
            checks.append(class_attr_check(dep, ns, None))
    return Closure(functions, values, records["untracked"], records["anonymous"], checks, files)
