"""Real models: Flax Linen (Dropout + BatchNorm, the issue's contract verbatim), Flax NNX, Equinox;
the reserved hook parameters, any params pytree, path-aware optimizers, given params, the errors."""

import dataclasses
import sys

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import tol  # by backend: a GPU multiplies float32 at TF32 precision

import nitro_ipy
from nitro_ipy import Device, GraphConst, Nitro
from nitro_ipy._compiler import _reuse
from nitro_ipy._base._errors import NitroTypeError, NitroValueError


def _images(n, seed=0):
    r = np.random.default_rng(seed)
    x = r.normal(size=(n, 8, 8, 1)).astype(np.float32)
    y = (x[:, :4].sum((1, 2, 3)) > 0).astype(np.int32)
    return {"x": x, "y": y}


class CNN(nn.Module):
    drop: float

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(2, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.relu(x).reshape((x.shape[0], -1))
        x = nn.Dropout(self.drop, deterministic=not train)(x)
        return nn.Dense(2)(x)


@dataclasses.dataclass
class Digits:
    drop: GraphConst[float] = 0.5
    lr: Device[float] = 1e-2

    def init(self, rng):
        v = CNN(self.drop).init(rng, jnp.zeros((1, 8, 8, 1)), train=False)
        return v["params"], {"batch_stats": v["batch_stats"]}

    def forward(self, params, *, x, state, rng, train):
        out, upd = CNN(self.drop).apply({"params": params, **state}, x, train=train,
                                        rngs={"dropout": rng}, mutable=["batch_stats"] if train else [])
        return out, (upd if train else state)

    def loss(self, outputs, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(outputs, y).mean()

    def optimizer(self):
        return optax.adam(self.lr)


def _flax_data():
    return {"train": _images(64), "valid": _images(20, seed=1)}


def test_flax_linen_contract_verbatim_counts_state_and_modes():
    nitro_ipy.cache_reset()
    n = Nitro(Digits(), data=_flax_data(), batch_size=16, max_epochs=1, progress=False)
    stats0 = jax.tree.map(np.asarray, n.state)
    n.train()
    s = nitro_ipy.cache_stats()
    assert (s.misses, s.entries) == (3, 3)  # grad + opt + eval: the acceptance counts are unchanged
    n.train(2)
    assert nitro_ipy.cache_stats().misses == 3  # nothing recompiles with steps or epochs
    assert n.step == 12
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), n.state, stats0)
    assert min(jax.tree.leaves(moved)) > 0  # every running statistic moved
    assert set(n.params) == {"Conv_0", "BatchNorm_0", "Dense_0"}
    assert "mean" not in str(jax.tree_util.tree_structure(n.params))  # stats are not params
    # train=False in evaluation: dropout off, the running averages used, so validation is deterministic
    assert n.validate() == n.validate()
    out = n.predict({"x": _flax_data()["valid"]["x"]})
    want = CNN(0.5).apply({"params": n.params, **n.state}, _flax_data()["valid"]["x"], train=False)
    np.testing.assert_allclose(out, np.asarray(want), rtol=1e-5, atol=1e-5)
    assert nitro_ipy.cache_stats().misses == 4  # + predict
    n2 = n.rebuild()  # carries params, model state and optimizer state
    assert n2.step == n.step
    jax.tree.map(np.testing.assert_array_equal, n2.state, n.state)
    jax.tree.map(np.testing.assert_array_equal, n2.params, n.params)
    n2.train()
    assert nitro_ipy.cache_stats().misses == 4


def test_optimizer_never_sees_the_state_and_accum_threads_it():
    nitro_ipy.cache_reset()
    n = Nitro(Digits(), data={"train": _images(64)}, batch_size=8, accum=2, progress=False, flat_params=False)
    mu = n.opt_state[0].mu
    assert jax.tree_util.tree_structure(mu) == jax.tree_util.tree_structure(n.params)
    mean0 = np.asarray(n.state["batch_stats"]["BatchNorm_0"]["mean"])
    n.train()
    assert nitro_ipy.cache_stats().misses == 2  # train-only: grad + opt, state or not
    assert n.step == 4 and not np.allclose(n.state["batch_stats"]["BatchNorm_0"]["mean"], mean0)


def test_rng_is_per_step_per_micro_batch_reproducible_and_resumed():
    seen = []

    @dataclasses.dataclass
    class Noisy:
        def init(self, rng):
            return {"w": jnp.zeros(())}

        def forward(self, params, *, x, rng, train):
            assert train is True or train is False  # a static Python bool, never a tracer
            noise = jax.random.normal(rng, ())
            jax.debug.callback(lambda v: seen.append(float(v)), noise)
            return x.sum(-1) * params["w"] + noise

        def loss(self, outputs, *, y):
            return jnp.mean((outputs - y) ** 2)

    data = {"train": {"x": np.ones((32, 2), np.float32), "y": np.zeros(32, np.float32)}}
    nitro_ipy.cache_reset()
    n = Nitro(Noisy(), data=data, batch_size=4, accum=2, progress=False, seed=3)
    n.train()  # 4 steps x 2 micro-batches
    jax.effects_barrier()
    assert nitro_ipy.cache_stats().misses == 2
    want = [float(jax.random.normal(jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(3), s), m), ()))
            for s in range(4) for m in range(2)]
    np.testing.assert_allclose(seen, want, rtol=1e-6)
    assert len(set(seen)) == 8
    seen.clear()
    n2 = n.rebuild()  # a resumed run continues the stream: steps 4..7
    n2.train()
    jax.effects_barrier()
    want = [float(jax.random.normal(jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(3), s), m), ()))
            for s in range(4, 8) for m in range(2)]
    np.testing.assert_allclose(seen, want, rtol=1e-6)


