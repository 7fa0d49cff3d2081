"""The notebook front end: nitro_ipy's messages, their buttons and the progress display (the live panel is `_panel`).

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

from .._base import _html, _report
from .._base._report import Kind
from .._training._runs import TrainingInterrupted

try:  # the server extension's marker (a package apart: the Jupyter server must not import JAX)
    from nitro_ipy_server import MARK
except ImportError:  # nitro_ipy on a path without its sibling: the same key, said here
    MARK = "nitro_ipy"

# How each kind looks is the reporter's (`_report.LOOKS`, drawn by `_html.message_html`); this module
# decides only where an output goes.
# The kinds after which the panel's figures may have moved (a disk edit changes none of them).
REFRESH_ON = frozenset({Kind.COMPILE, Kind.EPOCH, Kind.RECOMPILE_LOOP, Kind.STALE_CACHE, Kind.STALE_HANDLE})

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


def kernel_loop():
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
        self.panel = None  # the `_panel.Panel` `%nitro_panel` made, if any
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
        loop = kernel_loop()
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
