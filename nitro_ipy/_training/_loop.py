"""The epoch loop: steps, the Ctrl-C gate, the progress bar and the loss checks.

`train_epoch` advances one `StepState` in place: the params, model and optimizer state, Device values,
step, epoch, cursor and guard a handle trains (the handle owns it; nothing here reads the handle). A
step's results (params, optimizer and model state, guard, step) are stored with Ctrl-C held, and so is the
cursor that says how many steps the call took (its `finally`): at any line a Ctrl-C lands on, training on
equals an uninterrupted run, bit for bit (`tests/test_sweep.py` raises SIGINT at every line of the windows
between steps, epochs and the return). It resolves the programs through the `resolve`
function the handle passes (which keys and maybe compiles them), with arguments packed by name
(`Spec.pack`).

The steady-state loop is benchmarked at the microsecond level (a tiny MLP against a hand-written loop):
calls it makes every step are bound to locals, and counters and messages wait for a sync point. A step
hands the device nothing from the host but its batch (and scheduled Device values): its rng is derived on
the device from the step counter the guard carries, and its loss is summed on device into that guard
(`_guard`), which a sync point reads in one transfer. With `steps_per_execution=K`, K steps run as one
program (`_programs.make_steps`), so the host dispatches once per K steps.
"""

import collections
import contextlib
import dataclasses
import itertools
import signal
import sys
import threading
import time
import weakref
from typing import NamedTuple

import jax
import numpy as np

from .._base import _events
from .._base._compat import compiled_in_avals, compiled_out_avals
from .._base._errors import NonFiniteLossError
from .._compiler import _cache
from .._experiment._carry import copy_arrays
from . import _guard
from ._pipeline import run_ahead, train_batches
from ._programs import GRAD, OPT, STEPS

_SYNC_SECONDS = 0.25  # how often losses are checked, reuse counted and the live panel told
_NEVER = 1 << 62  # the step to log at when no logger logs steps


class Cursor(NamedTuple):
    """Where an epoch an interrupt cut short stopped; the next `train()` goes on from there."""

    taken: int  # steps of the epoch taken
    total: float  # the sum of their finite losses
    count: int  # how many losses that sum holds


EPOCH_START = Cursor(0, 0.0, 0)


@dataclasses.dataclass(eq=False, slots=True)
class StepState:
    """Everything the step loop reads and advances, in one object the handle owns (`Nitro._state`).

    Fixed at setup: `binding`, `model` (`_model.Model`), `layout`, `place` (`_sharding` placement),
    `batch_size`, `accum`, `on_nonfinite`, `per_execution` (`steps_per_execution`), `wants_rng`. Advanced by
    training: `params` (the dynamic tree), `model_state`, `opt_state`, `dev` (the Device values every
    program gets; schedules set them in place), `step`, `epoch`, `seed`, `cursor` and `guard` (the
    device vector the optimizer program carries, `_guard`). `shared`: params or optimizer state were
    handed out since the last step (`unshare`). `progress`: the running call's `_progress.Progress`.
    """

    binding: object = None
    model: object = None
    layout: object = None
    place: object = None
    batch_size: int = 0
    accum: int = 1
    on_nonfinite: str = "raise"
    per_execution: int = 1
    wants_rng: bool = False  # a hook takes `rng`: the gradient program gets the guard, which holds its key
    params: object = None
    model_state: object = None
    opt_state: object = None
    dev: dict = dataclasses.field(default_factory=dict)
    step: int = 0
    epoch: int = 0
    seed: int = 0
    cursor: Cursor = EPOCH_START
    guard: object = None
    guard_parts: int | None = None
    shared: bool = True
    progress: object = None
    tracking: object = None  # the running call's loggers (`nitro_ipy.loggers` session), or None

    def fresh_guard(self, step: int):
        """A guard with no steps seen, made at `step` (its rng counter starts there), placed."""
        return self.place.replicate(_guard.fresh(guard_parts(self), self.seed, step))

    def grad_args(self, batch, dev=None, guard=None) -> tuple:
        """The gradient program's arguments (by name, `Spec.pack`): at another step's Device values and
        guard (its rng) when given. The step loop uses the same order through `GRAD_ARGS`."""
        guard = self.guard if guard is None else guard
        return GRAD.pack(params=self.params, state=self.model_state, device=self.dev if dev is None else dev,
                         batch=batch, rng=guard if self.wants_rng else None)

    def fields(self, batch) -> dict:
        """The batch fields the gradient builder routes."""
        routes = self.binding.routes
        return {"inputs": routes["forward"].pick(batch), "targets": routes["loss"].pick(batch)}


