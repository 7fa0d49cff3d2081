"""Dependency closures: what a compiled program's trace ran and read, and whether any of it has moved.

While `jax.jit(fn).lower(*args)` traces, `record()` notes every *user* Python function the trace executes
(anything outside the standard library, installed packages and nitro_ipy itself: notebook cells, the
user's own module files). At exit it turns those into a `Closure`:

- `FuncDep` per function: module, qualified name and `code_fingerprint` (bytecode, constants, names; not
  line numbers or comments), plus a digest of the source file for "edited on disk, not loaded yet";
- `ValueDep` per global name those functions load (`LOAD_GLOBAL`), with a content fingerprint, and per
  `user_module.attr` they read; `ClassAttrDep` per attribute read through the compile view
  (`note_class_attr`); `CellDep` per closure cell of a closure made before the trace;
- `untracked`: values read that have no content fingerprint. They are listed, never assumed unchanged.

JAX caches traces by function identity, so the Python of an inner `jax.jit(helper)`, `jax.checkpoint`,
or a `lax.scan` body may not run on a second trace. Every user function reachable from a recorded global
(plain, `__wrapped__`, `functools.partial`, `custom_jvp`/`custom_vjp`) is therefore added statically,
with the globals it reads, recursively.

`Closure.drift(memo)` re-resolves each dependency by name against the live namespaces
(`sys.modules[module]`, then a static attribute chain over the qualified name; `<locals>` functions are
found among the enclosing function's nested code objects) and names what moved. A dependency that did not
resolve by name even at record time (a module-level lambda, a class defined inside a function, a function
rebound under another name) is "anonymous": it is listed in `Closure.anonymous` and covered through the
global, class attribute or GraphConst field that holds it. A scan that follows no redefinition is cheap:
each value keeps weak references to the objects it was made of (an "identity snapshot"), so an unchanged
global is recognized by identity and only mutable contents (NumPy arrays, objects) are hashed again.

Three ways to see the functions a trace runs (`NITRO_IPY_RECORDER` picks one; the default is the first
this Python has):

- `monitoring` (3.12+): `sys.monitoring` `PY_START`, library code disabled after its first call;
- `traceback` (3.11, or when no monitoring tool id is free, or a C profiler holds the profile hook): no
  hook at all. JAX keeps the Python stack of every equation; the user code objects on those stacks (in
  every sub-jaxpr too) are looked up in the user's namespaces for their globals and cells (`_FunctionIndex`).
  A function that binds no primitive is on no stack and is found by the static walk above;
- `profile` (opt-in on 3.11): `sys.setprofile`, exhaustive, but its 1.5M events double a deep model's trace.

Nested recorders in one thread share the hook and every active recorder receives every event: an outer
recording also depends on what an inner one traced. Recorders in other threads are independent.
"""

from __future__ import annotations

import dis
import functools
import hashlib
import os
import sys
import threading
import types
import weakref
from typing import NamedTuple

from ._compat import (
    CUSTOM_DERIVATIVE_PARTS,
    equation_traceback,
    is_custom_derivative,
    jaxpr_eqns,
    traceback_codes,
    tracebacks_usable as _tracebacks_usable,
)
from ._fingerprint import Unfingerprintable, code_fingerprint, fingerprint, is_library_file

__all__ = [
    "CellDep",
    "ClassAttrDep",
    "Closure",
    "FuncDep",
    "Recorder",
    "ValueDep",
    "closure_from_records",
    "closure_records",
    "live_module_namespace",
    "note_class_attr",
    "record",
]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_MISSING = object()
_SKIP = object()  # a value not worth recording at all: a tracer (trace-internal, not external state)


# --------------------------------------------------------------------------------------------------------
# Dependency records


class FuncDep(NamedTuple):
    """A user function the program depends on.

    `file_digest` is a hash of the source file's bytes at record time; `None` for notebook cells.
    """

    module: str
    qualname: str
    fingerprint: str
    filename: str
    file_digest: str | None

    @property
    def qualified(self) -> str:
        return f"{self.module}.{self.qualname}"


class ValueDep(NamedTuple):
    """A global `module.name` read by a dependency; `fingerprint` is `None` when it has none (untracked)."""

    module: str
    name: str
    fingerprint: str | None

    @property
    def qualified(self) -> str:
        return f"{self.module}.{self.name}"


class ClassAttrDep(NamedTuple):
    """An attribute `name` of class `module.cls_qualname` read through the compile view."""

    module: str
    cls_qualname: str
    name: str
    fingerprint: str | None

    @property
    def qualified(self) -> str:
        return f"{self.module}.{self.cls_qualname}.{self.name}"


class CellDep(NamedTuple):
    """A closure cell `var` of function `module.qualname`, as seen when the trace called it.

    Informational: drift of a closure's cells is caught through whatever holds the closure (a global, a
    class attribute, a GraphConst field); unfingerprintable cells are listed in `untracked`.
    """

    module: str
    qualname: str
    var: str
    fingerprint: str | None

    @property
    def qualified(self) -> str:
        return f"{self.module}.{self.qualname}.{self.var}"


# --------------------------------------------------------------------------------------------------------
# Classification: whose code is this?

_file_verdicts: dict[str, bool] = {}


def _classify_file(filename: str) -> bool:
    verdict = not is_library_file(filename)
    if verdict and not filename.startswith("<"):
        verdict = not os.path.abspath(filename).startswith(_PACKAGE_DIR)
    _file_verdicts[filename] = verdict
    return verdict


def _is_user_file(filename: str) -> bool:
    """True for code the user wrote: notebook cells and the user's own files (not nitro_ipy's)."""
    verdict = _file_verdicts.get(filename)
    return _classify_file(filename) if verdict is None else verdict


def _is_user_module(name: str) -> bool:
    if name == "__main__":
        return True
    module = sys.modules.get(name)
    filename = getattr(module, "__file__", None)
    return bool(filename) and _is_user_file(filename)


def _is_user_function(fn) -> bool:
    return isinstance(fn, types.FunctionType) and _is_user_file(fn.__code__.co_filename)


def _is_cell_file(filename: str) -> bool:
    """Notebook cells: `<ipython-input-N-...>` (terminal) or `/tmp/ipykernel_PID/HASH.py` (kernel)."""
    return filename.startswith("<") or f"{os.sep}ipykernel_" in filename


# --------------------------------------------------------------------------------------------------------
# Unwrapping callables to the Python functions that hold their code


def _underlying(obj, limit: int = 64) -> list:
    """The plain functions behind `obj`: itself, or what a wrapper, method, property or partial holds."""
    out, stack, seen = [], [obj], set()
    while stack and len(seen) < limit:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, types.FunctionType):
            out.append(x)
            wrapped = x.__dict__.get("__wrapped__")  # functools.wraps: keep going to the wrapped function
            if wrapped is not None:
                stack.append(wrapped)
        elif isinstance(x, (staticmethod, classmethod, types.MethodType)):
            stack.append(x.__func__)
        elif isinstance(x, property):
            stack.extend((x.fget, x.fset, x.fdel))
        elif isinstance(x, functools.partial):
            stack.append(x.func)
        elif isinstance(x, functools.cached_property):
            stack.append(x.func)
        elif isinstance(x, type):
            continue
        else:
            # jax.jit / jax.checkpoint / other `__wrapped__` wrappers; custom_jvp and custom_vjp (`fun`
            # and their rules). A user object's attribute that raises is no dependency.
            names = (
CUSTOM_DERIVATIVE_PARTS if is_custom_derivative(x) else ("__wrapped__",)
            )
            for name in names:
                try:
                    stack.append(getattr(x, name, None))
                except Exception:
                    pass
    return out