def test_the_step_keys_are_derived_on_the_device_bit_for_bit():
    from nitro_ipy._training import _guard
    from nitro_ipy._experiment._model import step_key, step_keys, threefry2x32

    for seed in (0, 3, 2**31 + 5, 2**32 - 1):
        for start in (0, 17, 2**31 - 3, 2**32 - 2):
            want = [np.asarray(step_key(np.uint32(seed), np.uint32((start + i) % 2**32), m)) for i in range(3)
                    for m in (0, 5)]
            host = [step_keys(seed, start + i) for i in range(3)]  # (before micro 0, after), Python ints
            got = [key if m == 0 else threefry2x32(*base, 0, m) for base, key in host for m in (0, 5)]
            np.testing.assert_array_equal(got, want)
            before = [np.asarray(jax.random.fold_in(jax.random.PRNGKey(np.uint32(seed)), np.uint32((start + i) % 2**32)))
                      for i in range(3)]
            np.testing.assert_array_equal([base for base, _ in host], before)
            # the gradient program's key: a fresh guard holds its first step's keys (from the host), and
            # the optimizer program's `decide` derives each next step's on the device, whatever the step
            # did (a bad step advances the keys too)
            guard = jnp.asarray(_guard.fresh(1, seed, start))
            for i, loss in enumerate((1.0, np.nan, 2.0)):
                for m in (0, 5):
                    np.testing.assert_array_equal(jax.jit(_guard.step_rng)(guard, m), want[2 * i + (m == 5)])
                np.testing.assert_array_equal(jax.jit(_guard.step_rng)(guard), before[i])
                guard = jax.jit(_guard.decide, static_argnums=2)(guard, [jnp.float32(loss)], True)[1]
    # a handle without micro-batches takes the step's key, over epochs (a fresh guard each)
    seen = []

    @dataclasses.dataclass
    class Noisy:
        def init(self, rng):
            return {"w": jnp.zeros(())}

        def forward(self, params, *, x, rng):
            jax.debug.callback(lambda v: seen.append(float(v)), jax.random.normal(rng, ()))
            return x.sum(-1) * params["w"]

        def loss(self, outputs, *, y):
            return jnp.mean((outputs - y) ** 2)

    data = {"train": {"x": np.ones((28, 2), np.float32), "y": np.zeros(28, np.float32)}}
    n = Nitro(Noisy(), data=data, batch_size=4, progress=False, seed=11)
    n.train(2)  # 14 steps
    jax.effects_barrier()
    want = [float(jax.random.normal(step_key(11, s, 0), ())) for s in range(14)]
    np.testing.assert_allclose(seen, want, rtol=1e-6)


class _Eqx(eqx.Module):
    mlp: eqx.nn.MLP
    scale: float
    count: jax.Array

    def __call__(self, x):
        return jax.vmap(self.mlp)(x)[:, 0] * self.scale


@dataclasses.dataclass
class EqxExp:
    width: GraphConst[int] = 4
    scale: float = 1.5  # Host: read by `init` only, so it reaches the programs as a static leaf

    def init(self, rng):
        return _Eqx(eqx.nn.MLP(2, 1, self.width, 1, key=rng), self.scale, jnp.arange(3))

    def forward(self, params, *, x):
        return params(x)

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)


def _reg(n=64, seed=0):
    r = np.random.default_rng(seed)
    x = r.normal(size=(n, 2)).astype(np.float32)
    return {"x": x, "y": np.sin(x.sum(1))}


@pytest.mark.parametrize("flat", [True, False])
def test_equinox_module_as_params(flat):
    nitro_ipy.cache_reset()
    n = Nitro(EqxExp(), data={"train": _reg(), "valid": _reg(20, 1)}, batch_size=16, progress=False,
              flat_params=flat)
    before = np.asarray(n.params.mlp.layers[0].weight)  # a copy: training donates the old buffers
    n.train(2)
    assert nitro_ipy.cache_stats().misses == 3
    assert isinstance(n.params, _Eqx) and n.params.mlp.activation is jax.nn.relu
    assert n.params.scale == 1.5  # static: never trained
    np.testing.assert_array_equal(n.params.count, np.arange(3))  # an int array: carried, never differentiated
    assert not np.allclose(n.params.mlp.layers[0].weight, before)
    assert np.isfinite(n.validate()["loss"])


class _EqxBN(eqx.Module):
    """A stateful Equinox model: BatchNorm statistics live in an `eqx.nn.State`, not in the module."""

    lin: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    drop: eqx.nn.Dropout
    out: eqx.nn.Linear

    def __init__(self, width, key):
        k1, k2 = jax.random.split(key)
        self.lin = eqx.nn.Linear(2, width, key=k1)
        self.bn = eqx.nn.BatchNorm(width, axis_name="batch", mode="batch")
        self.drop = eqx.nn.Dropout(0.3)
        self.out = eqx.nn.Linear(width, "scalar", key=k2)

    def __call__(self, x, state, key):
        x, state = self.bn(self.lin(x), state)
        return self.out(self.drop(jax.nn.relu(x), key=key)), state


def _eqx_apply(model, x, state, rng, train):
    """The Equinox way to run a stateful model on a batch: vmapped over examples, the state shared."""
    model = eqx.nn.inference_mode(model, value=not train)
    keys = jax.random.split(rng, x.shape[0])
    return jax.vmap(model, axis_name="batch", in_axes=(0, None, 0), out_axes=(0, None))(x, state, keys)


@dataclasses.dataclass
class EqxStateExp:
    width: GraphConst[int] = 6

    def init(self, rng):
        return eqx.nn.make_with_state(_EqxBN)(self.width, rng)

    def forward(self, params, *, x, state, rng, train):
        return _eqx_apply(params, x, state, rng, train)

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)

    def optimizer(self):
        return optax.adam(1e-2)


