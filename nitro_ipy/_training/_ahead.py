"""Compile ahead: after an edit poisons programs, the replacements of the programs that edit moved compile
in the background, under the keys a rebuilt handle will ask for, so `n.rebuild()` finds them ready.

The rule, applied in one place (`after_edit`: the extension's post-cell hook, or `bump_world(ahead=True)`
in a script; docs/recompilation.md states it for users):
- only after an edit that poisoned programs since the last cell (`_cache.moved_since`: served entries of
  this cache generation; `cache_reset()` forgets and never starts a compile; a no-op edit starts nothing);
- only the programs that edit moved: a handle's program whose entry is poisoned (`_staleness.stale`) or
  whose key, recomposed against the live code exactly as `rebuild()` keys it (`_staleness.rebind`,
  `rebound_model`), moved, and that the cache does not serve;
- only for the handles the user can run next (`targets`): bound to a name in the user's namespace, not
  superseded by their own `rebuild()` result or by a newer bound handle of the same experiment class;
- a newer edit cancels the queued work for the programs it moves again (`_planned`), and nothing else.
Live handles are tracked weakly (`track`), each with the recipe of every program it resolved
(`resolved`): its spec, hook, batch fields and the shapes of its arguments.
- Two worker threads compile them, in order, through `_compile.compile_ahead` (the cache's single-flight
  claim: a rebuild that needs a program in flight waits for it, never a second copy). One traces at a
  time; the next job starts as soon as the one before reaches XLA (`WORKERS`), so the evaluation
  program compiles beside the gradient program. A program whose code drifted while it compiled is
  dropped, not served; a new edit drops from the queue what it made stale, so that is never started.
- A compile ahead after an edit waits while a step loop runs and for `QUIET_S` after (training comes
  first), unless a rebuild waits for it.
- The workers say nothing: their compile lines are held on the entry and said by the handle that first
  takes the program (`_cache._served`), in its thread. A compile that raised leaves the key unclaimed, so
  the rebuild compiles it in the foreground and raises there, with the user's traceback.
- A cell starting while a job is ready to trace waits for its trace first (`_about_to_trace`, `_world`).
- `prefetch_eval`: a training handle's evaluation forward compiles while its first epoch runs: from the
  moment its first step's XLA compile starts (the `xla_start` event), or from its first step on when
  nothing compiles (`_pipeline` reports it through `stepping`); its device metrics' programs follow
  (`metric_jobs`, shaped from the evaluation program's outputs).

Off with `set_compile_ahead(False)`, `%nitro_ahead off`, or `NITRO_IPY_AHEAD=0` in the environment.
"""

import atexit
import collections
import itertools
import os
import sys
import threading
import time
import weakref
from typing import NamedTuple

import jax
import numpy as np

from .. import _closure
from .._base import _events, _memo, _report, _sharding, _world
from .._base._compat import compiled_out_avals
from .._base._live import live_value
from .._base._origin import user_namespaces
from .._compiler import _cache, _compile, _reuse
from .._experiment._data import split_len
from ._programs import EVAL, METRIC, SPECS, program_key
from ._staleness import rebind, rebound_model, stale

ENV = "NITRO_IPY_AHEAD"
# The workers' niceness (Linux sets it per thread). It covers the trace and lowering, which run in the
# worker; XLA compiles on its own threads, made at the process's first compile at normal priority, so
# the XLA part of a compile ahead competes with the foreground as any compile does (docs/recompilation.md).
NICE = 10
_OFF = ("0", "off", "false", "no")
_enabled = os.environ.get(ENV, "1").strip().lower() not in _OFF
# The order replacements compile in: what a rebuilt handle's first step needs first.
_ORDER = {kind: i for i, kind in enumerate(SPECS)}


def set_compile_ahead(enabled: bool) -> bool:
    """Turn compiling ahead on or off for this process (the default: on, unless `NITRO_IPY_AHEAD=0`).
    Off, an edit compiles nothing until a rebuilt handle asks, as before. Returns the previous setting."""
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"`set_compile_ahead` takes True or False; got {enabled!r}.")
    previous, _enabled = _enabled, enabled
    if not enabled:
        cancel()
    return previous


