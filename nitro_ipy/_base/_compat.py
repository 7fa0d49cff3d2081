"""Every JAX/XLA internal nitro_ipy relies on, in one place, each with a test in `tests/test_compat.py`.

A JAX upgrade has one file to look at: when a test here fails, the function beside it is what to fix.
Each function degrades (returns None / False / an empty answer) rather than raising where the internal
is missing, and says in its docstring what the caller falls back to.
"""

import contextlib
import functools
import re
import threading
import weakref

import jax
from jax.sharding import Mesh

# Type names of JAX's custom-derivative wrappers (`jax.custom_jvp`, `jax.custom_vjp`): the public classes
# are re-exported under other module paths across releases, so they are matched by name.
_CUSTOM_DERIVATIVE_TYPES = ("custom_jvp", "custom_vjp")
# The attributes of those wrappers holding user functions: the primal and its rules.
CUSTOM_DERIVATIVE_PARTS = ("fun", "jvp", "fwd", "bwd")


def is_custom_derivative(obj) -> bool:
    """True for a `jax.custom_jvp` / `jax.custom_vjp` wrapper (its primal is `obj.fun`)."""
    return type(obj).__name__ in _CUSTOM_DERIVATIVE_TYPES and hasattr(obj, "fun")


@functools.cache
def tracebacks_usable() -> bool:
    """Whether this jaxlib's tracebacks hand out their code objects (`Traceback.raw_frames`).

    Without it the 3.11 recorder falls back to `sys.setprofile` (the `profile` mode)."""
    try:
        from jax._src.lib import xla_client
    except Exception:
        return False
    return callable(getattr(xla_client.Traceback, "raw_frames", None))


def traceback_codes(tb) -> list:
    """The code objects of an equation's source traceback, innermost first (`Traceback.raw_frames`)."""
    return tb.raw_frames()[0]


def equation_traceback(eqn):
    """The Python traceback JAX kept for a jaxpr equation, or None."""
    return eqn.source_info.traceback


def sub_jaxprs(params: dict) -> list:
    """The jaxprs an equation carries in its params (pjit, scan, cond branches, while, custom_jvp/vjp,
    remat): any param value, or item of a tuple/list value, with `eqns` (a ClosedJaxpr holds its Jaxpr)."""
    out = []
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                out.append(inner)
    return out


def jaxpr_eqns(jaxprs: list):
    """Every equation of `jaxprs` (Jaxpr or ClosedJaxpr) and of the jaxprs they carry, at any depth; a
    jaxpr reached twice (a cached inner jit called twice) is walked once."""
    stack, seen = [getattr(j, "jaxpr", j) for j in jaxprs], {}
    while stack:
        jaxpr = stack.pop()
        if id(jaxpr) in seen:
            continue
        seen[id(jaxpr)] = jaxpr  # held for the walk, so no id is reused by a new object
        for eqn in jaxpr.eqns:
            yield eqn
            if eqn.params:
                stack.extend(sub_jaxprs(eqn.params))


def compiled_in_avals(compiled) -> list | None:
    """The abstract values of a `jax.stages.Compiled`'s positional arguments, one pytree per argument,
    or None where this JAX does not expose them (`Compiled.in_avals`)."""
    try:
        return list(compiled.in_avals[0])
    except Exception:
        return None


def compiled_out_avals(compiled):
    """The abstract values of a `jax.stages.Compiled`'s outputs (`Compiled.out_info`), or None."""
    try:
        return compiled.out_info
    except Exception:
        return None


# XLA refuses an option it does not know with this text (options come and go between releases).
_UNKNOWN_OPTION = re.compile(r"No such compile option: '([^']+)'")


def unknown_compile_option(err: BaseException) -> str | None:
    """The option name when `err` is XLA refusing an unknown compile option, else None."""
    found = _UNKNOWN_OPTION.search(str(err))
    return None if found is None else found.group(1)


