"""`nitro_ipy.jit`: `jax.jit` whose programs live in the module-level cache with their dependency closures.

A jitted function is not a fixed point: after an edit that moves what its trace depended on, its next
call compiles against the live code, once, and says why in one line. Between edits it is `jax.jit`:

- **Hot path.** Each *generation* (the function as traced against one version of the code) holds an
  inner `jax.jit`; a call compares the world counter with the one it last checked at and calls that
  inner object, so JAX's C++ dispatch does the work. The inner function JAX traces (`_Generation.traced`)
  notes that a trace ran; only then, after the call, does this module record the trace's dependency
  closure and put the program in the cache (`_Jitted._after_trace`): JAX keeps the trace and the
  executable it just built, so recording them re-traces and re-compiles nothing.
- **World moved.** The drift scan runs (`_cache.ensure_fresh`); a generation whose programs were
  poisoned, or whose nested traces' closures drifted, is replaced by a new one (or by a kept older one
  that is current again: an undone edit compiles nothing).
- **Adoption.** The first call of a generation looks its key up in the cache, then in the program store:
  a program compiled for the same code and arguments (the cell re-run, a restarted kernel) is called
  directly (`Compiled`), without a trace. A call that does not fit it goes to the inner `jax.jit`.
- **Nested.** Called inside another trace (`jax.grad`, `vmap`, an outer `jit`, `lax.scan`), JAX inlines
  it as `jax.jit` does; the outer recording sees its functions, and no program of its own is made.
"""

from __future__ import annotations

import functools
import inspect
import time
import types
import weakref

import jax

from .. import _closure
from .._base import _events, _report
from .._base._compat import XLA_RUNTIME_ERRORS
from .._base._fingerprint import Unfingerprintable, fingerprint, function_fingerprint
from .._base._report import Kind
from .._base._world import world
from . import _cache, _store
from ._explain import explain_miss

try:  # whether the caller is inside a trace (then JAX inlines the call: no program of its own)
    from jax._src.core import trace_state_clean as _top_level
except ImportError:  # pragma: no cover - moved in a later JAX: tell by the outputs instead
    _top_level = None

KIND = "jit"
# Generations a function keeps, newest last: an undone edit finds its old programs current again.
KEPT_GENERATIONS = 4
# Closures of nested traces a generation keeps (their drift replaces the generation).
NESTED_CLOSURES = 16
# A function compiles a recompile loop once at least this many of its programs of one generation were
# compiled and they outnumber the calls that reused one.
LOOP_COMPILES = 4

_live: weakref.WeakSet = weakref.WeakSet()  # every `_Jitted`, for hit counting and resets


def jit(fun=None, /, *, static_argnums=None, static_argnames=None, donate_argnums=None, donate_argnames=None,
        **options):
    """`jax.jit`, honest: programs in nitro_ipy's cache with their dependency closures, recompiled after
    an edit moves what they depend on.

    **Arguments:** those of `jax.jit`, with its meaning (`static_argnums`, `static_argnames`,
    `donate_argnums`, `donate_argnames`, `in_shardings`, `out_shardings`, `keep_unused`, `device`,
    `backend`, `inline`, `compiler_options`). Usable as `@nitro_ipy.jit`, `@nitro_ipy.jit(static_argnums=1)`
    and `functools.partial(nitro_ipy.jit, ...)`.

    **Returns:** a callable that keeps `__wrapped__`, `__name__` and `__doc__`, with `lower`, `trace`
    and `eval_shape` as a jitted function has them, and that binds as a method.
    """
    settings = dict(static_argnums=static_argnums, static_argnames=static_argnames, donate_argnums=donate_argnums,
                    donate_argnames=donate_argnames, **options)
    if fun is None:
        return functools.partial(jit, **settings)
    return _fast_class(fun)(fun, settings)


def _as_tuple(x, kind) -> tuple | None:
    if x is None:
        return None
    if isinstance(x, kind):
        return (x,)
    return tuple(x)


