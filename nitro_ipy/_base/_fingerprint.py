"""Content fingerprints of values and code, stable across processes (never the salted `hash()`).

A fingerprint is a hex digest of a canonical byte stream. Two values with equal content fingerprint equal;
anything whose only notion of equality is identity is refused with the path at which it was met.
"""

import dataclasses
import dis
import enum
import functools
import hashlib
import inspect
import math
import struct
import sys
import types
from collections.abc import Mapping

import numpy as np

from ._compat import is_custom_derivative
from ._errors import NitroTypeError
from ._memo import Memo
from ._origin import is_user_module


class Unfingerprintable(NitroTypeError):
    """A value with no content fingerprint; `path` says where inside the value it was met."""

    def __init__(self, path: str, what: str):
        self.path = path
        self.what = what
        super().__init__(f"{path}: {what}")


def _qualname(obj) -> str:
    return f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


class _Hasher:
    __slots__ = ("h", "active", "callables")

    def __init__(self):
        self.h = hashlib.blake2b(digest_size=16)
        self.active: set[int] = set()  # ids on the current path: recursion through closures/containers
        # Callable wrappers met on the way (partials, jit wrappers): content-fingerprinted here, but
        # `copy.deepcopy` would break or re-identify them, so the hashability check keeps them as they are.
        self.callables: list = []

    def tag(self, t: bytes):
        self.h.update(t)
        self.h.update(b"\x00")

    def text(self, s: str):
        b = s.encode("utf-8", "surrogatepass")
        self.h.update(struct.pack("<Q", len(b)))
        self.h.update(b)

    def raw(self, b: bytes):
        self.h.update(struct.pack("<Q", len(b)))
        self.h.update(b)

    def value(self, v, path: str):
        t = type(v)
        if v is None or v is Ellipsis or v is NotImplemented:
            self.tag(repr(v).encode())
        elif t is bool:
            self.tag(b"T" if v else b"F")
        elif t is int:
            self.tag(b"i")
            self.text(str(v))
        elif t is float:
            self.tag(b"f")
            self.text("nan" if math.isnan(v) else v.hex())
        elif t is complex:
            self.tag(b"c")
            self.value(v.real, path)
            self.value(v.imag, path)
        elif t is str:
            self.tag(b"s")
            self.text(v)
        elif t in (bytes, bytearray):
            self.tag(b"b")
            self.raw(bytes(v))
        elif isinstance(v, enum.Enum):
            self.tag(b"enum")
            self.text(_qualname(t))
            self.text(v.name)
            self.value(v.value, f"{path}.value")
        elif isinstance(v, np.dtype):
            self.tag(b"dtype")
            self.text(_dtype_text(v))
        elif isinstance(v, type) and _is_scalar_type(v):
            self.tag(b"dtype")
            self.text(_dtype_text(np.dtype(v)))
        elif isinstance(v, (np.ndarray, np.generic)):
            self.array(np.asarray(v))
        elif _is_jax_array(v):
            self.jax_array(v, path)
        else:
            self.compound(v, t, path)

    def array(self, a):
        self.tag(b"nd")
        self.text(_dtype_text(a.dtype))
        self.text(repr(a.shape))
        if a.dtype.hasobject:
            for i, item in enumerate(a.ravel()):
                self.value(item, f"[{i}]")
        else:
            self.raw(np.ascontiguousarray(a).tobytes())

    def jax_array(self, v, path):
        import jax

        if isinstance(v, jax.core.Tracer):
            raise Unfingerprintable(path, "a JAX tracer (a traced value has no content yet)")
        self.array(np.asarray(v))

    def compound(self, v, t, path):
        key = id(v)
        if key in self.active:
            self.tag(b"cycle")
            return
        self.active.add(key)
        try:
            self._compound(v, t, path)
        finally:
            self.active.discard(key)

    def _compound(self, v, t, path):
        if isinstance(v, tuple) and hasattr(t, "_fields"):  # NamedTuple
            self.tag(b"namedtuple")
            self.text(_qualname(t))
            for name, item in zip(t._fields, v):
                self.text(name)
                self.value(item, f"{path}.{name}")
        elif isinstance(v, (tuple, list)):
            self.tag(b"tuple" if isinstance(v, tuple) else b"list")
            self.text(_qualname(t))
            self.text(str(len(v)))
            for i, item in enumerate(v):
                self.value(item, f"{path}[{i}]")
        elif isinstance(v, (dict, Mapping)):  # a content-hashable mapping (flax's HashableMapping) too
            self.tag(b"dict")
            self.text(_qualname(t) if t is not dict else "dict")
            pairs = sorted((self.sub(k, f"{path} key {k!r}"), self.sub(item, f"{path}[{k!r}]")) for k, item in v.items())
            for kfp, vfp in pairs:
                self.text(kfp)
                self.text(vfp)
        elif isinstance(v, (set, frozenset)):
            self.tag(b"set")
            for fp in sorted(self.sub(item, f"{path}{{{item!r}}}") for item in v):
                self.text(fp)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            self.tag(b"dataclass")
            self.text(_qualname(t))
            self.text(_library_version(t.__module__))  # a Flax or Equinox module: its code is its version
            for f in dataclasses.fields(v):
                self.text(f.name)
                self.value(getattr(v, f.name), f"{path}.{f.name}")
        elif isinstance(v, functools.partial):
            self.callables.append(v)
            self.tag(b"partial")
            self.value(v.func, f"{path}.func")
            self.value(v.args, f"{path}.args")
            self.value(v.keywords, f"{path}.keywords")
        elif isinstance(v, types.FunctionType):
            self.function(v, path)
        elif isinstance(v, types.MethodType):
            self.tag(b"method")
            self.value(v.__func__, f"{path}.__func__")
            self.value(v.__self__, f"{path}.__self__")
        elif isinstance(v, types.CodeType):
            self.code(v, path)
        elif isinstance(v, (types.BuiltinFunctionType, types.ModuleType, np.ufunc)):
            self.tag(b"named")
            self.text(f"{getattr(v, '__module__', None)}.{v.__name__}")
        elif isinstance(v, type):
            self.cls(v, path)
        elif is_custom_derivative(v):
            self.callables.append(v)
            self.tag(b"custom")
            self.text(t.__name__)
            self.value(v.fun, f"{path}.fun")
            for rule in ("jvp", "fwd", "bwd"):
                if getattr(v, rule, None) is not None:
                    self.value(getattr(v, rule), f"{path}.{rule}")
        elif hasattr(v, "__wrapped__") and callable(v):
            # jax.jit / jax.checkpoint / functools.wraps wrappers: the wrapped code is the content.
            self.callables.append(v)
            self.tag(b"wrapped")
            self.text(_qualname(t))
            self.value(v.__wrapped__, f"{path}.__wrapped__")
        elif t is types.SimpleNamespace:
            self.tag(b"namespace")
            self.value(vars(v), path)
        elif isinstance(v, (range, slice)):
            self.tag(t.__name__.encode())
            self.value((v.start, v.stop, v.step), path)
        elif _is_treedef(v):
            self.tag(b"treedef")
            self.text(repr(v))
        else:
            how = "hashes by identity" if type(v).__hash__ is object.__hash__ else "has no content fingerprint"
            raise Unfingerprintable(path, f"{t.__qualname__} {how}")

    def sub(self, v, path) -> str:
        h = _Hasher()
        h.active = self.active
        h.callables = self.callables
        h.value(v, path)
        return h.h.hexdigest()

    def function(self, fn, path):
        self.tag(b"fn")
        self.text(fn.__qualname__)
        self.code(fn.__code__, path)
        self.value(fn.__defaults__, f"{path}.__defaults__")
        self.value(fn.__kwdefaults__, f"{path}.__kwdefaults__")
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            self.text(name)
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell: a name assigned later in the enclosing scope
                self.tag(b"empty")
                continue
            self.value(contents, f"{path} (closure cell `{name}`)")

    def code(self, code, path):
        self.tag(b"code")
        self.text(code_fingerprint(code))

    def cls(self, c, path):
        self.tag(b"class")
        self.text(_qualname(c))
        # A user's class by its methods' code, a library's by its name and its package's version (its
        # code only changes with an upgrade; a program stored on disk must not outlive one).
        if not is_user_module(c.__module__):
            self.text(_library_version(c.__module__))
            return
        for name, attr in sorted(vars(c).items()):
            if isinstance(attr, (staticmethod, classmethod)):
                attr = attr.__func__
            if isinstance(attr, types.FunctionType):
                self.text(name)
                self.function(attr, f"{path}.{name}")


