"""Flat parameter layout: one 1-D buffer per parameter group and dtype, so the optimizer updates a few
large buffers.

The groups are what the optimizer's masks and labels define (`optax.masked`, a weight-decay `mask=`,
`multi_transform` labels: `_optimizer.leaf_groups` evaluates them once, at setup, on the params tree).
Without any, there is one group per dtype and the optimizer sees `{dtype name: buffer}`. With them, it sees
the *grouped tree*: the params tree's own containers holding each group's buffer at the place of the
group's first parameter (every other place empty), and its masks and labels re-expressed on that tree
(`FlatLayout.adapt`); a mask or label by path, shape or dtype then means on the buffers exactly what it
meant on the arrays.

`ravel` (concatenation) is cheap to compile and goes wherever it is needed; `unravel` (one slice per
array, 5-150 ms of XLA compile each) only ever runs inside the optimizer program, which an edit to the model
or loss never recompiles. The gradient program stays as lean as the user's own.
"""

import hashlib
import math

import jax
import jax.numpy as jnp
import numpy as np

from ._groups import regrouped


class FlatLayout:
    """How a params pytree maps onto flat buffers `{group name: 1-D array}`, one per (dtype, group).

    **Arguments:**
    - `params`: the trainable tree (None where a leaf is not trained).
    - `labels`: per leaf (in flatten order), the values of the optimizer's masks and labels there, as
      `_optimizer.leaf_groups` finds them; None (the default) when the optimizer has none.
    - `cells`: the names of those masks and labels (`mask`, `param_labels`), one per value.
    """

    def __init__(self, params, labels: list | None = None, cells: tuple = ()):
        leaves, self.treedef = jax.tree_util.tree_flatten(params)
        self.shapes = [tuple(np.shape(x)) for x in leaves]
        self.dtypes = [np.dtype(x.dtype) for x in leaves]
        self.cells = tuple(cells)
        self.grouped = labels is not None
        keys = [(dt.name, tuple(labels[i]) if self.grouped else ()) for i, dt in enumerate(self.dtypes)]
        self.values: dict[str, tuple] = {}  # group name -> its masks' and labels' values
        self.groups: dict[str, list[int]] = {}  # group name -> its leaves, in flatten order
        for i, (dtype, values) in enumerate(keys):
            name = dtype if not self.grouped else f"{dtype}:" + ",".join(map(_word, self.cells, values))
            self.groups.setdefault(name, []).append(i)
            self.values[name] = values
        self.groups = dict(sorted(self.groups.items()))
        self.offsets = {}
        for name, idx in self.groups.items():
            offset = 0
            for i in idx:
                size = math.prod(self.shapes[i])
                self.offsets[i] = (offset, size)
                offset += size
        if self.grouped:
            # The grouped tree: the params containers, each group's buffer at its first leaf's place.
            self.firsts = sorted((idx[0], name) for name, idx in self.groups.items())
            first = {i for i, _ in self.firsts}
            holder = self.treedef.unflatten([0 if i in first else None for i in range(len(leaves))])
            self.tx_treedef = jax.tree_util.tree_structure(holder)
            digest = hashlib.sha256(repr([keys, self.cells]).encode()).hexdigest()[:16]
            self._signature = ("flat", tuple(self.groups), digest)
        else:
            self._signature = ("flat", tuple(self.groups))

    @property
    def signature(self) -> tuple:
        """What the layout contributes to a program key: the groups, and (grouped) which leaf is in which."""
        return self._signature

    def sizes(self) -> dict:
        """`{group name: (arrays, values)}`: what `%nitro_stats` shows of the groups."""
        return {name: (len(idx), sum(self.offsets[i][1] for i in idx)) for name, idx in self.groups.items()}

    def ravel(self, tree) -> dict:
        leaves = self.treedef.flatten_up_to(tree)
        return {
            name: jnp.concatenate([jnp.ravel(leaves[i]) for i in idx]) if len(idx) > 1 else jnp.ravel(leaves[idx[0]])
            for name, idx in self.groups.items()
        }

    def abstract(self, tree=None) -> dict:
        """What `ravel` returns, as shapes and dtypes, worked out without tracing it."""
        return {name: jax.ShapeDtypeStruct((sum(self.offsets[i][1] for i in idx),), self.dtypes[idx[0]])
                for name, idx in self.groups.items()}

    def unravel(self, flat: dict):
        leaves = [None] * len(self.shapes)
        for name, idx in self.groups.items():
            buf = flat[name]
            for i in idx:
                offset, size = self.offsets[i]
                leaves[i] = jax.lax.slice(buf, (offset,), (offset + size,)).reshape(self.shapes[i])
        return self.treedef.unflatten(leaves)

    # ---------------------------------------------------------------- what the optimizer sees
    def for_tx(self, flat: dict):
        """The tree the optimizer is handed: `flat` itself, or (grouped) the grouped tree."""
        if not self.grouped:
            return flat
        return self.tx_treedef.unflatten([flat[name] for _, name in self.firsts])

    def from_tx(self, tree) -> dict:
        """`for_tx` undone: the optimizer's updates as `{group name: buffer}`."""
        if not self.grouped:
            return tree
        return {name: x for (_, name), x in zip(self.firsts, self.tx_treedef.flatten_up_to(tree))}

    def adapt(self, tx, trainable=None):
        """`tx` with its masks and labels re-expressed on the grouped tree (the same transformation when
        the layout has no groups). `trainable`, when given (the params the program traces), re-evaluates
        the masks to check they still mean what they meant at setup."""
        if not self.grouped:
            return tx
        return regrouped(tx, self, trainable)

    def cell_trees(self) -> list:
        """Per mask or label of the optimizer, its value over the grouped tree."""
        return [self.tx_treedef.unflatten([self.values[name][k] for _, name in self.firsts])
                for k in range(len(self.cells))]


def _word(cell: str, value) -> str:
    """A mask's or label's value in a group's name: `mask` / `~mask` for a mask, the label itself."""
    if isinstance(value, (bool, np.bool_)):
        return cell if value else f"~{cell}"
    return str(value)


class TreeLayout:
    """The identity layout (`Nitro(..., flat_params=False)`): for optimizers whose maths is per array
    (LAMB, LARS, factored Adafactor), which a flat buffer would change, and for sharded parameters."""

    grouped = False

    def __init__(self, params):
        self.treedef = jax.tree_util.tree_structure(params)

    @property
    def signature(self) -> tuple:
        return ("tree",)

    def sizes(self) -> dict:
        return {}

    def ravel(self, tree):
        return tree

    def abstract(self, tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)

    def unravel(self, tree):
        return tree

    def for_tx(self, tree):
        return tree

    def from_tx(self, tree):
        return tree

    def adapt(self, tx, trainable=None):
        return tx