def _static_attr(obj, name: str):
    """`name` looked up without running descriptors or `__getattr__` (classes: along the MRO)."""
    if isinstance(obj, type):
        for klass in obj.__mro__:
            d = klass.__dict__
            if name in d:
                return d[name]
        return _MISSING
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        return d.get(name, _MISSING)
    return _MISSING


def _lookup(ns: dict, dotted: str):
    head, *rest = dotted.split(".")
    obj = ns.get(head, _MISSING)
    for part in rest:
        if obj is _MISSING:
            break
        obj = _static_attr(obj, part)
    return obj


_nested_memo: dict[tuple[int, str], tuple[types.CodeType, tuple]] = {}


def _nested(code: types.CodeType):
    """Every code object nested (at any depth) in `code`'s constants: its functions, lambdas, classes."""
    stack = [code]
    while stack:
        for const in stack.pop().co_consts:
            if isinstance(const, types.CodeType):
                yield const
                stack.append(const)


def _nested_codes(code: types.CodeType, qualname: str) -> tuple:
    """Code objects named `qualname` nested (at any depth) in `code`'s constants."""
    key = (id(code), qualname)
    hit = _nested_memo.get(key)
    if hit is not None and hit[0] is code:
        return hit[1]
    found = tuple(c for c in _nested(code) if c.co_qualname == qualname)
    _nested_memo[key] = (code, found)
    return found


def _resolve_function(ns: dict, qualname: str) -> frozenset | None:
    """Code fingerprints `qualname` resolves to in `ns` now, or None when it no longer resolves."""
    obj = ns.get(qualname)
    if type(obj) is types.FunctionType and "__wrapped__" not in obj.__dict__:
        return frozenset((code_fingerprint(obj.__code__),))  # the common case, fast
    outer, nested, _ = qualname.partition(".<locals>.")
    obj = _lookup(ns, outer)
    if obj is _MISSING:
        return None
    codes = [fn.__code__ for fn in _underlying(obj)]
    if nested:
        codes = [inner for c in codes for inner in _nested_codes(c, qualname)]
    return frozenset(code_fingerprint(c) for c in codes) or None


# --------------------------------------------------------------------------------------------------------
# Fingerprints of values


def _fp(value):
    try:
        return fingerprint(value)
    except Unfingerprintable as err:
        return _SKIP if "tracer" in err.what else None
    except Exception:  # a user's object whose attributes raise while we look: untracked, not a crash
        return None


def _lib_name(v) -> str:
    module = getattr(v, "__module__", None) or type(v).__module__
    return f"lib:{module}.{getattr(v, '__qualname__', None) or getattr(v, '__name__', '?')}"


def _value_fingerprint(v):
    """Fingerprint of a value read by user code: content for user things, name for library callables.

    Library code only changes with a package upgrade (which restarts the kernel), so a library function,
    class or module is identified by its name; a user function by `function_fingerprint` (code, closure
    cells, defaults). Returns None (untracked) or `_SKIP` (a tracer).
    """
    if isinstance(v, types.ModuleType):
        return "module:" + v.__name__
    if isinstance(v, type):
        return _fp(v) if _is_user_module(v.__module__) else _lib_name(v)
    if isinstance(v, types.FunctionType):
        return _fp(v) if _is_user_file(v.__code__.co_filename) else _lib_name(v)
    if isinstance(v, types.BuiltinFunctionType):
        return _lib_name(v)
    if isinstance(v, functools.partial):
        parts = (_value_fingerprint(v.func), _fp(v.args), _fp(v.keywords))
        if _SKIP in parts:
            return _SKIP
        return None if None in parts else fingerprint(parts)
    if _is_library_callable(v):
        return _lib_name(v)  # jax.nn.relu (a jit wrapper), jnp ufuncs, optax functions
    return _fp(v)


def _is_library_callable(v) -> bool:
    """A named callable whose code is all library code (a wrapper of a library function, a ufunc)."""
    if isinstance(v, types.FunctionType):
        return not _is_user_file(v.__code__.co_filename)
    if isinstance(v, types.BuiltinFunctionType):
        return True
    if isinstance(v, type):
        return not _is_user_module(v.__module__)
    if isinstance(v, functools.partial) or not callable(v):
        return False
    try:
        if not (hasattr(v, "__qualname__") or hasattr(v, "__name__")):
            return False
    except Exception:  # a user object whose `__getattr__` raises
        return False
    if _is_user_module(type(v).__module__):
        return False
    return not any(_is_user_function(f) for f in _underlying(v))


def _attr_fingerprint(attr):
    """Fingerprint of a class attribute as stored in the class `__dict__` (descriptors unwrapped)."""
    if isinstance(attr, (staticmethod, classmethod)):
        return _value_fingerprint(attr.__func__)
    if isinstance(attr, property):
        parts = tuple(
            _value_fingerprint(f) if f is not None else "-" for f in (attr.fget, attr.fset, attr.fdel)
        )
        return None if None in parts or _SKIP in parts else fingerprint(parts)
    return _value_fingerprint(attr)


# --------------------------------------------------------------------------------------------------------
# Globals a code object reads


class _Reads(NamedTuple):
    names: tuple  # global names loaded (LOAD_GLOBAL / LOAD_NAME), nested code included
    attrs: tuple  # (global name, attribute) pairs: `mod.attr` where `mod` is a global


_reads_memo: dict[int, tuple[types.CodeType, _Reads]] = {}
_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
_ATTR_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})


def _reads(code: types.CodeType) -> _Reads:
    """Global names `code` (and the code nested in it) loads, from its bytecode; memoized per code."""
    hit = _reads_memo.get(id(code))
    if hit is not None and hit[0] is code:
        return hit[1]
    names, attrs = {}, {}
    for c in (code, *_nested(code)):
        previous = None
        for ins in dis.get_instructions(c):
            if ins.opname in _GLOBAL_LOADS:
                names[ins.argval] = None
                previous = ins.argval
                continue
            if previous is not None and ins.opname in _ATTR_LOADS:
                attrs[(previous, ins.argval)] = None
            previous = None
    reads = _Reads(tuple(names), tuple(attrs))
    _reads_memo[id(code)] = (code, reads)
    return reads


# --------------------------------------------------------------------------------------------------------
# Files


def _file_bytes(filename: str) -> bytes | None:
    try:
        with open(filename, "rb") as f:
            return f.read()
    except OSError:
        return None


def _digest(data: bytes | None) -> str | None:
    return None if data is None else hashlib.blake2b(data, digest_size=16).hexdigest()


def _file_digest(filename: str) -> str | None:
    return _digest(_file_bytes(filename))


# digest -> {qualname: code fingerprints} of a source file version; bounded, most recent last.
_disk_versions: dict[str, dict[str, frozenset] | None] = {}
_DISK_VERSIONS_KEPT = 64


