"""The module-level compile cache: keys, entries, hit/miss counters, miss explanations, poisoning."""

import dataclasses
import math
import time
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from . import _memo, _world
from ._compat import jaxpr_eqns, unknown_compile_option


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


@dataclasses.dataclass(frozen=True)
class Key:
    """A program's compile key. Every component earns its place (see docs/recompilation.md)."""

    kind: str  # "grad", "opt", "eval", "metric:<hook>", "predict"
    owner: str  # the experiment type's qualified name
    hooks: tuple  # ((hook name, code fingerprint), ...) of the hooks the program traces
    args: tuple  # (treedef repr, (ArgSig, ...)) of the traced arguments
    graphconst: str  # graphconst_field_hash(e)
    options: tuple  # ((name, value), ...) trace-time options that change the graph (accum, layout)


def arg_signature(args: tuple, names: tuple = ()) -> tuple:
    """The `args` key component: tree structure plus shape, dtype, weak type and sharding of each leaf.

    `names` label the positional arguments in explanations (`params['w1']` rather than `[0]['w1']`).
    Sharding enters only when it spans several devices: one device is the default placement, whether
    the leaf arrived as numpy or as a committed array.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(args)
    sigs = []
    for path, leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None and len(sharding.device_set) == 1:
            sharding = None
        label = jax.tree_util.keystr(path[1:])
        if names and path and isinstance(path[0], jax.tree_util.SequenceKey) and path[0].idx < len(names):
            label = names[path[0].idx] + label
        else:
            label = jax.tree_util.keystr(path)
        sigs.append(
            ArgSig(
                label,
                tuple(np.shape(leaf)),
                str(getattr(leaf, "dtype", None) or np.result_type(leaf)),
                bool(getattr(leaf, "weak_type", False)),
                None if sharding is None else repr(sharding),
            )
        )
    return (str(treedef), tuple(sigs))


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
    world: int = 0
    compiler_options: dict = dataclasses.field(default_factory=dict)  # the XLA options it was compiled with

    @property
    def kind(self) -> str:
        return self.key.kind

    @property
    def hook_names(self) -> tuple:
        return tuple(name for name, _ in self.key.hooks)

    def shapes(self) -> str:
        return ", ".join(f"{s.path or 'arg'}{list(s.shape)}" for s in self.key.args[1] if s.shape)


class _State:
    def __init__(self):
        self.entries: dict[Key, Entry] = {}
        self.poisoned: list[Entry] = []
        self.hits = 0
        self.misses = 0
        self.scanned_world = -1
        self.disk_reported: set[str] = set()


_state = _State()


def cache_stats() -> CacheStats:
    """`(hits, misses, entries)` of the process-wide compile cache; hits and misses are cumulative."""
    return CacheStats(_state.hits, _state.misses, len(_state.entries))


def cache_reset() -> None:
    """Empty the compile cache and zero its counters: the escape hatch for anything staleness cannot see."""
    global _state
    _memo.clear_all()
    _state = _State()
    _state.scanned_world = _world.world()
    _notify(_on_reset)


_on_reset: list[Callable[[], None]] = []


def _notify(callbacks: list, *args) -> None:
    """Call front-end callbacks; one that raises never breaks training or a compile."""
    for fn in callbacks:
        try:
            fn(*args)
        except Exception:
            pass


def live_entries() -> list[Entry]:
    return list(_state.entries.values())


def poisoned_entries() -> list[Entry]:
    return list(_state.poisoned)


def count_hit(entry: Entry, uses: int = 1) -> None:
    """A handle reusing a program it already resolved counts as a cache hit, once per use."""
    entry.hits += uses
    _state.hits += uses


def lookup(key: Key) -> Entry | None:
    """The live entry for `key`, counted as a hit, or None (nothing counted)."""
    entry = _state.entries.get(key)
    if entry is not None:
        count_hit(entry)
    return entry


def compile_program(
    key: Key,
    fn: Callable,
    args: tuple,
    *,
    donate_argnums: tuple = (),
    info: dict | None = None,
    record: Callable | None = None,
    compiler_options: dict | None = None,
) -> Entry:
    """Count a miss, trace/lower/compile `fn` at `args` (JAX AOT), time it and store the entry.

    `record`, when given, is a context-manager factory that records the trace's dependency closure;
    its result (the `closure` attribute of the manager) lands on the entry.
    """
    why = explain_miss(key, info or {})
    jitted = jax.jit(fn, donate_argnums=donate_argnums)
    t0 = time.perf_counter()
    if record is not None:
        # Only the trace runs user Python; lowering stays outside the recorder (and off a profiler hook).
        with record() as recorder:
            traced = jitted.trace(*args)
            recorder.traced(traced.jaxpr, fn)
        closure = recorder.closure
    else:
        traced, closure = jitted.trace(*args), None
    lowered = traced.lower()
    t1 = time.perf_counter()
    compiled, used = _compile(lowered, program_options(traced.jaxpr, compiler_options))
    t2 = time.perf_counter()
    entry = Entry(key, compiled, t1 - t0, t2 - t1, closure, info or {}, why, world=_world.world(),
                  compiler_options=used)
    # A trace that raised (a bug in a hook) stored nothing, so it counts nothing: misses == entries holds.
    _state.misses += 1
    _state.entries[key] = entry
    _notify(_on_compile, entry)
    return entry


# XLA:CPU hands matrix multiplies to YNNPACK, which builds a runtime for each multiply the first time a new
# program runs: about 1 ms apiece here, 0.2 s on the first step of the 120-layer MLP's gradient program,
# paid again after every edit. For a multiply with at most one dimension above `NARROW_DOT` (every layer
# of a narrow MLP, at any batch size) XLA's own kernels run as fast (benchmarks/profile_handle.py `dots`),
# so a program whose multiplies are all that narrow is compiled without YNNPACK. Wider multiplies keep it:
# for a [8, 256] x [256, 256] it runs 1.3-1.6x faster.
NARROW_DOT = 64
_WITHOUT_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}


def program_options(jaxpr, options: dict | None = None) -> dict:
    """The compiler options for a program traced to `jaxpr`: `options`, plus XLA's own kernels for matrix
    multiplies where every one is narrow (see `NARROW_DOT`). Options given explicitly win."""
    out = dict(options or {})
    if jax.default_backend() == "cpu" and _all_dots_narrow(jaxpr):
        out = {**_WITHOUT_YNN, **out}
    return out


def _all_dots_narrow(jaxpr) -> bool:
    """True when `jaxpr` (sub-jaxprs included) multiplies matrices, and every multiply has at most one of
    its rows, columns and contracted size above `NARROW_DOT`."""
    dots = 0
    for eqn in jaxpr_eqns([jaxpr]):
        if eqn.primitive.name == "dot_general":
            dots += 1
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            rows = math.prod(d for i, d in enumerate(lhs) if i not in lc and i not in lb)
            cols = math.prod(d for i, d in enumerate(rhs) if i not in rc and i not in rb)
            inner = math.prod(lhs[i] for i in lc)
            if sorted((rows, cols, inner))[1] > NARROW_DOT:
                return False
    return dots > 0


def _compile(lowered, options: dict):
    """XLA-compile with `options`, leaving out each one this XLA does not know (options come and go
    between releases: jax 0.12 has no `xla_cpu_use_fusion_emitters`, but keeps the optimization level).
    Returns the executable and the options it was compiled with."""
    while options:
        try:
            return lowered.compile(compiler_options=options), options
        except Exception as err:
            unknown = unknown_compile_option(err)
            if unknown is None or unknown not in options:
                break  # not an unknown option: compile as usual
            del options[unknown]
    return lowered.compile(), {}


_on_compile: list[Callable[[Entry], None]] = []

# Called with no arguments at the handle's periodic sync points in the step loop (about every 0.25 s),
# so a live front end (the notebook panel) can refresh mid-epoch without a per-step cost.
_on_progress: list[Callable[[], None]] = []


def explain_miss(key: Key, info: dict) -> str | None:
    """Why `key` missed, next to the most similar entry of the same kind and owner: old -> new."""
    candidates = [e for e in (*_state.entries.values(), *_state.poisoned) if e.key.kind == key.kind]
    candidates = [e for e in candidates if e.key.owner == key.owner]
    if not candidates:
        return None
    best = min(candidates, key=lambda e: len(_diff(e.key, key, e.info, info)))
    lines = _diff(best.key, key, best.info, info)
    if not lines and best.poisoned:
        return "recompiling against edited code: " + ", ".join(best.drifted)
    return "; ".join(lines) if lines else None


def _diff(old: Key, new: Key, old_info: dict, new_info: dict) -> list[str]:
    out = []
    old_hooks, new_hooks = dict(old.hooks), dict(new.hooks)
    for name in sorted(old_hooks.keys() | new_hooks.keys()):
        if old_hooks.get(name) != new_hooks.get(name):
            out.append(f"hook `{name}` was redefined")
    if old.graphconst != new.graphconst:
        a, b = old_info.get("graphconst", {}), new_info.get("graphconst", {})
        moved = [n for n in sorted(a.keys() | b.keys()) if a.get(n, (None,))[0] != b.get(n, (None,))[0]]
        for n in moved:
            out.append(f"GraphConst `{n}`: {a.get(n, (None, '?'))[1]} -> {b.get(n, (None, '?'))[1]}")
        if not moved:
            out.append("GraphConst fields moved")
    if old.args != new.args:
        out.extend(_diff_args(old.args, new.args))
    if old.options != new.options:
        a, b = dict(old.options), dict(new.options)
        for n in sorted(a.keys() | b.keys()):
            if a.get(n) != b.get(n):
                out.append(f"option `{n}`: {a.get(n)!r} -> {b.get(n)!r}")
    return out


def _diff_args(old, new) -> list[str]:
    (old_tree, old_sigs), (new_tree, new_sigs) = old, new
    if old_tree != new_tree:
        return [f"argument structure: {_short(old_tree)} -> {_short(new_tree)}"]
    out = []
    for a, b in zip(old_sigs, new_sigs):
        for field, label in (("shape", "shape"), ("dtype", "dtype"), ("weak", "weak_type"), ("sharding", "sharding")):
            x, y = getattr(a, field), getattr(b, field)
            if x != y:
                shown = (list(x), list(y)) if field == "shape" else (x, y)
                out.append(f"argument `{b.path}` {label}: {shown[0]} -> {shown[1]}")
    return out


def _short(s: str, n: int = 80) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def poison(entry: Entry, drifted) -> None:
    """Never serve `entry` again; handles that hold it keep running it (fixed point) and are told so."""
    if entry.poisoned:
        return
    entry.poisoned = True
    entry.drifted = tuple(drifted)
    if _state.entries.get(entry.key) is entry:
        del _state.entries[entry.key]
    _state.poisoned.append(entry)


def ensure_fresh() -> None:
    """Re-resolve every live entry's dependency closure if the world moved since the last scan.

    Memoized on `world()`: after no bump this is one integer comparison. Drifted entries are poisoned
    and the cache-level message says so, once per redefinition.
    """
    if _state.scanned_world == _world._world:
        return
    _scan()


def _scan() -> None:
    from . import _report

    _state.scanned_world = _world._world
    memo: dict = {}
    poisoned, names = [], []
    disk: list[str] = []
    for entry in list(_state.entries.values()):
        closure = entry.closure
        if closure is None:
            continue
        drifted = closure.drift(memo)
        if drifted:
            poison(entry, drifted)
            poisoned.append(entry)
            names.extend(n for n in drifted if n not in names)
        else:
            disk.extend(n for n in closure.disk_edits(memo) if n not in disk)
    # Said once per edit: a name stays reported until it stops being a pending disk edit (reloaded).
    _state.disk_reported &= set(disk)
    disk = [n for n in disk if n not in _state.disk_reported]
    _state.disk_reported.update(disk)
    if poisoned:
        # JAX caches the traces of the user's own inner `jax.jit` / `checkpoint` functions by identity;
        # a recompile would otherwise rebuild around the old inner trace of a helper that changed.
        jax.clear_caches()
        kinds = ", ".join(sorted({e.kind for e in poisoned}))
        _report.emit(
            "stale-cache",
            f"nitro_ipy: {len(poisoned)} cached program{'s' if len(poisoned) != 1 else ''} ({kinds}) "
            f"poisoned; redefined: {', '.join(names)}. Handles built from now on recompile against "
            f"the current code.",
            count=len(poisoned),
            names=tuple(names),
            kinds=tuple(e.kind for e in poisoned),
        )
    if disk:
        _report.emit(
            "disk-edit",
            f"nitro_ipy: edited on disk, not loaded yet: {', '.join(disk)}. The running code is "
            f"unchanged; `importlib.reload` the module (or use `%autoreload 2`) to pick the edit up.",
            names=tuple(disk),
        )