_versions = Memo("package versions", maxsize=1024)


def _library_version(module: str) -> str:
    """`package version` of the installed package `module` belongs to; "" for user code (judged by
    its code instead) and for a package without a version."""
    top = (module or "").partition(".")[0]
    hit = _versions.get(top)
    if hit is None:
        if is_user_module(module or "") or top in ("builtins", "__main__"):
            hit = ""
        else:
            hit = str(getattr(sys.modules.get(top), "__version__", "") or "")
            if not hit:
                try:
                    from importlib.metadata import version

                    hit = version(top)
                except Exception:  # not a distribution (the standard library): its name is enough
                    hit = ""
        _versions[top] = hit
    return hit


def _dtype_text(dt: np.dtype) -> str:
    # `dt.str` alone is "<V1" for every one-byte ml_dtype (float8 variants, int4, ...): add the name.
    return f"{dt.str}:{dt.name}" if dt.names is None else repr(dt.descr)


def _is_scalar_type(t) -> bool:
    # `np.float32`, `jnp.float32` (a scalar-type wrapper) and friends.
    try:
        return issubclass(t, np.generic) or type(t).__name__ == "_ScalarMeta"
    except TypeError:
        return False


def _is_jax_array(v) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(v, jax.Array)


def _is_treedef(v) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(v, jax.tree_util.PyTreeDef)