@pytest.mark.parametrize("flat", [True, False])
def test_equinox_state_batchnorm_and_dropout_go_through_state(flat, tmp_path):
    nitro_ipy.cache_reset()
    data = {"train": _reg(64), "valid": _reg(20, 1)}
    n = Nitro(EqxStateExp(), data=data, batch_size=64, progress=False, flat_params=flat)
    assert isinstance(n.params, _EqxBN) and isinstance(n.state, eqx.nn.State)
    # the statistics are the state's, never parameters: the params are weights, biases and static leaves
    assert [p for p, k in zip(n._model.split.paths, n._model.split.kinds) if k != "static"] == [
        "params.lin.weight", "params.lin.bias", "params.bn.weight", "params.bn.bias",
        "params.out.weight", "params.out.bias"]
    copy = lambda a: np.array(a) if isinstance(a, jax.Array) else a  # training donates the old buffers
    init_params, state0 = jax.tree.map(copy, n.params), jax.tree.map(copy, n.state)
    n.train()  # one step over all 64 rows: the new statistics are those of the whole split, in any order
    assert nitro_ipy.cache_stats().misses == 3  # grad + opt + eval: state adds no program
    _, want = _eqx_apply(init_params, jnp.asarray(data["train"]["x"]), state0, jax.random.PRNGKey(0), True)
    moved = jax.tree.map(lambda a, b: not np.allclose(a, b), n.state, state0)
    assert all(jax.tree.leaves(moved))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **tol(1e-5, 1e-6)), n.state, want)
    # train=False in evaluation and predict: dropout off, the running statistics used
    assert n.validate() == n.validate()
    out = n.predict({"x": data["valid"]["x"]})
    direct, _ = _eqx_apply(n.params, jnp.asarray(data["valid"]["x"]), n.state, jax.random.PRNGKey(1), False)
    np.testing.assert_allclose(out, np.asarray(direct), **tol(1e-5, 1e-6))
    misses = nitro_ipy.cache_stats().misses
    n2 = n.rebuild()  # carries the module (static leaves included), the State and the optimizer state
    assert isinstance(n2.state, eqx.nn.State) and n2.params.drop.p == 0.3 and n2.params.bn.axis_name == "batch"
    jax.tree.map(np.testing.assert_array_equal, n2.state, n.state)
    n2.train()
    assert nitro_ipy.cache_stats().misses == misses  # the same programs: nothing in their keys moved
    m = Nitro(EqxStateExp(), data=data, batch_size=64, progress=False, flat_params=flat, resume=n2.save(tmp_path))
    assert m.step == 2 and isinstance(m.state, eqx.nn.State)
    jax.tree.map(np.testing.assert_array_equal, m.state, n2.state)
    assert m.validate() == n2.validate()


def test_rebuild_keeps_static_leaves_static():
    nitro_ipy.cache_reset()
    n = Nitro(EqxExp(), data={"train": _reg()}, batch_size=16, progress=False)
    n.train()
    n2 = n.rebuild()
    assert type(n2.params.scale) is float and n2.params.mlp.activation is jax.nn.relu
    np.testing.assert_array_equal(n2.params.count, np.arange(3))
    n2.train()
    assert nitro_ipy.cache_stats().misses == 2  # a static leaf turned into an array would key new programs


def test_rebuild_refuses_a_model_state_that_no_longer_fits():
    @dataclasses.dataclass
    class Counts:
        bins: int = 3  # Host: read by `init` only

        def init(self, rng):
            return {"w": jnp.zeros(2)}, {"seen": jnp.zeros(self.bins)}

        def forward(self, params, *, x, state):
            return x @ params["w"], {"seen": state["seen"] + 1.0}

        def loss(self, outputs, *, y):
            return jnp.mean((outputs - y) ** 2)

    n = Nitro(Counts(), data={"train": _reg(32)}, batch_size=16, progress=False)
    n.train()
    np.testing.assert_array_equal(n.state["seen"], [2.0, 2.0, 2.0])
    with pytest.raises(NitroValueError) as info:
        n.rebuild(Counts(bins=4))
    assert ("its parameters or model state differ from what `init` returns:\n  state['seen']: carried "
            "float32[3], `init` now gives float32[4]") in str(info.value)


def test_a_changed_static_leaf_moves_the_key():
    data = {"train": _reg()}
    for scale in (1.5, 1.5, 2.5):
        Nitro(EqxExp(scale=scale), data=data, batch_size=16, progress=False).train()
    # a Host field is never in the key; the static leaf it became is: 2.5 recompiles grad and opt
    assert nitro_ipy.cache_stats().misses == 4
    assert [e.why for e in nitro_ipy._compiler._cache.live_entries()][2:] != [None, None]


def test_leaf_neither_array_nor_static_is_refused_naming_its_path():
    class Opaque:
        __slots__ = ("v",)

        def __init__(self):
            self.v = 1

        __hash__ = object.__hash__

    @dataclasses.dataclass
    class Bad:
        def init(self, rng):
            return {"layers": [{"w": jnp.ones(2)}, {"w": jnp.ones(2), "activation": Opaque()}]}

        def forward(self, params, *, x):
            return x

    with pytest.raises(NitroTypeError, match=r"`params\['layers'\]\[1\]\['activation'\]` is Opaque"):
        Nitro(Bad(), progress=False)


def test_frozendict_and_int_leaves_with_both_layouts():
    from flax.core import FrozenDict

    @dataclasses.dataclass
    class Frozen:
        def init(self, rng):
            return FrozenDict({"w": jnp.ones(2) * 0.1, "steps": jnp.zeros((), jnp.int32), "on": jnp.array(True)})

        def forward(self, params, *, x):
            return jnp.where(params["on"], x @ params["w"], 0.0) + params["steps"]

        def loss(self, outputs, *, y):
            return jnp.mean((outputs - y) ** 2)

    for flat in (True, False):
        n = Nitro(Frozen(), data={"train": _reg()}, batch_size=16, progress=False, flat_params=flat)
        n.train()
        assert isinstance(n.params, FrozenDict) and n.params["steps"].dtype == jnp.int32
        assert bool(n.params["on"]) and not np.allclose(n.params["w"], 0.1)


class _NNXNet(nnx.Module):
    def __init__(self, width, rngs):
        self.lin = nnx.Linear(2, width, rngs=rngs)
        self.bn = nnx.BatchNorm(width, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.out = nnx.Linear(width, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.bn(self.lin(x)))))[:, 0]


