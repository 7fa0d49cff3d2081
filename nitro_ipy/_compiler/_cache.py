"""The module-level compile cache: keys, entries, hit/miss counters, poisoning and the drift scan.

Its surface for the rest of the package (the handle, the Jupyter side, the benchmarks): `Key`, `ArgSig`,
`arg_signature`, `Entry`; `cache_stats`, `cache_reset`, `generation`; `live_entries`, `poisoned_entries`,
`lookup`, `count_hit`, `store`, `discard`, `poison`, `revive`; `ensure_fresh`, `scanned_world`; and
the events it publishes go through `_base/_events.py`. How a program is compiled is `_compile.py`;
why a key missed is `_explain.py`.
"""

import collections
import dataclasses
import threading
import weakref
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from .._base import _events, _memo, _report
from .._base._compat import evict_traces
from .._base._origin import is_user_file
from .._base._report import Kind
from .._base._sharding import sharding_signature
from .._base._world import world
from . import _context


class CacheStats(NamedTuple):
    """Cumulative `hits` and `misses` since the last `cache_reset()`, and live `entries`."""

    hits: int
    misses: int
    entries: int


class ArgSig(NamedTuple):
    """One traced leaf of a program's arguments, as it enters the key."""

    path: str
    shape: tuple
    dtype: str
    weak: bool
    sharding: str | None


class ArgsKey(NamedTuple):
    """The `args` component of a key: the arguments' tree structure and one `ArgSig` per traced leaf."""

    tree: str  # the treedef's repr
    sigs: tuple  # (ArgSig, ...)


@dataclasses.dataclass(frozen=True)
class Key:
    """A program's compile key. Every component earns its place (see docs/recompilation.md).

    `graphconst` is the hash of every GraphConst field: what a program is stored and found under. A live
    program is also served for a key whose other components are equal and whose `fields` fingerprint
    alike the GraphConst fields its trace read (`Entry.reads`): an edit to a field only the gradient
    program reads leaves the optimizer program served (`_serves`)."""

    kind: str  # "grad", "opt", "eval", "metric:<hook>", "predict"
    owner: str  # the experiment type's qualified name
    hooks: tuple  # ((hook name, code fingerprint), ...) of the hooks the program traces
    args: ArgsKey  # structure, shapes, dtypes, weak types and shardings of the traced arguments
    graphconst: str  # graphconst_field_hash(e)
    options: tuple  # ((name, value), ...) trace-time options that change the graph (accum, layout)
    # ((GraphConst field, fingerprint), ...): what `graphconst` hashes, field by field (not compared:
    # equal keys have equal hashes; not in the repr, which names a stored program's file)
    fields: tuple = dataclasses.field(default=(), compare=False, repr=False)
    # The JAX configuration of the thread making the key (`_context.py`): JAX's trace context, as JAX's
    # own jit caches key on it. Taken when the key is made, in the thread that traces its program.
    context: _context.Context = dataclasses.field(default_factory=_context.current)

    def without_fields(self) -> tuple:
        """Every component but the GraphConst ones: what a program served by its read fields shares."""
        return (self.kind, self.owner, self.hooks, self.args, self.options, self.context)

    def __post_init__(self):
        if type(self.args) is tuple and len(self.args) == 2:  # a plain pair (a key read back from the store)
            object.__setattr__(self, "args", ArgsKey(*self.args))


def shapes_of(tree):
    """`tree` with each array replaced by its `jax.ShapeDtypeStruct` (a multi-device sharding kept): what
    a later trace needs of arguments, holding none of their buffers alive."""
    return jax.tree.map(_shape_of, tree)


def _shape_of(x):
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        sharding = getattr(x, "sharding", None)
        if sharding is not None and len(sharding.device_set) == 1:
            sharding = None
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, weak_type=bool(getattr(x, "weak_type", False)),
                                    sharding=sharding)
    return x


