"""A handle's loggers, and the thread that feeds them while a `train()` call runs.

The step path pays an int comparison a step, and at a logged step (`log_every=k`) an asynchronous device
-> host copy of one value (`copy_to_host_async`, on an accelerator) and an append to a bounded deque: no
host callback in the compiled step, no blocking transfer, no lock. The logger thread turns the values into
floats (the copies have landed by then) and calls the loggers.

Python runs one thread at a time, so whatever the loggers do while the step loop runs is taken from the
loop whenever the loop is the bottleneck (a small model's dispatch): a writer's 15-100 us per event beside
a 50 us step would double it. So while a `train()` call runs, the logger thread works in slices of at most
`SLICE` seconds and rests after each so that it holds the interpreter `DUTY` of the time while the
training thread is busy (more, up to `SHARE_MAX`, while it waits for an accelerator: `Session._share`),
and what it has not written waits in the queue. When the call ends it writes the rest
at full speed, and the call returns once everything is written and each logger flushed. When the
loggers cannot keep up (more than `QUEUE` step events waiting), new step events are dropped and counted
(said once, at the call's end); epoch, validation and text events are never dropped. A logger that raises
is detached for the rest of the call and said once.

What a step event's loss is: the loss of that step (the gradient program's output, not donated); with
`steps_per_execution=K`, the mean of the finite losses since the epoch's last logged point, read from a
copy of the guard the K-step program carries (`_training/_guard.py`: its loss sum and count), since a
K-step call hands back no per-step loss.
"""

import collections
import math
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from .._base import _report
from .._base._errors import NitroTypeError, NitroValueError
from ._event import Event, hparams, row_events, scalar

QUEUE = 16384  # step events waiting for the logger thread before new ones are dropped (a second or two to write)
POLL = 0.1  # seconds the logger thread waits for events when none are queued
SLICE = 0.002  # seconds of logger work at a time while a train() call runs
DUTY = 0.02  # the share of the time the logger thread works while the training thread is busy
IDLE = 0.5  # the training thread is idle (waiting for an accelerator) this share of the time or more: then
SHARE_MAX = 0.5  # the logger thread works half the idle time of the training thread and of the CPUs, at most this
REST_MIN = 0.005  # the shortest rest: how busy the training thread was is measured over it
REST_MAX = 0.5  # the longest rest after one slow event (a tracker's first event opens its run: seconds)
NEVER = 1 << 62  # the next step to log at when no logger logs steps

BAD_LOGGER = (
    "`loggers=` takes a list of loggers: `nitro_ipy.loggers.TensorBoard(logdir)`, `WandB(...)`, `MLflow(...)` "
    "or any callable `(event) -> None`; got {what} at position {i}. Fix: pass the logger object itself, "
    "e.g. `loggers=[TensorBoard(\"runs/a\")]`."
)
BAD_EVERY = "`log_every` is a number of optimizer steps, a positive int (or None: per epoch); got {what}."


def check_log_every(value):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise NitroValueError(BAD_EVERY.format(what=repr(value)))
    return value


def check_loggers(loggers) -> tuple:
    if loggers is None:
        return ()
    if callable(loggers) or isinstance(loggers, (str, bytes)):
        loggers = [loggers] if callable(loggers) else loggers
    out = tuple(loggers)
    for i, fn in enumerate(out):
        if not callable(fn):
            raise NitroTypeError(BAD_LOGGER.format(what=f"`{type(fn).__name__}` {fn!r:.60}", i=i))
        check_log_every(getattr(fn, "log_every", None))
    return out


