"""Every message nitro_ipy says, how it looks, and where it goes: plain text lines by default, rich
output once the extension is loaded.

One reporter, two front ends (as tqdm's): a message is a `Message(kind, text, data, more)`: `kind` is a
`Kind`, `data` the facts the text was built from (front ends key on the kind and read the data, never
parse the text), `more` the long lists the text sums up (`Fold`: "and 6 argument shapes with it"), each
one click away in HTML. The core calls `emit(kind, **data)`; the text comes from that kind's builder
below, and its look (a quiet line, or a box in a tone with a title: `LOOKS`) from the table below, so
every message of one kind is composed and drawn the same way, by whichever thread emits it. The text
front end prints `text`; the notebook one (`_html.message_html`, shown by `_notebook._widgets`) draws
the same text in the kind's look. Front ends install a sink (`set_sink`).
"""

import contextlib
import enum
import sys
import threading
from typing import Callable, NamedTuple

from ._sharding import is_main_process


class Kind(str, enum.Enum):
    """What a message is about. A `str` enum: `Kind.COMPILE == "compile"`."""

    COMPILE = "compile"  # a program was compiled: entry
    STALE_CACHE = "stale-cache"  # informational, once per redefinition: count, names, kinds
    STALE_HANDLE = "stale-handle"  # the running handle holds a poisoned program: handle, names, kinds
    DISK_EDIT = "disk-edit"  # a file changed on disk but was not reloaded: names
    RECOMPILE_LOOP = "recompile-loop"  # a program kind compiled again after step 1: program, why
    EPOCH = "epoch"  # an epoch ended: record
    LARGE_CONSTANT = "large-constant"  # a program bakes in a large array: program, nbytes, shape, dtype, origin
    STORE_REFUSED = "store-refused"  # a stored program file was bad and deleted: name, reason
    STORE_FALLBACK = "store-fallback"  # a program cannot be stored; JAX's persistent cache takes it: program, reason, path
    STORE_OFF = "store-off"  # the program store's directory was refused: text
    RESUMED = "resumed"  # a handle resumed from a checkpoint: path, step, epoch, notes (changed Device/Host, hooks)
    MIXED_CODE = "mixed-code"  # a background run compiled a program after its code moved: program, names, others
    INTERRUPTED = "interrupted"  # a train() call stopped early: where (`epoch 4, step 422/427`), reason
    LOGGER = "logger"  # a logger (`nitro_ipy.loggers`) was detached or fell behind: text

    def __str__(self):
        return self.value


class Fold(NamedTuple):
    """A list a message's text sums up ("and 4 more"): `label` names it, `items` hold it whole. HTML shows
    it in a `<details>` under the text; `%nitro_stats --why` lists the explanations' ones in text."""

    label: str
    items: tuple


class Message(NamedTuple):
    kind: Kind
    text: str
    data: dict
    more: tuple = ()  # `Fold`s: the full lists behind the text's summaries


# How many names a message lists before it sums the rest up ("and 4 more").
FEW = 3


def some(names, few: int = FEW) -> str:
    """`a, b, c and 4 more`: the first `few` of `names`, the rest counted."""
    names = list(names)
    if len(names) <= few + 1:  # "and 1 more" saves nothing over the name itself
        return ", ".join(names)
    return f"{', '.join(names[:few])} and {len(names) - few} more"


def _fold(label: str, names, few: int = FEW) -> tuple:
    names = tuple(names)
    return (Fold(label, names),) if len(names) > few + 1 else ()


class Explanation(str):
    """Why a program compiled, next to the most similar earlier one (`_compiler._explain`): the full text
    (a `str`, every moved component's line joined by "; ", old -> new), and its two parts: `causes`,
    what moved (a GraphConst field, a hook, an option, edited code), and `follows`, the argument changes
    that moved with them (the shapes of the parameters a GraphConst `hidden` sizes)."""

    causes: tuple
    follows: tuple

    def __new__(cls, causes=(), follows=()):
        self = super().__new__(cls, "; ".join((*causes, *follows)))
        self.causes, self.follows = tuple(causes), tuple(follows)
        return self

    def __getnewargs__(self):
        return self.causes, self.follows

    def summary(self) -> str:
        """The causes, with the argument changes that follow from them counted: `GraphConst `hidden`:
        32 -> 8192, and 6 argument shapes with it`. With no cause, the argument changes are the cause:
        the first few, the rest counted."""
        causes, follows = self.causes, self.follows
        if not causes:
            return "; ".join(follows) if len(follows) <= FEW + 1 else (
                "; ".join(follows[:FEW]) + f"; and {_plural(len(follows) - FEW, 'more argument change')}")
        text = "; ".join(causes) if len(causes) <= FEW + 1 else (
            "; ".join(causes[:FEW]) + f"; and {len(causes) - FEW} more")
        if follows:
            what = "argument shape" if all(" shape: " in f for f in follows) else "argument change"
            text += f", and {_plural(len(follows), what)} with {'it' if len(causes) == 1 else 'them'}"
        return text

    def folded(self) -> tuple:
        """The `Fold`s behind `summary()`: what it counted instead of listing."""
        if self.summary() == str(self):
            return ()
        return (Fold(f"all {_plural(len(self.causes) + len(self.follows), 'change')}", (*self.causes, *self.follows)),)


