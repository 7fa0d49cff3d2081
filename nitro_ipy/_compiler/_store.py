"""The program store: compiled programs on disk, loaded by a later process without tracing.

Every program the cache compiles is written to `<cache dir>/programs/<digest>.nxp` (`key_digest`: the
key and this process's validity): its serialized executable (`jax.experimental.serialize_executable`) and
the devices it runs on, its `Key`, its dependency closure as plain records, and what makes it valid here
(`validity()`: versions, backend, devices, CPU features, XLA flags, the fingerprint of nitro_ipy's own
program builders). On an in-memory miss, `load(key, info)` returns a
stored program with an equal key, valid here, whose recorded closure re-resolves clean against the live
code (`drift({}) == []`); anything else (stale, foreign, truncated, corrupt) is never loaded, and a bad
file is deleted and reported once.

A program that cannot be stored that way (a host callback, a constant JAX keeps out of the executable,
a dependency with no content fingerprint) is compiled through JAX's own persistent compilation cache in
`<cache dir>/xla`, so a restart still skips XLA (it traces again).

The directory: `set_cache_dir(path)`, else `NITRO_IPY_CACHE_DIR` (empty: off), else the per-user cache
directory (`platformdirs.user_cache_dir("nitro_ipy")`). A stored program is code this process runs, so
the store is private to this user, checked as ssh's StrictModes (`_trust.py`): a directory or file that
someone else owns or could write turns the store off for the process, said once. Nothing it reads calls
anything while it is read: the header (key, closure, trees, validity) is JSON, the executable's pickle
is checked name by name before it is unpickled, with those names alone.
"""

import hashlib
import json
import os
import platform
import struct
import sys
import threading
import time

import jax

from .. import _closure
from .._base import _report, _writes
from .._base._compat import (
    HOST_CALLBACK_PRIMITIVES,
    compiled_device_ids,
    deserialize_compiled,
    enable_jax_compilation_cache,
    jax_cache,
    jaxpr_eqns,
    serialize_compiled,
    use_jax_cache,
)
from .._base._errors import NitroValueError
from .._base._origin import PACKAGE_DIR
from .._base._report import Kind
from .._base._sharding import is_main_process
from . import _cache, _trust, _xla

ENV = "NITRO_IPY_CACHE_DIR"
ENV_MAX_BYTES = "NITRO_IPY_CACHE_MAX_BYTES"
DEFAULT_MAX_BYTES = 2 << 30  # least recently used programs go once the store holds more than this
FORMAT = 2  # 2: trees as JSON records, the executable's pickle alone in the payload
_MAGIC = b"NITROPS1"
_SUFFIX = ".nxp"

_UNSET = object()
_override = _UNSET  # what `set_cache_dir` chose (a path or None), else the environment decides
_max_bytes: int | None = None
_lock = threading.Lock()
_refused_dirs: set = set()  # roots refused (`_trust.Untrusted`): off for the process, each said once
_xla_checked: set = set()  # `xla/` directories whose entries were checked (once per process: private after)
_reported: set = set()  # bad files said once per process
_fallbacks: set = set()  # keys said once as going through JAX's cache
_swept: set = set()  # store directories (resolved) swept of what killed writers left, once per process
loaded_count = 0  # programs this process loaded from disk
# Executables `_prefetch` deserialized before anyone asked: file name -> `Preloaded`. `load` takes one
# whose payload is the file's (its checks run as for any load), and waits for one still loading.
preloaded: dict = {}
preloaded_taken = 0  # loads that took a preloaded executable


class Preloaded:
    """One executable `_prefetch` loads in the background: `done` set once `compiled` (None: it failed)."""

    def __init__(self):
        self.done, self.sha, self.compiled = threading.Event(), None, None


def claim_preloads(names) -> list:
    """`(name, Preloaded)` for each of `names` not loading or loaded already, registered for `load` to take;
    executables loaded earlier that no load took (a handle that never asked) are dropped first."""
    with _lock:
        for name in [n for n, slot in preloaded.items() if slot.done.is_set()]:
            del preloaded[name]
        todo = [(n, Preloaded()) for n in names if n not in preloaded]
        preloaded.update(todo)
    return todo