def _rngs(seed):
    """The `nnx.Rngs` of an NNX model: a named `dropout` stream, which `nnx.reseed` can find."""
    return nnx.Rngs(params=seed, dropout=seed)


@dataclasses.dataclass
class NNXExp:
    graphdef: GraphConst[object] = None

    def init(self, rng):
        _, params, state = nnx.split(_NNXNet(4, _rngs(rng)), nnx.Param, ...)
        return params, state

    def forward(self, params, *, x, state, rng, train):
        model = nnx.merge(self.graphdef, params, state, copy=True)
        model.train() if train else model.eval()
        if train:
            nnx.reseed(model, dropout=rng)
        out = model(x)
        return out, nnx.state(model, nnx.Not(nnx.Param))

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)


@dataclasses.dataclass
class _NNXDefaultStream(NNXExp):
    def init(self, rng):
        _, params, state = nnx.split(_NNXNet(4, nnx.Rngs(rng)), nnx.Param, ...)
        return params, state


def test_nnx_dropout_draws_from_the_step_s_rng_as_docs_models_says():
    """`nnx.reseed(model, dropout=rng)` reaches dropout only when `init`'s state has a `dropout` stream;
    with `nnx.Rngs(rng)` alone it is a silent no-op (Flax 0.12): the step's key never reaches dropout."""
    x = jnp.asarray(_reg()["x"])
    graphdef = nnx.split(_NNXNet(4, _rngs(0)), nnx.Param, ...)[0]
    for cls, reaches in ((NNXExp, True), (_NNXDefaultStream, False)):
        e = cls(graphdef)
        params, state = e.init(jax.random.PRNGKey(0))
        out = lambda k, train: np.asarray(e.forward(params, x=x, state=state, rng=jax.random.PRNGKey(k), train=train)[0])
        assert (not np.array_equal(out(1, True), out(2, True))) == reaches
        np.testing.assert_array_equal(out(1, False), out(2, False))  # evaluation: no dropout


def test_nnx_graphdef_as_graphconst_trains_batch_stats():
    graphdef, _, _ = nnx.split(_NNXNet(4, _rngs(0)), nnx.Param, ...)
    nitro_ipy.cache_reset()
    n = Nitro(NNXExp(graphdef), data={"train": _reg(), "valid": _reg(20, 1)}, batch_size=16, progress=False)
    mean0 = np.asarray(n.state["bn"]["mean"][...])
    n.train(2)
    assert nitro_ipy.cache_stats().misses == 3
    assert not np.allclose(np.asarray(n.state["bn"]["mean"][...]), mean0)
    assert n.validate() == n.validate()
    # the same graphdef rebuilt from scratch fingerprints equal: a fresh handle hits
    graphdef2, _, _ = nnx.split(_NNXNet(4, _rngs(1)), nnx.Param, ...)
    Nitro(NNXExp(graphdef2), data={"train": _reg(), "valid": _reg(20, 1)}, batch_size=16, progress=False).train()
    assert nitro_ipy.cache_stats().misses == 3
    graphdef3, _, _ = nnx.split(_NNXNet(8, _rngs(1)), nnx.Param, ...)
    assert nitro_ipy.graphconst_field_hash(NNXExp(graphdef3)) != nitro_ipy.graphconst_field_hash(NNXExp(graphdef))


@dataclasses.dataclass
class NNXStreamExp(NNXExp):
    """Dropout draws from the model's own `nnx.Rngs` stream: its key (a typed `key<fry>` array) and count
    are model state, not the step's `rng`."""

    def init(self, rng):
        _, params, state = nnx.split(_NNXNet(4, nnx.Rngs(params=0, dropout=1)), nnx.Param, ...)
        return params, state

    def forward(self, params, *, x, state, train):
        model = nnx.merge(self.graphdef, params, state, copy=True)
        model.train() if train else model.eval()
        return model(x), nnx.state(model, nnx.Not(nnx.Param))


def test_nnx_rngs_stream_in_the_state_rebuilds_saves_and_resumes(tmp_path):
    graphdef, _, _ = nnx.split(_NNXNet(4, _rngs(0)), nnx.Param, ...)
    data = {"train": _reg(), "valid": _reg(20, 1)}
    nitro_ipy.cache_reset()
    n = Nitro(NNXStreamExp(graphdef), data=data, batch_size=16, progress=False)
    assert [str(x.dtype) for x in jax.tree.leaves(n.state) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)] == ["key<fry>"]
    n.train(2)
    assert int(n.state["drop"]["rngs"]["count"][...]) == 8  # the stream advanced once per step
    n = n.rebuild()  # the carried state's typed key fits what `init` builds
    n.train()
    path = n.save(tmp_path)
    m = Nitro(NNXStreamExp(graphdef), data=data, batch_size=16, progress=False, resume=path)
    np.testing.assert_array_equal(jax.random.key_data(m.state["drop"]["rngs"]["key"][...]),
                                  jax.random.key_data(n.state["drop"]["rngs"]["key"][...]))
    assert m.validate() == n.validate()
    m.train()
    n.train()
    jax.tree.map(np.testing.assert_array_equal, m.params, n.params)  # the resumed run drew the same masks
    assert nitro_ipy.cache_stats().misses == 3


@dataclasses.dataclass
class Decayed:
    def init(self, rng):
        k1, k2 = jax.random.split(rng)
        return {"dense": {"kernel": jax.random.normal(k1, (2, 4)), "bias": jnp.ones(4)},
                "out": {"kernel": jax.random.normal(k2, (4,)), "bias": jnp.ones(())}}

    def forward(self, params, *, x):
        h = jnp.tanh(x @ params["dense"]["kernel"] + params["dense"]["bias"])
        return h @ params["out"]["kernel"] + params["out"]["bias"]

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)

    def optimizer(self):
        mask = lambda p: jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key == "kernel", p)
        return optax.adamw(1e-2, weight_decay=0.5, mask=mask)


