"""The world counter: bumped by every notebook cell, every watched file change, or by hand.

Staleness scans are memoized on it, so an entry point that follows no bump pays one integer comparison.
"""

import threading

_world = 0
_lock = threading.Lock()  # the file watcher bumps from its own thread


def world() -> int:
    """The current world: a counter that only grows."""
    return _world


def bump_world() -> int:
    """Mark that code may have changed (a cell ran, a file was saved); returns the new world.

    The IPython extension and the file watcher call this for you; call it by hand in a script after
    `importlib.reload` or any other redefinition.
    """
    global _world
    with _lock:
        _world += 1
        return _world
