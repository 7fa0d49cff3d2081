"""Compiling one program: trace (recording its dependency closure), lower, XLA-compile with the option
policy below, time each part, and hand the entry to the cache.

The cache (`_cache.py`) owns keys, entries and counters; this module owns how a program is built.
"""

import contextlib
import gc
import math
import sys
import threading
import time
from typing import Callable

import jax
import numpy as np

from .._base import _events, _report, _world
from .._base._compat import (
    FUSION_EMITTERS_OPTION,
    INTERNAL_FLOATING_POINT_ERROR,
    OPTIMIZATION_LEVEL_OPTION,
    XLA_RUNTIME_ERRORS,
    YNN_FUSION_OPTION,
    jax_jit,
    jaxpr_eqns,
    own_compile,
    raise_deoptimized,
    unknown_compile_option,
)
from .._base._errors import NitroValueError, library_hint
from .._base._live import holds_user_instances, live_value
from .._base._report import Kind
from . import _cache, _context, _reuse, _store
from ._explain import explain_miss

# XLA:CPU hands matrix multiplies to YNNPACK, which builds a runtime for each multiply the first time a new
# program runs: about 1 ms apiece here, 0.2 s on the first step of the 120-layer MLP's gradient program,
# paid again after every edit. For a multiply with at most one dimension above `NARROW_DOT` (every layer
# of a narrow MLP, at any batch size) XLA's own kernels run as fast (benchmarks/profile_handle.py `dots`),
# so a program whose multiplies are all that narrow is compiled without YNNPACK. Wider multiplies keep it:
# for a [8, 256] x [256, 256] it runs 1.3-1.6x faster.
NARROW_DOT = 64
WITHOUT_YNN = {YNN_FUSION_OPTION: ""}

# The optimizer program unravels the flat buffers into one slice per parameter array. XLA:CPU's fusion
# emitters compile each slice as its own LLVM module (35-150 ms apiece here: 4-6 s at 242 arrays); the
# classic emitters at optimization level 1 compile the same program in about a quarter of that and run it
# faster (benchmarks/profile_handle.py `optflags`). Only this program gets them: the gradient program,
# which every edit recompiles, compiles slower with them. An XLA without one of them (jax 0.12 dropped the
# fusion-emitter switch) compiles with the rest: level 1 alone takes 2.9 s there instead of 4.5 s.
OPTIMIZER_OPTIONS = {FUSION_EMITTERS_OPTION: False, OPTIMIZATION_LEVEL_OPTION: 1}

# A program with a convolution (a CNN's gradient, evaluation and predict programs) compiles with the classic
# emitters: XLA:CPU's fusion emitters spend about half again as much compile time on the fusions around
# convolutions and batch statistics (gradient programs, CPU seconds: bench_models' CNN 1.2 -> 0.7-0.8, a
# Conv + BatchNorm CNN 0.76 -> 0.48, a two-Conv CNN 0.65 -> 0.35), for run times within +-20% either way
# (benchmarks/profile_handle.py `convflags`). Every edit of a CNN recompiles these programs. Programs
# without one keep the fusion emitters: an MLP's gradient program compiles 2-12x slower with the classic
# ones. YNNPACK, which runs convolutions too, stays on there whatever the multiplies (`NARROW_DOT` was
# measured on multiplies only).
CONVOLUTION_OPTIONS = {FUSION_EMITTERS_OPTION: False}

# Programs without a convolution compile at XLA:CPU's backend optimization level 2, not its default 3:
# LLVM's level-3 pipeline spends more time on each fusion's kernel for no faster code. Gradient programs
# here: 7-35% less XLA compile time (a 120-layer MLP 0.37 -> 0.35 s, a 2-block attention 0.58 -> 0.48 s, a
# 1-layer MLP 0.14 -> 0.09 s), the same run time within the noise (0.97-1.02x over interleaved pairs), the
# 120-layer MLP's 0.92x (benchmarks/profile_handle.py `levels`). Every edit recompiles these programs.
# Convolution programs keep the default: with the classic emitters they compile 4-7% slower at 2.
LEVEL = {OPTIMIZATION_LEVEL_OPTION: 2}


# Called (no arguments) as a build's XLA compile starts, in the building thread: the XLA compile releases
# the GIL and leaves part of the CPU idle, so `_ahead` starts its next job then (`_ahead._xla_started`).


