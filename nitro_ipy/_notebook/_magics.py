"""`NitroMagics`: `%nitro_stats`, `%nitro_reset`, `%nitro_panel`, `%nitro_ahead`, `%nitro_honest_jit`, and
the state of one load of the extension.

As IPython's `AutoreloadMagics` owns its reloader, the magics object owns what one `%load_ext nitro_ipy`
set up: its cell callbacks (`pre_run_cell`, `post_run_cell`, methods of it), the rich message sink, the
live panel and the file watch set. `_extension.load` registers them; `close` undoes what the object set up.

- `start` makes `jax.jit` honest (`_adopt`) and names the user's functions jitted before; `close` puts
  the originals back;
- `pre_run_cell` bumps the world counter, so a redefinition in a cell is seen by the next entry point
  (even one in the same cell);
- `post_run_cell` refreshes the file watch set from the cache entries' closures (only when the cache
  changed since the last cell) and flushes the live panel;
- in a kernel that can show widgets (ipykernel's `ZMQInteractiveShell`), messages render as widgets;
  in terminal IPython they stay plain text lines.

Imported only by `_extension` (which `load_ipython_extension` imports on demand): the core never imports it.
"""

import sys

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .. import _adopt
from .._base import _report, _world
from .._compiler import _cache
from .._compiler._cache import cache_reset
from .._compiler._stats import stats_table
from .._training import _ahead
from . import _watch

CELL_EVENTS = ("pre_run_cell", "post_run_cell")  # each is also the name of the method registered for it
STATS_OPTIONS = ("--reset", "--why")
NO_WIDGETS = (
    "nitro_ipy: ipywidgets is not installed, so messages stay plain text and `%nitro_panel` is unavailable "
    "(`pip install ipywidgets` for the rich versions)."
)
_BAD_OPTION = "`%{magic}`: {problem}. Valid options: {valid}."
JITTED_BEFORE = (
    "nitro_ipy: {names}: jitted before the extension loaded; re-run their cells to make them honest "
    "(an edit of what they call cannot be seen)."
)
# A load finds the callbacks an earlier one registered by this attribute, even across an `importlib.reload`
# of this module (when the earlier callbacks' class is no longer `NitroMagics`).
_CALLBACK_TAG = "__nitro_ipy_callback__"


def _cell_callback(fn):
    setattr(fn, _CALLBACK_TAG, True)  # a bound method reads it from its function
    return fn


def is_cell_callback(fn) -> bool:
    """True for a cell callback that some load of nitro_ipy registered."""
    return getattr(fn, _CALLBACK_TAG, False)


def widget_kernel(shell) -> bool:
    """True in ipykernel's `ZMQInteractiveShell` (a notebook, JupyterLab, VS Code, nbclient)."""
    return any(c.__name__ == "ZMQInteractiveShell" for c in type(shell).__mro__)


def _import_widgets():
    """`_widgets`, or None when ipywidgets (or IPython's display machinery) cannot be imported."""
    try:
        from . import (
            _widgets,  # lazy: ipywidgets is optional, and only a widget kernel needs it
        )
    except ImportError:
        return None
    return _widgets


def _note(what: str, err: BaseException) -> None:
    print(f"nitro_ipy: {what} failed ({type(err).__name__}: {err}); your cell ran normally.", file=sys.stderr)


def _parse(magic, line: str, name: str, valid: tuple):
    try:
        return parse_argstring(magic, line)
    except UsageError as err:
        raise UsageError(_BAD_OPTION.format(magic=name, problem=err, valid=", ".join(valid))) from None


def _no_arguments(line: str, name: str) -> None:
    if line.strip():
        raise UsageError(_BAD_OPTION.format(magic=name, problem=f"unexpected `{line.strip()}`", valid="none"))


def _reset(disk: bool = False) -> None:
    cache_reset()
    print("nitro_ipy: compile cache emptied; counters zeroed.")
    if disk:
        from .._compiler._store import cache_dir, clear

        removed = clear()
        where = cache_dir()
        print(f"nitro_ipy: program store cleared: {removed} program{'s' if removed != 1 else ''} deleted from {where}."
              if where else "nitro_ipy: the program store is off; nothing on disk to clear.")


