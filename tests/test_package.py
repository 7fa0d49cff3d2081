"""The package's shape: one public surface, private modules that depend on each other without cycles
and never reach into each other's private names (read statically from the source, lazy imports too)."""

import ast
import pathlib

import nitro_ipy

ROOT = pathlib.Path(nitro_ipy.__file__).parent


def _modules() -> dict:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict):
    """`(imported module, private names taken from it)` for every relative import of `name`."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{target}.{alias.name}"
                if full in modules:
                    aliases[alias.asname or alias.name] = full
                    yield full, None
                else:
                    private = alias.name.startswith("_") and not alias.name.startswith("__")
                    yield target, alias.name if private else None
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                yield aliases[node.value.id], node.attr


def _graph():
    modules = _modules()
    edges, private = {}, []
    for name, path in modules.items():
        edges[name] = set()
        for target, taken in _imports(name, path, modules):
            if target != name:
                edges[name].add(target)
            # A package's own __init__ re-exporting its private modules' names is its job.
            if taken is not None and not (path.name == "__init__.py" and target.startswith(name)):
                private.append(f"{name} uses {target}.{taken}")
    return edges, private


def test_no_module_uses_a_private_name_of_another():
    _, private = _graph()
    assert private == []


def test_there_is_no_import_cycle():
    edges, _ = _graph()
    cycles, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    # The package root imports every module it re-exports; a module importing the root back is a cycle.
    assert cycles == []


def test_the_core_never_imports_the_jupyter_side():
    edges, _ = _graph()
    jupyter = {m for m in edges if m.startswith("nitro_ipy._notebook.")}
    assert {"nitro_ipy._notebook._extension", "nitro_ipy._notebook._widgets", "nitro_ipy._notebook._panel"} <= jupyter
    core = [m for m in edges if m not in jupyter and m != "nitro_ipy"]
    assert {m: sorted(edges[m] & jupyter) for m in core if edges[m] & jupyter} == {}


# Each package and the packages it may import (its `__init__.py` says the same in words). The root
# (`nitro_ipy/__init__.py`) is the public surface and may import any of them.
LAYERS = {
    "_base": set(),
    "_closure": {"_base"},
    "_experiment": {"_base", "_closure"},
    "_compiler": {"_base", "_closure"},
    "loggers": {"_base", "_experiment"},  # public: `nitro_ipy.loggers.TensorBoard(...)`
    "_training": {"_base", "_closure", "_experiment", "_compiler", "loggers"},
    "_adopt": {"_base", "_closure", "_compiler"},
    "_notebook": {"_base", "_closure", "_experiment", "_compiler", "_training", "_adopt", "loggers"},
}


def _package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_module_lives_in_a_package_of_the_plan():
    loose = [m for m in _modules() if m != "nitro_ipy" and _package_of(m) not in LAYERS]
    assert loose == []


def test_imports_run_from_a_higher_package_to_a_lower_one_only():
    edges, _ = _graph()
    upward = sorted(
        f"{m} imports {t}"
        for m, targets in edges.items() if _package_of(m) is not None
        for t in targets
        if _package_of(t) not in (None, _package_of(m)) and _package_of(t) not in LAYERS[_package_of(m)]
    )
    assert upward == []
    # and no package reaches up to the root (the public surface) either
    assert sorted(f"{m} imports nitro_ipy" for m, t in edges.items() if _package_of(m) and "nitro_ipy" in t) == []


def test_the_layering_check_sees_an_upward_import(tmp_path, monkeypatch):
    # The check above must be able to fail: a `_base` module importing the handle is caught.
    fake = dict(_modules())
    bad = tmp_path / "_bad.py"
    bad.write_text("from .._training._handle import Nitro\n")
    fake["nitro_ipy._base._bad"] = bad
    taken = list(_imports("nitro_ipy._base._bad", bad, fake))
    assert ("nitro_ipy._training._handle", None) in taken
    assert "_training" not in LAYERS["_base"]


def test_the_package_folder_covers_every_subpackage():
    # `_origin` counts nitro_ipy's files as library code by the package's root folder, and the program
    # store fingerprints the package by it: both must reach the files two folders down.
    from nitro_ipy._base import _origin
    from nitro_ipy._compiler import _store

    assert _origin.PACKAGE_DIR == str(ROOT)
    for path in ROOT.rglob("*.py"):
        assert not _origin.is_user_file(str(path)), path
    before = _store._package_fingerprint()
    probe = ROOT / "_training" / "_fingerprint_probe.py"
    probe.write_text("# a file the store's fingerprint of the package must see\n")
    try:
        assert _store._package_fingerprint() != before
    finally:
        probe.unlink()
    assert _store._package_fingerprint() == before


def _handle_private_names() -> set:
    """The private attributes `Nitro` sets on itself (`self._x = ...` anywhere in its class)."""
    tree = ast.parse((ROOT / "_training" / "_handle.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Nitro"]
    names = set()
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self" \
                    and t.attr.startswith("_") and not t.attr.startswith("__"):
                names.add(t.attr)
    return names


def _private_reads(path: pathlib.Path, names: set) -> list:
    """`x._name` in `path` for a handle's private `_name`, on anything but `self`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in names:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                out.append(f"{path.name}:{node.lineno} .{node.attr}")
    return out


def test_no_module_outside_the_handle_s_package_reads_a_handle_s_private_attribute():
    names = _handle_private_names()
    assert {"_params", "_opt_state", "_binding"} <= names  # the check reads the real class
    reads = [r for path in sorted(ROOT.rglob("*.py")) if "_training" not in path.parts
             for r in _private_reads(path, names)]
    assert reads == []


def test_the_private_attribute_check_sees_a_read(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f(n, self):\n    self._params = 1\n    return n._params, n.params\n")
    assert _private_reads(probe, {"_params"}) == ["probe.py:3 ._params"]


def test_no_module_is_longer_than_700_lines():
    # The house's bound: a concern that outgrows one file becomes two files along its seams (docs: STYLE).
    long = {str(p.relative_to(ROOT)): n for p in sorted(ROOT.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 700}
    assert long == {}


def test_the_ci_once_lists_name_test_files_once():
    # A misspelt name would quietly run a file on every Python, or skip none of what it means to.
    from conftest import ONCE_PER_CI, ONCE_PER_JAX

    files = {p.name for p in pathlib.Path(__file__).parent.glob("test_*.py")}
    listed = list(ONCE_PER_CI) + list(ONCE_PER_JAX)
    assert sorted(set(listed) - files) == [] and len(set(listed)) == len(listed)