def name_of(fn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


class Tracker:
    """A handle's loggers (`Nitro(e, loggers=[...])`). Events noted while no `train()` call runs (a rebuild,
    a resume, a stale program, a compile for `validate()`) wait in `pending` and open the next call's log."""

    def __init__(self, loggers=()):
        self.loggers = check_loggers(loggers)
        self.pending: list = []
        self.session = None

    def note(self, kind: str, step: int, epoch: int, values=None, **params):
        """An event of `kind` now: to the running call's thread, or held for the next call."""
        event = Event(kind, int(step), int(epoch), dict(values or {}), params, time.time())
        if self.session is not None:
            self.session.put(event)
        elif self.loggers:
            self.pending.append(event)

    def compiled(self, entry, step: int, epoch: int, taken: str):
        """The handle took `entry`, a program it had not run: compiled `now`, or from the `cache` (compiled
        by another handle, ahead, or loaded from the program store: `entry.origin` is `"disk"` then)."""
        if self.loggers or self.session is not None:
            seconds = float(entry.trace_s or 0.0) + float(entry.compile_s or 0.0)
            self.note("compile", step, epoch, {f"compile/{entry.kind}": seconds}, taken=taken, origin=entry.origin)

    def begin(self, step: int, epoch: int, experiment, extra=(), *, schedules=None,
              guard_read=None) -> "Session | None":
        """This `train()` call's session (None when no logger is attached): its thread runs until `end`.
        `schedules`: `apply(values, step)` setting each scheduled field's value; `guard_read`: a guard ->
        `(origin, loss sum, count)`."""
        loggers = self.loggers + check_loggers(extra)
        if not loggers:
            return None
        start = Event("start", int(step), int(epoch), {}, hparams(experiment), time.time())
        self.session = session = Session(loggers, [start, *self.pending], step, guard_read, schedules)
        self.pending = []
        session.thread.start()
        return session

    def end(self, session, err: BaseException | None, step: int, epoch: int):
        """The call ended (`err`: how, when it did not finish): a stop event, then every event is delivered
        and each logger flushed before this returns."""
        if session is None:
            return
        self.session = None
        if err is not None:
            reason = ("interrupted (Ctrl-C or `run.stop()`)" if isinstance(err, KeyboardInterrupt)
                      else f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
            session.put(Event("stop", int(step), int(epoch), {}, {"reason": reason}, time.time()))
        session.close()


class _Slot:
    """One logger in a session: its step cadence, the next step it wants, whether it was detached."""

    __slots__ = ("fn", "every", "next_at", "dead")

    def __init__(self, fn):
        self.fn, self.every, self.next_at, self.dead = fn, getattr(fn, "log_every", None), 0, False


class Session:
    """One `train()` call's logging: the loop's hooks (`next_at`, `step`) and the logger thread."""

    def __init__(self, loggers, first: list, step: int, guard_read, schedules):
        self.slots = [_Slot(fn) for fn in loggers]
        everies = [s.every for s in self.slots if s.every]
        self.every = math.gcd(*everies) if everies else None
        self.guard_read = guard_read  # host guard -> (origin, loss sum, count) (`_training/_guard.py`)
        self.schedules = schedules  # `binding.apply_schedules`, or None
        self.queue = collections.deque(first)
        # Step events queued (the loop's count) and taken (the logger thread's): each written by one thread.
        self.steps_queued = self.steps_taken = 0
        self.dropped = 0  # step events the loop did not queue (the queue was full)
        self.unreadable = 0  # step events whose value could not be read (a deleted buffer)
        self.said: list = []  # (logger name, error) the loop has not said yet
        self.last_step = (step, time.perf_counter())  # for steps/s between logged steps
        self.block = (None, 0.0, 0)  # the guard origin and the loss sum, count at the last logged K block
        # On an accelerator the value's copy to the host starts at once, so the logger thread finds it there;
        # on the CPU the buffer is host memory already, and the call costs 5-6 us of the loop's CPU a step.
        self.copy = jax.default_backend() != "cpu"
        try:  # the training thread's CPU clock: how busy it is while the logger thread rests
            self.trainer = time.pthread_getcpuclockid(threading.get_ident())
        except (AttributeError, OSError):  # not a POSIX system: the logger thread keeps to `DUTY`
            self.trainer = None
        self.cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.closing = False
        self.wake = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="nitro_ipy-loggers", daemon=True)  # `begin` starts it

    # ------------------------------------------------------------ the step loop's side
    def next_at(self, step: int) -> int:
        """The first step after `step` a logger wants (`NEVER` when none logs steps)."""
        every = self.every
        return NEVER if every is None else (step // every + 1) * every

    def step(self, s, loss) -> int:
        """A logged step of `s` (the loop's `StepState`), `loss` its loss on the device (None after a
        K-step call): start the copy, queue it, return the next step to log at."""
        value = loss if s.per_execution == 1 else jnp.copy(s.guard)  # the guard is donated to the next call
        if self.copy:
            value.copy_to_host_async()
        if self.steps_queued - self.steps_taken < QUEUE:
            self.steps_queued += 1
            self.queue.append((s.step, s.epoch, value, time.perf_counter(), time.time()))
        else:
            self.dropped += 1
        if self.said:
            self.say()
        return (s.step // self.every + 1) * self.every

    def epoch(self, row: dict, step: int, epoch: int, steps: int, seconds: float):
        """An epoch row done (validated, checked for early stopping): its events."""
        extra = {}
        if seconds > 0 and steps > 0:
            extra["train/steps_per_s"] = steps / seconds
        extra.update(self._schedules(step))
        for event in row_events(row, step, epoch, extra, time.time()):
            self.put(event)
        if self.said:
            self.say()

    def put(self, event: Event):
        self.queue.append(event)

    def say(self):
        """The loggers detached since the last call, one line each (from the training thread, so a
        background run collects it with its other messages)."""
        said, self.said = self.said, []
        for name, err in said:
            _report.emit(_report.Kind.LOGGER, text=f"nitro_ipy.loggers: `{name}` raised {err}; it is detached "
                                                   f"for the rest of this train() call, which goes on.")

    def close(self):
        self.closing = True
        self.wake.set()
        self.thread.join()
        self.say()
        if self.dropped:
            _report.emit(_report.Kind.LOGGER, text=(
                f"nitro_ipy.loggers: {self.dropped} step events were dropped: the loggers fell behind the "
                f"steps ({QUEUE} were waiting). Fix: a larger `log_every`."))
        if self.unreadable:
            _report.emit(_report.Kind.LOGGER, text=(
                f"nitro_ipy.loggers: {self.unreadable} step events were lost: their values could not be read "
                f"from the device (the arrays were deleted before the logger thread reached them)."))

    # ------------------------------------------------------------ the logger thread's side
    def _serve(self):
        rested = self._clocks()
        while True:
            closing = self.closing
            if self.queue:
                start = time.perf_counter()
                share = DUTY if closing else self._share(rested, self._clocks())
                self._drain(None if closing else start + SLICE)
                self._flush()
                if not closing:  # rest, so that the logger thread works `share` of the time
                    spent = time.perf_counter() - start
                    rested = self._clocks()
                    self.wake.wait(min(max(spent * (1 / share - 1), REST_MIN), REST_MAX))
                continue
            if closing:
                return
            rested = self._clocks()
            self.wake.wait(POLL)

    def _clocks(self) -> tuple:
        """(wall, the training thread's CPU, the process's CPU) seconds, read when a rest begins."""
        trainer = 0.0
        if self.trainer is not None:
            try:
                trainer = time.clock_gettime(self.trainer)
            except OSError:  # the training thread ended (a background run's): it is idle
                self.trainer = None
        return time.perf_counter(), trainer, time.process_time()

    def _share(self, rested: tuple, now: tuple) -> float:
        """The share of the time the logger thread may work until its next rest: `DUTY` while the training
        thread was busy during the last rest (a dispatch-bound loop: every moment the logger holds the
        interpreter is taken from it); when it was mostly idle (waiting for an accelerator), half of
        what it and the process left of the CPUs idle, up to `SHARE_MAX`. Measured over the rest alone,
        when the logger thread took nothing, so its own work never reads as the training thread's idleness."""
        wall, trainer, process = now
        span = wall - rested[0]
        if self.trainer is None or span < REST_MIN / 2:  # woken early (the call's end): no measure
            return DUTY
        idle = 1 - (trainer - rested[1]) / span
        if idle < IDLE:
            return DUTY
        idle_cpus = self.cpus - (process - rested[2]) / span
        return min(max(min(idle, idle_cpus) / 2, DUTY), SHARE_MAX)

    def _drain(self, until: float | None):
        """Deliver queued events in order, until the queue is empty or the clock passes `until`."""
        queue, clock = self.queue, time.perf_counter
        while queue:
            item = queue.popleft()
            if isinstance(item, Event):
                self._deliver(item)
            else:
                self.steps_taken += 1
                try:
                    event = self._step_event(*item)
                except Exception:  # noqa: BLE001 - a value that cannot be read (a deleted buffer) is lost,
                    self.unreadable += 1  # counted and said at the call's end, never the thread's end
                    continue
                self._deliver(event)
            if until is not None and clock() > until:
                return

    def _step_event(self, step, epoch, value, clock, now) -> Event:
        values = {}
        if self.guard_read is None or getattr(value, "ndim", 0) == 0:
            values["step/loss"] = float(np.asarray(value))  # a sixth of `float(value)`'s 9 us on a CPU
        else:
            origin, total, count = self.guard_read(value)
            last_origin, last_total, last_count = self.block
            if origin != last_origin:
                last_total, last_count = 0.0, 0
            self.block = (origin, total, count)
            if count > last_count:
                values["step/loss"] = (total - last_total) / (count - last_count)
        last_step, last_clock = self.last_step
        if step > last_step and clock > last_clock:
            values["step/steps_per_s"] = (step - last_step) / (clock - last_clock)
        self.last_step = (step, clock)
        values.update(self._schedules(step))
        return Event("step", int(step), int(epoch), values, {}, now)

    def _schedules(self, step: int) -> dict:
        """Each scheduled Device field's value at the step that brought the count to `step`."""
        if self.schedules is None or step < 1:
            return {}
        values = {}
        try:
            self.schedules(values, step - 1)
        except Exception:  # noqa: BLE001 - the step loop reports a failing schedule itself
            return {}
        return {f"schedule/{k}": x for k, v in values.items() if (x := scalar(v)) is not None}

    def _deliver(self, event: Event):
        for slot in self.slots:
            if slot.dead:
                continue
            if event.kind == "step":
                if slot.every is None or event.step < slot.next_at:
                    continue
                slot.next_at = (event.step // slot.every + 1) * slot.every
            try:
                slot.fn(event)
            except Exception as err:  # noqa: BLE001 - a logger's fault never stops training
                slot.dead = True
                self.said.append((name_of(slot.fn), f"{type(err).__name__}: {err}"))

    def _flush(self):
        for slot in self.slots:
            flush = getattr(slot.fn, "flush", None)
            if slot.dead or flush is None:
                continue
            try:
                flush()
            except Exception as err:  # noqa: BLE001
                slot.dead = True
                self.said.append((name_of(slot.fn), f"{type(err).__name__}: {err}"))
