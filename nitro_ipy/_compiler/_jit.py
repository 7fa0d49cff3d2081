"""`nitro_ipy.jit`: `jax.jit` whose programs live in the module-level cache with their dependency closures.

A jitted function is not a fixed point: after an edit that moves what its trace depended on, its next
call compiles against the live code, once, and says why in one line. Between edits it is `jax.jit`:

- **Shared state.** Every `jit` of one function with the same options shares one `_State`, found through
  a table keyed weakly on the function (as `jax.jit`'s share JAX's caches): `jit(f)(x)` written inline
  costs a lookup. The state holds the function weakly; each `_Jitted` holds it strongly.
- **Hot path.** Each *generation* (the function as traced against one version of the code) holds an
  inner `jax.jit` of a `_Traced` wrapper; a call compares the world counter with the one the state last
  checked at and calls that inner object, so JAX's C++ dispatch does the work. The wrapper notes that a
  trace ran; only then, after the call, does this module record the trace's dependency closure and put
  the program in the cache (`_State._after_trace`): JAX keeps the trace and the executable it just
  built, so recording them re-traces and re-compiles nothing.
- **World moved.** The drift scan runs (`_cache.ensure_fresh`); a generation whose programs were
  poisoned, or whose nested traces' closures drifted, is replaced by a new one (or by a kept older one
  that is current again: an undone edit compiles nothing).
- **Adoption.** The first call of a generation looks its key up in the cache, then in the program store:
  a program compiled for the same code and arguments (the cell re-run, a restarted kernel; not one
  compiled in the same world) is called directly (`_jit_args.Adopted`), without a trace, while JAX's
  configuration is the one it was adopted under. A call that does not fit it goes to the inner `jax.jit`.
- **Nested.** Called inside another trace (`jax.grad`, `vmap`, an outer `jit`, `lax.scan`), JAX inlines
  it as `jax.jit` does; the outer recording sees its functions, and no program of its own is made.
- **JAX's API.** `lower`, `trace` and `eval_shape` go through the inner `jax.jit` (sharing its traces);
  errors, `repr`, names and attributes are JAX's (`tools/jax_jit_suite.py` runs JAX's own tests).
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
from .._base._compat import (
    XLA_RUNTIME_ERRORS,
    exclude_from_tracebacks,
    jax_jit,
)
from .._base._fingerprint import Unfingerprintable, fingerprint, function_fingerprint
from .._base._report import Kind
from .._base._world import world
from . import _cache, _context, _store
from ._explain import explain_miss
from ._jit_args import Adopted, Pinned, StaticArgs, short_repr

try:  # whether the caller is inside a trace (then JAX inlines the call: no program of its own)
    from jax._src.core import trace_state_clean as _top_level
except ImportError:  # pragma: no cover - moved in a later JAX: tell by the outputs instead
    _top_level = None

KIND = "jit"
exclude_from_tracebacks(__file__)  # JAX's user frames (error locations, cache-miss lines) are the caller's
# Generations a function keeps, newest last: an undone edit finds its old programs current again.
KEPT_GENERATIONS = 4
# Closures of nested traces a generation keeps (their drift replaces the generation).
NESTED_CLOSURES = 16
# A function compiles a recompile loop once at least this many of its programs of one generation were
# compiled and they outnumber the calls that reused one.
LOOP_COMPILES = 4

_born: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # entry -> the world it was compiled in
_live: weakref.WeakSet = weakref.WeakSet()  # every `_State`, for hit counting and resets


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
    if fun is None:
        return functools.partial(jit, static_argnums=static_argnums, static_argnames=static_argnames,
                                 donate_argnums=donate_argnums, donate_argnames=donate_argnames, **options)
    # Every `jit` of one function with the same options shares one state, as `jax.jit`'s share JAX's caches
    # (keyed on the function): `jit(f)(x)` written inline costs a lookup, not a new trace or fingerprint.
    key = (_frozen(static_argnums), _frozen(static_argnames), _frozen(donate_argnums), _frozen(donate_argnames),
           tuple(sorted(options.items())) if options else ())
    known = _shared.get(id(fun))
    if known is not None and known[0]() is fun:
        try:
            state = known[1].get(key)
        except TypeError:  # an option that does not hash (a list of shardings): a state of its own
            state = None
        if state is not None:
            return state.cls(fun, state)
    settings = dict(static_argnums=static_argnums, static_argnames=static_argnames, donate_argnums=donate_argnums,
                    donate_argnames=donate_argnames, **options)
    checked = jax_jit(fun, **settings)  # JAX's own errors (a generator, a staticmethod, options), at decoration
    try:
        weakref.ref(fun)
    except TypeError:
        # JAX's own object: its call raises JAX's error (it keys its caches on the function, weakly). (And a
        # second `jax.jit` of such a callable crashes the process in JAX 0.10: there is no inner one.)
        return checked
    state = _State(fun, settings)
    jitted = state.cls(fun, state)
    _share(fun, key, state)
    return jitted


def _frozen(x):
    return tuple(x) if isinstance(x, list) else x


# id(function) -> (weak reference to it, {options: _State}); an entry goes with its function.
_shared: dict[int, tuple] = {}


def _share(fun, key, state) -> None:
    try:
        hash(key)
        known = _shared.get(id(fun))
        if known is None or known[0]() is not fun:
            ident = id(fun)
            known = (weakref.ref(fun, lambda _ref: _shared.pop(ident, None)), {})
            _shared[ident] = known
    except TypeError:  # a callable that cannot be weakly referenced, an unhashable option: not shared
        return
    known[1][key] = state


class _Traced:
    """What JAX traces for one generation: the user's function, with the trace's start, length and
    recording noted for the call that triggered it (`_State._after_trace`).

    It holds the function and the state weakly (the state is shared through a table keyed on the function,
    so it must not keep the function alive), and shows JAX the function through `__wrapped__`,
    `__signature__` and its names: static argument names resolve, the lowered module is named after the
    function, and debug info and `jax_explain_cache_misses` point at the user's own file."""

    def __init__(self, state: _State, gen: _Generation, fun):
        self._fun, self._state, self._gen = state.fun, weakref.ref(state), weakref.ref(gen)
        try:
            self.__signature__ = inspect.signature(fun)
        except (TypeError, ValueError):
            pass
        self.__name__ = _fun_name(fun)
        self.__qualname__ = getattr(fun, "__qualname__", self.__name__)
        self.__module__ = getattr(fun, "__module__", None)
        self.__doc__ = getattr(fun, "__doc__", None)

    @property
    def __wrapped__(self):
        return self._fun()

    def __call__(self, *args, **kwargs):
        fun = self._fun()
        t0 = time.perf_counter()
        with _closure.record() as recorder:
            out = fun(*args, **kwargs)
        state = self._state()
        if state is not None:
            state.traced = (self._gen(), t0, time.perf_counter() - t0, recorder)
        return out


