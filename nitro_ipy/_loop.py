"""The epoch loop: steps, the Ctrl-C gate, the progress bar and the loss checks.

`train_epoch` advances a handle in place. It reads and writes the handle's `_params`, `_state` and `step`
(a step's results are stored there before Ctrl-C may land) and resolves the two training programs
through the handle's `_grad_entry` / `_opt_entry`, which key and maybe compile them.

The steady-state loop is benchmarked at the microsecond level (a tiny MLP against a hand-written loop):
calls it makes every step are bound to locals, and counters and messages wait for a sync point.
"""

import contextlib
import signal
import threading
import time

import jax
import numpy as np

from . import _cache
from ._compat import compiled_in_avals, compiled_out_avals
from ._data import train_batches
from ._errors import NonFiniteLossError
from ._sharding import is_main_process

_SYNC_SECONDS = 0.25  # how often losses are checked, reuse counted and the live panel told


class InterruptGate:
    """Holds Ctrl-C while `defer` is True, until the step in flight has stored its results, so an
    interrupt never leaves the handle with donated-away buffers. Outside the gate it raises at once.

    A held Ctrl-C sets `pending`; the loop raises `KeyboardInterrupt` at its next check (a background
    run's `stop()` sets it too: `_runs.RunControl`). `quiet` turns the progress bar off (a worker thread
    never draws one).
    """

    __slots__ = ("defer", "pending", "quiet")

    def __init__(self):
        self.defer = False
        self.pending = False
        self.quiet = False

    def _on_sigint(self, signum, frame):
        if self.defer:
            self.pending = True
        else:
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


def train_epoch(n, split: dict, fields, steps: int, gate: InterruptGate | None = None) -> float:
    """One epoch of training on handle `n`.

    **Arguments:**
    - `n`: the handle; its parameters, optimizer state and step advance in place.
    - `split`: the train split; `fields`: the batch fields the programs take.
    - `steps`: optimizer steps in the epoch (the progress bar's total).
    - `gate`: the train call's control (Ctrl-C, a stop request); default: a fresh `InterruptGate`.

    **Returns:** the epoch's mean training loss. Raises `NonFiniteLossError` on a NaN or infinite loss.
    """
    place = n._place  # on a mesh, each batch is split along the data axis as it is drawn
    batches = place.batches(train_batches(split, fields, n.batch_size, n.accum, (n.seed, n.epoch)), n.accum > 1)
    bar = None  # opened after the first step, so compile lines print above it, not through it
    binding = n._binding
    schedules, apply_schedules = binding.schedules, place.schedules(binding.apply_schedules)
    dev = n._dev  # schedules set its values in place, so the programs see them through this one dict
    gate = InterruptGate() if gate is None else gate
    losses, total, n_loss = [], 0.0, 0
    reused, grad, opt = 0, None, None  # steady-state steps that reused the resolved programs
    try:
        with gate.installed():
            # First step: resolve both programs (maybe compiling); they stay fixed for the epoch when
            # the optimizer hands back parameters and state of the avals it was compiled for.
            batch = next(batches)
            if schedules:
                apply_schedules(dev, n.step)
            grad, opt, loss = keyed_step(n, batch, gate)
            stable = returns_its_inputs(opt)
            n.step += 1
            losses.append(loss)
            gate.defer = False
            if n.progress and not gate.quiet and is_main_process():
                bar = progress_bar(steps, f"epoch {n.epoch + 1}")
                bar.update(1)
            grad_call, opt_call = grad.call, opt.call
            append, perf_counter = losses.append, time.perf_counter
            next_sync = perf_counter() + _SYNC_SECONDS
            for batch in batches:
                if gate.pending:
                    raise KeyboardInterrupt
                gate.defer = True  # from here to the stored results, Ctrl-C waits for the step
                if schedules:
                    apply_schedules(dev, n.step)
                if stable:
                    flat_grads, loss = grad_call(n._params, dev, batch)
                    n._params, n._state = opt_call(n._params, flat_grads, n._state, dev)
                    reused += 1
                else:  # slow path: re-key every step (and report the loop)
                    gate.defer = False  # nothing is donated yet, and a compile may follow
                    grad, opt, loss = keyed_step(n, batch, gate)
                n.step += 1
                gate.defer = False
                append(loss)
                if bar is not None:
                    bar.update(1)
                if perf_counter() > next_sync:
                    total, n_loss = check_losses(n, losses, total, n_loss, bar)
                    losses.clear()
                    count_reuse(grad, opt, reused)
                    reused = 0
                    _cache.publish("progress")  # the live panel, never per step
                    next_sync = perf_counter() + _SYNC_SECONDS
            if gate.pending and gate.cuts_epoch():
                raise KeyboardInterrupt
    finally:
        count_reuse(grad, opt, reused)
        if bar is not None:
            bar.close()
    total, n_loss = check_losses(n, losses, total, n_loss, None)
    return total / max(n_loss, 1)


