"""The notebook front end: the live cache panel and nitro_ipy's messages as ipywidgets.

Imported only by the extension, and only in a kernel that can show widgets: the core never imports it.
Everything here runs on the kernel's main thread; a call from any other thread degrades to plain text
(messages) or to a deferred refresh (the panel), so a background thread never touches a widget.
"""

import contextlib
import html
import re
import threading
import time
import weakref

import ipywidgets as widgets
from IPython.display import display

from . import _cache, _report
from ._report import Kind

# The message kinds shown as widgets, and the box style (colour) of each. Others stay plain text lines.
STYLES = {
    Kind.STALE_CACHE: "info",  # informational: the poisoning is what makes the next handle see the edit
    Kind.STALE_HANDLE: "warning",  # the running handle holds a poisoned program: rebuild it
    Kind.DISK_EDIT: "warning",
    Kind.RECOMPILE_LOOP: "warning",
}
# The kinds after which the panel's figures may have moved (a disk edit changes none of them).
_REFRESH_ON = frozenset({Kind.COMPILE, Kind.EPOCH, Kind.RECOMPILE_LOOP, Kind.STALE_CACHE, Kind.STALE_HANDLE})
# Colours of the text/html fallback (nbconvert, a front end without the widget manager): JupyterLab's own
# info and warning colours, so the fallback looks like the widget it stands for.
_COLORS = {"info": ("#0288d1", "#e1f5fe"), "warning": ("#f57c00", "#fff3e0")}

REBUILD = "Rebuild handle"
REBUILT = "Rebuilt"
# Names IPython itself binds to recent outputs; rebinding them would rewrite history, not the user's handle.
_OUTPUT_NAMES = re.compile(r"_+|_\d+|_i\d*|_ii+")