def clear_preloaded() -> None:
    with _lock:
        preloaded.clear()


def program_file(key) -> str:
    """The name of `key`'s file in the programs directory."""
    return key_digest(key) + _SUFFIX


def is_program_file(name: str) -> bool:
    return name.endswith(_SUFFIX) and os.sep not in name


def foreign(header: dict) -> bool:
    """Whether a stored file's header says it was written for another setup (`validity`)."""
    return bool(_mismatch(header.get("validity") or {}))


def _take_preloaded(name: str, sha: str):
    """The executable `_prefetch` loaded from file `name` with payload `sha` (waiting while it loads), or None."""
    global preloaded_taken
    with _lock:
        slot = preloaded.pop(name, None)
    if slot is None:
        return None
    slot.done.wait()
    if slot.compiled is None or slot.sha != sha:
        return None
    with _lock:
        preloaded_taken += 1
    return slot.compiled


# ---------------------------------------------------------------- where
def set_cache_dir(path, *, max_bytes: int | None = None) -> None:
    """Store compiled programs under `path` (created, private to this user); `None` turns the store off.

    **Arguments:**
    - `path`: a directory, or None. Overrides `NITRO_IPY_CACHE_DIR`.
    - `max_bytes`: the size cap (default 2 GiB, or `NITRO_IPY_CACHE_MAX_BYTES`); least recently used
      programs are evicted beyond it.

    Raises `NitroValueError` for a directory others can write to.
    """
    global _override, _max_bytes
    if path is not None:
        path = os.path.abspath(os.path.expanduser(os.fspath(path)))
        problem = _check_dir(path)
        if problem:
            raise NitroValueError(problem)
        _refused_dirs.discard(path)  # checked again just now: on, for this process too
    _override = path
    _max_bytes = max_bytes


def cache_dir() -> str | None:
    """The store's directory as configured now (None: off), whether or not it exists yet."""
    if _override is not _UNSET:
        return _override
    env = os.environ.get(ENV)
    if env is not None:
        return os.path.abspath(os.path.expanduser(env)) if env.strip() else None
    import platformdirs

    return platformdirs.user_cache_dir("nitro_ipy")


def max_bytes() -> int:
    if _max_bytes is not None:
        return _max_bytes
    try:
        return int(os.environ.get(ENV_MAX_BYTES, DEFAULT_MAX_BYTES))
    except ValueError:
        return DEFAULT_MAX_BYTES


def _check_dir(path: str) -> str | None:
    """Create `path` (mode 0700) if missing and check it, its parents, `programs/` and `xla/` (`_trust`);
    the one line saying why it is refused, or None."""
    try:
        _check_store(path)
    except _trust.Untrusted as err:
        return str(err)
    except OSError as err:
        return f"nitro_ipy: the program store `{path}` cannot be used ({err}); programs compile as usual."
    return None


def _check_store(root: str) -> None:
    if not os.path.isdir(root):
        os.makedirs(root, mode=0o700, exist_ok=True)
    real = os.path.realpath(root)  # a store reached through a link is checked where it is
    _trust.check_parents(real)
    _trust.private_dir(root, real, create=False, top=True)
    for sub in ("programs", "xla"):
        _trust.private_dir(root, os.path.join(real, sub), create=True)


def _turn_off(root: str, text: str) -> None:
    """The store is off for this process (said once per directory), JAX's cache in it too."""
    with _lock:  # a background compile (compile ahead) may find the same fault at the same moment
        first = root not in _refused_dirs
        _refused_dirs.add(root)
    ours = jax_cache()
    if isinstance(ours, _xla.StoreCache):
        ours.off = True
    if first:
        _report.emit(Kind.STORE_OFF, text=text)


WRITE_FAILED = (
    "nitro_ipy: the program store `{root}` could not be written: {problem}. The store is off for this "
    "process: training goes on, programs compile as usual and are not kept for a restart. Fix: free "
    "space there, or point `NITRO_IPY_CACHE_DIR` (or `nitro_ipy.set_cache_dir`) at a writable disk."
)


