"""Parameter groups on the flat layout: every form of optax mask and label trains the same parameters on
the default (flat) layout as on `flat_params=False`, with one buffer per (dtype, group); the forms that
cannot mean the same on buffers are refused at setup with the fix."""

import dataclasses
import functools

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nitro_ipy
from nitro_ipy import Device, GraphConst, Nitro
from nitro_ipy._base._errors import NitroValueError


def _reg(n=48, seed=0):
    r = np.random.default_rng(seed)
    x = r.normal(size=(n, 3)).astype(np.float32)
    return {"x": x, "y": np.sin(x.sum(1)).astype(np.float32)}


def by_path(p):
    """Decay kernels, not biases or norm scales: a mask by path."""
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key == "kernel", p)


def by_ndim(p):
    """optax's own docstring example: decay what is not 1-D."""
    return jax.tree.map(lambda x: x.ndim != 1, p)


def labels_by_path(p):
    return jax.tree_util.tree_map_with_path(lambda path, _: "fast" if path[0].key == "out" else "slow", p)


_MASK_TREE = {"dense": {"kernel": True, "bias": False}, "norm": {"scale": False}, "out": {"kernel": True, "bias": False}}
_LABEL_TREE = {"dense": "slow", "norm": "frozen", "out": "fast"}  # a prefix of the params tree

# Every form of mask and label the issue names, alone, nested in chains, with schedules, Device
# hyperparameters (`self.lr`, traced in the optimizer program) and `inject_hyperparams`.
FORMS = {
    "adamw mask by path": lambda e: optax.adamw(e.lr, weight_decay=0.3, mask=by_path),
    "adamw mask by ndim": lambda e: optax.adamw(e.lr, weight_decay=0.3, mask=by_ndim),
    "adamw mask tree": lambda e: optax.adamw(e.lr, weight_decay=0.3, mask=_MASK_TREE),
    "masked in chain": lambda e: optax.chain(
        optax.clip_by_global_norm(1.0), optax.scale_by_adam(),
        optax.masked(optax.add_decayed_weights(0.2), by_path), optax.scale(-e.lr)),
    "masked global clip": lambda e: optax.chain(
        optax.masked(optax.clip_by_global_norm(0.05), by_ndim), optax.adam(e.lr)),
    "multi_transform labels fn": lambda e: optax.multi_transform(
        {"fast": optax.adam(e.lr * 3), "slow": optax.sgd(e.lr, momentum=0.9)}, labels_by_path),
    "multi_transform prefix tree": lambda e: optax.multi_transform(
        {"fast": optax.adamw(e.lr, weight_decay=0.1, mask=by_ndim), "slow": optax.sgd(e.lr),
         "frozen": optax.set_to_zero()}, _LABEL_TREE),
    "schedule + mask": lambda e: optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 2e-2, 2, 10), weight_decay=0.3, mask=by_path)),
    "inject_hyperparams": lambda e: optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
        learning_rate=e.lr, weight_decay=0.3, mask=by_path),
    "inject_hyperparams mask tree": lambda e: optax.inject_hyperparams(optax.adamw)(
        learning_rate=e.lr, weight_decay=0.3, mask=_MASK_TREE),
    "freeze": lambda e: optax.chain(optax.adam(e.lr), optax.transforms.freeze(by_ndim)),
    "MultiSteps": lambda e: optax.MultiSteps(optax.adamw(e.lr, weight_decay=0.3, mask=by_path), every_k_schedule=2),
    "two masks": lambda e: optax.chain(
        optax.masked(optax.clip(0.01), by_ndim), optax.adamw(e.lr, weight_decay=0.3, mask=by_path)),
}


@dataclasses.dataclass
class Net:
    form: GraphConst[str] = "adamw mask by path"
    lr: Device[float] = 1e-2

    def init(self, rng):
        k1, k2 = jax.random.split(rng)
        return {"dense": {"kernel": jax.random.normal(k1, (3, 8)) * 0.5, "bias": jnp.full(8, 0.1)},
                "norm": {"scale": jnp.ones(8)},
                "out": {"kernel": jax.random.normal(k2, (8,)) * 0.5, "bias": jnp.ones(())}}

    def forward(self, params, *, x):
        h = jnp.tanh(x @ params["dense"]["kernel"] + params["dense"]["bias"]) * params["norm"]["scale"]
        return h @ params["out"]["kernel"] + params["out"]["bias"]

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)

    def optimizer(self):
        return FORMS[self.form](self)