# XLA:CPU option names nitro_ipy sets (see `_compile.py` for why each is set). An XLA that does not know
# one drops it (`unknown_compile_option`).
YNN_FUSION_OPTION = "xla_cpu_experimental_ynn_fusion_type"
FUSION_EMITTERS_OPTION = "xla_cpu_use_fusion_emitters"
OPTIMIZATION_LEVEL_OPTION = "xla_backend_optimization_level"


def default_backend() -> str:
    return jax.default_backend()


def _registered_caches() -> list:
    """JAX's registry of its memo caches (`jax._src.util._caches`), or None where it moved."""
    try:
        from jax._src import util
    except Exception:
        return None
    caches = getattr(util, "_caches", None)
    return None if caches is None else list(caches.items())


# Trace caches keyed on a `lu.WrappedFun` (no weak key to evict by): cleared whole. They hold traces only,
# never an executable, so clearing one costs a re-trace of what uses it next, not a compile.
_WRAPPED_FUN_TRACE_CACHES = ("_cached_trace_to_jaxpr",)


def evict_traces(is_user) -> bool:
    """Drop JAX's cached *traces* of the functions `is_user(fn)` accepts (an inner `jax.jit`, a
    `lax.scan` body, a `jax.checkpoint`), leaving every other cache, and every compiled executable of
    the user's own `jax.jit` functions, in place.

    The weak-keyed trace caches (`WeakrefLRUCache`: key[0] is a weak reference to the traced function)
    are evicted per function; the few keyed on wrapped functions are cleared whole.

    **Returns:** False when JAX's registry is not where this expects it: call `jax.clear_caches()` then.
    """
    caches = _registered_caches()
    if caches is None:
        return False
    for cache, name in caches:
        keys = getattr(cache, "cache_keys", None)
        evict = getattr(cache, "evict_weakref", None)
        if keys is not None and evict is not None:
            users = {}
            for key in keys():
                ref = key[0] if isinstance(key, tuple) and key else None
                fn = ref() if isinstance(ref, weakref.ref) else None
                if fn is not None and id(fn) not in users and is_user(fn):
                    users[id(fn)] = fn
            for fn in users.values():
                evict(fn)
        elif any(part in name for part in _WRAPPED_FUN_TRACE_CACHES):
            cache.cache_clear()
    return True


def ambient_mesh():
    """The concrete mesh made current by `jax.set_mesh(mesh)` / `jax.sharding.use_mesh(mesh)` (or, on a
    JAX without them, `with mesh:`), or None when none is set: the handle then runs on one device."""
    get = getattr(jax.sharding, "get_mesh", None)
    if get is not None:  # asked at every entry point: one call, no fallback
        try:
            mesh = get()
        except Exception:
            return None
        return mesh if isinstance(mesh, Mesh) and not mesh.empty else None
    try:  # `with mesh:` (older JAX): the resource environment's physical mesh
        from jax._src import mesh as mesh_lib

        mesh = mesh_lib.thread_resources.env.physical_mesh
    except Exception:
        return None
    return mesh if isinstance(mesh, Mesh) and not mesh.empty else None


def auto_axes(mesh):
    """`mesh` with every axis in Auto mode (XLA propagates shardings, as `jax.jit` with shardings on the
    arguments expects); `jax.make_mesh` builds Explicit axes on newer JAX, under which a matmul of a
    batch split on `data` by a weight split on `data` is a type error rather than a gather. A mesh that
    is already Auto, or a JAX without axis types, returns `mesh` itself."""
    axis_type = getattr(jax.sharding, "AxisType", None)
    types = getattr(mesh, "axis_types", None)
    if axis_type is None or types is None or all(t == axis_type.Auto for t in types):
        return mesh
    return type(mesh)(mesh.devices, mesh.axis_names, axis_types=(axis_type.Auto,) * len(mesh.axis_names))


def mesh_context(mesh):
    """A context manager making `mesh` the current mesh: `jax.set_mesh`, else `jax.sharding.use_mesh`,
    else (older JAX) the mesh itself."""
    for setter in (getattr(jax, "set_mesh", None), getattr(jax.sharding, "use_mesh", None)):
        if setter is not None:
            return setter(mesh)
    return mesh


