"""Model state however `forward` uses it: Equinox `eqx.nn.State` vmapped with an `axis_name`, closed
over, called per layer, set at the top level and returned as a new object (BatchNorm, Dropout,
`inference_mode`); Flax NNX `BatchStat` and Linen `batch_stats` under `vmap`. Each trains, validates
deterministically, rebuilds and checkpoints."""

import dataclasses
import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nitro_ipy
from nitro_ipy import GraphConst, Nitro


def _reg(n=64, seed=0):
    r = np.random.default_rng(seed)
    x = r.normal(size=(n, 3)).astype(np.float32) * 2 + 1
    return {"x": x, "y": np.sin(x.sum(1)).astype(np.float32)}


class _BN(eqx.Module):
    lin: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    drop: eqx.nn.Dropout
    bn2: eqx.nn.BatchNorm
    out: eqx.nn.Linear
    seen: eqx.nn.StateIndex

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.lin = eqx.nn.Linear(3, 8, key=k1)
        self.bn = eqx.nn.BatchNorm(8, axis_name="batch", mode="batch")
        self.drop = eqx.nn.Dropout(0.2)
        self.bn2 = eqx.nn.BatchNorm(8, axis_name="batch", mode="batch")
        self.out = eqx.nn.Linear(8, "scalar", key=k2)
        self.seen = eqx.nn.StateIndex(jnp.zeros((), jnp.float32))  # batches seen: set outside any vmap

    def __call__(self, x, state, key):
        x, state = self.bn(self.lin(x), state)
        x = self.drop(jax.nn.relu(x), key=key)
        x, state = self.bn2(x, state)
        return self.out(x), state


def _keys(rng, n):
    return jax.random.split(rng, n)


def documented(model, x, state, rng):
    """Equinox's documented pattern: the model vmapped with `axis_name`, the state unmapped in and out."""
    return jax.vmap(model, axis_name="batch", in_axes=(0, None, 0), out_axes=(0, None))(x, state, _keys(rng, len(x)))


def closed_over(model, x, state, rng):
    """The state closed over by the vmapped function, not passed through the vmap: the layers `set` the
    very object `forward` was given."""
    return jax.vmap(lambda xi, k: model(xi, state, k), axis_name="batch", out_axes=(0, None))(x, _keys(rng, len(x)))


def per_layer(model, x, state, rng):
    """Each layer vmapped on its own (`filter_vmap` for the stateful ones), the state threaded by hand."""
    h = jax.vmap(model.lin)(x)
    h, state = eqx.filter_vmap(model.bn, in_axes=(0, None), out_axes=(0, None), axis_name="batch")(h, state)
    h = jax.vmap(lambda hi, k: model.drop(jax.nn.relu(hi), key=k))(h, _keys(rng, len(x)))
    h, state = jax.vmap(model.bn2, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(h, state)
    return jax.vmap(model.out)(h), state


PATTERNS = {"documented": documented, "closed over": closed_over, "per layer": per_layer}


@dataclasses.dataclass
class EqxBN:
    pattern: GraphConst[str] = "documented"

    def init(self, rng):
        return eqx.nn.make_with_state(_BN)(rng)

    def forward(self, params, *, x, state, rng, train):
        model = eqx.nn.inference_mode(params, value=not train)
        out, state = PATTERNS[self.pattern](model, x, state, rng)
        if train:  # a top-level `set`: the state returned is a new object, the one given is spent
            state = state.set(params.seen, state.get(params.seen) + 1)
        return out, state

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)

    def optimizer(self):
        return optax.adam(1e-2)


def _copy(tree):
    return jax.tree.map(lambda a: np.array(a) if isinstance(a, jax.Array) else a, tree)