def arg_signature(args: tuple, names: tuple = ()) -> ArgsKey:
    """The `args` key component: tree structure plus shape, dtype, weak type and sharding of each leaf.

    `names` label the positional arguments in explanations (`params['w1']` rather than `[0]['w1']`).
    Sharding enters only when it spans several devices (with the devices' ids: `_sharding.sharding_signature`):
    one device is the default placement, whether the leaf arrived as numpy or as a committed array.

    Every epoch's first step keys both programs over every parameter array: the tree's repr and the
    leaves' labels are worked out once per structure, dtype names and sharding signatures once per value
    (3 ms -> 0.3 ms at 242 arrays, a tenth of a 48-step epoch's own host time).
    """
    leaves, treedef = jax.tree_util.tree_flatten(args)
    tree, labels = _structure(treedef, names, args)
    sigs = []
    for label, leaf in zip(labels, leaves):
        dtype = getattr(leaf, "dtype", None)
        sigs.append(
            ArgSig(
                label,
                tuple(leaf.shape) if isinstance(leaf, jax.Array) else tuple(np.shape(leaf)),
                _dtype_name(dtype if dtype is not None else np.result_type(leaf)),
                bool(getattr(leaf, "weak_type", False)),
                _sharding_of(getattr(leaf, "sharding", None)),
            )
        )
    return ArgsKey(tree, tuple(sigs))


# Memos for `arg_signature`, bounded: a session sees a handful of argument structures, dtypes and
# placements; a program whose structure moves every call (a recompile loop) must not grow them forever.
_MEMO_LIMIT = 512
_structures: dict = {}
_dtype_names: dict = {}
_shardings: dict = {}


def _memo_get(memo: dict, key, make):
    try:
        value = memo.get(key, _MISSING)
    except TypeError:  # unhashable (a pytree node's aux data, a custom sharding): worked out each time
        return make()
    if value is _MISSING:
        if len(memo) >= _MEMO_LIMIT:
            memo.clear()
        value = memo[key] = make()
    return value


_MISSING = object()


def _structure(treedef, names: tuple, args) -> tuple:
    """`(repr of treedef, label of each leaf)`, the labels named after `names` where they reach."""

    def make():
        labels = []
        for path, _ in jax.tree_util.tree_flatten_with_path(args)[0]:
            if names and path and isinstance(path[0], jax.tree_util.SequenceKey) and path[0].idx < len(names):
                labels.append(names[path[0].idx] + jax.tree_util.keystr(path[1:]))
            else:
                labels.append(jax.tree_util.keystr(path))
        return str(treedef), tuple(labels)

    return _memo_get(_structures, (treedef, names), make)


def _dtype_name(dtype) -> str:
    return _memo_get(_dtype_names, dtype, lambda: str(dtype))


def _sharding_of(sharding):
    if sharding is None or type(sharding) is jax.sharding.SingleDeviceSharding:
        return None
    return _memo_get(_shardings, sharding, lambda: sharding_signature(sharding))


@dataclasses.dataclass(eq=False)
class Entry:
    """A compiled program and what is known about it."""

    key: Key
    call: Callable
    trace_s: float
    compile_s: float
    closure: Any = None  # a `_closure.Closure`: what the trace depended on
    info: dict = dataclasses.field(default_factory=dict)  # GraphConst reprs etc., for explanations
    why: str | None = None  # why it was compiled, when a similar entry existed
    hits: int = 0
    poisoned: bool = False
    drifted: tuple = ()  # names of the functions/values whose drift poisoned it
    compiler_options: dict = dataclasses.field(default_factory=dict)  # the XLA options it was compiled with
    operations: int = 0  # equations of its jaxpr, sub-jaxprs included: what a slow compile is made of
    constants: tuple = ()  # (nbytes, shape, dtype, origin) of large constants baked in (`_compile`)
    origin: str = "compiled"  # "disk": loaded from the program store (`_store.py`), not traced
    # The experiment fields its trace read through the compile view (`_closure.note_field_read`); None
    # when unknown (loaded from the store, or traced unrecorded): then it serves its exact key only.
    reads: frozenset | None = None
    # Compiled in the background (`_ahead`) and not taken by a handle yet: its first taking counts no
    # hit, files it as compiled then, and says so to front ends (`take`), as if compiled on demand.
    untaken: bool = False
    held: tuple = ()  # its compile lines, composed in the background: said by the handle that takes it
    unstorable: str | None = None  # why the store cannot hold it (then JAX's persistent cache does)

    @property
    def kind(self) -> str:
        return self.key.kind

    @property
    def hook_names(self) -> tuple:
        return tuple(name for name, _ in self.key.hooks)

    def shapes(self) -> str:
        return ", ".join(f"{s.path or 'arg'}{list(s.shape)}" for s in self.key.args.sigs if s.shape)