def _train(e, flat, steps=6, **kw):
    n = Nitro(e, data={"train": _reg()}, batch_size=16, max_epochs=2, progress=False, flat_params=flat, **kw)
    n.train()
    assert steps is None or n.step == steps
    return n


def _close(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-6), a, b)


@pytest.mark.parametrize("form", list(FORMS))
def test_each_form_trains_the_same_params_on_the_flat_layout_as_on_the_tree(form):
    nitro_ipy.cache_reset()
    flat, tree = _train(Net(form), True), _train(Net(form), False)
    _close(flat.params, tree.params)
    init = Nitro(Net(form), data={"train": _reg()}, progress=False).params
    moved = jax.tree.map(lambda a, b: not np.allclose(a, b), flat.params, init)
    assert any(jax.tree.leaves(moved))  # the test is about something: training moved the params
    # the groups are the masks' and labels': few buffers, far fewer than the 5 arrays of the tree
    assert flat._layout.grouped and 2 <= len(flat._layout.groups) <= 5
    buffers = lambda n: [x for x in jax.tree.leaves(n.opt_state) if np.size(x) > 1]  # noqa: E731
    assert len(buffers(flat)) <= len(buffers(tree))


def test_groups_with_a_per_step_schedule_of_a_device_field_and_micro_batches():
    kw = dict(schedules={"lr": lambda step: 2e-2 / (1 + step)}, accum=2, steps=None)
    for form in ("adamw mask by path", "multi_transform labels fn"):
        flat, tree = _train(Net(form), True, **kw), _train(Net(form), False, **kw)
        assert flat.step == tree.step >= 2
        _close(flat.params, tree.params)


def test_groups_are_the_masks_values_and_the_optimizer_state_is_one_buffer_per_group():
    nitro_ipy.cache_reset()
    n = _train(Net("adamw mask by path"), True)
    assert n._layout.sizes() == {"float32:mask": (2, 32), "float32:~mask": (3, 17)}
    mu = n.opt_state[0].mu  # adam's first moment: the params' containers, a buffer at each group's first place
    assert [np.shape(x) for x in jax.tree.leaves(mu)] == [(17,), (32,)]
    assert [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(mu)[0]] == [
        "['dense']['bias']", "['dense']['kernel']"]
    m = _train(Net("multi_transform labels fn"), True)
    assert m._layout.sizes() == {"float32:fast": (2, 9), "float32:slow": (3, 40)}
    assert nitro_ipy.cache_stats().misses == 4  # grad + opt per handle: the groups add no program


def test_an_ungrouped_optimizer_keeps_one_buffer_per_dtype():
    @dataclasses.dataclass
    class Plain(Net):
        def optimizer(self):
            return optax.adamw(self.lr, weight_decay=0.1)

    n = _train(Plain(), True)
    assert not n._layout.grouped and n._layout.sizes() == {"float32": (5, 49)}
    assert [np.shape(x) for x in jax.tree.leaves(n.opt_state[0].mu)] == [(49,)]


def test_nitro_stats_shows_the_groups():
    from nitro_ipy._compiler._stats import stats_table

    nitro_ipy.cache_reset()
    _train(Net("multi_transform labels fn"), True)
    opt = [r for r in stats_table().rows if r.kind == "opt"]
    assert len(opt) == 1
    assert "gradients 49 float32 in 2 groups (float32:fast 9, float32:slow 40)" in opt[0].inputs
    # what `%nitro_stats` prints in a terminal
    assert "  opt parameter groups: 2 groups (float32:fast 9, float32:slow 40)" in repr(stats_table()).splitlines()


def test_mixed_dtypes_make_one_buffer_per_dtype_and_group():
    @dataclasses.dataclass
    class Mixed(Net):
        def init(self, rng):
            p = Net.init(self, rng)
            p["out"] = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p["out"])
            return p

        def forward(self, params, *, x):
            out = jax.tree.map(lambda a: a.astype(jnp.float32), params["out"])
            return Net.forward(self, {**params, "out": out}, x=x)

    flat, tree = _train(Mixed(), True), _train(Mixed(), False)
    assert sorted(flat._layout.groups) == ["bfloat16:mask", "bfloat16:~mask", "float32:mask", "float32:~mask"]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                                         rtol=1e-2, atol=1e-2), flat.params, tree.params)
    _close(flat.params["dense"], tree.params["dense"])


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm()(nn.relu(nn.Dense(16)(x)))
        return nn.Dense(1)(x)[..., 0]