# The config option choosing the CPU backend's cross-process collectives (`"gloo"` for a multi-process run
# on CPU: without it, a program spanning processes fails at its first all-reduce).
CPU_COLLECTIVES_OPTION = "jax_cpu_collectives_implementation"


def is_concrete_array(v) -> bool:
    """True for a `jax.Array` holding data, not a tracer met during a trace (`jax.core.Tracer`, a class
    JAX keeps under `jax.core`). Identity snapshots hold only concrete arrays; a tracer has none."""
    return isinstance(v, jax.Array) and not isinstance(v, jax.core.Tracer)


# ---------------------------------------------------------------- the program store (`_store.py`)
# Primitives whose compiled form calls back into this Python process: an executable holding one cannot be
# stored and loaded in another process (the callback is a pointer into this one).
HOST_CALLBACK_PRIMITIVES = ("pure_callback", "io_callback", "debug_callback", "callback", "debug_print")


def _runtime_errors() -> tuple:
    """The exception types XLA raises when running an executable (`JaxRuntimeError` in newer JAX,
    `XlaRuntimeError` before)."""
    out = []
    err = getattr(jax.errors, "JaxRuntimeError", None)
    if isinstance(err, type):
        out.append(err)
    try:
        from jax._src.lib import xla_client

        err = getattr(xla_client, "XlaRuntimeError", None)
        if isinstance(err, type) and err not in out:
            out.append(err)
    except Exception:
        pass
    return tuple(out) or (RuntimeError,)


XLA_RUNTIME_ERRORS = _runtime_errors()


def serialize_compiled(compiled) -> tuple[bytes, object, object]:
    """`(payload, in_tree, out_tree)` of a `jax.stages.Compiled` (`jax.experimental.serialize_executable`).

    Raises where this executable cannot be serialized (JAX raises ValueError / NotImplementedError for
    closed-over constants or mutable refs); the caller falls back to JAX's persistent compilation cache."""
    from jax.experimental import serialize_executable

    return serialize_executable.serialize(compiled)


def compiled_device_ids(compiled) -> list[int] | None:
    """The ids of the devices `compiled` runs on, in its device assignment's order (what XLA compiled it
    for: one device for a one-device program, the mesh's devices for a sharded one), or None where this
    JAX does not say."""
    devices = getattr(getattr(compiled._executable, "_unloaded_executable", None), "device_list", None)
    try:
        return [d.id for d in devices]
    except TypeError:
        return None


def deserialize_compiled(payload: bytes, in_tree, out_tree, device_ids: list[int] | None = None,
                         find_class=None):
    """The `jax.stages.Compiled` that `serialize_compiled` wrote, loaded on this process's default backend,
    on the devices `device_ids` names (`compiled_device_ids`; None: every device of the backend, which
    is right only for a program that spans them all). Runs pickle on `payload`: only for files this
    user's own store wrote (`_store.py` checks them first); `find_class(module, name)`, when given,
    resolves every global the pickle names (`serialize_executable.deserialize_and_load`, with JAX's
    unpickler restricted to what it returns)."""
    from jax.experimental import serialize_executable

    devices = None
    if device_ids is not None:
        by_id = {d.id: d for d in jax.devices()}
        devices = [by_id[i] for i in device_ids]  # a KeyError: the caller refuses the file
    if find_class is None:
        return serialize_executable.deserialize_and_load(payload, in_tree, out_tree, execution_devices=devices)
    import io

    base = serialize_executable._JaxPjrtUnpickler

    class Restricted(base):
        def find_class(self, module, name):
            return find_class(module, name)

    backend = jax.devices()[0].client
    loaded = Restricted(io.BytesIO(payload), backend, devices).load()
    if len(loaded) == 3:  # JAX before its serialization versions: (executable, args, no_kwargs)
        (unloaded, args_info_flat, no_kwargs), const_args = loaded, []
    else:  # (version, executable, args, no_kwargs, closed-over constants): JAX 0.12.1 writes version 3
        _version, unloaded, args_info_flat, no_kwargs, const_args = loaded[:5]
    args_info = in_tree.unflatten(args_info_flat)
    return jax.stages.Compiled(unloaded.load(), const_args, args_info, out_tree, no_kwargs=no_kwargs)