class Held:
    """Entries the cache no longer serves but some handle may still run: held weakly, in order, so an
    executable is released once no handle holds its entry (a poisoned program, or one a `cache_reset()`
    dropped), while the handles that do hold one can still be told it went stale."""

    __slots__ = ("_refs",)

    def __init__(self):
        self._refs: dict[int, weakref.ref] = {}

    def add(self, entry: Entry) -> None:
        refs = self._refs
        refs[id(entry)] = weakref.ref(entry, lambda _, i=id(entry): refs.pop(i, None))

    def discard(self, entry: Entry) -> None:
        ref = self._refs.get(id(entry))
        if ref is not None and ref() is entry:
            del self._refs[id(entry)]

    def alive(self) -> list[Entry]:
        return [e for e in (ref() for ref in list(self._refs.values())) if e is not None]


class Poisoned:
    """One poisoning: the entry while a handle holds it, and what `%nitro_stats` and miss explanations
    keep of it once released (the entry without its executable and closure)."""

    __slots__ = ("ref", "summary", "served")

    def __init__(self, entry: Entry, served: bool):
        self.ref = weakref.ref(entry)
        self.summary = dataclasses.replace(entry, call=None, closure=None)
        self.served = served  # the cache served it: a revival serves it again (an orphan's does not)

    def entry(self) -> Entry:
        return self.ref() or self.summary


# Poisonings remembered for `%nitro_stats` and explanations: enough for a long session's edits, bounded.
POISONINGS = 256


class _State:
    def __init__(self, generation: int):
        self.entries: dict[Key, Entry] = {}
        self.poisoned: collections.deque = collections.deque(maxlen=POISONINGS)  # of `Poisoned`
        self.orphans = Held()  # live entries of before the last `cache_reset()`, for the drift scan
        self.hits = 0
        self.misses = 0
        self.scanned_world = -1
        self.disk_reported: dict[str, str | None] = {}  # name -> the file version its edit was said for
        self.generation = generation
        self.compiling: dict[Key, "Claim"] = {}  # keys a thread is compiling now (single flight)
        # The served entries the drift scan poisoned in this generation, numbered: what an edit moved
        # (`moved_since`). Entries of before a `cache_reset()` (orphans) are not in it: a reset forgets.
        self.moved: collections.deque = collections.deque(maxlen=POISONINGS)  # of (number, weak ref)
        self.moves = 0


_state = _State(0)
# Guards the counters, the entries and the claims: handles may train, and programs compile, in several
# threads at once. Re-entrant: a scan poisons, a claim counts a hit, under the same lock.
_lock = threading.RLock()


def cache_stats() -> CacheStats:
    """`(hits, misses, entries)` of the process-wide compile cache; hits and misses are cumulative."""
    _events.signal("counting")  # `nitro_ipy.jit` adds the hits its calls counted without a lock
    return CacheStats(_state.hits, _state.misses, len(_state.entries))


def cache_reset() -> None:
    """Empty the compile cache and zero its counters: the escape hatch for anything staleness cannot see."""
    global _state
    with _lock:
        _memo.clear_all()
        old, _state = _state, _State(_state.generation + 1)
        _state.scanned_world = world()
        # A handle built before the reset keeps running its programs: the scan still checks them (held
        # weakly), so such a handle can still learn that one went stale.
        for entry in (*old.entries.values(), *old.orphans.alive()):
            _state.orphans.add(entry)
    _events.publish("reset")


def generation() -> int:
    """How many times the cache was reset: a front end that saw generation g has seen every entry since."""
    return _state.generation


# ---------------------------------------------------------------- entries
def live_entries() -> list[Entry]:
    return list(_state.entries.values())


def poisoned_entries() -> list[Entry]:
    """Entries poisoned since the last reset, oldest first: the entry itself while a handle holds it,
    else its summary (released: no executable, no closure)."""
    return [p.entry() for p in _state.poisoned]


def _held_poisoned() -> list[Entry]:
    return [e for e in (p.ref() for p in _state.poisoned) if e is not None]


def explanation_candidates() -> list:
    """What a miss is explained against: live entries, then the poisoned ones (held or summarised)."""
    return [*_state.entries.values(), *poisoned_entries()]