@dataclasses.dataclass
class FlaxDecay:
    lr: Device[float] = 1e-2

    def init(self, rng):
        return _Mlp().init(rng, jnp.zeros((1, 3)))["params"]

    def forward(self, params, *, x):
        return _Mlp().apply({"params": params}, x)

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)

    def optimizer(self):
        from flax import traverse_util

        def mask(p):  # the Flax examples' way: decay every kernel, by the flattened path
            flat = traverse_util.flatten_dict(p)
            return traverse_util.unflatten_dict({k: k[-1] == "kernel" for k in flat})

        return optax.adamw(self.lr, weight_decay=0.2, mask=mask)


class _EqxMlp(eqx.Module):
    lin: eqx.nn.Linear
    norm: eqx.nn.LayerNorm
    out: eqx.nn.Linear
    act: object = eqx.field(static=True)

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.lin, self.norm = eqx.nn.Linear(3, 8, key=k1), eqx.nn.LayerNorm(8)
        self.out, self.act = eqx.nn.Linear(8, "scalar", key=k2), jax.nn.relu

    def __call__(self, x):
        return self.out(self.norm(self.act(self.lin(x))))


@dataclasses.dataclass
class EqxDecay(FlaxDecay):
    def init(self, rng):
        return _EqxMlp(rng)

    def forward(self, params, *, x):
        return jax.vmap(params)(x)

    def optimizer(self):  # an Equinox model is a tree too: its masks are trees of the module's shape
        return optax.adamw(self.lr, weight_decay=0.2, mask=lambda m: jax.tree.map(lambda x: x.ndim > 1, m))


class _NNXMlp(nnx.Module):
    def __init__(self, rngs):
        self.a, self.ln, self.b = nnx.Linear(3, 8, rngs=rngs), nnx.LayerNorm(8, rngs=rngs), nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.b(self.ln(nnx.relu(self.a(x))))[..., 0]


@dataclasses.dataclass
class NNXDecay(FlaxDecay):
    graphdef: GraphConst[object] = None

    def init(self, rng):
        return nnx.split(_NNXMlp(nnx.Rngs(rng)))[1]

    def forward(self, params, *, x):
        return nnx.merge(self.graphdef, params, copy=True)(x)

    def optimizer(self):  # an `nnx.State` of `Param`s: its masks are `nnx.State`s too
        return optax.adamw(self.lr, weight_decay=0.2, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))


def _nnx_decay():
    return NNXDecay(graphdef=nnx.split(_NNXMlp(nnx.Rngs(0)))[0])


@pytest.mark.parametrize("make", [FlaxDecay, EqxDecay, _nnx_decay], ids=["flax", "equinox", "nnx"])
def test_real_models_masks_train_the_same_as_on_the_tree(make):
    flat, tree = _train(make(), True), _train(make(), False)
    assert len(flat._layout.groups) == 2
    _close(flat.params, tree.params)


# ---------------------------------------------------------------- what cannot mean the same: refused
def test_a_mask_by_values_is_refused_at_setup_with_the_fix():
    @dataclasses.dataclass
    class ByValue(Net):
        def optimizer(self):
            return optax.adamw(self.lr, mask=lambda p: jax.tree.map(lambda x: jnp.all(x > 0), p))

    with pytest.raises(NitroValueError) as info:
        Nitro(ByValue(), data={"train": _reg()}, progress=False)
    assert str(info.value) == (
        "the optimizer of `test_a_mask_by_values_is_refused_at_setup_with_the_fix.<locals>.ByValue` has a "
        "`mask` that depends on the parameters' values (it returned a traced array at "
        "`params['dense']['bias']`); optax needs masks and labels static. Decide from each parameter's path, "
        "shape or dtype, e.g. `mask=lambda p: jax.tree_util.tree_map_with_path(lambda path, x: x.ndim > 1, p)`.")


