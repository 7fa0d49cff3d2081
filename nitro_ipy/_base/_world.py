"""The world counter: bumped by every notebook cell, every watched file change, or by hand.

Staleness scans are memoized on it, so an entry point that follows no bump pays one integer comparison.

It also says whether a trace in a background thread (compile ahead, a trace-reuse warming) ran alone. A
recording reads the values of the globals a trace read when the trace ends, not as each was read: a cell
that redefined a helper meanwhile would have the old helper compiled and the new one recorded, a stale
program that says it is current. So the cell hooks mark when a cell's own statements may run
(`cell_started` / `cell_ended`, and `inside_nitro` around nitro's own calls in the cell, during which none
do), and `trace_begun()` / `trace_ended(mark)`, around a trace, tell whether any may have run meanwhile.

A cell that starts while a background trace runs waits for that trace first, at most `CELL_WAIT_S`
(`trace_begun` / `trace_ended` count them; not a `speculative` one, trace reuse's warming): the cell run
at once after an edit (`n = n.rebuild()`) would otherwise cross the trace compile ahead began at the
edit's end, and have it dropped and done again in the foreground; the trace holds the GIL, so the cell
would have run at half speed beside it anyway.
"""

import contextlib
import threading
import time

_world = 0
_lock = threading.Lock()  # the file watcher bumps from its own thread
_traced = threading.Condition(_lock)  # notified when a background trace ends


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
_background = [0]  # traces in threads other than the cell's, in flight (`trace_begun` to `trace_ended`)
# How long a cell's start waits for the background traces in flight (a trace of a program compiled ahead
# takes 0.02-0.2 s for the models of benchmarks/; a longer one is crossed by the cell, and done again).
CELL_WAIT_S = 0.5
POLL_S = 0.005
waited = [0]  # cells that waited for a background trace (for tests)
# Callables saying whether a background trace is about to start (`_ahead`: a job ready to go): the cell's
# start waits for it too. Called without this module's lock.
PENDING: list = []


def cell_started(wait: float | None = None) -> None:
    """A notebook cell starts (the extension's pre-cell hook): its statements may redefine anything. It
    first waits, at most `wait` s (`CELL_WAIT_S`), for the traces running in other threads to end."""
    deadline, polls = time.monotonic() + (CELL_WAIT_S if wait is None else wait), 0
    while (_background[0] or any(about() for about in PENDING)) and time.monotonic() < deadline:
        polls += 1
        with _traced:  # woken as a trace ends; a job taken off a queue starts its trace within a poll
            _traced.wait(min(POLL_S, max(deadline - time.monotonic(), 0)))
    waited[0] += polls > 0
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


_speculative = threading.local()


@contextlib.contextmanager
def speculative():
    """Around a speculative trace (trace reuse's warming, whose recordings nest in it): a cell starting
    meanwhile does not wait for it; it crosses and drops it, and the warming is done again later."""
    _speculative.depth = getattr(_speculative, "depth", 0) + 1
    try:
        yield
    finally:
        _speculative.depth -= 1


def trace_begun():
    """A mark for `trace_ended`, taken as a trace starts; None in the cell's own thread (nothing else edits
    while the cell itself traces). A trace in another thread counts as in flight until `trace_ended`
    (which must follow): a cell starting meanwhile waits for it, unless it is `speculative`."""
    me = threading.get_ident()
    awaited = not getattr(_speculative, "depth", 0)
    with _lock:
        if _cell[0] == me:
            return None
        _background[0] += awaited
        return _moves[0], _cell[0] is not None and _cell[1] == 0, awaited


def trace_ended(mark) -> bool:
    """The trace `trace_begun` gave `mark` for ended: whether no statement of a cell (and no other
    redefinition that bumps the world) can have run since, so that what a recording in this thread read
    is what it records."""
    if mark is None:
        return True
    with _traced:
        _background[0] -= mark[2]
        _traced.notify_all()
        return not mark[1] and mark[0] == _moves[0]


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
