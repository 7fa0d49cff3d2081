"""Parameter groups: the masks and labels of an optax transformation, found by walking it, evaluated on
the params tree, and re-expressed on the flat layout's grouped tree.

Found where optax keeps them: the closure cells `mask` (`optax.masked`, a weight-decay `mask=`,
`transforms.freeze`) and `param_labels` (`multi_transform` / `partition`) of optax's functions, and the same
names among the arguments `inject_hyperparams` holds. The walk goes through functions, closure cells,
tuples (named or not), lists, dicts, partials, bound methods and optax objects (`MultiSteps`), and
rebuilds what it changes: a transformation the user keeps is never mutated.
"""

import copy
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np

from .._base._errors import NitroValueError

# Closure cells of optax's path-aware transformations (`optax.masked`, `add_decayed_weights(mask=)`,
# `adamw(mask=)`, `multi_transform` / `partition(param_labels=)`), and the same names among the arguments
# `inject_hyperparams` holds: the masks and labels that define the flat layout's parameter groups.
_PATH_CELLS = ("mask", "param_labels")

MASK_FAILS = (
    "the optimizer of `{owner}` has a `{cell}` that could not be evaluated on the params tree ({error}). "
    "optax evaluates it on the params (and updates) under `jax.jit`, so it must decide from each "
    "parameter's path, shape or dtype, never its values, and return a tree with the params' structure "
    "(or a prefix of it), e.g. `mask=lambda p: jax.tree_util.tree_map_with_path(lambda path, x: x.ndim > 1, p)`."
)

MASK_VALUES = (
    "the optimizer of `{owner}` has a `{cell}` that depends on the parameters' values (it returned a "
    "traced array at `{where}`); optax needs masks and labels static. Decide from each parameter's path, "
    "shape or dtype, e.g. `mask=lambda p: jax.tree_util.tree_map_with_path(lambda path, x: x.ndim > 1, p)`."
)

GROUPS_MOVED = (
    "the optimizer of `{owner}` now puts the parameters in other groups than at setup (its `{cell}` "
    "gives another value at `{where}`), and the flat layout's buffers were laid out by the old groups. "
    "Rebuild the handle (`n = n.rebuild()`) so the layout follows the optimizer."
)


def _is_optax(fn) -> bool:
    return (getattr(fn, "__module__", None) or "").split(".")[0] == "optax"


class _Walk:
    """A walk over a transformation's functions, closure cells, tuples (named or not), lists, dicts and
    partials, in one fixed order. Each mask or label it meets (an optax function's closure cell, or an
    argument `inject_hyperparams` holds, named in `_PATH_CELLS`) is appended to `found` as `(name,
    value)`; with `values`, the object graph is rebuilt (nothing is mutated: a transformation the user
    keeps is left as it is) with the k-th one holding `values[k]` instead."""

    def __init__(self, values: list | None = None):
        self.values, self.found, self.memo, self.cells = values, [], {}, {}

    def _target(self, name, value):
        k = len(self.found)
        self.found.append((name, value))
        return value if self.values is None or k >= len(self.values) else self.values[k]

    def go(self, obj, held: bool = False):
        key = id(obj)
        if key in self.memo:
            return self.memo[key]
        if isinstance(obj, types.FunctionType):
            self.memo[key] = obj  # a cycle leads back here: left as it is
            new = self._function(obj)
        elif isinstance(obj, functools.partial):
            self.memo[key] = obj
            func, args = self.go(obj.func), [self.go(a) for a in obj.args]
            kw = {k: self.go(v) for k, v in obj.keywords.items()}
            same = func is obj.func and _same(args, obj.args) and _same(kw.values(), obj.keywords.values())
            new = obj if same else functools.partial(func, *args, **kw)
        elif isinstance(obj, types.MethodType):  # a method of an optax object (`MultiSteps.update`)
            self.memo[key] = obj
            owner = self.go(obj.__self__)
            new = obj if owner is obj.__self__ else types.MethodType(obj.__func__, owner)
        elif _is_optax(type(obj)) and hasattr(obj, "__dict__") and not isinstance(obj, tuple):
            self.memo[key] = obj  # an optax object holding its inner transformation (`MultiSteps`)
            attrs = {k: self.go(v) for k, v in vars(obj).items()}
            if _same(attrs.values(), vars(obj).values()):
                new = obj
            else:
                new = copy.copy(obj)
                for k, v in attrs.items():
                    object.__setattr__(new, k, v)
        elif isinstance(obj, (tuple, list)):
            items = [self.go(x) for x in obj]
            if _same(items, obj):
                new = obj
            elif isinstance(obj, list):
                new = items
            else:
                new = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        elif isinstance(obj, dict):
            items = {k: (self._target(k, v) if held and k in _PATH_CELLS and v is not None else self.go(v))
                     for k, v in obj.items()}
            new = obj if _same(items.values(), obj.values()) else type(obj)(items) if type(obj) is dict else items
        else:
            return obj
        self.memo[key] = new
        return new

    def _function(self, fn):
        if not fn.__closure__:
            return fn
        optax_fn = _is_optax(fn)
        cells = []
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__):
            if id(cell) not in self.cells:
                try:
                    value = cell.cell_contents
                except ValueError:  # an empty cell
                    self.cells[id(cell)] = cell
                else:
                    if optax_fn and name in _PATH_CELLS and value is not None:
                        new = self._target(name, value)
                    else:
                        new = self.go(value, held=optax_fn)
                    self.cells[id(cell)] = cell if new is value else types.CellType(new)
            cells.append(self.cells[id(cell)])
        if _same(cells, fn.__closure__):
            return fn
        new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, tuple(cells))
        new.__kwdefaults__, new.__qualname__, new.__module__ = fn.__kwdefaults__, fn.__qualname__, fn.__module__
        new.__dict__.update(fn.__dict__)
        return new