# The per-step programs' arguments, in their `Spec.args` order, from a `StepState` `s` and what each call
# brings: built once, so the hot loop pays no more than a tuple written out by hand. The guard is the
# gradient program's `rng` (it holds the step counter) when a hook takes `rng`.
GRAD_ARGS = GRAD.packer(("batch",), params="s.params", state="s.model_state", device="s.dev",
                        rng="s.guard if s.wants_rng else None")
OPT_ARGS = OPT.packer(("grads", "loss", "new_state"), params="s.params", opt_state="s.opt_state", device="s.dev",
                      guard="s.guard", state="s.model_state")
STEPS_ARGS = STEPS.packer(("batches", "schedule"), params="s.params", state="s.model_state",
                          opt_state="s.opt_state", device="s.dev", guard="s.guard")


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
            raise self.interrupt()

    def interrupt(self) -> KeyboardInterrupt:
        """The interrupt that ends the loop, with Ctrl-C held from here: a second one waits until the
        cursor of the steps taken is stored (`train_epoch`'s `finally`) rather than skip that store."""
        self.defer = True
        return KeyboardInterrupt()

    def cuts_epoch(self) -> bool:
        """Whether a request pending after the epoch's last step ends the call before validation (a held
        Ctrl-C does; a run's stop lets the finished epoch count)."""
        return True

    def commit(self, store, *args):
        """`store(*args)` with Ctrl-C held: the stores that move the handle from one consistent state to
        the next (an epoch's cursor and its count, a cut epoch's cursor) happen all or none. A Ctrl-C
        landing before the hold changed nothing; one during it is pending, raised at the loop's next
        check; one after it finds the stores done."""
        held, self.defer = self.defer, True
        try:
            return store(*args)
        finally:
            self.defer = held

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