def compile_program(
    key,
    fn: Callable,
    args: tuple,
    *,
    donate_argnums: tuple = (),
    info: dict | None = None,
    record: Callable | None = None,
    compiler_options: dict | None = None,
    sources: dict | None = None,
    out_shardings=None,
):
    """Trace/lower/compile `fn` at `args` (JAX AOT), time it, and store the entry (a miss).

    **Arguments:**
    - `key`: the program's `_cache.Key`.
    - `fn`, `args`: what to trace, and the arguments it is called with.
    - `donate_argnums`: arguments whose buffers the program may reuse for its outputs.
    - `info`: what explains a later miss next to this entry (GraphConst reprs).
    - `record`: a context-manager factory that records the trace's dependency closure; its result (the
      `closure` attribute of the manager) lands on the entry.
    - `compiler_options`: XLA options, on top of `program_options`' policy.
    - `sources`: `{label: value}` a large constant baked into the program may have come from (the
      GraphConst fields), so the compile can say which one (`large_constants`).
    - `out_shardings`: where the outputs go on a mesh (`_sharding.Sharded.out_shardings`); None lets XLA
      choose (one device). Input shardings are the arguments' own.

    **Returns:** the stored `_cache.Entry`; if another thread is compiling the same key, the entry it
    stores (this thread waits for it: a key is compiled once, and the wait counts a hit).
    """
    entry, claimed = _cache.claim(key)
    if claimed is None:
        return entry
    try:
        entry = _load_or_build(key, fn, args, donate_argnums, info, record, compiler_options, sources,
                               out_shardings)
    except BaseException as err:
        _cache.release(claimed, err)
        raise
    # A trace that raised (a bug in a hook) stored nothing, so it counts nothing: misses == entries holds.
    _cache.store(entry, claimed)
    _save(entry)
    _report.emit(Kind.COMPILE, entry=entry)
    for nbytes, shape, dtype, origin in entry.constants:
        _report.emit(Kind.LARGE_CONSTANT, program=entry.kind, nbytes=nbytes, shape=shape, dtype=dtype,
                     origin=origin)
    _events.signal("compiled", entry, False)  # a compile guard (`_guards`) may raise here
    return entry


def compile_ahead(key, fn, args, *, donate_argnums: tuple = (), info: dict | None = None,
                  record: Callable | None = None, compiler_options: dict | None = None,
                  sources: dict | None = None, out_shardings=None,
                  ahead: str = _report.AFTER_EDIT, generation: int | None = None) -> tuple:
    """`compile_program` for a background thread (`_ahead`): the same claim, build and store, but it
    says nothing and raises nothing. A program whose dependencies drifted while it compiled is dropped,
    not served; a compile that raised leaves the key unclaimed, so the handle that needs the program
    compiles it itself and the error surfaces there, with the user's traceback, as without compiling ahead.
    `ahead` says on its compile line why it was built in the background (`_report.AFTER_EDIT`, ...).

    **Returns:** `(status, entry, detail)`: `("compiled", entry, messages)` (the messages to say later,
    from the main thread), `("had", entry, None)` when the key was live already (counted as a hit, as a
    rebuilt handle's lookup would), `("drifted", None, names)`, `("failed", None, error)`, or
    `("cancelled", None, None)` when the cache was reset since `generation` (the cache's generation when
    the job was planned), or when a cell's statements ran beside its trace (`Unsettled`): nothing
    compiled, nothing counted.
    """
    entry, claimed = _cache.claim(key, generation)
    if claimed is None:
        return ("had", entry, None) if entry is not None else ("cancelled", None, None)
    try:
        entry = _load_or_build(key, fn, args, donate_argnums, info, record, compiler_options, sources,
                               out_shardings, speculative=True)
    except Unsettled:  # a cell ran beside its trace: not kept, the handle compiles it when it needs it
        _cache.release(claimed, None)
        return "cancelled", None, None
    except Exception as err:  # noqa: BLE001 - surfaces at the rebuild that compiles it in the foreground
        _cache.release(claimed, None)
        return "failed", None, err
    except BaseException:
        _cache.release(claimed, None)
        raise
    # Counted as the miss it is; the handle that first takes it counts no hit and says its compile lines
    # (`_cache._served`), composed here, before any handle can take it.
    entry.untaken = True
    messages = [_report.message(Kind.COMPILE, entry=entry, ahead=ahead)]
    messages += [_report.message(Kind.LARGE_CONSTANT, program=entry.kind, nbytes=nbytes, shape=shape,
                                 dtype=dtype, origin=origin) for nbytes, shape, dtype, origin in entry.constants]
    entry.held = tuple(messages)
    # On disk before any handle can take it, as a foreground compile is: a handle that took it, then a
    # restart, finds it stored. (One whose code moved while it compiled is stored too, and not served: its
    # closure names the old code, so a load refuses it unless an undo makes it current again.)
    if generation is None or generation == _cache.generation():  # a reset since (`--disk`) writes nothing
        _save(entry)
    drifted = _cache.store_if_current(entry, claimed)
    if drifted:
        return "drifted", None, drifted
    return "compiled", entry, messages