def _same(a, b) -> bool:
    a, b = list(a), list(b)
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def path_cells(tx) -> list[str]:
    """The names of the masks and labels found anywhere in `tx`."""
    walk = _Walk()
    walk.go(tx)
    return list(dict.fromkeys(name for name, _ in walk.found))


def _hashable(v):
    if isinstance(v, (np.ndarray, np.generic)) or (isinstance(v, jax.Array) and not isinstance(v, jax.core.Tracer)):
        return np.asarray(v).item() if np.size(v) == 1 else v
    return v


def _per_leaf(owner, name, value, trainable, paths):
    """`value` (a mask or labels: a tree, a prefix of the params tree, or a callable returning one)
    as one value per leaf of `trainable`, evaluated as optax does: the callable on the params as traced."""
    treedef = jax.tree_util.tree_structure(trainable)
    got = {}

    def probe(tree):
        got["tree"] = value(tree) if callable(value) else value
        return jnp.zeros(())

    try:
        jax.eval_shape(probe, jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), trainable))
        expanded = jax.tree.map(lambda v, sub: jax.tree.map(lambda _: v, sub), got["tree"], trainable)
        out = treedef.flatten_up_to(expanded)
    except Exception as err:  # the user's callable or tree: whatever it raises is said with the fix
        first = (str(err).strip().splitlines() or [""])[0]
        raise NitroValueError(MASK_FAILS.format(owner=owner, cell=name,
                                                error=f"{type(err).__name__}: {first[:200]}")) from None
    for path, v in zip(paths, out):
        if isinstance(v, jax.core.Tracer):
            raise NitroValueError(MASK_VALUES.format(owner=owner, cell=name, where=path))
    return [_hashable(v) for v in out]


def leaf_groups(owner: str, tx, trainable, paths=None):
    """`(names, per-leaf values)`: the masks and labels of `tx` (`_PATH_CELLS`), each evaluated on the
    params tree `trainable`, as one tuple of values per leaf (flatten order); `(), None` when `tx` has
    none. `paths` names the leaves in messages."""
    walk = _Walk()
    walk.go(tx)
    if not walk.found:
        return (), None
    leaves = jax.tree_util.tree_leaves(trainable)
    paths = paths or [f"leaf {i}" for i in range(len(leaves))]
    columns = [_per_leaf(owner, name, value, trainable, paths) for name, value in walk.found]
    return tuple(name for name, _ in walk.found), [tuple(c[i] for c in columns) for i in range(len(leaves))]


def substituted(tx, trees: list):
    """`tx` rebuilt with its k-th mask or label replaced by `trees[k]` (trees of values, no callables)."""
    return _Walk(trees).go(tx)


def regrouped(tx, layout, trainable=None):
    """`tx` with its masks and labels re-expressed on `layout`'s grouped tree (`FlatLayout.adapt`).

    With `trainable` (the params as traced), the masks are evaluated again and must give every leaf the
    values the layout was built with: a layout is never used with groups it was not made for."""
    owner = "the experiment"
    walk = _Walk(layout.cell_trees())
    new = walk.go(tx)
    if len(walk.found) != len(layout.cells):
        raise NitroValueError(GROUPS_MOVED.format(owner=owner, cell=", ".join(layout.cells) or "masks",
                                                  where="the optimizer's structure"))
    if trainable is not None:
        names = [name for name, _ in walk.found]
        leaves = jax.tree_util.tree_leaves(trainable)
        paths = [f"leaf {i}" for i in range(len(leaves))]
        for k, (name, value) in enumerate(walk.found):
            column = _per_leaf(owner, name, value, trainable, paths)
            for i, v in enumerate(column):
                group = next(g for g, idx in layout.groups.items() if i in idx)
                if layout.values[group][k] != v:
                    raise NitroValueError(GROUPS_MOVED.format(owner=owner, cell=names[k], where=paths[i]))
    return new