def train_epoch(s: StepState, resolve, split: dict, fields, steps: int, gate: InterruptGate | None = None) -> tuple:
    """One epoch of training.

    **Arguments:**
    - `s`: the handle's `StepState`; its parameters, optimizer state, step and cursor advance in place.
    - `resolve(spec, args, **fields)`: the handle's program resolution (`Nitro._resolve`): the entry of
      `spec`'s program for `args`, keyed, counted and maybe compiled.
    - `split`: the train split; `fields`: the batch fields the programs take.
    - `steps`: optimizer steps in the epoch (the progress display's total).
    - `gate`: the train call's control (Ctrl-C, a stop request); default: a fresh `InterruptGate`.

    **Returns:** `(mean training loss, skipped steps)`; the mean is NaN when every step was skipped.
    With `on_nonfinite="raise"` a step with a NaN or infinite loss, gradient or Device value raises
    `NonFiniteLossError` at the next sync point; the optimizer program has kept the parameters of the
    last finite step (`_guard`).

    The epoch's first step runs the per-step programs (resolving them); with `steps_per_execution=K`
    the rest runs K steps a call (`_programs.STEPS`), and the steps left when K does not divide them
    run through the per-step programs again. Ctrl-C and a run's stop land between calls.
    """
    place = s.place  # on a mesh, each batch is split along the data axis as it is drawn
    # An epoch an interrupt cut short goes on at its next batch, with the losses it had: an interrupted
    # (or checkpointed mid-epoch and resumed) run takes the uninterrupted run's steps, in its order.
    fresh = steps is None or s.cursor.taken <= steps  # `steps` is None for a loader not counted yet
    start, total, n_loss = s.cursor = s.cursor if fresh else EPOCH_START
    if start == steps:  # every step was taken, the epoch not counted yet (Ctrl-C after its last step)
        return mean_loss(total, n_loss), 0  # the caller counts it and resets the cursor
    drawn = train_batches(split, fields, s.batch_size, s.accum, (s.seed, s.epoch), start)
    batches = place.batches(drawn, s.accum > 1)
    step0 = s.step
    # The guard is a tiny int32 vector (replicated on a mesh, like every scalar the programs take); it
    # also carries the step's rng keys, which the optimizer program advances for the gradient program.
    s.guard = s.fresh_guard(step0)
    settled = False
    bar = None  # told after the first step, so compile lines print above it, not through it
    binding = s.binding
    schedules, apply_schedules = binding.schedules, place.schedules(binding.apply_schedules)
    dev = s.dev  # schedules set its values in place, so the programs see them through this one dict
    gate = InterruptGate() if gate is None else gate
    seen, guard = (0.0, 0), None  # the finite losses' (sum, count) at the last sync, and that guard
    reused = {}  # entry -> steady-state calls that reused it since the last sync point
    pairs = 0  # steady-state per-step (grad, opt) calls since then: an int, not two dict updates a step
    grad = opt = None  # the per-step entries, once the first step resolved them
    halt = s.on_nonfinite == "raise"
    try:
        with gate.installed():
            # First step: resolve both programs (maybe compiling); they stay fixed for the epoch when
            # the optimizer hands back parameters and state of the avals it was compiled for.
            batch = next(batches, None)
            if batch is None:  # a loader's pass ended where the cut epoch stood: every step was taken
                settled = True
                return mean_loss(total, n_loss), 0
            if schedules:  # checked: type, dtype, shape, finite; then replicated on a mesh
                place.schedules(binding.first_schedules)(dev, s.step)
            grad, opt, loss = keyed_step(s, resolve, batch, gate)
            stable = returns_its_inputs(opt)
            s.step += 1
            gate.defer = False
            track = s.tracking  # `log_every=k`: an int compare a step; a logged step queues an async copy
            log_at = track.next_at(step0) if track is not None else _NEVER
            if s.step >= log_at:
                log_at = track.step(s, loss)
            bar = s.progress  # this train() call's `_progress.Progress`, or None
            if bar is not None:  # it draws on process 0 only (`_progress.start`)
                bar.begin_epoch()
            perf_counter = time.perf_counter
            next_sync = perf_counter() + _SYNC_SECONDS
            per = s.per_execution
            left = None if steps is None else steps - start - 1  # a loader's pass: step by step
            if per > 1 and stable and left is not None and left >= per:  # K steps a call, then the remainder step by step
                multi = None
                while left >= per:
                    if gate.pending:
                        raise gate.interrupt()
                    stacked = stack(list(itertools.islice(batches, per)))
                    schedule = stacked_schedules(binding, dev, s.step, per)
                    if multi is None:  # resolved (maybe compiled) once per epoch, nothing donated yet
                        multi = resolve(STEPS, STEPS_ARGS(s, stacked, schedule), **s.fields(stacked), halt=halt)
                    else:
                        reused[multi] = reused.get(multi, 0) + 1
                    if s.shared:
                        unshare(s)
                    gate.defer = True
                    s.params, s.model_state, s.opt_state, s.guard = multi.call(*STEPS_ARGS(s, stacked, schedule))
                    s.step += per
                    left -= per
                    gate.defer = False
                    if s.step >= log_at:
                        log_at = track.step(s, None)
                    if perf_counter() > next_sync:
                        seen, guard = sync(s, seen, bar, step0, split, fields, resolve, reused)
                        next_sync = perf_counter() + _SYNC_SECONDS
            grad_call, opt_call, grad_args, opt_args = grad.call, opt.call, GRAD_ARGS, OPT_ARGS
            # How many steps this loop may run ahead of the device: a CPU mesh's own bound (`_sharding.pace`),
            # else the pipeline's: each queued step holds its batch, so an unbounded lead grows memory by a
            # batch a step whenever the host outruns the device (`_pipeline.run_ahead`).
            ahead = place.ahead or run_ahead(batch)
            recent = collections.deque(maxlen=ahead + 1)  # the last steps' losses, kept only to pace by
            for batch in batches:
                if gate.pending:
                    raise gate.interrupt()
                gate.defer = True  # from here to the stored results, Ctrl-C waits for the step
                if schedules:
                    apply_schedules(dev, s.step)
                if stable:
                    flat_grads, loss, model_state = grad_call(*grad_args(s, batch))
                    if s.shared:  # read by the user (a schedule, say) since the last step
                        unshare(s)
                    s.params, s.opt_state, s.guard, s.model_state = opt_call(*opt_args(s, flat_grads, loss,
                                                                                       model_state))
                    pairs += 1
                else:  # slow path: re-key every step (and report the loop)
                    gate.defer = False  # nothing is donated yet, and a compile may follow
                    grad, opt, loss = keyed_step(s, resolve, batch, gate)
                s.step += 1
                gate.defer = False
                if s.step >= log_at:
                    log_at = track.step(s, loss)
                if ahead:  # a CPU mesh: wait for the step `ahead` back (`_sharding.pace`)
                    recent.append(loss)
                    if len(recent) > ahead:
                        recent[0].block_until_ready()
                if perf_counter() > next_sync:
                    pairs = fold_pairs(reused, grad, opt, pairs)
                    seen, guard = sync(s, seen, bar, step0, split, fields, resolve, reused)
                    next_sync = perf_counter() + _SYNC_SECONDS
            if gate.pending and gate.cuts_epoch():
                raise gate.interrupt()
            seen, guard = check_losses(s, seen, bar, step0, split, fields, resolve)
            gate.defer = True  # held from here to the cursor's store
            settled = True
    finally:
        # The step block's commit point: until the cursor says how many steps were taken, `s.step` is
        # ahead of it, and a Ctrl-C in between would make the next call replay those steps. Ctrl-C is
        # held on the way in: after the last check above, or by the interrupt that ended the loop.
        gate.defer = True
        try:
            close_epoch(s, start, step0, total, n_loss, settled and seen, reused, grad, opt, pairs)
        finally:
            try:
                # The batch stream ends here, not when the frame is collected: an interrupt's traceback
                # (kept by a stopped background run) holds this frame, and the stream's end is what tells
                # compile ahead that the step loop stopped (`_pipeline._stepping`). With Ctrl-C still
                # held: one landing in the stream's end would leave compile ahead waiting for a step loop
                # that is over (for the process's life).
                drawn.close()
                _events.publish("steps_over")
            finally:
                gate.defer = False
    # Every step taken: the cursor stays at the epoch's end until the caller counts the epoch, so a
    # Ctrl-C landing in between leaves an epoch the next call counts, never one it replays.
    return mean_loss(total + seen[0], n_loss + seen[1]), _guard.bad_steps(guard)