class _Generation:
    """The function as traced against one version of the code: its inner `jax.jit`, the programs it
    compiled or adopted, and the closures of its nested traces."""

    __slots__ = ("inner", "traced", "entries", "closures", "fingerprint", "compiles", "hits", "looped",
                 "adopted", "aot", "__weakref__")

    def __init__(self, owner: _Jitted):
        fun = owner.__wrapped__
        ref = weakref.ref(owner)

        def traced(*args, **kwargs):
            # What JAX traces: the user's function, with the trace's start, length and recording noted
            # for the call that triggered it (`_Jitted._after_trace`).
            t0 = time.perf_counter()
            with _closure.record() as recorder:
                out = fun(*args, **kwargs)
            jitted = ref()
            if jitted is not None:
                jitted.traced = (self, t0, time.perf_counter() - t0, recorder)
            return out

        functools.update_wrapper(traced, fun)  # JAX reads the signature and the name through it
        self.traced = traced
        self.inner = jax.jit(traced, **owner.settings)  # JAX's own errors for bad options, at decoration
        self.entries: list = []
        self.closures: list = []
        self.fingerprint = None
        self.compiles = 0
        self.hits = 0
        self.looped = False
        self.adopted = False
        self.aot = None  # the `jax.jit` that `lower`, `trace` and `eval_shape` go through

    def current(self, memo: dict) -> bool:
        """Whether nothing this generation's programs and nested traces depended on moved."""
        if any(e.poisoned for e in self.entries):
            return False
        return not any(c is None or c.drift(memo) for c in self.closures)

    def used(self) -> bool:
        return bool(self.entries or self.closures)