def _load_or_build(key, fn, args, donate_argnums, info, record, compiler_options, sources, out_shardings=None,
                   speculative=False):
    """A program stored by an earlier process, valid here and against the live code, is loaded
    instead of traced (`_store.py`); it still counts as a miss that creates an entry. Else `_build`."""
    why = explain_miss(key, info or {}, _cache.explanation_candidates())
    entry = _store.load(key, info, why) if record is not None else None
    if entry is None:
        entry = _build(key, fn, args, donate_argnums, info, record, compiler_options, sources, why,
                       out_shardings, speculative)
    else:
        rebuild = lambda live: _build(key, fn, live, donate_argnums, info, record, compiler_options,  # noqa: E731
                                      sources, why, out_shardings)
        entry.call = FirstRun(entry, donate_argnums, rebuild)
    return entry


class FirstRun:
    """The first call of a program loaded from the store, checked: a stored executable can load and yet
    fail when it runs (XLA:CPU could not run an executable re-serialized after JAX's persistent cache
    had served it: `JaxRuntimeError: NOT_FOUND: Function ... not found`). If that first run raises an
    XLA runtime error, the file is deleted (said once), the program is compiled from its source as on a
    miss, and the call is retried: a bad file costs a compile, never the user's training step.

    The donated arguments are copied for that first run, so a run that fails after XLA took their
    buffers leaves the caller's intact for the retry; its outputs are waited for, so an error is seen
    here. After a good first run the entry calls the executable directly."""

    def __init__(self, entry, donate_argnums: tuple, rebuild):
        self.entry, self.donate, self.rebuild = entry, tuple(donate_argnums), rebuild
        self.compiled = entry.call

    @property
    def out_info(self):  # what the executable says of its outputs (`_compat.compiled_out_avals`)
        return self.compiled.out_info

    def __call__(self, *args):
        entry = self.entry
        safe = tuple(jax.device_put(a, may_alias=False) if i in self.donate else a for i, a in enumerate(args))
        try:
            out = jax.block_until_ready(self.compiled(*safe))
        except XLA_RUNTIME_ERRORS as err:
            first = (str(err).strip().splitlines() or [""])[0]
            _store.forget(entry.key, f"loaded, but its first run failed: {type(err).__name__}: {first[:200]}")
            fresh = self.rebuild(args)
            for name in ("call", "trace_s", "compile_s", "closure", "compiler_options", "operations",
                         "constants", "origin", "unstorable", "reads"):
                setattr(entry, name, getattr(fresh, name))
            _save(entry)
            _report.emit(Kind.COMPILE, entry=entry)
            return entry.call(*args)
        if entry.call is self:
            entry.call = self.compiled
        return out


def _save(entry) -> None:
    if entry.origin != "disk" and not entry.unstorable:
        _store.save(entry)


_gc_lock = threading.Lock()
_gc_pauses = [0, False]  # [traces and lowerings running, whether automatic collection was on before]


@contextlib.contextmanager
def gc_paused():
    """No automatic cyclic garbage collection while any thread traces or lowers a program."""
    with _gc_lock:
        if _gc_pauses[0] == 0:
            _gc_pauses[1] = gc.isenabled()
            gc.disable()
        _gc_pauses[0] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses[0] -= 1
            if _gc_pauses[0] == 0 and _gc_pauses[1]:
                gc.enable()


_building = [0]  # builds running, in any thread: a `_reuse` warming waits for none


def _no_build() -> bool:
    return _building[0] == 0


_reuse.IDLE.append(_no_build)
_reuse.WHILE_TRACING.append(gc_paused)


def _fresh(fn):
    """`fn` under a new identity: JAX caches a function's traces by identity."""

    def again(*args, **kwargs):
        return fn(*args, **kwargs)

    return again


