"""Watch the user's source files and bump the world counter when one of them is saved.

One watchdog `Observer` (a daemon thread, started on the first `watch`) watches the directories of the
watched files, non-recursively. A modified, created, moved (editors that save by writing a temporary file
and renaming it over the original) or deleted watched file bumps `world()`; events within `DEBOUNCE_S`
of the first one coalesce into a single bump, made when the window closes (so the save has finished).
The observer and timer threads call `bump_world()` and touch nothing else: the staleness scan itself
runs at the next entry point, in the user's thread.

A watched directory can disappear (`rm -rf` and a fresh checkout, a branch switch): the kernel drops its
watch, so each directory's parent is watched too. A directory event on a watched directory (deleted,
created, moved) marks the watches for a resync, done by the timer thread when the window closes (never in
the observer's thread, which dispatches holding the lock `schedule` needs): a directory whose inode
changed is unscheduled and scheduled again, a missing one waits for its parent to report it back.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from .._base import _world

__all__ = ["DEBOUNCE_S", "stop", "watch", "watched"]

DEBOUNCE_S = 0.05

# Two locks, never nested: `_lock` guards the observer and the watched set (held while scheduling, which
# takes the observer's own lock); `_timer_lock` guards the debounce timer and is the only lock the
# handler takes (the observer dispatches with its lock held, so taking `_lock` there could deadlock).
_lock = threading.Lock()
_timer_lock = threading.Lock()
_observer: Observer | None = None
_files: frozenset[str] = frozenset()  # replaced, never mutated: the handler reads it without the lock
_dirs: dict[str, tuple] = {}  # directory -> (its ObservedWatch or None while missing, (st_dev, st_ino))
_parents: dict[str, object] = {}  # parent directory -> its ObservedWatch
_dir_names: frozenset[str] = frozenset()  # the watched directories, for the handler (replaced, never mutated)
_timer: threading.Timer | None = None
_resync = False  # a watched directory moved: re-schedule when the debounce window closes


def _norm(path) -> str:
    return os.path.realpath(os.fsdecode(path))


class _Handler(FileSystemEventHandler):
    def on_any_event(self, event: FileSystemEvent) -> None:
        global _resync
        if event.event_type not in ("modified", "created", "moved", "deleted"):
            return
        paths = [event.src_path, getattr(event, "dest_path", None)]
        paths = [os.path.normpath(os.fsdecode(p)) for p in paths if p]
        if event.event_type != "modified":  # a directory's "modified" is a file inside it: not ours
            if any(p in _dir_names for p in paths):  # a watched directory went or came back
                _resync = True
                _schedule_bump()
                return
        if not event.is_directory and any(p in _files for p in paths):
            if event.event_type != "modified":
                _resync = True  # replaced: maybe by a symlink, whose target must be watched too
            _schedule_bump()


def _schedule_bump() -> None:
    """Bump once when the debounce window that this event opens (or joins) closes."""
    global _timer
    with _timer_lock:
        if _timer is not None:
            return
        _timer = threading.Timer(DEBOUNCE_S, _fire)
        _timer.daemon = True
        _timer.start()


def _fire() -> None:
    global _timer, _resync
    with _timer_lock:
        _timer = None
    if _resync:
        _resync = False
        try:
            _resync_watches()
        except Exception:  # a thread never raises: the next directory event tries again
            pass
    _world.bump_world()


def _identity(directory: str):
    try:
        st = os.stat(directory)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _schedule_dir(directory: str) -> None:
    """Watch `directory` (and its parent, to see it go and come back). Called with `_lock` held."""
    global _dir_names
    ident = _identity(directory)
    watch = _observer.schedule(_handler, directory, recursive=False) if ident is not None else None
    _dirs[directory] = (watch, ident)
    parent = os.path.dirname(directory)
    if parent and parent != directory and parent not in _parents and os.path.isdir(parent):
        _parents[parent] = _observer.schedule(_handler, parent, recursive=False)
    _dir_names = frozenset(_dirs)


def _resync_watches() -> None:
    """Re-schedule each watched directory whose inode changed (removed and recreated, replaced), and
    watch the target of a watched file that became a symlink (saves then go to the target)."""
    targets = {os.path.realpath(f) for f in _files if os.path.islink(f)}
    if targets - _files:
        watch(targets)
    with _lock:
        if _observer is None:
            return
        for directory, (observed, ident) in list(_dirs.items()):
            now = _identity(directory)
            if now == ident and observed is not None:
                continue
            if observed is not None:
                try:
                    _observer.unschedule(observed)
                except Exception:  # its emitter already stopped with the directory
                    pass
            _schedule_dir(directory)


def watch(paths: Iterable[str]) -> None:
    """Watch these files (in addition to those already watched); starts the observer on first use.

    Files whose directory does not exist are skipped.
    """
    global _observer, _files
    with _lock:
        new = {_norm(p) for p in paths} - _files
        if not new:
            return
        if _observer is None:
            _observer = Observer()
            _observer.daemon = True
            _observer.start()
        for path in sorted(new):
            directory = os.path.dirname(path)
            if directory not in _dirs:
                if not os.path.isdir(directory):
                    new.discard(path)
                    continue
                _schedule_dir(directory)
        _files = _files | new


def watched() -> set[str]:
    """The files being watched (real paths)."""
    return set(_files)


def stop() -> None:
    """Stop and join the observer and forget the watched files; a pending bump is made now."""
    global _observer, _files, _timer, _dir_names
    with _lock:
        observer = _observer
        _observer = None
        _files = frozenset()
        _dirs.clear()
        _parents.clear()
        _dir_names = frozenset()
    with _timer_lock:
        timer, _timer = _timer, None
    if timer is not None:
        timer.cancel()
        _world.bump_world()
    if observer is not None:
        observer.stop()
        # Join outside the lock: the observer's handler may be waiting on it.
        observer.join(timeout=5)


_handler = _Handler()
