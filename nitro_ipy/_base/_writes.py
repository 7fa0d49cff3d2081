"""Files written whole or not at all, temp files no killed writer leaves behind, and write errors said
in one line.

Every file nitro_ipy writes (a stored program, a JAX cache entry in the store, a checkpoint) is written
to a temp file in its directory and renamed into place (`atomic_write`): a reader sees the old file or
the new one, whole. A writer killed before the rename leaves its temp file; its name says who wrote it
(`.tmp-<pid>@<host>-<random>.part`), so the next start (`sweep`) removes exactly those no live process
can still be writing: this host's whose writer is gone, and any older than `STALE_S` (another host's,
a reused pid's, one of an older nitro_ipy whose names say no owner). A live writer's file is left alone.

A write that fails for want of room or permission (`ENOSPC`, `EDQUOT`, `EFBIG`, `EROFS`) is described
by `write_problem` (why, how much the file needed and how much is free), for the store's one line and
the checkpoint's error.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import tempfile
import threading
import time

from . import _events
from ._report import size_text

STALE_S = 3600.0  # a temp file this old is no live writer's (a program or checkpoint writes in seconds)
_HOST = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname() or "host")[:64]
_TEMP = re.compile(r"^\.tmp-(?:(\d+)@([A-Za-z0-9_.]+)-)?[A-Za-z0-9_]+\.part$")

_lock = threading.Lock()
swept: list = []  # (directory, name, bytes, why) of every file this process swept: `%nitro_stats` says it


def temp_prefix() -> str:
    """The start of this process's temp names: `.tmp-<pid>@<host>-` (the pid of now: a fork gets its own)."""
    return f".tmp-{os.getpid()}@{_HOST}-"


def atomic_write(path: str, data: bytes, *, reserve: bool = False, mode: int | None = None) -> None:
    """Write `data` to `path` whole or not at all: a temp file in the same directory (named for this
    process), fsync'ed, renamed over `path`. Raises the `OSError` of a failed write, the temp file gone.

    `reserve`: allocate the file's size before writing (`posix_fallocate`), so a full disk fails at
    once instead of after a partial write. `mode`: the file's permissions (mkstemp's 0600 otherwise)."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=temp_prefix(), suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            if reserve:
                allocate(f.fileno(), len(data))
            f.write(data)
            f.flush()
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        _events.signal("temp_written", tmp)
        os.replace(tmp, path)
    except BaseException:
        discard(tmp)
        raise


def allocate(fd: int, size: int) -> None:
    """Reserve `size` bytes for the open file `fd` (no-op where the platform has no `posix_fallocate`,
    or the file system does not support it): raises `ENOSPC`, `EDQUOT`, `EFBIG` now rather than midway."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None or size <= 0:
        return
    try:
        fallocate(fd, 0, size)
    except OSError as err:
        if err.errno in (errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)):
            return  # a file system without preallocation: the write itself says it
        raise


def discard(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):  # another user's process: alive
        return True
    return True


def sweep(directory: str, *, now: float | None = None) -> list:
    """Remove the temp files in `directory` no live process can still be writing (see the module's
    docstring); returns `(name, bytes)` of each one removed, and records them in `swept`."""
    now = time.time() if now is None else now
    gone = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return gone
    for e in entries:
        m = _TEMP.match(e.name)
        if m is None:
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        pid, host = m.group(1), m.group(2)
        old = now - st.st_mtime > STALE_S
        if pid is not None and host == _HOST:
            dead = not _alive(int(pid))
            why = "its writer (pid %s) is gone" % pid if dead else "older than an hour"
        else:
            dead, why = False, "older than an hour"
        if dead or old:
            try:
                os.unlink(e.path)
            except OSError:
                continue
            gone.append((e.name, st.st_size))
            record(directory, e.name, st.st_size, why)
    return gone


def record(directory: str, name: str, nbytes: int, why: str) -> None:
    """Note a file swept away (for `%nitro_stats`)."""
    with _lock:
        swept.append((directory, name, nbytes, why))


def swept_summary() -> str | None:
    """`swept at start: 3 files (234 KiB) left by killed writers` (by reason), or None."""
    with _lock:
        items = list(swept)
    if not items:
        return None
    partial = [s for s in items if s[3] != "truncated"]
    bad = [s for s in items if s[3] == "truncated"]
    parts = []
    if partial:
        parts.append(f"{len(partial)} temp file{'s' if len(partial) != 1 else ''} "
                     f"({size_text(sum(s[2] for s in partial))}) left by killed writers")
    if bad:
        parts.append(f"{len(bad)} empty or truncated JAX cache file{'s' if len(bad) != 1 else ''}")
    return "nitro_ipy swept: " + ", ".join(parts)


# ---------------------------------------------------------------- write errors
_WHY = {
    errno.ENOSPC: "no space left on the device (ENOSPC)",
    errno.EDQUOT: "your disk quota is used up (EDQUOT)",
    errno.EFBIG: "the file is larger than this process may write (EFBIG: `ulimit -f`)",
    errno.EROFS: "the file system is read-only (EROFS)",
}


def is_full(err: BaseException) -> bool:
    """Whether `err` is a write refused for want of room or permission to write (not a bug of ours)."""
    return isinstance(err, OSError) and err.errno in _WHY


def free_bytes(directory: str) -> int | None:
    """Bytes an unprivileged writer may still use on `directory`'s file system, or None."""
    try:
        st = os.statvfs(directory)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def write_problem(err: OSError, directory: str, needed: int | None) -> str:
    """`no space left on the device (ENOSPC): it needs 1.2 MiB, 300 KiB are free there` for a failed
    write of `needed` bytes into `directory`."""
    why = _WHY.get(err.errno) or f"{err.strerror or type(err).__name__} ({errno.errorcode.get(err.errno, err.errno)})"
    if err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return why  # read-only, or not a matter of room
    free = free_bytes(directory)
    need = f"it needs {size_text(needed)}" if needed else ""
    have = f"{size_text(free)} free there" if free is not None and err.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    if err.errno == errno.EFBIG:
        import resource  # POSIX only, where EFBIG comes from

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            have = f"the limit is {size_text(limit)}"
    more = ", ".join(p for p in (need, have) if p)
    return f"{why}: {more}" if more else why
