"""The notebook front end: nitro_ipy's messages, the progress display and the live panel.

Imported only by the extension, and only in a kernel that can show widgets: the core never imports it.

Everything is rich HTML output (`_html`) shown through display handles and updated in place, so the
notebook saves each output's final state as `text/html` + `text/plain`: a reload, a reopen on a fresh
kernel, nbconvert and GitHub all show it, and no saved output needs a widget model. Only what needs a
click is a widget (the **Rebuild handle** button, the panel's **Stop** button), displayed on its own and
replaced by its HTML outcome once clicked or no longer needed (ipywidgets' views of a model that is not in
the kernel any more read "Error displaying widget: model not found"; JupyterLab never falls back to the
other mime types of such an output).

Everything here runs on the kernel's main thread; a call from any other thread degrades to plain text
(messages) or to a refresh scheduled on the kernel's event loop (the panel), so a worker thread never
touches a display or a widget.
"""

import re
import threading
import time
import weakref

import ipywidgets as widgets
from IPython.display import display

from .._base import _events, _html, _report
from .._base._report import Kind
from .._compiler import _cache
from .._training import _progress
from .._training._runs import TrainingInterrupted

try:  # the server extension's marker (a package apart: the Jupyter server must not import JAX)
    from nitro_ipy_server import MARK
except ImportError:  # nitro_ipy on a path without its sibling: the same key, said here
    MARK = "nitro_ipy"

# How each kind looks is the reporter's (`_report.LOOKS`, drawn by `_html.message_html`); this module
# decides only where an output goes.
# The kinds after which the panel's figures may have moved (a disk edit changes none of them).
_REFRESH_ON = frozenset({Kind.COMPILE, Kind.EPOCH, Kind.RECOMPILE_LOOP, Kind.STALE_CACHE, Kind.STALE_HANDLE})

REBUILD = "Rebuild handle"
STOP = "Stop"
RETIRED_NO_NAME = "no longer needed: no name holds that handle any more (it was rebuilt or dropped)"
RETIRED_MOVED_ON = "not clicked before the next cell ran; to use the current code: `{name} = {name}.rebuild()`"
# What a live button's output says in a notebook saved while it could still be clicked (the server
# extension `nitro_ipy_server` writes this static form to disk instead of the widget view).
SAVED_REBUILD = "not clicked when the notebook was saved; to use the current code: `{name} = {name}.rebuild()`"
SAVED_STOP = ("live when the notebook was saved: a background run{what} was training; the panel above "
              "shows how far it had got, its Stop button stops it only in the kernel that ran it")


class Rich:
    """A static output: HTML for notebooks, its plain-text lines for everything else."""

    def __init__(self, html: str, text: str):
        self.html, self.text = html, text

    def _repr_mimebundle_(self, include=None, exclude=None):
        return {"text/plain": self.text, "text/html": self.html}

    def __repr__(self):
        return self.text


def show(obj, handle=None):
    """Display `obj` (anything with `_repr_mimebundle_`, which may return `(data, metadata)`) as a new
    output with a display id, or into `handle`'s output; returns the handle. The bundle is published raw:
    IPython's formatters (a few hundred microseconds a call) have nothing to find that the bundle does not
    already say."""
    bundle, metadata = obj._repr_mimebundle_(), None
    if isinstance(bundle, tuple):
        bundle, metadata = bundle
    if handle is None:
        return display(bundle, raw=True, metadata=metadata, display_id=True)
    handle.update(bundle, raw=True, metadata=metadata)
    return handle


message_html = _html.message_html  # one look per kind, whoever shows it


def message_output(msg: _report.Message) -> Rich:
    return Rich(message_html(msg), msg.text)


def _kernel_loop():
    """The kernel's event loop (tornado's, whose `add_callback` is thread-safe), or None."""
    try:
        from ipykernel.kernelbase import (
            Kernel,  # lazily: IPython in a terminal runs without ipykernel
        )

        return Kernel.instance().io_loop if Kernel.initialized() else None
    except Exception:  # noqa: BLE001 - no kernel, or one without an io_loop: no scheduling
        return None