def count_hit(entry: Entry, uses: int = 1) -> None:
    """A handle reusing a program it already resolved counts as a cache hit, once per use."""
    with _lock:
        entry.hits += uses
        _state.hits += uses


def _serving(key: Key) -> Entry | None:
    """The live entry that serves `key` (under `_lock`): the one stored under it, else one whose trace
    read only GraphConst fields that `key` fingerprints alike (with every other component equal). Its
    trace would run again exactly as it ran: the same hooks, argument types and options, and the same
    values for every field it read (values a trace reads in any other way are in its closure)."""
    entry = _state.entries.get(key)
    if entry is not None or not key.fields:
        return entry
    mine, rest = dict(key.fields), key.without_fields()
    for entry in _state.entries.values():
        if entry.reads is None or not entry.key.fields or entry.key.without_fields() != rest:
            continue
        theirs = dict(entry.key.fields)
        if theirs.keys() == mine.keys() and all(theirs[n] == mine[n] for n in entry.reads if n in mine):
            return entry
    return None


def lookup(key: Key) -> Entry | None:
    """The live entry serving `key`, counted as a hit, or None (nothing counted)."""
    with _lock:
        entry = _serving(key)
        said = _served(entry) if entry is not None else ()
    _say(said)
    if said:  # taken compiled ahead: for this thread, the compile it would have run (a guard counts it)
        _events.signal("compiled", entry, True)
    return entry


def _served(entry: Entry) -> tuple:
    """A handle takes `entry` (under `_lock`): a hit, or, the first time for a program compiled in the
    background, what its compile on demand would have been: no hit (its miss was counted when it was
    made), filed as the newest entry, the compile event front ends follow (the live panel), and its
    compile lines, returned to be said in the taking thread (`_say`), where its compile would have said
    them. A program a later edit poisoned is never taken, so its lines are never said."""
    if not entry.untaken:
        count_hit(entry)
        return ()
    entry.untaken = False
    if _state.entries.get(entry.key) is entry:
        del _state.entries[entry.key]
        _state.entries[entry.key] = entry
    said, entry.held = entry.held, ()
    _events.publish("compile", entry)
    return said


def _say(messages) -> None:
    for msg in messages:  # outside the lock: a sink may display, or read the cache
        _report.send(msg)


class Claim:
    """The right to compile one key: `claim` hands it to the first thread that needs the key; `store`
    or `release` ends it, and only then do other threads waiting for that key go on."""

    __slots__ = ("key", "state", "done", "entry", "error", "awaited")

    def __init__(self, key: Key, state):
        self.key, self.state = key, state
        self.done = threading.Event()
        self.entry = self.error = None
        self.awaited = False  # another thread waits for it (a compile ahead held back then goes on)


def claim(key: Key, generation: int | None = None) -> tuple[Entry | None, Claim | None]:
    """Single-flight compiling: `(entry, None)` when `key` is live (counted as a hit), or was compiled
    by another thread while this one waited for it (the same); else `(None, claim)`: compile it, then
    `store(entry, claim)`, or `release(claim, error)` if the compile raised. With `generation` (a
    compile ahead's), `(None, None)` once the cache is past it: a `cache_reset()` since the job was
    planned, whose counters a background compile must never move."""
    while True:
        said = ()
        with _lock:
            if generation is not None and generation != _state.generation:
                return None, None
            entry = _serving(key)
            if entry is None:
                pending = _state.compiling.get(key)
                if pending is None:
                    pending = _state.compiling[key] = Claim(key, _state)
                    return None, pending
                pending.awaited = True
            elif generation is None:  # (a background compile finding it live counts nothing)
                said = _served(entry)
        if entry is not None:
            _say(said)
            if said:  # taken compiled ahead (`lookup`)
                _events.signal("compiled", entry, True)
            return entry, None
        _events.publish("awaiting")
        pending.done.wait()
        if pending.error is not None:
            raise pending.error  # the same code failed the same way in the thread that compiled it


