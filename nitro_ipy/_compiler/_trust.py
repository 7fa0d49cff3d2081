"""What the program store (`_store.py`) trusts, and how it reads what it trusts.

A stored program is native code this process runs, so the store runs only what this user's own
processes wrote, checked as ssh's StrictModes checks `~/.ssh`:

- the store's root, `programs/`, `xla/` and every file read are owned by this user and writable by no
  one else (not group, not others); none is a symbolic link (the root may be reached through one: it is
  checked where it resolves);
- every parent directory of the root is owned by root or this user and not writable by others, unless
  it has the sticky bit (`/tmp`): whoever can write a parent can swap the store for theirs;
- a file is opened without following symbolic links (`O_NOFOLLOW`, relative to the directory's open
  descriptor) and checked on the open descriptor (`fstat`), so a swap between the check and the read
  cannot pass.

A violation is an `Untrusted` (one line: the path, the rule, the fix); the store turns itself off.

What the loader reads besides the executable (trees, key, closure, validity) is JSON: reading it calls
nothing. Tree definitions are records naming their node types, resolved by name (never imported, never
called) among the types the live process treats as pytree nodes (`tree_records`, `tree_from_records`).
The executable is JAX's own pickle: before it is unpickled, every global it names is found by a dry run
in which each resolves to an inert stand-in (`pickle_globals`), and checked against the exact classes
and functions JAX's serializer writes (`EXECUTABLE_GLOBALS`); it is then unpickled with a `find_class`
that resolves those alone.
"""

from __future__ import annotations

import collections
import errno
import importlib
import io
import os
import pickle
import stat
import sys
from collections.abc import Mapping

from .. import _closure
from .._base._compat import is_pytree_node_type

POSIX = os.name == "posix"


class Untrusted(Exception):
    """The store (a directory or file in it) is not private to this user: one line, path, rule and fix."""

    def __init__(self, root: str, path: str, problem: str, fix: str):
        self.root, self.path, self.problem, self.fix = root, path, problem, fix
        super().__init__(
            f"nitro_ipy: refusing the program store `{root}`: {'it' if path == root else f'`{path}`'} {problem}, "
            f"and a stored program is code this process runs; the store is off for this process, programs "
            f"compile as usual. Fix: {fix}."
        )


class Refused(Exception):
    """A stored file asks for something the loader never resolves (said as the file's refusal reason)."""