# ------------------------------------------------------------------------------------------------ buttons
def rebind_names(user_ns: dict, obj) -> list[str]:
    """The user's names bound to `obj`, leaving out IPython's output-history names.

    **Arguments:**

    - `user_ns`: the namespace to search.
    - `obj`: the object, compared by identity.

    **Returns:** the names, in the namespace's order.
    """
    history = re.compile(r"_+|_\d+|_i\d*|_ii+")  # IPython's own names for recent outputs
    return [k for k, v in list(user_ns.items()) if v is obj and not history.fullmatch(k)]


class ActionButton:
    """A widget button shown in its own output, replaced by HTML saying what it did once it has acted or
    is retired: the saved notebook then holds that HTML, not a widget view.

    While it is ready, its output also carries the static form `saved()` (what it was when the notebook
    was saved) as `text/html` + `text/plain`, and the output metadata `{"nitro_ipy": {"live": kind}}`:
    the server extension (`nitro_ipy_server`) then saves that form instead of the widget view, which a
    reopen on a fresh kernel could not draw. `state` is "ready", then "done", "failed" or "retired";
    `result` the line the output ends with.
    """

    def __init__(self, description: str, tooltip: str, style: str, icon: str, action, saved: str = "",
                 kind: str = "action"):
        self.action = action
        self.kind = kind  # the `live` mark of its output
        self.saved_line = saved or f"{description}: not clicked when the notebook was saved"
        self.state, self.result = "ready", ""
        self.widget = widgets.Button(description=description, button_style=style, icon=icon, tooltip=tooltip)
        self.widget.on_click(self.click)
        self.handle = None

    def show(self, handle=None):
        """Display the button (into `handle`'s output when given, else as a new output)."""
        self.handle = show(self, handle)
        return self.handle

    def _repr_mimebundle_(self, include=None, exclude=None):
        if self.state != "ready":
            return self.final()._repr_mimebundle_()
        bundle = dict(self.widget._repr_mimebundle_(include=include, exclude=exclude) or {})
        bundle.update(self.saved()._repr_mimebundle_())  # under the widget view: what the file keeps
        return bundle, {MARK: {"live": self.kind}}

    def saved(self) -> Rich:
        """The static form of the button still waiting for its click: what a notebook saved now keeps."""
        line = self.saved_line
        return Rich(_html.box(_html.code_html(line), "plain", "nitro-action nitro-saved-live"), line)

    def final(self) -> Rich:
        tone = {"done": "success", "failed": "error"}.get(self.state, "plain")
        return Rich(_html.box(_html.code_html(self.result), tone, f"nitro-action nitro-{self.state}"), self.result)

    def click(self, _button=None):
        # A comm callback: an exception here would only reach the kernel log, so the output shows it.
        try:
            self.result = self.action()
            self.state = "done"
        except Exception as err:  # noqa: BLE001 - shown to the user, never raised into the kernel
            self.state, self.result = "failed", f"failed: {type(err).__name__}: {err}"
        self.end()

    def retire(self, why: str):
        if self.state == "ready":
            self.state, self.result = "retired", why
            self.end()

    def end(self):
        if self.handle is not None:
            show(self.final(), self.handle)
        for model in (self.widget.layout, self.widget.style, self.widget):  # the button's parts are models too
            model.close()


class RebuildButton(ActionButton):
    """**Rebuild handle** under a stale-handle message: rebuilds the handle and points every name in the
    user namespace that held it at the new one."""

    def __init__(self, handle, user_ns: dict):
        # Weak: the notebook may show the button long after; the stale handle's device memory must not
        # live that long.
        self._handle = weakref.ref(handle)
        self.user_ns = user_ns
        names = self.names()
        super().__init__(REBUILD, "n.rebuild(), then point every name that held this handle at the new one",
                         "warning", "refresh", self.rebuild, SAVED_REBUILD.format(name=names[0] if names else "n"),
                         kind="rebuild")

    def names(self) -> list[str]:
        old = self._handle()
        return rebind_names(self.user_ns, old) if old is not None else []

    def rebuild(self) -> str:
        """Rebuild the stale handle and rebind its names; returns the line the output ends with."""
        names = self.names()
        if not names:
            return ("nothing rebuilt: no name in the namespace holds this handle any more; run "
                    "`n = n.rebuild()` on the handle you mean.")
        new = self._handle().rebuild()
        for name in names:
            self.user_ns[name] = new
        return f"rebuilt: {', '.join(names)} -> new handle"


