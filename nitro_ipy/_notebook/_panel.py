"""The live panel (`%nitro_panel`): hits, misses, entries and poisoned as chips, the loss chart, the latest
compile with its reason, and a **Stop** button while a background run is active.

Split from `_widgets` (the messages and buttons it reuses); like it, imported only by the extension in a
kernel that can show widgets, and run on the kernel's main thread only.
"""

import threading
import time
import weakref

from .._base import _events, _html, _report
from .._base._report import Kind
from .._compiler import _cache
from .._training import _progress
from ._widgets import (
    REFRESH_ON,
    SAVED_STOP,
    STOP,
    ActionButton,
    Rich,
    kernel_loop,
    show,
)


def _run_over(run) -> bool:
    done = getattr(run, "done", None)
    if callable(done):
        done = done()
    if done is None:
        thread = getattr(run, "thread", None)
        done = thread is not None and not thread.is_alive()
    return bool(done)


def _run_what(run) -> str:
    """A background run in a few words, for its Stop button's saved form: `` of `Regressor` (3 epochs)``."""
    experiment = getattr(getattr(run, "handle", None), "experiment", None)
    epochs = getattr(run, "epochs", None)
    what = f" of `{type(experiment).__qualname__}`" if experiment is not None else ""
    return what + (f" ({epochs} epoch{'s' if epochs != 1 else ''})" if isinstance(epochs, int) else "")


# What the panel adds to the latest compile while it is a program compiled in the background that no
# handle took yet: its miss is counted, its compile line is said by the handle that takes it.
AHEAD_NOTE = "compiled in the background, not taken yet"