def is_pytree_node_type(cls) -> bool:
    """Whether JAX flattens instances of `cls` as tree nodes: registered (`register_pytree_node`,
    `register_dataclass`, Flax and Equinox classes) or a named tuple."""
    if issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple):
        return True
    try:
        from jax._src import tree_util

        return cls in tree_util._registry
    except Exception:  # where JAX moved its registry: only named tuples and built-in nodes load
        return False


def enable_jax_compilation_cache(path: str, max_bytes: int = -1) -> bool:
    """Point JAX's own persistent compilation cache at `path` and cache every executable (no minimum
    compile time or size; at most `max_bytes`, least recently used first), unless the user configured a
    directory of their own.

    **Returns:** True when JAX's cache now writes to `path`."""
    current = jax.config.jax_compilation_cache_dir
    if current and current != path:
        return False
    if current != path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        import importlib.util

        if max_bytes > 0 and importlib.util.find_spec("filelock") is not None:  # JAX's cap needs filelock
            try:
                jax.config.update("jax_compilation_cache_max_size", int(max_bytes))
            except Exception:  # an older JAX without a size cap
                pass
        try:  # JAX initializes its cache once per process, on the first compile: start it again at `path`
            from jax._src import compilation_cache

            compilation_cache.reset_cache()
        except Exception:
            pass
    return True


def use_jax_cache(cache) -> bool:
    """Make `cache` (an object with JAX's `get(key)` and `put(key, value)`) the one JAX's persistent
    compilation cache reads and writes, in place of the file cache JAX would make on its first compile
    (`jax._src.compilation_cache._cache`, the same in JAX 0.10 to 0.12). Returns False where this JAX
    keeps its cache elsewhere (its own file cache then serves)."""
    try:
        from jax._src import compilation_cache as cc

        with cc._cache_initialized_mutex:
            cc._cache = cache
            cc._cache_initialized = True
        return True
    except Exception:
        return False


def jax_cache():
    """The cache object JAX's persistent compilation cache uses now (None before its first compile)."""
    try:
        from jax._src import compilation_cache as cc

        return cc._cache
    except Exception:
        return None


# XLA:CPU cannot serialize an executable that was itself deserialized: the copy loads, then fails on its
# first run with `NOT_FOUND: Function <fusion> not found`. JAX's persistent cache (on for setup's eager
# operations, `enable_jax_compilation_cache`) hands out deserialized executables, so a program of ours
# compiled through it must not be written to our store, and should not be written to JAX's cache either
# (the store holds it, and a later compile of the same HLO would be served the unstorable copy).
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_served = threading.local()


def _on_jax_event(event: str, **kwargs) -> None:
    if event == _CACHE_HIT_EVENT and getattr(_served, "watching", False):
        _served.hit = True


@functools.cache
def _listen_for_cache_hits() -> bool:
    try:
        from jax import monitoring

        monitoring.register_event_listener(_on_jax_event)
        return True
    except Exception:
        return False


@contextlib.contextmanager
def own_compile(write_jax_cache: bool):
    """Compile one of our programs: yields a dict whose `"from_jax_cache"` is True afterwards when JAX's
    persistent cache served the executable (the caller must not serialize it: see above). Unless
    `write_jax_cache`, the compile is kept out of JAX's cache (a thread-local minimum compile time);
    a program our store cannot hold passes True, so it still skips XLA after a restart."""
    out = {"from_jax_cache": False}
    _listen_for_cache_hits()
    _served.watching, _served.hit = True, False
    try:
        if write_jax_cache:
            yield out
        else:
            with _no_jax_cache_writes():
                yield out
    finally:
        out["from_jax_cache"] = _served.hit
        _served.watching = _served.hit = False