def _write_failed(err: OSError, directory: str, nbytes: int) -> None:
    """A write into the store failed (a full disk, a quota, a file size limit, a read-only mount): said
    in one line, once, and the store (JAX's cache in it too) is off for the process."""
    root = cache_dir()
    if root is not None:
        _turn_off(root, WRITE_FAILED.format(root=root, problem=_writes.write_problem(err, directory, nbytes)))


def _sweep(real: str) -> None:
    """What killed writers left in the store: temp files no live process writes (`_writes.sweep`), and
    JAX cache files that are empty or truncated (`_xla.verify`: each file read once), removed before
    JAX reads them. Once per directory per process."""
    if real in _swept:
        return
    _swept.add(real)
    _writes.sweep(os.path.join(real, "programs"))
    xla = os.path.join(real, "xla")
    _writes.sweep(xla)
    _xla.verify(xla)


def active_dir() -> str | None:
    """The programs directory when the store is on and usable, else None (a refusal is said once, and
    keeps the store off for the process: `set_cache_dir` checks again)."""
    root = cache_dir()
    if root is None or root in _refused_dirs:
        return None
    problem = _check_dir(root)
    if problem:
        _turn_off(root, problem)
        return None
    real = os.path.realpath(root)
    _sweep(real)
    return os.path.join(real, "programs")


def _xla_dir(programs: str) -> str | None:
    """`<cache dir>/xla`, JAX's persistent cache, once every file in it is checked (JAX reads them without
    checking; this process's own writes there are private); None when one is refused (the store is off)."""
    xla = os.path.join(os.path.dirname(programs), "xla")
    if xla not in _xla_checked:
        try:
            _trust.check_entries(cache_dir() or xla, xla)
        except _trust.Untrusted as err:
            _turn_off(cache_dir(), str(err))
            return None
        _xla_checked.add(xla)
    return xla


# ---------------------------------------------------------------- what makes a stored program valid
def _cpu_features() -> str:
    """A digest of this CPU's feature flags (an executable compiled for AVX-512 must not run without it)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    text = f"{platform.machine()}|{platform.processor()}|{' '.join(sorted(flags.split()))}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _package_fingerprint() -> str:
    """nitro_ipy's own source: its program builders are library code, in no closure."""
    h = hashlib.sha256()
    for root, _dirs, files in sorted(os.walk(PACKAGE_DIR)):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path, "rb") as f:
                    h.update(os.path.relpath(path, PACKAGE_DIR).encode() + b"\0" + f.read())
    return h.hexdigest()[:16]


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except Exception:
        return None


_validity: dict | None = None


