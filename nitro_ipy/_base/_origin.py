"""Whose code is this, and where does it live: the one place nitro_ipy decides what is user code.

Fingerprinting (a user class by its code, a library class by its name), dependency recording (which
functions a trace ran, and which of their files the watcher watches: not the cells) and live-class
binding all ask here. The rule is positive about library code, and everything else is the user's:

- **library code**: files in the standard library and installed packages (the `sysconfig` library
  directories of `sys.prefix` and `sys.base_prefix`, every `site-packages` / `dist-packages` on the
  path, the user site), nitro_ipy itself, whatever `register_exclusion` adds; the interpreter's frozen
  modules (`<frozen ...>`) and the pseudo-files of code generators (`_LIBRARY_PSEUDO_FILES`); and code a
  library generates with `exec` into a user module (`is_generated`: dataclass methods, namedtuple
  constructors), judged by its library;
- **user code**: everything else. Notebook cells of every front end (`<ipython-input-N-...>` in a
  terminal shell, `/tmp/ipykernel_PID/HASH.py` in a kernel, VS Code's cell names), `%%time`'s
  `<timed exec>`, `%%timeit`'s `<magic-timeit>`, `%run` scripts, the plain REPL (`<stdin>`), `python -c`
  and the user's own `exec` strings (`<string>`), and the user's module files.

A change of rule is a change to `_exclusions`, `_LIBRARY_PSEUDO_FILES` or `_GENERATED`.
"""

from __future__ import annotations

import contextlib
import os
import site
import sys
import sysconfig
import types
import weakref

from ._memo import Memo, register

__all__ = [
    "class_namespace",
    "is_cell_file",
    "is_generated",
    "is_user_file",
    "is_user_function",
    "is_user_module",
    "live_namespace",
    "register_exclusion",
    "user_namespaces",
]

def _library_dirs() -> set[str]:
    """The standard library's and the installed packages' directories (not a whole prefix: a project
    checked out inside a virtual environment's directory is still the user's)."""
    dirs = set()
    for base in {sys.prefix, sys.base_prefix, sys.exec_prefix}:
        paths = sysconfig.get_paths(vars={"base": base, "platbase": base, "installed_base": base,
                                          "installed_platbase": base})
        dirs.update(paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k))
    try:
        dirs.update(site.getsitepackages())
        dirs.add(site.getusersitepackages())
    except AttributeError:  # an embedded interpreter's stripped `site`
        pass
    dirs.update(p for p in sys.path if p.rstrip(os.sep).endswith(("site-packages", "dist-packages")))
    return {os.path.join(os.path.abspath(d), "") for d in dirs if d}


# The package's root folder (this file is `nitro_ipy/_base/_origin.py`): every subpackage is below it.
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Path prefixes of library code. nitro_ipy's own directory is one: its code is library code everywhere
# (in a checkout as much as in site-packages).
_exclusions: list[str] = sorted(_library_dirs() | {PACKAGE_DIR + os.sep})
_prefixes: tuple[str, ...] = tuple(_exclusions)

# Pseudo-files (`<...>`) that hold library code: the interpreter's frozen modules and code generators'
# files. Every other pseudo-file holds the user's code: cells, `%%time`, `%%timeit`, `exec`, the REPL.
_LIBRARY_PSEUDO_FILES = ("<frozen ", "<attrs generated", "<decorator-gen-", "<__array_function__", "<makefun-gen")

# Code a library `exec`s into a user's module, found by its name: dataclasses compiles each generated
# method inside a `__create_fn__` (3.11 to 3.13), namedtuple its `__new__` in a namespace named
# `namedtuple_<typename>`.
_GENERATED = ("__create_fn__.",)
_GENERATED_NAMESPACES = ("namedtuple_",)

# filename -> is user code. Read on every function start while a probe records, hence a plain `dict.get`
# (`verdicts.get`) before the full rule (`is_user_file`).
verdicts = Memo("file origins", maxsize=65536)


def register_exclusion(path_prefix: str) -> None:
    """Count every file under `path_prefix` as library code (as JAX's `source_info_util` does)."""
    global _prefixes
    _exclusions.append(path_prefix)
    _prefixes = tuple(_exclusions)
    verdicts.clear()


def _classify(filename: str | None) -> bool:
    if not filename:
        return False
    if filename.startswith("<"):
        verdict = not filename.startswith(_LIBRARY_PSEUDO_FILES)
    else:
        verdict = not filename.startswith(_prefixes) and not os.path.abspath(filename).startswith(_prefixes)
    verdicts[filename] = verdict
    return verdict


def is_user_file(filename: str | None) -> bool:
    """True for code the user wrote: notebook cells and the user's own files."""
    verdict = verdicts.get(filename)
    return _classify(filename) if verdict is None else verdict