def keyed_step(n, batch, gate: InterruptGate):
    """One step that keys (and maybe compiles) both programs: the first step of an epoch, or every
    step when the optimizer's outputs would move its key. Ctrl-C is held only once the optimizer
    program, which donates params and state, is about to run."""
    grad = n._grad_entry(batch)
    flat_grads, loss = grad.call(n._params, n._dev, batch)
    opt = n._opt_entry(flat_grads)
    gate.defer = True
    n._params, n._state = opt.call(n._params, flat_grads, n._state, n._dev)
    return grad, opt, loss


def check_losses(n, losses: list, total: float, count: int, bar):
    """Fold the losses since the last sync into `(total, count)`, refusing a non-finite one.

    **Arguments:**
    - `n`: the handle (its step and epoch name the failing step in the message).
    - `losses`: device scalars of the steps since the last sync, in order.
    - `total`, `count`: the running sum and number of losses so far this epoch.
    - `bar`: the progress bar to show the last loss on, or None.

    **Returns:** the new `(total, count)`.
    """
    if not losses:
        return total, count
    values = np.asarray(jax.device_get(losses), dtype=np.float64)
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        step = n.step - len(values) + int(bad[0]) + 1
        raise NonFiniteLossError(
            f"the training loss became {values[bad[0]]} at step {step} (epoch {n.epoch + 1}). "
            f"Check the `loss` hook for log(0) or division by zero and lower the learning rate; "
            f"the handle stays usable (`n.params` holds the parameters after step {n.step})."
        )
    if bar is not None:
        bar.set_postfix(loss=f"{values[-1]:.4g}", refresh=False)
    return total + float(values.sum()), count + len(values)


def count_reuse(grad, opt, steps: int):
    """Steady-state steps reuse the two entries resolved at the first step; each use is a cache hit,
    counted in a local and folded into the counters at sync points rather than paid per step."""
    if steps:
        _cache.count_hit(grad, steps)
        _cache.count_hit(opt, steps)


def returns_its_inputs(opt_entry) -> bool:
    """True when the optimizer program returns params and state of exactly the avals it takes, so the
    next step can skip re-keying. False means the key would move: the slow path re-keys every step."""
    in_avals, out_avals = compiled_in_avals(opt_entry.call), compiled_out_avals(opt_entry.call)
    if in_avals is None or out_avals is None:
        return True
    in_avals = jax.tree.leaves(in_avals[0]) + jax.tree.leaves(in_avals[2])
    out_avals = jax.tree.leaves(out_avals)
    norm = lambda a: (tuple(a.shape), str(a.dtype), bool(getattr(a, "weak_type", False)))
    return [norm(a) for a in in_avals] == [norm(a) for a in out_avals]


def progress_bar(total: int, desc: str):
    """A tqdm bar (a widget in notebooks, text in terminals) for one epoch's steps."""
    # Imported on the first bar, not at the top, for import speed only (no cycle): `tqdm.auto` adds ~30 ms
    # to `import nitro_ipy`, which scripts that never show a bar need not pay.
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", leave=False, mininterval=0.25)