class Unsettled(Exception):
    """A background trace overlapped a cell's own statements (`_world.trace_ended`): what it recorded may not
    be what it traced, so nothing of it is kept."""


def _trace(jitted, fn, args, record) -> tuple:
    """`(traced, closure, reads, settled)`: `jitted` traced at `args`, under `record` when given (its
    closure, and the experiment fields the trace read; None when unknown), and whether no cell's
    statement can have run meanwhile (`Recorder.settled`: only a background thread's trace can fail it)."""
    with gc_paused():
        try:
            if record is None:
                return jitted.trace(*args), None, None, True
            # Only the trace runs user Python; lowering stays outside the recorder (and off a profiler hook).
            with record() as recorder:
                traced = jitted.trace(*args)
                recorder.traced(traced.jaxpr, fn)
        except Exception as err:
            hint = library_hint(err)
            if hint is not None and hint not in getattr(err, "__notes__", ()):
                err.add_note(hint)
            raise
    closure, reads = recorder.closure, recorder.fields
    if closure is not None and closure.untracked:
        # It read a value with no fingerprint: what that value holds may come from a GraphConst field
        # it never read (docs/recompilation.md), so every field keys it.
        reads = None
    return traced, closure, reads, recorder.settled


def _build(key, fn, args, donate_argnums, info, record, compiler_options, sources, why=None, out_shardings=None,
           speculative=False):
    """Trace (recording), lower and XLA-compile: the `Entry`, not yet stored."""
    with _gc_lock:
        _building[0] += 1
    try:
        return _trace_and_compile(key, fn, args, donate_argnums, info, record, compiler_options, sources, why,
                                  out_shardings, speculative)
    finally:
        with _gc_lock:
            _building[0] -= 1


# A trace during which an edit's scan evicted the user's cached inner traces may have cached one of the
# old code again (it read the old helper before the edit): it is traced again, at most this many times.
RETRACES = 3
# How long a background run's trace that a cell crossed waits for the cell's own statements to end before
# it traces again (`_world.wait_settled`); a cell busy longer than this is crossed again, and counted.
SETTLE_WAIT_S = 10.0


def _trace_and_compile(key, fn, args, donate_argnums, info, record, compiler_options, sources, why, out_shardings,
                       speculative=False):
    if speculative and _context.current() != key.context:
        # Planned under another JAX configuration than this thread's (a thread-local setting is not seen
        # by a background thread): its trace would not be the key's program. The handle compiles it.
        raise Unsettled()
    debug = key.context.debug
    if debug:  # as `jax.jit` under `debug_nans`: no donation, so a de-optimized re-run has its inputs
        donate_argnums = ()
    placed = {} if out_shardings is None else {"out_shardings": out_shardings}
    jitted = jax_jit(fn, donate_argnums=donate_argnums, **placed)
    t0 = time.perf_counter()
    for _ in range(RETRACES):
        evictions = _cache.evictions()
        traced, closure, reads, settled = _trace(jitted, fn, args, record)
        if not settled:
            # A cell's statements may have run while it traced (in a background thread: compile ahead, a
            # background run): its closure may name values it did not bake in. Nothing of it is kept (its
            # inner traces neither). While the cell waits inside nitro (a rebuilt handle's `train()`
            # waiting for this very program) it is traced again. While the cell runs statements of its
            # own, a compile ahead gives up (the program compiles when it is needed); a background run,
            # which needs it now, traces again once the cell is done with them (`_world.wait_settled`).
            _cache.evict_user_traces()
            if _world.cell_busy():
                if speculative:
                    raise Unsettled()
                _world.wait_settled(SETTLE_WAIT_S)
            jitted = jax_jit(_fresh(fn), donate_argnums=donate_argnums, **placed)
            continue
        if _cache.evictions() == evictions:
            break
        # An edit's scan evicted JAX's cached traces of the user's inner functions meanwhile, and this
        # trace may have cached one of the old code again: evicted again, whatever becomes of this one.
        _cache.evict_user_traces()
        if closure is not None and closure.drift({}):
            break  # it ran the old code and says so: dropped (compile ahead) or poisoned by the next scan
        jitted = jax_jit(_fresh(fn), donate_argnums=donate_argnums, **placed)  # traced again, past JAX's
        # cache of `fn`'s traces: its closure says it is current, yet it may have used an old inner trace
    else:
        if speculative and not settled:
            raise Unsettled()
        if not settled and closure is not None:
            # A background run's program crossed a cell at every trace: it runs it, told so (stale at
            # birth, `_cache.store`), and no other handle is ever served it.
            closure.superseded = tuple(closure.names())
    if speculative and _context.current() != key.context:  # the global configuration moved meanwhile
        raise Unsettled()
    with gc_paused():
        lowered = traced.lower()
    # A program the store cannot hold still skips XLA after a restart, through JAX's own cache.
    on = record is not None and _store.cache_dir() is not None and key.context.storable
    unstorable = _store.unstorable_reason(traced.jaxpr, closure) if on else None
    if unstorable is not None:
        _store.fallback(key, unstorable)
    t1 = time.perf_counter()
    _events.signal("xla_start")  # `_ahead`: its next job may trace now, while XLA holds no GIL
    # A program the store holds stays out of JAX's cache; one JAX's cache serves cannot be stored.
    with own_compile(write_jax_cache=(not on or unstorable is not None) and not debug) as served:
        compiled, used = xla_compile(lowered, program_options(traced.jaxpr, compiler_options))
    warm = getattr(fn, "warm", None)
    if warm is not None:  # a gradient program traced plainly: warm its forward when idle (`_reuse`)
        del fn.warm
        warm(args)
    t2 = time.perf_counter()
    if served["from_jax_cache"] and unstorable is None:
        unstorable = "JAX's persistent cache served it, and a loaded executable does not serialize again"
    if debug:
        compiled = Deoptimizing(compiled, fn)
    if holds_user_instances(args):
        compiled = Retreed(compiled)  # callable with a re-run model cell's instances (`_carry`)
    return _cache.Entry(
        key, compiled, t1 - t0, t2 - t1, closure, info or {}, why, compiler_options=used,
        operations=sum(1 for _ in jaxpr_eqns([traced.jaxpr])),
        constants=large_constants(traced.jaxpr, closure, sources), unstorable=unstorable, reads=reads,
    )


