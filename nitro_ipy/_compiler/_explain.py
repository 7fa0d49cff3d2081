"""Why a key missed: the most similar earlier entry, and what moved, old -> new.

One differ per key component (hooks, GraphConst fields, arguments, options, JAX's configuration), chained
as JAX's `diff_tracing_cache_keys` chains its own: each returns the lines it has to say, none when its
component did not move. An explanation is composed of the lines of every differ that spoke: the
hooks', GraphConst fields' and options' lines are its causes, the arguments' lines what moved with them
(`_report.Explanation`, whose summary counts those instead of listing them).
"""

from typing import Iterable

from .._base._report import Explanation
from .._closure import describe_edit
from . import _context
from ._cache import ArgsKey


def explain_miss(key, info: dict, candidates: Iterable) -> Explanation | None:
    """Why `key` missed, next to the most similar of `candidates` (entries, live or poisoned) of the same
    kind and owner: `"GraphConst `hidden`: 16 -> 8; argument `params['w1']` shape: [4, 16] -> [4, 8]"`,
    or "recompiling against edited code: ..." when only an edit separates them; None with no candidate.
    An `Explanation`: the text, with the causes apart from the argument changes that follow them."""
    similar = [e for e in candidates if e.key.kind == key.kind and e.key.owner == key.owner]
    if not similar:
        return None
    best = min(similar, key=lambda e: len(diff_keys(e.key, key, e.info, info)))
    causes = [line for differ in _CAUSES for line in differ(best.key, key, best.info, info)]
    follows = _diff_args(best.key, key, best.info, info)
    if best.poisoned and all(line.endswith(SAME_REPR) for line in causes + follows):
        # An edit moved it: with no other change, or through a GraphConst value that names the edited
        # code (an NNX GraphDef names the module's classes), whose repr does not show what moved.
        drifted = best.drifted
        if info.get("hook_label") == "function":  # a jitted function: where each edit was, and the path to it
            drifted = [describe_edit(best.closure, key.owner, name) for name in drifted]
        edited = "edited code: " + ", ".join(drifted)
        return Explanation(causes + [edited] if causes else ["recompiling against " + edited])
    return Explanation(causes, follows) if causes or follows else None


SAME_REPR = " (same repr)"  # a GraphConst value whose content moved, not its repr


def diff_keys(old, new, old_info: dict, new_info: dict) -> list[str]:
    """Every line each component's differ has to say about `old` -> `new`."""
    out = []
    for differ in _DIFFERS:
        out.extend(differ(old, new, old_info, new_info))
    return out


def _diff_hooks(old, new, _old_info, new_info) -> list[str]:
    a, b = dict(old.hooks), dict(new.hooks)
    label = new_info.get("hook_label", "hook")  # `nitro_ipy.jit`: "function"
    return [f"{label} `{name}` was redefined" for name in sorted(a.keys() | b.keys()) if a.get(name) != b.get(name)]


def _diff_graphconst(old, new, old_info, new_info) -> list[str]:
    if old.graphconst == new.graphconst:
        return []
    a, b = old_info.get("graphconst", {}), new_info.get("graphconst", {})
    label = new_info.get("graphconst_label", "GraphConst")  # `nitro_ipy.jit`: "static argument"
    moved = [n for n in sorted(a.keys() | b.keys()) if a.get(n, (None,))[0] != b.get(n, (None,))[0]]
    if not moved:
        return [f"{label} fields moved" if label == "GraphConst" else f"{label}s moved"]
    out = []
    for n in moved:
        was, now = a.get(n, (None, "?"))[1], b.get(n, (None, "?"))[1]
        if was != now:
            out.append(f"{label} `{n}`: {was} -> {now}")
        elif "<function " in was:  # the same name, new code (`_live.live_value` re-binds it)
            out.append(f"{label} `{n}`: {was}, its function redefined")
        else:
            out.append(f"{label} `{n}` moved{SAME_REPR}")
    return out


_LEAF_FIELDS = (("shape", "shape"), ("dtype", "dtype"), ("weak", "weak_type"), ("sharding", "sharding"))


def diff_args(old, new) -> list[str]:
    """The `args` component (`_cache.ArgsKey`): the structure if it moved, else each leaf's shape, dtype,
    weak type and sharding that moved."""
    old, new = ArgsKey(*old), ArgsKey(*new)
    if old.tree != new.tree:
        return [f"argument structure: {_short(old.tree)} -> {_short(new.tree)}"]
    out = []
    for a, b in zip(old.sigs, new.sigs):
        for field, label in _LEAF_FIELDS:
            x, y = getattr(a, field), getattr(b, field)
            if x != y:
                if field == "shape":
                    x, y = list(x), list(y)
                out.append(f"argument `{b.path}` {label}: {x} -> {y}")
    return out


def _diff_args(old, new, _old_info, _new_info) -> list[str]:
    return [] if old.args == new.args else diff_args(old.args, new.args)


def _diff_options(old, new, _old_info, _new_info) -> list[str]:
    a, b = dict(old.options), dict(new.options)
    return [f"option `{n}`: {a.get(n)!r} -> {b.get(n)!r}" for n in sorted(a.keys() | b.keys()) if a.get(n) != b.get(n)]


def _diff_context(old, new, _old_info, _new_info) -> list[str]:
    """`config `jax_enable_x64`: False -> True`: a setting of JAX's trace context moved (`_context.py`)."""
    return _context.diff(old.context, new.context)


_DIFFERS = (_diff_hooks, _diff_graphconst, _diff_args, _diff_options, _diff_context)
# What moved; `_diff_args`: what moved with it (x64 on moves the dtypes of arguments made after it too).
_CAUSES = (_diff_hooks, _diff_graphconst, _diff_options, _diff_context)


def _short(s: str, n: int = 80) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."