def test_a_mask_that_does_not_fit_the_params_is_refused_with_the_fix():
    @dataclasses.dataclass
    class Misfit(Net):
        def optimizer(self):
            return optax.adamw(self.lr, mask={"dense": True, "other": False})

    with pytest.raises(NitroValueError, match=r"has a `mask` that could not be evaluated on the params tree "
                                              r"\(ValueError: .*tree_map_with_path"):
        Nitro(Misfit(), data={"train": _reg()}, progress=False)


@pytest.mark.parametrize("tx", [
    lambda: optax.chain(optax.masked(optax.adaptive_grad_clip(0.01), by_ndim), optax.sgd(1e-2)),
    lambda: optax.multi_transform({"fast": optax.lamb(1e-2), "slow": optax.sgd(1e-2)}, labels_by_path),
    lambda: optax.chain(optax.masked(optax.scale_by_lbfgs(), by_path), optax.sgd(1e-2)),
], ids=["adaptive_grad_clip", "lamb in a group", "lbfgs"])
def test_per_array_maths_inside_a_group_is_refused_at_setup(tx):
    @dataclasses.dataclass
    class PerArray(Net):
        def optimizer(self):
            return tx()

    with pytest.raises(NitroValueError, match=r"treats each parameter array by its own shape or norm .*"
                                              r"Pass `Nitro\(e, \.\.\., flat_params=False\)`"):
        Nitro(PerArray(), data={"train": _reg()}, progress=False)
    _train(PerArray(), False)  # the tree layout takes it


def test_per_array_maths_on_a_group_of_one_array_is_its_buffer_s_maths():
    # `adaptive_grad_clip` clips by each array's norm: on a group holding one array, that is the buffer's
    @dataclasses.dataclass
    class OneArray(Net):
        def optimizer(self):
            only_out = lambda p: jax.tree_util.tree_map_with_path(  # noqa: E731
                lambda path, _: jax.tree_util.keystr(path) == "['out']['kernel']", p)
            return optax.chain(optax.masked(optax.adaptive_grad_clip(0.01), only_out), optax.adam(self.lr))

    _close(_train(OneArray(), True).params, _train(OneArray(), False).params)


def test_rebuild_carries_the_groups_and_refuses_groups_that_moved(tmp_path):
    nitro_ipy.cache_reset()
    n = _train(Net("adamw mask by path"), True)
    n2 = n.rebuild()
    n2.train()
    assert nitro_ipy.cache_stats().misses == 2  # the same layout, the same programs
    m = Nitro(Net("adamw mask by path"), data={"train": _reg()}, batch_size=16, max_epochs=2, progress=False,
              resume=n2.save(tmp_path))
    assert m.step == 12 and m._layout.signature == n2._layout.signature
    jax.tree.map(np.testing.assert_array_equal, m.opt_state, n2.opt_state)
    with pytest.raises(NitroValueError, match=r"now groups the parameters differently .*"
                                              r"`Nitro\(e, \.\.\., params=n\.params\)`"):
        n2.rebuild(Net("multi_transform labels fn"))


def test_the_optimizer_program_checks_the_masks_still_mean_the_setup_s_groups():
    from nitro_ipy._experiment._groups import regrouped

    n = Nitro(Net("adamw mask by path"), data={"train": _reg()}, progress=False)
    trainable = n._model.split.trainable(n._params)
    regrouped(optax.adamw(1e-2, mask=by_path), n._layout, trainable)  # the same groups: fine
    with pytest.raises(NitroValueError, match=r"now puts the parameters in other groups than at setup"):
        regrouped(optax.adamw(1e-2, mask=by_ndim), n._layout, trainable)


def _path_aware():
    """A hand-written transformation choosing by path outside any optax mask: the flat buffers have none."""
    def update(updates, state, params=None):
        double = lambda path, g: g * (2.0 if jax.tree_util.keystr(path).endswith("['kernel']") else 1.0)  # noqa: E731
        return jax.tree_util.tree_map_with_path(double, updates), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def test_path_logic_outside_the_masks_is_refused_at_setup_with_the_fix():
    @dataclasses.dataclass
    class ByHand(Net):
        def optimizer(self):
            return optax.chain(_path_aware(), optax.adamw(self.lr, mask=by_ndim))

    with pytest.raises(NitroValueError) as info:
        Nitro(ByHand(), data={"train": _reg()}, progress=False)
    assert str(info.value) == (
        "the optimizer of `test_path_logic_outside_the_masks_is_refused_at_setup_with_the_fix.<locals>.ByHand` "
        "computes something else depending on the parameters' paths (its update traced on the params tree and "
        "on the same arrays without their paths gives different programs), beyond the masks and labels "
        "nitro_ipy lays out as parameter groups (`optax.masked`, a weight-decay `mask=`, `multi_transform` / "
        "`partition` labels, `transforms.freeze`). Express the choice as one of those, or pass "
        "`Nitro(e, ..., flat_params=False)` so it sees the params tree.")
    _train(ByHand(), False)  # the tree layout takes it