def test_a_path_mask_trains_on_the_flat_layout_as_on_the_tree():
    # the decay mask groups the flat buffers (tests/test_groups.py has every form of mask and label)
    runs = []
    for flat in (True, False):
        n = Nitro(Decayed(), data={"train": _reg()}, batch_size=16, max_epochs=2, progress=False, flat_params=flat)
        n.train()
        runs.append(n.params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), *runs)


def test_flat_and_tree_layouts_train_identical_params():
    @dataclasses.dataclass
    class Plain(Decayed):
        def optimizer(self):
            return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))

    runs = []
    for flat in (True, False):
        n = Nitro(Plain(), data={"train": _reg()}, batch_size=16, max_epochs=2, progress=False, flat_params=flat)
        n.train()
        runs.append(n.params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), *runs)


def test_device_field_in_a_schedule_constructor_names_field_and_fixes():
    @dataclasses.dataclass
    class Warm(Decayed):
        lr: Device[float] = 1e-2
        wd: Device[float] = 1e-4

        def optimizer(self):
            sched = optax.warmup_cosine_decay_schedule(0.0, self.lr, 10, 100)
            return optax.adamw(sched, weight_decay=self.wd)

    with pytest.raises(NitroTypeError) as info:
        Nitro(Warm(), data={"train": _reg()}, progress=False)
    msg = str(info.value)
    assert "Device field `lr`" in msg and "`wd`" not in msg
    assert "GraphConst[float]" in msg and "schedules={'lr': fn}" in msg


def test_forward_wrong_arity_and_init_wrong_arity():
    @dataclasses.dataclass
    class NoTuple(Digits):
        def init(self, rng):
            return CNN(self.drop).init(rng, jnp.zeros((1, 8, 8, 1)), train=False)["params"]

    with pytest.raises(NitroTypeError, match=r"declares `state`, so `init` must return `\(params, state\)`"):
        Nitro(NoTuple(), data=_flax_data(), progress=False)

    @dataclasses.dataclass
    class OneOut(Digits):
        def forward(self, params, *, x, state, rng, train):
            return CNN(self.drop).apply({"params": params, **state}, x, train=False)

    with pytest.raises(NitroTypeError, match=r"must return `\(outputs, new_state\)`"):
        Nitro(OneOut(), data=_flax_data(), batch_size=16, progress=False).train()


def test_reserved_name_on_a_hook_that_does_not_receive_it():
    @dataclasses.dataclass
    class LossRng(Decayed):
        def loss(self, outputs, *, y, rng):
            return jnp.mean((outputs - y) ** 2)

    with pytest.raises(NitroTypeError, match=r"declares the reserved parameter `rng`"):
        Nitro(LossRng(), progress=False)


def test_given_params_and_state_start_the_run_and_are_checked():
    n = Nitro(Digits(), data=_flax_data(), batch_size=16, progress=False)
    n.train()
    m = Nitro(Digits(), data=_flax_data(), batch_size=16, progress=False, params=n.params, state=n.state)
    assert m.step == 0
    jax.tree.map(np.testing.assert_array_equal, m.params, n.params)
    assert m.validate() == n.validate()
    bad = jax.tree.map(lambda a: a, dict(n.params))
    bad["Dense_0"] = {"kernel": jnp.zeros((10, 2)), "bias": jnp.zeros(2)}
    with pytest.raises(NitroValueError) as info:
        Nitro(Digits(), data=_flax_data(), progress=False, params=bad, state=n.state)
    assert "`params['Dense_0']['kernel']`: expected float32[128, 2], got float32[10, 2]" in str(info.value)
    with pytest.raises(NitroValueError, match=r"`state\['batch_stats'\]\['BatchNorm_0'\]\['mean'\]` missing"):
        Nitro(Digits(), data=_flax_data(), progress=False, params=n.params, state={})


def test_given_params_in_other_mappings_are_taken_in_init_s_containers():
    # weights loaded as a Flax FrozenDict (an older checkpoint, `flax.serialization`) for an `init` that
    # returns dicts, and the state given as an `nnx.State`: the same keys, so they are taken as given
    from flax.core import freeze

    n = Nitro(Digits(), data=_flax_data(), batch_size=16, progress=False)
    n.train()
    frozen = freeze(jax.tree.map(np.asarray, n.params))
    m = Nitro(Digits(), data=_flax_data(), batch_size=16, progress=False, params=frozen,
              state=nnx.State(jax.tree.map(np.asarray, n.state)))
    assert type(m.params) is dict and type(m.params["Dense_0"]) is dict and type(m.state) is dict
    jax.tree.map(np.testing.assert_array_equal, m.params, n.params)
    assert m.validate() == n.validate()
    m.train()
    assert m.step == 4
    # a FrozenDict missing a layer is still refused by path
    short = freeze({k: v for k, v in frozen.items() if k != "Dense_0"})
    with pytest.raises(NitroValueError, match=r"`params\['Dense_0'\]\['bias'\]` missing"):
        Nitro(Digits(), data=_flax_data(), progress=False, params=short)


class _Tagged(eqx.Module):
    lin: eqx.nn.Linear
    tag: str = eqx.field(static=True)

    def __call__(self, x):
        return jax.vmap(self.lin)(x)[:, 0]


@dataclasses.dataclass
class TaggedExp:
    def init(self, rng):
        return _Tagged(eqx.nn.Linear(2, 1, key=rng), "relu")

    def forward(self, params, *, x):
        return params(x)

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)


def test_a_given_module_with_other_static_fields_is_refused():
    # an Equinox module whose arrays fit but whose static fields differ is another model: not regrouped
    good = TaggedExp().init(jax.random.PRNGKey(1))
    with pytest.raises(NitroValueError, match="containers differ"):
        Nitro(TaggedExp(), data={"train": _reg()}, progress=False, params=_Tagged(good.lin, "tanh"))
    m = Nitro(TaggedExp(), data={"train": _reg()}, batch_size=64, progress=False, params=good)
    np.testing.assert_array_equal(m.params.lin.weight, good.lin.weight)