def close_epoch(s: StepState, start: int, step0: int, total: float, count: int, seen, reused: dict, grad, opt,
                pairs: int):
    """The cursor of the steps this call took (from `start`, the cursor's at the call, and `step0`, the
    step): after every step (`seen`: the finite losses' `(sum, count)` at the last sync point), or after
    Ctrl-C or an error (`seen` False: the guard's, with a bad step before it still counted as not
    applied, `settle`). Runs with Ctrl-C held."""
    fold_pairs(reused, grad, opt, pairs)
    count_reuse(reused)
    if seen is False:
        total, count = settle(s, step0, total, count)
    else:
        total, count = total + seen[0], count + seen[1]
    s.cursor = Cursor(start + s.step - step0, total, count)


def sync(s: StepState, seen: tuple, bar, step0: int, split: dict, fields, resolve, reused: dict) -> tuple:
    """A periodic sync point: the losses checked, reuse counted, the live panel told (never per step)."""
    out = check_losses(s, seen, bar, step0, split, fields, resolve)
    count_reuse(reused)
    _events.publish("progress")
    return out


def stack(batches: list) -> dict:
    """K consecutive batches as one, with a new leading axis (numpy on the host, else on the device)."""
    return {k: (np.stack if isinstance(batches[0][k], np.ndarray) else jax.numpy.stack)([b[k] for b in batches])
            for k in batches[0]}