class _Schedule:
    """A schedule as an object of the user's (a class with `__call__`)."""

    def __call__(self, count):
        return 1e-2 / (1 + count)


def _hidden(how):
    """`_path_aware`'s update reached another way: jitted, through a partial, as a method of an object."""
    tx = _path_aware()
    if how == "jitted":
        return optax.GradientTransformation(tx.init, jax.jit(tx.update))
    if how == "partial":
        return optax.GradientTransformation(tx.init, functools.partial(lambda f, *a, **k: f(*a, **k), tx.update))

    class Holder:
        def update(self, updates, state, params=None):
            return tx.update(updates, state, params)

    return optax.GradientTransformation(tx.init, Holder().update)


@pytest.mark.parametrize("how", ["jitted", "partial", "method"])
def test_path_logic_reached_through_a_jit_a_partial_or_a_method_is_refused_too(how):
    @dataclasses.dataclass
    class ByHand(Net):
        def optimizer(self):
            return optax.chain(_hidden(how), optax.adamw(self.lr, mask=by_ndim))

    with pytest.raises(NitroValueError, match=r"computes something else depending on the parameters' paths"):
        Nitro(ByHand(), data={"train": _reg()}, progress=False)


def test_only_optax_code_skips_the_traced_path_check_and_anything_of_yours_takes_it():
    # The traced check costs two traces of the update over every parameter array (0.5 s a handle, and at
    # every restart, at 242 arrays): an optimizer made of optax's code alone, its masks given as values,
    # cannot choose by path outside them; a function or object of yours anywhere in it is checked.
    from nitro_ipy._experiment._groups import substituted
    from nitro_ipy._experiment._optimizer import library_only

    library = {
        "adam": optax.adam(1e-3),
        "adamw, mask as values": optax.adamw(1e-3, mask={"w": True, "b": False}),
        "adamw, callable mask substituted": substituted(optax.adamw(1e-3, mask=by_path), [[True, False]]),
        "chain, clip, optax schedule": optax.chain(optax.clip_by_global_norm(1.0),
                                                   optax.adam(optax.cosine_decay_schedule(1e-3, 100))),
        "inject_hyperparams": optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3),
        "MultiSteps": optax.MultiSteps(optax.adam(1e-3), 4),
    }
    yours = {
        "callable mask, not substituted": optax.adamw(1e-3, mask=by_path),
        "lambda schedule": optax.adam(lambda count: 1e-3),
        "schedule object": optax.adam(_Schedule()),
        "hand-written transformation": optax.chain(_path_aware(), optax.adam(1e-3)),
        **{f"update {how}": optax.chain(optax.adam(1e-3), _hidden(how)) for how in ("jitted", "partial", "method")},
    }
    assert {name: library_only(tx) for name, tx in {**library, **yours}.items()} == {
        **dict.fromkeys(library, True), **dict.fromkeys(yours, False)}


@pytest.mark.parametrize("traced", [False, True], ids=["as set up", "traced check"])
def test_no_optimizer_that_means_the_same_on_buffers_is_taken_for_path_logic(traced, monkeypatch):
    from test_models import _SAME_FLAT

    from nitro_ipy._experiment import _optimizer
    from nitro_ipy._experiment._layout import FlatLayout
    from nitro_ipy._experiment._optimizer import path_dependent

    if traced:  # the two traces themselves agree on optax's own code (not only the shortcut)
        monkeypatch.setattr(_optimizer, "library_only", lambda tx: False)
    params = Net().init(jax.random.PRNGKey(0))
    for name, make in {**_SAME_FLAT, **{f: (lambda f=f: FORMS[f](Net())) for f in FORMS}}.items():
        tx = make()
        from nitro_ipy._experiment._groups import leaf_groups

        cells, labels = leaf_groups("Net", tx, params)
        assert not path_dependent(tx, params, FlatLayout(params, labels, cells)), name