# ------------------------------------------------------------------------------------------------ progress
def _kept(msg: _report.Message) -> _report.Message:
    """`msg` as an output keeps it to redraw: its plain facts only. A compile entry or a handle in its
    data would keep a program (and a poisoned one could then be revived) or a model alive for as long as
    the notebook shows the line."""
    plain = {k: v for k, v in msg.data.items() if isinstance(v, (str, int, float, bool, tuple))}
    return msg._replace(data=plain)


class Block:
    """One output of a cell holding the messages said in it, in order, each drawn in its kind's look
    (`_html.messages_html`): quiet lines in one block, boxes between. Shown on its first message,
    updated in place by each next one; its `text/plain` is what a terminal printed."""

    def __init__(self, cell=None):
        self.cell = cell  # the cell it belongs to (the shell's execution count)
        self.messages: list = []
        self.handle = None
        self.updates = 0  # display updates sent: tests count them

    @property
    def lines(self) -> list[str]:
        return [m.text for m in self.messages]

    def add(self, msg: _report.Message) -> None:
        self.messages.append(_kept(msg))
        self.draw()

    def draw(self) -> None:
        if self.handle is None:
            self.handle = show(self.output())
        else:
            self.updates += 1
            show(self.output(), self.handle)

    def text(self) -> str:
        return "\n".join(self.lines)

    def output(self) -> Rich:
        return Rich(f"<div class='nitro-block'>{_html.messages_html(self.messages)}</div>", self.text())


class NotebookFront(Block):
    """The notebook front end of `_progress.Progress`: one output per `train()` call holding the messages
    said while it runs (compiles, epochs, warnings: from its first step's compile lines on) above the
    progress line, updated at sync points. Its final form is those messages, and the line saying where
    it stopped when it stopped early: what a terminal printed."""

    def __init__(self, min_interval: float = 0.25):
        super().__init__()
        self.progress = None
        self.min_interval = min_interval
        self.stop_text = None  # the line a stop said, once the call ended with one
        self._last = 0.0

    # -- `_progress` front-end interface
    def begin_epoch(self, p):
        self.progress = p
        if self.handle is None:
            self.handle = show(self.output())
            self._last = time.monotonic()
        else:
            self.update(p)

    def update(self, p=None, force: bool = False):
        """Redraw, at most once per `min_interval` seconds unless `force` (an epoch end, the close)."""
        now = time.monotonic()
        if self.handle is not None and (force or now - self._last >= self.min_interval):
            self._last = now
            self.updates += 1
            show(self.output(), self.handle)

    def end_epoch(self, p):
        if p.epoch < p.last:  # after the last one, `close` draws the final form
            self.update(p, force=True)

    def close(self, p):
        self.progress = p
        if self.handle is None and (p.status != "done" or self.messages):  # ended before its first step
            self.handle = show(self.output())
        else:
            self.update(p, force=True)
        # Its final form is drawn: it lets go of the call's progress (and through it the handle).
        self.stop_text = p.stop_message.text if p.stop_message is not None else None
        self.progress = None

    def absorb(self, msg: _report.Message) -> bool:
        """Take a message said while its `train()` call runs (shown at once when it is the first); False
        once the call has ended."""
        if self.progress is None or self.progress.status != "running":
            return False
        self.messages.append(_kept(msg))
        if self.handle is None:  # its first step's compile lines: the display opens with them
            self.handle = show(self.output())
            self._last = time.monotonic()
        elif msg.kind not in _QUIET:  # a warning is drawn at once; a quiet line at the next sync point
            self.update(force=True)
        return True

    def bind(self, p) -> None:
        """The `train()` call's progress, from its start (`_progress.start`): lines said before its
        first step is done join this display."""
        self.progress = p

    # -- rendering
    def text(self) -> str:
        p = self.progress
        lines = list(self.lines)
        if p is not None and p.status == "running" and p.epoch:
            lines.append(f"nitro_ipy: {p.line()}")
        elif p is not None and p.status not in ("running", "done"):
            lines.append(f"nitro_ipy: {p.status}")
        return "\n".join(lines)

    def output(self) -> Rich:
        p = self.progress
        body = _html.messages_html(self.messages)
        if p is not None and p.status == "running" and p.epoch:
            frac = p.fraction()
            accent = "var(--jp-brand-color1, #1976d2)"
            bar = (f"<div style='height: 4px; background: rgba(128,128,128,0.25); border-radius: 2px; "
                   f"margin-top: 4px'><div style='height: 4px; width: {100 * frac:.1f}%; background: {accent}; "
                   f"border-radius: 2px'></div></div>")
            body += _html.box(_html.esc(p.line()) + bar, "info", "nitro-progress-running")
        elif p is not None and p.status not in ("running", "done"):
            stop = p.stop_message or _report.Message(Kind.INTERRUPTED, p.status, {})
            body += _html.message_html(stop).replace(f"nitro-{stop.kind}'", f"nitro-{stop.kind} nitro-progress-stopped'", 1)
        return Rich(f"<div class='nitro-progress nitro-block'>{body}</div>", self.text())