# ---------------------------------------------------------------- ownership and modes
def _who(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _mode(st) -> str:
    return f"mode {stat.S_IMODE(st.st_mode):o}"


def _writable(st) -> str | None:
    """'others' or 'its group' when the mode lets them write, else None."""
    if st.st_mode & 0o002:
        return "others"
    if st.st_mode & 0o020:
        return "its group"
    return None


def check_private(root: str, path: str, st, *, kind: str, top: bool = False) -> None:
    """`path` (a directory or a file of the store, `st` its lstat/fstat; `top`: the store's own
    directory, `root` as configured or where it resolves) is this user's and no one else's to write;
    raises `Untrusted` otherwise."""
    if not POSIX:
        return
    top = top or path == root
    uid = os.getuid()
    if stat.S_ISLNK(st.st_mode):
        raise Untrusted(root, path, "is a symbolic link (the store follows none)", f"`rm {path}`")
    is_dir = stat.S_ISDIR(st.st_mode)
    if kind == "dir" and not is_dir or kind == "file" and not stat.S_ISREG(st.st_mode):
        raise Untrusted(root, path, f"is not a {'directory' if kind == 'dir' else 'regular file'}",
                        f"`rm {path}`")
    if st.st_uid != uid:
        fix = ("point `NITRO_IPY_CACHE_DIR` (or `nitro_ipy.set_cache_dir`) at a directory of your own" if top
               else f"`rm {path}` (a file you did not write)" if not is_dir
               else f"`rm -r {path}` (nitro_ipy makes it again, yours)")
        raise Untrusted(root, path, f"is owned by {_who(st.st_uid)}, not by you ({_who(uid)})", fix)
    who = _writable(st)
    if who:
        raise Untrusted(root, path, f"is writable by {who} ({_mode(st)})",
                        f"`chmod {'700' if is_dir else '600'} {path}`")


def check_parents(root: str) -> None:
    """Every directory above `root` (resolved) is owned by root or this user and not writable by others
    unless sticky; raises `Untrusted` otherwise."""
    if not POSIX:
        return
    uid = os.getuid()
    path = os.path.dirname(root)
    while True:
        try:
            st = os.stat(path)
        except OSError as err:
            raise Untrusted(root, path, f"cannot be checked ({err.strerror})",
                            "a store under directories you can read") from None
        if st.st_uid not in (0, uid):
            raise Untrusted(root, path, f"(a parent) is owned by {_who(st.st_uid)}, who could replace the store",
                            "a store under directories owned by you or root: `NITRO_IPY_CACHE_DIR` or "
                            "`nitro_ipy.set_cache_dir`")
        if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
            raise Untrusted(root, path, f"(a parent) is writable by others without the sticky bit ({_mode(st)}), "
                                        "so anyone could replace the store",
                            f"`chmod o-w {path}`, or a store under a directory only you can write")
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent


def private_dir(root: str, path: str, *, create: bool, top: bool = False) -> None:
    """Check `path` (the root or a directory in it); made 0700 when missing and `create`."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not create:
            return
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(path)
    check_private(root, path, st, kind="dir", top=top)


def _umask() -> int:
    """This process's umask, read without changing it (Linux), else the usual 022."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def check_entries(root: str, path: str) -> None:
    """Every entry of `path` (JAX's cache directory, which JAX reads without checking) is a regular file or
    directory of this user's that no one else can write. JAX writes its files with the process's umask:
    under a umask that lets the group write (002), a group-writable file of this user's inside this
    private directory is one JAX wrote, and passes (others-writable never does)."""
    group_ok = not _umask() & 0o020
    try:
        with os.scandir(path) as it:
            for e in it:
                st = e.stat(follow_symlinks=False)
                if group_ok and stat.S_ISREG(st.st_mode) and not st.st_mode & 0o002:
                    st = os.stat_result((st.st_mode & ~0o020, *tuple(st)[1:]))
                check_private(root, e.path, st, kind="any")
    except FileNotFoundError:
        pass


_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def read_private(root: str, directory: str, name: str) -> bytes | None:
    """The bytes of `directory/name`, opened without following a symbolic link (relative to the
    directory's own descriptor) and checked on the descriptor; None when there is no such file."""
    if not POSIX:
        try:
            with open(os.path.join(directory, name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
    path = os.path.join(directory, name)
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | _OPEN_FLAGS)
    try:
        check_private(root, directory, os.fstat(dfd), kind="dir")
        try:
            fd = os.open(name, _OPEN_FLAGS | getattr(os, "O_NONBLOCK", 0), dir_fd=dfd)  # a FIFO must not block
        except FileNotFoundError:
            return None
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise Untrusted(root, path, "is a symbolic link (the store follows none)", f"`rm {path}`") from None
            raise
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        check_private(root, path, st, kind="file")
        chunks, left = [], st.st_size
        while True:
            chunk = os.read(fd, max(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the executable's pickle
# The globals JAX's serializer (`jax.experimental.serialize_executable`) writes for an executable, exactly:
# classes and the unpickling functions of JAX's shardings, numpy's dtype and array reconstruction. Found
# by serializing programs of every shape the package compiles (one device, meshes, shardings, donation,
# typed keys); `save` checks each payload against this list before writing it, so a JAX that writes
# something else leaves that program to JAX's own cache (said once) and never writes an unloadable file.
_NUMPY_CORE = ("numpy._core.multiarray", "numpy.core.multiarray")  # numpy 2, numpy 1
_ML_DTYPES = ("bfloat16", "bcomplex32", "complex32", "float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn",
              "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn", "float8_e4m3fnuz",
              "float8_e5m2", "float8_e5m2fnuz", "float8_e5m3fnu", "float8_e8m0fnu", "int1", "int2", "int4",
              "uint1", "uint2", "uint4")
EXECUTABLE_GLOBALS = frozenset({
    ("jax", "P"),
    ("jax.sharding", "PartitionSpec"),
    ("jax._src.partition_spec", "PartitionSpec"),
    ("jax._src.core", "ManualAxisType"),
    ("jax._src.core", "MemorySpace"),
    ("jax._src.core", "ShapedArray"),
    ("jax._src.interpreters.pxla", "AllArgsInfo"),
    ("jax._src.interpreters.pxla", "UnloadedMeshExecutable"),
    ("jax._src.layout", "AutoLayoutSingleton"),  # JAX 0.12: an executable's default layouts
    ("jax._src.layout", "Layout"),
    ("jax._src.linear_util", "DebugInfo"),
    ("jax._src.mesh", "AbstractDevice"),
    ("jax._src.mesh", "AbstractMesh"),
    ("jax._src.mesh", "AxisType"),
    ("jax._src.mesh", "Mesh"),
    ("jax._src.named_sharding", "_unpickle_named_sharding"),
    ("jax._src.sharding_impls", "_unpickle_gspmd_sharding"),
    ("jax._src.sharding_impls", "_unpickle_single_device_sharding"),
    ("jax._src.stages", "ArgInfo"),
    ("jax._src.random.prng", "KeyTy"),  # typed keys (`jax.random.key`): their implementation's functions
    ("jax._src.random.prng", "PRNGImpl"),
    *(("jax._src.random.threefry2x32", f"threefry_{op}") for op in ("seed", "split", "fold_in", "random_bits")),
    *(("jax._src.random.rbg", f"_rbg_{op}") for op in ("seed", "split", "fold_in", "random_bits")),
    *(("jax._src.random.rbg", f"_unsafe_rbg_{op}") for op in ("split", "fold_in")),
    ("jaxlib._hlo", "OpSharding"),
    ("jaxlib._jax", "DeviceList"),
    ("numpy", "dtype"),
    ("numpy", "ndarray"),
    *((m, f) for m in _NUMPY_CORE for f in ("_reconstruct", "scalar")),
    *(("ml_dtypes", t) for t in _ML_DTYPES),
})


class _Inert:
    """What every global resolves to in `pickle_globals`' dry run: takes any arguments, state or items,
    does nothing."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Inert()

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):
        pass

    def append(self, value):
        pass

    def extend(self, values):
        pass

    def add(self, value):
        pass


class _DryRun(pickle.Unpickler):
    """Unpickles with every global (`GLOBAL`, `STACK_GLOBAL`, `INST`, extension codes: all go through
    `find_class`) resolved to `_Inert` and every persistent id to None, noting the names: the file's
    structure is walked and nothing it names is imported or called."""

    def __init__(self, data: bytes):
        super().__init__(io.BytesIO(data))
        self.names = []

    def find_class(self, module, name):
        self.names.append((module, name))
        return _Inert

    def persistent_load(self, pid):
        return None


def pickle_globals(data: bytes) -> list:
    """Every `(module, name)` the pickle `data` asks for, in order, found by a dry run (`_DryRun`) before
    any of it is unpickled for real (Python's own unpickler in C: fast where a walk over the opcodes in
    Python takes 100 times as long). Raises `Refused` for what does not unpickle that way."""
    dry = _DryRun(data)
    try:
        dry.load()
    except Exception as err:
        raise Refused(f"its executable is not a pickle this loader reads ({type(err).__name__})") from None
    return dry.names


def _resolve_allowed(module: str, name: str):
    if (module, name) not in EXECUTABLE_GLOBALS:
        raise Refused(f"names `{module}.{name}`, which a stored program never loads")
    obj = importlib.import_module(module)  # one of JAX's or numpy's own modules, listed above
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def check_executable(payload: bytes) -> None:
    """Raise `Refused` unless every global the executable's pickle names is one JAX's serializer writes."""
    for module, name in pickle_globals(payload):
        if (module, name) not in EXECUTABLE_GLOBALS:
            raise Refused(f"names `{module}.{name}`, which a stored program never loads")


def find_executable_class(module: str, name: str):
    """The unpickler's `find_class` for an executable: the listed globals only (checked again)."""
    return _resolve_allowed(module, name)


# ---------------------------------------------------------------- tree definitions as records
_BUILTIN_NODES = {"tuple": tuple, "list": list, "dict": dict, "None": type(None),
                  "OrderedDict": collections.OrderedDict, "defaultdict": collections.defaultdict}
_BUILTIN_NAMES = {v: k for k, v in _BUILTIN_NODES.items()}
# Types aux data may name (a defaultdict's factory): called later by the tree's user, so never a type a
# file could choose beyond these and the pytree node types.
_AUX_TYPES = {"list": list, "dict": dict, "int": int, "float": float, "str": str, "tuple": tuple, "set": set}


class Unrecordable(Exception):
    """A tree definition whose node types or aux data have no record (the program is not stored)."""


def _type_name(cls) -> str:
    if cls in _BUILTIN_NAMES:
        return _BUILTIN_NAMES[cls]
    module, qual = getattr(cls, "__module__", None), getattr(cls, "__qualname__", "")
    if not isinstance(module, str) or "<" in qual:
        raise Unrecordable(f"its tree has a node type with no importable name ({cls!r})")
    if _lookup(module, qual) is not cls:
        raise Unrecordable(f"its tree's node type {module}.{qual} is not found by that name")
    return f"{module}:{qual}"


def _lookup(module: str, qual: str):
    """`module.qual` among what the live process has already imported (never importing, never calling:
    plain mapping lookups, no attribute hooks); None when absent."""
    if module == "__main__":
        ns = _closure.live_module_namespace(module)
    else:
        ns = getattr(sys.modules.get(module), "__dict__", None)
    obj = None
    for part in qual.split("."):
        if not isinstance(ns, Mapping):
            return None
        obj = ns.get(part)
        ns = vars(obj) if isinstance(obj, type) else None
    return obj


def _node_type(ref: str):
    if ref in _BUILTIN_NODES:
        return _BUILTIN_NODES[ref]
    module, _, qual = ref.partition(":")
    cls = _lookup(module, qual) if qual else None
    if not isinstance(cls, type) or not is_pytree_node_type(cls):
        raise Refused(f"names the tree node type `{ref.replace(':', '.')}`, which is not a pytree node type of "
                      f"this process")
    return cls


def _aux_record(value):
    if value is None or isinstance(value, (bool, str)) or type(value) in (int, float):
        return value
    if type(value) is tuple:
        return {"t": [_aux_record(v) for v in value]}
    if type(value) is list:
        return {"l": [_aux_record(v) for v in value]}
    if type(value) is dict:
        return {"d": [[_aux_record(k), _aux_record(v)] for k, v in value.items()]}
    if isinstance(value, type):
        if value in _AUX_TYPES.values():
            return {"b": value.__name__}
        return {"n": _type_name(value)}
    named = _constant_name(value)
    if named is not None:
        return {"o": named}
    raise Unrecordable(f"its tree carries a {type(value).__name__} in a node's aux data")


def _constant_name(value) -> str | None:
    """`module:name` of a constant its type's module defines (a sentinel such as Equinox's `MISSING`, an
    enum member): found by identity, and only an object nothing can call."""
    if callable(value):
        return None
    module = getattr(type(value), "__module__", None)
    ns = getattr(sys.modules.get(module), "__dict__", None) if isinstance(module, str) else None
    if not isinstance(ns, Mapping):
        return None
    for name, obj in list(ns.items()):
        if obj is value:
            return f"{module}:{name}"
    if isinstance(getattr(value, "name", None), str):  # an enum member: its class's attribute
        qual = f"{type(value).__qualname__}.{value.name}"
        if _lookup(module, qual) is value:
            return f"{module}:{qual}"
    return None


def _constant(ref: str):
    module, _, qual = ref.partition(":")
    obj = _lookup(module, qual) if qual else None
    if obj is None or callable(obj) or isinstance(obj, type) or type(obj).__module__ != module:
        raise Refused(f"names `{ref.replace(':', '.')}` in a tree, which is not a constant of its module")
    return obj


def _aux_value(rec):
    if rec is None or isinstance(rec, (bool, str, int, float)):
        return rec
    if isinstance(rec, dict) and len(rec) == 1:
        (tag, v), = rec.items()
        if tag == "t" and isinstance(v, list):
            return tuple(_aux_value(x) for x in v)
        if tag == "l" and isinstance(v, list):
            return [_aux_value(x) for x in v]
        if tag == "d" and isinstance(v, list):
            return {_aux_value(k): _aux_value(x) for k, x in v}
        if tag == "b" and v in _AUX_TYPES:
            return _AUX_TYPES[v]
        if tag == "n" and isinstance(v, str):
            return _node_type(v)
        if tag == "o" and isinstance(v, str):
            return _constant(v)
    raise Refused("has a tree record this loader does not read")


def tree_records(treedef):
    """A tree definition as JSON records: None for a leaf, `[node type, aux, [children]]` for a node.
    Raises `Unrecordable` when a node type or its aux data has no record, or the records do not rebuild
    an equal tree."""
    def rec(td):
        data = td.node_data()
        if data is None:
            return None
        cls, aux = data
        return [_type_name(cls), _aux_record(aux), [rec(c) for c in td.children()]]

    out = rec(treedef)
    try:
        same = tree_from_records(out) == treedef
    except Refused as err:
        raise Unrecordable(str(err)) from None
    if not same:
        raise Unrecordable("its tree does not rebuild equal from records")
    return out


def tree_from_records(records):
    """The tree definition `tree_records` wrote, rebuilt over the live process's node types (`Refused`
    for a record naming anything else)."""
    import jax

    leaf = jax.tree.structure(0)
    registry = jax.tree_util.default_registry

    def build(r, depth=0):
        if r is None:
            return leaf
        if depth > 200 or not (isinstance(r, list) and len(r) == 3 and isinstance(r[0], str) and isinstance(r[2], list)):
            raise Refused("has a tree record this loader does not read")
        cls = _node_type(r[0])
        aux = _aux_value(r[1])
        children = [build(c, depth + 1) for c in r[2]]
        try:
            return jax.tree_util.PyTreeDef.from_node_data_and_children(registry, (cls, aux), children)
        except Exception as err:
            raise Refused(f"has a tree record that does not rebuild ({type(err).__name__})") from None

    return build(records)