def test_a_checkpoint_carries_the_model_state(tmp_path):
    n = Nitro(Digits(), data={"train": _images(32)}, batch_size=16, progress=False)
    n.train()
    path = n.save(tmp_path)
    m = Nitro(Digits(), data={"train": _images(32)}, batch_size=16, progress=False, resume=path)
    assert m.step == n.step == 2
    jax.tree.map(np.testing.assert_array_equal, m.state, n.state)
    jax.tree.map(np.testing.assert_array_equal, m.params, n.params)


def _nnx_experiment():
    graphdef, _, _ = nnx.split(_NNXNet(4, _rngs(0)), nnx.Param, ...)
    return NNXExp(graphdef), {"train": _reg(), "valid": _reg(20, 1)}


@pytest.mark.parametrize("make", [
    lambda: (Digits(), _flax_data()),  # Linen with rng, state and train
    lambda: (EqxExp(), {"train": _reg(), "valid": _reg(20, 1)}),  # an Equinox module as params
    _nnx_experiment,  # NNX: graphdef GraphConst, state, rng
], ids=["linen", "equinox", "nnx"])
def test_a_dropped_handle_frees_its_programs_without_a_garbage_collection(make):
    """A notebook rebinds `n` every rebuild: the old handle, and the programs only it holds, must go at
    once, not at the next `gc` (compile-ahead would otherwise rebuild programs for a handle no one has)."""
    import gc
    import weakref

    e, data = make()
    gc.collect()
    gc.disable()
    try:
        n = Nitro(e, data=data, batch_size=16, max_epochs=1, progress=False)
        n.train()
        n.predict({"x": data["valid"]["x"]})
        handle, entries = weakref.ref(n), [weakref.ref(x) for x in n._programs.values()]
        assert len(entries) >= 3  # grad, opt, eval, predict
        del n
        nitro_ipy.cache_reset()
        assert (handle() is None, [r() is None for r in entries]) == (True, [True] * len(entries))
    finally:
        gc.enable()


# Optimizers that mean the same on one flat buffer per dtype as on the params tree, and ones that do not:
# the setup check's verdict (`_optimizer.shape_dependence`) against the updates themselves, 3 steps each.
_SAME_FLAT = {
    "sgd": lambda: optax.sgd(0.1), "nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: optax.adam(1e-2), "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "adamax": lambda: optax.adamax(1e-2), "adagrad": lambda: optax.adagrad(1e-2),
    "rmsprop": lambda: optax.rmsprop(1e-2, centered=True), "adabelief": lambda: optax.adabelief(1e-2),
    "lion": lambda: optax.lion(1e-2), "yogi": lambda: optax.yogi(1e-2), "radam": lambda: optax.radam(1e-2),
    "amsgrad": lambda: optax.amsgrad(1e-2),
    "global clip + adam": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)),
    "clip + sgd": lambda: optax.chain(optax.clip(0.1), optax.sgd(1e-2)),
    "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(1e-2), 3),
    "MultiSteps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    "schedule": lambda: optax.adam(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)),
    # global inner products over every parameter (`tree_vdot`: a reshape, then a full contraction)
    "prodigy": lambda: optax.contrib.prodigy(1.0), "dadapt_adamw": lambda: optax.contrib.dadapt_adamw(1.0),
    "momo": lambda: optax.contrib.momo(1.0),
}
_NOT_SAME_FLAT = {
    "lamb": lambda: optax.lamb(1e-2), "lars": lambda: optax.lars(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=2),
    "novograd": lambda: optax.novograd(1e-2), "fromage": lambda: optax.fromage(1e-2),
    "adaptive_grad_clip": lambda: optax.chain(optax.adaptive_grad_clip(0.01), optax.sgd(1e-2)),
    "trust ratio": lambda: optax.chain(optax.scale_by_adam(), optax.scale_by_trust_ratio(), optax.scale(-1e-2)),
    "sm3": lambda: optax.sm3(1e-2), "centralize": lambda: optax.chain(optax.centralize(), optax.sgd(1e-2)),
    "muon": lambda: optax.contrib.muon(1e-2), "DoG": lambda: optax.scale_by_distance_over_gradients(),
}


def _updates(tx, tree, grads, flat: bool):
    ravel = lambda t: jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(t)])  # noqa: E731
    p = ravel(tree) if flat else tree
    state = tx.init(p)
    from nitro_ipy._experiment._optimizer import update_args

    step = jax.jit(lambda g, s: tx.update(g, s, p, **update_args(tx, jnp.float32(0.5))))  # `value=` for momo
    for g in grads:
        u, state = step(ravel(g) if flat else g, state)
    return np.asarray(u if flat else ravel(u))


@pytest.mark.parametrize("name", [*_SAME_FLAT, *_NOT_SAME_FLAT])
def test_flat_layout_refuses_exactly_the_optimizers_that_would_compute_otherwise(name):
    from nitro_ipy._experiment._optimizer import shape_dependence

    r = np.random.default_rng(0)
    shapes = [(3, 4), (4,), (4, 4), (5, 1)]
    tree = {f"p{i}": jnp.asarray(r.normal(size=s).astype(np.float32)) for i, s in enumerate(shapes)}
    grads = [{k: jnp.asarray(r.normal(size=v.shape).astype(np.float32)) for k, v in tree.items()} for _ in range(3)]
    tx = {**_SAME_FLAT, **_NOT_SAME_FLAT}[name]()
    same = np.allclose(_updates(tx, tree, grads, True), _updates(tx, tree, grads, False), rtol=1e-5, atol=1e-7)
    assert same == (name in _SAME_FLAT)
    assert (shape_dependence(tx, tree) is None) == same