class _Jitted:
    """What `nitro_ipy.jit` returns. The call is the hot path: one world comparison, then the current
    generation's callable (the inner `jax.jit`, or an adopted program)."""

    def __init__(self, fun, settings: dict):
        if not callable(fun):
            jax.jit(fun)  # JAX's own error for a non-callable
        functools.update_wrapper(self, fun, updated=())
        self.settings = settings
        self.world = -1  # the world last checked at: the first call checks
        self.calls = 0  # calls since the last hit count (`_flush_hits`)
        self.traced = None  # set by a trace during the current call
        base = getattr(fun, "func", fun)  # a functools.partial: named after its function
        self.qualified = f"{getattr(base, '__module__', None) or '?'}.{getattr(base, '__qualname__', None) or type(base).__qualname__}"
        self._static = _StaticArgs(fun, settings)
        self._options = tuple(sorted(
            (name, repr(value)) for name, value in settings.items()
            if value is not None and name not in ("static_argnums", "static_argnames")
        ))
        self.gen = _Generation(self)
        self.kept: list[_Generation] = [self.gen]
        self.call = self.gen.inner
        _live.add(self)

    # ------------------------------------------------------------ the hot path
    def __call__(self, *args, **kwargs):
        if self.world == world():
            self.calls += 1
            try:
                out = self.call(*args, **kwargs)
            except TypeError:
                self.calls -= 1
                if self.call is self.gen.inner:
                    raise
                return self._misfit(args, kwargs)
            except BaseException:
                self.calls -= 1  # a call that raised reused nothing
                raise
            if self.traced is not None:
                return self._after_trace(args, kwargs, out)
            return out
        return self._enter(args, kwargs)

    def __get__(self, obj, objtype=None):
        return self if obj is None else types.MethodType(self, obj)

    def __repr__(self):
        return f"<nitro_ipy.jit of {self.qualified}>"

    # ------------------------------------------------------------ jax.jit's other methods
    def trace(self, *args, **kwargs):
        return self._aot("trace", args, kwargs)

    def lower(self, *args, **kwargs):
        return self._aot("lower", args, kwargs)

    def eval_shape(self, *args, **kwargs):
        return self._aot("eval_shape", args, kwargs)

    def _aot(self, method, args, kwargs):
        # A `jax.jit` of its own per generation: a trace JAX caches for `lower` must not stand in for the
        # trace of the call that compiles (which would then run no Python, and go unrecorded).
        self._refresh()
        gen = self.gen
        if gen.aot is None:
            gen.aot = jax.jit(self.__wrapped__, **self.settings)
        return getattr(gen.aot, method)(*args, **kwargs)

    # ------------------------------------------------------------ after an edit
    def _refresh(self) -> None:
        """Scan for drift if the world moved, and make the generation current."""
        if self.world == world():
            return
        _cache.ensure_fresh()
        now = world()
        memo: dict = {}
        if not self.gen.current(memo):
            _flush_one(self)  # the calls so far reused the old generation's programs
            again = [g for g in self.kept[:-1] if g.used() and g.current(memo)]
            if again:  # an edit undone: the programs of before it are current again
                self.gen = again[-1]
                self.kept.remove(self.gen)
            else:
                self.gen = _Generation(self)
            self.kept = [*self.kept, self.gen][-KEPT_GENERATIONS:]
            self.call = self.gen.inner
        self.world = now

    def _enter(self, args, kwargs):
        self._refresh()
        gen = self.gen
        if not gen.adopted and self.call is gen.inner and (_top_level is None or _top_level()):
            gen.adopted = True
            adopted = self._adopt(args, kwargs)
            if adopted is not None:
                try:
                    return self.call(*args, **kwargs)  # a hit (the lookup counted it) or a load (a miss)
                except TypeError:
                    return self._misfit(args, kwargs)
                except XLA_RUNTIME_ERRORS as err:
                    if adopted.origin != "disk":
                        raise
                    # A stored executable can load and still fail to run (`_compile.FirstRun`): the file
                    # goes, and JAX compiles the program as on a miss. (Nothing was donated: see `_adopt`.)
                    first = (str(err).strip().splitlines() or [""])[0]
                    _store.forget(adopted.key, f"loaded, but its first run failed: {type(err).__name__}: {first[:200]}")
                    return self._misfit(args, kwargs)
        return self._counted(args, kwargs)

    def _adopt(self, args, kwargs):
        """Call a program compiled before for this code and these arguments (the cache's, or the
        store's) directly. Returns its entry, or None when there is none."""
        try:
            key, info, statics = self._key(args, kwargs, self.gen)
        except Exception:  # noqa: BLE001 - an unhashable static, say: JAX's call raises its own error
            return None
        entry = _cache.lookup(key)
        # Not from disk for a function that donates: a stored program's first run may fail after XLA took
        # the donated buffers, and the retry would have none.
        donates = self.settings.get("donate_argnums") is not None or self.settings.get("donate_argnames") is not None
        if entry is None and not donates and not self.gen.fingerprint.startswith("id:"):
            why = explain_miss(key, info, _cache.explanation_candidates())
            entry = _store.load(key, info, why)
            if entry is not None:
                _cache.store(entry)
                if entry.why:
                    _report.emit(Kind.COMPILE, entry=entry)
                _events.signal("compiled", entry, False)  # a compile guard (`_guards`) may raise here
        if entry is None or entry.poisoned or entry.call is None:
            return None
        self.gen.entries.append(entry)
        self.call = _Direct(entry.call, self._static, statics) if statics else entry.call
        return entry

    def _misfit(self, args, kwargs):
        """A call an adopted program does not fit (another shape, structure or static value): from now
        on the inner `jax.jit` serves this generation."""
        self.call = self.gen.inner
        return self._counted(args, kwargs)

    def _counted(self, args, kwargs):
        """The hot path's call, for the slow paths: counted as a hit unless it compiles or raises."""
        self.calls += 1
        try:
            out = self.call(*args, **kwargs)
        except BaseException:
            self.calls -= 1
            raise
        if self.traced is not None:
            return self._after_trace(args, kwargs, out)
        return out

    # ------------------------------------------------------------ a call that traced
    def _after_trace(self, args, kwargs, out):
        """The call just traced and compiled (JAX did): record its closure and put the program in the
        cache, or, inside an outer trace, keep the closure for the generation's drift checks."""
        gen, t0, trace_s, recorder = self.traced
        self.traced = None
        self.calls -= 1  # a compile, not a hit
        if jax.config.jax_disable_jit:
            return out  # `jax.disable_jit()`: the function ran eagerly, nothing was compiled
        elapsed = time.perf_counter() - t0
        entries = len(gen.entries)
        try:
            self._register(gen, trace_s, elapsed, recorder, args, kwargs, out)
        except Exception:  # noqa: BLE001 - the call itself succeeded: its result is the user's
            # Unrecorded, so no edit could be seen: the generation is replaced at the next world bump.
            gen.closures = [*gen.closures, None][-NESTED_CLOSURES:]
            return out
        finally:
            self.traced = None
        if len(gen.entries) > entries:  # a program entered the cache: a compile guard may raise here
            _events.signal("compiled", gen.entries[-1], False)
        return out

    def _register(self, gen, trace_s, elapsed, recorder, args, kwargs, out):
        nested = not _top_level() if _top_level is not None else any(
            isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves((out, args, kwargs)))
        if recorder.mode == "traceback":  # the trace's functions are read from its jaxpr's tracebacks
            with _closure.record() as recorder:
                traced = gen.inner.trace(*args, **kwargs)  # JAX's cached trace: no Python runs again
                recorder.traced(traced.jaxpr, self.__wrapped__)
        elif not nested:
            traced = gen.inner.trace(*args, **kwargs)
        closure = recorder.closure
        if nested:
            gen.closures = [*gen.closures, closure][-NESTED_CLOSURES:]
            return out
        key, info, _statics = self._key(args, kwargs, gen)
        compiled = traced.lower().compile()  # JAX's executable of this call: compiles nothing again
        why = explain_miss(key, info, _cache.explanation_candidates())
        unstorable = None
        if gen.fingerprint.startswith("id:") or info.get("unstorable"):
            unstorable = info.get("unstorable") or "its function has no content fingerprint"
        elif _store.cache_dir() is not None:
            unstorable = _store.unstorable_reason(traced.jaxpr, closure)
        entry = _cache.Entry(key, compiled, trace_s, max(elapsed - trace_s, 0.0), closure, info, why,
                             unstorable=unstorable)
        if _cache.peek(key) is not None:
            _cache.discard(key)  # compiled again (a call an adopted program did not fit came back)
        _cache.store(entry)
        gen.entries.append(entry)
        gen.compiles += 1
        if not unstorable and entry.closure is not None:
            _store.save(entry)
        if why:
            _report.emit(Kind.COMPILE, entry=entry)
        if not gen.looped and gen.compiles >= LOOP_COMPILES and gen.compiles > gen.hits + self.calls:
            gen.looped = True
            _report.emit(Kind.RECOMPILE_LOOP, program=self.qualified, why=why or "its key moved",
                         compiles=gen.compiles, calls=gen.compiles + gen.hits + self.calls)
        return out

    # ------------------------------------------------------------ keys
    def _key(self, args, kwargs, gen: _Generation):
        """`(Key, info, statics)` of a call: the function's content fingerprint, its dynamic arguments'
        signature, its static arguments' fingerprints (their reprs in `info`, for explanations)."""
        if gen.fingerprint is None:
            try:
                gen.fingerprint = function_fingerprint(self.__wrapped__)
            except Exception:  # noqa: BLE001 - a callable object, a cell holding a lock: not storable
                gen.fingerprint = f"id:{id(self.__wrapped__)}"
        dyn_args, dyn_names, dyn_kwargs, statics = self._static.split(args, kwargs)
        tree, sigs = _cache.arg_signature(tuple(dyn_args), tuple(dyn_names))
        for name in sorted(dyn_kwargs):
            kw_tree, kw_sigs = _cache.arg_signature((dyn_kwargs[name],), (name,))
            tree, sigs = f"{tree}, {name}={kw_tree}", sigs + kw_sigs
        shown, fps, unstorable = {}, [], None
        for label, value in statics:
            try:
                fp = fingerprint(value, label)
            except Unfingerprintable as err:
                fp, unstorable = f"id:{id(value)}", f"static argument `{label}`: {err}"
            fps.append((label, fp))
            shown[label] = (fp, _short_repr(value))
        info = {"graphconst": shown, "graphconst_label": "static argument", "hook_label": "function"}
        if unstorable:
            info["unstorable"] = unstorable
        key = _cache.Key(KIND, self.qualified, ((self.qualified, gen.fingerprint),), (tree, sigs),
                         fingerprint(tuple(fps)) if fps else "", self._options)
        return key, info, statics