def compile_ahead_enabled() -> bool:
    return _enabled


class Recipe(NamedTuple):
    """What a handle resolved one program from: enough to key and build its replacement."""

    spec: object
    hook: str | None
    fields: dict
    args: tuple  # the arguments, arrays replaced by `jax.ShapeDtypeStruct`s (nothing held alive)


class Job(NamedTuple):
    key: object
    fn: object
    args: tuple
    spec: object
    binding: object
    after: int = -1  # start once more than this many step loops started (a prefetch: its first step)
    out_shardings: object = None  # on a mesh: where the outputs go, as the handle compiles it
    then: object = None  # `then(entry)` -> the jobs that follow once this one's program exists
    mesh: object = None  # the handle's mesh: traced under it as the handle's methods trace (`in_mesh`)
    target: str = ""  # the names of the handle it is for (`%nitro_stats` says so)
    generation: int = -1  # the cache's generation when planned: a `cache_reset()` since cancels it


class Outcome(NamedTuple):
    """What the worker did with one job (`history()`, for tests and `%nitro_ahead`)."""

    kind: str
    status: str  # "compiled", "had", "drifted", "failed", "cancelled"
    detail: object


_recipes: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # handle -> {key: Recipe}
_born: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # handle -> its place in creation order
_births = itertools.count()
_successors: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # handle -> weak ref to its rebuild
# handle -> {key of a program it runs: the replacement's key}: what a newer edit moving it again cancels
_planned: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_mark = None  # `_cache.moved_since`'s mark at the last `after_edit`: poisonings after it are the new edit's
_cv = threading.Condition()
_queue: collections.deque = collections.deque()
_wanted: set = set()  # keys still wanted: a job whose key left it (a newer edit) is dropped, not compiled
# Two workers, so independent programs compile at once: XLA's compile releases the GIL, and a second
# program's trace runs while the first one is in XLA. Only one traces at a time (`_tracing`): two would
# share the GIL, and the first program (what the rebuilt handle's first step needs) be ready later.
WORKERS = 2
_busy: dict = {}  # worker thread -> the Job it runs
_tracing: set = set()  # workers whose job has not reached its XLA compile yet
_workers: list = []
_failed = _memo.Memo("ahead.failed", 256)  # keys whose compile raised: the rebuild compiles (and raises) them
_history: collections.deque = collections.deque(maxlen=64)  # (order taken, Outcome)
_taken = 0  # jobs taken off the queue so far: `history()` lists outcomes in the order jobs started
_loops = 0  # step loops started (`stepping`) and foreground XLA compiles: a prefetch waits for one
# A compile ahead after an edit waits while a step loop runs (foreground or a background run) and for
# this long after the last one ended: a dispatch-bound loop keeps both of these 2 cores busy, and one
# thread of compile work beside it slows it 1.8x (a trace also takes the GIL). A rebuild waiting for the
# program lets it go on at once; a compile already in XLA when a loop starts runs to its end.
QUIET_S = 0.25
_running: dict = {}  # thread ident -> step loops past their first step in that thread, not ended yet
_last_loop = 0.0  # `time.monotonic()` when a step loop last started or ended


def stepping(running: bool | None, thread: int | None = None) -> None:
    """`_pipeline`: a step loop in `thread` (default: this one) passed its first step (True), or ended
    (False); None (`steps_over`, at its epoch's end with Ctrl-C held): every step loop of this thread is
    over. A Ctrl-C in the batch stream's end can skip its False: compile ahead would wait for life."""
    global _last_loop, _loops
    me = threading.get_ident() if thread is None else thread
    with _cv:
        left = 0 if running is None else _running.get(me, 0) + (1 if running else -1)
        _running.update({me: left}) if left > 0 else _running.pop(me, None)
        _last_loop = time.monotonic()
        _loops += bool(running)
        _cv.notify_all()


