"""One progress report per `train()` call: one reporter, two front ends.

`Progress` holds what a front end shows (epoch k/K, steps done, loss, step rate, the loss curve at sync
points, the validation loss per epoch) and is told only at the loop's sync points (about every 0.25 s),
never per step. The front end is chosen by the message sink: the notebook sink (`_widgets.RichSink`)
provides one that draws a single updating HTML display; otherwise `TextFront` draws a tqdm bar on a
terminal's stderr (none when stderr is not a terminal), and the epoch lines are the sink's plain text.

Core code: it imports neither IPython nor ipywidgets. Subscribers of the cache's "progress" event (the
live panel) read `latest()`.
"""

import sys
import time
import weakref

from .._base import _memo, _report
from .._base._sharding import is_main_process


class TextFront:
    """The terminal front end: a tqdm bar per epoch on stderr when it is a terminal, nothing otherwise
    (a script's log keeps only the epoch lines)."""

    def __init__(self, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.bar = None

    def begin_epoch(self, p: "Progress") -> None:
        if not getattr(self.stream, "isatty", lambda: False)():
            return
        from tqdm import (
            tqdm,  # on the first bar, not at import: scripts that show none need not pay
        )

        self.bar = tqdm(total=p.steps, desc=f"epoch {p.epoch}/{p.last}", unit="step", leave=False, initial=p.done,
                        file=self.stream, mininterval=0.25)
        _report.bar_writer = lambda text: tqdm.write(text, file=sys.stdout)  # the bar clears, the line, the bar

    def update(self, p: "Progress") -> None:
        if self.bar is not None:
            self.bar.n = p.done
            self.bar.set_postfix(loss=f"{p.loss:.4g}", refresh=False)
            self.bar.refresh()

    def end_epoch(self, p: "Progress") -> None:
        if self.bar is not None:
            _report.bar_writer = None
            self.bar.close()
            self.bar = None

    def close(self, p: "Progress") -> None:
        self.end_epoch(p)


class Progress:
    """The state of one `train()` call, as its front end shows it.

    One epoch numbering everywhere: the handle's (`n.epoch`, the rows of `n.history`), so a second
    `train(2)` after three epochs says `epoch 4/5`, and a stop says the epoch `TrainingInterrupted` says.

    **Attributes:** `epoch` (the handle's epoch running, 1-based) up to `last` (the one this call ends
    at); `epochs` (this call's count); `steps` per epoch and `done` of them (an epoch an interrupt cut
    short goes on from where it stopped); `loss` (mean over the last sync window), `rate` (steps per
    second over it); `train_points` and `valid_points` (`(epoch, loss)`, the chart's data, over the
    handle's life); `status`: "running", "done", or the line that says why it ended early, and
    `stop_message`, that line as the reporter's `Message` (None otherwise).
    """

    def __init__(self, n, epochs: int, steps: int, front, control=None):
        # The handle weakly: the module keeps the latest progress (the panel draws it), never the handle,
        # its parameters or its programs (`del n` frees them at once).
        self._n = weakref.ref(n)
        self.epochs, self.steps, self.front = epochs, steps, front
        self.control = control  # the call's `_runs.RunControl`: where a stop landed (dropped at `close`)
        self.done, self.loss, self.rate = 0, float("nan"), 0.0
        self.first_epoch = n.epoch  # epochs the handle had trained before this call (the chart's origin)
        self.epoch = n.epoch  # none running yet
        self.last = n.epoch + epochs
        # The handle keeps its curve across calls (what `Nitro.plot()` draws); this call appends to it.
        self.train_points: list = n._curve
        self.valid_points: list = [(float(r["epoch"]), r["valid_loss"]) for r in n.history
                                   if isinstance(r.get("valid_loss"), float)]
        self.records: list = []
        self.status = "running"
        self.stop_message = None
        self._start_step, self._last = n.step, (n.step, time.perf_counter())

    @property
    def n(self):
        """The handle training (alive while its `train()` runs, which holds it)."""
        return self._n()

    # -- told by the loop and the handle
    def begin_epoch(self) -> None:
        """An epoch's first step has run (its compiles were said above the display)."""
        n = self.n
        self.epoch = n.epoch + 1
        # Steps the epoch had taken before this call (an interrupted epoch goes on) count as done.
        taken = n._cursor.taken
        self._start_step = n.step - 1 - (taken if self.steps is None else min(taken, self.steps))
        self.done = n.step - self._start_step
        self._last = (n.step, time.perf_counter())
        self.front.begin_epoch(self)

    def sync(self, loss: float) -> None:
        """A sync point: `loss`, the mean finite loss of the steps since the last one."""
        now, step = time.perf_counter(), self.n.step
        last_step, last_t = self._last
        if now > last_t and step > last_step:
            self.rate = (step - last_step) / (now - last_t)
        self._last = (step, now)
        self.done = step - self._start_step
        self.loss = float(loss)
        self.train_points.append((self.epoch - 1 + (self.done / self.steps if self.steps else 0.5), self.loss))
        self.front.update(self)

    def end_epoch(self, record: dict) -> None:
        """An epoch ended (validated, when a `valid` split exists): `record` is its row of `n.history`."""
        self.records.append(record)
        if isinstance(record.get("valid_loss"), float):
            self.valid_points.append((float(record["epoch"]), record["valid_loss"]))
        self.front.end_epoch(self)

    def close(self, error: BaseException | None = None) -> None:
        """The call ended: normally, or with `error` (an interrupt, a non-finite loss, ...)."""
        if self.epoch > self.first_epoch and self.n is not None:
            self.done = self.n.step - self._start_step  # steps stored, synced or not
            self.done = self.done if self.steps is None else min(self.done, self.steps)
        if error is None:
            self.status = "done"
        elif isinstance(error, KeyboardInterrupt):
            self.stop_message = stop_message(self.control, self.n, self.steps)
            self.status = self.stop_message.text
        else:
            self.status = f"training stopped at epoch {self.n.epoch + 1}: {type(error).__name__}: {error}"
        self.control = None  # it holds the handle; the module keeps the latest progress, never a handle
        self.front.close(self)

    # -- what front ends show
    def fraction(self) -> float:
        """How much of this call's training is done, 0 to 1."""
        within = self.done / self.steps if self.steps else 0.0  # a loader not counted yet: whole epochs
        return min(max((self.epoch - self.first_epoch - 1 + within) / max(self.epochs, 1), 0.0), 1.0)

    def line(self) -> str:
        """The running line: `epoch 2/3 | step 7/10 | loss 0.2134 | 812 steps/s` (the handle's epochs)."""
        parts = [f"epoch {self.epoch}/{self.last}", f"step {self.done}/{total(self.steps)}"]
        if self.loss == self.loss:
            parts.append(f"loss {self.loss:.4g}")
        if self.rate:
            parts.append(f"{self.rate:,.0f} steps/s")
        return " | ".join(parts)


def stop_message(control, n, steps: int) -> _report.Message:
    """The one line a stop says, in the display and in `TrainingInterrupted` alike: where it landed, in
    the handle's epochs (`epoch 4, step 422/427`, or `epoch 4, validating`)."""
    if control is not None:
        return control.stop_message(control.stop_reason)
    return _report.message(_report.Kind.INTERRUPTED, where=f"epoch {n.epoch + 1}, step {n._cursor.taken}/{total(steps)}")


_latest: Progress | None = None


def _forget() -> None:
    global _latest
    _latest = None


_memo.register(_forget)  # `cache_reset()` forgets it


def latest() -> Progress | None:
    """The most recent `train()` call's progress (running or ended), or None."""
    return _latest


class QuietFront:
    """No front end: a background run draws nothing (the live panel still reads its progress)."""

    def begin_epoch(self, p):
        pass

    update = end_epoch = close = begin_epoch


def start(n, epochs: int, steps: int, quiet: bool = False, control=None) -> Progress | None:
    """The progress of a `train()` call on `n`, with the current sink's front end (none when `quiet`: a
    background run, and every process but 0 of a `jax.distributed` run), or None when the handle was built
    with `progress=False`. `control`: the call's `_runs.RunControl`, which says where a stop landed."""
    global _latest
    if not n.progress:
        return None
    quiet = quiet or not is_main_process()
    make = None if quiet else getattr(_report.sink(), "progress_front", None)
    front = QuietFront() if quiet else (make() if make is not None else None)
    _latest = Progress(n, epochs, steps, front if front is not None else TextFront(), control)
    bind = getattr(_latest.front, "bind", None)
    if bind is not None:  # the front takes the lines said before the first step is done
        bind(_latest)
    return _latest


def total(steps) -> str:
    """An epoch's step count as shown: "?" for a loader without a length, before a pass has counted it."""
    return "?" if steps is None else str(steps)