def store(entry: Entry, claimed: Claim | None = None) -> None:
    """Add a newly compiled program: a miss that creates an entry."""
    with _lock:
        state = _state if claimed is None else claimed.state
        state.misses += 1
        superseded = getattr(entry.closure, "superseded", ())
        if superseded:
            # Its trace ran code that is not the live version: stale at birth. The handle that compiled
            # it runs it (and is told); no other handle is ever served it.
            entry.poisoned, entry.drifted = True, tuple(superseded)
            state.poisoned.append(Poisoned(entry, served=False))
        else:
            state.entries[entry.key] = entry
        if claimed is not None:
            state.compiling.pop(claimed.key, None)
            claimed.entry = entry
            claimed.state = None  # ended: a claim something still holds keeps no cache generation alive
            claimed.done.set()
    if not entry.untaken:  # one compiled ahead is said when a handle takes it (`_served`)
        _events.publish("compile", entry)
    else:  # its miss counted now: the panel shows it as the background's (a line comes when it is taken)
        _events.publish("ahead", entry)


def moved_since(mark: tuple | None) -> tuple[tuple, list]:
    """`(mark, entries)`: the served entries an edit poisoned since `mark` (an earlier call's mark; None:
    none yet), in this cache generation only, and the mark to pass next time. `_ahead` compiles the
    replacements of these, and of nothing else: a `cache_reset()` starts a generation with none."""
    with _lock:
        now = (_state.generation, _state.moves)
        since = mark[1] if mark is not None and mark[0] == now[0] else 0
        found = [e for n, ref in _state.moved if n > since and (e := ref()) is not None]
    return now, found


def awaited(key: Key) -> bool:
    """True when a thread waits for `key`, which another thread is compiling. Takes no lock (`_ahead`
    asks under its own, which `cache_reset` takes under this module's): one dict read, one attribute."""
    pending = _state.compiling.get(key)
    return pending is not None and pending.awaited


def peek(key: Key) -> Entry | None:
    """The live entry serving `key`, or None, counting nothing (`_ahead` reads a stored program's outputs)."""
    with _lock:
        return _serving(key)


def known(key: Key) -> bool:
    """True when `key` is served or being compiled (nothing counted): `_ahead` need not compile it."""
    with _lock:
        return key in _state.compiling or _serving(key) is not None


def store_if_current(entry: Entry, claimed: Claim) -> tuple:
    """Store `entry` (compiled in the background, `_ahead`) unless its dependencies drifted since its
    trace read them: `()` when stored, else the drifted names (then nothing is stored or counted, and a
    thread waiting for the key compiles it itself). Checked under the lock the drift scan takes, so an
    edit is either seen here or by the scan that follows it: never a stale entry served."""
    with _lock:
        drifted = entry.closure.drift({}) if entry.closure is not None else ()
        if drifted:
            release(claimed, None)
            return tuple(drifted)
        store(entry, claimed)
        return ()


def release(claimed: Claim, error: BaseException | None) -> None:
    """End `claimed` without an entry: the compile raised `error` (nothing is counted). With `error`
    None, a thread waiting for the key claims it and compiles it itself."""
    with _lock:
        if claimed.state is None:  # stored already: nothing to end
            return
        claimed.state.compiling.pop(claimed.key, None)
        claimed.state = None
        claimed.error = error
        claimed.done.set()


def discard(key: Key) -> None:
    """Drop the live entry for `key` without counting anything (the next use compiles it again)."""
    with _lock:
        _state.entries.pop(key, None)


def poison(entry: Entry, drifted) -> bool:
    """Never serve `entry` again; handles that hold it keep running it (fixed point) and are told so.
    Returns whether it is recorded as poisoned: a program compiled ahead that no handle ever ran is
    dropped instead, unsaid (the user never had it; with compile ahead off it would not exist)."""
    with _lock:
        if entry.poisoned:
            return False
        entry.poisoned = True
        entry.drifted = tuple(drifted)
        served = _state.entries.get(entry.key) is entry
        if served:
            del _state.entries[entry.key]
            _state.moves += 1
            _state.moved.append((_state.moves, weakref.ref(entry)))
        _state.orphans.discard(entry)
        if entry.untaken:
            return False
        _state.poisoned.append(Poisoned(entry, served))
        return True


def revive(entry: Entry) -> None:
    """Serve a poisoned `entry` again (its dependencies are as they were when it was compiled): the
    handles holding it stop being stale. A live entry under the same key stays: `entry` is then only
    current again for the handles that hold it; so is one `cache_reset()` had let go of (an orphan)."""
    with _lock:
        mine = [p for p in _state.poisoned if p.ref() is entry]
        if not entry.poisoned or not mine:
            return  # not poisoned, or a released entry's summary: nothing runs it any more
        entry.poisoned, entry.drifted = False, ()
        kept = [p for p in _state.poisoned if p.ref() is not entry]
        _state.poisoned.clear()
        _state.poisoned.extend(kept)
        if mine[-1].served:
            _state.entries.setdefault(entry.key, entry)
        else:
            _state.orphans.add(entry)  # scanned again, as before it was poisoned