def _disk_state(filename: str, memo: dict) -> tuple:
    """`(digest, {qualname: code fingerprints})` of the file as it is on disk now (memoized per scan).

    The mapping is None when the file cannot be read or compiled (deleted, mid-edit syntax error). Each
    file version is compiled once, whatever the number of scans.
    """
    key = ("D", filename)
    state = memo.get(key)
    if state is None:
        try:
            st = os.stat(filename)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            stamp = None
        known = _disk_stamps.get(filename)
        if stamp is not None and known is not None and known[0] == stamp:
            state = known[1]  # unchanged since the last scan by stat: no read, no hash
        else:
            data = _file_bytes(filename)
            digest = _digest(data)
            state = (digest, _LazyVersion(filename, data, digest))
            if stamp is not None:
                _disk_stamps[filename] = (stamp, state)
        memo[key] = state
    return state


# filename -> ((mtime_ns, size, inode), state): a file whose stat did not move is not read again.
_disk_stamps: dict[str, tuple] = {}


class _LazyVersion:
    """Compiles a file version only when a function's on-disk code is actually asked for."""

    __slots__ = ("filename", "data", "digest")

    def __init__(self, filename, data, digest):
        self.filename, self.data, self.digest = filename, data, digest

    def codes(self, qualname: str) -> frozenset | None:
        if self.digest not in _disk_versions:
            _disk_versions[self.digest] = _compile_version(self.filename, self.data)
            while len(_disk_versions) > _DISK_VERSIONS_KEPT:
                del _disk_versions[next(iter(_disk_versions))]
        table = _disk_versions[self.digest]
        return None if table is None else table.get(qualname)