def _held_back() -> float:
    """Seconds a compile ahead after an edit still waits for: while a step loop runs and for `QUIET_S`
    after the last one ended (0: it may go on). Under `_cv`."""
    if _running:
        return QUIET_S
    return max(0.0, _last_loop + QUIET_S - time.monotonic())


def _may_go(job: "Job") -> bool:
    """A prefetch serves the loop that is running; a compile ahead after an edit waits for the step
    loops, unless a handle already waits for the program it compiles (a rebuild: it goes on at once)."""
    return job.after >= 0 or _held_back() == 0 or _cache.awaited(job.key)


def _xla_started() -> None:
    """`_compile`: a build reached its XLA compile; its trace is done, and XLA holds no GIL.
    - In a worker: the other worker may start the next job (its trace runs beside this XLA compile).
      Its own XLA compile waits here while a step loop runs (`_may_go`), unless a rebuild needs it.
    - In any other thread (a handle's first step): a waiting prefetch starts now rather than after
      that step. XLA keeps about 1.7 of these 2 cores busy, so the evaluation program traces and
      compiles beside the gradient program's XLA; for a CNN's rebuilt handle that takes most of its
      compile off the live-edit cycle (benchmarks/bench_models.py)."""
    global _loops
    me = threading.current_thread()
    if me in _busy:
        with _cv:
            _tracing.discard(me)
            _cv.notify_all()
            job = _busy[me]
            _wait_until(lambda: _may_go(job) or job.key not in _wanted)  # a step loop started meanwhile
            if job.key not in _wanted:  # a newer edit made it stale while it waited: no XLA for it
                raise Cancelled(job.key.kind)
    else:
        with _cv:
            _loops += 1
            _cv.notify_all()


class Cancelled(Exception):
    """Raised into a held-back build whose edit was superseded while it waited (the worker's own)."""


def _awaiting() -> None:
    """`_cache`: a thread waits for a key in flight; a held-back compile of it goes on."""
    with _cv:
        _cv.notify_all()


_events.subscribe("xla_start", _xla_started)
_events.subscribe("awaiting", _awaiting)
_events.subscribe("stepping", stepping)
_events.subscribe("steps_over", lambda: stepping(None))


def _quiet_now() -> bool:
    """`_reuse`: no step loop ran for `QUIET_S`, and no compile ahead is due or running."""
    with _cv:
        return _held_back() == 0 and not _busy and not _queue


def _about_to_trace() -> bool:
    """`_world`: a job taken is short of its XLA compile, or the next may start (a cell waits: `_world`)."""
    with _cv:
        return bool(_tracing) or _ready()


_reuse.IDLE.append(_quiet_now)
_world.PENDING.append(_about_to_trace)


# ---------------------------------------------------------------- the handle's side (main thread)
def track(handle) -> None:
    """Follow `handle` (weakly) so an edit that poisons its programs compiles their replacements."""
    _recipes[handle] = {}
    _born[handle] = next(_births)


def resolved(handle, spec, key, args: tuple, hook: str | None, fields: dict) -> None:
    """`handle` resolved the program `key` (new to it) from `args`: keep its recipe."""
    recipes = _recipes.get(handle)
    if recipes is not None and key not in recipes:
        recipes[key] = Recipe(spec, hook, dict(fields), _cache.shapes_of(args))


def rebuilt(old, new) -> None:
    """`old.rebuild()` returned `new`: while `new` lives, `old` is superseded (no compile ahead for it)."""
    if old in _recipes:
        _successors[old] = weakref.ref(new)