def why_summary(why) -> str:
    """A compile's reason as its line says it: an `Explanation`'s summary, any other text as it is."""
    return why.summary() if isinstance(why, Explanation) else (why or "")


def merge_names(entries) -> tuple:
    """The drifted names of `entries`, each once, in the order they were first met."""
    names: dict = {}
    for entry in entries:
        names.update(dict.fromkeys(entry.drifted))
    return tuple(names)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


# A compile at least this slow says how many operations its program has: the size of the graph is what
# a slow compile is made of (docs/recompilation.md, "When a compile is genuinely slow").
SLOW_COMPILE_S = 2.0


# How a program built in the background (`_ahead`) came to be, said on its compile line.
AFTER_EDIT = "compiled ahead after your edit"  # once the edit's cell finished, before the rebuild asked
BESIDE_TRAINING = "compiled in the background as training started"  # validation's, beside the first steps


def _compile_text(entry, ahead: str = "") -> str:
    why = f" ({why_summary(entry.why)})" if entry.why else ""
    if ahead:
        why = f"{why}, {ahead}" if why else f" ({ahead})"
    hooks = ", ".join(entry.hook_names)
    seconds = entry.trace_s + entry.compile_s
    if getattr(entry, "origin", "compiled") == "disk":
        return f"nitro_ipy: compiled {entry.kind} [{hooks}] from disk in {seconds:.2f} s (loaded, no trace){why}"
    size = f", {entry.operations:,} operations" if seconds >= SLOW_COMPILE_S and entry.operations else ""
    return (
        f"nitro_ipy: compiled {entry.kind} [{hooks}] in {seconds:.2f} s "
        f"(trace {entry.trace_s:.2f} s, XLA {entry.compile_s:.2f} s{size}){why}"
    )


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024


size_text = _size


def _store_refused_text(name: str, reason: str) -> str:
    return f"nitro_ipy: stored program {name} refused ({reason}); deleted, it compiles as usual."


def _store_fallback_text(program: str, reason: str, path: str | None) -> str:
    where = (f"JAX's persistent compilation cache in {path} keeps its XLA step (a restart traces it again)"
             if path else "it compiles in full after a restart (JAX's cache is configured elsewhere)")
    return f"nitro_ipy: the `{program}` program cannot be stored ({reason}); {where}."


def _store_off_text(text: str) -> str:
    return text


def _resumed_text(path: str, step: int, epoch: int, notes: tuple) -> str:
    changed = "".join(f"\n  {line}" for line in notes)
    return (f"nitro_ipy: resumed from {path} at step {step}, epoch {epoch}"
            + (f"; changed since it was saved (not refused):{changed}" if notes else ""))


def _large_constant_text(program: str, nbytes: int, shape: tuple, dtype: str, origin: str | None) -> str:
    where = f" (from {origin})" if origin else ""
    return (
        f"nitro_ipy: the `{program}` program bakes in a {_size(nbytes)} constant {dtype}{list(shape)}{where}: "
        f"it is copied into the program at every compile and kept alive with it. Pass it as data (a "
        f"batch field of a split) or as a `Device` field, so compiled code receives it as an input."
    )


def _stale_cache_text(count: int, names: tuple, kinds: tuple) -> str:
    return (
        f"nitro_ipy: {_plural(count, 'cached program')} ({', '.join(sorted(set(kinds)))}) poisoned; "
        f"redefined: {some(names)}. Handles built from now on recompile against the current code."
    )