def is_user_module(name: str) -> bool:
    """True for `__main__` (the notebook) and for modules loaded from a user file."""
    if name == "__main__":
        return True
    filename = getattr(sys.modules.get(name), "__file__", None)
    return bool(filename) and is_user_file(filename)


def is_generated(code: types.CodeType, ns: dict | None) -> bool:
    """True for code a library generated with `exec` (a dataclass's `__init__`, a namedtuple's `__new__`):
    its file is a pseudo-file that user code shares, so it is told apart by its name."""
    if not code.co_filename.startswith("<"):
        return False
    if code.co_qualname.startswith(_GENERATED):
        return True
    return ns is not None and str(ns.get("__name__", "")).startswith(_GENERATED_NAMESPACES)


def is_user_function(fn) -> bool:
    """True for a plain function of user code (not one a library generated into a user module)."""
    return (
        isinstance(fn, types.FunctionType)
        and is_user_file(fn.__code__.co_filename)
        and not is_generated(fn.__code__, fn.__globals__)
    )


def is_cell_file(filename: str) -> bool:
    """Notebook cells, which have no file to digest or watch: `<ipython-input-N-...>` (terminal) or
    `/tmp/ipykernel_PID/HASH.py` (kernel); every pseudo-file is treated alike."""
    return filename.startswith("<") or f"{os.sep}ipykernel_" in filename


def live_namespace(module: str, recorded: dict | None = None) -> dict | None:
    """The namespace `module` names now.

    **Arguments:**
    - `module`: a module name, `__main__` for the notebook.
    - `recorded`: the namespace the code ran in, if known.

    **Returns:** `sys.modules[module].__dict__`, else `recorded`. For `__main__`, `recorded` wins: an
    IPython shell's user namespace may not be `sys.modules["__main__"]` (a test runner or an embedding
    host owns that), and the code ran in the user namespace.
    """
    mod = sys.modules.get(module)
    d = getattr(mod, "__dict__", None) if mod is not None else None
    if d is None or (d is not recorded and module == "__main__" and recorded is not None):
        return recorded
    return d


def user_namespaces() -> list[tuple[str, dict]]:
    """`(module name, globals)` of each user namespace; the notebook's (`__main__`) first: the IPython user
    namespace when a shell runs, else `sys.modules["__main__"]`."""
    out = []
    shell = sys.modules.get("IPython")
    get_ipython = getattr(shell, "get_ipython", None)
    ip = get_ipython() if get_ipython is not None else None
    if ip is not None:
        out.append(("__main__", ip.user_ns))
    for name, module in list(sys.modules.items()):
        ns = getattr(module, "__dict__", None)
        if isinstance(ns, dict) and is_user_module(name):
            out.append((name, ns))
    if not out or out[0][0] != "__main__":
        out.insert(0, ("__main__", getattr(sys.modules.get("__main__"), "__dict__", {})))
    return out


def _methods(cls: type):
    """The plain functions `cls` defines: methods, static and class methods, property accessors, and the
    functions `functools.wraps`-style decorators (and `jax.jit`) wrap."""
    for attr in vars(cls).values():
        if isinstance(attr, (staticmethod, classmethod)):
            attr = attr.__func__
        accessors = (attr.fget, attr.fset, attr.fdel) if isinstance(attr, property) else (attr,)
        for fn in accessors:
            for _ in range(64):  # a wrapper chain, bounded (a `__wrapped__` cycle is a user's bug)
                if fn is None or isinstance(fn, type):
                    break
                if isinstance(fn, types.FunctionType):
                    yield fn
                try:
                    fn = getattr(fn, "__wrapped__", None)
                except Exception:  # a user object whose attribute raises: no function behind it
                    break


# class -> the globals one of its own methods names (a method's `__globals__` never changes, and a
# class keeps the methods it was defined with unless deleted): `live_class` asks after every cell.
_class_globals: "weakref.WeakKeyDictionary[type, dict]" = weakref.WeakKeyDictionary()
register(_class_globals.clear)  # `cache_reset()` lets go of the namespaces it holds


def class_namespace(cls: type) -> dict | None:
    """The globals of the module `cls` was defined in.

    Its own methods know them, even in an IPython shell whose user namespace is not
    `sys.modules["__main__"]`; a class without methods falls back to `sys.modules[cls.__module__]`.
    """
    try:
        ns = _class_globals.get(cls)
    except TypeError:  # a class that takes no weak reference
        ns = None
    if ns is not None:
        return ns
    prefix = cls.__qualname__ + "."
    for fn in _methods(cls):
        if fn.__code__.co_qualname.startswith(prefix):
            with contextlib.suppress(TypeError):
                _class_globals[cls] = fn.__globals__
            return fn.__globals__
    return getattr(sys.modules.get(cls.__module__), "__dict__", None)
