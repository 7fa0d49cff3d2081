"""The world counter: bumped by every notebook cell, every watched file change, or by hand.

Staleness scans are memoized on it, so an entry point that follows no bump pays one integer comparison.

It also says whether a trace in a background thread (compile ahead, a trace-reuse warming) ran alone. A
recording reads the values of the globals a trace read when the trace ends, not as each was read: a cell
that redefined a helper meanwhile would have the old helper compiled and the new one recorded, a stale
program that says it is current. So the cell hooks mark when a cell's own statements may run
(`cell_started` / `cell_ended`, and `inside_nitro` around nitro's own calls in the cell, during which none
do), and `settle_mark()` / `settled(mark)` tell whether any may have run between the two.
"""

import contextlib
import threading
import time

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
        _moves[0] += 1
        return _world


_moves = [0]  # bumped whenever the user's code may have started to run or to redefine something
_cell = [None, 0]  # the thread running a notebook cell (None between cells), nitro calls it is inside


def cell_started() -> None:
    """A notebook cell starts (the extension's pre-cell hook): its statements may redefine anything."""
    with _lock:
        _cell[:] = [threading.get_ident(), 0]
        _moves[0] += 1


def cell_ended() -> None:
    """The cell ended (the extension's post-cell hook)."""
    with _lock:
        _cell[:] = [None, 0]
        _moves[0] += 1


@contextlib.contextmanager
def inside_nitro():
    """Around a nitro call that a cell makes (a training run): no statement of the cell runs until it
    returns. Only the cell's own thread counts; a background run's thread leaves the cell running."""
    if _cell[0] != threading.get_ident():
        yield
        return
    with _lock:
        _cell[1] += 1
    try:
        yield
    finally:
        with _lock:
            _cell[1] -= 1
            _moves[0] += 1  # back in the cell's own statements


def settle_mark():
    """A mark to hand `settled` after a trace in this thread. None in the cell's own thread: nothing
    else edits while the cell itself traces."""
    me = threading.get_ident()
    with _lock:
        if _cell[0] == me:
            return None
        return _moves[0], _cell[0] is not None and _cell[1] == 0


def cell_busy() -> bool:
    """Whether a cell's own statements may be running now (in another thread than this one)."""
    cell, inside = _cell
    return cell is not None and inside == 0 and cell != threading.get_ident()


def wait_settled(timeout: float) -> bool:
    """Wait (at most `timeout` s) until no cell's own statements run in another thread: the cell ended, or
    waits inside nitro. True when none runs now."""
    deadline = time.monotonic() + timeout
    while cell_busy():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def settled(mark) -> bool:
    """Whether no statement of a cell (and no other redefinition that bumps the world) can have run since
    `settle_mark()` gave `mark`: what a recording in this thread read is what it records."""
    return mark is None or (not mark[1] and mark[0] == _moves[0])
