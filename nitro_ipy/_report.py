"""Where nitro_ipy's messages go: plain text lines by default, rich widgets once the extension is loaded.

A message is a `Message(kind, text, data)`. Kinds: "stale-cache" (informational, once per redefinition),
"stale-handle" (the running handle holds a poisoned program), "disk-edit" (a file changed on disk but was
not reloaded), "recompile-loop", "compile". The core only calls `emit`; front ends install a sink.
"""

import sys
from typing import Callable, NamedTuple


class Message(NamedTuple):
    kind: str
    text: str
    data: dict


def _print_sink(msg: Message) -> None:
    print(msg.text, file=sys.stdout, flush=True)


_sink: Callable[[Message], None] = _print_sink


def emit(kind: str, text: str, **data) -> Message:
    """Send a message to the current sink; a failing sink degrades to plain text, never raises."""
    msg = Message(kind, text, data)
    try:
        _sink(msg)
    except Exception:
        _print_sink(msg)
    return msg


def set_sink(sink: Callable[[Message], None] | None) -> Callable[[Message], None]:
    """Install `sink` (None restores plain text); returns the previous one."""
    global _sink
    previous = _sink
    _sink = sink or _print_sink
    return previous