def validity() -> dict:
    """What a stored program must match to be loaded here (computed once per process)."""
    global _validity
    if _validity is None:
        devices = jax.devices()
        _validity = {
            "format": FORMAT,
            "python": "%d.%d" % sys.version_info[:2],
            "versions": {d: _version(d) for d in ("jax", "jaxlib", "optax", "numpy", "flax", "equinox")},
            "nitro_ipy": _package_fingerprint(),
            "backend": jax.default_backend(),
            "platform_version": getattr(devices[0].client, "platform_version", ""),
            "devices": sorted({d.device_kind for d in devices}),
            "device_count": len(devices),
            "cpu": _cpu_features(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
        }
    return _validity


def _mismatch(recorded: dict) -> str | None:
    """Which validity field differs ("jaxlib 0.4.30 -> 0.10.2"), or None."""
    here = validity()
    for field in here:
        if recorded.get(field) != here[field]:
            if field == "versions":
                for d, v in here[field].items():
                    old = (recorded.get(field) or {}).get(d)
                    if old != v:
                        return f"written by {d} {old}, this is {d} {v}"
            if field == "cpu":
                return "written on a CPU with other features"
            return f"written with {field} {recorded.get(field)!r}, this is {here[field]!r}"
    return None


# ---------------------------------------------------------------- files
def key_digest(key) -> str:
    """The file name of `key`'s program here: a digest of the key's repr (tuples of strings: stable) and
    of `validity()`. Processes that differ in what validity records (device count, Python, versions,
    XLA flags) compile the same key to programs that are not interchangeable; each gets a file of its
    own, so two of them sharing a store never refuse and delete each other's programs. A file left by an
    environment that is gone goes with the least recently used (`evict`)."""
    here = json.dumps(validity(), sort_keys=True)
    return hashlib.sha256(f"{key!r}\n{here}".encode()).hexdigest()[:32]


def unstorable_reason(jaxpr, closure) -> str | None:
    """Why a program traced to `jaxpr` cannot be stored and loaded elsewhere, or None."""
    if closure is None:
        return "its dependencies were not recorded"
    if closure.untracked:
        return f"it reads values with no content fingerprint ({', '.join(closure.untracked[:3])})"
    for eqn in jaxpr_eqns([jaxpr]):
        if eqn.primitive.name in HOST_CALLBACK_PRIMITIVES:
            return f"it calls back into Python (`{eqn.primitive.name}`)"
    return None


def _jax_cache_here(xla: str) -> None:
    """JAX's cache writes `xla` whole (`_xla.StoreCache`), not in place."""
    current = jax_cache()
    if not (isinstance(current, _xla.StoreCache) and current.path == xla and not current.off):
        programs = os.path.join(os.path.dirname(xla), "programs")
        use_jax_cache(_xla.StoreCache(xla, _write_failed, lambda: evict(programs)))


def activate() -> bool:
    """Called before a handle's setup runs: check the directory, and point JAX's own persistent cache
    at `<cache dir>/xla` for the process, so the eager operations of setup (`init`'s random draws, the
    optimizer state's zeros) skip XLA after a restart too; they are most of a restart otherwise. A
    directory the user gave JAX is left alone. Returns True when the store is on."""
    programs = active_dir()
    xla = None if programs is None else _xla_dir(programs)
    if xla is None:
        return False
    if enable_jax_compilation_cache(xla, max_bytes()):
        _jax_cache_here(xla)
    return True


def fallback(key, reason: str) -> bool:
    """Route the next XLA compile through JAX's own persistent cache (in the store's directory), and say
    so once per program. Returns True when JAX's cache is on."""
    programs = active_dir()
    xla = None if programs is None else _xla_dir(programs)
    if xla is None:
        return False
    on = enable_jax_compilation_cache(xla, max_bytes())
    if on:
        _jax_cache_here(xla)
    if key not in _fallbacks:
        _fallbacks.add(key)
        _report.emit(Kind.STORE_FALLBACK, program=key.kind, reason=reason, path=xla if on else None)
    return on


def save(entry) -> bool:
    """Write `entry` to the store (atomically); False when the store is off or the program cannot be
    serialized (then JAX's persistent cache takes it: `fallback`). Under `jax.distributed` only process 0
    writes (`_sharding.is_main_process`): the others compiled the same program under the same key."""
    programs = active_dir()
    if programs is None or entry.closure is None or not is_main_process() or not entry.key.context.storable:
        return False
    try:
        payload, in_tree, out_tree = serialize_compiled(entry.call)
    except Exception as err:
        fallback(entry.key, f"its executable does not serialize: {type(err).__name__}: {err}")
        return False
    try:  # what `load` accepts, checked before writing: a file this would refuse is never written
        _trust.check_executable(payload)
        trees = {"in": _trust.tree_records(in_tree), "out": _trust.tree_records(out_tree)}
    except (_trust.Refused, _trust.Unrecordable) as err:
        fallback(entry.key, str(err) if isinstance(err, _trust.Unrecordable) else f"its executable {err}")
        return False
    header = {
        "validity": validity(),
        "key": repr(entry.key),
        "kind": entry.kind,
        "closure": _closure.closure_records(entry.closure),
        "trees": trees,
        "meta": {
            "trace_s": entry.trace_s,
            "compile_s": entry.compile_s,
            "operations": entry.operations,
            "constants": [list(c) for c in entry.constants],
            "compiler_options": entry.compiler_options,
            "devices": compiled_device_ids(entry.call),  # loaded onto these, not every device there is
        },
        "payload": {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()},
        "written": time.time(),
    }
    head = json.dumps(header, sort_keys=True).encode()
    blob = _MAGIC + struct.pack(">Q", len(head)) + head + payload
    path = os.path.join(programs, program_file(entry.key))
    try:  # a temp file named for this process, renamed into place: readers see old or new, whole
        _writes.atomic_write(path, blob, reserve=True)
    except OSError as err:  # a full or read-only disk: said once, the store goes off, nothing breaks
        _write_failed(err, programs, len(blob))
        return False
    evict(programs)
    return True


class BadFile(Exception):
    """A stored file that must not be loaded: truncated, corrupt, foreign."""


def read_header(blob: bytes) -> tuple[dict, bytes]:
    """`(header, payload)` of a stored file, checked for shape and integrity (never unpickles)."""
    if not blob.startswith(_MAGIC):
        raise BadFile("not a nitro_ipy program file")
    if len(blob) < len(_MAGIC) + 8:
        raise BadFile("truncated")
    (n,) = struct.unpack(">Q", blob[len(_MAGIC) : len(_MAGIC) + 8])
    start = len(_MAGIC) + 8
    if n > len(blob) - start:
        raise BadFile("truncated")
    try:
        header = json.loads(blob[start : start + n])
        expected = header["payload"]
    except Exception:
        raise BadFile("corrupt header") from None
    payload = blob[start + n :]
    if len(payload) != expected.get("size"):
        raise BadFile("truncated")
    if hashlib.sha256(payload).hexdigest() != expected.get("sha256"):
        raise BadFile("corrupt (checksum mismatch)")
    return header, payload


def _refuse(path: str, reason: str) -> None:
    """Delete a bad file, and say so once per file and reason."""
    try:
        os.unlink(path)
    except OSError:
        pass
    if (path, reason) not in _reported:
        _reported.add((path, reason))
        _report.emit(Kind.STORE_REFUSED, name=os.path.basename(path), reason=reason)


def forget(key, reason: str) -> None:
    """Delete `key`'s stored program, which loaded but must not be used (`_compile.FirstRun`), saying
    why once."""
    programs = active_dir()
    if programs is not None:
        _refuse(os.path.join(programs, program_file(key)), reason)


def load(key, info: dict | None = None, why: str | None = None):
    """The stored program for `key` as a `_cache.Entry` (origin "disk"), or None.

    None when nothing is stored, when its closure drifted from the live code (the file stays: an undo
    makes it valid again), when the file is bad (deleted and reported), or when it is not private to this
    user (`_trust`: the store turns off). The executable is unpickled last, after every other check,
    resolving only the globals JAX's serializer writes."""
    global loaded_count
    programs = active_dir()
    if programs is None or not key.context.storable:  # (a configuration that means nothing elsewhere)
        return None
    name = program_file(key)
    path = os.path.join(programs, name)
    t0 = time.perf_counter()
    try:
        blob = _trust.read_private(cache_dir(), programs, name)
    except _trust.Untrusted as err:
        _turn_off(cache_dir(), str(err))
        return None
    except OSError:
        return None
    if blob is None:
        return None
    try:
        header, payload = read_header(blob)
        problem = _mismatch(header.get("validity") or {})
        if problem:
            raise BadFile(f"foreign: {problem}")
        if header.get("key") != repr(key):
            return None  # a digest collision, or another key's file: not ours to judge
        closure = _closure.closure_from_records(header["closure"])
        meta = header["meta"]
        trees = header["trees"]
    except BadFile as err:
        _refuse(path, str(err))
        return None
    except Exception as err:
        _refuse(path, f"unreadable ({type(err).__name__}: {err})")
        return None
    if closure.drift({}):
        return None  # stale: compiled against code that is not the live code
    try:  # nothing of the payload is interpreted before every name it asks for is known and allowed
        in_tree, out_tree = _trust.tree_from_records(trees["in"]), _trust.tree_from_records(trees["out"])
        _trust.check_executable(payload)
    except _trust.Refused as err:
        _refuse(path, str(err))
        return None
    except Exception as err:
        _refuse(path, f"unreadable ({type(err).__name__}: {err})")
        return None
    try:
        compiled = _take_preloaded(name, (header.get("payload") or {}).get("sha256"))
        if compiled is None:
            compiled = deserialize_compiled(payload, in_tree, out_tree, meta.get("devices"),
                                            find_class=_trust.find_executable_class)
    except _trust.Refused as err:
        _refuse(path, str(err))
        return None
    except Exception as err:
        _refuse(path, f"does not load ({type(err).__name__}: {err})")
        return None
    try:
        os.utime(path, follow_symlinks=False)  # least recently *used*: a load counts as a use
    except OSError:
        pass
    with _lock:
        loaded_count += 1
    return _cache.Entry(
        key, compiled, 0.0, time.perf_counter() - t0, closure, info or {}, why,
        compiler_options=meta.get("compiler_options") or {}, operations=meta.get("operations", 0),
        constants=tuple(tuple(c[:1]) + (tuple(c[1]),) + tuple(c[2:]) for c in meta.get("constants", ())),
        origin="disk",
    )


# ---------------------------------------------------------------- size, eviction, clearing
def _files(programs: str) -> list:
    out = []
    try:
        with os.scandir(programs) as it:
            for e in it:
                if e.name.endswith(_SUFFIX):
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    out.append((st.st_mtime, st.st_size, e.path))
    except OSError:
        pass
    return out


def _xla_files(programs: str) -> list:
    """JAX's own cache files next to the programs (`<cache dir>/xla`): they count toward the cap too, at
    any depth (on a GPU, JAX keeps XLA's autotuning cache in a directory inside it). Links are never
    followed."""
    out = []
    stack = [os.path.join(os.path.dirname(programs), "xla")]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                    elif e.is_file(follow_symlinks=False) and not e.name.startswith("."):  # not a writer's temp file
                        out.append((max(st.st_mtime, st.st_atime), st.st_size, e.path))
        except OSError:
            pass
    return out


def evict(programs: str, cap: int | None = None) -> int:
    """Delete least recently used programs (and JAX cache files) until the store holds at most `cap`
    bytes; returns how many files went."""
    cap = max_bytes() if cap is None else cap
    files = _files(programs) + _xla_files(programs)
    total = sum(size for _, size, _ in files)
    removed = 0
    for _mtime, size, path in sorted(files):
        if total <= cap:
            break
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass
        total -= size
    return removed


class StoreStats:
    """The store's directory, program count and size (what `%nitro_stats` says)."""

    def __init__(self, path, count, nbytes, loaded):
        self.path, self.count, self.nbytes, self.loaded = path, count, nbytes, loaded

    def __repr__(self):
        if self.path is None:
            return "nitro_ipy program store: off"
        return (
            f"nitro_ipy program store: {self.count} program{'s' if self.count != 1 else ''}, "
            f"{_report.size_text(self.nbytes)} of {_report.size_text(max_bytes())} in {self.path} "
            f"({self.loaded} loaded from disk this session)"
        )


def store_stats() -> StoreStats:
    root = cache_dir()
    if root is None or root in _refused_dirs or not os.path.isdir(os.path.join(root, "programs")):
        return StoreStats(root if root is not None and root not in _refused_dirs else None, 0, 0, loaded_count)
    files = _files(os.path.join(root, "programs"))
    return StoreStats(root, len(files), sum(s for _, s, _ in files), loaded_count)


def clear() -> int:
    """Delete every stored program (and JAX's cache files in the store's directory); returns how many
    program files went."""
    root = cache_dir()
    if root is None or not os.path.isdir(root):
        return 0
    removed = 0
    d = os.path.join(root, "programs")
    if os.path.isdir(d):
        for name in os.listdir(d):
            try:
                os.unlink(os.path.join(d, name))
                removed += name.endswith(_SUFFIX)
            except OSError:
                pass
    for _mtime, _size, path in _xla_files(d):  # JAX's, at any depth
        try:
            os.unlink(path)
        except OSError:
            pass
    return removed