def _short_repr(value, n: int = 60) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001
        text = f"<{type(value).__qualname__}>"
    return text if len(text) <= n else text[: n - 3] + "..."


class _StaticArgs:
    """Which arguments of a call are static, as `jax.jit` decides it: `static_argnums` and
    `static_argnames`, each inferred from the other through the function's signature."""

    def __init__(self, fun, settings: dict):
        nums = _as_tuple(settings.get("static_argnums"), int)
        names = _as_tuple(settings.get("static_argnames"), str)
        try:
            params = list(inspect.signature(fun).parameters.values())
        except (TypeError, ValueError):
            params = []
        self.positional = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        either = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
        if nums is not None and names is None:
            names = tuple(self.positional[i] for i in nums if -len(self.positional) <= i < len(self.positional)
                          and self.positional[i] in either)
        elif names is not None and nums is None:
            nums = tuple(i for i, n in enumerate(self.positional) if n in names and n in either)
        self.nums, self.names = nums or (), frozenset(names or ())
        self.any = bool(self.nums or self.names)

    def split(self, args: tuple, kwargs: dict):
        """`(dynamic positional args, their labels, dynamic keyword args, [(label, static value)])`."""
        if not self.any:
            labels = [self.positional[i] if i < len(self.positional) else f"arg{i}" for i in range(len(args))]
            return args, labels, kwargs, []
        static_pos = {i % len(args) for i in self.nums if -len(args) <= i < len(args)} if args else set()
        dyn, labels, statics = [], [], []
        for i, a in enumerate(args):
            label = self.positional[i] if i < len(self.positional) else f"arg{i}"
            if i in static_pos:
                statics.append((label, a))
            else:
                dyn.append(a)
                labels.append(label)
        dyn_kwargs = {}
        for k, v in kwargs.items():
            if k in self.names:
                statics.append((k, v))
            else:
                dyn_kwargs[k] = v
        return dyn, labels, dyn_kwargs, statics