# ---------------------------------------------------------------- staleness
def scanned_world() -> int:
    """The world the last drift scan ran at (`ensure_fresh` scans again once `world()` moves past it)."""
    return _state.scanned_world


def ensure_fresh() -> None:
    """Re-resolve every live entry's dependency closure if the world moved since the last scan.

    Memoized on `world()`: after no bump this is one integer comparison. Drifted entries are poisoned
    and the cache-level message says so, once per redefinition.
    """
    if _state.scanned_world == world():
        return
    _scan()


def _wraps_user_code(fn) -> bool:
    """True for a user function, or a library wrapper of one (`jax.checkpoint(f)`: `__wrapped__` chain)."""
    try:
        for _ in range(16):
            code = getattr(fn, "__code__", None)
            if code is not None and is_user_file(code.co_filename):
                return True
            fn = getattr(fn, "__wrapped__", None)
            if fn is None:
                return False
    except Exception:  # an object whose attributes raise: evicting its trace is the safe side
        return True
    return False


_evictions = [0]  # how many times `evict_user_traces` ran: a trace that saw it move may hold old ones


def evictions() -> int:
    """A counter `evict_user_traces` moves: a thread that traced while it moved (a compile ahead, a
    trace-reuse warming) may have cached an inner trace of the old code, and evicts again (`_compile`)."""
    return _evictions[0]


def evict_user_traces() -> None:
    """Drop JAX's cached traces of the user's own functions. JAX caches the traces of inner `jax.jit` /
    `checkpoint` functions by identity; a recompile after an edit would otherwise rebuild around the
    old inner trace of a helper that changed. Only user functions' traces go: the user's other compiled
    `jax.jit` functions keep theirs."""
    _evictions[0] += 1
    if not evict_traces(_wraps_user_code):
        jax.clear_caches()


def _scan() -> None:
    with _lock:
        # The world this scan checks against: a bump while it runs (the watcher's thread) scans again.
        # It is marked scanned only once the scan finished, so one interrupted (Ctrl-C) runs again.
        target = world()
        _scan_entries()
        _state.scanned_world = target


def _scan_entries() -> None:
    memo: dict = {}
    poisoned, names = [], []
    evict = False  # a program was poisoned (said, or an unused one compiled ahead dropped)
    disk: dict[str, str | None] = {}  # name -> digest of the file version it is edited in
    held = _held_poisoned()
    for entry in [*_state.entries.values(), *_state.orphans.alive()]:
        closure = entry.closure
        if closure is None:
            continue
        drifted = closure.drift(memo)
        if drifted:
            evict = True
            if poison(entry, drifted):
                poisoned.append(entry)
                names.extend(n for n in drifted if n not in names)
        else:
            disk.update(closure.disk_edit_versions(memo))
    # An edit reverted (its dependencies fingerprint as at compile time again) makes a poisoned entry
    # current again: revived, it is served instead of compiled anew, and its old handles stop warning.
    # After the poisoning above, so the key it takes back is free when the reverted edit's own program
    # (compiled ahead, or by a rebuild) held it.
    for entry in held:
        if entry.closure is not None and not entry.closure.drift(memo):
            revive(entry)
    # Said once per edit: a name stays reported until it stops being a pending disk edit (reloaded), or
    # its file is saved again with another version of it (a second edit is said too).
    said = _state.disk_reported
    _state.disk_reported = dict(disk)
    disk = [n for n, version in disk.items() if said.get(n, "") != version]
    if evict:
        evict_user_traces()
    if poisoned:
        # A `nitro_ipy.jit` function's programs are not said here: its next call recompiles and its one
        # compile line names what changed (`_jit.py`).
        said = [e for e in poisoned if e.kind != "jit"]
        if said:
            _report.emit(Kind.STALE_CACHE, count=len(said), names=_report.merge_names(said),
                         kinds=tuple(e.kind for e in said))
    if disk:
        _report.emit(Kind.DISK_EDIT, names=tuple(disk))