# A constant at least this large baked into a program is said at compile time: it is part of the program
# (copied into it at every compile, kept alive with it), and usually a dataset captured by accident.
LARGE_CONSTANT_BYTES = 1 << 20


def large_constants(jaxpr, closure=None, sources: dict | None = None) -> tuple:
    """`(nbytes, shape, dtype, origin)` of each constant of at least `LARGE_CONSTANT_BYTES` that the
    traced program closes over, largest first. `origin` says where it came from when it can be found:
    a global the trace read (`` `__main__.TABLE` ``, one level into a dict, list or tuple global), or the
    label of one of `sources` (`{label: value}`, such as the GraphConst fields); None otherwise."""
    big = [c for c in getattr(jaxpr, "consts", ()) if getattr(c, "nbytes", 0) >= LARGE_CONSTANT_BYTES]
    if not big:
        return ()
    candidates = list((sources or {}).items()) + _global_arrays(closure)
    out = []
    for const in sorted(big, key=lambda c: -c.nbytes):
        origin = next((name for name, value in candidates if value is const), None)  # a device array
        if origin is None:  # a NumPy array is copied into the trace: recognise it by content
            origin = next((name for name, value in candidates if _same_array(const, value)), None)
        out.append((int(const.nbytes), tuple(const.shape), str(const.dtype), origin))
    return tuple(out)


def _global_arrays(closure) -> list:
    """`(qualified name, array)` for the arrays among the globals `closure` recorded, one level deep."""
    out = []
    for dep in getattr(closure, "values", ()):
        name = getattr(dep, "name", None)
        module = sys.modules.get(getattr(dep, "module", ""))
        if name is None or module is None:
            continue
        value = vars(module).get(name)
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
        out.append((f"`{dep.qualified}`", value))
        out.extend((f"`{dep.qualified}[{k!r}]`", v) for k, v in items)
    return [(n, v) for n, v in out if hasattr(v, "shape") and hasattr(v, "dtype")]


def _same_array(const, value) -> bool:
    if getattr(value, "size", -1) != const.size or str(getattr(value, "dtype", "")) != str(const.dtype):
        return False
    value = np.asarray(value)
    if value.shape == const.shape and np.array_equal(value, const):
        return True
    return value.ndim == 2 and value.T.shape == const.shape and np.array_equal(value.T, const)