class _Generation:
    """The function as traced against one version of the code: its inner `jax.jit`, the programs it
    compiled or adopted, and the closures of its nested traces."""

    __slots__ = ("inner", "entries", "closures", "fingerprint", "compiles", "hits", "looped", "adopted",
                 "__weakref__")

    def __init__(self, state: _State, fun):
        self.inner = jax_jit(_Traced(state, self, fun), **state.settings)
        self.entries: list = []
        self.closures: list = []
        self.fingerprint = None
        self.compiles = 0
        self.hits = 0
        self.looped = False
        self.adopted: set = set()  # the JAX configurations a program was looked up for (`_adopt`)

    def current(self, memo: dict) -> bool:
        """Whether nothing this generation's programs and nested traces depended on moved."""
        if any(e.poisoned for e in self.entries):
            return False
        return not any(c is None or c.drift(memo) for c in self.closures)

    def used(self) -> bool:
        return bool(self.entries or self.closures)


class _Jitted:
    """What `nitro_ipy.jit` returns: the function (`__wrapped__`, its names and attributes, as `jax.jit`'s
    object keeps them) and the state shared by every `jit` of it with the same options. The call is the
    hot path: one world comparison, then the current generation's callable (the inner `jax.jit`, or an
    adopted program)."""

    def __init__(self, fun, state: _State):
        d = self.__dict__
        d.update(getattr(fun, "__dict__", ()))  # `functools.wraps`'s attributes, as `jax.jit` forwards them
        for name in functools.WRAPPER_ASSIGNMENTS:
            try:
                d[name] = getattr(fun, name)
            except AttributeError:
                pass
        d["__wrapped__"] = fun
        d["_s"] = state

    # ------------------------------------------------------------ the hot path
    def __call__(self, *args, **kwargs):
        s = self._s
        if s.world == world():
            s.calls += 1
            try:
                out = s.call(*args, **kwargs)
            except TypeError:
                s.calls -= 1
                if s.call is s.gen.inner:
                    raise
                return s._misfit(args, kwargs)
            except BaseException:
                s.calls -= 1  # a call that raised reused nothing
                raise
            if s.traced is not None:
                return s._after_trace(args, kwargs, out)
            return out
        return s._enter(args, kwargs)

    def __get__(self, obj, objtype=None):
        return self if obj is None else types.MethodType(self, obj)

    @property
    def qualified(self) -> str:
        """The name its programs are keyed and shown under (the adoption of `eqx.filter_jit` sets it)."""
        return self._s.qualified

    @qualified.setter
    def qualified(self, name: str) -> None:
        self._s.qualified = name

    def __repr__(self):  # JAX's
        try:
            return f"<PjitFunction of {self.__wrapped__!r}>"
        except Exception:  # noqa: BLE001 - a failing repr, a deleted `__wrapped__`
            return "<PjitFunction>"

    def __reduce__(self):
        return _rejit, (self.__wrapped__, self._s.settings)

    def __getstate__(self):  # JAX's fields (`function_name`, ...)
        return self._s.gen.inner.__getstate__()

    # ------------------------------------------------------------ jax.jit's other methods
    def trace(self, *args, **kwargs):
        return self._s.ahead_of_time("trace", args, kwargs)

    def lower(self, *args, **kwargs):
        return self._s.ahead_of_time("lower", args, kwargs)

    def eval_shape(self, *args, **kwargs):
        return self._s.ahead_of_time("eval_shape", args, kwargs)

    def _cache_size(self) -> int:
        """The programs the function holds now, as `jax.jit`'s `_cache_size()` counts them."""
        s = self._s
        return s.gen.inner._cache_size() + (s.call is not s.gen.inner)

    def clear_cache(self) -> None:
        """Drop the function's compiled programs (JAX's and nitro_ipy's cache's): its next call compiles."""
        self._s.clear()