def stacked_schedules(binding, dev: dict, step: int, count: int) -> dict:
    """`{field: [count, ...]}`: each scheduled Device field's values at steps `step .. step + count - 1`,
    as the per-step loop would set them; `dev` is left at the last one's, as that loop leaves it."""
    if not binding.schedules:
        return {}
    rows = []
    for i in range(count):
        values = {}
        binding.apply_schedules(values, step + i)
        rows.append(values)
    dev.update(rows[-1])
    return {name: np.stack([r[name] for r in rows]) for name in binding.schedules}


def mean_loss(total: float, count: int) -> float:
    """The epoch's mean finite loss; NaN when it had none (every step skipped), never a perfect 0.0."""
    return total / count if count else float("nan")


def guard_parts(s: StepState) -> int:
    """How many values the handle's steps check (`_guard.n_parts`), worked out once per handle: it traces
    the layout's ravel (milliseconds, a tenth of a 256-step epoch of a tiny MLP when paid per epoch), and
    neither the layout nor the Device fields' dtypes move after setup."""
    if s.guard_parts is None:
        s.guard_parts = _guard.n_parts(s.layout, s.model.split.trainable(s.params), s.dev)
    return s.guard_parts


def keyed_step(s: StepState, resolve, batch, gate: InterruptGate):
    """One step that keys (and maybe compiles) both programs: the first step of an epoch, or every
    step when the optimizer's outputs would move its key. Ctrl-C is held only once the optimizer
    program, which donates params and state, is about to run."""
    args = s.grad_args(batch)
    grad = resolve(GRAD, args, **s.fields(batch))
    # The new model state is stored with the step's parameters, by the optimizer program (which keeps the
    # old one for a step it skips): a Ctrl-C while it is resolved (maybe compiled) changes neither.
    flat_grads, loss, model_state = grad.call(*args)
    opt = resolve(OPT, OPT_ARGS(s, flat_grads, loss, model_state), halt=s.on_nonfinite == "raise")
    if s.shared:
        unshare(s)
    gate.defer = True
    s.params, s.opt_state, s.guard, s.model_state = opt.call(*OPT_ARGS(s, flat_grads, loss, model_state))
    return grad, opt, loss


def unshare(s: StepState):
    """Fresh buffers for the params and optimizer state the next step donates, when something besides
    the handle still holds the current ones (`best = n.params`, IPython's `Out`, a carried-from handle):
    a donated array would be deleted under it. Asked once after each read (`shared`), not per step.
    A read whose result was dropped (`jax.block_until_ready(n.params)`) costs nothing: a copy of the
    120-layer MLP's 242 arrays and their optimizer state takes about 10 ms."""
    if _held_elsewhere((s.params, s.opt_state)):
        s.params, s.opt_state = copy_arrays((s.params, s.opt_state))
        stats["copies"] += 1
    s.shared = False


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


def check_losses(s: StepState, seen: tuple, bar, step0: int, split: dict, fields, resolve) -> tuple:
    """A sync point: one transfer of the guard, which holds the epoch's finite losses (their sum and
    count, `_guard.loss_sum`) and its bad steps; with `on_nonfinite="raise"`, raise the
    `NonFiniteLossError` of a guard that saw a bad step.

    **Arguments:**
    - `s`: the step state (its guard, step and epoch name the failing step in the message).
    - `seen`: the finite losses' `(sum, count)` at the last sync point (`(0.0, 0)` at the epoch's start).
    - `bar`: the call's `_progress.Progress`, told the mean loss since the last sync point, or None.
    - `step0`, `split`, `fields`: the step the epoch started at and its batches, to name the cause.
    - `resolve`: the handle's program resolution, to recompute the bad step's gradients.

    **Returns:** `((sum, count), host guard)`: the epoch's finite losses so far, and the guard read.
    """
    guard = jax.device_get(s.guard)
    if s.on_nonfinite == "raise" and _guard.bad_steps(guard):
        raise nonfinite_error(s, resolve, guard, step0, split, fields)
    total, count = _guard.loss_sum(guard)  # "skip": a skipped step's non-finite loss is not the epoch's
    if bar is not None and count > seen[1]:
        bar.sync((total - seen[0]) / (count - seen[1]))
    return (total, count), guard


