"""Loading a restarted process's programs from the store before its handle asks for them.

A handle's first epoch after a restart waits for its programs to load (a 120-layer MLP's gradient and
optimizer programs: 0.25 s of executable deserialization, a third of that epoch), while the handle's own
setup before its first step (the user's `init`, run eagerly, and the optimizer's setup check) keeps the
training thread busy for as long. Deserializing leaves the GIL free, so the two can overlap.

- `note(group, key)`: a handle of experiment class `group` took the stored program of `key`. The
  store keeps, per group, the programs its handles took most recently (`<digest>.nxg` beside the
  programs: JSON, the last `KEEP` program file names, in the order first taken), rewritten only when it
  changes.
- `start(group)`: at a handle's creation, a background thread loads those programs' executables in that
  order (each file read and checked as `_store.load` checks it before unpickling anything) into
  `_store.preloaded`. When the handle asks, `_store.load` runs its checks on the file as for any load
  (a program whose code drifted is still never served) and takes the preloaded executable of the same
  payload instead of deserializing it again, waiting for one still loading.

Nothing is said: a file that fails a check is left for `_store.load` to refuse and report when (if) a
handle asks for it. Executables loaded for programs no handle asks for are dropped at the next `start`.
"""

import hashlib
import json
import os
import threading

from .._base import _memo, _writes
from .._base._compat import deserialize_compiled
from .._base._sharding import is_main_process
from . import _store, _trust

KEEP = 8  # programs remembered per experiment class
_SUFFIX = ".nxg"
_noted: set = set()  # (programs dir, group, program file) noted by this process


def _index_name(group: str) -> str:
    return hashlib.sha256(group.encode()).hexdigest()[:32] + _SUFFIX


def _read(programs: str, group: str) -> list:
    """The program file names remembered for `group` (empty when none are, or the index is unreadable)."""
    try:
        blob = _trust.read_private(_store.cache_dir(), programs, _index_name(group))
        record = json.loads(blob) if blob else {}
    except (_trust.Untrusted, OSError, ValueError):
        return []
    names = record.get("programs") if isinstance(record, dict) and record.get("group") == group else None
    if not isinstance(names, list):
        return []
    return [n for n in names if isinstance(n, str) and _store.is_program_file(n)][-KEEP:]


def note(group: str, key) -> None:
    """A handle of experiment class `group` took `key`'s program, which the store holds."""
    programs = _store.active_dir()
    if programs is None or not is_main_process() or not key.context.storable:
        return
    name = _store.program_file(key)
    if (programs, group, name) in _noted:
        return
    _noted.add((programs, group, name))
    names = _read(programs, group)
    if name in names:
        return
    names = [*names, name][-KEEP:]
    try:
        _writes.atomic_write(os.path.join(programs, _index_name(group)),
                             json.dumps({"group": group, "programs": names}).encode())
    except OSError:  # a full or read-only disk: the next restart loads on demand, as before
        pass


def start(group: str) -> None:
    """Load `group`'s remembered programs in a background thread (nothing when the store is off)."""
    programs = _store.active_dir()
    if programs is None:
        return
    # Not what a handle of this process already took: the in-memory cache serves it (a sweep making a
    # handle per trial would load the same executables again for each).
    names = [n for n in _read(programs, group) if (programs, group, n) not in _noted]
    todo = _store.claim_preloads(names)
    if todo:
        threading.Thread(target=_load_all, args=(programs, todo), name="nitro_ipy-prefetch", daemon=True).start()


def _load_all(programs: str, todo: list) -> None:
    for name, slot in todo:
        try:
            slot.sha, slot.compiled = _load(programs, name)
        except Exception:  # noqa: BLE001 - any failure leaves the file to `_store.load`, which says why
            slot.sha = slot.compiled = None
        finally:
            slot.done.set()


def _load(programs: str, name: str) -> tuple:
    """(payload sha256, executable) of file `name`, after the checks `_store.load` makes before unpickling."""
    blob = _trust.read_private(_store.cache_dir(), programs, name)
    if blob is None:
        return None, None
    header, payload = _store.read_header(blob)
    if _store.foreign(header):
        return None, None
    trees = header["trees"]
    in_tree, out_tree = _trust.tree_from_records(trees["in"]), _trust.tree_from_records(trees["out"])
    _trust.check_executable(payload)
    compiled = deserialize_compiled(payload, in_tree, out_tree, header["meta"].get("devices"),
                                    find_class=_trust.find_executable_class)
    return header["payload"]["sha256"], compiled


def clear() -> None:
    _store.clear_preloaded()
    _noted.clear()


_memo.register(clear)  # `cache_reset()`: nothing preloaded outlives it
