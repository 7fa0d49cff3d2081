"""Trace reuse: after an edit to the loss, a new gradient program traces the loss, not the model again.

Most of a deep model's gradient trace is its forward and that forward's derivative: 0.2 s of the 120-layer
MLP's 0.9 s compile. An edit to the loss leaves the forward's code alone, and yet the new program would
trace all of it again. So a gradient program calls its forward through an inner `jax.jit` (`Forward`).
JAX caches that call's trace, and the derivative's (JVP, partial evaluation, transpose), per function. A
program that calls the same `Forward` with the same argument types traces only the rest: 35 ms instead
of 200 ms. XLA inlines the call, so the compiled program computes the same maths.

The inner call makes its *first* trace about twice as long as a plain one: JAX derives a traced jaxpr
instead of tracing the Python once. So no program pays that on its critical path:
- A gradient program with no usable `Forward` traces its forward plainly, and queues a *warming*: when
  the process is idle (no training for `QUIET_S`, no compile anywhere, no cell's own statements running),
  a background thread traces the same program again through a new `Forward` (`schedule`). That is the
  user's reading time after a compile; an edit of the forward itself then costs nothing beside its own
  compile. A cell that starts while a warming traces drops it (what the trace read may be the cell's
  doing); the warming is made again, from scratch, once idle (`RETRIES` times at most).
- The next gradient program whose forward is keyed alike takes it (`forward_key`: owner, forward hook
  fingerprint, GraphConst values, Host names, static leaves, batch inputs, reserved parameters). It needs
  two more things: the forward's own recorded closure has not moved (an edited helper below the forward
  discards it), and the call's argument types are the ones traced (`Forward.fits`). A program built
  while its warming is still due or running traces plainly: whether it reuses changes only how long its
  trace takes, since XLA compiles the same maths either way (`tests/test_reuse.py` compares the bits).
- A trace that JAX serves from its cache runs none of the forward's Python. So what the forward's first
  trace recorded is replayed into the program's recording (`_closure.replay`), and the new program
  depends on the forward's code as if it had traced it.

Off with `set_trace_reuse(False)` or `NITRO_IPY_TRACE_REUSE=0`: every gradient program traces its
forward plainly, as before.

The warming trace runs the user's `forward` and `loss` once more. Whatever they print at trace time is
dropped there (`_quiet`), so a `print` in a hook still prints once per compile.
"""

import atexit
import collections
import contextlib
import os
import sys
import threading
import time

import jax

from .. import _closure
from .._base import _memo, _world
from .._base._compat import jax_jit
from . import _cache

ENV = "NITRO_IPY_TRACE_REUSE"
_enabled = os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")
_forwards = _memo.Memo("reuse.forwards", 32)  # forward_key -> a warmed, checked `Forward`
# What trace reuse did in this process: `warmed` Forwards made in idle time, `reused` programs that traced
# through one, `discarded` ones found stale, `retraced` calls JAX had no trace for any more, `redone`
# warmings a cell crossed, queued again.
stats = {"warmed": 0, "reused": 0, "discarded": 0, "retraced": 0, "redone": 0}


def set_trace_reuse(enabled: bool) -> bool:
    """Turn trace reuse on or off for this process (on unless `NITRO_IPY_TRACE_REUSE=0`); off, every
    gradient program traces its forward plainly and nothing is warmed. Returns the previous setting."""
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"`set_trace_reuse` takes True or False; got {enabled!r}.")
    previous, _enabled = _enabled, enabled
    if not enabled:
        _forwards.clear()
    return previous


def forward_key(b, model, input_names) -> tuple | None:
    """What a gradient program's forward trace depends on besides its code and the argument types:
    None when the forward cannot be keyed (no fingerprint), or trace reuse is off."""
    fp = b.hook_fps.get("forward")
    if fp is None or not _enabled:
        return None
    return (b.owner, fp, b.graphconst.hash, tuple(b.hosts), model.split.signature, tuple(input_names),
            tuple(sorted(model.reserved.get("forward", ()))), model.has_state)


def lookup(key) -> "Forward | None":
    """The warmed `Forward` of `key` if its closure has not moved; a stale one is discarded. None while
    its warming is still due or running: the program traces plainly then (the same maths)."""
    found = None if key is None else _forwards.get(key)
    if found is None:
        return None
    if found.fresh():
        return found
    _forwards.pop(key, None)
    stats["discarded"] += 1
    return None


def _signature(args) -> tuple:
    leaves, treedef = jax.tree.flatten(args)
    avals = []
    for leaf in leaves:
        aval = jax.typeof(leaf)
        avals.append((tuple(aval.shape), aval.dtype, bool(getattr(aval, "weak_type", False))))
    return treedef, tuple(avals)