def targets(namespaces=()) -> list:
    """`[(handle, names)]`: the handles the user can run next, the only ones compiled ahead for. A handle
    is one when a name binds it in the user's namespace (the notebook's; `namespaces` add others, a
    script's frame) and nothing supersedes it: neither its `rebuild()` result, while that lives, nor a
    newer handle of the same experiment class bound to a name (`n2 = Nitro(e)` after `n = Nitro(e)`).
    History names (`_`, `_12`, `Out`) and names starting with `_` do not count."""
    tracked = {id(h): h for h in list(_recipes.keys())}
    if not tracked:
        return []
    names: dict = {}
    for ns in [user_namespaces()[0][1], *namespaces]:
        for name, value in list(ns.items()):
            if id(value) in tracked and isinstance(name, str) and name.isidentifier() and not name.startswith("_"):
                names.setdefault(id(value), set()).add(name)
    bound = [tracked[i] for i in names]
    newest: dict = {}  # experiment class (module.qualname) -> the newest bound handle's birth
    for h in bound:
        newest[h._state.binding.owner] = max(newest.get(h._state.binding.owner, -1), _born.get(h, -1))
    out = []
    for h in sorted(bound, key=lambda h: _born.get(h, -1)):
        successor = _successors.get(h)
        if successor is not None and successor() is not None:
            continue  # rebuilt: its rebuild is what the user runs next
        if _born.get(h, -1) < newest[h._state.binding.owner]:
            continue  # an older handle of the same experiment class
        out.append((h, tuple(sorted(names[id(h)]))))
    return out


def after_edit(namespaces=()) -> int:
    """The compile-ahead rule, applied after a cell (or `bump_world(ahead=True)`): scan for drift, and if
    an edit poisoned programs since the last call (in this cache generation: a `cache_reset()` forgets),
    queue the replacements of the programs that edit moved, for the `targets` holding them. A newer edit
    drops queued work for the programs it moves again. Returns how many jobs were queued; 0 when off,
    when no edit poisoned anything (a no-op edit, a reset, a cell that only trains), or when no live
    handle ran a program."""
    global _mark
    if not _enabled or not any(_recipes.values()):
        _mark = _cache.moved_since(_mark)[0]  # poisonings while off are never compiled for later
        return 0
    _cache.ensure_fresh()
    _mark, moved = _cache.moved_since(_mark)
    with _cv:
        pending = bool(_queue or _busy)
    if not moved and not pending:
        return 0
    jobs, wanted, dropped = plan(moved, namespaces)
    return _submit(jobs, wanted, dropped)


def bump_world(ahead: bool = False) -> int:
    """Mark that code may have changed (`importlib.reload`, a redefinition in a script); returns the new
    world. With `ahead=True`, also start compiling, in the background, the replacements of the programs
    the change poisoned, for the handles bound to a name in the caller's frame or `__main__` (as the
    notebook extension does after every cell, for the notebook's names)."""
    w = _world.bump_world()
    if ahead:
        caller = sys._getframe(1)
        try:
            after_edit((caller.f_locals, caller.f_globals))
        finally:
            del caller
    return w


def plan(moved=(), namespaces=()) -> tuple[list, set, set]:
    """`(jobs, wanted, dropped)` for an edit that poisoned the entries `moved`: for each of the `targets`
    the edit touched (it runs a moved entry, a replacement compiled for it moved again, or work is due
    for it), the replacement of each program whose entry is poisoned or whose key moved (recomposed
    against the live code, exactly as `rebuild()` keys it) that the cache lacks. `wanted` gets the
    replacement keys the cache has or is compiling too; `dropped` the keys of replacements planned
    before that this edit moved again (or reverted): their queued work is cancelled."""
    moved_keys = {e.key for e in moved}
    with _cv:
        due = set(_wanted)
    jobs, wanted, dropped, seen = [], set(), set(), set()
    for handle, names in targets(namespaces):
        recipes = _recipes.get(handle) or {}
        planned = _planned.setdefault(handle, {})
        if _across_processes(handle) or not recipes:
            continue
        entries = handle._programs
        touched = any(k in moved_keys or entries[k] in moved for k in recipes if k in entries) or any(
            k in moved_keys or k in due for k in planned.values())
        if not touched or not stale(handle, scan=False).programs and not planned:
            continue
        try:  # exactly what `rebuild()` binds; an error here is the rebuild's to raise, in the foreground
            b = rebind(handle)
        except Exception:  # noqa: BLE001
            continue
        jobs += _plan_handle(handle, names, b, recipes, planned, wanted, dropped, seen)
    return sorted(jobs, key=lambda j: _ORDER.get(j.spec.kind, len(_ORDER))), wanted, dropped - wanted


