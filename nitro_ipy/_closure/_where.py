"""Where an edit was made and how a program reached it: `__main__.huber (In [7]; train_step → loss_fn → huber)`.

Read after the fact, from the live code: the cell that last bound the name (IPython's input history), or
the file and line of the function's code now; and a path of names from the jitted function down to the
edited one, through the code of the functions the closure recorded (each one's global and attribute
names, nested code included). A path a call through an object's method hides (`model(x)` reaching
`Model.__call__`) is left out rather than guessed.
"""

from __future__ import annotations

import os
import re
import sys
import types

from .._base import _origin

_CELL = re.compile(r"<ipython-input-(\d+)-")


def describe_edit(closure, root: str, name: str) -> str:
    """`name`, with where it was edited and the path from `root` (a qualified name) to it, when known."""
    try:
        where = _where(name)
        path = _path(closure, root, name) if closure is not None else None
    except Exception:  # noqa: BLE001 - a line of context, never a reason for the message to fail
        return name
    extra = "; ".join(p for p in (where, path) if p)
    return f"{name} ({extra})" if extra else name


def _namespace(module: str):
    if module == "__main__":
        return _origin.user_namespaces()[0][1]
    return getattr(sys.modules.get(module), "__dict__", None)


def _split(qualified: str, ns_of=_namespace):
    """`(module, namespace, qualname)` of a qualified name: the longest module prefix that is loaded."""
    parts = qualified.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:i])
        ns = ns_of(module)
        if ns is not None:
            return module, ns, parts[i:]
    return None, None, parts


def _resolve(qualified: str):
    module, ns, rest = _split(qualified)
    if ns is None:
        return module, None
    obj = ns.get(rest[0], None)
    for attr in rest[1:]:
        if attr == "<locals>" or obj is None:
            return module, None
        obj = getattr(obj, attr, None)
    return module, obj


def _code(obj):
    for _ in range(16):
        if isinstance(obj, types.FunctionType):
            return obj.__code__
        obj = getattr(obj, "func", None) or getattr(obj, "__wrapped__", None)
        if obj is None:
            return None
    return None


def _ipython():
    get = getattr(sys.modules.get("IPython"), "get_ipython", None)
    return get() if get is not None else None


def _cell_label(filename: str) -> str | None:
    ip = _ipython()
    number = getattr(getattr(ip, "compile", None), "_filename_map", {}).get(filename)
    if number is None:
        m = _CELL.match(filename)
        number = int(m.group(1)) if m else None
    return f"In [{number}]" if number is not None else None


def _where(name: str) -> str | None:
    module, obj = _resolve(name)
    short = name.rsplit(".", 1)[-1]
    if module == "__main__":
        ip = _ipython()
        cells = ip.user_ns.get("In") if ip is not None else None
        if isinstance(cells, list):
            binds = re.compile(rf"(^|\n)[ \t]*(def[ \t]+{short}\b|class[ \t]+{short}\b|{short}[ \t]*(\[[^\]\n]*\])?"
                               rf"[ \t]*[-+*/@]?=[^=])")
            for n in range(len(cells) - 1, 0, -1):
                if isinstance(cells[n], str) and binds.search(cells[n]):
                    return f"In [{n}]"
    code = _code(obj)
    if code is not None:
        label = _cell_label(code.co_filename) if _origin.is_cell_file(code.co_filename) else None
        return label or f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}"
    if module in (None, "__main__"):  # a notebook value no cell in the history binds: say nothing
        return None
    filename = getattr(sys.modules.get(module), "__file__", None)
    return os.path.basename(filename) if filename else None


def _names(code: types.CodeType) -> set[str]:
    out = set(code.co_names) | set(code.co_freevars)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out |= _names(const)
    return out


def _path(closure, root: str, name: str) -> str | None:
    """`f → act → inner`: the shortest chain of recorded functions from `root` whose code names the next,
    ending at `name`. Where a call through an object hides a link (`model(x)` reaching `Model.__call__`),
    the chain from the nearest function that names `name` follows an ellipsis: `f → … → Model.__call__ →
    act`. None when nothing names it (or `name` is `root` itself)."""
    if name == root:
        return None
    nodes = {}
    for dep in closure.functions:
        code = _code(_resolve(dep.qualified)[1])
        if code is not None:
            nodes[dep.qualified] = (dep.qualname.replace("<locals>.", ""), _names(code))
    if root not in nodes:
        return None
    target = name.rsplit(".", 1)[-1]
    chain = _chain(nodes, root, target)
    if chain is not None:
        return " → ".join([nodes[q][0] for q in chain] + [target])
    chains = [c for c in (_chain(nodes, q, target) for q in nodes if q != root) if c is not None]
    if not chains:
        return None
    return " → ".join([nodes[root][0], "…"] + [nodes[q][0] for q in min(chains, key=len)] + [target])


def _chain(nodes: dict, start: str, target: str) -> list | None:
    """The shortest list of recorded functions from `start` to one whose code names `target` (breadth
    first, each step to a function whose last name the previous one's code names)."""
    seen, frontier = {start: [start]}, [start]
    while frontier:
        nxt = []
        for q in frontier:
            if target in nodes[q][1]:
                return seen[q]
            for other, (label, _names_) in nodes.items():
                if other not in seen and label.rsplit(".", 1)[-1] in nodes[q][1]:
                    seen[other] = seen[q] + [other]
                    nxt.append(other)
        frontier = nxt
    return None
