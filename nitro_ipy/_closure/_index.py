"""The traceback recorder's lookup: the user functions a trace ran, read from its equations' tracebacks."""

from __future__ import annotations

import types
from typing import NamedTuple

from .._base import _memo, _origin, _world
from .._base._compat import equation_traceback, jaxpr_eqns, traceback_codes
from ._resolve import cell_contents, cells_of, nested, underlying


class Frame(NamedTuple):
    """A user function as a recording saw it run: its code, its globals, its cells' values (or None)."""

    code: types.CodeType
    ns: dict
    cells: list | None


class _Owner(NamedTuple):
    code: types.CodeType
    ns: dict
    cells: list | None
    is_function: bool  # held by a function object (not only nested in another function's code)


def _traceback_codes(jaxprs: list) -> dict[int, types.CodeType]:
    """User code objects on the Python stack when any equation (at any depth) was traced.

    JAX keeps a traceback per equation, cut at the traced function (cached inner jaxprs keep theirs):
    every user function that bound a primitive, directly or any number of calls down, is on one.
    `<module>` frames are never a function the program depends on."""
    codes, seen_tb = {}, {}
    get_verdict = _origin.verdicts.get  # the classification memo first: most frames are known files
    for eqn in jaxpr_eqns(jaxprs):
        tb = equation_traceback(eqn)
        if tb is not None and id(tb) not in seen_tb:
            seen_tb[id(tb)] = tb  # held, like the jaxprs: ids stay unique for the walk
            for code in traceback_codes(tb):
                if code.co_name == "<module>":
                    break
                verdict = get_verdict(code.co_filename)
                if verdict is None:
                    verdict = _origin.is_user_file(code.co_filename)
                if verdict and not (code.co_filename.startswith("<") and _origin.is_generated(code, None)):
                    codes[id(code)] = code
    return codes


def _add(value, owners: dict, depth: int = 0) -> None:
    """Index the code of the user functions `value` holds (a class's methods, two levels down)."""
    if isinstance(value, type):
        if depth < 2 and _origin.is_user_module(getattr(value, "__module__", "") or ""):
            for attr in list(vars(value).values()):
                _add(attr, owners, depth + 1)
        return
    if not callable(value) and not isinstance(value, (staticmethod, classmethod, property)):
        return
    for fn in underlying(value):
        if not _origin.is_user_function(fn):
            continue
        code, cells = fn.__code__, cells_of(fn)
        hit = owners.get(id(code))
        if hit is None or not hit.is_function:  # a function object beats a code nested in another function
            owners[id(code)] = _Owner(code, fn.__globals__, cells, True)
        elif hit.cells and any(a is not b for (_, a), (_, b) in zip(hit.cells, cells)):
            owners[id(code)] = _Owner(code, hit.ns, None, True)  # closures sharing this code: which ran?
        for inner in nested(code):
            owners.setdefault(id(inner), _Owner(inner, fn.__globals__, None, False))


def _add_namespace(ns: dict, owners: dict) -> None:
    for value in list(ns.values()):
        _add(value, owners)


class _FunctionIndex:
    """Where a user code object lives: the function holding it (for its globals and closure cells).

    A traceback names code objects only, so the functions are looked up among the user's namespaces
    (`_origin.user_namespaces`) and the classes defined there, nested code included. Rebuilt after a
    world bump, and once more when a code is not found (defined since). Holds the user's namespaces, so
    `cache_reset()` clears it."""

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.world = None
        self.owners: dict[int, _Owner] = {}  # id(code) -> its owner
        self.files: dict[str, dict] = {}  # module file -> its globals
        self.scanned: set[int] = set()  # ids of the namespaces indexed
        self.main: dict = {}  # the notebook's namespace (`__main__`), where a cell's code runs

    def lookup(self, code: types.CodeType, rebuilt: list) -> Frame | None:
        hit = self.owners.get(id(code))
        if (hit is None or hit.code is not code) and not rebuilt:
            rebuilt.append(True)
            self.build()
            hit = self.owners.get(id(code))
        return Frame(hit.code, hit.ns, hit.cells) if hit is not None and hit.code is code else None

    def fallback(self, code: types.CodeType) -> Frame:
        """A code no namespace holds (a lambda in a container, a closure made and dropped): the globals of
        its module file, or of the notebook for a cell, so its reads are still recorded. By name it
        resolves to nothing, so it is anonymous, covered through whatever holds it."""
        ns = self.files.get(code.co_filename)
        if ns is None:
            ns = self.main if _origin.is_cell_file(code.co_filename) else {"__name__": "?"}
        return Frame(code, ns, None)

    def fresh(self) -> _FunctionIndex:
        if self.world != _world.world():
            self.build()
        return self

    def build(self) -> None:
        self.world = _world.world()
        owners, files, scanned = {}, {}, set()
        namespaces = _origin.user_namespaces()
        for _name, ns in namespaces:
            filename = ns.get("__file__")
            if isinstance(filename, str):
                files.setdefault(filename, ns)
            _add_namespace(ns, owners)
            scanned.add(id(ns))
        self.owners, self.files, self.scanned, self.main = owners, files, scanned, namespaces[0][1]


_index = _FunctionIndex()
_memo.register(_index.clear)


def traceback_functions(jaxprs: list, roots: list) -> list[Frame]:
    """The user functions the traced jaxprs' tracebacks show.

    **Arguments:**
    - `jaxprs`: the jaxprs traced.
    - `roots`: the functions traced and the class attributes read through the compile view. What they
      reach (through closure cells, methods, partials and wrappers) is searched first, with the
      namespaces it lives in: that is where the hooks and their helpers are, whether or not a module
      lists it (cells exec'd into a namespace of their own). Then the user's modules (`_FunctionIndex`).

    **Returns:** a `Frame` per function.
    """
    codes = _traceback_codes(jaxprs)
    if not codes:
        return []
    index, rebuilt = _index.fresh(), []
    local: dict = {}
    scanned = set(index.scanned)
    stack, seen = list(roots), set()
    while stack and len(seen) < 256:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        for fn in underlying(obj):
            if _origin.is_user_function(fn):
                _add(fn, local)
                if id(fn.__globals__) not in scanned:
                    scanned.add(id(fn.__globals__))
                    _add_namespace(fn.__globals__, local)
            # the program functions nitro_ipy builds hold the hooks in their cells
            stack.extend(v for v in cell_contents(fn.__closure__) if callable(v))
    out = []
    for code in codes.values():
        hit = local.get(id(code))
        found = Frame(hit.code, hit.ns, hit.cells) if hit is not None and hit.code is code else index.lookup(code, rebuilt)
        out.append(found or index.fallback(code))
    return out