def _check_lifecycle(make, data, tmp_path, state_leaves):
    """Train, validate twice (the same), predict twice (the same), rebuild (same programs, state carried),
    save and resume (the same state and validation)."""
    nitro_ipy.cache_reset()
    n = Nitro(make(), data=data, batch_size=16, max_epochs=2, progress=False)
    state0 = _copy(n.state)
    n.train()
    assert n.step == 8
    moved = [not np.allclose(a, b) for a, b in zip(state_leaves(n.state), state_leaves(state0))]
    assert moved and all(moved), moved  # every running statistic was updated by training
    first = n.validate()
    assert np.isfinite(first["loss"]) and n.validate() == first
    x = data["valid"]["x"]
    np.testing.assert_array_equal(n.predict({"x": x}), n.predict({"x": x}))
    misses = nitro_ipy.cache_stats().misses
    n2 = n.rebuild()
    jax.tree.map(np.testing.assert_array_equal, state_leaves(n2.state), state_leaves(n.state))
    assert n2.validate() == first
    n2.train(1)
    assert nitro_ipy.cache_stats().misses == misses  # the rebuild reuses every program
    m = Nitro(make(), data=data, batch_size=16, progress=False, resume=n2.save(tmp_path))
    assert m.step == 12
    jax.tree.map(np.testing.assert_array_equal, state_leaves(m.state), state_leaves(n2.state))
    assert m.validate() == n2.validate()
    return n2


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_equinox_state_any_pattern_trains_validates_rebuilds_and_checkpoints(pattern, tmp_path):
    data = {"train": _reg(), "valid": _reg(20, 1)}
    n = _check_lifecycle(lambda: EqxBN(pattern), data, tmp_path, jax.tree.leaves)
    assert isinstance(n.state, eqx.nn.State)
    assert float(n.state.get(n.params.seen)) == 12  # the top-level counter: one per training step


def test_the_patterns_compute_the_same_statistics():
    data = {"train": _reg()}
    runs = []
    for pattern in PATTERNS:
        n = Nitro(EqxBN(pattern), data=data, batch_size=16, max_epochs=1, progress=False)
        n.train()
        runs.append(jax.tree.leaves(eqx.filter((n.params, n.state), eqx.is_array)))
    for other in runs[1:]:
        assert len(other) == len(runs[0]) == 15  # every array of params and state
        for a, b in zip(runs[0], other):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- Flax NNX BatchStat under vmap
class _NNX(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, axis_name="batch", rngs=rngs)
        self.drop = nnx.Dropout(0.2)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x, rngs=None):
        return self.out(self.drop(nnx.relu(self.bn(self.lin(x))), rngs=rngs))[..., 0]


def _nnx_graphdef():
    graphdef, _, _ = nnx.split(_NNX(nnx.Rngs(0)), nnx.Param, nnx.BatchStat)
    return graphdef


@dataclasses.dataclass
class NNXvmap:
    graphdef: GraphConst[object] = None

    def init(self, rng):
        _, params, stats = nnx.split(_NNX(nnx.Rngs(rng)), nnx.Param, nnx.BatchStat)
        return params, stats

    def forward(self, params, *, x, state, rng, train):
        model = nnx.merge(self.graphdef, params, state, copy=True)
        model.train() if train else model.eval()

        # one example a call, the statistics shared across the batch by `axis_name` and carried out
        @nnx.vmap(in_axes=(nnx.StateAxes({nnx.BatchStat: None, ...: None}), 0, 0), out_axes=0, axis_name="batch")
        def each(m, xi, key):
            return m(xi[None], rngs=nnx.Rngs(dropout=key))[0]

        out = each(model, x, jax.random.split(rng, x.shape[0]))
        return out, nnx.state(model, nnx.BatchStat)

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)

    def optimizer(self):
        return optax.adam(1e-2)


def test_nnx_batch_stats_under_vmap(tmp_path):
    graphdef = _nnx_graphdef()
    data = {"train": _reg(), "valid": _reg(20, 1)}
    _check_lifecycle(lambda: NNXvmap(graphdef), data, tmp_path, jax.tree.leaves)


# ---------------------------------------------------------------- Flax Linen batch_stats under vmap
class _Linen(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train, axis_name="batch")(x)
        x = nn.Dropout(0.2, deterministic=not train)(nn.relu(x))
        return nn.Dense(1)(x)[..., 0]


@dataclasses.dataclass
class LinenVmap:
    def init(self, rng):
        v = jax.vmap(lambda x: _Linen().init(rng, x, train=False), axis_name="batch", out_axes=None)(jnp.zeros((2, 3)))
        return v["params"], {"batch_stats": v["batch_stats"]}

    def forward(self, params, *, x, state, rng, train):
        def one(xi, key):  # one example a call; BatchNorm averages over the vmapped `batch` axis
            return _Linen().apply({"params": params, **state}, xi, train=train, rngs={"dropout": key},
                                  mutable=["batch_stats"] if train else [])

        out, upd = jax.vmap(one, axis_name="batch", out_axes=(0, None))(x, jax.random.split(rng, x.shape[0]))
        return out, (upd if train else state)

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)

    def optimizer(self):
        return optax.adam(1e-2)


def test_linen_batch_stats_under_vmap(tmp_path):
    data = {"train": _reg(), "valid": _reg(20, 1)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        _check_lifecycle(LinenVmap, data, tmp_path, jax.tree.leaves)
