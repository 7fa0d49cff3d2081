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
    jupyter = {"nitro_ipy._extension", "nitro_ipy._magics", "nitro_ipy._widgets", "nitro_ipy._watch"}
    core = [m for m in edges if m not in jupyter and m != "nitro_ipy"]
    assert {m: sorted(edges[m] & jupyter) for m in core if edges[m] & jupyter} == {}