def _plan_handle(handle, names, b, recipes, planned, wanted, dropped, seen) -> list:
    """The jobs of one target `handle` against its rebuild's binding `b` (`plan`)."""
    model = None  # made for the first job only: most scans find every key compiled or in flight
    eval_key, metrics, mine = None, [], []
    target = ", ".join(f"`{n}`" for n in names)
    generation = _cache.generation()
    for slot, r in list(recipes.items()):
        entry = handle._programs.get(slot)
        # Instances of a re-run class cell in the arguments (an Equinox model as the params) take the
        # live class, as `rebuild()` re-binds the training state: else the key is the old program's.
        args = live_value(r.args)
        if r.spec is METRIC:  # keyed below, from the evaluation program's outputs
            if entry is not None and entry.poisoned:
                metrics += metric_request(r.hook, args)
            continue
        key = program_key(r.spec, b, args, handle._settings, r.hook)
        if key.context != slot.context:
            # The handle ran it under another JAX configuration (a thread-local setting around its cell):
            # its rebuild there asks for that one, which this thread cannot trace (`_compiler/_context.py`).
            continue
        is_moved = (entry is not None and entry.poisoned) or key != slot
        if r.spec is EVAL and eval_key is None:
            eval_key = key
            if is_moved:  # the outputs' shapes may have moved: every device metric is keyed anew
                metrics = [m for rr in recipes.values() if rr.spec is METRIC
                           for m in metric_request(rr.hook, live_value(rr.args))]
        before = planned.get(slot)
        if not is_moved:  # current (an edit reverted): nothing due for it
            if before is not None:
                dropped.add(before)
                del planned[slot]
            continue
        if before is not None and before != key:
            dropped.add(before)  # moved again: the earlier edit's replacement is not what a rebuild asks
        planned[slot] = key
        if key in _failed:
            continue
        wanted.add(key)  # in flight already counts: a job holding it goes on
        if key in seen or _cache.known(key):
            continue
        seen.add(key)
        if model is None:
            model = rebound_model(handle, b)
        fn = r.spec.build(b, model, handle.accum, r.hook, **r.fields)
        mine.append(Job(key, fn, args, r.spec, b, mesh=handle._state.place.mesh,
                        out_shardings=handle._state.place.out_shardings(r.spec.kind, args, model),
                        target=target, generation=generation))
    if metrics and eval_key is not None:
        # A device metric's arguments are the evaluation program's outputs, whose shapes an edit can
        # change (a forward that now returns another shape): its replacements are keyed from the
        # replacement evaluation program's outputs, once that program exists, never from the shapes
        # the old one gave. One in flight already (an earlier scan's job) queues them when it ends.
        model = rebound_model(handle, b) if model is None else model
        then = _metrics_after(handle, metrics, b, model, target)
        queued = [i for i, j in enumerate(mine) if j.key == eval_key]
        stored = _cache.peek(eval_key)
        if queued:
            mine[queued[0]] = mine[queued[0]]._replace(then=then)
        elif stored is not None:
            for job in then(stored):
                wanted.add(job.key)
                if job.key not in seen:
                    seen.add(job.key)
                    mine.append(job)
    return mine


def _across_processes(handle) -> bool:
    """A handle on a mesh that spans processes (`jax.distributed`) compiles its programs itself, on
    demand: every process must build the same program at the same point of the run, and a background
    compile in each would start whenever that process's cell ended (docs/scale.md). A mesh within this
    process compiles ahead like one device: the recipes' argument shapes keep their shardings, and each
    job takes the output shardings the handle's `_place` gives its program."""
    return bool(getattr(getattr(handle, "_place", None), "multi_process", False))