def program_options(jaxpr, options: dict | None = None) -> dict:
    """The compiler options for a program traced to `jaxpr`: `options`, plus the classic emitters for a
    program with a convolution (see `CONVOLUTION_OPTIONS`), else optimization level 2 (see `LEVEL`) and
    XLA's own kernels for matrix multiplies where every one is narrow (see `NARROW_DOT`). Options given
    explicitly win."""
    out = dict(options or {})
    if jax.default_backend() != "cpu":
        return out
    convolutions, narrow = _multiplies(jaxpr)
    if convolutions:
        return {**CONVOLUTION_OPTIONS, **out}
    return {**LEVEL, **(WITHOUT_YNN if narrow else {}), **out}


def _multiplies(jaxpr) -> tuple[bool, bool]:
    """`(convolves, all dots narrow)` for `jaxpr` (sub-jaxprs included): whether it has a convolution, and
    whether it multiplies matrices with every multiply having at most one of its rows, columns and
    contracted size above `NARROW_DOT`."""
    dots, narrow, convolves = 0, True, False
    for eqn in jaxpr_eqns([jaxpr]):
        name = eqn.primitive.name
        if name == "conv_general_dilated":
            convolves = True
        elif name == "dot_general" and narrow:
            dots += 1
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            rows = math.prod(d for i, d in enumerate(lhs) if i not in lc and i not in lb)
            cols = math.prod(d for i, d in enumerate(rhs) if i not in rc and i not in rb)
            inner = math.prod(lhs[i] for i in lc)
            narrow = sorted((rows, cols, inner))[1] <= NARROW_DOT
    return convolves, narrow and dots > 0


def xla_compile(lowered, options: dict):
    """XLA-compile with `options`, leaving out each one this XLA does not know (options come and go
    between releases: jax 0.12 has no `xla_cpu_use_fusion_emitters`, but keeps the optimization level).

    **Returns:** the executable and the options it was compiled with."""
    while options:
        try:
            return lowered.compile(compiler_options=options), options
        except Exception as err:
            unknown = unknown_compile_option(err)
            if unknown is None or unknown not in options:
                break  # not an unknown option: compile as usual
            del options[unknown]
    return lowered.compile(), {}


class Deoptimizing:
    """A program compiled under `debug_nans`/`debug_infs` (its key's configuration says so), with its
    Python function: a NaN or infinite output is re-run de-optimized, op by op, and raises JAX's own
    `FloatingPointError` naming the primitive, as `jax.jit` does. (An executable alone raises JAX's
    internal error, which names only the program.) Only such programs hold their function: it holds what
    the trace closed over, a handle's binding among it."""

    __slots__ = ("compiled", "fn")

    def __init__(self, compiled, fn):
        self.compiled, self.fn = compiled, fn

    def __call__(self, *args):
        try:
            return self.compiled(*args)
        except INTERNAL_FLOATING_POINT_ERROR as err:
            raise_deoptimized(err, self.fn, args, {})

    def __getattr__(self, name):
        return getattr(self.compiled, name)  # `in_avals`, `out_info`, ... of the compiled program


class Retreed:
    """A compiled program whose arguments hold instances of user classes, callable with instances of a
    redefined class of equal structure.

    The key holds a class by name and field structure, not by identity: re-running an Equinox model's
    cell, or editing a method the program never runs, changes no program. JAX checks the class object,
    though; so arguments whose tree differs only by that are re-treed into the compiled structure, and
    the results re-bound to the live classes (`live_value`), so the handle's state stays live.
    """

    __slots__ = ("compiled",)

    def __init__(self, compiled):
        self.compiled = compiled

    def __call__(self, *args):
        try:
            return self.compiled(*args)
        except TypeError as err:
            if "pytree" not in str(err):
                raise
        leaves = jax.tree_util.tree_leaves((args, {}))
        in_tree = self.compiled.in_tree
        if in_tree.num_leaves != len(leaves):
            raise NitroValueError(
                f"the arguments no longer fit this compiled program ({len(leaves)} arrays, the program takes "
                f"{in_tree.num_leaves}); rebuild the handle: `n = n.rebuild()`."
            )
        args, kwargs = jax.tree_util.tree_unflatten(in_tree, leaves)
        return live_value(self.compiled(*args, **kwargs))

    def __getattr__(self, name):
        return getattr(self.compiled, name)  # `in_avals`, `out_avals`, ... of the compiled program
