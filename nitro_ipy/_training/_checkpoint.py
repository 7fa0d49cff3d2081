"""Checkpoints: `n.save(path)`, `Nitro(e, resume=path | "auto")`, and periodic saves with retention.

A checkpoint is one `.npz` file written atomically (temp file, fsync, `os.replace`, directory fsync) by a
background writer once the state is on the host (`snapshot`, then `commit`): every array of the handle's
state (`handle_state`: params, model state, optimizer state), and a JSON manifest of the experiment
(GraphConst fingerprints and reprs, Device and Host values, hook fingerprints, versions), the training
position (step, epoch, seed: the data order of epoch k is `(seed, k)`, so a resumed run continues the same
stream) and the history. No pickle: a checkpoint is arrays and JSON.

The file's room is reserved in the caller (`reserve`: a temp file named for this process, allocated),
so a full disk, a quota, a file size limit or a read-only mount raises at `save` (`CheckpointWriteError`);
a periodic save warns once instead and training goes on (`Policy.failed`). A temp file a killed writer
left is swept the next time a process saves to or resumes from its directory (`_writes.sweep`).

Why not orbax-checkpoint: on the 120-layer MLP's state (245 small arrays) orbax 0.12.8's asynchronous
`StandardCheckpointer` held the caller 348 ms per save and committed in 1.5 s (its import: 1.9 s),
against 3 ms and 35 ms here; an epoch of that model takes well under a second, and the target is a save
under 10% of an epoch (docs/persistence.md).

Resuming refuses a GraphConst change (the programs, and the parameter shapes, depend on it) with the
field-level diff, and lists changed Device/Host fields and edited hooks without refusing.
"""

import atexit
import dataclasses
import functools
import glob
import json
import os
import queue
import re
import sys
import tempfile
import threading
import warnings
from importlib import metadata

import jax
import numpy as np

from .._base import _events, _report, _writes
from .._base._errors import NitroValueError, NitroWarning
from .._base._fingerprint import Unfingerprintable, fingerprint
from .._base._report import Kind
from .._base._sharding import is_main_process, wait_for_all
from .._experiment._data import Loader, split_len
from .._experiment._fields import short_repr
from ._loop import Cursor

FORMAT = 1
SUFFIX = ".nitro.npz"
_MANIFEST = "__manifest__"


class ResumeMismatchError(NitroValueError):
    """A checkpoint's experiment differs from the one resuming it in a GraphConst field."""


class CheckpointWriteError(NitroValueError):
    """A checkpoint could not be written: a full disk, a quota, a file size limit, a read-only mount."""

    def __init__(self, path: str, problem: str, full: bool):
        self.path, self.problem = path, problem
        super().__init__(WRITE_FAILED.format(path=path, problem=problem) + (FIX if full else ""))


WRITE_FAILED = ("the checkpoint `{path}` could not be written: {problem}. Nothing of it is on disk; the "
                "checkpoints written before it are whole.")
FIX = " Fix: free space there, or save to another disk."
PERIODIC_FAILED = ("the periodic checkpoint `{path}` could not be written: {problem}. Training goes "
                   "on and keeps the last checkpoint written ({last}); later epochs try again, unsaid. Fix: free "
                   "space in `{directory}`, or pass another `checkpoint_dir=`.")
_swept_dirs: set = set()  # checkpoint directories swept of killed writers' temp files, once per process


def _sweep(directory: str) -> None:
    """Remove the temp files killed writers left in `directory` (`_writes.sweep`: only those no live
    process writes), the first time this process saves there or resumes from there."""
    directory = os.path.abspath(directory)
    if directory not in _swept_dirs:
        _swept_dirs.add(directory)
        _writes.sweep(directory)


def _problem(err: BaseException, path: str, nbytes: int | None) -> str:
    if isinstance(err, OSError):
        return _writes.write_problem(err, os.path.dirname(path), nbytes)
    return f"{type(err).__name__}: {err}"


def handle_state(n) -> dict:
    """Every piece of training state a handle holds, by name: what a checkpoint carries (the one list).

    `opt_state` is the optimizer state; `model_state` is the model's own state (batch statistics), None
    when the model has none."""
    return {"params": n._params, "model_state": n._model_state, "opt_state": n._opt_state}


def set_handle_state(n, state: dict) -> None:
    """Put `state` (as `handle_state` names it) back on handle `n`."""
    n._params = state["params"]
    n._opt_state, n._model_state = state["opt_state"], state["model_state"]