_code_memo = Memo("code fingerprints", maxsize=65536)  # id(code) -> (code, fingerprint)


def code_fingerprint(code: types.CodeType) -> str:
    """Fingerprint of a code object: bytecode, constants, names, signature; not line numbers or comments.

    Memoized by identity (code objects are immutable); nested code objects (inner functions, lambdas,
    comprehensions) are fingerprinted recursively.
    """
    hit = _code_memo.get(id(code))
    if hit is not None and hit[0] is code:
        return hit[1]
    h = hashlib.blake2b(digest_size=16)

    def put(b: bytes):
        h.update(struct.pack("<Q", len(b)))
        h.update(b)

    put(code.co_code)
    for attr in ("co_argcount", "co_posonlyargcount", "co_kwonlyargcount", "co_flags"):
        put(str(getattr(code, attr)).encode())
    for attr in ("co_names", "co_varnames", "co_freevars", "co_cellvars"):
        put(repr(getattr(code, attr)).encode())
    docstring = _docstring_index(code)
    for i, const in enumerate(code.co_consts):
        if i == docstring:
            put(b"doc")  # a docstring-only edit is no edit of the program
        elif isinstance(const, types.CodeType):
            put(b"code:" + code_fingerprint(const).encode())
        else:
            put(_const_fingerprint(const).encode())
    digest = h.hexdigest()
    _code_memo[id(code)] = (code, digest)
    return digest


_CONST_LOADS = frozenset(dis.hasconst)
_EXTENDED_ARG = dis.opmap["EXTENDED_ARG"]


def _docstring_index(code: types.CodeType) -> int | None:
    """0 when `co_consts[0]` is the function's docstring, else None.

    A function's docstring is its first constant (3.11 to 3.13), which its bytecode never loads; a first
    string constant that the code does load (`return "abc"`) is a value, not a docstring.
    """
    consts = code.co_consts
    # A function without one has None there on 3.11 and 3.12, so adding or removing a docstring counts
    # as nothing too (when the bytecode does not load that None).
    if not consts or (type(consts[0]) is not str and consts[0] is not None) or not code.co_flags & inspect.CO_NEWLOCALS:
        return None
    # The raw bytecode, not `dis` (this runs for every function fingerprinted): 2-byte units of opcode and
    # argument; an `EXTENDED_ARG` before one makes its argument larger than 0.
    co = code.co_code
    extended = _EXTENDED_ARG
    for i in range(0, len(co), 2):
        if co[i + 1] == 0 and co[i] in _CONST_LOADS and (i == 0 or co[i - 2] != extended):
            return None
    return 0


def _const_fingerprint(const) -> str:
    # Constants are immutable literals; frozensets and tuples may nest code objects in theory only.
    hasher = _Hasher()
    hasher.value(const, "<const>")
    return hasher.h.hexdigest()


def fingerprint(value, path: str = "value") -> str:
    """Content fingerprint of `value`, stable across processes.

    Raises `Unfingerprintable` (with the path inside `value`) for anything that only has identity.
    """
    return fingerprint_with_callables(value, path)[0]


def fingerprint_with_callables(value, path: str = "value") -> tuple[str, list]:
    """`fingerprint(value)` and the callable wrappers (partials, jit wrappers) met inside it."""
    hasher = _Hasher()
    hasher.value(value, path)
    return hasher.h.hexdigest(), hasher.callables


def function_fingerprint(fn) -> str:
    """Fingerprint of a function: code, defaults and closure cells, recursively."""
    return fingerprint(fn, getattr(fn, "__qualname__", "function"))