def handle_name(handle) -> str:
    """The notebook variable bound to `handle` (`m`, `run2`), for the rebuild line to name; `n` when none
    is (a handle in a list, a script)."""
    if handle is not None:
        from ._origin import (
            user_namespaces,  # (here: `_origin` is heavier than this module's other imports)
        )

        ns = user_namespaces()[0][1]
        found = sorted(k for k, v in list(ns.items()) if v is handle and k.isidentifier() and not k.startswith("_"))
        if found:
            return "n" if "n" in found else found[0]
    return "n"


def _stale_handle_text(names: tuple, kinds: tuple, handle=None, schedules: tuple = (), graphconst: tuple = ()) -> str:
    name = handle_name(handle)
    if graphconst:  # a GraphConst value changed in place: the programs hold the old one
        fields = "; ".join(graphconst)
        return (
            f"! this handle's GraphConst field {fields} changed in place since it was built. Its programs "
            f"were compiled with the value it had then, and it keeps running them; to compile for the new "
            f"value, rebuild it: `{name} = {name}.rebuild()` (or give the experiment a new value, "
            f"`dataclasses.replace(e, ...)`, and build a new handle)"
        )
    if not names:  # only a schedule was edited: the programs are current
        return (
            f"! this handle's {', '.join(schedules)} was redefined. It keeps calling the one it was built "
            f"with; to use the current code, rebuild it: `{name} = {name}.rebuild()`"
        )
    also = f"; its {', '.join(schedules)} was redefined too" if schedules else ""
    return (
        f"! this handle's compiled programs had dependency methods redefined: {some(names)} "
        f"({', '.join(sorted(set(kinds)))}){also}. It keeps running the programs it was built with; to "
        f"use the current code, rebuild it: `{name} = {name}.rebuild()`"
    )


def _disk_edit_text(names: tuple) -> str:
    return (
        f"nitro_ipy: edited on disk, not loaded yet: {some(names)}. The running code is unchanged; "
        f"`importlib.reload` the module (or use `%autoreload 2`) to pick the edit up."
    )


def _recompile_loop_text(program: str, why: str, compiles: int = 0, calls: int = 0) -> str:
    if compiles:  # a `nitro_ipy.jit` function: most of its calls compiled
        return (
            f"nitro_ipy: recompile loop: `{program}` compiled {compiles} programs in {calls} calls ({why}). "
            f"Each new argument shape, dtype or static value compiles a program; pad shapes to a few sizes, "
            f"and pass values that vary per call as arrays rather than as static arguments."
        )
    return (
        f"nitro_ipy: recompile loop: the `{program}` program compiled again after step 1 ({why_summary(why)}). "
        f"Something in its key moves every step; every step pays a compile. Usual causes: a GraphConst "
        f"field rebuilt with a new value, an optimizer state whose shape or dtype changes, batch shapes "
        f"that vary."
    )


def _epoch_text(record: dict) -> str:
    parts = [f"epoch {record['epoch']}"]
    for k, v in record.items():
        if k != "epoch" and isinstance(v, float):
            parts.append(f"{k} {v:.4g}")
    if record.get("skipped"):
        parts.append(f"skipped {_plural(record['skipped'], 'non-finite step')}")
    if record.get("stopped"):  # early stopping fired at this epoch (`_runs.EarlyStop`)
        parts.append(f"stopped: {record['stopped']}")
    return "nitro_ipy: " + " | ".join(parts)


def _mixed_code_text(program: str, names: tuple, others: tuple) -> str:
    return (
        f"nitro_ipy: this run compiled its `{program}` program after {some(names)} changed: `{program}` "
        f"runs the new code, {', '.join(f'`{o}`' for o in others)} the code the run started with. To train "
        f"and validate one version: `run.stop(); run.wait(); n = n.rebuild()`, then train again."
    )


def _interrupted_text(where: str, reason: str | None = None) -> str:
    if reason:
        return f"training stopped at {where}: {reason}; the handle is usable"
    return f"training interrupted at {where}; the handle is usable"


TEXT: dict[Kind, Callable[..., str]] = {
    Kind.COMPILE: _compile_text,
    Kind.STALE_CACHE: _stale_cache_text,
    Kind.STALE_HANDLE: _stale_handle_text,
    Kind.DISK_EDIT: _disk_edit_text,
    Kind.RECOMPILE_LOOP: _recompile_loop_text,
    Kind.EPOCH: _epoch_text,
    Kind.LARGE_CONSTANT: _large_constant_text,
    Kind.STORE_REFUSED: _store_refused_text,
    Kind.STORE_FALLBACK: _store_fallback_text,
    Kind.STORE_OFF: _store_off_text,
    Kind.RESUMED: _resumed_text,
    Kind.MIXED_CODE: _mixed_code_text,
    Kind.INTERRUPTED: _interrupted_text,
    Kind.LOGGER: lambda text: text,
}


