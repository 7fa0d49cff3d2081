"""Runs of `train()`: in the foreground (Ctrl-C ends it with one line) or in a worker thread (`Run`),
plus what a training loop is expected to have around it: `set` (a Device field of a live handle),
early stopping (`stop_when=`), and `n.history` as a table.

**The run interface front ends use** (the live panel's Stop button, a status line), kept small:

- `_events.subscribe("run", fn)`: `fn(run)` is called when a background run starts (from the thread that
  called `train(background=True)`) and when it ends (from its worker thread; `run.done` is True then).
  A subscriber only sets flags or reads state: it never touches a widget from there.
- `run.stop(reason=...)`: asks the run to stop at its next step boundary; returns at once.
- `run.status` (`"running"`, `"stopped"`, `"finished"`, `"failed"`), `run.done`, `run.running`,
  `run.where()` (one line: epoch, step), `run.rows` (the epoch rows so far), `run.handle`, `run.messages`.

**What a stop keeps.** The step in flight completes and stores its results; params, optimizer state,
`n.step` count every step taken. An epoch cut short is not counted: `n.epoch` and `n.history` hold the
completed epochs only, and the next `train()` goes on with that epoch at its next batch (the same
shuffle, the same rng stream: interrupted and continued, or checkpointed there and resumed, a run takes
exactly the uninterrupted run's steps). A stop asked
for during validation lets validation finish, so its row is whole.

**Messages of a background run** (compile lines, epoch lines, stale warnings) are collected on the run,
never printed from the worker thread (which would land in whichever cell runs then) and never shown as
widgets from it. `run.wait()` shows the ones not shown yet, in the calling cell.
"""

import atexit
import copy
import dataclasses
import html
import queue
import threading
import time
import weakref

import jax
import numpy as np