def prefetch_eval(handle) -> bool:
    """Queue `handle`'s evaluation forward (when it has a `valid` split) to compile in the background
    while its first epoch trains; validation then finds it compiled or waits for the one in flight."""
    b = handle._state.binding
    split = b.splits.get("valid")
    if not _enabled or not isinstance(split, dict) or _across_processes(handle):  # a loader: compiled at use
        return False
    inputs = b.routes["forward"].pick(split)
    targets = b.routes["loss"].pick(split) if b.loss is not None else ()
    key, args = eval_key(handle, split, inputs, targets)
    # A handle that holds its evaluation program already (it validated before a `cache_reset()`) runs
    # that one: compiling it again would put an entry in the cache that nothing asked for, nor said.
    if key in _failed or key in handle._programs or _cache.known(key):
        return False
    fn = EVAL.build(b, handle._state.model, handle.accum, None, inputs=inputs, targets=targets)
    device_metrics = [name for name, (_, residency) in b.metrics.items() if residency == "device"]
    n, width = split_len(split), handle.batch_size
    lengths = ([width] if n >= width else []) + ([n % width] if n % width else [])  # validation's order
    requests = [(name, rows, handle._state.dev, {k: jax.ShapeDtypeStruct((rows,) + split[k].shape[1:], split[k].dtype)
                                           for k in b.routes[name].pick(split)})
                for rows in lengths for name in device_metrics]
    then = _metrics_after(handle, requests) if requests else None
    with _cv:
        if any(j.key == key for j in _queue):
            return False
        _queue.append(Job(key, fn, args, EVAL, b, _loops, then=then, mesh=handle._state.place.mesh,
                          out_shardings=handle._state.place.out_shardings(EVAL.kind, args, handle._state.model),
                          generation=_cache.generation()))
        _wanted.add(key)
        _start()
        _cv.notify_all()
    return True


def eval_key(handle, split: dict, inputs, targets) -> tuple:
    """`(key, args)` of the evaluation program `handle._evaluate` resolves for `split`: its arguments'
    shapes, batches padded to the batch width and placed as the handle places them (split along a mesh's
    data axis), without evaluating anything."""
    width, place = handle.batch_size, handle._state.place

    def batch(names):  # a zero batch of the width, placed, then only its shapes and shardings kept
        zeros = {k: np.zeros((width,) + split[k].shape[1:], split[k].dtype) for k in names}
        return _cache.shapes_of(place.batch(zeros))

    args = _cache.shapes_of((handle._state.params, handle._state.model_state, handle._state.dev)) + (
        batch(inputs), batch(targets), _cache.shapes_of(place.replicate(np.int32(0))))
    return program_key(EVAL, handle._state.binding, args, handle._settings), args


def metric_request(name: str, args: tuple) -> list:
    """`[(name, rows, dev, fields)]` of a device metric's program that ran with `args`: what a
    replacement keeps (its rows, `Device` values and batch fields) when its outputs' shapes are taken
    anew; [] when nothing in it has rows (it then compiles on demand)."""
    dev, outs, fields = args
    leaves = [a for a in jax.tree.leaves((outs, fields)) if len(a.shape)]
    return [(name, leaves[0].shape[0], dev, fields)] if leaves else []


def _metrics_after(handle, requests: list, b=None, model=None, target: str = ""):
    """An evaluation job's `then`: `metric_jobs` of `requests` once its program exists, for `handle`
    (held weakly) as it is then."""
    ref, generation = weakref.ref(handle), _cache.generation()
    return lambda entry: metric_jobs(ref(), entry, requests, b, model, target, generation)


