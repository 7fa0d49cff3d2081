"""Recording: `with record() as r:` notes the user functions a trace runs and turns them into `r.closure`."""

from __future__ import annotations

import threading

from .._base import _origin, _world
from ._builder import Builder
from ._index import Frame, traceback_functions
from ._model import Closure
from ._probes import probes
from ._records import MISSING
from ._resolve import static_attr, underlying


class Recorder:
    """Records the dependency closure of the code run inside `with record() as r:`; `r.closure` after.

    Nested recorders in one thread all receive every event (the outer one also depends on what the inner
    one traced); recorders in other threads are independent. In the `traceback` mode the code inside the
    block hands each traced jaxpr over with `r.traced(jaxpr)`.
    """

    __slots__ = ("closure", "kept", "fields", "settled", "_keep", "_frames", "_attrs", "_fields", "_jaxprs",
                 "_roots", "_mode", "_tid", "_mark")

    def __init__(self, keep: bool = False):
        self.closure: Closure | None = None
        # With `keep`: `(frames, class attrs, fields)` the recording saw, for `replay` into a later recording.
        self.kept: tuple = ((), (), ())
        # After the block: the experiment fields traced code read through the compile view
        # (`note_field_read`), replays included: what a program's GraphConst key component is matched on.
        self.fields: frozenset = frozenset()
        # After the block: False when a cell's statements may have run in another thread while this one
        # traced (`_world.trace_ended`): the closure holds the globals as they are at the end, and the trace
        # may have read others. A background compile drops such a program; the cell's own thread is
        # always settled.
        self.settled: bool = True
        self._fields: set = set()
        self._keep = keep
        self._frames: dict[int, Frame] = {}  # id(code) -> the function as it ran
        self._attrs: dict[tuple, tuple] = {}  # (id(cls), name) -> (cls, name, attr)
        self._jaxprs: list = []  # traced jaxprs (traceback mode)
        self._roots: list = []  # the functions traced (traceback mode)
        self._mode = None
        self._tid = None

    def __enter__(self) -> Recorder:
        self._tid = threading.get_ident()
        self._mark = _world.trace_begun()
        try:
            self._mode = probes.enter(self)
        except BaseException:
            _world.trace_ended(self._mark)
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            probes.exit(self)
            if self._jaxprs:
                roots = [*self._roots, *(attr for _cls, _name, attr in self._attrs.values())]
                for frame in traceback_functions(self._jaxprs, roots):
                    self._frames.setdefault(id(frame.code), frame)
            builder = Builder()
            builder.via_class = {id(fn.__code__) for _cls, _name, attr in self._attrs.values()
                                 for fn in underlying(attr)}
            frames = [f for f in self._frames.values() if f is not None]
            self.fields = frozenset(self._fields)
            if self._keep:
                self.kept = (tuple(frames), tuple(self._attrs.values()), self.fields)
            for code, ns, _cells in frames:
                builder.executed.add((ns.get("__name__") or "?", code.co_qualname))
            for code, ns, cells in frames:
                builder.function(code, ns, cells)
            for cls, name, attr in self._attrs.values():
                builder.class_attr(cls, name, attr)
            self.closure = builder.build()
        finally:
            self.settled = _world.trace_ended(self._mark)  # after the build: what it read is what the trace read
        self._frames.clear()
        self._attrs.clear()
        self._fields.clear()
        self._jaxprs.clear()
        self._roots.clear()

    @property
    def mode(self) -> str | None:
        """The recording mode this recorder ran in (`monitoring`, `traceback`, `profile`)."""
        return self._mode

    def traced(self, jaxpr, fn=None) -> None:
        """Hand over what was traced inside this block (`compile_program` does); the probe modes saw it run.

        **Arguments:**
        - `jaxpr`: a jaxpr traced inside the block; the traceback mode reads the user functions from its
          equations' tracebacks, for every recorder of this thread.
        - `fn`: the function traced; their globals are searched for starting from it.
        """
        for rec in probes.active.get(self._tid, ()):
            if rec._mode == "traceback":
                rec._jaxprs.append(jaxpr)
                if fn is not None:
                    rec._roots.append(fn)

    def _note(self, frame, code) -> None:
        """A user function started: remember its code, globals and (closures) its cell values."""
        if id(code) in self._frames:
            return
        if code.co_filename.startswith("<") and _origin.is_generated(code, frame.f_globals):
            self._frames[id(code)] = None  # a dataclass's `__init__`: its library's code, not the user's
            return
        cells = None
        if code.co_freevars:
            try:
                local = frame.f_locals
                cells = [(n, local[n]) for n in code.co_freevars if n in local]
            except Exception:
                cells = None
        self._frames[id(code)] = Frame(code, frame.f_globals, cells)


class _HookRecorder(Recorder):
    """A `Recorder` that also notes each hook as read from the experiment class (`record_hooks`)."""

    __slots__ = ("_hooks",)

    def __init__(self, keep: bool, cls: type, names: tuple):
        super().__init__(keep)
        self._hooks = (cls, names)

    def __enter__(self) -> Recorder:
        super().__enter__()
        cls, names = self._hooks
        for name in names:
            attr = static_attr(cls, name)
            if attr is not MISSING:
                note_class_attr(cls, name, attr)
        return self


def record_hooks(cls: type, hooks: tuple):
    """A `record` for a program whose key holds `hooks` (`Key.hooks`: `((name, fingerprint), ...)`) of
    experiment class `cls`: each hook is a dependency as the class resolves it (`Sub.loss`, maybe
    inherited), so a subclass whose cell now overrides a hook it inherited is drift, and a base class
    re-run alone, which the subclass still does not inherit from, is not. The functions it resolves to
    are checked through that attribute, not by their own names (`Builder.function`)."""
    names = tuple(name for name, _fp in hooks)
    return lambda keep=False: _HookRecorder(keep, cls, names)


def record(keep: bool = False) -> Recorder:
    """A context manager recording the dependency closure of what runs inside it (in this thread).
    With `keep`, `r.kept` holds what it saw, for `replay`."""
    return Recorder(keep)


def replay(kept: tuple) -> None:
    """Tell every recorder active in this thread that the code a `record(keep=True)` saw ran again: a
    trace JAX served from its cache (`_reuse`) depends on that code as if it had run."""
    frames, attrs, fields = kept
    for rec in probes.active.get(threading.get_ident(), ()):
        for frame in frames:
            rec._frames.setdefault(id(frame.code), frame)
        for cls, name, attr in attrs:
            rec._attrs.setdefault((id(cls), name), (cls, name, attr))
        rec._fields.update(fields)


def note_class_attr(cls, name: str, attr) -> None:
    """Record that traced code read class attribute `cls.name` (the compile view calls this)."""
    stack = probes.active.get(threading.get_ident())
    if stack:
        for rec in stack:
            rec._attrs.setdefault((id(cls), name), (cls, name, attr))


def note_field_read(name: str) -> None:
    """Record that traced code read experiment field `name` through the compile view (the view calls
    this on every read): a program is served only where the GraphConst fields it read are unchanged."""
    stack = probes.active.get(threading.get_ident())
    if stack:
        for rec in stack:
            rec._fields.add(name)
