"""`Closure`: what one compiled program depends on, and the scans that say whether any of it moved."""

from __future__ import annotations

from ._disk import disk_plan, disk_state
from ._records import MISSING
from ._resolve import live_function, live_namespace
from ._scan import memoized, scan_plan
from ._snapshot import Ref


class Closure:
    """What one compiled program depends on, and the means to check whether any of it moved.

    **Attributes:**
    - `functions`: `FuncDep`s, executed by the trace or reachable from the globals it read.
    - `values`: `ValueDep`s (globals), `ClassAttrDep`s (compile-view attributes), `CellDep`s (cells).
    - `untracked`: `"module.name"` of values read that have no content fingerprint: their changes are
      invisible (`cache_reset()` is the escape hatch).
    - `anonymous`: names of dependencies that do not resolve by name (a module-level lambda, a class
      defined in a function); they are checked through what holds them.
    - `superseded`: functions the trace ran whose name meant other code already at record time (a
      method of a class redefined after the instance was made): the program is stale at birth.
    """

    __slots__ = ("functions", "values", "untracked", "anonymous", "superseded", "_checks", "_files", "_plan",
                 "_disk_plan")

    def __init__(self, functions=(), values=(), untracked=(), anonymous=(), checks=(), files=(), superseded=()):
        self.functions: tuple = tuple(functions)
        self.values: tuple = tuple(values)
        self.untracked: tuple = tuple(untracked)
        self.anonymous: tuple = tuple(anonymous)
        self.superseded: tuple = tuple(superseded)
        self._checks: tuple = tuple(checks)  # `_scan.Check`s
        self._files: tuple = tuple(files)  # `_disk.FileBacked`s
        # `_checks` and `_files` arranged for fast scans (`ScanPlan`, `DiskGroup`s), by the first scan.
        self._plan = self._disk_plan = None

    def drift(self, memo: dict) -> list[str]:
        """Qualified names of dependencies that moved or no longer resolve, sorted.

        `memo` is shared by every closure of one scan, so each dependency is resolved once per scan. A
        drifted nested function is not listed under its drifted enclosing function.
        """
        plan = self._plan
        if plan is None:
            plan = self._plan = scan_plan(self._checks)
        groups, rest = plan
        unsettled = []
        # Globals still bound to the very objects recorded, per namespace (looked up once), in tight
        # loops: no memo, no call but a weak reference's. This is `_snapshot.matches` inlined for the
        # two commonest snapshots; a global that fails it joins `rest` for the memoized checker, which
        # resolves it in full (an identity test is as cheap as a memo lookup, so sharing those answers
        # would not pay).
        for nskey, module, recorded, same, functions in groups:
            ns = memo.get(nskey)
            if ns is None:
                ns = live_namespace(module, recorded, memo, nskey)
            get = ns.get
            for name, held, check in same:
                # `held` is the recorded object (an atom, a tuple of atoms) or a weak reference to it. A
                # dead reference returns None, hence the `is not None` (a weakly held value is never None).
                value = get(name, MISSING)
                if value is held or (type(held) is Ref and value is not None and held() is value):
                    continue
                unsettled.append(check)
            for name, fn_ref, code_ref, qualname, check in functions:
                # A function without defaults or cells: the same object with the same code and name
                # (`%autoreload 2` swaps `__code__` in place). `__closure__` is read-only, and a swapped
                # code must have the same free variables, so there are no cells to look at.
                fn = get(name)
                if (
                    fn is not None
                    and fn_ref() is fn
                    and fn.__code__ is code_ref()
                    and fn.__defaults__ is None
                    and fn.__kwdefaults__ is None
                    and fn.__qualname__ == qualname
                ):
                    continue
                unsettled.append(check)
        out = None
        for check in (*unsettled, *rest):
            if not memoized(check, memo):
                out = out or set()
                out.add(check[3])  # an exact `Check` (see `_scan`): its `name`
        return _collapse(out) if out else []

    def disk_edits(self, memo: dict) -> list[str]:
        """Functions whose source file now defines them differently while the live code did not change.

        That is "edited on disk, not loaded yet" (`importlib.reload` or `%autoreload` will pick it up).
        Comment-only and blank-line edits do not count: the file is compiled and compared by code.
        """
        return list(self.disk_edit_versions(memo))

    def disk_edit_versions(self, memo: dict) -> dict[str, str | None]:
        """`disk_edits` with the digest of the file version each name was found edited in (None: the file
        cannot be read: deleted or moved), so an edit on disk is told from a second edit of the same name."""
        plan = self._disk_plan
        if plan is None:
            plan = self._disk_plan = disk_plan(self._files)
        out = None
        for filename, file_digest, files in plan:
            digest, version = disk_state(filename, memo)
            if digest == file_digest:
                continue  # the file is as recorded: none of its functions has a pending edit
            for dep, ns, anonymous in files:
                if not anonymous:
                    live = live_function(dep.module, ns, dep.qualname, memo)
                    if live is None or dep.fingerprint not in live:
                        continue  # the live code moved: that is drift, not a pending disk edit
                on_disk = version.codes(dep.qualname)
                if on_disk is None or dep.fingerprint not in on_disk:
                    out = out or {}
                    out[dep.qualified] = digest
        return {name: out[name] for name in _collapse(set(out))} if out else {}

    @property
    def checks(self) -> tuple:
        """The `_scan.Check` per dependency a drift scan re-resolves (for benchmarks and diagnostics)."""
        return self._checks

    @property
    def file_checks(self) -> tuple:
        """The `_disk.FileBacked` per file-backed function `disk_edits` looks at."""
        return self._files

    def names(self) -> list[str]:
        """Every dependency's qualified name, sorted (functions, globals, class attributes, cells)."""
        return sorted({d.qualified for d in (*self.functions, *self.values)})

    def files(self) -> set[str]:
        """The user source files the functions live in (notebook cells excluded): what to watch."""
        return {d.filename for d in self.functions if d.file_digest is not None}

    def __repr__(self):
        return (
            f"<Closure {len(self.functions)} functions, {len(self.values)} values, "
            f"{len(self.untracked)} untracked>"
        )


def _collapse(names: set) -> list[str]:
    """Sorted names, without `f.<locals>.g` when `f` itself is listed."""
    return sorted(n for n in names if not any(n.startswith(p + ".<locals>.") for p in _prefixes(n, names)))


def _prefixes(name: str, names: set):
    head = name
    while ".<locals>." in head:
        head = head.rpartition(".<locals>.")[0]
        if head in names:
            yield head