def nonfinite_error(s: StepState, resolve, guard, step0: int, split: dict, fields) -> NonFiniteLossError:
    """The handle back at the last finite step (`step`), and the error naming the bad one."""
    s.step = step0 + _guard.first_bad(guard)
    binding, place = s.binding, s.place

    def batch_at(index):  # `index` counts from the step the epoch (or what is left of it) began at
        start = s.cursor.taken
        drawn = train_batches(split, fields, s.batch_size, s.accum, (s.seed, s.epoch), start)
        try:
            for i, batch in enumerate(drawn):
                if i == index:
                    return batch
        finally:
            drawn.close()  # its end, not the collector, tells compile ahead no step loop runs

    def dev_at(step):
        dev = dict(s.dev)
        if binding.schedules:
            place.schedules(binding.apply_schedules)(dev, step)
        return dev

    def regrad(batch, dev):
        batch = place.batch(batch, s.accum > 1)  # placed as the loop placed it: the same program
        args = s.grad_args(batch, dev, guard=s.fresh_guard(s.step))  # the bad step's rng
        flat_grads, loss, _ = resolve(GRAD, args, **s.fields(batch)).call(*args)
        return flat_grads, loss

    return _guard.diagnose(s, guard, step0, batch_at, dev_at, regrad)


def settle(s: StepState, step0: int, total: float, count: int) -> tuple:
    """After Ctrl-C or an error: with `on_nonfinite="raise"`, a bad step the loop had not seen yet
    still ends the handle at the last finite step (the programs applied nothing after it).

    **Returns:** `(total, count)` with the finite losses of the steps kept folded in (what the rest of
    the epoch starts from): the guard's sum, which holds only the losses of the steps it applied."""
    guard = s.guard
    if guard is None:
        return total, count
    try:
        guard = jax.device_get(guard)
    except Exception:  # a guard donated to a step that never finished: nothing was applied either
        return total, count
    if s.on_nonfinite == "raise" and _guard.bad_steps(guard):
        s.step = step0 + _guard.first_bad(guard)
    more, counted = _guard.loss_sum(guard)
    return total + more, count + counted


def fold_pairs(reused: dict, grad, opt, pairs: int) -> int:
    """`pairs` reuses of the per-step entries folded into `reused`; returns 0 (the count restarts)."""
    if pairs:
        reused[grad] = reused.get(grad, 0) + pairs
        reused[opt] = reused.get(opt, 0) + pairs
    return 0


def count_reuse(reused: dict):
    """Steady-state calls reuse the entries resolved at the epoch's first step (or first K-step call);
    each use is a cache hit, counted in a local and folded into the counters at sync points rather
    than paid per step."""
    for entry, calls in reused.items():
        if calls:
            _cache.count_hit(entry, calls)
    reused.clear()


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


_CARRIED = ("params", "opt_state", "guard", "state")  # what the optimizer program returns, in order


def _returns_its_inputs(opt_entry) -> bool:
    in_avals, out_avals = compiled_in_avals(opt_entry.call), compiled_out_avals(opt_entry.call)
    if in_avals is None or out_avals is None:
        return True
    in_avals = [leaf for name in _CARRIED for leaf in jax.tree.leaves(in_avals[OPT.args.index(name)])]
    out_avals = jax.tree.leaves(out_avals)
    norm = lambda a: (tuple(a.shape), str(a.dtype), bool(getattr(a, "weak_type", False)))
    return [norm(a) for a in in_avals] == [norm(a) for a in out_avals]
