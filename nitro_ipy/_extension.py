"""`%load_ext nitro_ipy`: the cell hooks, the magics, the file watcher and the notebook front end.

- `pre_run_cell` bumps the world counter, so a redefinition in a cell is seen by the next entry point
  (even one in the same cell);
- `post_run_cell` refreshes the file watch set from the cache entries' closures (only when the cache
  changed since the last cell) and flushes the live panel;
- in a kernel that can show widgets (ipykernel's `ZMQInteractiveShell`), messages render as widgets;
  in terminal IPython they stay plain text lines.

`unload` removes every callback, the magics and the message sink, and stops the watcher. Loading again
(twice, or `%reload_ext`) first removes what an earlier load left, so exactly one set is ever registered.
"""

import sys

from . import _cache, _report, _watch, _world

_EVENTS = ("pre_run_cell", "post_run_cell")
_MAGIC_NAMES = ("nitro_stats", "nitro_reset", "nitro_panel")
_NO_WIDGETS = (
    "nitro_ipy: ipywidgets is not installed, so messages stay plain text and `%nitro_panel` is unavailable "
    "(`pip install ipywidgets` for the rich versions)."
)


class _Loaded:
    """What one load registered, so that `unload` removes exactly that."""

    def __init__(self, shell):
        self.shell = shell
        self.magics = None
        self.sink = None  # our `_widgets.RichSink`, when installed
        self.previous_sink = None
        self.panel = None
        self.watch_signature = None  # (cache identity, misses, entries) when the watch set was last refreshed


_loaded: _Loaded | None = None
_hinted = False  # the missing-ipywidgets hint is printed once per process


def _tagged(fn):
    # Tag every callback, so a later load can find (and remove) ones an earlier copy of this module
    # registered, even across `importlib.reload` of this module, when `_loaded` has been lost.
    fn.__nitro_ipy_callback__ = True
    return fn


def _note(what: str, err: BaseException) -> None:
    print(f"nitro_ipy: {what} failed ({type(err).__name__}: {err}); your cell ran normally.", file=sys.stderr)


def widget_kernel(shell) -> bool:
    """True in ipykernel's `ZMQInteractiveShell` (a notebook, JupyterLab, VS Code, nbclient)."""
    return any(c.__name__ == "ZMQInteractiveShell" for c in type(shell).__mro__)


def _import_widgets():
    """`_widgets`, or None when ipywidgets (or IPython's display machinery) cannot be imported."""
    try:
        from . import _widgets
    except ImportError:
        return None
    return _widgets


def load(shell) -> None:
    """Register the cell hooks, magics, file watcher and (in a widget kernel) the rich message sink."""
    global _loaded, _hinted
    if _loaded is not None:
        unload(_loaded.shell)
    _remove_tagged(shell)
    state = _loaded = _Loaded(shell)

    @_tagged
    def pre_run_cell(info=None):
        try:
            _world.bump_world()
        except Exception as err:  # noqa: BLE001 - a callback never breaks the user's cell
            _note("the pre-cell hook", err)

    @_tagged
    def post_run_cell(result=None):
        try:
            refresh_watch(state)
            if state.panel is not None:
                state.panel.flush()
        except Exception as err:  # noqa: BLE001
            _note("the post-cell hook", err)

    # Their `unregister` is `_remove_tagged`, which finds them by their tag.
    shell.events.register("pre_run_cell", pre_run_cell)
    shell.events.register("post_run_cell", post_run_cell)

    from ._magics import make_magics_class

    state.magics = make_magics_class()(shell)
    shell.register_magics(state.magics)

    if widget_kernel(shell):
        widgets = _import_widgets()
        if widgets is not None:
            state.sink = widgets.RichSink(shell, _report.sink())
            state.previous_sink = _report.set_sink(state.sink)
        elif not _hinted:
            _hinted = True
            print(_NO_WIDGETS)

    try:
        refresh_watch(state)  # starts the watcher when the cache already holds programs from user files
    except Exception as err:  # noqa: BLE001 - no watcher (say, out of inotify watches) is no reason to fail
        _note("starting the file watcher", err)


def unload(shell) -> None:
    """Remove every callback, the magics, the message sink and the panel; stop the watcher."""
    global _loaded
    state = _loaded
    _remove_tagged(shell)
    if state is None:
        return
    _loaded = None
    if state.magics is not None:
        _remove_magics(state.shell, state.magics)
    if state.sink is not None and _report.sink() is state.sink:
        _report.set_sink(state.previous_sink)
    if state.panel is not None:
        state.panel.close()
    _watch.stop()


def _remove_tagged(shell) -> None:
    for event in _EVENTS:
        for fn in list(shell.events.callbacks.get(event, ())):
            if getattr(fn, "__nitro_ipy_callback__", False):
                shell.events.unregister(event, fn)


def _remove_magics(shell, magics) -> None:
    # IPython has no `unregister_magics`; remove exactly the entries that point at our instance.
    table = shell.magics_manager.magics["line"]
    for name in _MAGIC_NAMES:
        fn = table.get(name)
        if getattr(fn, "__self__", None) is magics:
            del table[name]
    registry = shell.magics_manager.registry
    if registry.get(type(magics).__name__) is magics:
        del registry[type(magics).__name__]


def refresh_watch(state: _Loaded) -> None:
    """Watch the user module files that cached programs depend on. Cheap when the cache did not change."""
    stats = _cache.cache_stats()
    # Hits do not change what is cached. (A reset reuses no figures unless the same programs come back.)
    signature = (_cache.generation(), stats.misses, stats.entries)
    if signature == state.watch_signature:
        return
    state.watch_signature = signature
    files = set()
    for entry in _cache.live_entries():
        if entry.closure is not None:
            files |= entry.closure.files()
    if files:
        _watch.watch(files)


def show_panel(shell) -> None:
    """`%nitro_panel`: display the live panel (one per load; showing it again shows the same panel).

    The panel is a notebook widget; in terminal IPython (or without ipywidgets) this prints the cache's
    one-line summary instead.
    """
    from IPython.core.error import UsageError

    state = _loaded
    if state is None or state.shell is not shell:
        raise UsageError("`%nitro_panel` needs the extension: run `%load_ext nitro_ipy` first.")
    if state.sink is None:  # not a widget kernel, or ipywidgets is missing
        from ._magics import stats_table

        why = _NO_WIDGETS if widget_kernel(shell) else "nitro_ipy: the live panel needs a notebook kernel."
        print(f"{why}\n{stats_table().summary()}")
        return
    if state.panel is None:
        from ._widgets import Panel

        state.panel = state.sink.panel = Panel()
        state.panel.attach()
    state.panel.show()