def test_a_shape_dependent_optimizer_is_refused_at_setup_with_the_fix():
    @dataclasses.dataclass
    class Lamb(Decayed):
        def optimizer(self):
            return optax.lamb(1e-2)

    with pytest.raises(NitroValueError) as info:
        Nitro(Lamb(), data={"train": _reg()}, progress=False)
    assert str(info.value) == (
        "the optimizer of `test_a_shape_dependent_optimizer_is_refused_at_setup_with_the_fix.<locals>.Lamb` "
        "treats each parameter array by its own shape or norm (an update reads a reduction over its own array: "
        "as `adafactor`, `lamb`, `lars` or a per-parameter clip do), but `flat_params=True` hands it one flat "
        "buffer per dtype, where it would compute something else. Pass `Nitro(e, ..., flat_params=False)` so "
        "it sees the params tree.")
    n = Nitro(Lamb(), data={"train": _reg()}, batch_size=64, progress=False, flat_params=False)
    n.train()
    assert n.step == 1


@pytest.mark.parametrize("flat", [True, False])
def test_an_optimizer_taking_the_loss_gets_the_step_s_loss_as_value(flat):
    # `reduce_on_plateau` reads `value=` in its update: the step's loss, as the optax docs' loop passes it
    tx = lambda: optax.chain(optax.sgd(0.5), optax.contrib.reduce_on_plateau(patience=1, factor=0.5))  # noqa: E731

    @dataclasses.dataclass
    class Plateau(Decayed):
        def optimizer(self):
            return tx()

    data = {"train": _reg(32)}
    n = Nitro(Plateau(), data=data, batch_size=32, progress=False, flat_params=flat)
    p = jax.tree.map(np.asarray, n.params)
    n.train(12)
    # the same steps by hand: one full batch a step, so the order of the rows cannot matter
    x, y = jnp.asarray(data["train"]["x"]), jnp.asarray(data["train"]["y"])
    loss = lambda p: jnp.mean((Plateau().forward(p, x=x) - y) ** 2)  # noqa: E731
    want, state = p, tx().init(p)
    for _ in range(12):
        value, g = jax.value_and_grad(loss)(want)
        u, state = tx().update(g, state, want, value=value)
        want = optax.apply_updates(want, u)
    scale = float(optax.tree_utils.tree_get(state, "scale"))
    assert scale < 1.0  # the plateau was reached: the test is about something
    assert float(optax.tree_utils.tree_get(n.opt_state, "scale")) == scale
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), n.params, want)


def test_an_optimizer_needing_more_than_the_loss_is_refused_at_setup():
    @dataclasses.dataclass
    class LineSearch(Decayed):
        def optimizer(self):
            return optax.chain(optax.sgd(1.0), optax.scale_by_backtracking_linesearch(max_backtracking_steps=3))

    with pytest.raises(NitroTypeError) as info:
        Nitro(LineSearch(), data={"train": _reg()}, progress=False)
    assert str(info.value) == (
        "the optimizer of `test_an_optimizer_needing_more_than_the_loss_is_refused_at_setup.<locals>.LineSearch` "
        "needs `grad=` in its `update` (an optax transformation taking extra arguments, such as a line search's "
        "`value_fn`); the optimizer program passes only `value=`, the step's loss (enough for `reduce_on_plateau` "
        "and `polyak_sgd`). Pick a transformation that needs no more, or drive the step yourself with `optax` "
        "outside nitro_ipy.")


INIT_CALLS = []


def _hidden_width(e):
    return e.hidden


@dataclasses.dataclass
class Sized:
    hidden: int = 4  # Host: `init` reads it, the programs never do
    extra: list = dataclasses.field(default_factory=list)  # Host, mutable

    def init(self, rng):
        INIT_CALLS.append(1)
        w = _hidden_width(self) + len(self.extra)
        return {"w": jnp.zeros((2, w)), "v": jnp.zeros((w,))}

    def forward(self, params, *, x):
        return jnp.tanh(x @ params["w"]) @ params["v"]

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)


def test_rebuild_reuses_init_s_shapes_only_while_nothing_they_hang_on_moved(monkeypatch):
    n = Nitro(Sized(), data={"train": _reg()}, batch_size=64, progress=False)
    n.train()
    INIT_CALLS.clear()
    n = n.rebuild()
    n = n.rebuild()
    assert len(INIT_CALLS) == 1  # the second rebuild's check took the first's shapes: init not traced
    # a Host field `init` reads: a new value is a new trace, and the carried params no longer fit
    n.experiment.hidden = 5
    with pytest.raises(NitroValueError, match=r"params\['v'\]: carried float32\[4\], `init` now gives float32\[5\]"):
        n.rebuild()
    n.experiment.hidden = 4
    n.rebuild()
    # a list mutated in place: its content moved, so the shapes are traced again
    n.experiment.extra.append(0)
    with pytest.raises(NitroValueError, match=r"params\['w'\]: carried float32\[2, 4\], `init` now gives float32\[2, 5\]"):
        n.rebuild()
    n.experiment.extra.clear()
    n.rebuild()
    # a helper `init` calls, redefined: its dependency closure drifted
    monkeypatch.setattr(sys.modules[__name__], "_hidden_width", lambda e: e.hidden * 2)
    with pytest.raises(NitroValueError, match=r"params\['v'\]: carried float32\[4\], `init` now gives float32\[8\]"):
        n.rebuild()


