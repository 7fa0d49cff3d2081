"""Watch the user's source files and bump the world counter when one of them is saved.

One watchdog `Observer` (a daemon thread, started on the first `watch`) watches the directories of the
watched files, non-recursively. A modified, created, moved (editors that save by writing a temporary file
and renaming it over the original) or deleted watched file bumps `world()`; events within `DEBOUNCE_S`
of the first one coalesce into a single bump, made when the window closes (so the save has finished).
The observer and timer threads call `bump_world()` and touch nothing else: the staleness scan itself
runs at the next entry point, in the user's thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from . import _world

__all__ = ["DEBOUNCE_S", "stop", "watch", "watched"]

DEBOUNCE_S = 0.05

# Two locks, never nested: `_lock` guards the observer and the watched set (held while scheduling, which
# takes the observer's own lock); `_timer_lock` guards the debounce timer and is the only lock the
# handler takes (the observer dispatches with its lock held, so taking `_lock` there could deadlock).
_lock = threading.Lock()
_timer_lock = threading.Lock()
_observer: Observer | None = None
_files: frozenset[str] = frozenset()  # replaced, never mutated: the handler reads it without the lock
_dirs: set[str] = set()
_timer: threading.Timer | None = None


def _norm(path) -> str:
    return os.path.realpath(os.fsdecode(path))


class _Handler(FileSystemEventHandler):
    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.is_directory or event.event_type not in ("modified", "created", "moved", "deleted"):
            return
        files = _files
        paths = [event.src_path, getattr(event, "dest_path", None)]
        if any(p and os.path.normpath(os.fsdecode(p)) in files for p in paths):
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
    global _timer
    with _timer_lock:
        _timer = None
    _world.bump_world()


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
        handler = _handler
        for path in sorted(new):
            directory = os.path.dirname(path)
            if directory not in _dirs:
                if not os.path.isdir(directory):
                    new.discard(path)
                    continue
                _observer.schedule(handler, directory, recursive=False)
                _dirs.add(directory)
        _files = _files | new


def watched() -> set[str]:
    """The files being watched (real paths)."""
    return set(_files)


def stop() -> None:
    """Stop and join the observer and forget the watched files; a pending bump is made now."""
    global _observer, _files, _timer
    with _lock:
        observer = _observer
        _observer = None
        _files = frozenset()
        _dirs.clear()
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