def metric_jobs(handle, eval_entry, requests: list, b=None, model=None, target: str = "",
                generation: int = -1) -> list:
    """The device metrics' programs `handle._evaluate` resolves once its evaluation program
    `eval_entry` exists, one per request `(name, rows, dev, fields)` (in validation's order: per batch
    length, full batches and a shorter last one, each metric hook): their arguments are shaped from that
    program's outputs, sliced to `rows` and placed as validation slices and places them. Built against
    binding `b` and `model` (a rebuild's; the handle's own by default). [] when the handle is gone or
    the program does not say its output shapes."""
    out_avals = None if handle is None else compiled_out_avals(eval_entry.call)
    if out_avals is None:
        return []
    b, model, place = b or handle._state.binding, model or handle._state.model, handle._state.place
    jobs, seen = [], set()
    for name, rows, dev, fields in requests:
        shaped = lambda a: ((rows,) + tuple(a.shape[1:]), a.dtype)  # noqa: E731
        outputs = jax.tree.map(lambda o: np.zeros(*shaped(o)), out_avals[0])
        zeros = {k: np.zeros(f.shape, f.dtype) for k, f in fields.items()}
        outs, placed = _cache.shapes_of(place.metric_args((outputs, zeros)))
        if place.mesh is None:  # the evaluation program's outputs as they are: their weak types kept
            outs = jax.tree.map(lambda o: jax.ShapeDtypeStruct(*shaped(o), weak_type=bool(o.weak_type)),
                                out_avals[0])
        args = (_cache.shapes_of(dev), outs, placed)
        key = program_key(METRIC, b, args, handle._settings, name)
        if key not in seen and key not in _failed and not _cache.known(key):
            seen.add(key)
            jobs.append(Job(key, METRIC.build(b, model, handle.accum, name), args, METRIC, b, mesh=place.mesh,
                            out_shardings=place.out_shardings(METRIC.kind, args, model), target=target,
                            generation=generation))
    return jobs


def _following(job: Job, entry) -> list:
    """The jobs `job.then` makes of its program `entry` (none when it has no `then`, or raised: those
    programs then compile on demand, as without it). Not under `_cv`: it keys and builds programs."""
    if job.then is None or entry is None:
        return []
    try:
        return job.then(entry)
    except Exception:  # noqa: BLE001
        return []


def _follow(job: Job, jobs: list) -> None:
    """Queue `jobs` (`_following`) at the head, as validation is about to need them; they start when
    `job` could. Under `_cv`."""
    if job.key not in _wanted:  # a newer edit made `job` stale: what follows it would be too
        return
    fresh = [j._replace(after=job.after) for j in jobs if j.key not in _wanted]
    _wanted.update(j.key for j in fresh)
    _queue.extendleft(reversed(fresh))


def _submit(jobs: list[Job], wanted: set, dropped: set) -> int:
    """A new edit's plan: the queued work it moved again (`dropped`, keys no plan wants now) is dropped,
    the rest stays queued (other handles' replacements, a training handle's prefetch), and `jobs` not
    queued yet join."""
    with _cv:
        _wanted.difference_update(dropped)
        _wanted.update(wanted)
        _wanted.update(j.key for j in jobs)
        _drop_unwanted()
        queued = {j.key for j in _queue}
        _queue.extend(j for j in jobs if j.key not in queued)
        if _queue:
            _start()
        _cv.notify_all()
    return len(jobs)


def _drop_unwanted() -> None:
    """Take the queued jobs whose key left `_wanted` off the queue (noted "cancelled"). Under `_cv`."""
    kept = [j for j in _queue if j.key in _wanted]
    for job in _queue:
        if job.key not in _wanted:
            _note(job, "cancelled")
    _queue.clear()
    _queue.extend(kept)


def cancel() -> None:
    """Drop every queued compile (the one in flight finishes, unless it waits for a step loop; its
    result is checked for drift) and forget what was planned."""
    with _cv:
        _wanted.clear()
        _drop_unwanted()
        _planned.clear()
        _cv.notify_all()


def wait(timeout: float | None = None) -> bool:
    """Block until the worker is idle (tests, benchmarks); True unless `timeout` ran out first."""
    with _cv:
        return _cv.wait_for(lambda: not _queue and not _busy, timeout)


EXIT_WAIT_S = 30.0  # at most this long at exit for the job in flight (a trace, or an XLA compile)


@atexit.register
def _at_exit() -> None:
    # A daemon worker stopped inside a trace or an XLA compile while the interpreter shuts down can crash
    # the process (a segfault after bench_ahead's last line, 1 run in 5). So drop what is queued (a job
    # that has not reached XLA yet then stops there, `Cancelled`) and let the one in flight end first.
    cancel()
    wait(EXIT_WAIT_S)