# ---------------------------------------------------------------- the manifest
@functools.cache
def _versions() -> dict:
    out = {}
    for dist in ("nitro_ipy", "jax", "jaxlib", "optax", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except Exception:
            out[dist] = None
    return out


def _content_map(value, path: str, depth: int = 0, parent: str | None = None) -> dict:
    """`{path: [fingerprint, parent path]}` of `value` and its parts, a few levels down: where two values
    with the same repr differ (`cfg.table[3]`)."""
    try:
        out = {path: [fingerprint(value, path), parent]}
    except Unfingerprintable:
        return {}
    if depth >= 3:
        return out
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        parts = [(f"{path}.{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)]
    elif isinstance(value, dict):
        parts = [(f"{path}[{k!r}]", v) for k, v in list(value.items())[:64]]
    elif isinstance(value, (list, tuple)):
        parts = [(f"{path}[{i}]", v) for i, v in enumerate(value[:64])]
    elif hasattr(value, "shape") and hasattr(value, "dtype") and np.ndim(value) >= 1 and len(value) > 1:
        # An array in at most 16 slices, each sliced again one level down: a change is narrowed to a
        # short range of rows (`table[144:160]`) in three levels.
        arr, base = np.asarray(value), path.rsplit("[", 1)[0] if path.endswith("]") and ":" in path else path
        start = int(path.rsplit("[", 1)[1].split(":")[0]) if base != path else 0
        step = -(-len(arr) // 16)
        parts = [(f"{base}[{start + i}:{start + min(i + step, len(arr))}]" if step > 1 else f"{base}[{start + i}]",
                  arr[i : i + step] if step > 1 else arr[i]) for i in range(0, len(arr), step)]
    else:
        parts = []
    for p, v in parts:
        out.update(_content_map(v, p, depth + 1, path))
    return out


def manifest(n) -> dict:
    """The experiment and the training position of handle `n`, as JSON-able data."""
    b = n._binding
    e = n.experiment  # with the values `n.set(...)` gave (the binding keeps the ones it was made with)
    return {
        "format": FORMAT,
        "experiment": b.owner,
        "graphconst": {
            name: {"fingerprint": fp, "repr": rep, "content": _content_map(b.graphconst.values[name], name)}
            for name, (fp, rep) in b.graphconst.info.items()
        },
        "device": {name: short_repr(getattr(e, name, v)) for name, v in b.device_host.items()},
        "host": {name: short_repr(getattr(e, name, None)) for name in b.hosts},
        "hooks": dict(b.hook_fps),
        "versions": dict(_versions()),
        "step": int(n.step),
        "epoch": int(n.epoch),
        "seed": int(n.seed),
        # An epoch cut short: its steps taken and their loss sum and count (a resume goes on there).
        "cursor": [int(n._cursor.taken), float(n._cursor.total), int(n._cursor.count)],
        "batch_size": n.batch_size,
        "accum": n.accum,
        "data": data_position(n),
        "history": _jsonable(n.history),
    }


def data_position(n) -> dict:
    """Where the train split's epoch stands and how a resume finds it again: an array split's epoch is
    its seeded shuffle (exact); a loader's is replayed, its batches taken before the cut read and dropped
    (exact only when it yields the same batches on every pass)."""
    split = n._binding.splits.get("train")
    if split is None:
        return {}
    taken = int(n._cursor.taken)
    if isinstance(split, Loader):
        return {"split": "train", "kind": "loader", "source": type(split.source).__qualname__,
                "steps_into_epoch": taken, "batches_taken": taken * n.accum, "exact": False,
                "resume": "replays the loader's pass and drops the batches taken; the same batches only "
                          "when it yields them in the same order every pass"}
    return {"split": "train", "kind": "arrays", "examples": split_len(split), "steps_into_epoch": taken,
            "exact": True, "resume": "the epoch's seeded shuffle, from the step after the last taken"}


def resume_data_notes(info: dict, n) -> list:
    """A note when a checkpoint cut mid-epoch resumes on a loader (which cannot be resumed exactly), or
    on another kind of train split than it was saved with."""
    saved = info.get("data") or {}
    split = n._binding.splits.get("train")
    if not saved or split is None:
        return []
    kind = "loader" if isinstance(split, Loader) else "arrays"
    notes = []
    if saved.get("kind") != kind:
        notes.append(f"train split: {saved.get('kind')} -> {kind}")
    if kind == "loader" and n._cursor.taken:
        notes.append(f"train split is a loader: the cut epoch goes on after its first "
                     f"{n._cursor.taken * n.accum} batches, read again and dropped; the same batches as the "
                     f"uninterrupted run only if the loader yields the same order every pass")
    return notes


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.generic, np.ndarray)) or hasattr(x, "__array__"):
        a = np.asarray(x)
        return a.item() if a.ndim == 0 else a.tolist()
    return x


# ---------------------------------------------------------------- writing
_DTYPE_NAMES: dict = {}  # dtype -> its name (`str(dtype)` is Python code in numpy, paid per array)


def _dtype_name(dt) -> str:
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        name = _DTYPE_NAMES[dt] = str(dt)
    return name


def _key_impl(x) -> str | None:
    """The PRNG implementation's name (`threefry2x32`) of a typed key array, else None."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return None
    return str(jax.random.key_impl(x))


def snapshot(n) -> tuple[dict, bytes]:
    """`(manifest, data)`: handle `n`'s manifest (with the array layout) and every array's bytes, copied
    to the host now. This is the part of a save the training loop waits for: the next step may donate
    the device buffers, so the bytes are taken here; the file is written afterwards (`commit`).

    Every array's bytes go in one buffer (a zip member per array costs more than the arrays, at 250 small
    ones); dtype, shape and offset of each are in the manifest. bfloat16 and other ml_dtypes need no .npy
    form this way either."""
    info = manifest(n)
    place = n._place
    if getattr(place, "multi_process", False):  # under jax.distributed: arrays split over processes gathered
        groups = [(group, (jax.tree_util.tree_leaves(place.host(tree)), jax.tree_util.tree_structure(tree)))
                  for group, tree in handle_state(n).items()]  # (a collective: every process saves)
    else:
        groups = [(group, jax.tree_util.tree_flatten(tree)) for group, tree in handle_state(n).items()]
    if jax.default_backend() != "cpu":  # every transfer under way before the first one is waited for
        for _, (leaves, _) in groups:
            for x in leaves:
                if hasattr(x, "copy_to_host_async"):
                    x.copy_to_host_async()
    chunks, layout, offset = [], {}, 0
    for group, (leaves, treedef) in groups:
        entries = []
        for x in leaves:
            impl = _key_impl(x)  # a typed PRNG key (an `nnx.Rngs` stream's) is saved as its key data
            a = np.asarray(x if impl is None else jax.random.key_data(x))  # on CPU a view of the device
            entries.append([_dtype_name(a.dtype), list(a.shape), offset, *(() if impl is None else (impl,))])
            chunks.append(a.reshape(-1).view(np.uint8) if a.ndim and a.flags.c_contiguous else a.tobytes())
            offset += a.nbytes
        layout[group] = {"treedef": str(treedef), "leaves": entries}
    info["layout"] = layout
    return info, b"".join(chunks)


def _size(info: dict, data: bytes) -> int:
    """About the bytes a checkpoint file takes (its arrays, its manifest and the zip's headers)."""
    return len(data) + len(json.dumps(info, sort_keys=True)) + 4096


def reserve(path: str, nbytes: int) -> str:
    """A temp file next to `path` (named for this process: `_writes.sweep`) with `nbytes` allocated, so a
    full disk, a quota, a file size limit or a read-only mount fails here, in the caller, before anything
    is written; raises `CheckpointWriteError` saying why and how much room it needs."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=_writes.temp_prefix(), suffix=".part")
        try:
            _writes.allocate(fd, nbytes)
        finally:
            os.close(fd)
    except OSError as err:
        if tmp is not None:
            _writes.discard(tmp)
        raise CheckpointWriteError(path, _problem(err, path, nbytes), _writes.is_full(err)) from err
    return tmp


def commit(path: str, info: dict, data: bytes, tmp: str | None = None) -> None:
    """Write a snapshot to `path` durably and atomically: a temp file in the same directory (`tmp`, one
    `reserve` made, or a new one), fsync'ed, renamed over `path`, then the directory fsync'ed (so the
    rename itself survives a power cut). A crash at any point leaves `path` either absent or its
    previous content, never a partial file (and a temp file the next start sweeps)."""
    directory = os.path.dirname(os.path.abspath(path))
    arrays = {"data": np.frombuffer(data, np.uint8),
              _MANIFEST: np.frombuffer(json.dumps(info, sort_keys=True).encode(), np.uint8)}
    if tmp is None:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=_writes.temp_prefix(), suffix=".part")
        os.close(fd)
    try:
        with open(tmp, "r+b") as f:  # not "wb": truncating would give back the space `reserve` holds
            np.savez(f, **arrays)
            f.truncate()
            f.flush()
            os.fsync(f.fileno())
        _events.signal("temp_written", tmp)
        os.replace(tmp, path)
    except BaseException:
        _writes.discard(tmp)
        raise
    try:
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:  # a platform without directory handles (Windows): the rename is what it offers
        return
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class _Writer:
    """Commits checkpoints in a background thread, one at a time, in order.

    `save` hands its snapshot here and returns: the file write and the fsyncs (most of a save's cost)
    overlap the next steps. A commit is awaited before the next one is handed over, before any
    checkpoint is read or listed here (`read`, `newest`), by `n.save(path, wait=True)`, at the end of a
    `train()` that checkpoints, and at interpreter exit (`atexit`, which a kernel restart runs), so a
    checkpoint is never lost to a normal exit. A failed commit is raised by the next save or wait (and
    printed at exit if nothing waited).

    The thread lives as long as the process and takes jobs from a queue: handing one over never waits
    for a new thread to be scheduled (on a loaded machine that alone took milliseconds)."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._error: tuple | None = None  # (path, exception, bytes, policy) of a failed commit
        self._lock = threading.Lock()

    def submit(self, path: str, info: dict, data: bytes, then=None, tmp=None, policy=None) -> None:
        with self._lock:
            self.wait()
            if self._thread is None or not self._thread.is_alive():  # the first save (or after a fork)
                self._thread = threading.Thread(target=self._loop, name="nitro_ipy checkpoint writer", daemon=True)
                self._thread.start()
            self._idle.clear()
            self._jobs.put((path, info, data, then, tmp, policy))

    def _loop(self):
        while True:
            path, info, data, then, tmp, policy = self._jobs.get()
            try:
                commit(path, info, data, tmp)
                if then is not None:
                    then()
            except BaseException as err:  # raised by whoever waits next (a periodic one: warned)
                self._error = (path, err, _size(info, data), policy)
            finally:
                self._idle.set()

    def wait(self) -> None:
        """Until the pending commit is on disk; raises what it raised (`CheckpointWriteError` for a
        failed write), or, for a periodic checkpoint, warns once (`Policy.failed`)."""
        self._idle.wait()
        failed, self._error = self._error, None
        if failed is not None:
            path, err, nbytes, policy = failed
            if policy is not None:
                return policy.failed(path, _problem(err, path, nbytes))
            raise CheckpointWriteError(path, _problem(err, path, nbytes), _writes.is_full(err)) from err

    def _at_exit(self):
        try:
            self.wait()
        except NitroValueError as err:
            print(f"nitro_ipy: {err}", file=sys.stderr)


_writer = _Writer()
atexit.register(_writer._at_exit)
wait = _writer.wait


def save(n, path, *, wait: bool = False, then=None, policy=None) -> str:
    """Write handle `n`'s checkpoint to `path` (a file; a directory gets `step-<step>.nitro.npz` inside).

    The state is copied to the host before this returns; the file is committed in the background
    (`_Writer`) unless `wait=True`. `then()` runs after the commit, in the writer (retention). Under
    `jax.distributed` every process calls it: all gather the arrays, process 0 writes, and each returns
    once the file is there (no background commit: the other processes wait for it). The file's room is
    allocated before this returns: a full disk raises `CheckpointWriteError` here (a periodic save of
    `policy` warns instead: `Policy.failed`).

    **Returns:** the file (being) written."""
    path = os.fspath(path)
    if os.path.isdir(path) or path.endswith(os.sep):
        path = os.path.join(path, f"step-{int(n.step):08d}{SUFFIX}")
    elif not path.endswith(".npz"):
        path += SUFFIX
    if is_main_process():
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        _sweep(os.path.dirname(os.path.abspath(path)))
    info, data = snapshot(n)  # under jax.distributed on every process: a sharded array needs them all
    multi = jax.process_count() > 1
    if is_main_process():  # process 0 writes (and prunes: `then`)
        tmp = reserve(path, _size(info, data))  # a full disk raises here, in the caller
        try:
            _writer.submit(os.path.abspath(path), info, data, then, tmp, policy)
        except BaseException:
            _writes.discard(tmp)
            raise
        if wait or multi:
            _writer.wait()
    if multi:  # every process returns once the file is there, so each can resume from it
        wait_for_all(f"nitro_ipy checkpoint at step {int(n.step)}")
    return path


# ---------------------------------------------------------------- reading
def newest(directory) -> str | None:
    """The newest checkpoint in `directory` (highest step, then latest written), or None."""
    _writer.wait()
    _sweep(os.fspath(directory))
    files = glob.glob(os.path.join(os.fspath(directory), "*" + SUFFIX))
    if not files:
        return None
    return max(files, key=lambda p: (_step_of(p), os.path.getmtime(p)))


def _step_of(path: str) -> int:
    m = re.search(r"-(\d+)\.nitro\.npz$", path)
    return int(m.group(1)) if m else -1


def read(path) -> tuple[dict, dict]:
    """`(manifest, {group: [arrays]})` of a checkpoint file, or a `NitroValueError` saying what is wrong."""
    path = os.fspath(path)
    _writer.wait()
    try:
        with np.load(path, allow_pickle=False) as z:
            info = json.loads(bytes(z[_MANIFEST]).decode())
            data = z["data"]
            groups = {}
            for group, lay in info["layout"].items():
                arrays = []
                for dtype, shape, offset, *key in lay["leaves"]:
                    dt = jax.numpy.dtype(dtype)
                    size = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
                    if offset + size > data.size:
                        raise ValueError("truncated array data")
                    a = data[offset : offset + size].view(dt).reshape(tuple(shape)).copy()
                    arrays.append(jax.random.wrap_key_data(a, impl=key[0]) if key else a)
                groups[group] = arrays
    except FileNotFoundError:
        raise NitroValueError(f"no checkpoint at `{path}`.") from None
    except Exception as err:
        raise NitroValueError(f"`{path}` is not a readable nitro_ipy checkpoint ({type(err).__name__}: {err}).") from None
    return info, groups


def _content_diff(old: dict, new: dict) -> str | None:
    """The deepest paths whose fingerprints differ between two content maps."""
    moved = [p for p in set(old) | set(new) if old.get(p) != new.get(p)]
    parents = {(old.get(p) or new.get(p))[1] for p in moved}
    deepest = [p for p in moved if p not in parents]
    return ", ".join(f"`{p}`" for p in sorted(deepest)[:5]) if deepest else None


def diff(info: dict, n) -> tuple[list, list]:
    """`(refusals, notes)` comparing a checkpoint's manifest with handle `n`: GraphConst changes refuse;
    Device/Host changes and edited hooks are notes. Each line is "field: old -> new"."""
    now = manifest(n)
    refusals, notes = [], []
    if info.get("experiment") != now["experiment"]:
        notes.append(f"experiment class: {info.get('experiment')} -> {now['experiment']}")
    old_gc, new_gc = info.get("graphconst", {}), now["graphconst"]
    for name in sorted(set(old_gc) | set(new_gc)):
        o, c = old_gc.get(name), new_gc.get(name)
        if o is None or c is None:
            refusals.append(f"GraphConst `{name}`: {'(absent)' if o is None else o['repr']} -> "
                            f"{'(absent)' if c is None else c['repr']}")
        elif o["fingerprint"] != c["fingerprint"]:
            if o["repr"] == c["repr"]:
                where = _content_diff(o.get("content", {}), c["content"])
                refusals.append(f"GraphConst `{name}`: {o['repr']} -> {c['repr']} (same repr; the content differs"
                                + (f" at {where})" if where else ")"))
            else:
                refusals.append(f"GraphConst `{name}`: {o['repr']} -> {c['repr']}")
    for kind in ("device", "host"):
        old, new = info.get(kind, {}), now[kind]
        for name in sorted(set(old) | set(new)):
            if old.get(name) != new.get(name):
                notes.append(f"{kind.capitalize()} `{name}`: {old.get(name, '(absent)')} -> {new.get(name, '(absent)')}")
    for name in sorted(set(info.get("hooks", {})) | set(now["hooks"])):
        if info.get("hooks", {}).get(name) != now["hooks"].get(name):
            notes.append(f"hook `{name}` edited since the checkpoint")
    return refusals, notes


def restore(n, path) -> None:
    """Load checkpoint `path` into the freshly set up handle `n` (refusing a GraphConst change)."""
    info, groups = read(path)
    refusals, notes = diff(info, n)
    if refusals:
        raise ResumeMismatchError(
            f"cannot resume from `{path}`: the experiment's GraphConst fields changed since it was saved "
            f"(the compiled programs and the parameter shapes depend on them):\n  "
            + "\n  ".join(refusals)
            + "\nFix: set those fields back to the saved values, or start a fresh run without `resume=`."
        )
    live = handle_state(n)
    state = {}
    for group, tree in live.items():
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        saved = info["layout"].get(group, {"treedef": str(jax.tree_util.tree_structure(None)), "leaves": []})
        if saved["treedef"] != str(treedef):
            raise NitroValueError(
                f"cannot resume from `{path}`: its `{group}` has another structure than this handle's "
                f"({len(saved['leaves'])} arrays saved, {len(leaves)} here). Was `flat_params=` or the optimizer "
                f"changed? Resume with the settings it was saved with."
            )
        arrays = groups.get(group, [])
        for old, new in zip(leaves, arrays):
            if tuple(np.shape(old)) != tuple(new.shape):
                raise NitroValueError(f"cannot resume from `{path}`: a `{group}` array is {list(new.shape)} "
                                      f"there and {list(np.shape(old))} here.")
        # Each array where the live one is (on a mesh: replicated or sharded as the handle placed it).
        state[group] = None if tree is None else n._place.like(jax.tree_util.tree_unflatten(treedef, arrays), tree)
    set_handle_state(n, state)
    n.step, n.epoch, n.seed = info["step"], info["epoch"], info["seed"]
    pos, total, count = info.get("cursor", (0, 0.0, 0))
    n._cursor = Cursor(int(pos), float(total), int(count))
    notes.extend(resume_data_notes(info, n))
    n.history.clear()  # the handle's own history object (a list of rows), refilled
    n.history.extend(info.get("history", []))
    _report.emit(Kind.RESUMED, path=str(path), step=n.step, epoch=n.epoch, notes=tuple(notes))


# ---------------------------------------------------------------- periodic saves and retention
class Policy:
    """`checkpoint_every=` epochs into `directory`, keeping the newest `keep` and the best by `keep_best`."""

    def __init__(self, directory, every, keep, keep_best):
        if directory is None:
            raise NitroValueError("`checkpoint_every=` needs `checkpoint_dir=`: the directory checkpoints go to.")
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise NitroValueError(f"`checkpoint_every` must be a positive number of epochs; got {every!r}.")
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
            raise NitroValueError(f"`keep` must be a positive integer (checkpoints kept) or None (all); got {keep!r}.")
        if keep_best is not None and not (
            isinstance(keep_best, tuple) and len(keep_best) == 2 and isinstance(keep_best[0], str)
            and keep_best[1] in ("min", "max")
        ):
            raise NitroValueError(f'`keep_best` must be `(metric, "min" | "max")`, e.g. `("valid_loss", "min")`; '
                                  f"got {keep_best!r}.")
        self.directory, self.every, self.keep, self.keep_best = os.fspath(directory), every, keep, keep_best
        self.warned = False

    def after_epoch(self, n) -> str | None:
        if n.epoch % self.every:
            return None
        # Retention runs in the writer, after the commit: the loop waits for the host copy only.
        path = os.path.join(self.directory, f"step-{int(n.step):08d}{SUFFIX}")
        try:
            return save(n, path, then=self.retain, policy=self)
        except CheckpointWriteError as err:  # a full disk must not stop training: said once, retried
            self.failed(err.path, err.problem)
            return None

    def failed(self, path: str, problem: str) -> None:
        """A periodic checkpoint could not be written: warn once (a `NitroWarning`) and train on; the
        checkpoints already written stay (retention runs only after a commit)."""
        if self.warned:
            return
        self.warned = True
        files = sorted(glob.glob(os.path.join(self.directory, "*" + SUFFIX)), key=_step_of)
        last = f"`{os.path.basename(files[-1])}`" if files else "none was written yet"
        warnings.warn(PERIODIC_FAILED.format(path=path, problem=problem, last=last, directory=self.directory),
                      NitroWarning, stacklevel=2)

    def retain(self) -> None:
        files = sorted(glob.glob(os.path.join(self.directory, "*" + SUFFIX)), key=_step_of)
        keep = set(files if self.keep is None else files[-self.keep:])
        if self.keep_best is not None:
            metric, mode = self.keep_best
            scored = []
            for p in files:
                try:
                    with np.load(p, allow_pickle=False) as z:
                        history = json.loads(bytes(z[_MANIFEST]).decode()).get("history") or [{}]
                    value = history[-1].get(metric)
                except Exception:
                    continue
                if isinstance(value, (int, float)):
                    scored.append((value if mode == "min" else -value, p))
            if scored:
                keep.add(min(scored)[1])
        for p in files:
            if p not in keep:
                try:
                    os.unlink(p)
                except OSError:
                    pass