def test_an_nnx_module_merged_without_copy_trains_as_with_it():
    # The hooks get params and state containers built inside the trace that differentiates them, so NNX
    # lets the module update its BatchStat even without `copy=True` (it used to refuse: "Cannot mutate
    # BatchStat from a different trace level", which nitro_ipy still annotates with the fix).
    @dataclasses.dataclass
    class NoCopy(NNXExp):
        def forward(self, params, *, x, state, train):
            model = nnx.merge(self.graphdef, params, state)
            model.train() if train else model.eval()
            return model(x), nnx.state(model, nnx.Not(nnx.Param))

    @dataclasses.dataclass
    class Copy(NoCopy):
        def forward(self, params, *, x, state, train):
            model = nnx.merge(self.graphdef, params, state, copy=True)
            model.train() if train else model.eval()
            return model(x), nnx.state(model, nnx.Not(nnx.Param))

    graphdef, _, _ = nnx.split(_NNXNet(4, _rngs(0)), nnx.Param, ...)
    runs = []
    for cls in (NoCopy, Copy):
        n = Nitro(cls(graphdef), data={"train": _reg()}, batch_size=16, progress=False)
        n.train()
        runs.append([x for x in jax.tree.leaves((n.params, n.state)) if jnp.issubdtype(x.dtype, jnp.floating)])
    assert len(runs[0]) == len(runs[1]) >= 6  # weights, biases, BatchNorm scale and statistics
    for a, b in zip(*runs):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    from nitro_ipy._base._errors import library_hint

    err = type("TraceContextError", (Exception,), {"__module__": "flax.errors"})("Cannot mutate BatchStat")
    assert "nnx.merge(graphdef, params, state, copy=True)" in library_hint(err)


# ---------------------------------------------------------------- trace reuse on real models
def _loss_edit(monkeypatch, cls):
    """Re-define `cls` as re-running its cell with another loss would: the same name, the same forward."""
    base = cls.loss

    def loss(self, outputs, *, y):
        return 2.0 * base(self, outputs, y=y) + 0.01 * jnp.mean(outputs ** 2)

    edited = type(cls.__name__, (cls,), {"loss": loss, "__qualname__": cls.__qualname__,
                                         "__module__": cls.__module__})
    monkeypatch.setattr(sys.modules[cls.__module__], cls.__name__, edited)
    nitro_ipy.bump_world()


def _trained_after_a_loss_edit(monkeypatch, make, reuse: bool, **options):
    """Train, edit the loss, rebuild and train: the rebuilt handle, and what trace reuse did meanwhile."""
    nitro_ipy.cache_reset()
    previous = nitro_ipy.set_trace_reuse(reuse)
    try:
        e, data = make()
        n = Nitro(e, data=data, batch_size=16, progress=False, **options)
        n.train()
        assert _reuse.wait(60)
        before = dict(_reuse.stats)
        with monkeypatch.context() as m:
            _loss_edit(m, type(e))
            n = n.rebuild()
            n.train(2)
        assert _reuse.wait(60)
        return n, {k: v - before[k] for k, v in _reuse.stats.items()}
    finally:
        nitro_ipy.set_trace_reuse(previous)


def _eqx_state_experiment():
    return EqxStateExp(), {"train": _reg(64), "valid": _reg(20, 1)}


@pytest.mark.parametrize("options", [{}, {"accum": 2}, {"flat_params": False}], ids=["flat", "accum2", "tree"])
@pytest.mark.parametrize("make", [
    lambda: (Digits(), _flax_data()),  # Linen: BatchNorm statistics in the state, a dropout key per step
    lambda: (EqxExp(), {"train": _reg(), "valid": _reg(20, 1)}),  # a module with static leaves as params
    _eqx_state_experiment,  # Equinox BatchNorm and Dropout through `eqx.nn.State`
    _nnx_experiment,  # NNX: a graphdef GraphConst, its state, the step's rng
], ids=["linen", "equinox", "equinox-state", "nnx"])
def test_a_loss_edit_reuses_the_forward_s_trace_and_trains_the_same_bits(monkeypatch, make, options):
    """The rebuilt gradient program traces the loss through the forward's cached trace (state, step keys,
    micro-batches and static leaves included) and trains exactly what a plain trace of the edit trains."""
    reused, stats = _trained_after_a_loss_edit(monkeypatch, make, True, **options)
    assert stats == {"warmed": 0, "reused": 1, "discarded": 0, "retraced": 0, "redone": 0}
    plain, stats = _trained_after_a_loss_edit(monkeypatch, make, False, **options)
    assert stats == {"warmed": 0, "reused": 0, "discarded": 0, "retraced": 0, "redone": 0}
    assert [h["loss"] for h in reused.history] == [h["loss"] for h in plain.history]
    assert [h["valid_loss"] for h in reused.history] == [h["valid_loss"] for h in plain.history]
    assert _bits((reused.params, reused.state)) == _bits((plain.params, plain.state))


def _bits(tree) -> list:
    """Every leaf of `tree` as bytes (a typed PRNG key as its data), or as itself when not an array."""
    def bits(leaf):
        if not isinstance(leaf, jax.Array):
            return leaf
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        return np.asarray(leaf).tobytes()
    return [bits(leaf) for leaf in jax.tree.leaves(tree)]


class Moved(Sized):  # `init` inherited from `Sized`
    pass


class Based(Sized):
    def width(self):
        return 4

    def init(self, rng):
        return {"w": jnp.zeros((2, self.width())), "v": jnp.zeros((self.width(),))}


class MovedWidth(Based):  # `init` and the `width` it calls inherited from `Based`
    pass


# A class's cell re-run so that a method `init` runs moves to the class itself: the same class name,
# module and field values, and the functions the kept shapes' closure recorded have not changed.
MOVED = {
    "init": ("Moved", "class Moved(Sized):\n    def init(self, rng):\n"
                      "        return {'w': jnp.zeros((2, 6)), 'v': jnp.zeros((6,))}\n"),
    "a method init calls": ("MovedWidth", "class MovedWidth(Based):\n    def width(self):\n        return 6\n"),
}


@pytest.mark.parametrize("what", sorted(MOVED))
def test_rebuild_traces_init_again_when_a_method_it_runs_moves_to_the_class(what, monkeypatch):
    name, cell = MOVED[what]
    module = sys.modules[__name__]
    n = Nitro(getattr(module, name)(), data={"train": _reg()}, batch_size=64, progress=False)
    n.train()
    n = n.rebuild()  # the inherited code's shapes, kept
    ns = dict(vars(module))
    exec(compile(cell, __file__, "exec"), ns)
    monkeypatch.setattr(module, name, ns[name])
    with pytest.raises(NitroValueError, match=r"params\['v'\]: carried float32\[4\], `init` now gives float32\[6\]"):
        n.rebuild()