def _rejit(fun, settings):
    return jit(fun, **settings)


def _fun_name(fun) -> str:
    """The name JAX gives a function (its lowered module's `jit_<name>`): a partial's function's."""
    name = getattr(fun, "__name__", None)
    while name is None and isinstance(fun, functools.partial):
        fun = fun.func
        name = getattr(fun, "__name__", None)
    return name if isinstance(name, str) else "<unnamed function>"


class _State:
    """One function jitted with one set of options: its generations, the callable that serves calls, the
    hit count. Shared by every `jit` of the function with those options; holds the function weakly."""

    def __init__(self, fun, settings: dict):
        self.fun = weakref.ref(fun)
        self.settings = settings
        self.world = -1  # the world last checked at: the first call checks
        self.calls = 0  # calls since the last hit count (`_flush_hits`)
        self.traced = None  # set by a trace during the current call
        base = getattr(fun, "func", fun)  # a functools.partial: named after its function
        self.qualified = f"{getattr(base, '__module__', None) or '?'}.{getattr(base, '__qualname__', None) or type(base).__qualname__}"
        self._static = StaticArgs(fun, settings)
        self._options = tuple(sorted(
            (name, repr(value)) for name, value in settings.items()
            if value is not None and name not in ("static_argnums", "static_argnames")
        ))
        self.cls = _fast_class(fun)
        self.gen = _Generation(self, fun)
        self.kept: list[_Generation] = [self.gen]
        self.call = self.gen.inner
        _live.add(self)

    def clear(self) -> None:
        """`clear_cache()`: the programs of every generation leave the cache (and free their executables);
        the next call traces and compiles afresh."""
        _flush_one(self)
        for gen in self.kept:
            for entry in gen.entries:
                if _cache.peek(entry.key) is entry:
                    _cache.discard(entry.key)
            gen.inner.clear_cache()
        self.new_generation()

    def new_generation(self) -> None:
        self.calls = 0
        self.gen = _Generation(self, self.fun())
        self.kept = [self.gen]
        self.call = self.gen.inner
        self.world = -1

    def ahead_of_time(self, method: str, args, kwargs):
        """`trace`, `lower` or `eval_shape` through the current generation's inner `jax.jit`, so that they
        share its traces as `jax.jit`'s do. A trace they run stays noted (`traced`): the call that JAX then
        compiles from that cached trace runs no Python, and is recorded and cached from the note."""
        self._refresh()
        return getattr(self.gen.inner, method)(*args, **kwargs)

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
                self.gen = _Generation(self, self.fun())
            self.kept = [*self.kept, self.gen][-KEPT_GENERATIONS:]
            self.call = self.gen.inner
        self.world = now

    def _enter(self, args, kwargs):
        self._refresh()
        gen = self.gen
        context = _context.current()
        if context not in gen.adopted and self.call is gen.inner and (_top_level is None or _top_level()):
            gen.adopted.add(context)  # once per configuration: the store may hold this one's program
            adopted = self._adopt(args, kwargs)
            if adopted is not None:
                self.traced = None  # a note `lower` left: this call runs the adopted program, no trace
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
        known = _cache.peek(key)
        if known is not None and _born.get(known) == world():
            # Compiled since the last cell ran (or, in a script, since the last `bump_world()`): a new
            # function of the same code made in a loop, say. It traces as with `jax.jit`; a re-run cell,
            # a restarted kernel, adopt.
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
        call = Adopted(entry.call, self._static, statics) if statics else entry.call
        self.call = Pinned(call, key.context, self.fun)
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
                recorder.traced(traced.jaxpr, self.fun())
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
        _born[entry] = world()
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
                gen.fingerprint = function_fingerprint(self.fun())
            except Exception:  # noqa: BLE001 - a callable object, a cell holding a lock: not storable
                gen.fingerprint = f"id:{id(self.fun())}"
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
            shown[label] = (fp, short_repr(value))
        info = {"graphconst": shown, "graphconst_label": "static argument", "hook_label": "function"}
        if unstorable:
            info["unstorable"] = unstorable
        key = _cache.Key(KIND, self.qualified, ((self.qualified, gen.fingerprint),), (tree, sigs),
                         fingerprint(tuple(fps)) if fps else "", self._options)
        return key, info, statics