class Panel:
    """The live panel: hits, misses, entries and poisoned as chips that wrap, a warning chip when
    something is stale, the loss chart, the latest compile with its reason in a `<details>`, and a
    **Stop** button while a background run is active.

    Three display outputs, each updated in place only when its content changed: the figures and chart,
    the latest compile (apart, so an opened `<details>` stays open while the chart moves), and the Stop
    slot. Fed by the cache's "compile", "reset", "progress" and "run" events, the message sink, and a
    flush after every cell; refreshes are throttled to one per `min_interval` seconds, and one asked for
    sooner (or off the main thread) is deferred to the next event, the flush, or the kernel's event loop.
    """

    def __init__(self, min_interval: float = 0.25):
        """`min_interval`: the fewest seconds between two refreshes sent to the front end."""
        self.min_interval = min_interval
        live = _cache.live_entries()
        self.latest_entry = live[-1] if live else None  # entries are kept in compile order
        self.latest_ahead = bool(getattr(self.latest_entry, "untaken", False))  # compiled ahead, not taken yet
        self.loop = None  # the last recompile-loop message: a warning chip until the next reset
        self._run = None  # weakly, the background run the Stop button stops (`run`)
        self.stop_button: ActionButton | None = None
        self.refreshes = 0  # how many refreshes sent something: the throttle is tested by counting these
        self._last = 0.0
        self._dirty = False
        self._scheduled = False
        self._unsubscribe = []  # one function per cache subscription; empty while detached
        self._displays = []  # [(main, compile, stop) display handles] per place the panel is shown
        self._sent = (None, None)

    # -- wiring
    def attach(self) -> None:
        """Subscribe to the cache's events (idempotent)."""
        if not self._unsubscribe:
            self._unsubscribe = [_events.subscribe("compile", self.on_compile),
                                 _events.subscribe("ahead", self.on_ahead),
                                 _events.subscribe("reset", self.on_reset),
                                 _events.subscribe("progress", self.on_progress),
                                 _events.subscribe("run", self.on_run)]

    def detach(self) -> None:
        """Unsubscribe from the cache: the panel stops updating (its outputs stay as they are)."""
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe = []

    def close(self) -> None:
        """Detach; a shown Stop button is retired."""
        self.detach()
        if self.stop_button is not None:
            self.stop_button.retire("the panel was closed")

    def show(self) -> None:
        """Display the panel (again: every place it is shown updates alike)."""
        main, latest = self.outputs()
        self._sent = (main.html, latest.html)
        handles = (show(main), show(latest), show(Rich("", "")))
        self._displays.append(handles)
        if self.run is not None and self.stop_button is not None and self.stop_button.state == "ready":
            show(self.stop_button, handles[2])

    # -- subscribers and the sink's notice (each must never raise into the step loop or the cache)
    def on_compile(self, entry) -> None:
        self.latest_entry, self.latest_ahead = entry, False
        self._safely(self.refresh)

    def on_ahead(self, entry) -> None:
        """A program compiled in the background: its miss is counted now, its line comes when a handle
        takes it; until then the panel shows it as the latest compile, marked as the background's."""
        self.latest_entry, self.latest_ahead = entry, True
        self._safely(self.refresh)

    def on_reset(self) -> None:
        self.latest_entry, self.loop = None, None
        self._safely(self.refresh, force=True)

    def on_progress(self) -> None:
        self._safely(self.refresh)

    def on_run(self, run) -> None:
        """A background run started (or ended): show its Stop button while it is active."""
        self._safely(self._set_run, run=run)

    def on_message(self, msg: _report.Message) -> None:
        if msg.kind == Kind.RECOMPILE_LOOP:
            self.loop = msg
        if msg.kind in REFRESH_ON:
            self.refresh()

    # The panel keeps figures, never a handle: the run (which holds its handle) is held weakly, so a
    # finished run the user dropped, and its handle, go at once (the worker holds a running one).
    @property
    def run(self):
        """The background run the Stop button stops, while something else keeps it (None after)."""
        return None if self._run is None else self._run()

    @run.setter
    def run(self, run) -> None:
        self._run = None if run is None else weakref.ref(run)

    def _set_run(self, run) -> None:
        if threading.current_thread() is not threading.main_thread():
            self._dirty = True
            self._schedule()
            self._pending_run = weakref.ref(run)
            return
        if run is not self.run and not _run_over(run):
            if self.stop_button is not None:
                self.stop_button.retire("replaced by a newer run")
            self.run = run
            self.stop_button = ActionButton(STOP, "stop the background run at the next step boundary",
                                            "danger", "stop", self._stop, SAVED_STOP.format(what=_run_what(run)),
                                            kind="stop")
            for handles in self._displays:
                self.stop_button.show(handles[2])
        self.refresh(force=True)

    def _stop(self) -> str:
        run = self.run
        if run is None:
            return "nothing to stop: the run has ended"
        run.stop()
        return "stop asked: the run ends at the next step boundary, nothing lost"

    def flush(self) -> None:
        """Send any deferred refresh now (after each cell, so the panel ends every cell exact)."""
        pending = self.__dict__.pop("_pending_run", lambda: None)()
        if pending is not None:
            self._set_run(pending)
        if self._dirty:
            self.refresh(force=True)

    def _safely(self, fn, **kwargs):
        try:
            fn(**kwargs)
        except Exception as err:  # noqa: BLE001 - a panel glitch must not break training
            print(f"nitro_ipy: the panel failed to update ({type(err).__name__}: {err})")

    def _schedule(self) -> None:
        """Off the main thread (a background run): flush on the kernel's event loop, once."""
        if self._scheduled:
            return
        loop = kernel_loop()
        if loop is not None:
            self._scheduled = True
            loop.add_callback(self._scheduled_flush)

    def _scheduled_flush(self) -> None:
        self._scheduled = False
        self._safely(self.flush)
        if self.run is not None and not _run_over(self.run):
            self._dirty = True  # keep drawing while the run is active: the loop calls back, throttled
            loop = kernel_loop()
            if loop is not None and not self._scheduled:
                self._scheduled = True
                loop.call_later(self.min_interval, self._scheduled_flush)

    # -- state
    def figures(self) -> dict:
        """What the panel shows now, as plain text: `{label: value}`."""
        hits, misses, entries = _cache.cache_stats()
        e = self.latest_entry
        if e is None:
            latest = "none yet"
        else:
            why = f" ({_html.summarise_why(e.why)})" if e.why else ""
            latest = f"{e.kind} [{', '.join(e.hook_names)}] in {e.trace_s + e.compile_s:.2f} s{why}"
            if self.latest_ahead:
                latest += ", " + AHEAD_NOTE
        return {"hits": str(hits), "misses": str(misses), "entries": str(entries),
                "poisoned": str(len(_cache.poisoned_entries())), "latest compile": latest}

    def warnings(self) -> list[str]:
        """The warning chips: a recompile loop; programs poisoned by an edit."""
        out = []
        if self.loop is not None:
            out.append(f"recompile loop in `{self.loop.data.get('program', '?')}`")
        poisoned = len(_cache.poisoned_entries())
        if poisoned:
            out.append(f"stale: {poisoned} program{'s' if poisoned != 1 else ''} compiled before an edit")
        return out

    def text(self) -> str:
        """The panel as one plain-text line (its `text/plain` form)."""
        f = self.figures()
        return (f"nitro_ipy panel: hits {f['hits']} | misses {f['misses']} | entries {f['entries']} | "
                f"poisoned {f['poisoned']} | latest compile: {f['latest compile']}")

    def chart(self) -> _html.LossChart | None:
        p = _progress.latest()
        if p is None:
            return None
        # The handle's whole run: its curve and validation points over every train() call, the x axis up
        # to the epoch the data reached (a `train(100000, background=True)` stopped early ends there).
        return _html.LossChart(p.train_points, p.valid_points)

    def outputs(self) -> tuple:
        """The panel's two outputs now: (figures + chart, latest compile)."""
        f = self.figures()
        chips = "".join(_html.chip(f"{k} {f[k]}") for k in ("hits", "misses", "entries", "poisoned"))
        chips += "".join(_html.chip(w, "warning") for w in self.warnings())
        chart = self.chart()
        svg = chart.svg() if chart is not None else ""
        run = ""
        if self.run is not None and not _run_over(self.run):
            run = _html.chip("background run active", "info")
        main_html = _html.box(
            "<div style='font-weight: 600'>nitro_ipy</div>"
            f"<div class='nitro-figures' style='display: flex; flex-wrap: wrap; align-items: center'>{chips}{run}</div>"
            + (f"<div class='nitro-chart-box' style='margin-top: 4px'>{svg}</div>" if svg else ""),
            "warning" if self.warnings() else "plain", "nitro-panel")
        text = self.text()
        if chart is not None:
            text += "\n" + repr(chart)
        e = self.latest_entry
        if e is None:
            latest_html = _html.box(f"latest compile: {_html.esc(f['latest compile'])}", "plain", "nitro-latest")
        else:
            head = f"latest compile: {e.kind} [{', '.join(e.hook_names)}] in {e.trace_s + e.compile_s:.2f} s"
            if self.latest_ahead:
                head += ", " + AHEAD_NOTE
            why = _html.why_html(e.why) if e.why else "first compile of this program"
            latest_html = _html.box(
                f"<details><summary>{_html.code_html(head)}</summary>"
                f"<div>why: {why}</div>"
                f"<div>trace {e.trace_s:.2f} s, XLA {e.compile_s:.2f} s</div></details>", "plain", "nitro-latest")
        return Rich(main_html, text), Rich(latest_html, f"latest compile: {f['latest compile']}")

    def refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if threading.current_thread() is not threading.main_thread():
            self._dirty = True
            self._schedule()
            return
        if not force and now - self._last < self.min_interval:
            self._dirty = True
            return
        self._last, self._dirty = now, False
        run = self.run
        if self.stop_button is not None and self._run is not None and (run is None or _run_over(run)):
            self.stop_button.retire(self._run_line())  # ended, or dropped once it ended
            self.run = None
        main, latest = self.outputs()
        sent = (main.html, latest.html)
        if sent == self._sent:
            return
        for handles in self._displays:
            if main.html != self._sent[0]:
                show(main, handles[0])
            if latest.html != self._sent[1]:
                show(latest, handles[1])
        self._sent = sent
        self.refreshes += 1

    def _run_line(self) -> str:
        line = getattr(self.run, "summary", None) or getattr(self.run, "where", None)
        line = line() if callable(line) else line
        return f"background run ended: {line}" if line else "background run ended"

    def _repr_mimebundle_(self, include=None, exclude=None):
        main, _ = self.outputs()
        return main._repr_mimebundle_()

    def __repr__(self):
        return self.text()
