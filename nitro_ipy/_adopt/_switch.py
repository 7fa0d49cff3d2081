"""The switch: `jax.jit` and `equinox.filter_jit` replaced by honest versions, and put back.

- **`jax.jit`** is looked up by attribute when user code runs `@jax.jit`, `jax.jit(f)` or
  `functools.partial(jax.jit, ...)`, so replacing the attribute reaches every such call made after the
  switch. The replacement asks `user_function` whose code `f` runs: the user's (a cell, the user's own
  file; through `functools.partial`, methods and `__wrapped__` chains such as `jax.grad`'s) gets
  `nitro_ipy.jit(f, ...)`; anything else, and every call made from nitro_ipy's own files, gets JAX's own
  object, built by the original `jax.jit`: a library's functions cost exactly what they cost before.
- **`flax.nnx.jit`** needs nothing of its own: it calls `jax.jit` by attribute on a `JitFn` whose
  `__wrapped__` is the user's function, so its inner jit is honest and its graph handling is its own.
- **`equinox.filter_jit`** calls `jax.jit` on a function of its own (one per function name, in an LRU
  cache) and passes the user's function as a static argument: the replacement lets Equinox build its
  wrapper, then swaps the wrapper's inner `jax.jit` (`_cached`, in the Equinox versions this was written
  against: 0.11 to 0.13) for `nitro_ipy.jit` over the same function with the same options. Filtering,
  donation and Equinox's error messages stay Equinox's. An Equinox imported after the switch is patched
  as its import ends (`_EquinoxImport`).
- **Off** (`set_honest_jit(False)`, `%unload_ext`): the original attributes come back (`jax.jit is` the
  original again). Functions jitted while it was on keep their honesty.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
import threading
import types

import jax

from .._base import _origin
from .._compiler._jit import jit as nitro_jit

_OWN = _origin.PACKAGE_DIR + os.sep  # nitro_ipy's own calls of `jax.jit` (its handle's programs) stay JAX's
_MISSING = object()
_lock = threading.Lock()
_originals: dict[str, object] = {}  # "jax.jit", "equinox.filter_jit" -> the object the switch replaced


def honest_jit_enabled() -> bool:
    """Whether `jax.jit` (and Equinox's `filter_jit`) are the honest versions now."""
    return "jax.jit" in _originals


def set_honest_jit(enabled: bool) -> None:
    """Make `jax.jit`, `equinox.filter_jit` and `flax.nnx.jit` honest for the user's own functions (on by
    default with `%load_ext nitro_ipy`), or put the originals back.

    **Arguments:**
    - `enabled`: True: a function of a notebook cell or of the user's own files jitted from now on by any
      of the three behaves as `nitro_ipy.jit` (recompiled once after an edit moves what its trace read,
      with a line saying why); library functions get JAX's own object. False: `jax.jit` and
      `equinox.filter_jit` are the originals again.
    """
    with _lock:
        if enabled:
            _enable()
        else:
            _disable()


def _enable() -> None:
    if "jax.jit" not in _originals:
        original = jax.jit
        _originals["jax.jit"] = original
        jax.jit = _honest_jax_jit(original)
    equinox = sys.modules.get("equinox")
    if equinox is not None:
        _patch_equinox(equinox)
    elif not any(isinstance(f, _EquinoxImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _EquinoxImport())


def _disable() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _EquinoxImport)]
    original = _originals.pop("jax.jit", None)
    if original is not None and getattr(jax.jit, "__nitro_honest__", False):
        jax.jit = original  # (one set by someone else since is left in place)
    original = _originals.pop("equinox.filter_jit", None)
    equinox = sys.modules.get("equinox")
    if original is not None and equinox is not None and getattr(equinox.filter_jit, "__nitro_honest__", False):
        equinox.filter_jit = original