def _no_jax_cache_writes():
    """A context under which JAX writes nothing to its persistent cache (this thread only)."""
    try:
        from jax._src import config

        return config.persistent_cache_min_compile_time_secs(float("inf"))
    except Exception:  # an older JAX: our programs are written there too (only disk space)
        return contextlib.nullcontext()


# JAX's own `jit`, resolved once, at import: nitro_ipy calls it, never `jax.jit` by attribute, so a `jax.jit`
# pointed at `nitro_ipy.jit` (the extension's adoption, JAX's test suite run through nitro_ipy) never
# recurses. (`jax._src.api.jit` is the object `jax.jit` re-exports.)
try:
    from jax._src.api import jit as jax_jit
except ImportError:  # pragma: no cover - moved in a later JAX: the public name, read before anyone patches it
    jax_jit = jax.jit


def exclude_from_tracebacks(path: str) -> None:
    """Have JAX treat frames of `path` as its own (`source_info_util.register_exclusion`, which equinox
    calls for its files): the locations JAX reports (`jax_explain_cache_misses`, equation source lines)
    are the user's. Without it (a JAX that moved it) they may name nitro_ipy's file."""
    try:
        from jax._src import source_info_util

        source_info_util.register_exclusion(path)
    except (ImportError, AttributeError):  # pragma: no cover
        pass


# ---------------------------------------------------------------- the configuration a trace depends on
def _trace_context_api() -> tuple:
    """`(trace_context, names)`: JAX's own `config.trace_context` (what its jit caches key on: one tuple of
    every setting that changes what a trace produces), and the names of its entries (None where this jaxlib
    does not say them: then entries are named by position)."""
    try:
        from jax._src import config
    except Exception:  # pragma: no cover - a JAX that moved it: keys carry no configuration
        return (lambda: ()), ()
    context = getattr(config, "trace_context", None)
    if context is None:  # pragma: no cover
        return (lambda: ()), (lambda: ())
    named = getattr(config, "trace_context_names", None)

    def names():  # asked again whenever the context grew: an import (Flax's Pallas) registers settings
        try:
            return tuple(named())
        except Exception:  # pragma: no cover - jaxlib before `trace_context_names`
            return None

    return context, names


trace_context, trace_context_names = _trace_context_api()


def _debug_states() -> tuple:
    """JAX's `jax_debug_nans` and `jax_debug_infs` settings (thread-local aware `State`s)."""
    from jax._src import config

    return config.debug_nans, config.debug_infs


DEBUG_NANS, DEBUG_INFS = _debug_states()


def _internal_floating_point_error() -> type:
    """The exception a compiled program raises under `debug_nans`/`debug_infs` when an output is NaN or
    infinite, before JAX re-runs the function de-optimized to name the primitive (`jax.jit` does; an AOT
    `Compiled` lets it escape)."""
    try:
        from jax._src.api_util import InternalFloatingPointError

        return InternalFloatingPointError
    except Exception:  # pragma: no cover - moved: nothing of ours is caught
        return type("InternalFloatingPointError", (Exception,), {})


INTERNAL_FLOATING_POINT_ERROR = _internal_floating_point_error()


def raise_deoptimized(err: BaseException, fn, args: tuple, kwargs: dict):
    """What `jax.jit` does when its program's output is NaN/inf under `debug_nans`/`debug_infs`: run `fn`
    de-optimized (op by op), which raises JAX's `FloatingPointError` naming the primitive; if it runs
    clean, JAX's `FloatingPointError` saying so. Never returns."""
    try:
        from jax._src.api_util import maybe_recursive_nan_check
    except Exception:  # pragma: no cover
        maybe_recursive_nan_check = None
    if maybe_recursive_nan_check is not None:
        maybe_recursive_nan_check(err, fn, args, kwargs)
    fn(*args, **kwargs)  # pragma: no cover - a JAX without it: its eager run raises, or we do
    raise FloatingPointError(f"invalid value ({getattr(err, 'ty', 'nan')}) in a compiled program")  # pragma: no cover