def _compile_version(filename: str, data: bytes | None) -> dict[str, frozenset] | None:
    if data is None:
        return None
    try:
        module_code = compile(data, filename, "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        return None
    table: dict[str, set] = {}
    for code in _nested(module_code):
        table.setdefault(code.co_qualname, set()).add(code_fingerprint(code))
    return {q: frozenset(fps) for q, fps in table.items()}


# --------------------------------------------------------------------------------------------------------
# Live namespaces and the memoized resolvers a scan shares


def _live_namespace(module: str, recorded: dict, memo: dict, key=None) -> dict | None:
    """The namespace `module` names now: `sys.modules[module]`, else the one the code ran in.

    `__main__` is special: an IPython shell's user namespace may not be `sys.modules["__main__"]` (a test
    runner owns that), and the code ran in the user namespace, so that one stays authoritative.
    """
    if key is None:
        key = ("N", module, id(recorded))
    ns = memo.get(key, _MISSING)
    if ns is _MISSING:
        mod = sys.modules.get(module)
        d = getattr(mod, "__dict__", None) if mod is not None else None
        if d is None or (d is not recorded and module == "__main__"):
            d = recorded
        ns = memo[key] = d
    return ns


def _live_function(module: str, recorded: dict, qualname: str, memo: dict):
    """Code fingerprints `module.qualname` resolves to now (memoized per scan), or None."""
    key = ("F", module, id(recorded), qualname)
    live = memo.get(key, _MISSING)
    if live is _MISSING:
        live = memo[key] = _resolve_function(_live_namespace(module, recorded, memo), qualname)
    return live


class _Live:
    """A value as it is now; its fingerprint is computed at most once per scan, and only when needed."""

    __slots__ = ("value", "attr", "_fp")

    def __init__(self, value, attr: bool):
        self.value, self.attr = value, attr
        self._fp = _MISSING

    def same_as(self, expected: str, snap) -> bool:
        if snap is not None and _matches(snap, self.value):
            return True  # the very same objects as at record time: content unchanged
        if self._fp is _MISSING:
            self._fp = _attr_fingerprint(self.value) if self.attr else _value_fingerprint(self.value)
        return self._fp == expected


# The checkers below run once per (dependency, expected fingerprint) and scan; `nskey` and `key` are the
# memo keys of the live namespace and of the live dependency, precomputed when the closure is built.


def _check_function(nskey, module, recorded, key, qualname, expected, _snap, memo) -> bool:
    live = memo.get(key, _MISSING)
    if live is _MISSING:
        live = memo[key] = _resolve_function(_live_namespace(module, recorded, memo, nskey), qualname)
    return live is not None and expected in live


def _check_value(nskey, module, recorded, key, name, expected, snap, memo) -> bool:
    live = memo.get(key, _MISSING)
    if live is _MISSING:
        value = _live_namespace(module, recorded, memo, nskey).get(name, _MISSING)
        if value is not _MISSING and snap is not None and _matches(snap, value):
            return True  # the very same objects as at record time: the common case, fast
        live = memo[key] = None if value is _MISSING else _Live(value, attr=False)
    return live is not None and (expected is None or live.same_as(expected, snap))


def _check_class_attr(nskey, module, recorded, key, cls_qualname, name, expected, snap, memo) -> bool:
    live = memo.get(key, _MISSING)
    if live is _MISSING:
        cls = _lookup(_live_namespace(module, recorded, memo, nskey), cls_qualname)
        attr = _static_attr(cls, name) if isinstance(cls, type) else _MISSING
        live = memo[key] = None if attr is _MISSING else _Live(attr, attr=True)
    return live is not None and (expected is None or live.same_as(expected, snap))


# --------------------------------------------------------------------------------------------------------
# Identity snapshots: the fast path of a scan that follows no redefinition

_ATOMS = frozenset({int, float, complex, str, bytes, bool, type(None), type(Ellipsis)})


class _Ref(weakref.ref):
    """A snapshot element held weakly (so a snapshot never keeps a rebound value alive)."""

    __slots__ = ()


def _snapshot(v, depth: int = 0) -> list | None:
    """Objects whose identity guarantees that `v`'s fingerprint has not changed, or None.

    Immutable things qualify by identity (atoms, tuples and frozensets of them, concrete JAX arrays,
    modules); small lists and dicts, partials and functions by identity plus their mutable parts (items;
    code, qualified name, defaults and closure cells); small NumPy arrays by identity plus a `_Content`
    digest of their bytes. Anything else (large or object arrays, objects) is None and is fingerprinted
    by content on every scan. `_matches` walks a value in the same order.
    """
    t = type(v)
    if t in _ATOMS or t is types.ModuleType:
        return [v]
    if depth >= 4:
        return None
    if t is tuple or t is frozenset:
        if len(v) > 32:
            return None
        out = [v]
        for item in v:
            s = _snapshot(item, depth + 1)
            if s is None:
                return None
            out += s
        return out
    if t is list or t is dict:
        # Mutable, so the container's identity proves nothing: list its current items (and length).
        if len(v) > 32:
            return None
        out = [v, len(v)]
        for item in _flat_items(v) if t is dict else v:
            s = _snapshot(item, depth + 1)
            if s is None:
                return None
            out += s
        return out
    if t is functools.partial:
        out = [v]
        for part in (v.func, v.args, v.keywords):
            s = _snapshot(part, depth + 1)
            if s is None:
                return None
            out += s
        return out
    if t is types.FunctionType:
        defaults, kwdefaults = v.__defaults__, v.__kwdefaults__
        out = [v, v.__code__, v.__qualname__, defaults, kwdefaults]
        for part in (defaults, kwdefaults):
            if part:
                s = _snapshot(part, depth + 1)
                if s is None:
                    return None
                out += s
        for cell in v.__closure__ or ():
            try:
                s = _snapshot(cell.cell_contents, depth + 1)
            except ValueError:  # an empty cell
                s = [_MISSING]
            if s is None:
                return None
            out += s
        return out
    np = sys.modules.get("numpy")
    if np is not None and t is np.ndarray and not v.dtype.hasobject and v.nbytes <= _CONTENT_BYTES:
        return [v, _Content(v)]
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(v, jax.Array) and not isinstance(v, jax.core.Tracer):
        return [v]
    if _is_library_callable(v):
        return [v]  # fingerprinted by name, and a library object's name does not change
    return None


def _flat_items(d: dict):
    for k, v in d.items():
        yield k
        yield v


def _freeze(snap: list | None) -> tuple | None:
    if snap is None:
        return None
    out = []
    for obj in snap:
        try:
            out.append(_Ref(obj))
        except TypeError:  # ints, strings, tuples: small, held as they are
            out.append(obj)
    return tuple(out)


def _held(x):
    """A snapshot element's object (`_MISSING` when a weakly held one is gone)."""
    if type(x) is _Ref:
        x = x()
        return _MISSING if x is None else x
    return x


# Above this size hashing dominates either way, and a fingerprint is taken at record time already.
_CONTENT_BYTES = 1 << 16


class _Content:
    """A NumPy array's dtype, shape and a digest of its bytes: an array changes in place, so its
    identity proves nothing, but this is far cheaper to compare than a fingerprint. Held strongly (no
    weak references to it: it lives in the snapshot only)."""

    __slots__ = ("dtype", "shape", "digest")

    def __init__(self, a):
        self.dtype, self.shape = a.dtype, a.shape
        self.digest = hashlib.blake2b(a.tobytes(), digest_size=16).digest()

    def __eq__(self, other) -> bool:
        return (
            type(other) is _Content
            and self.dtype is other.dtype  # builtin dtypes are shared objects; others fall back safely
            and self.shape == other.shape
            and self.digest == other.digest
        )


def _matches(frozen: tuple, v) -> bool:
    """Whether `_snapshot(v)` would list the very objects `frozen` holds, found without building it.

    Walks `v` in `_snapshot`'s order and stops at the first object that is not the recorded one. An
    object found where the recorded one was is that object, so a leaf (an atom, module, JAX array or
    library callable) needs no second look at what it is.
    """
    return _match(frozen, 0, v) == len(frozen)


def _match(frozen: tuple, i: int, v) -> int:
    """`_matches` for `v`'s part of the snapshot, starting at `frozen[i]`: where it ends, or -1."""
    if i >= len(frozen):
        return -1
    held = frozen[i]
    if type(held) is _Ref:
        held = held()
        if held is None:
            return -1  # gone, so `v` is not it
    if held is not v:
        return -1
    i += 1
    t = type(v)
    if t in _ATOMS:
        return i
    if t is tuple or t is frozenset:
        items = v
    elif t is list or t is dict:
        if i >= len(frozen) or frozen[i] != len(v):
            return -1
        i += 1
        items = _flat_items(v) if t is dict else v
    elif t is functools.partial:
        items = (v.func, v.args, v.keywords)
    elif t is types.FunctionType:
        # Recorded: the code (held weakly), then the qualified name, defaults and keyword defaults (not
        # weakly referenceable, so held as they are; were they not, the test fails safe).
        defaults, kwdefaults, closure = v.__defaults__, v.__kwdefaults__, v.__closure__
        if (
            len(frozen) < i + 4
            or _held(frozen[i]) is not v.__code__
            or frozen[i + 1] is not v.__qualname__
            or frozen[i + 2] is not defaults
            or frozen[i + 3] is not kwdefaults
        ):
            return -1
        i += 4
        if not (defaults or kwdefaults or closure):
            return i  # a plain function
        items = [part for part in (defaults, kwdefaults) if part]
        for cell in closure or ():
            try:
                items.append(cell.cell_contents)
            except ValueError:  # an empty cell: `_MISSING` in the snapshot
                items.append(_MISSING)
    elif i < len(frozen) and type(frozen[i]) is _Content:  # `v` is the recorded NumPy array
        return i + 1 if frozen[i] == _Content(v) else -1
    else:
        return i  # a leaf
    for item in items:
        i = _match(frozen, i, item)
        if i < 0:
            return -1
    return i


# --------------------------------------------------------------------------------------------------------
# Scan plans: a closure's checks arranged once, so that a scan is a few tight loops

# The types whose snapshot lists parts that can change in place (items, code, defaults, cells, an
# array's `_Content`).
_MUTABLE_PARTS = frozenset({list, dict, functools.partial, types.FunctionType, _Content})


def _memoized(check: tuple, memo: dict) -> bool:
    """A `Closure._checks` entry's answer, resolved in full at most once per scan."""
    key, checker, args, _name = check
    ok = memo.get(key, _MISSING)
    if ok is _MISSING:
        ok = memo[key] = checker(*args, memo)
    return ok


def _scan_plan(checks: tuple) -> tuple:
    """`(groups, rest)`: the global checks an identity test settles, per namespace, and all the others.

    A group is `(nskey, module, recorded namespace, same, functions)`, where
    - `same` holds `(name, held, check)` for a global whose snapshot follows from the value's identity
      alone: none of its objects is a list, dict, partial or function, so it is an atom, a module, a JAX
      array, a library callable, or a tuple / frozenset of such (`held`: the snapshot's first element);
    - `functions` holds `(name, function ref, code ref, qualname, check)` for a plain function (no
      defaults, keyword defaults or cells), the usual global a program reads.
    `rest` holds the other checks (functions by name, class attributes, values with mutable parts or no
    snapshot), resolved through `_memoized`; so does a snapshot whose objects are gone already.
    """
    groups: dict = {}
    rest = []
    for check in checks:
        args = check[2]
        if check[1] is not _check_value or args[6] is None:
            rest.append(check)
            continue
        nskey, module, recorded, _key, name, _expected, snap = args
        objs = [_held(x) for x in snap]
        if any(o is _MISSING for o in objs):
            rest.append(check)
            continue
        if not _MUTABLE_PARTS.intersection(map(type, objs)):
            kind, item = 3, (name, snap[0], check)
        elif (
            len(snap) == 5
            and type(objs[0]) is types.FunctionType
            and type(snap[0]) is _Ref
            and type(snap[1]) is _Ref
            and snap[3] is None
            and snap[4] is None
        ):
            kind, item = 4, (name, snap[0], snap[1], snap[2], check)
        else:
            rest.append(check)
            continue
        group = groups.get(nskey)
        if group is None:
            group = groups[nskey] = (nskey, module, recorded, [], [])
        group[kind].append(item)
    groups = tuple((k, module, ns, tuple(same), tuple(fns)) for k, module, ns, same, fns in groups.values())
    return groups, tuple(rest)


def _disk_plan(files: tuple) -> tuple:
    """`Closure._files` grouped by source file: `(filename, digest at record time, entries)`."""
    groups: dict = {}
    for entry in files:
        dep = entry[0]
        groups.setdefault((dep.filename, dep.file_digest), []).append(entry)
    return tuple((filename, digest, tuple(entries)) for (filename, digest), entries in groups.items())


# --------------------------------------------------------------------------------------------------------
# The closure


class Closure:
    """What one compiled program depends on, and the means to check whether any of it moved.

    Attributes:
        functions: `FuncDep`s, executed by the trace or reachable from the globals it read.
        values: `ValueDep`s (globals), `ClassAttrDep`s (compile-view attributes), `CellDep`s (cells).
        untracked: `"module.name"` of values read that have no content fingerprint: their changes are
            invisible (`cache_reset()` is the escape hatch).
        anonymous: names of dependencies that do not resolve by name (a module-level lambda, a class
            defined in a function); they are checked through what holds them.
    """

    __slots__ = ("functions", "values", "untracked", "anonymous", "_checks", "_files", "_plan", "_disk_plan")

    def __init__(self, functions=(), values=(), untracked=(), anonymous=(), checks=(), files=()):
        self.functions: tuple = tuple(functions)
        self.values: tuple = tuple(values)
        self.untracked: tuple = tuple(untracked)
        self.anonymous: tuple = tuple(anonymous)
        # (memo key, checker, args, qualified name): `checker(*args, memo)` says "still the same"; the
        # key includes the expected fingerprint, so closures recorded alike share one answer per scan.
        self._checks: tuple = tuple(checks)
        # (FuncDep, namespace it ran in, anonymous?) for file-backed functions
        self._files: tuple = tuple(files)
        # `_checks` and `_files` arranged for fast scans (`_scan_plan`, `_disk_plan`), by the first scan.
        self._plan = self._disk_plan = None

    def drift(self, memo: dict) -> list[str]:
        """Qualified names of dependencies that moved or no longer resolve, sorted.

        `memo` is shared by every closure of one scan, so each dependency is resolved once per scan. A
        drifted nested function is not listed under its drifted enclosing function.
        """
        plan = self._plan
        if plan is None:
            plan = self._plan = _scan_plan(self._checks)
        groups, rest = plan
        unsettled = []
        # Globals still bound to the very objects recorded, per namespace (looked up once), in tight
        # loops: no memo, no call but a weak reference's. This is `_matches` inlined for the two
        # commonest snapshots; a global that fails it joins `rest` for the memoized checker, which
        # resolves it in full (an identity test is as cheap as a memo lookup, so sharing those answers
        # would not pay).
        for nskey, module, recorded, same, functions in groups:
            ns = memo.get(nskey)
            if ns is None:
                ns = _live_namespace(module, recorded, memo, nskey)
            get = ns.get
            for name, held, check in same:
                # `held` is the recorded object (an atom, a tuple of atoms) or a weak reference to it. A
                # dead reference returns None, hence the `is not None` (a weakly held value is never None).
                value = get(name, _MISSING)
                if value is held or (type(held) is _Ref and value is not None and held() is value):
                    continue
                unsettled.append(check)
            for name, fn_ref, code_ref, qualname, check in functions:
                # A function without defaults or cells: the same object with the same code and name
                # (`%autoreload 2` swaps `__code__` in place). `__closure__` is read-only, and a swapped
                # code must have the same free variables, so there are no cells to look at.
                fn = get(name)
                if (
                    fn is not None
                    and fn_ref() is fn
                    and fn.__code__ is code_ref()
                    and fn.__defaults__ is None
                    and fn.__kwdefaults__ is None
                    and fn.__qualname__ == qualname
                ):
                    continue
                unsettled.append(check)
        out = None
        for check in (*unsettled, *rest):
            if not _memoized(check, memo):
                out = out or set()
                out.add(check[3])
        return _collapse(out) if out else []

    def disk_edits(self, memo: dict) -> list[str]:
        """Functions whose source file now defines them differently while the live code did not change.

        That is "edited on disk, not loaded yet" (`importlib.reload` or `%autoreload` will pick it up).
        Comment-only and blank-line edits do not count: the file is compiled and compared by code.
        """
        plan = self._disk_plan
        if plan is None:
            plan = self._disk_plan = _disk_plan(self._files)
        out = None
        for filename, file_digest, files in plan:
            digest, version = _disk_state(filename, memo)
            if digest == file_digest:
                continue  # the file is as recorded: none of its functions has a pending edit
            for dep, ns, anonymous in files:
                if not anonymous:
                    live = _live_function(dep.module, ns, dep.qualname, memo)
                    if live is None or dep.fingerprint not in live:
                        continue  # the live code moved: that is drift, not a pending disk edit
                on_disk = version.codes(dep.qualname)
                if on_disk is None or dep.fingerprint not in on_disk:
                    out = out or set()
                    out.add(dep.qualified)
        return _collapse(out) if out else []

    def names(self) -> list[str]:
        """Every dependency's qualified name, sorted (functions, globals, class attributes, cells)."""
        return sorted({d.qualified for d in (*self.functions, *self.values)})

    def files(self) -> set[str]:
        """The user source files the functions live in (notebook cells excluded): what to watch."""
        return {d.filename for d in self.functions if d.file_digest is not None}

    def __repr__(self):
        return (
            f"<Closure {len(self.functions)} functions, {len(self.values)} values, "
            f"{len(self.untracked)} untracked>"
        )


def _collapse(names: set) -> list[str]:
    """Sorted names, without `f.<locals>.g` when `f` itself is listed."""
    return sorted(n for n in names if not any(n.startswith(p + ".<locals>.") for p in _prefixes(n, names)))


def _prefixes(name: str, names: set):
    head = name
    while ".<locals>." in head:
        head = head.rpartition(".<locals>.")[0]
        if head in names:
            yield head


# --------------------------------------------------------------------------------------------------------
# Building a closure from what a recording saw


class _Builder:
    def __init__(self):
        self.functions: dict[int, tuple] = {}  # id(code) -> (FuncDep, ns, anonymous)
        self.codes: list = []  # keeps the code objects alive while ids are in use
        self.values: dict[tuple, tuple] = {}  # (id(ns), name) -> (ValueDep, ns, snapshot)
        self.attrs: dict[tuple, tuple] = {}  # (id(cls), name) -> (ClassAttrDep, ns, anonymous, snapshot)
        self.cells: dict[tuple, CellDep] = {}  # (module, qualname, var) -> CellDep
        self.digests: dict[str, str | None] = {}
        self.executed: set[tuple[str, str]] = set()  # (module, qualname) the trace ran

    def function(self, code: types.CodeType, ns: dict, cells) -> None:
        """Add a user function (by code), the globals it reads and, recursively, what those hold."""
        if id(code) in self.functions:
            return
        module = ns.get("__name__") or "?"
        qualname = code.co_qualname
        filename = code.co_filename
        digest = None
        if not _is_cell_file(filename):
            if filename not in self.digests:
                self.digests[filename] = _file_digest(filename)
            digest = self.digests[filename]
        fp = code_fingerprint(code)
        dep = FuncDep(module, qualname, fp, filename, digest)
        # Resolvable by name now, to this very code? Otherwise it is anonymous (see module docstring).
        live = _resolve_function(_live_namespace(module, ns, {}), qualname)
        self.functions[id(code)] = (dep, ns, live is None or fp not in live)
        self.codes.append(code)
        reads = _reads(code)
        for name in reads.names:
            value = ns.get(name, _MISSING)
            if value is not _MISSING:
                self.value(ns, name, value)
        for name, attr in reads.attrs:
            mod = ns.get(name)
            if isinstance(mod, types.ModuleType) and _is_user_module(mod.__name__):
                value = mod.__dict__.get(attr, _MISSING)
                if value is not _MISSING:
                    self.value(mod.__dict__, attr, value)
        if cells and (module, qualname.rpartition(".<locals>.")[0]) in self.executed:
            cells = ()  # a closure the trace itself created: its cells hold trace-time values
        for var, value in cells or ():
            if var == "__class__":
                continue  # the class a method is defined in: covered by the method's own dependency
            cfp = _value_fingerprint(value)
            if cfp is _SKIP:
                continue
            self.cells[(module, qualname, var)] = CellDep(module, qualname, var, cfp)
            self.walk(value)

    def value(self, ns: dict, name: str, value) -> None:
        key = (id(ns), name)
        if key in self.values:
            return
        fp = _value_fingerprint(value)
        if fp is _SKIP:
            return
        snap = _freeze(_snapshot(value)) if fp is not None else None
        self.values[key] = (ValueDep(ns.get("__name__") or "?", name, fp), ns, snap)
        self.walk(value)

    def class_attr(self, cls: type, name: str, attr) -> None:
        key = (id(cls), name)
        if key in self.attrs:
            return
        fp = _attr_fingerprint(attr)
        if fp is _SKIP:
            return
        ns = _class_namespace(cls)
        dep = ClassAttrDep(cls.__module__, cls.__qualname__, name, fp)
        anonymous = ns is None or not isinstance(
            _lookup(_live_namespace(cls.__module__, ns, {}), cls.__qualname__), type
        )
        snap = _freeze(_snapshot(attr)) if fp is not None else None
        self.attrs[key] = (dep, ns, anonymous, snap)
        self.walk(attr)

    def walk(self, value) -> None:
        """Statically add the user functions `value` holds (JAX may not re-run their Python)."""
        if not callable(value) and not isinstance(value, (staticmethod, classmethod, property)):
            return
        if isinstance(value, type):
            return  # a class's methods are dependencies when called; its fingerprint covers the rest
        for fn in _underlying(value):
            if _is_user_function(fn):
                self.function(fn.__code__, fn.__globals__, _cells_of(fn))

    def build(self) -> Closure:
        functions, values, untracked, anonymous, checks, files = [], [], set(), set(), [], []
        # A function bound to a global that is itself a tracked dependency needs no check of its own: the
        # global's fingerprint covers its code (and its defaults and cells).
        covered = {(id(ns), dep.name) for dep, ns, _snap in self.values.values() if dep.fingerprint}
        for dep, ns, anon in self.functions.values():
            functions.append(dep)
            if anon:
                anonymous.add(dep.qualified)
            elif (id(ns), dep.qualname) not in covered:
                nskey, key = ("N", dep.module, id(ns)), ("F", dep.module, id(ns), dep.qualname)
                args = (nskey, dep.module, ns, key, dep.qualname, dep.fingerprint, None)
                checks.append((key + (dep.fingerprint,), _check_function, args, dep.qualified))
            if dep.file_digest is not None:
                files.append((dep, ns, anon))
        for dep, ns, snap in self.values.values():
            values.append(dep)
            if dep.fingerprint is None:
                untracked.add(dep.qualified)
            nskey, key = ("N", dep.module, id(ns)), ("V", dep.module, id(ns), dep.name)
            args = (nskey, dep.module, ns, key, dep.name, dep.fingerprint, snap)
            checks.append((key + (dep.fingerprint,), _check_value, args, dep.qualified))
        for dep, ns, anon, snap in self.attrs.values():
            values.append(dep)
            if dep.fingerprint is None:
                untracked.add(dep.qualified)
            if anon:
                anonymous.add(dep.qualified)
            else:
                nskey, key = ("N", dep.module, id(ns)), ("A", dep.module, id(ns), dep.cls_qualname, dep.name)
                args = (nskey, dep.module, ns, key, dep.cls_qualname, dep.name, dep.fingerprint, snap)
                checks.append((key + (dep.fingerprint,), _check_class_attr, args, dep.qualified))
        for dep in self.cells.values():
            values.append(dep)
            if dep.fingerprint is None:
                untracked.add(dep.qualified)
        functions.sort(key=lambda d: (d.module, d.qualname, d.fingerprint))
        values.sort(key=lambda d: (type(d).__name__, d.qualified))
        return Closure(functions, values, sorted(untracked), sorted(anonymous), checks, files)


def _cell_contents(closure) -> list:
    out = []
    for cell in closure or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:  # an empty cell
            out.append(_MISSING)
    return out


def _cells_of(fn: types.FunctionType) -> list[tuple[str, object]]:
    """`(free variable, value)` of each filled closure cell of `fn`."""
    cells = zip(fn.__code__.co_freevars, _cell_contents(fn.__closure__), strict=True)
    return [(k, v) for k, v in cells if v is not _MISSING]


def _class_namespace(cls: type) -> dict | None:
    """The globals of the module a class was defined in (its methods know it even in an IPython shell)."""
    for attr in vars(cls).values():
        if not isinstance(attr, (types.FunctionType, staticmethod, classmethod, property)):
            continue
        for fn in _underlying(attr):
            if fn.__code__.co_qualname.startswith(cls.__qualname__ + "."):
                return fn.__globals__
    module = sys.modules.get(cls.__module__)
    return getattr(module, "__dict__", None)


# --------------------------------------------------------------------------------------------------------
# Recording


class Recorder:
    """Records the dependency closure of the code run inside `with record() as r:`; `r.closure` after.

    Nested recorders in one thread all receive every event (the outer one also depends on what the inner
    one traced); recorders in other threads are independent. In the `traceback` mode the code inside the
    block hands each traced jaxpr over with `r.traced(jaxpr)`.
    """

    __slots__ = ("closure", "_frames", "_attrs", "_jaxprs", "_roots", "_mode", "_tid")

    def __init__(self):
        self.closure: Closure | None = None
        self._frames: dict[int, tuple] = {}  # id(code) -> (code, globals, cells or None)
        self._attrs: dict[tuple, tuple] = {}  # (id(cls), name) -> (cls, name, attr)
        self._jaxprs: list = []  # traced jaxprs (traceback mode)
        self._roots: list = []  # the functions traced (traceback mode)
        self._mode = None
        self._tid = None

    def __enter__(self) -> Recorder:
        self._tid = threading.get_ident()
        self._mode = _hooks.enter(self)
        return self

    def __exit__(self, *exc) -> None:
        _hooks.exit(self)
        if self._jaxprs:
            roots = [*self._roots, *(attr for _cls, _name, attr in self._attrs.values())]
            for code, ns, cells in _traceback_functions(self._jaxprs, roots):
                self._frames.setdefault(id(code), (code, ns, cells))
        builder = _Builder()
        for code, ns, _cells in self._frames.values():
            builder.executed.add((ns.get("__name__") or "?", code.co_qualname))
        for code, ns, cells in self._frames.values():
            builder.function(code, ns, cells)
        for cls, name, attr in self._attrs.values():
            builder.class_attr(cls, name, attr)
        self.closure = builder.build()
        self._frames.clear()
        self._attrs.clear()
        self._jaxprs.clear()
        self._roots.clear()

    def traced(self, jaxpr, fn=None) -> None:
        """Hand over a jaxpr traced inside this block and the function traced (`compile_program` does).
        The traceback mode reads the user functions from the jaxpr, for every recorder of this thread,
        and finds their globals starting from `fn`; the hook modes saw them run."""
        for rec in _hooks.active.get(self._tid, ()):
            if rec._mode == "traceback":
                rec._jaxprs.append(jaxpr)
                if fn is not None:
                    rec._roots.append(fn)

    def _note(self, frame, code) -> None:
        """A user function started: remember its code, globals and (closures) its cell values."""
        if id(code) in self._frames:
            return
        cells = None
        if code.co_freevars:
            try:
                local = frame.f_locals
                cells = [(n, local[n]) for n in code.co_freevars if n in local]
            except Exception:
                cells = None
        self._frames[id(code)] = (code, frame.f_globals, cells)


def record() -> Recorder:
    """A context manager recording the dependency closure of what runs inside it (in this thread)."""
    return Recorder()


def note_class_attr(cls, name: str, attr) -> None:
    """Record that traced code read class attribute `cls.name` (the compile view calls this)."""
    stack = _hooks.active.get(threading.get_ident())
    if stack:
        for rec in stack:
            rec._attrs.setdefault((id(cls), name), (cls, name, attr))


# --------------------------------------------------------------------------------------------------------
# The traceback mode: the user functions a trace ran, read from its equations' source tracebacks


def _traceback_codes(jaxprs: list) -> dict[int, types.CodeType]:
    """User code objects on the Python stack when any equation (at any depth) was traced.

    JAX keeps a traceback per equation, cut at the traced function (cached inner jaxprs keep theirs):
    every user function that bound a primitive, directly or any number of calls down, is on one.
    `<module>` frames are never a function the program depends on."""
    codes, seen_tb = {}, {}
    get_verdict = _file_verdicts.get
    for eqn in jaxpr_eqns(jaxprs):
        tb = equation_traceback(eqn)
        if tb is not None and id(tb) not in seen_tb:
            seen_tb[id(tb)] = tb  # held, like the jaxprs: ids stay unique for the walk
            for code in traceback_codes(tb):
                if code.co_name == "<module>":
                    break
                verdict = get_verdict(code.co_filename)
                if verdict is None:
                    verdict = _classify_file(code.co_filename)
                if verdict:
                    codes[id(code)] = code
    return codes


class _FunctionIndex:
    """Where a user code object lives: the function holding it (for its globals and closure cells).

    A traceback names code objects only, so the functions are looked up among the user's namespaces
    (user modules, `__main__`, the IPython user namespace) and the classes defined there, nested code
    included. Rebuilt after a world bump, and once more when a code is not found (defined since)."""

    def __init__(self):
        self.world = None
        self.owners: dict[int, tuple] = {}  # id(code) -> (code, globals, cells or None, is a function)
        self.files: dict[str, dict] = {}  # module file -> its globals
        self.scanned: set[int] = set()  # ids of the namespaces indexed
        self.main: dict = {}  # the notebook's namespace (`__main__`), where a cell's code runs

    def lookup(self, code: types.CodeType, rebuilt: list) -> tuple | None:
        hit = self.owners.get(id(code))
        if (hit is None or hit[0] is not code) and not rebuilt:
            rebuilt.append(True)
            self.build()
            hit = self.owners.get(id(code))
        return hit[:3] if hit is not None and hit[0] is code else None

    def fallback(self, code: types.CodeType) -> tuple:
        """A code no namespace holds (a lambda in a container, a closure made and dropped): the globals of
        its module file, or of the notebook for a cell, so its reads are still recorded. By name it
        resolves to nothing, so it is anonymous, covered through whatever holds it."""
        ns = self.files.get(code.co_filename)
        if ns is None:
            ns = self.main if _is_cell_file(code.co_filename) else {"__name__": "?"}
        return code, ns, None

    def fresh(self) -> _FunctionIndex:
        from ._world import world

        if self.world != world():
            self.build()
        return self

    @staticmethod
    def _namespaces() -> list[tuple[str, dict]]:
        """(module name, globals) of each user namespace; the notebook's (`__main__`) first."""
        out = []
        shell = sys.modules.get("IPython")
        get_ipython = getattr(shell, "get_ipython", None)
        ip = get_ipython() if get_ipython is not None else None
        if ip is not None:
            out.append(("__main__", ip.user_ns))
        for name, module in list(sys.modules.items()):
            ns = getattr(module, "__dict__", None)
            if isinstance(ns, dict) and _is_user_module(name):
                out.append((name, ns))
        if not out or out[0][0] != "__main__":
            out.insert(0, ("__main__", getattr(sys.modules.get("__main__"), "__dict__", {})))
        return out

    def build(self) -> None:
        from ._world import world

        self.world = world()
        owners, files, scanned = {}, {}, set()
        namespaces = self._namespaces()
        for _name, ns in namespaces:
            filename = ns.get("__file__")
            if isinstance(filename, str):
                files.setdefault(filename, ns)
            self.add_namespace(ns, owners)
            scanned.add(id(ns))
        self.owners, self.files, self.scanned, self.main = owners, files, scanned, namespaces[0][1]

    @classmethod
    def add_namespace(cls, ns: dict, owners: dict) -> None:
        for value in list(ns.values()):
            cls._add(value, owners, 0)

    @classmethod
    def _add(cls, value, owners: dict, depth: int) -> None:
        if isinstance(value, type):
            if depth < 2 and _is_user_module(getattr(value, "__module__", "") or ""):
                for attr in list(vars(value).values()):
                    cls._add(attr, owners, depth + 1)
            return
        if not callable(value) and not isinstance(value, (staticmethod, classmethod, property)):
            return
        for fn in _underlying(value):
            if not _is_user_function(fn):
                continue
            code, cells = fn.__code__, _cells_of(fn)
            hit = owners.get(id(code))
            if hit is None or not hit[3]:  # a function object beats a code nested in another function
                owners[id(code)] = (code, fn.__globals__, cells, True)
            elif hit[2] and any(a is not b for (_, a), (_, b) in zip(hit[2], cells)):
                owners[id(code)] = (code, hit[1], None, True)  # closures sharing this code: which ran?
            for nested in _nested(code):
                owners.setdefault(id(nested), (nested, fn.__globals__, None, False))


_index = _FunctionIndex()


def _traceback_functions(jaxprs: list, roots: list) -> list[tuple]:
    """(code, globals, cells or None) of each user function the traced jaxprs' tracebacks show.

    The functions reachable from `roots` (the traced function, through closure cells, methods, partials
    and wrappers; the class attributes read through the compile view) are searched first, with the
    namespaces they live in: that is where the hooks and their helpers are, whether or not a module lists
    it (cells exec'd into a namespace of their own). Then the user's modules (`_FunctionIndex`)."""
    codes = _traceback_codes(jaxprs)
    if not codes:
        return []
    index, rebuilt = _index.fresh(), []
    local: dict = {}
    scanned = set(index.scanned)
    stack, seen = list(roots), set()
    while stack and len(seen) < 256:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        for fn in _underlying(obj):
            if _is_user_function(fn):
                _FunctionIndex._add(fn, local, 0)
                if id(fn.__globals__) not in scanned:
                    scanned.add(id(fn.__globals__))
                    _FunctionIndex.add_namespace(fn.__globals__, local)
            # the program functions nitro_ipy builds hold the hooks in their cells
            stack.extend(v for v in _cell_contents(fn.__closure__) if callable(v))
    out = []
    for code in codes.values():
        hit = local.get(id(code))
        found = hit[:3] if hit is not None and hit[0] is code else index.lookup(code, rebuilt)
        out.append(found or index.fallback(code))
    return out


class _Hooks:
    """Installs one interpreter hook while any recorder is active; dispatches to the thread's recorders."""

    def __init__(self):
        self.lock = threading.Lock()
        self.active: dict[int, list[Recorder]] = {}  # thread id -> active recorders, outermost first
        self.tool: int | None = None  # sys.monitoring tool id while claimed
        self.monitoring_users = 0
        self.profile_prev: dict[int, object] = {}  # thread id -> profiler to restore

    # ---- entry and exit

    def enter(self, rec: Recorder) -> str:
        wanted = os.environ.get("NITRO_IPY_RECORDER") or ("monitoring" if hasattr(sys, "monitoring") else "traceback")
        with self.lock:
            stack = self.active.setdefault(rec._tid, [])
            stack.append(rec)
            if len(stack) > 1:
                return stack[0]._mode  # the thread's hook is installed already
            if wanted == "monitoring" and hasattr(sys, "monitoring") and self._claim_monitoring():
                return "monitoring"
        if wanted == "profile" or not _tracebacks_usable():
            return self._install_profile(rec._tid, stack)
        return "traceback"

    def exit(self, rec: Recorder) -> None:
        with self.lock:
            stack = self.active.get(rec._tid, [])
            if rec in stack:
                stack.remove(rec)
            if stack:
                return
            self.active.pop(rec._tid, None)
            if rec._mode == "monitoring":
                self._release_monitoring()
                return
        if rec._mode == "profile":
            self._remove_profile(rec._tid)

    # ---- sys.monitoring (3.12+): one global callback, library code disabled after its first call

    def _claim_monitoring(self) -> bool:
        mon = sys.monitoring
        if self.tool is None:
            # 0, 1, 2 and 5 are the debugger's, coverage's, profiler's and optimizer's by convention.
            for tool in (4, 3):
                try:
                    mon.use_tool_id(tool, "nitro_ipy")
                except ValueError:
                    continue
                self.tool = tool
                break
            else:
                return False
            mon.register_callback(self.tool, mon.events.PY_START, self._on_py_start)
            mon.set_events(self.tool, mon.events.PY_START)
        self.monitoring_users += 1
        return True

    def _release_monitoring(self) -> None:
        self.monitoring_users -= 1
        if self.monitoring_users == 0 and self.tool is not None:
            mon = sys.monitoring
            mon.set_events(self.tool, 0)
            mon.register_callback(self.tool, mon.events.PY_START, None)
            mon.free_tool_id(self.tool)
            self.tool = None

    def _on_py_start(self, code, offset):
        verdict = _file_verdicts.get(code.co_filename)
        if verdict is None:
            verdict = _classify_file(code.co_filename)
        if not verdict:
            return sys.monitoring.DISABLE  # library code is never tracked: stop paying for it
        stack = self.active.get(threading.get_ident())
        if stack:
            frame = sys._getframe(1)
            if frame.f_code is code:
                for rec in stack:
                    rec._note(frame, code)
        # User code is never disabled: a later recorder (or another thread's) needs its events.
        return None

    # ---- sys.setprofile (3.11): per thread, chained to a Python-level profiler already installed

    def _install_profile(self, tid: int, stack: list) -> str:
        prev = sys.getprofile()
        if prev is not None and not callable(prev):
            # A C profiler (cProfile on 3.11) cannot be chained or restored from Python: leave it alone
            # and read the trace's tracebacks instead.
            return "traceback"
        get_verdict = _file_verdicts.get

        def hook(frame, event, arg):
            # Runs on every call and C call of the trace: keep it minimal.
            if event == "call":
                code = frame.f_code
                verdict = get_verdict(code.co_filename)
                if verdict is None:
                    verdict = _classify_file(code.co_filename)
                if verdict:
                    for rec in stack:
                        rec._note(frame, code)

        if prev is not None:
            inner = hook

            def hook(frame, event, arg):  # noqa: F811 (chained variant)
                inner(frame, event, arg)
                return prev(frame, event, arg)

        self.profile_prev[tid] = (prev, hook)
        sys.setprofile(hook)
        return "profile"

    def _remove_profile(self, tid: int) -> None:
        prev, hook = self.profile_prev.pop(tid, (None, None))
        if sys.getprofile() is hook:
            sys.setprofile(prev)


_hooks = _Hooks()


# --------------------------------------------------------------------------------------------------------
# Closures as plain records (the program store writes them to disk; another process rebuilds them)


def closure_records(closure) -> dict:
    """The dependency records of `closure` as plain lists (JSON): what `closure_from_records` rebuilds."""
    values = []
    for dep in closure.values:
        values.append([type(dep).__name__, *dep])
    return {
        "functions": [list(dep) for dep in closure.functions],
        "values": values,
        "untracked": list(closure.untracked),
        "anonymous": list(closure.anonymous),
    }


_VALUE_TYPES = {"ValueDep": ValueDep, "ClassAttrDep": ClassAttrDep, "CellDep": CellDep}


def live_module_namespace(module: str) -> dict:
    """The live namespace of `module`: the notebook's user namespace for `__main__`; {} if not imported."""
    if module == "__main__":
        shell = sys.modules.get("IPython")
        get_ipython = getattr(shell, "get_ipython", None)
        ip = get_ipython() if get_ipython is not None else None
        if ip is not None:
            return ip.user_ns
    ns = getattr(sys.modules.get(module), "__dict__", None)
    return ns if isinstance(ns, dict) else {}


def closure_from_records(records: dict):
    """A `_closure.Closure` over the live namespaces, checking the recorded fingerprints.

    The one place a closure is made from records (the program store's, `_store.py`): the checks are
    the ones `_Builder.build` makes at record time, with no identity snapshot (every value is compared
    by content fingerprint)."""
    functions = [FuncDep(*r) for r in records["functions"]]
    values = [_VALUE_TYPES[r[0]](*r[1:]) for r in records["values"]]
    anonymous = set(records["anonymous"])
    checks, files = [], []
    spaces = {}

    def ns_of(module):
        if module not in spaces:
            spaces[module] = live_module_namespace(module)
        return spaces[module]

    covered = {(v.module, v.name) for v in values if type(v) is ValueDep and v.fingerprint}
    for dep in functions:
        ns = ns_of(dep.module)
        anon = dep.qualified in anonymous
        if not anon and (dep.module, dep.qualname) not in covered:
            nskey, key = ("N", dep.module, id(ns)), ("F", dep.module, id(ns), dep.qualname)
            args = (nskey, dep.module, ns, key, dep.qualname, dep.fingerprint, None)
            checks.append((key + (dep.fingerprint,), _check_function, args, dep.qualified))
        if dep.file_digest is not None:
            files.append((dep, ns, anon))
    for dep in values:
        ns = ns_of(dep.module)
        nskey = ("N", dep.module, id(ns))
        if type(dep) is ValueDep:
            key = ("V", dep.module, id(ns), dep.name)
            args = (nskey, dep.module, ns, key, dep.name, dep.fingerprint, None)
            checks.append((key + (dep.fingerprint,), _check_value, args, dep.qualified))
        elif type(dep) is ClassAttrDep and dep.qualified not in anonymous:
            key = ("A", dep.module, id(ns), dep.cls_qualname, dep.name)
            args = (nskey, dep.module, ns, key, dep.cls_qualname, dep.name, dep.fingerprint, None)
            checks.append((key + (dep.fingerprint,), _check_class_attr, args, dep.qualified))
    return Closure(functions, values, records["untracked"], records["anonymous"], checks, files)