# ---------------------------------------------------------------- the hot path, by signature
# `__call__(self, *args, **kwargs)` packs the arguments and unpacks them again for JAX: on a tiny function
# that is a third of the wrapper's cost (a 5 us dispatch: 1.12x against 1.08x, `benchmarks/bench_jit.py`).
# A function whose parameters are all plain (positional or keyword, no defaults, no `*args`/`**kwargs`)
# gets a `__call__` with its own parameters, positional-only, passed on by position. A call that passes
# one by keyword (or leaves one out) takes the general `__call__`: JAX traces `f(x, y=1)` apart from
# `f(x, 1)` and reads `static_argnums` for positions only, so the keyword must reach it as a keyword.
_FAST_CALL = """
def __call__(__nitro_self, {defaulted}, /, **__nitro_kw):
    if __nitro_kw or {last} is __nitro_na:  # a keyword or a missing argument: JAX tells them apart
        return __nitro_generic(__nitro_self, *[a for a in ({params},) if a is not __nitro_na], **__nitro_kw)
    __nitro_s = __nitro_self._s
    if __nitro_s.world == __nitro_world():
        __nitro_s.calls += 1
        try:
            out = __nitro_s.call({params})
        except TypeError:
            __nitro_s.calls -= 1
            if __nitro_s.call is __nitro_s.gen.inner:
                raise
            return __nitro_s._misfit(({params},), {{}})
        except BaseException:
            __nitro_s.calls -= 1
            raise
        if __nitro_s.traced is not None:
            return __nitro_s._after_trace(({params},), {{}}, out)
        return out
    return __nitro_s._enter(({params},), {{}})
"""
_NA = object()  # an argument not passed by position
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
        ns = {"__nitro_world": world, "__nitro_na": _NA, "__nitro_generic": _Jitted.__call__}
        source = _FAST_CALL.format(params=", ".join(names), last=names[-1],
                                   defaulted=", ".join(f"{n}=__nitro_na" for n in names))
        exec(compile(source, __file__, "exec"), ns)  # library code
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
    for state in list(_live):
        _flush_one(state)


def _flush_one(state: _State) -> None:
    n = state.calls
    if n <= 0:
        return
    state.calls -= n
    gen = state.gen
    gen.hits += n
    if gen.entries:
        _cache.count_hit(gen.entries[-1], n)


def _on_reset() -> None:
    """`cache_reset()` is the escape hatch for an edit nothing tracks: every jitted function compiles
    afresh on its next call (a handle built before it keeps its programs; a jitted function is no fixed
    point)."""
    for state in list(_live):
        if state.fun() is not None:
            state.new_generation()


_events.subscribe("counting", _flush_hits)
_events.subscribe("reset", _on_reset)