from .._base import _events, _report, _world
from .._base._errors import HandleBusyError, NitroTypeError, NitroValueError
from .._experiment._checks import device_value
from .._experiment._fields import field_kinds, short_repr
from ._loop import InterruptGate


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a foreground `train()`; the handle is usable (the step in flight completed).

    Still a `KeyboardInterrupt`, so it aborts a notebook's "Run All" like any interrupt; IPython and
    ipykernel show `_render_traceback_`, one line, instead of a traceback into nitro_ipy.
    Attributes: `epoch` (the handle's epoch it was in, 1-based: `n.epoch + 1`), `step` and `steps`
    (optimizer steps into that epoch, and its length), `rows` (the epoch rows this call completed),
    `message` (the reporter's line: a notebook shows it once, in the call's display).
    """

    __module__ = "nitro_ipy"  # the plain traceback's last line reads `nitro_ipy.TrainingInterrupted: ...`

    def __init__(self, text: str, epoch: int = 0, step: int = 0, steps: int = 0, rows=(), message=None):
        super().__init__(text)
        self.epoch, self.step, self.steps, self.rows = epoch, step, steps, list(rows)
        self.message = message

    def _render_traceback_(self):
        return [str(self)]


class RunControl(InterruptGate):
    """One `train()` call's control: the Ctrl-C gate, a stop request, and where the loop is."""

    __slots__ = ("stop_reason", "steps", "epoch", "epoch_start", "validating", "rows", "handle")

    def __init__(self, handle, steps: int, quiet: bool = False):
        super().__init__()
        self.quiet = quiet
        self.handle = handle
        self.stop_reason = None
        self.steps = steps  # optimizer steps per epoch
        self.epoch = handle.epoch + 1  # the epoch being trained (1-based)
        self.epoch_start = handle.step - handle._cursor.taken  # `n.step` when it began (maybe in an earlier call)
        self.validating = False
        self.rows = []  # this call's completed epoch rows

    def begin_epoch(self):
        n = self.handle
        self.epoch, self.epoch_start, self.validating = n.epoch + 1, n.step - n._cursor.taken, False

    def request_stop(self, reason: str):
        self.stop_reason = reason
        self.pending = True  # the loop checks it at every step boundary

    def cuts_epoch(self) -> bool:
        return self.stop_reason is None

    def where(self) -> str:
        """`epoch 4, step 204/427`, or `epoch 4, validating` once its steps are done (the handle's epochs)."""
        if self.validating or self.handle.epoch >= self.epoch:  # its steps done and the epoch counted
            return f"epoch {self.epoch}, validating"
        return f"epoch {self.epoch}, step {self.handle.step - self.epoch_start}/{'?' if self.steps is None else self.steps}"

    def stop_message(self, reason: str | None = None) -> _report.Message:
        """The one line this call's stop says: in its progress display and as `TrainingInterrupted`."""
        return _report.message(_report.Kind.INTERRUPTED, where=self.where(), reason=reason)

    def interrupted(self) -> "TrainingInterrupted":
        """The error a Ctrl-C ends the call with, carrying the line its display shows."""
        msg = self.stop_message()
        return TrainingInterrupted(msg.text, self.epoch, self.handle.step - self.epoch_start, self.steps,
                                   self.rows, msg)


def foreground(control: RunControl, work):
    """Run `work()` (the epoch loop) here; Ctrl-C ends it with one line, the handle usable. The gate
    is the SIGINT handler for the whole call, validation too: a Ctrl-C Python drops (`InterruptGate`)
    is raised again at the next epoch, or when the last one ends."""
    try:
        with control.installed():
            return work()
    except KeyboardInterrupt:
        if control.stop_reason is not None:
            return list(control.rows)
        raise control.interrupted() from None


_live: "weakref.WeakSet[Run]" = weakref.WeakSet()


class Run:
    """A `train()` running in a worker thread: what `n.train(..., background=True)` returns.

    `stop()` stops it at the next step boundary, `wait()` returns its rows (or raises what it raised).
    The handle's entry points refuse to run meanwhile (`HandleBusyError`); `n.set(...)` and reading
    `n.history`, `n.step`, `n.epoch` work, and rows reach `n.history` as epochs end.
    """

    def __init__(self, handle, control: RunControl, work, epochs: int):
        self.handle = handle
        self.epochs = epochs
        self.messages: list = []  # every message the run emitted, in order
        self._control = control
        self._work = work
        self._shown = 0  # messages already shown by `wait()`
        self._result = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._released = threading.Event()  # set once its worker holds it no more (just after `_done`)
        self.started = time.time()
        self.ended: float | None = None
        self._thread: threading.Thread | None = None  # the worker it runs on, once `_main` starts there

    def _name(self) -> str:
        return type(self.handle.experiment).__qualname__

    def _start(self) -> "Run":
        self.handle._run = self
        _live.add(self)
        _workers.submit(f"nitro_ipy run ({self._name()})", self._main, self._released)
        _events.publish("run", self)
        return self

    def _main(self):
        self._thread = threading.current_thread()  # before anything it runs asks (`_on_compile`)
        unsubscribe = _events.subscribe("compile", self._on_compile)
        try:
            with _report.thread_sink(self.messages.append):
                self._result = self._work()
        except KeyboardInterrupt:  # a stop request, raised at a step boundary
            self._result = list(self._control.rows)
        except BaseException as err:  # noqa: BLE001 - kept for `wait()`, which raises it where it is read
            self.error = err
        finally:
            unsubscribe()
            # The handle forgets its ended run and the run its work (a closure over the handle): a run
            # and its handle hold each other no longer, so dropping both frees the handle's programs
            # at once, not at the next garbage collection (until which a scan would still judge them).
            if self.handle._run is self:
                self.handle._run = None
            self._work = None
            self.ended = time.time()
            self._done.set()
            _events.publish("run", self)

    def _on_compile(self, entry):
        # A program this run compiles late (validation's, after epoch 1) traces the code as it is then: if
        # a cell redefined something the run's earlier programs traced, the run now mixes two versions.
        if threading.current_thread() is not self._thread:
            return
        earlier = [e for e in self.handle._programs.values() if e is not entry]
        names, others = mixed_code(entry, earlier)
        if names:
            _report.emit(_report.Kind.MIXED_CODE, program=entry.kind, names=names, others=others)

    # ---------------------------------------------------------------- control
    def stop(self, reason: str = "stopped by `run.stop()`") -> None:
        """Stop at the next step boundary (the step in flight completes); returns at once. `wait()` then
        returns the completed epochs' rows."""
        if not self.done:
            self._control.request_stop(reason)

    def wait(self, timeout: float | None = None) -> list[dict]:
        """Block until the run ends; return its rows (what `train()` returns) or raise what it raised.

        Shows, in the calling cell, the run's messages not shown yet. Ctrl-C while waiting stops the run
        at its next step and raises `TrainingInterrupted`. After `timeout` seconds with the run still
        training, raises `TimeoutError` (the run goes on).
        """
        if threading.current_thread() is self._thread:
            raise RuntimeError("`run.wait()` from the run's own thread would wait forever.")
        try:
            with _world.inside_nitro():  # the cell runs none of its statements: the run's traces are settled
                finished = self._done.wait(timeout)
        except KeyboardInterrupt:
            self.stop("interrupted (Ctrl-C in `run.wait()`)")
            self._done.wait()
            self._show_messages()
            raise self._control.interrupted() from None
        if finished:
            self._released.wait()  # its worker has let go of it: dropping the run and handle frees them
        else:
            raise TimeoutError(
                f"the run is still training after {timeout} s ({self.where()}); call `run.wait()` again, "
                f"or `run.stop()` to end it at the next step."
            )
        self._show_messages()
        if self.error is not None:
            raise self.error
        return list(self._result)

    def _show_messages(self):
        pending, self._shown = self.messages[self._shown:], len(self.messages)
        for msg in pending:
            try:
                _report.sink()(msg)
            except Exception:  # noqa: BLE001 - a front end glitch must not hide the run's result
                _report.print_sink(msg)

    # ---------------------------------------------------------------- state
    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def running(self) -> bool:
        return not self._done.is_set()

    @property
    def status(self) -> str:
        """`"running"`, `"stopped"` (by `stop()` or early stopping), `"finished"` or `"failed"`."""
        if not self.done:
            return "running"
        if self.error is not None:
            return "failed"
        rows = self._result or []
        if self._control.stop_reason is not None or (rows and rows[-1].get("stopped")):
            return "stopped"
        return "finished"

    @property
    def rows(self) -> list[dict]:
        """The epoch rows completed so far."""
        return list(self._control.rows)

    def where(self) -> str:
        """Where the run is (or ended): `epoch 2, step 13/40`."""
        return self._control.where()

    def __repr__(self):
        status = self.status
        c = self._control
        rows = f"{len(c.rows)}/{self.epochs} epochs done"
        if status == "running":
            what = f"training at {c.where()}, {rows}"
        elif status == "failed":
            what = f"failed at {c.where()}: {type(self.error).__name__}: {self.error}"
        elif status == "stopped":
            reason = c.stop_reason or (c.rows[-1].get("stopped") if c.rows else None)
            what = f"stopped ({reason}), {rows}; `run.wait()` returns them"
        else:
            what = f"finished, {rows}; `run.wait()` returns them"
        last = f"; last message: {self.messages[-1].text}" if self.messages and status == "running" else ""
        return f"<nitro_ipy run of {self._name()}: {what}, step {self.handle.step}{last}>"


def _dependencies(entry) -> dict:
    closure = entry.closure
    if closure is None:
        return {}
    return {d.qualified: d.fingerprint for d in (*closure.functions, *closure.values)
            if getattr(d, "fingerprint", None) is not None}


def mixed_code(new, earlier) -> tuple[tuple, tuple]:
    """The dependencies `new` traced with another fingerprint than an `earlier` entry did, and the kinds
    of those earlier entries: `((names...), (kinds...))`, both empty when all agree."""
    mine = _dependencies(new)
    names, others = {}, {}
    for entry in earlier:
        for name, fp in _dependencies(entry).items():
            if name in mine and mine[name] != fp:
                names[name] = others[entry.kind] = None
    return tuple(names), tuple(others)


class _Workers:
    """Worker threads kept for the next background run once theirs ends.

    A thread's first few hundred JAX dispatches are slower than a warm thread's (measured: a fresh
    thread's 400-step loop of a tiny `jax.jit` at 1.03-1.09x of the main thread's, a reused one at
    0.97-1.01x), so a run on a new thread each time pays that on every short epoch. An idle worker waits
    on its own queue, holding nothing of the run it ran (no frame keeps a handle alive); a run that finds
    none idle starts one, so runs of different handles still train side by side.
    """

    def __init__(self):
        self._idle: list[tuple[threading.Thread, queue.SimpleQueue]] = []
        self._lock = threading.Lock()

    def submit(self, name: str, fn, released: threading.Event) -> None:
        """Run `fn()` on an idle worker (named `name` meanwhile), or on a new one.
        `released` is set once the worker has let go of `fn` (and so of what it is bound to)."""
        with self._lock:
            while self._idle:
                thread, jobs = self._idle.pop()
                if thread.is_alive():  # a fork leaves the entry and not the thread
                    break
            else:
                thread, jobs = None, queue.SimpleQueue()
        if thread is None:
            thread = threading.Thread(target=self._serve, args=(jobs,), name=name, daemon=True)
            thread.start()
        thread.name = name
        jobs.put((fn, released))

    def _serve(self, jobs: queue.SimpleQueue):
        me = threading.current_thread()
        while True:
            fn, released = jobs.get()
            try:
                fn()  # `Run._main` keeps what it raises for `wait()`
            finally:
                del fn  # the idle worker must not hold the run, nor through it the handle
                released.set()
            me.name = "nitro_ipy run (idle)"
            with self._lock:
                self._idle.append((me, jobs))


_workers = _Workers()


def start(handle, control: RunControl, work, epochs: int) -> Run:
    """Start `work()` (the epoch loop) in a worker thread; returns its `Run` at once."""
    return Run(handle, control, work, epochs)._start()


@atexit.register
def stop_live_runs(reason: str = "the interpreter is exiting"):
    """Stop every background run at its next step and wait (30 s each) for it to end. At exit: a daemon
    thread killed inside an XLA call can crash the process."""
    for run in list(_live):
        run.stop(reason)
    for run in list(_live):
        run._done.wait(30)


def check_idle(handle, what: str) -> None:
    """Refuse `what` (an entry point) on a handle that trains in the background, with the fix."""
    run = getattr(handle, "_run", None)
    if run is not None and run.running and threading.current_thread() is not run._thread:
        raise HandleBusyError(
            f"`{what}` on a handle that is training in the background ({run._control.where()}): both "
            f"would use its parameters. Wait for the run, `run.wait()`, or stop it at the next step, "
            f"`run.stop(); run.wait()`, then call `{what}` again. (`n.set(...)` and reading `n.history` "
            f"work meanwhile.)"
        )


# -------------------------------------------------------------------- n.set
def set_fields(handle, values: dict) -> None:
    """`n.set(**values)`: new values for Device (and Host) fields of a live handle, with no recompile.

    A Device value is coerced to the field's dtype and shape (a scalar broadcasts) and is what the next
    step traces with; a Host value replaces the field on `n.experiment` (compiled code never reads it; a
    `rebuild()` carries it, and re-runs a `data(self)` hook with it). A GraphConst field is refused: a new
    value means new programs. All values are checked before any is set.
    """
    b = handle._binding
    kinds = field_kinds(b.cls)
    device, host = {}, {}
    for name, value in values.items():
        kind = kinds.get(name)
        if kind is None:
            listing = "; ".join(
                f"{k}: {', '.join(f'`{n}`' for n, kk in kinds.items() if kk == k)}"
                for k in ("Device", "Host", "GraphConst") if k in kinds.values()
            )
            raise NitroValueError(f"`{type(b.experiment).__name__}` has no field `{name}` ({listing}).")
        if kind == "GraphConst":
            raise NitroTypeError(
                f"`{name}` is a GraphConst field: it is baked into the compiled programs, so a live handle "
                f"cannot change it. Make a new experiment and a handle on it, "
                f"`Nitro(dataclasses.replace(n.experiment, {name}={short_repr(value)}), ...)`, or edit the "
                f"class default and `n = n.rebuild()`. To sweep it without recompiling, mark it `Device`."
            )
        if kind == "Device":
            if name in b.schedules:
                raise NitroValueError(
                    f"`{name}` follows its schedule (`schedules={{'{name}': ...}}`), which sets it before every "
                    f"step; a value set now would last one step. Change the schedule: a new handle with "
                    f"`schedules=`."
                )
            device[name] = _coerce(b, name, value)
        else:
            host[name] = value
    experiment = copy.copy(handle.experiment)  # the user's object (and other handles on it) stay as they were
    for name, value in {**device, **host}.items():
        object.__setattr__(experiment, name, values[name])  # works on frozen dataclasses too
    for name, arr in device.items():
        b.device_host[name] = arr  # what host metric hooks and a rebuild's optimizer init see
        # The programs read this dict at every step; on a mesh the value is replicated like the others.
        handle._dev[name] = handle._place.replicate(jax.device_put(arr))
    handle.experiment = experiment


def _coerce(b, name: str, value) -> np.ndarray:
    return device_value(value, b.device_host[name], b.source(name, "set"))


# -------------------------------------------------------------------- early stopping
@dataclasses.dataclass
class EarlyStop:
    """`stop_when=(metric, "min" | "max", patience)`: stop when `metric` of the epoch rows has not
    improved for `patience` epochs. Counted per `train()` call."""

    metric: str
    mode: str
    patience: int
    best: float | None = None
    best_epoch: int = 0
    bad: int = 0

    def fresh(self) -> "EarlyStop":
        return EarlyStop(self.metric, self.mode, self.patience)

    def update(self, row: dict) -> str | None:
        """Fold in an epoch's row; the reason to stop, or None."""
        if self.metric not in row:
            raise NitroValueError(
                f"`stop_when` watches `{self.metric}`, which the epoch rows do not have (they have "
                f"{', '.join(f'`{k}`' for k in row)}). Name one of those."
            )
        value = row[self.metric]
        if np.ndim(value) != 0:
            raise NitroValueError(
                f"`stop_when` watches `{self.metric}`, which is an array of shape {np.shape(value)}, not a "
                f"number; watch a scalar metric."
            )
        value = float(value)
        better = self.best is None or (value < self.best if self.mode == "min" else value > self.best)
        if better:
            self.best, self.best_epoch, self.bad = value, row["epoch"], 0
            return None
        self.bad += 1
        if self.bad < self.patience:
            return None
        epochs = f"{self.patience} epoch{'s' if self.patience != 1 else ''}"
        best = "none finite" if self.best is None else f"best {self.best:.4g} at epoch {self.best_epoch}"
        return f"{self.metric} did not improve for {epochs} ({best})"


def early_stop(rule, splits: dict) -> EarlyStop | None:
    """`stop_when=` checked at setup: the shape of the rule, and a `valid_` metric needs a valid split."""
    if rule is None:
        return None
    usage = "`stop_when=(metric, \"min\" | \"max\", patience)`, e.g. `stop_when=(\"valid_loss\", \"min\", 3)`"
    if not isinstance(rule, (tuple, list)) or len(rule) != 3:
        raise NitroValueError(f"{usage}; got {short_repr(rule)}.")
    metric, mode, patience = rule
    if not isinstance(metric, str):
        raise NitroValueError(f"{usage}; the metric must be a row name such as `valid_loss`, got {metric!r}.")
    if mode not in ("min", "max"):
        raise NitroValueError(f"{usage}; the mode must be \"min\" or \"max\", got {mode!r}.")
    if not isinstance(patience, (int, np.integer)) or isinstance(patience, bool) or patience < 1:
        raise NitroValueError(f"{usage}; the patience must be a positive integer of epochs, got {patience!r}.")
    if metric.startswith("valid_") and "valid" not in splits:
        have = ", ".join(f"`{k}`" for k in splits) or "none"
        raise NitroValueError(
            f"`stop_when` watches `{metric}`, a validation metric, but this handle has no `valid` split "
            f"(splits: {have}). Pass one, `data={{\"valid\": ...}}`, or watch the training `loss`."
        )
    return EarlyStop(metric, mode, int(patience))


# -------------------------------------------------------------------- n.history
class History(list):
    """`n.history`: a list of epoch rows (dicts), and `table()`."""

    def table(self):
        """The rows as a table: a pandas `DataFrame` when pandas is importable, else a `HistoryTable`
        (plain text in a terminal, HTML in a notebook)."""
        try:
            import pandas  # optional, and heavy: only when a table is asked for
        except ImportError:
            return HistoryTable(list(self))
        return pandas.DataFrame(list(self))


class HistoryTable:
    """The epoch rows as a plain table: `columns`, `rows` (the dicts); text repr and HTML repr."""

    def __init__(self, rows: list[dict]):
        self.rows = rows
        self.columns = list(dict.fromkeys(k for row in rows for k in row))

    def cells(self) -> list[list[str]]:
        """Each row's cells as text, in column order ("" where a row lacks a column)."""
        return [[_cell(row[c]) if c in row else "" for c in self.columns] for row in self.rows]

    def __repr__(self):
        cells = self.cells()
        if not self.columns:
            return "(no epochs yet)"
        widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(self.columns)]
        line = lambda items: "  ".join(s.ljust(w) for s, w in zip(items, widths)).rstrip()
        return "\n".join([line(self.columns)] + [line(r) for r in cells])

    def _repr_html_(self):
        head = "".join(f"<th style='text-align:left'>{html.escape(c)}</th>" for c in self.columns)
        body = "".join(
            "<tr>" + "".join(f"<td style='text-align:left'>{html.escape(v)}</td>" for v in r) + "</tr>"
            for r in self.cells()
        )
        return f"<table class='nitro-history'><tr>{head}</tr>{body}</table>"


def _cell(value) -> str:
    if isinstance(value, (float, np.floating)):
        return f"{value:.4g}"
    if isinstance(value, np.ndarray) and value.ndim:
        return f"array{list(value.shape)}"
    return str(value)