def status() -> str:
    """One line on the work due, for `%nitro_ahead`: '' when there is none."""
    with _cv:
        jobs = [*_busy.values(), *_queue]
        kinds, held = [j.key.kind for j in jobs], any(not _may_go(j) for j in jobs)
    line = f"{len(kinds)} program{'s' if len(kinds) != 1 else ''} due ({', '.join(kinds)})" if kinds else ""
    return line and line + (", held back while a step loop runs: they compile once it ends, or at once for a"
                            " rebuild that needs them." if held else ".")


def history() -> list[Outcome]:
    """What the workers did, in the order the jobs started (bounded)."""
    with _cv:
        return [outcome for _, outcome in sorted(_history, key=lambda h: h[0])]


def reset() -> None:
    """Forget failures, history and successors (`cache_reset`'s companion, for tests)."""
    cancel()
    wait()
    with _cv:
        _failed.clear()
        _history.clear()
        _successors.clear()


_memo.register(cancel)  # `cache_reset()` drops the queued jobs (they hold the user's functions): it forgets


# ---------------------------------------------------------------- the worker
def _next_order() -> int:
    """The place of a job taken off the queue (under `_cv`), for `history()`."""
    global _taken
    _taken += 1
    return _taken


def _note(job: Job, status: str, detail=None, order: int | None = None) -> None:
    _history.append((_next_order() if order is None else order, Outcome(job.key.kind, status, detail)))


def _start() -> None:
    """Start the workers not running yet (under `_cv`); idle ones wait on it and cost nothing."""
    _workers[:] = [w for w in _workers if w.is_alive()]
    while len(_workers) < WORKERS:
        worker = threading.Thread(target=_work, name=f"nitro_ipy-ahead-{len(_workers) + 1}", daemon=True)
        _workers.append(worker)
        worker.start()


def _ready() -> bool:
    return bool(_queue) and _loops > _queue[0].after and not _tracing and _may_go(_queue[0])


def _wait_until(ready) -> None:
    """`_cv.wait_for(ready)`, waking up when the quiet time after a step loop runs out (under `_cv`)."""
    while not ready():
        left = _held_back()
        _cv.wait(max(left, 0.01) if left else None)


def _work() -> None:
    me = threading.current_thread()
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except (AttributeError, OSError):  # not Linux: the trace runs at the process's priority
        pass
    while True:
        with _cv:
            _wait_until(_ready)
            job = _busy[me] = _queue.popleft()
            _tracing.add(me)
            order = _next_order()
        try:
            if job.key not in _wanted:
                with _cv:
                    _note(job, "cancelled", order=order)
                continue
            b = job.binding
            info = {"graphconst": b.graphconst.info}
            if job.target:
                info["ahead"] = f"compiled ahead for {job.target}"
            with _sharding.auto_context(job.mesh):
                status, entry, detail = _compile.compile_ahead(
                    job.key, job.fn, job.args, donate_argnums=job.spec.donate, info=info,
                    generation=job.generation if job.generation >= 0 else None,
                    record=_closure.record_hooks(b.cls, job.key.hooks),
                    compiler_options=job.spec.compiler_options, sources=b.graphconst_sources,
                    out_shardings=job.out_shardings,
                    ahead=_report.BESIDE_TRAINING if job.after >= 0 else _report.AFTER_EDIT)
            follow = _following(job, entry)
            with _cv:
                if status == "failed" and isinstance(detail, Cancelled):
                    status, detail = "cancelled", None
                if status == "failed":
                    _failed[job.key] = True
                _note(job, status, detail if status != "compiled" else None, order=order)
                _follow(job, follow)
        except BaseException as err:  # noqa: BLE001 - the worker outlives anything one job does
            with _cv:
                _note(job, "failed", err, order=order)
        finally:
            with _cv:
                _busy.pop(me, None)
                _tracing.discard(me)
                _cv.notify_all()
            # Nothing of the job outlives it in this idle thread: a program kept alive here would be
            # checked (and said poisoned) after a `cache_reset()` as if a handle still ran it.
            job = entry = follow = detail = b = info = None
