"""Compile guards: `no_compiles()` and `assert_max_compiles(n)`, context managers and decorators that raise
at the first compile past their bound, with the compile line that explains it.

A guard counts what the thread that entered it puts in the cache: a program it traced and compiled
(a handle's, or a `nitro_ipy.jit` function's), one it loaded from the program store, and one compiled
ahead in the background that it took or waited for. It hears them through the event bus (`compiled`,
signalled by the cache and the compilers once the program is in the cache): nothing is threaded
through the compilers, and with no guard entered no one listens. Loads are counted apart from
compiles, since a load traces nothing: they count against `loads=` only when it is given. Another
thread's compiles (a background run's, a compile ahead no one waits for) are not this guard's.
"""

from __future__ import annotations

import contextlib
import threading

from .._base import _events, _report
from .._base._errors import NitroError, NitroTypeError
from .._base._report import Kind


class CompileGuardError(NitroError):
    """A compile past a compile guard's bound (`no_compiles`, `assert_max_compiles`)."""


_local = threading.local()  # .guards: the guards this thread is inside, outermost first
_lock = threading.Lock()
_entered = [0, None]  # guards entered in any thread; the unsubscribe function while > 0


def _guards() -> list:
    guards = getattr(_local, "guards", None)
    if guards is None:
        guards = _local.guards = []
    return guards


def _compiled(entry, ahead: bool) -> None:
    """The `compiled` event: this thread put `entry` in the cache. Every guard it is inside counts it;
    the first one past its bound raises."""
    guards = getattr(_local, "guards", None)
    if not guards:
        return
    loaded = getattr(entry, "origin", "compiled") == "disk"
    line = _report.message(Kind.COMPILE, entry=entry, ahead=_report.AFTER_EDIT if ahead else "").text
    for guard in guards:
        guard._count(entry, loaded, line)
    for guard in guards:
        guard._check()


class CompileGuard(contextlib.ContextDecorator):
    """`with assert_max_compiles(n):` / `@assert_max_compiles(n)`: at most `n` compiles (and `loads`
    loads from the program store, when given) in the thread that runs the block. After the block,
    `compiles` and `loads` list the compile lines it counted."""

    def __init__(self, n: int, loads: int | None = None, *, name: str | None = None):
        for what, value in (("n", n), ("loads", loads)):
            if value is not None and (type(value) is not int or value < 0):
                raise NitroTypeError(f"`assert_max_compiles` takes a count >= 0 for `{what}`; got {value!r}.")
        self.n, self.max_loads = n, loads
        self.name = name or f"assert_max_compiles({n}{'' if loads is None else f', loads={loads}'})"
        self.compiles: list[str] = []
        self.loads: list[str] = []
        self._over: str | None = None  # "compile" or "load": what went past the bound
        self._raised = False

    def __enter__(self):
        self.compiles, self.loads, self._over, self._raised = [], [], None, False
        with _lock:
            _entered[0] += 1
            if _entered[0] == 1:
                _entered[1] = _events.subscribe("compiled", _compiled)
        _guards().append(self)
        return self

    def __exit__(self, *exc):
        guards = _guards()
        if self in guards:
            guards.remove(self)
        with _lock:
            _entered[0] -= 1
            if _entered[0] == 0:
                _entered[1]()
                _entered[1] = None
        return False

    def _count(self, entry, loaded: bool, line: str) -> None:
        if self._over is not None:
            return  # raised already: what follows is the error's own unwinding
        (self.loads if loaded else self.compiles).append(line)
        if len(self.compiles) > self.n:
            self._over = "compile"
        elif loaded and self.max_loads is not None and len(self.loads) > self.max_loads:
            self._over = "load"

    def _check(self) -> None:
        if self._over is None or self._raised:
            return
        self._raised = True
        raise CompileGuardError(self._message())

    def _message(self) -> str:
        if self._over == "load":
            count, bound, lines, what = len(self.loads), self.max_loads, self.loads, "load from the program store"
        else:
            count, bound, lines, what = len(self.compiles), self.n, self.compiles, "compile"
        head = (f"nitro_ipy.{self.name}: {what} {count} inside it, where at most {bound} may run"
                if bound else f"nitro_ipy.{self.name}: a {what} inside it")
        text = f"{head}:\n  {lines[-1]}"
        if len(lines) > 1:
            text += "\nbefore it:\n" + "\n".join(f"  {line}" for line in lines[:-1])
        if self._over == "compile" and self.loads:
            text += (f"\n({len(self.loads)} loaded from the program store, counted apart: a load traces "
                     f"nothing; `loads=` bounds them too)")
        return text + ("\nThe line says what moved (a new shape, a GraphConst value, an edit): keep it "
                       "fixed, or raise the bound if the compile is expected.")


def assert_max_compiles(n: int, *, loads: int | None = None) -> CompileGuard:
    """At most `n` programs compiled inside the block (a context manager) or the function (a
    decorator), in the thread that runs it; the first compile past `n` raises `CompileGuardError` with
    its compile line.

    **Arguments:**
    - `n`: how many compiles may run: a handle's programs, `nitro_ipy.jit` functions' programs, and
      programs compiled ahead in the background that the block took or waited for.
    - `loads`: how many programs may load from the program store (`NITRO_IPY_CACHE_DIR`); None (the
      default) counts them apart without a bound: a load traces and compiles nothing.

    **Returns:** the guard; after the block, `guard.compiles` and `guard.loads` hold the lines counted.
    """
    return CompileGuard(n, loads)


def no_compiles(*, loads: int | None = None) -> CompileGuard:
    """`assert_max_compiles(0)`: the first compile inside the block raises `CompileGuardError` with the
    line that explains it (what moved). Loads from the program store pass unless `loads=` bounds them."""
    return CompileGuard(0, loads, name="no_compiles()" if loads is None else f"no_compiles(loads={loads})")