def _folds(kind: Kind, data: dict) -> tuple:
    """The full lists a kind's text sums up."""
    if kind == Kind.COMPILE:
        why = data["entry"].why
        return why.folded() if isinstance(why, Explanation) else ()
    if kind == Kind.RECOMPILE_LOOP:
        why = data.get("why")
        return why.folded() if isinstance(why, Explanation) else ()
    names = data.get("names") or ()
    return _fold(f"all {len(names)} names", names)


class Look(NamedTuple):
    """How a kind of message is drawn in a notebook: a quiet `line` (monospace, muted: what a log holds),
    or a `box` in a `tone` (info, warning, error, success) with an optional title, for what asks the
    reader to act or know. In text it is its line either way."""

    box: bool
    tone: str = "plain"
    title: Callable[[dict], str] | None = None


_LINE = Look(False)
LOOKS: dict[Kind, Look] = {
    Kind.COMPILE: _LINE,
    Kind.EPOCH: _LINE,
    Kind.RESUMED: _LINE,
    Kind.STORE_REFUSED: _LINE,
    Kind.STORE_OFF: Look(True, "info"),
    Kind.STORE_FALLBACK: Look(True, "info"),
    Kind.STALE_CACHE: Look(True, "info", lambda d: f"Edit seen: {_plural(d['count'], 'cached program')} poisoned"),
    Kind.STALE_HANDLE: Look(True, "warning", lambda d: "This handle runs code compiled before your edit"),
    Kind.DISK_EDIT: Look(True, "warning", lambda d: "Edited on disk, not loaded yet"),
    Kind.RECOMPILE_LOOP: Look(True, "warning", lambda d: f"Recompile loop in the `{d['program']}` program"),
    Kind.LARGE_CONSTANT: Look(True, "warning", lambda d: f"A large constant in the `{d['program']}` program"),
    Kind.MIXED_CODE: Look(True, "warning", lambda d: f"Mixed code in the `{d['program']}` program"),
    Kind.INTERRUPTED: Look(True, "warning"),
    Kind.LOGGER: Look(True, "warning"),
}


def message(kind: Kind, **data) -> Message:
    """The message of `kind` about `data`, its text composed by the kind's builder."""
    kind = Kind(kind)
    return Message(kind, TEXT[kind](**data), data, _folds(kind, data))


# While a terminal's progress bar is drawn (`_progress.TextFront`), lines go through it (tqdm's `write`),
# so a line said mid-epoch lands above the bar instead of through it.
bar_writer: Callable[[str], None] | None = None


def print_sink(msg: Message) -> None:
    """The text front end: the message's line on stdout (above a terminal's progress bar, if one is drawn)."""
    writer = bar_writer
    if writer is not None:
        try:
            return writer(msg.text)
        except Exception:  # noqa: BLE001 - a closed bar: print as usual
            pass
    print(msg.text, file=sys.stdout, flush=True)


_sink: Callable[[Message], None] = print_sink
# A thread's own sink, over the process-wide one: a background run collects its messages here, so its
# worker thread never prints into whichever cell runs now, nor touches a widget (`_runs.py`).
_local = threading.local()


def emit(kind: Kind, **data) -> Message:
    """Compose the message and send it to the current sink; a failing sink degrades to plain text, never
    raises. Under `jax.distributed` only process 0 says anything (`_sharding.is_main_process`): the
    others compose the message and return it."""
    return send(message(kind, **data))


def send(msg: Message) -> Message:
    """Send a composed message (one a background thread composed and held, say) to the current sink;
    on a process other than 0 of a `jax.distributed` run, nothing is said."""
    if not is_main_process():
        return msg
    target = getattr(_local, "sink", None) or _sink
    try:
        target(msg)
    except Exception:
        print_sink(msg)
    return msg


@contextlib.contextmanager
def thread_sink(fn: Callable[[Message], None]):
    """Send the messages this thread emits inside the block to `fn` instead of the current sink."""
    previous = getattr(_local, "sink", None)
    _local.sink = fn
    try:
        yield fn
    finally:
        _local.sink = previous


def sink() -> Callable[[Message], None]:
    """The sink messages go to now."""
    return _sink


def set_sink(new: Callable[[Message], None] | None) -> Callable[[Message], None]:
    """Install `new` (None restores plain text); returns the previous one."""
    global _sink
    previous = _sink
    _sink = new or print_sink
    return previous
