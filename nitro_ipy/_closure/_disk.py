"""Source files as they are on disk now: "edited on disk, not loaded yet" without re-reading every file."""

from __future__ import annotations

import hashlib
import os
from typing import NamedTuple

from .._base._fingerprint import code_fingerprint
from .._base._memo import Memo
from ._records import MISSING, FuncDep, disk_key
from ._resolve import nested


def _file_bytes(filename: str) -> bytes | None:
    try:
        with open(filename, "rb") as f:
            return f.read()
    except OSError:
        return None


def _digest(data: bytes | None) -> str | None:
    return None if data is None else hashlib.blake2b(data, digest_size=16).hexdigest()


def file_digest(filename: str) -> str | None:
    """A digest of the file's bytes now, or None when it cannot be read."""
    return _digest(_file_bytes(filename))


# digest -> {qualname: code fingerprints} of a source file version (None: it does not compile).
_disk_versions = Memo("compiled source file versions", maxsize=64)
# filename -> ((mtime_ns, size, inode), state): a file whose stat did not move is not read again.
_disk_stamps = Memo("source file stats")


def disk_state(filename: str, memo: dict) -> tuple:
    """The file as it is on disk now, memoized per scan; a file whose `os.stat` did not move is not read.

    **Arguments:**
    - `filename`: a user source file.
    - `memo`: the scan memo.

    **Returns:** `(digest, LazyVersion)`; the digest is None when the file cannot be read, the version's
    codes when it cannot be compiled (deleted, mid-edit syntax error). Each file version is compiled
    once, whatever the number of scans.
    """
    key = disk_key(filename)
    state = memo.get(key)
    if state is None:
        try:
            st = os.stat(filename)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            stamp = None
        known = _disk_stamps.get(filename)
        if stamp is not None and known is not None and known[0] == stamp:
            state = known[1]  # unchanged since the last scan by stat: no read, no hash
        else:
            data = _file_bytes(filename)
            digest = _digest(data)
            state = (digest, LazyVersion(filename, data, digest))
            if stamp is not None:
                _disk_stamps[filename] = (stamp, state)
        memo[key] = state
    return state


class LazyVersion:
    """Compiles a file version only when a function's on-disk code is actually asked for."""

    __slots__ = ("filename", "data", "digest")

    def __init__(self, filename, data, digest):
        self.filename, self.data, self.digest = filename, data, digest

    def codes(self, qualname: str) -> frozenset | None:
        table = _disk_versions.get(self.digest, MISSING)
        if table is MISSING:
            table = _disk_versions[self.digest] = _compile_version(self.filename, self.data)
        return None if table is None else table.get(qualname)


def _compile_version(filename: str, data: bytes | None) -> dict[str, frozenset] | None:
    if data is None:
        return None
    try:
        module_code = compile(data, filename, "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        return None
    table: dict[str, set] = {}
    for code in nested(module_code):
        table.setdefault(code.co_qualname, set()).add(code_fingerprint(code))
    return {q: frozenset(fps) for q, fps in table.items()}


class FileBacked(NamedTuple):
    """A function that lives in a source file, as `Closure.disk_edits` checks it."""

    dep: FuncDep
    ns: dict  # the namespace it ran in
    anonymous: bool  # it does not resolve by name (checked on disk only)


class DiskGroup(NamedTuple):
    """The file-backed functions of one source file, with the file's digest at record time."""

    filename: str
    digest: str | None
    entries: tuple  # FileBacked


def disk_plan(files: tuple) -> tuple:
    """`Closure._files` grouped by source file: a `DiskGroup` per file."""
    groups: dict = {}
    for entry in files:
        dep = entry.dep
        groups.setdefault((dep.filename, dep.file_digest), []).append(entry)
    return tuple(DiskGroup(filename, digest, tuple(entries)) for (filename, digest), entries in groups.items())