_QUIET = frozenset(k for k, look in _report.LOOKS.items() if not look.box)


# ------------------------------------------------------------------------------------------------ sink
class RichSink:
    """The `_report` sink in a widget-capable kernel: every message is drawn in its kind's look, in the
    running `train()` call's display or in the cell's block of messages, a stale-handle one with its
    **Rebuild handle** button. A message emitted off the main thread (a background compile, a worker) is
    queued and drawn the same way by the main thread: at the next message, after the cell, or on the
    kernel's event loop. It also tells the live panel, when one is shown, that something happened.
    """

    def __init__(self, shell, previous):
        """**Arguments:**

        - `shell`: the kernel's shell, whose namespace a **Rebuild handle** button rebinds.
        - `previous`: the sink this one replaced (restored when the extension unloads).
        """
        self.shell = shell
        self.previous = previous
        self.panel: "Panel | None" = None
        self.buttons: list[RebuildButton] = []  # shown and not yet clicked or retired
        self.front: NotebookFront | None = None  # the running train() call's display
        self.block: Block | None = None  # the cell's block of messages (below the last other output)
        self.pending: list = []  # messages emitted off the main thread, not drawn yet
        self._lock = threading.Lock()
        self._scheduled = False
        self._custom_exc = None  # the shell's custom exception handler before `catch_interrupts`

    def progress_front(self):
        """A progress front end for a `train()` call (`_progress.start` asks), or None off the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return None
        self.front = NotebookFront()
        self.block = None  # what is said after the call goes below its display
        return self.front

    def __call__(self, msg: _report.Message) -> None:
        if threading.current_thread() is not threading.main_thread():
            with self._lock:  # never a display off the main thread: the main thread draws it
                self.pending.append(msg)
            self._schedule()
            return
        self.drain()
        self._draw(msg)

    def drain(self) -> None:
        """Draw the messages queued off the main thread, in the order they were emitted."""
        if threading.current_thread() is not threading.main_thread():
            return
        with self._lock:
            pending, self.pending = self.pending, []
        for msg in pending:
            self._draw(msg)

    def _schedule(self) -> None:
        loop = _kernel_loop()
        with self._lock:
            if self._scheduled or loop is None:
                return
            self._scheduled = True

        def drain():
            self._scheduled = False
            try:
                self.drain()
            except Exception as err:  # noqa: BLE001 - on the event loop: said, never raised
                print(f"nitro_ipy: a message could not be shown ({type(err).__name__}: {err})")

        loop.add_callback(drain)

    def _cell(self):
        return getattr(self.shell, "execution_count", None)

    def _draw(self, msg: _report.Message) -> None:
        handle = msg.data.get("handle") if msg.kind == Kind.STALE_HANDLE else None
        if handle is not None:  # a box with its button: outputs of their own
            show(message_output(msg))
            button = RebuildButton(handle, self.shell.user_ns)
            self.buttons = [b for b in self.buttons if b.state == "ready"] + [button]
            button.show()
            self.block = None  # what is said next goes below the button
        elif self.front is not None and self.front.absorb(msg):
            self.block = None
        else:
            if self.block is None or self.block.cell != self._cell():
                self.block = Block(self._cell())
            self.block.add(msg)
        if self.panel is not None:
            try:
                self.panel.on_message(msg)
            except Exception as err:  # noqa: BLE001 - the panel is a nicety, the message was shown
                print(f"nitro_ipy: the panel failed to update ({type(err).__name__}: {err})")

    # -- a stop, said once
    def catch_interrupts(self) -> None:
        """Show `TrainingInterrupted` raised into a cell as the reporter's line, once: the running
        `train()` display already says it (the error then adds nothing), else a box says it. The cell still
        ends in an error (a "Run All" stops there); a shell with another custom handler keeps it."""
        shell = self.shell
        if getattr(shell, "custom_exceptions", ()) or not hasattr(shell, "set_custom_exc"):
            return
        self._custom_exc = (shell.custom_exceptions, shell.CustomTB)
        sink = self

        def said_once(shell, etype, value, tb, tb_offset=None):
            sink.interrupted(value)
            shell._last_traceback = [str(value)]  # what the kernel's reply carries
            return [str(value)]

        shell.set_custom_exc((TrainingInterrupted,), said_once)

    def interrupted(self, err) -> None:
        """Show the stop `err` says, unless the display of the call it stopped said it already."""
        if self.front is not None and self.front.stop_text == str(err):
            return
        msg = getattr(err, "message", None) or _report.Message(Kind.INTERRUPTED, str(err), {})
        self.block = None if self.front is not None and self.front.handle is not None else self.block
        self._draw(msg)

    def retire(self, moved_on: bool = False) -> None:
        """After each cell: a Rebuild button whose handle no name holds any more (rebuilt by hand, or
        dropped) becomes a line saying so. Before each cell (`moved_on`): every button still shown ends as
        the line saying how to rebuild by hand.

        A button can act only between cells (a kernel runs no comm message during a cell), and it can
        only be seen as a widget while its kernel holds its model: a notebook reopened on a fresh kernel
        shows "Error displaying widget: model not found" for every widget view it saved (JupyterLab never
        falls back to an output's other mime types, and saves no widget state unless "Save Widget State
        Automatically" is on). So a button lives until the next cell runs, and the saved notebook holds
        its HTML outcome, unless it is saved with that button the latest thing shown."""
        for button in self.buttons:
            if button.state != "ready":
                continue
            names = button.names()
            if not names:
                button.retire(RETIRED_NO_NAME)
            elif moved_on:
                button.retire(RETIRED_MOVED_ON.format(name=names[0]))
        self.buttons = [b for b in self.buttons if b.state == "ready"]

    def close(self) -> None:
        """The extension is unloaded: every button still shown ends as its HTML line; messages queued off
        the main thread are drawn; the shell's custom exception handler is the one it had."""
        self.retire(moved_on=True)
        self.drain()
        if self._custom_exc is not None:
            self.shell.custom_exceptions, self.shell.CustomTB = self._custom_exc
            self._custom_exc = None


# ------------------------------------------------------------------------------------------------ panel
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
        self.latest_entry = entry
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
        if msg.kind in _REFRESH_ON:
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
        loop = _kernel_loop()
        if loop is not None:
            self._scheduled = True
            loop.add_callback(self._scheduled_flush)

    def _scheduled_flush(self) -> None:
        self._scheduled = False
        self._safely(self.flush)
        if self.run is not None and not _run_over(self.run):
            self._dirty = True  # keep drawing while the run is active: the loop calls back, throttled
            loop = _kernel_loop()
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
