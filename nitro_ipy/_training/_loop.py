"""The epoch loop: steps, the Ctrl-C gate, the progress bar and the loss checks.

`train_epoch` advances a handle in place. It reads and writes the handle's `_params`, `_model_state`,
`_opt_state` and `step` (a step's results are stored there before Ctrl-C may land) and resolves the two
training programs through the handle's `_grad_entry` / `_opt_entry`, which key and maybe compile them.

The steady-state loop is benchmarked at the microsecond level (a tiny MLP against a hand-written loop):
calls it makes every step are bound to locals, and counters and messages wait for a sync point. A step
keeps nothing on the host: its loss is summed on device into the guard the optimizer program carries
(`_guard`), which a sync point reads in one transfer.
"""

import collections
import contextlib
import signal
import sys
import threading
import time
import weakref

import jax

from .._base import _events
from .._base._compat import compiled_in_avals, compiled_out_avals
from .._base._errors import NonFiniteLossError
from .._compiler import _cache
from .._experiment._carry import copy_arrays
from . import _guard
from ._pipeline import run_ahead, train_batches

_SYNC_SECONDS = 0.25  # how often losses are checked, reuse counted and the live panel told


class InterruptGate:
    """Holds Ctrl-C while `defer` is True, until the step in flight has stored its results, so an
    interrupt never leaves the handle with donated-away buffers. Outside the gate it raises at once.

    A Ctrl-C sets `pending`, held or not; the loop raises `KeyboardInterrupt` at its next check (a
    background run's `stop()` sets it too: `_runs.RunControl`). `quiet` turns the progress bar off (a
    worker thread never draws one).
    """

    __slots__ = ("defer", "pending", "quiet")

    def __init__(self):
        self.defer = False
        self.pending = False
        self.quiet = False

    def _on_sigint(self, signum, frame):
        # Pending either way: a `KeyboardInterrupt` raised while Python runs a gc callback (JAX's
        # `_xla_gc_callback`), a `__del__` or a weakref callback is reported as "Exception ignored" and
        # lost, and the loop's next check raises it again. Raised here, it ends the call, and the gate
        # with it.
        self.pending = True
        if not self.defer:
            raise KeyboardInterrupt

    def cuts_epoch(self) -> bool:
        """Whether a request pending after the epoch's last step ends the call before validation (a held
        Ctrl-C does; a run's stop lets the finished epoch count)."""
        return True

    @contextlib.contextmanager
    def installed(self):
        """The gate as the SIGINT handler for the block (signals only reach the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


def train_epoch(n, split: dict, fields, steps: int, gate: InterruptGate | None = None) -> tuple:
    """One epoch of training on handle `n`.

    **Arguments:**
    - `n`: the handle; its parameters, optimizer state and step advance in place.
    - `split`: the train split; `fields`: the batch fields the programs take.
    - `steps`: optimizer steps in the epoch (the progress display's total).
    - `gate`: the train call's control (Ctrl-C, a stop request); default: a fresh `InterruptGate`.

    **Returns:** `(mean training loss, skipped steps)`; the mean is NaN when every step was skipped.
    With `on_nonfinite="raise"` a step with a NaN or infinite loss, gradient or Device value raises
    `NonFiniteLossError` at the next sync point; the optimizer program has kept the parameters of the
    last finite step (`_guard`).
    """
    place = n._place  # on a mesh, each batch is split along the data axis as it is drawn
    # An epoch an interrupt cut short goes on at its next batch, with the losses it had: an interrupted
    # (or checkpointed mid-epoch and resumed) run takes the uninterrupted run's steps, in its order.
    start, total, n_loss = n._cursor if steps is None or n._cursor[0] <= steps else (0, 0.0, 0)
    n._cursor = (start, total, n_loss)  # read by `nonfinite_error` while the epoch runs
    if start == steps:  # every step was taken, the epoch not counted yet (Ctrl-C after its last step)
        return mean_loss(total, n_loss), 0  # the caller counts it and resets the cursor
    batches = place.batches(train_batches(split, fields, n.batch_size, n.accum, (n.seed, n.epoch), start),
                            n.accum > 1)
    step0 = n.step
    # The guard is a tiny int32 vector: replicated on a mesh, like every scalar the programs take.
    n._guard = place.replicate(_guard.fresh(guard_parts(n)))
    settled = False
    bar = None  # told after the first step, so compile lines print above it, not through it
    binding = n._binding
    schedules, apply_schedules = binding.schedules, place.schedules(binding.apply_schedules)
    dev = n._dev  # schedules set its values in place, so the programs see them through this one dict
    gate = InterruptGate() if gate is None else gate
    seen, guard = (0.0, 0), None  # the finite losses' (sum, count) at the last sync, and that guard
    reused, grad, opt = 0, None, None  # steady-state steps that reused the resolved programs
    try:
        with gate.installed():
            # First step: resolve both programs (maybe compiling); they stay fixed for the epoch when
            # the optimizer hands back parameters and state of the avals it was compiled for.
            batch = next(batches, None)
            if batch is None:  # a loader's pass ended where the cut epoch stood: every step was taken
                settled = True
                return mean_loss(total, n_loss), 0
            if schedules:  # checked: type, dtype, shape, finite; then replicated on a mesh
                place.schedules(binding.first_schedules)(dev, n.step)
            grad, opt, _ = keyed_step(n, batch, gate)
            stable = returns_its_inputs(opt)
            n.step += 1
            gate.defer = False
            bar = n._progress  # this train() call's `_progress.Progress`, or None
            if bar is not None:  # it draws on process 0 only (`_progress.start`)
                bar.begin_epoch()
            grad_call, opt_call, seed_step = grad.call, opt.call, n._seed_step
            perf_counter = time.perf_counter
            # How many steps this loop may run ahead of the device: a CPU mesh's own bound (`_sharding.pace`),
            # else the pipeline's: each queued step holds its batch, so an unbounded lead grows memory by a
            # batch a step whenever the host outruns the device (`_pipeline.run_ahead`).
            ahead = place.ahead or run_ahead(batch)
            recent = collections.deque(maxlen=ahead + 1)  # the last steps' losses, kept only to pace by
            next_sync = perf_counter() + _SYNC_SECONDS
            for batch in batches:
                if gate.pending:
                    raise KeyboardInterrupt
                gate.defer = True  # from here to the stored results, Ctrl-C waits for the step
                if schedules:
                    apply_schedules(dev, n.step)
                if stable:
                    flat_grads, loss, n._model_state = grad_call(n._params, n._model_state, dev, batch,
                                                                 seed_step(n.step))
                    if n._shared:  # read by the user (a schedule, say) since the last step
                        unshare(n)
                    n._params, n._opt_state, n._guard = opt_call(n._params, flat_grads, n._opt_state, dev, loss,
                                                                 n._guard)
                    reused += 1
                else:  # slow path: re-key every step (and report the loop)
                    gate.defer = False  # nothing is donated yet, and a compile may follow
                    grad, opt, loss = keyed_step(n, batch, gate)
                n.step += 1
                gate.defer = False
                if ahead:  # a CPU mesh: wait for the step `ahead` back (`_sharding.pace`)
                    recent.append(loss)
                    if len(recent) > ahead:
                        recent[0].block_until_ready()
                if perf_counter() > next_sync:
                    seen, guard = check_losses(n, seen, bar, step0, split, fields)
                    count_reuse(grad, opt, reused)
                    reused = 0
                    _events.publish("progress")  # the live panel, never per step
                    next_sync = perf_counter() + _SYNC_SECONDS
                gate.defer = False
            if gate.pending and gate.cuts_epoch():
                raise KeyboardInterrupt
            seen, guard = check_losses(n, seen, bar, step0, split, fields)
            settled = True
    finally:
        count_reuse(grad, opt, reused)
        if not settled:  # Ctrl-C or an error: a bad step before it still counts as not applied
            total, n_loss = settle(n, step0, total, n_loss)
            n._cursor = (start + n.step - step0, total, n_loss)
    # Every step taken: the cursor stays at the epoch's end until the caller counts the epoch, so a
    # Ctrl-C landing in between leaves an epoch the next call counts, never one it replays.
    n._cursor = (start + n.step - step0, total + seen[0], n_loss + seen[1])
    return mean_loss(total + seen[0], n_loss + seen[1]), _guard.bad_steps(guard)


def mean_loss(total: float, count: int) -> float:
    """The epoch's mean finite loss; NaN when it had none (every step skipped), never a perfect 0.0."""
    return total / count if count else float("nan")


def guard_parts(n) -> int:
    """How many values the handle's steps check (`_guard.n_parts`), worked out once per handle: it traces
    the layout's ravel (milliseconds, a tenth of a 256-step epoch of a tiny MLP when paid per epoch), and
    neither the layout nor the Device fields' dtypes move after setup."""
    if n._guard_parts is None:
        n._guard_parts = _guard.n_parts(n._layout, n._model.split.trainable(n._params), n._dev)
    return n._guard_parts


def keyed_step(n, batch, gate: InterruptGate):
    """One step that keys (and maybe compiles) both programs: the first step of an epoch, or every
    step when the optimizer's outputs would move its key. Ctrl-C is held only once the optimizer
    program, which donates params and state, is about to run."""
    grad = n._grad_entry(batch)
    flat_grads, loss, n._model_state = grad.call(n._params, n._model_state, n._dev, batch, n._seed_step(n.step))
    opt = n._opt_entry(flat_grads, loss, n._guard)
    if n._shared:
        unshare(n)
    gate.defer = True
    n._params, n._opt_state, n._guard = opt.call(n._params, flat_grads, n._opt_state, n._dev, loss, n._guard)
    return grad, opt, loss


def unshare(n):
    """Fresh buffers for the params and optimizer state the next step donates, when something besides
    the handle still holds the current ones (`best = n.params`, IPython's `Out`, a carried-from handle):
    a donated array would be deleted under it. Asked once after each read (`n._shared`), not per step.
    A read whose result was dropped (`jax.block_until_ready(n.params)`) costs nothing: a copy of the
    120-layer MLP's 242 arrays and their optimizer state takes about 10 ms."""
    if _held_elsewhere((n._params, n._opt_state)):
        n._params, n._opt_state = copy_arrays((n._params, n._opt_state))
        stats["copies"] += 1
    n._shared = False


def _refcounts(tree) -> list:
    return [sys.getrefcount(x) for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]


def _held_elsewhere(tree) -> bool:
    """Whether any array of `tree` is referenced from outside it (CPython's reference count, against
    that of an array held by one container only, measured the same way once)."""
    global _ONE_HOLDER
    if _ONE_HOLDER is None:  # here, not at import: an array made at import would start JAX's backend
        _ONE_HOLDER = max(_refcounts({"probe": jax.numpy.zeros(())}))
    return any(count > _ONE_HOLDER for count in _refcounts(tree))


_ONE_HOLDER = None
stats = {"copies": 0}  # how often `unshare` copied (tests)


def check_losses(n, seen: tuple, bar, step0: int, split: dict, fields) -> tuple:
    """A sync point: one transfer of the guard, which holds the epoch's finite losses (their sum and
    count, `_guard.loss_sum`) and its bad steps; with `on_nonfinite="raise"`, raise the
    `NonFiniteLossError` of a guard that saw a bad step.

    **Arguments:**
    - `n`: the handle (its guard, step and epoch name the failing step in the message).
    - `seen`: the finite losses' `(sum, count)` at the last sync point (`(0.0, 0)` at the epoch's start).
    - `bar`: the call's `_progress.Progress`, told the mean loss since the last sync point, or None.
    - `step0`, `split`, `fields`: the step the epoch started at and its batches, to name the cause.

    **Returns:** `((sum, count), host guard)`: the epoch's finite losses so far, and the guard read.
    """
    guard = jax.device_get(n._guard)
    if n.on_nonfinite == "raise" and _guard.bad_steps(guard):
        raise nonfinite_error(n, guard, step0, split, fields)
    total, count = _guard.loss_sum(guard)  # "skip": a skipped step's non-finite loss is not the epoch's
    if bar is not None and count > seen[1]:
        bar.sync((total - seen[0]) / (count - seen[1]))
    return (total, count), guard


def nonfinite_error(n, guard, step0: int, split: dict, fields) -> NonFiniteLossError:
    """The handle back at the last finite step (`n.step`), and the error naming the bad one."""
    n.step = step0 + _guard.first_bad(guard)
    binding = n._binding

    def batch_at(index):  # `index` counts from the step the epoch (or what is left of it) began at
        start = n._cursor[0]
        for i, batch in enumerate(train_batches(split, fields, n.batch_size, n.accum, (n.seed, n.epoch), start)):
            if i == index:
                return batch

    place = n._place

    def dev_at(step):
        dev = dict(n._dev)
        if binding.schedules:
            place.schedules(binding.apply_schedules)(dev, step)
        return dev

    def regrad(batch, dev):
        batch = place.batch(batch, n.accum > 1)  # placed as the loop placed it: the same program
        flat_grads, loss, _ = n._grad_entry(batch).call(n._params, n._model_state, dev, batch, n._seed_step(n.step))
        return flat_grads, loss

    return _guard.diagnose(n, guard, step0, batch_at, dev_at, regrad)


def settle(n, step0: int, total: float, count: int) -> tuple:
    """After Ctrl-C or an error: with `on_nonfinite="raise"`, a bad step the loop had not seen yet
    still ends the handle at the last finite step (the programs applied nothing after it).

    **Returns:** `(total, count)` with the finite losses of the steps kept folded in (what the rest of
    the epoch starts from): the guard's sum, which holds only the losses of the steps it applied."""
    guard = getattr(n, "_guard", None)
    if guard is None:
        return total, count
    try:
        guard = jax.device_get(guard)
    except Exception:  # a guard donated to a step that never finished: nothing was applied either
        return total, count
    if n.on_nonfinite == "raise" and _guard.bad_steps(guard):
        n.step = step0 + _guard.first_bad(guard)
    more, counted = _guard.loss_sum(guard)
    return total + more, count + counted


def count_reuse(grad, opt, steps: int):
    """Steady-state steps reuse the two entries resolved at the first step; each use is a cache hit,
    counted in a local and folded into the counters at sync points rather than paid per step."""
    if steps:
        _cache.count_hit(grad, steps)
        _cache.count_hit(opt, steps)


def returns_its_inputs(opt_entry) -> bool:
    """True when the optimizer program returns params and state of exactly the avals it takes, so the
    next step can skip re-keying. False means the key would move: the slow path re-keys every step.
    A property of the compiled program, asked at every epoch's first step: worked out once per entry
    (4 ms at 242 arrays)."""
    call, known = _RETURNS_ITS_INPUTS.get(opt_entry, (None, None))
    if call is not opt_entry.call:  # (a first run's wrapper hands over to the executable: asked again)
        known = _returns_its_inputs(opt_entry)
        _RETURNS_ITS_INPUTS[opt_entry] = (opt_entry.call, known)
    return known


_RETURNS_ITS_INPUTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _returns_its_inputs(opt_entry) -> bool:
    in_avals, out_avals = compiled_in_avals(opt_entry.call), compiled_out_avals(opt_entry.call)
    if in_avals is None or out_avals is None:
        return True
    in_avals = jax.tree.leaves(in_avals[0]) + jax.tree.leaves(in_avals[2]) + jax.tree.leaves(in_avals[5])
    out_avals = jax.tree.leaves(out_avals)
    norm = lambda a: (tuple(a.shape), str(a.dtype), bool(getattr(a, "weak_type", False)))
    return [norm(a) for a in in_avals] == [norm(a) for a in out_avals]
