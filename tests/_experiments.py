"""The tiny experiment most in-process tests train, and its data: one copy, imported by the tests that
train it as it is (`Reg`) or with a field or hook of their own (a subclass).

A 4-feature regression with one GraphConst and one Device field; `data(n)` is n rows of it. Tests that
need other sizes or hyperparameters (their counts and numbers depend on them) keep their own."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from nitro_ipy import Device, GraphConst


def data(n, seed=0):
    """`{"x": (n, 4) float32, "y": (n,) float32}`: y = sin of the row sum."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    return {"x": x, "y": np.sin(x.sum(1)).astype(np.float32)}


@dataclasses.dataclass
class Reg:
    hidden: GraphConst[int] = 8
    lr: Device[float] = 1e-2

    def init(self, rng):
        k1, k2 = jax.random.split(rng)
        return {"w1": jax.random.normal(k1, (4, self.hidden)) * 0.5, "w2": jax.random.normal(k2, (self.hidden,)) * 0.5}

    def forward(self, params, *, x):
        return jnp.tanh(x @ params["w1"]) @ params["w2"]

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)

    def optimizer(self):
        return optax.adam(self.lr)