class Forward:
    """A model's forward behind an inner `jax.jit`, with what its first trace recorded.

    `call(dev, params, trainable, inputs, state, key) -> (outputs, state)` is the forward as the gradient
    program calls it; `root` is the forward hook (where the traceback recorder looks for its globals)."""

    __slots__ = ("call", "root", "jitted", "sig", "kept", "closure", "fields", "__weakref__")

    def __init__(self, call, root):
        self.call, self.root = call, root
        self.jitted = jax_jit(self._trace)
        self.sig = None  # (treedef, avals) of the arguments it was traced for
        self.kept = ((), (), ())  # what the recording of its trace saw (`_closure.replay`)
        self.closure = None  # that recording's closure: the freshness test
        self.fields = frozenset()  # the experiment fields its trace read (the compile view saw each read)

    def _trace(self, *args):
        """Runs only when JAX has no trace of this call for these argument types."""
        with _closure.record(keep=True) as recording:
            out = self.call(*args)
        if self.sig is not None:
            stats["retraced"] += 1
        self.sig = _signature(args)
        self.fields = recording.fields  # seen as the Python ran, whatever the mode
        if recording.mode != "traceback":  # the traceback mode reads the jaxpr, after the trace (`finish`)
            self.kept, self.closure = recording.kept, recording.closure
        return out

    def fits(self, args) -> bool:
        return self.sig is not None and _signature(args) == self.sig

    def __call__(self, *args, warming: bool = False):
        _closure.replay(self.kept)
        if not warming:
            stats["reused"] += 1
        return self.jitted(*args)

    def finish(self) -> None:
        """After the warming trace: in the traceback mode, record the forward from the jaxpr JAX kept."""
        if self.closure is not None or self.sig is None:
            return
        treedef, avals = self.sig
        abstract = treedef.unflatten([jax.ShapeDtypeStruct(s, d, weak_type=w) for s, d, w in avals])
        with _closure.record(keep=True) as recording:
            recording.traced(self.jitted.trace(*abstract).jaxpr, self.root)
        frames, attrs, _ = recording.kept  # (no Python ran in this trace: the fields read are the first's)
        self.kept, self.closure = (frames, attrs, self.fields), recording.closure

    def fresh(self) -> bool:
        closure = self.closure
        return closure is not None and not closure.superseded and not closure.drift({})


KEPT, CROSSED, DROPPED = "kept", "crossed", "dropped"


def warm(key, make, args) -> str:
    """Trace the gradient program `make()` gives (with the `Forward` it calls through) for `args`, so that
    JAX caches the forward's trace and derivative; then keep that `Forward` for the next program keyed
    `key`. Returns `KEPT`; `CROSSED` when only a cell starting or ending while it traced dropped it (the
    code it traced has not moved since: worth another try); else `DROPPED`."""
    forward, program = make()
    with _world.speculative():  # a cell starting meanwhile does not wait for it (it drops it)
        evictions, generation, mark = _cache.evictions(), _cache.generation(), _world.trace_begun()
        try:
            with _quiet():
                jax_jit(program).trace(*args)
            forward.finish()
        except Exception:  # an optimisation only: the next build traces plainly and warms again
            return DROPPED
        finally:
            settled = _world.trace_ended(mark)
    edited = _cache.evictions() != evictions
    if edited or not settled:
        # An edit's scan ran meanwhile, or a cell did (its recording may name code the trace did not
        # run): what this trace cached of the user's inner functions may be the old code's.
        _cache.evict_user_traces()
    # `cache_reset()` since (it forgets, this too), or the code moved while it traced, or an edit's scan ran
    if _cache.generation() != generation or not forward.fresh() or edited:
        return DROPPED
    if not settled:  # only a cell crossed it
        return CROSSED
    _forwards[key] = forward
    stats["warmed"] += 1
    return KEPT


# ---------------------------------------------------------------- warming when idle
# Whether the process is idle enough to warm: `_ahead` adds "no step loop for QUIET_S, no compile ahead
# busy", `_compile` "no build running" (a warming trace takes the GIL and a core for a few hundred ms).
IDLE: list = []
WHILE_TRACING: list = []  # context managers around a warming trace: `_compile.gc_paused`
NICE = 10  # the warming thread's niceness (Linux), as the compile-ahead workers'
QUIET_S = 0.25  # and no handle trained for this long (`training_ended`): the user's next cell comes first
RETRIES = 3  # warmings of one key that cells crossed, made again (a cell may start during each)
_calls: set = set()  # a token per train() call running (`training_began`)
_trained = [0.0]  # `time.monotonic()` when the last train() call ended
_cv = threading.Condition()
_due: collections.OrderedDict = collections.OrderedDict()  # key -> (make, abstract args, tries)
_running: list = []  # the key being warmed, while one is
_thread: list = []
_exiting: list = []  # non-empty once the interpreter exits: nothing more is queued


