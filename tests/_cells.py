"""Notebook cells shared by the shell and kernel tests: a tiny experiment whose loss calls a helper."""

import textwrap

TINY_EXPERIMENT = textwrap.dedent(
    '''
    import dataclasses
    import jax, jax.numpy as jnp, numpy as np, optax
    import nitro_ipy
    from nitro_ipy import Device, GraphConst, Nitro

    def helper(r):
        return r ** 2

    @dataclasses.dataclass
    class Tiny:
        hidden: GraphConst[int] = 4
        lr: Device[float] = 1e-2

        def init(self, rng):
            return {"w": jax.random.normal(rng, (3, self.hidden)) * 0.1, "v": jnp.zeros(self.hidden)}

        def forward(self, params, *, x):
            return jnp.tanh(x @ params["w"]) @ params["v"]

        def loss(self, outputs, *, y):
            return jnp.mean(helper(outputs - y))

        def optimizer(self):
            return optax.sgd(self.lr)

    rs = np.random.RandomState(0)
    X = rs.normal(size=(64, 3)).astype(np.float32)
    Y = X.sum(1).astype(np.float32)
    data = {"train": {"x": X[:48], "y": Y[:48]}, "valid": {"x": X[48:], "y": Y[48:]}}
    '''
)