# ---------------------------------------------------------------- whose code is it
def user_function(fun):
    """The function of the user's code that calling `fun` runs, or None when it runs library code.

    Follows `functools.partial`, bound methods, `__wrapped__` chains (`functools.wraps`, `jax.grad`,
    `jax.vmap`, NNX's `JitFn`) and a callable object's class `__call__`; `_origin` decides what is the
    user's. nitro_ipy's own functions are library code, whatever they wrap.
    """
    for _ in range(32):  # a bounded chain (a `__wrapped__` cycle is a user's bug)
        if isinstance(fun, functools.partial):
            fun = fun.func
            continue
        if isinstance(fun, types.MethodType):
            fun = fun.__func__
            continue
        if isinstance(fun, types.FunctionType):
            if fun.__code__.co_filename.startswith(_OWN):
                return None
            if _origin.is_user_function(fun):
                return fun
        try:
            wrapped = getattr(fun, "__wrapped__", None)
        except Exception:  # noqa: BLE001 - a user object whose attribute raises: nothing behind it
            return None
        if wrapped is None:
            if isinstance(fun, (types.FunctionType, type, types.BuiltinFunctionType)):
                return None
            call = getattr(type(fun), "__call__", None)
            return call if isinstance(call, types.FunctionType) and _origin.is_user_function(call) else None
        fun = wrapped
    return None


def _qualified(fun) -> str:
    base = user_function(fun) or fun
    qualname = getattr(base, "__qualname__", None) or type(base).__qualname__
    return f"{getattr(base, '__module__', None) or '?'}.{qualname}"


# ---------------------------------------------------------------- jax.jit
def _honest_jax_jit(original):
    @functools.wraps(original)  # `inspect.signature(jax.jit)` and the docstring stay JAX's
    def jit(fun=_MISSING, /, **options):
        if fun is _MISSING:  # `@jax.jit(static_argnums=...)`
            return functools.partial(jit, **options)
        if (not callable(fun) or sys._getframe(1).f_code.co_filename.startswith(_OWN)
                or user_function(fun) is None):
            return original(fun, **options)
        return nitro_jit(fun, **options)

    jit.__nitro_honest__ = True
    return jit


# ---------------------------------------------------------------- equinox.filter_jit
def _patch_equinox(equinox) -> None:
    current = getattr(equinox, "filter_jit", None)
    if current is None or getattr(current, "__nitro_honest__", False):
        return
    _originals["equinox.filter_jit"] = current
    equinox.filter_jit = _honest_filter_jit(current)


def _honest_filter_jit(original):
    @functools.wraps(original)
    def filter_jit(fun=_MISSING, *, donate="none", **jitkwargs):
        if fun is _MISSING:  # `@eqx.filter_jit(donate=...)`
            return functools.partial(filter_jit, donate=donate, **jitkwargs)
        wrapper = original(fun, donate=donate, **jitkwargs)
        if user_function(fun) is None:
            return wrapper
        cached = getattr(wrapper, "_cached", None)
        inner = getattr(cached, "__wrapped__", None)  # Equinox's own traced function
        if type(cached).__name__ != "PjitFunction" or not callable(inner):
            return wrapper  # an Equinox whose wrapper is built otherwise: left as it is
        # The options Equinox gives its `jax.jit` (`_filter_jit_cache`): donated dynamic arrays first,
        # the static rest (the user's function among it) third.
        honest = nitro_jit(inner, donate_argnums=0, static_argnums=2, **jitkwargs)
        honest.qualified = _qualified(fun)
        object.__setattr__(wrapper, "_cached", honest)  # a frozen `eqx.Module`: set as its __init__ does
        return wrapper

    filter_jit.__nitro_honest__ = True
    return filter_jit


class _EquinoxImport(importlib.abc.MetaPathFinder):
    """Patches Equinox as its import ends, when it is imported after the switch went on."""

    def find_spec(self, name, path=None, target=None):
        if name != "equinox":
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]  # once; and the real finders answer
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            with _lock:
                if honest_jit_enabled():
                    _patch_equinox(module)

        loader.exec_module = exec_and_patch
        return spec