def schedule(key, make, args) -> None:
    """Queue the warming for `key` (once per key), to run when the process is idle: `make()` gives a new
    `(Forward, gradient program calling through it)` for each try. The arguments are kept as shapes only."""
    with _cv:
        if key in _due or key in _running or _exiting:
            return
        _due[key] = (make, _cache.shapes_of(args), 0)
        if not (_thread and _thread[0].is_alive()):
            _thread[:] = [threading.Thread(target=_work, name="nitro_ipy-warm", daemon=True)]
            _thread[0].start()
        _cv.notify_all()


def pending(key) -> bool:
    with _cv:
        return key in _due or key in _running


def wait(timeout: float | None = None) -> bool:
    """Wait until no warming is due or running (tests, benchmarks); False on timeout. A cell waiting here
    runs none of its statements meanwhile, so a warming may start and be kept."""
    with _world.inside_nitro(), _cv:
        return _cv.wait_for(lambda: not _due and not _running, timeout)


def _clear() -> None:
    with _cv:
        _due.clear()
        _cv.notify_all()


_memo.register(_clear)  # `cache_reset()` drops what is due (it holds the user's functions)

EXIT_WAIT_S = 30.0  # at most this long at exit for a warming trace under way


@atexit.register
def _at_exit() -> None:
    # The warming thread is a daemon; stopped inside a trace while the interpreter shuts down, it can
    # crash the process (a segfault after bench_ahead's last line). Drop what is due, let a running
    # warming end (a trace: well under a second on the benchmarks' models).
    _exiting.append(True)
    _clear()
    wait(EXIT_WAIT_S)


def training_began() -> object:
    """A handle's training starts (its epochs and validations, in any thread): no warming starts until
    `training_ended` with the token this returns, and `QUIET_S` after."""
    token = object()
    with _cv:
        _calls.add(token)
    return token


def training_ended(token) -> None:
    """The training `token` stands for ended. Idempotent: a caller ends it on its normal path and again on
    its way out after a Ctrl-C that landed in the first call (held from then on), so that the count
    never outlives the call and warmings go on."""
    with _cv:
        if token in _calls:
            _calls.discard(token)
            _trained[0] = time.monotonic()
            _cv.notify_all()


def _idle() -> bool:
    if _calls or time.monotonic() - _trained[0] < QUIET_S or _world.cell_busy():
        return False  # a trace beside a cell's own statements would be dropped (`warm`)
    return all(ok() for ok in IDLE)


def _work() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except (AttributeError, OSError):
        pass
    while True:
        with _cv:
            while not (_due and _idle()):
                _cv.wait(0.05 if _due else None)
            key, (make, args, tries) = _due.popitem(last=False)
            _running.append(key)
        outcome = DROPPED
        try:
            with contextlib.ExitStack() as stack:
                for context in WHILE_TRACING:
                    stack.enter_context(context())
                outcome = warm(key, make, args)
        except BaseException:  # noqa: BLE001 - the thread outlives anything one warming does
            pass
        finally:
            with _cv:
                _running.clear()
                if outcome == CROSSED and tries < RETRIES and not _exiting:  # (`schedule` skips a running key)
                    _due[key] = (make, args, tries + 1)  # from scratch: a new Forward, a new trace
                    stats["redone"] += 1
                _cv.notify_all()


_mute_lock = threading.Lock()
_muted: set = set()  # threads whose writes to sys.stdout / sys.stderr are dropped
_saved: list = []  # [(stdout, stderr) before the proxies went in, (the proxies)] while any thread is muted


class _Muted:
    """`sys.stdout` / `sys.stderr` while a warming trace runs: a muted thread's writes are dropped, every
    other thread's go where they went."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        if threading.current_thread() in _muted:
            return len(text)
        return self._stream.write(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _quiet:
    def __enter__(self):
        with _mute_lock:
            if not _muted:
                mine = (_Muted(sys.stdout), _Muted(sys.stderr))
                _saved[:] = [(sys.stdout, sys.stderr), mine]
                sys.stdout, sys.stderr = mine
            _muted.add(threading.current_thread())
        return self

    def __exit__(self, *exc):
        with _mute_lock:
            _muted.discard(threading.current_thread())
            if not _muted and _saved:
                (out, err), (my_out, my_err) = _saved
                # Put back only what is still ours: a stream swapped in meanwhile (a capture) stays.
                if sys.stdout is my_out:
                    sys.stdout = out
                if sys.stderr is my_err:
                    sys.stderr = err
                _saved.clear()
