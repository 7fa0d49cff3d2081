"""The process's one event bus: what happened, told to whoever asked, without the teller knowing who.

The cache, the compiler, the step loop and background runs publish here; compile ahead, the live panel
and background runs subscribe. Each event's arguments are fixed (`EVENTS`). Two ways to tell:

- `publish(event, *args)`: news. A subscriber that raises never breaks training or a compile; front ends
  (the panel) only set flags here, since the publisher may be any thread.
- `signal(event, *args)`: coordination inside the package, where a subscriber may stop the publisher on
  purpose (compile ahead raises `Cancelled` into a held-back build whose edit was superseded).

Subscribers are held in tuples replaced under a lock, so publishing takes no lock and a subscriber may
unsubscribe itself while being called.
"""

from __future__ import annotations

import threading
from typing import Callable

EVENTS = {
    "compile": "(entry): a program was stored in the cache",
    "reset": "(): `cache_reset()` ran",
    "counting": "(): the cache's counters are about to be read (`nitro_ipy.jit` adds the hits it counted)",
    "awaiting": "(): a thread waits for a key another thread is compiling",
    "xla_start": "(): a build's trace is done and its XLA compile starts (no GIL held from here)",
    "stepping": "(running: bool, thread: int): a step loop in `thread` passed its first step (True), or that loop "
                "ended (False)",
    "steps_over": "(): this thread's step loop is over (its epoch ended; told again if `stepping` was cut)",
    "progress": "(): a training handle reached a periodic sync point (about every 0.25 s, never per step)",
    "run": "(run): a background run (`Run`) started or ended (`run.done` tells which)",
    "temp_written": "(path): a file's temp copy is written and synced, not yet renamed into place (`_writes`)",
    "ahead": "(entry): a program compiled in the background entered the cache (a miss); its compile line is "
             "said when a handle takes it (then `compile` follows)",
    "compiled": "(entry, ahead: bool): this thread put `entry` in the cache: compiled, loaded from the store, or "
                "taken compiled ahead (`ahead`); signalled once it is in, so a compile guard may raise",
}

_lock = threading.Lock()
_subscribers: dict[str, tuple[Callable, ...]] = {event: () for event in EVENTS}


def subscribe(event: str, fn: Callable, *, first: bool = False) -> Callable[[], None]:
    """Call `fn(*args)` on every `event` (one of `EVENTS`), after those subscribed before it (`first`:
    before them). Returns the function that unsubscribes it again."""
    if event not in EVENTS:
        raise KeyError(f"unknown event {event!r}; the events are {', '.join(EVENTS)}")
    with _lock:
        _subscribers[event] = (fn, *_subscribers[event]) if first else (*_subscribers[event], fn)

    def unsubscribe():
        with _lock:
            subs = list(_subscribers[event])
            if fn in subs:
                subs.remove(fn)
                _subscribers[event] = tuple(subs)

    return unsubscribe


def subscribers(event: str) -> tuple:
    return _subscribers[event]


def publish(event: str, *args) -> None:
    """Tell `event`'s subscribers; one that raises is skipped, never breaking the publisher."""
    for fn in _subscribers[event]:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - news: a front end's fault must not stop training
            pass


def signal(event: str, *args) -> None:
    """Tell `event`'s subscribers; an exception a subscriber raises reaches the publisher."""
    for fn in _subscribers[event]:
        fn(*args)
