"""JAX's own persistent compilation cache inside the program store (`<cache dir>/xla`), written whole.

JAX's file cache (`jax._src.lru_cache.LRUCache`, JAX 0.10 to 0.12) writes each entry in place
(`<key>-cache`, `Path.write_bytes`): a process killed mid-write, or a full disk, leaves an empty or
truncated file, which every later process reads and warns about ("Error reading persistent compilation
cache entry ... incomplete or truncated stream"), run after run. So:

- the store gives JAX a cache of its own (`StoreCache`, installed by `_compat.use_jax_cache`): an entry
  goes to a temp file named for this process and is renamed into place (`_writes.atomic_write`); a
  write that fails (full disk, quota, file size limit, read-only) is said once by the store, which turns
  itself off, and this cache with it. The store's size cap covers these files (`_store.evict`): a read
  touches a file's time, so the least recently used go first;
- at the store's first use in a process, `verify` removes the `-cache` files no reader could use:
  empty, or a compressed stream that ends early (zlib's and zstd's own framing say whether a stream is
  whole). A file known whole is read-only (`WHOLE`, mode 0400: `StoreCache` writes its files so, and
  `verify` marks those it found whole), and is never read again: a restart pays the check once per
  file written in place, by an older nitro_ipy or a JAX this store could not give its cache to (about
  25 ms a MiB on a loaded 2-core machine). A removed file compiles again, that is all.
"""

from __future__ import annotations

import os
import pathlib
import stat
import zlib

from .._base import _writes

CACHE_SUFFIX = "-cache"  # JAX's names: `<key>-cache`, and `<key>-atime` when its own eviction is on
ATIME_SUFFIX = "-atime"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
WHOLE = 0o400  # the mode of a cache file known whole: written atomically, or checked (JAX's are 0644/0664)


class StoreCache:
    """JAX's cache interface (`get`, `put`) over `path`, writing each entry atomically; `on_error(err,
    directory, nbytes)` hears of a failed write, after which the cache is off (gets miss, puts do
    nothing); `on_write()` of each entry written (the store keeps its size cap)."""

    def __init__(self, path: str, on_error, on_write=None):
        self._path = pathlib.Path(path)  # the attribute JAX reads (`reset_cache` logs it)
        self.path = path
        self.on_error, self.on_write = on_error, on_write
        self.off = False

    def get(self, key: str) -> bytes | None:
        if self.off or not key:
            return None
        name = os.path.join(self.path, key + CACHE_SUFFIX)
        try:
            with open(name, "rb") as f:
                data = f.read()
        except OSError:
            return None
        try:
            os.utime(name)  # least recently used first, whatever the mount's atime policy
        except OSError:
            pass
        return data

    def put(self, key: str, value: bytes) -> None:
        if self.off or not key:
            return
        name = os.path.join(self.path, key + CACHE_SUFFIX)
        if os.path.exists(name):
            return
        try:
            _writes.atomic_write(name, value, reserve=True, mode=WHOLE)
        except OSError as err:
            self.off = True
            self.on_error(err, self.path, len(value))
            return
        if self.on_write is not None:
            self.on_write()

    def clear(self) -> None:
        pass


def _zlib_whole(data: bytes) -> bool:
    d = zlib.decompressobj()
    try:
        while data and not d.eof:
            d.decompress(data, 1 << 20)  # bounded output: a check, not a copy of the executable
            data = d.unconsumed_tail
    except zlib.error:
        return False
    return d.eof


def _zstd_whole(data: bytes) -> bool | None:
    """True/False where this Python can read zstd (as JAX picks it), None where it cannot judge."""
    try:
        from compression import zstd  # Python 3.14+

        try:
            zstd.decompress(data)
            return True
        except zstd.ZstdError:
            return False
    except ImportError:
        pass
    try:
        import zstandard
    except ImportError:
        return None
    try:
        zstandard.ZstdDecompressor().decompress(data)
        return True
    except zstandard.ZstdError:
        return False


def whole(data: bytes) -> bool:
    """Whether a JAX cache entry's bytes are a whole compressed stream (an unknown format passes)."""
    if not data:
        return False
    if data[:4] == _ZSTD_MAGIC:
        return _zstd_whole(data) is not False
    if len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0:  # a zlib header
        return _zlib_whole(data)
    return True


def verify(path: str) -> list:
    """Remove the `-cache` files in `path` that are empty or truncated (and their `-atime` companions),
    marking the whole ones `WHOLE`; files already so marked are not read. Returns `(name, bytes)` of each
    removed, recorded in `_writes.swept`."""
    gone = []
    try:
        entries = list(os.scandir(path))
    except OSError:
        return gone
    for e in entries:
        if not e.name.endswith(CACHE_SUFFIX):
            continue
        try:
            st = e.stat(follow_symlinks=False)
            if stat.S_IMODE(st.st_mode) == WHOLE or not stat.S_ISREG(st.st_mode):
                continue
            with open(e.path, "rb") as f:
                data = f.read()
        except OSError:
            continue
        if whole(data):
            try:
                os.chmod(e.path, WHOLE)
            except OSError:
                pass
            continue
        _writes.discard(e.path)
        _writes.discard(e.path[: -len(CACHE_SUFFIX)] + ATIME_SUFFIX)
        gone.append((e.name, st.st_size))
        _writes.record(path, e.name, st.st_size, "truncated")
    return gone
