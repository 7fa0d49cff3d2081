"""Fingerprints of the values user code reads: content for user things, name for library callables."""

from __future__ import annotations

import functools
import types

from .._base._fingerprint import Unfingerprintable, fingerprint
from .._base._origin import is_user_file, is_user_function, is_user_module
from ._records import SKIP
from ._resolve import underlying


def _fp(value):
    try:
        return fingerprint(value)
    except Unfingerprintable as err:
        return SKIP if "tracer" in err.what else None
    except Exception:  # a user's object whose attributes raise while we look: untracked, not a crash
        return None


def _lib_name(v) -> str:
    module = getattr(v, "__module__", None) or type(v).__module__
    return f"lib:{module}.{getattr(v, '__qualname__', None) or getattr(v, '__name__', '?')}"


def value_fingerprint(v):
    """Fingerprint of a value read by user code: content for user things, name for library callables.

    Library code only changes with a package upgrade (which restarts the kernel), so a library function,
    class or module is identified by its name; a user function by `function_fingerprint` (code, closure
    cells, defaults). Returns None (untracked) or `SKIP` (a tracer).
    """
    if isinstance(v, types.ModuleType):
        return "module:" + v.__name__
    if isinstance(v, type):
        # A class by its name, not the code of all its methods: the methods the trace ran and the class
        # attributes it read are dependencies of their own, so editing a method nothing calls is no edit.
        # Its identity is in the snapshot: a re-run class cell is checked, and found equal, by name.
        return ("class:" if is_user_module(v.__module__) else "lib:") + f"{v.__module__}.{v.__qualname__}"
    if isinstance(v, types.FunctionType):
        return _fp(v) if is_user_file(v.__code__.co_filename) else _lib_name(v)
    if isinstance(v, types.BuiltinFunctionType):
        return _lib_name(v)
    if isinstance(v, functools.partial):
        parts = (value_fingerprint(v.func), _fp(v.args), _fp(v.keywords))
        if SKIP in parts:
            return SKIP
        return None if None in parts else fingerprint(parts)
    if is_library_callable(v):
        return _lib_name(v)  # jax.nn.relu (a jit wrapper), jnp ufuncs, optax functions
    fp = _fp(v)
    if fp is None:
        return object_fingerprint(v)
    return fp


def object_fingerprint(v):
    """An instance of a user class that has no content fingerprint of its own, by its attributes.

    The code of its methods is not in it: the methods the trace ran are dependencies of their own (and
    their class attributes, `Builder.self_reads`), so an edit to a method nothing calls is no edit.
    None when it has no `__dict__` or an attribute has no fingerprint (then it is untracked).
    """
    t = type(v)
    if not is_user_module(t.__module__) or isinstance(v, type):
        return None
    attrs = getattr(v, "__dict__", None)
    if type(attrs) is not dict:
        return None
    fp = _fp(attrs)
    return None if fp is None or fp is SKIP else fingerprint(("object", f"{t.__module__}.{t.__qualname__}", fp))


def is_library_callable(v) -> bool:
    """A named callable whose code is all library code (a wrapper of a library function, a ufunc)."""
    if isinstance(v, types.FunctionType):
        return not is_user_file(v.__code__.co_filename)
    if isinstance(v, types.BuiltinFunctionType):
        return True
    if isinstance(v, type):
        return not is_user_module(v.__module__)
    if isinstance(v, functools.partial) or not callable(v):
        return False
    try:
        if not (hasattr(v, "__qualname__") or hasattr(v, "__name__")):
            return False
    except Exception:  # a user object whose `__getattr__` raises
        return False
    if is_user_module(type(v).__module__):
        return False
    return not any(is_user_function(f) for f in underlying(v))


def attr_fingerprint(attr):
    """Fingerprint of a class attribute as stored in the class `__dict__` (descriptors unwrapped)."""
    if isinstance(attr, (staticmethod, classmethod)):
        return value_fingerprint(attr.__func__)
    if isinstance(attr, property):
        parts = tuple(
            value_fingerprint(f) if f is not None else "-" for f in (attr.fget, attr.fset, attr.fdel)
        )
        return None if None in parts or SKIP in parts else fingerprint(parts)
    return value_fingerprint(attr)