@magics_class
class NitroMagics(Magics):
    """nitro_ipy's magics (thin wrappers over `stats_table()`, `cache_reset()` and the live panel) and the
    state of the load that registered them."""

    # Class-wide, so a `%reload_ext` (a new instance) does not print it again: once per process.
    hinted = False

    def __init__(self, shell):
        super().__init__(shell)
        self.sink = None  # our `_widgets.RichSink`, when installed
        self.previous_sink = None
        self.panel = None
        self.watch_signature = None  # (cache generation, misses, entries) when the watch set was last refreshed

    # -- lifetime
    def start(self) -> None:
        """Make `jax.jit` honest, install the rich message sink (in a widget kernel) and start watching the
        cache's user files."""
        self.honest_jit(True)
        if widget_kernel(self.shell):
            widgets = _import_widgets()
            if widgets is not None:
                self.sink = widgets.RichSink(self.shell, _report.sink())
                self.previous_sink = _report.set_sink(self.sink)
                self.sink.catch_interrupts()  # a stop is said once: the train() display's line
            elif not NitroMagics.hinted:
                NitroMagics.hinted = True
                print(NO_WIDGETS)
        try:
            self.refresh_watch()  # starts the watcher when the cache already holds programs from user files
        except Exception as err:  # noqa: BLE001 - no watcher (say, out of inotify watches) is no reason to fail
            _note("starting the file watcher", err)

    def honest_jit(self, on: bool) -> None:
        """Switch zero-change honesty (`_adopt`); on, name the user's functions jitted before it was on."""
        _adopt.set_honest_jit(on)
        before = _adopt.jitted_before(self.shell.user_ns) if on else []
        if before:
            print(JITTED_BEFORE.format(names=_report.some(before)))

    def close(self) -> None:
        """Undo `start`: put `jax.jit` back, restore the previous message sink, close the panel, stop the
        watcher."""
        _adopt.set_honest_jit(False)
        if self.sink is not None:
            self.sink.close()
            if _report.sink() is self.sink:
                _report.set_sink(self.previous_sink)
        if self.panel is not None:
            self.panel.close()
        _watch.stop()

    # -- cell callbacks (never raise into the user's cell)
    @_cell_callback
    def pre_run_cell(self, info=None) -> None:
        try:
            _world.cell_started()
            _world.bump_world()
            if self.sink is not None and self.sink.buttons:
                self.sink.retire(moved_on=True)  # a button shown by an earlier cell can no longer be clicked
        except Exception as err:  # noqa: BLE001
            _note("the pre-cell hook", err)  # (the user-facing words predate the vocabulary)

    @_cell_callback
    def post_run_cell(self, result=None) -> None:
        try:
            _world.cell_ended()  # before compile ahead starts: its traces meet no statement of this cell
            _ahead.after_edit()  # the replacements of what this cell's edit poisoned start compiling
            self.refresh_watch()
            if self.sink is not None:
                self.sink.drain()  # what a background thread said during the cell, drawn in it
                self.sink.retire()
            if self.panel is not None:
                self.panel.flush()
        except Exception as err:  # noqa: BLE001
            _note("the post-cell hook", err)

    def refresh_watch(self) -> None:
        """Watch the user module files that cached programs depend on. Cheap when the cache did not change."""
        stats = _cache.cache_stats()
        # Hits do not change what is cached. (A reset reuses no figures unless the same programs come back.)
        signature = (_cache.generation(), stats.misses, stats.entries)
        if signature == self.watch_signature:
            return
        self.watch_signature = signature
        files = set()
        for entry in _cache.live_entries():
            if entry.closure is not None:
                files |= entry.closure.files()
        if files:
            _watch.watch(files)

    # -- magics
    @magic_arguments()
    @argument("--reset", action="store_true", help="empty the compile cache and zero its counters")
    @argument("--why", action="store_true", help="each program's full reason to compile, every change listed")
    @line_magic
    def nitro_stats(self, line=""):
        """Show the compile cache: hits, misses, entries, and one row per compiled program.

        `%nitro_stats --why` lists every change behind each program's compile (the compile lines sum up
        the argument shapes a GraphConst field moved); `%nitro_stats --reset` empties the cache instead
        (the escape hatch for an edit nothing tracks).
        """
        args = _parse(self.nitro_stats, line, "nitro_stats", STATS_OPTIONS)
        if args.reset:
            return _reset()
        return stats_table(why=args.why)

    @magic_arguments()
    @argument("--disk", action="store_true", help="also delete every program stored on disk")
    @line_magic
    def nitro_reset(self, line=""):
        """Empty the compile cache and zero its counters (`nitro_ipy.cache_reset()`); `--disk` also
        deletes the programs stored on disk (the program store, `nitro_ipy.set_cache_dir`)."""
        args = _parse(self.nitro_reset, line, "nitro_reset", ("--disk",))
        return _reset(disk=args.disk)

    @line_magic
    def nitro_ahead(self, line=""):
        """`%nitro_ahead on|off`: compile the replacements of the programs an edit poisons in the
        background, before the rebuild asks (on by default; `NITRO_IPY_AHEAD=0` starts it off). With no
        argument, say whether it is on."""
        word = line.strip().lower()
        if word not in ("", "on", "off"):
            raise UsageError(_BAD_OPTION.format(magic="nitro_ahead", problem=f"unexpected `{line.strip()}`",
                                                valid="on, off"))
        if word:
            _ahead.set_compile_ahead(word == "on")
        due = _ahead.status()
        print(f"nitro_ipy: compile ahead is {'on' if _ahead.compile_ahead_enabled() else 'off'}."
              + (f" {due}" if due else ""))

    @line_magic
    def nitro_honest_jit(self, line=""):
        """`%nitro_honest_jit on|off`: `jax.jit`, `equinox.filter_jit` and `flax.nnx.jit` applied to your own
        functions behave as `nitro_ipy.jit` (on by default with the extension), or are JAX's and the
        libraries' own again (`nitro_ipy.set_honest_jit`). With no argument, say whether it is on."""
        word = line.strip().lower()
        if word not in ("", "on", "off"):
            raise UsageError(_BAD_OPTION.format(magic="nitro_honest_jit", problem=f"unexpected `{line.strip()}`",
                                                valid="on, off"))
        if word:
            self.honest_jit(word == "on")
        print(f"nitro_ipy: honest jax.jit is {'on' if _adopt.honest_jit_enabled() else 'off'}.")

    @line_magic
    def nitro_panel(self, line=""):
        """Show the live panel: hits, misses, entries and the latest compile, updating while training.

        One panel per load: showing it again shows the same panel. It is a notebook widget; in terminal
        IPython (or without ipywidgets) this prints the cache's one-line summary instead.
        """
        _no_arguments(line, "nitro_panel")
        if self.sink is None:  # not a widget kernel, or ipywidgets is missing
            why = NO_WIDGETS if widget_kernel(self.shell) else "nitro_ipy: the live panel needs a notebook kernel."
            print(f"{why}\n{stats_table().summary()}")
            return
        if self.panel is None:
            from ._panel import (
                Panel,  # its `_widgets` is imported already: `self.sink` is one of its classes
            )

            self.panel = self.sink.panel = Panel()
            self.panel.attach()
        self.panel.show()