def _code_html(text: str) -> str:
    """Escape `text`, keeping its `backticked` spans as <code>."""
    parts = html.escape(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


def message_html(msg: _report.Message) -> str:
    """A message as standalone HTML: the `text/html` fallback of its widget."""
    border, background = _COLORS[STYLES.get(msg.kind, "info")]
    return (
        f"<div class='nitro-message nitro-{msg.kind}' style='border-left: 4px solid {border}; "
        f"background: {background}; padding: 4px 8px; margin: 2px 0'>{_code_html(msg.text)}</div>"
    )


class MessageView:
    """A message as a widget: an HTML body in a box styled 'info' or 'warning'. A `Kind.STALE_HANDLE`
    message also carries the **Rebuild handle** button and an `Output` widget where the rebuild reports.

    Displayed, it carries `text/plain` (the message's own text line) and `text/html` next to the widget
    view, so a console, nbconvert or a plain-text reader gets the same words.
    """

    def __init__(self, msg: _report.Message, user_ns: dict | None = None):
        """**Arguments:**

        - `msg`: the message; its `data["handle"]`, when there is one, is what the button rebuilds.
        - `user_ns`: the namespace whose names the rebuild points at the new handle.
        """
        handle = msg.data.get("handle")
        # The widget lives as long as the notebook shows it; a strong reference would keep the stale
        # handle's parameters and optimizer state (device memory) alive that long too.
        self._handle = weakref.ref(handle) if handle is not None else None
        self.msg = msg._replace(data={k: v for k, v in msg.data.items() if k != "handle"})
        self.user_ns = user_ns if user_ns is not None else {}
        self.body = widgets.HTML(value=_code_html(msg.text))
        children = [self.body]
        self.button = self.output = None
        if msg.kind == Kind.STALE_HANDLE and handle is not None:
            self.button = widgets.Button(
                description=REBUILD,
                button_style="warning",
                icon="refresh",
                tooltip="n.rebuild(), then point every name that held this handle at the new one",
            )
            self.button.on_click(self._on_click)
            self.output = widgets.Output()
            children += [self.button, self.output]
        self.widget = widgets.VBox(children, box_style=STYLES.get(msg.kind, "info"))

    def _repr_mimebundle_(self, include=None, exclude=None):
        bundle = dict(self.widget._repr_mimebundle_(include=include, exclude=exclude) or {})
        bundle["text/plain"] = self.msg.text
        bundle["text/html"] = message_html(self.msg)
        return bundle

    def __repr__(self):
        return self.msg.text

    def _on_click(self, _button=None):
        # A comm callback: an exception here would only reach the kernel log, so report it in the widget.
        try:
            self.rebuild()
        except Exception as err:  # noqa: BLE001 - shown to the user, never raised into the kernel
            self.button.button_style = "danger"
            self.output.append_stdout(f"rebuild failed: {type(err).__name__}: {err}\n")

    def rebuild(self):
        """Rebuild the stale handle and rebind every name in the user namespace that held it.

        Returns the new handle, or None when no name held the old one (nothing is rebuilt then: the
        handle the user cares about is not the one this message was about any more).
        """
        old = self._handle()
        names = rebind_names(self.user_ns, old) if old is not None else []
        if not names:
            self.output.append_stdout(
                "nothing rebuilt: no name in the namespace holds this handle any more; run "
                "`n = n.rebuild()` on the handle you mean.\n"
            )
            return None
        new = old.rebuild()
        for name in names:
            self.user_ns[name] = new
        with self.button.hold_sync():
            self.button.description = REBUILT
            self.button.button_style = "success"
            self.button.icon = "check"
            self.button.disabled = True
        self.output.append_stdout(f"rebuilt: {', '.join(names)} -> new handle\n")
        return new


def rebind_names(user_ns: dict, obj) -> list[str]:
    """The user's names bound to `obj`, leaving out IPython's output-history names.

    **Arguments:**

    - `user_ns`: the namespace to search.
    - `obj`: the object, compared by identity.

    **Returns:** the names, in the namespace's order.
    """
    return [k for k, v in list(user_ns.items()) if v is obj and not _OUTPUT_NAMES.fullmatch(k)]


class RichSink:
    """The `_report` sink in a widget-capable kernel: messages of a kind in `STYLES` become `MessageView`
    widgets, everything else (compile and epoch lines) goes to the previous sink as text. It also tells
    the live panel, when one is shown, that something happened.
    """

    def __init__(self, shell, previous):
        """**Arguments:**

        - `shell`: the kernel's shell, whose namespace a **Rebuild handle** button rebinds.
        - `previous`: the sink that messages shown as text go to.
        """
        self.shell = shell
        self.previous = previous
        self.panel: "Panel | None" = None
        self.views: list[MessageView] = []  # most recent last; kept short, for tests and inspection

    def __call__(self, msg: _report.Message) -> None:
        if threading.current_thread() is not threading.main_thread():
            self.previous(msg)  # never a widget off the main thread
            return
        if msg.kind in STYLES:
            view = MessageView(msg, self.shell.user_ns)
            self.views = [*self.views[-9:], view]
            display(view)
        else:
            self.previous(msg)
        if self.panel is not None:
            try:
                self.panel.on_message(msg)
            except Exception as err:  # noqa: BLE001 - the panel is a nicety, the message was shown
                print(f"nitro_ipy: the panel failed to update ({type(err).__name__}: {err})")


class Panel:
    """The live panel: hits, misses, entries, poisoned and the latest compile (kind, seconds, why).

    Fed by its subscribers to the cache's "compile", "reset" and "progress" events, the message sink, and
    a flush after every cell. Refreshes are throttled to one per `min_interval` seconds; a refresh asked for
    sooner (or off the main thread) is deferred to the next event or flush. Trait updates are batched with
    `hold_sync()`, and a value that did not change is not sent.
    """

    def __init__(self, min_interval: float = 0.25):
        """`min_interval`: the fewest seconds between two refreshes sent to the front end."""
        self.min_interval = min_interval
        live = _cache.live_entries()
        self.latest_entry = live[-1] if live else None  # entries are kept in compile order
        self.loop = None  # the last recompile-loop message, which turns the panel 'warning'
        # Created with their values, so each widget's comm_open carries its state: no update follows.
        self.hits, self.misses, self.entries, self.poisoned, self.latest = (
            widgets.HTML(value=html.escape(value), description=name,
                         layout=widgets.Layout(width="10em" if name != "latest compile" else "auto"))
            for name, value in self.figures().items()
        )
        self._title = widgets.HTML(value="<b>nitro_ipy compile cache</b>")
        self._row = widgets.HBox([self.hits, self.misses, self.entries, self.poisoned])
        self.widget = widgets.VBox([self._title, self._row, self.latest])
        self.refreshes = 0  # how many refreshes were sent: the throttle is tested by counting these
        self._last = time.monotonic()
        self._dirty = False
        self._unsubscribe = []  # one function per cache subscription; empty while detached
        self._displays = []  # DisplayHandles of where the panel is shown, to refresh their text fallback
        self._shown_text = None

    # -- wiring
    def attach(self) -> None:
        """Subscribe to the cache's events (idempotent)."""
        if not self._unsubscribe:
            self._unsubscribe = [_cache.subscribe("compile", self.on_compile),
                                 _cache.subscribe("reset", self.on_reset),
                                 _cache.subscribe("progress", self.on_progress)]

    def detach(self) -> None:
        """Unsubscribe from the cache: the panel stops updating (its widgets stay as they are)."""
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe = []

    def close(self) -> None:
        """Detach and close the widgets (their views disappear from the notebook)."""
        self.detach()
        for w in (self.hits, self.misses, self.entries, self.poisoned, self.latest, self._title, self._row,
                  self.widget):
            w.close()

    def show(self) -> None:
        """Display the panel (again: every view shows the same widgets)."""
        self._displays.append(display(self, display_id=True))

    # -- subscribers and the sink's notice (each must never raise into the step loop or the cache)
    def on_compile(self, entry) -> None:
        self.latest_entry = entry
        self._safely(self.refresh)

    def on_reset(self) -> None:
        self.latest_entry, self.loop = None, None
        self._safely(self.refresh, force=True)

    def on_progress(self) -> None:
        self._safely(self.refresh)

    def on_message(self, msg: _report.Message) -> None:
        if msg.kind == Kind.RECOMPILE_LOOP:
            self.loop = msg
        if msg.kind in _REFRESH_ON:
            self.refresh()

    def flush(self) -> None:
        """Send any deferred refresh now (after each cell, so the panel ends every cell exact), and bring
        the displays' text fallback up to date when the figures changed (what nbconvert and a plain-text
        reader of the saved notebook see)."""
        if self._dirty:
            self.refresh(force=True)
        if self._displays and self.text() != self._shown_text:
            for handle in self._displays:
                handle.update(self)

    def _safely(self, fn, **kwargs):
        try:
            fn(**kwargs)
        except Exception as err:  # noqa: BLE001 - a panel glitch must not break training
            print(f"nitro_ipy: the panel failed to update ({type(err).__name__}: {err})")

    # -- state
    def figures(self) -> dict:
        """What the panel shows now, as plain text: `{label: value}`."""
        hits, misses, entries = _cache.cache_stats()
        e = self.latest_entry
        if e is None:
            latest = "none yet"
        else:
            why = f" ({e.why})" if e.why else ""
            latest = f"{e.kind} [{', '.join(e.hook_names)}] in {e.trace_s + e.compile_s:.2f} s{why}"
        return {"hits": str(hits), "misses": str(misses), "entries": str(entries),
                "poisoned": str(len(_cache.poisoned_entries())), "latest compile": latest}

    def text(self) -> str:
        """The panel as one plain-text line (its `text/plain` fallback)."""
        f = self.figures()
        return (f"nitro_ipy panel: hits {f['hits']} | misses {f['misses']} | entries {f['entries']} | "
                f"poisoned {f['poisoned']} | latest compile: {f['latest compile']}")

    def refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if threading.current_thread() is not threading.main_thread() or (
            not force and now - self._last < self.min_interval
        ):
            self._dirty = True
            return
        self._last, self._dirty = now, False
        values = dict(zip((self.hits, self.misses, self.entries, self.poisoned, self.latest),
                          map(html.escape, self.figures().values())))
        style = "warning" if self.loop is not None else ""
        changed = [w for w, v in values.items() if w.value != v]
        with contextlib.ExitStack() as stack:
            for w in changed:
                stack.enter_context(w.hold_sync())
            if style != self.widget.box_style:
                stack.enter_context(self.widget.hold_sync())
                self.widget.box_style = style
            for w in changed:
                w.value = values[w]
        self.refreshes += 1

    def _repr_mimebundle_(self, include=None, exclude=None):
        if self._dirty:
            self.refresh(force=True)
        text = self._shown_text = self.text()
        bundle = dict(self.widget._repr_mimebundle_(include=include, exclude=exclude) or {})
        bundle["text/plain"] = text
        bundle["text/html"] = f"<div class='nitro-panel'>{html.escape(text)}</div>"
        return bundle

    def __repr__(self):
        return self.text()