class _Direct:
    """An adopted program for a function with static arguments: called with the dynamic ones, when the
    static ones equal those it was compiled for (else `TypeError`, and the inner `jax.jit` takes over)."""

    __slots__ = ("compiled", "static", "statics")

    def __init__(self, compiled, static: _StaticArgs, statics: list):
        self.compiled, self.static, self.statics = compiled, static, statics

    def __call__(self, *args, **kwargs):
        dyn, _labels, dyn_kwargs, statics = self.static.split(args, kwargs)
        if statics != self.statics:
            raise TypeError("static arguments differ from the adopted program's")
        return self.compiled(*dyn, **dyn_kwargs)


# ---------------------------------------------------------------- the hot path, by signature
# `__call__(self, *args, **kwargs)` packs the arguments and unpacks them again for JAX: on a tiny function
# that is a third of the wrapper's cost (a 5 us dispatch: 1.12x against 1.08x, `benchmarks/bench_jit.py`).
# A function whose parameters are all plain (positional or keyword, no defaults, no `*args`/`**kwargs`)
# gets a `__call__` with its own parameters, passed on by position: `jax.jit` resolves static and donated
# arguments by name and by position alike, so the program is the same.
_FAST_CALL = """
def __call__(__nitro_self, {params}):
    if __nitro_self.world == world():
        __nitro_self.calls += 1
        try:
            out = __nitro_self.call({params})
        except TypeError:
            __nitro_self.calls -= 1
            if __nitro_self.call is __nitro_self.gen.inner:
                raise
            return __nitro_self._misfit(({params},), {{}})
        except BaseException:
            __nitro_self.calls -= 1
            raise
        if __nitro_self.traced is not None:
            return __nitro_self._after_trace(({params},), {{}}, out)
        return out
    return __nitro_self._enter(({params},), {{}})
"""
_fast_classes: dict = {}  # parameter names -> the `_Jitted` subclass with that `__call__`
_FAST_LIMIT = 256


def _fast_class(fun) -> type:
    """`_Jitted`, or its subclass whose `__call__` takes `fun`'s own parameters (see `_FAST_CALL`)."""
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        return _Jitted
    if not params or any(p.kind != p.POSITIONAL_OR_KEYWORD or p.default is not p.empty
                         or p.name.startswith("__nitro") for p in params):
        return _Jitted
    names = tuple(p.name for p in params)
    cls = _fast_classes.get(names)
    if cls is None:
        ns = {"world": world}
        exec(compile(_FAST_CALL.format(params=", ".join(names)), __file__, "exec"), ns)  # library code
        cls = type("_Jitted", (_Jitted,), {"__call__": ns["__call__"], "__module__": __name__})
        cls.__qualname__ = _Jitted.__qualname__  # fingerprints name the wrapper type: one name for all
        if len(_fast_classes) >= _FAST_LIMIT:
            _fast_classes.clear()
        _fast_classes[names] = cls
    return cls


# ---------------------------------------------------------------- counting and resets
def _flush_hits() -> None:
    """Count the calls that reused a program since the last count as cache hits, on the function's
    newest program (a function with several shapes has its hits counted on the newest one)."""
    for jitted in list(_live):
        _flush_one(jitted)


def _flush_one(jitted: _Jitted) -> None:
    n = jitted.calls
    if n <= 0:
        return
    jitted.calls -= n
    gen = jitted.gen
    gen.hits += n
    if gen.entries:
        _cache.count_hit(gen.entries[-1], n)


def _on_reset() -> None:
    """`cache_reset()` is the escape hatch for an edit nothing tracks: every jitted function compiles
    afresh on its next call (a handle built before it keeps its programs; a jitted function is no fixed
    point)."""
    for jitted in list(_live):
        jitted.calls = 0
        jitted.gen = _Generation(jitted)
        jitted.kept = [jitted.gen]
        jitted.call = jitted.gen.inner
        jitted.world = -1


_events.subscribe("counting", _flush_hits)
_events.subscribe("reset", _on_reset)
