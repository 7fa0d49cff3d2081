"""Flat parameter layout: one 1-D buffer per dtype, so the optimizer updates a few large buffers.

`ravel` (concatenation) is cheap to compile and goes wherever it is needed; `unravel` (one slice per
array, 5-150 ms of XLA compile each) only ever runs inside the optimizer program, which an edit to the model
or loss never recompiles. The gradient program stays as lean as the user's own.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np


class FlatLayout:
    """How a params pytree maps onto per-dtype flat buffers `{dtype name: 1-D array}`."""

    def __init__(self, params):
        leaves, self.treedef = jax.tree_util.tree_flatten(params)
        self.shapes = [tuple(np.shape(x)) for x in leaves]
        self.dtypes = [np.dtype(x.dtype) for x in leaves]
        self.groups: dict[str, list[int]] = {}
        for i, dt in enumerate(self.dtypes):
            self.groups.setdefault(dt.name, []).append(i)
        self.groups = dict(sorted(self.groups.items()))
        self.offsets = {}
        for name, idx in self.groups.items():
            offset = 0
            for i in idx:
                size = math.prod(self.shapes[i])
                self.offsets[i] = (offset, size)
                offset += size

    @property
    def signature(self) -> tuple:
        """What the layout contributes to a program key (also implied by the argument avals)."""
        return ("flat", tuple(self.groups))

    def ravel(self, tree) -> dict:
        leaves = self.treedef.flatten_up_to(tree)
        return {
            name: jnp.concatenate([jnp.ravel(leaves[i]) for i in idx]) if len(idx) > 1 else jnp.ravel(leaves[idx[0]])
            for name, idx in self.groups.items()
        }

    def abstract(self, tree=None) -> dict:
        """What `ravel` returns, as shapes and dtypes, worked out without tracing it."""
        return {name: jax.ShapeDtypeStruct((sum(self.offsets[i][1] for i in idx),), np.dtype(name))
                for name, idx in self.groups.items()}

    def unravel(self, flat: dict):
        leaves = [None] * len(self.shapes)
        for name, idx in self.groups.items():
            buf = flat[name]
            for i in idx:
                offset, size = self.offsets[i]
                leaves[i] = jax.lax.slice(buf, (offset,), (offset + size,)).reshape(self.shapes[i])
        return self.treedef.unflatten(leaves)


class TreeLayout:
    """The identity layout (`Nitro(..., flat_params=False)`): for optimizers whose maths is per array
    (LAMB, LARS, factored Adafactor, masks by parameter path), which a flat buffer would change."""

    def __init__(self, params):
        self.treedef = jax.tree_util.tree_structure(params)

    @property
    def signature(self) -> tuple:
        return ("tree",)

    def ravel(self, tree):
        return tree

    def abstract(self, tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)

    def unravel(self, tree):
        return tree
