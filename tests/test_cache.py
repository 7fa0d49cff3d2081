"""The module-level compile cache: what moves the key, exact counts, miss explanations, poisoning."""

import dataclasses
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import cpu_only
import nitro_ipy
from nitro_ipy import CacheStats, Device, GraphConst, Host, Nitro
from nitro_ipy._base import _html, _report
from nitro_ipy._compiler import _cache, _compile, _explain

import _experiments  # the tiny regression most tests train, and its data
from _experiments import data as _split


DATA = {"train": _split(64)}  # two steps per epoch at batch_size=32


@dataclasses.dataclass
class Reg(_experiments.Reg):
    """The tiny regression, wider, with a smaller step and init, and a Host field."""

    hidden: GraphConst[int] = 16
    lr: Device[float] = 1e-3
    seed_note: Host[int] = 0
    notes: str = ""

    def init(self, rng):
        k1, k2 = jax.random.split(rng)
        return {
            "w1": jax.random.normal(k1, (4, self.hidden)) * 0.1,
            "w2": jax.random.normal(k2, (self.hidden,)) * 0.1,
        }


def _train(e, batch_size=32, data=DATA, **kw):
    n = Nitro(e, data=data, batch_size=batch_size, progress=False, **kw)
    n.train()
    return n


def _entries(kind):
    return [e for e in _cache.live_entries() if e.kind == kind]


# ---------------------------------------------------------------- stats


def test_cache_stats_is_a_namedtuple():
    stats = nitro_ipy.cache_stats()
    assert isinstance(stats, CacheStats) and isinstance(stats, tuple)
    assert CacheStats._fields == ("hits", "misses", "entries")
    assert stats == CacheStats(hits=0, misses=0, entries=0)


def test_construction_compiles_nothing():
    Nitro(Reg(), data=DATA, batch_size=32, progress=False)
    assert nitro_ipy.cache_stats() == (0, 0, 0)


def test_train_only_run_compiles_gradient_and_optimizer():
    _train(Reg())
    # 2 steps x 2 programs = 4 uses: the first two compile, the other two are hits.
    assert nitro_ipy.cache_stats() == CacheStats(hits=2, misses=2, entries=2)
    assert sorted(e.kind for e in _cache.live_entries()) == ["grad", "opt"]


def test_misses_do_not_grow_with_steps_or_epochs():
    n = _train(Reg(), batch_size=8, max_epochs=3)  # 8 steps per epoch, 24 steps
    s = nitro_ipy.cache_stats()
    assert (s.misses, s.entries) == (2, 2)
    assert s.hits + s.misses == 2 * 24
    n.train()
    s = nitro_ipy.cache_stats()
    assert (s.misses, s.entries) == (2, 2)
    assert s.hits + s.misses == 2 * 48


def test_cache_reset_zeroes_and_empties():
    _train(Reg())
    assert nitro_ipy.cache_stats() != (0, 0, 0)
    nitro_ipy.cache_reset()
    assert nitro_ipy.cache_stats() == CacheStats(0, 0, 0)
    assert _cache.live_entries() == [] and _cache.poisoned_entries() == []
    _train(Reg())  # and the next run compiles again
    assert nitro_ipy.cache_stats() == CacheStats(2, 2, 2)


# ---------------------------------------------------------------- what moves the key


def test_graphconst_change_misses():
    _train(Reg(hidden=16))
    _train(Reg(hidden=8))
    assert nitro_ipy.cache_stats() == CacheStats(hits=4, misses=4, entries=4)


def test_device_value_change_hits():
    _train(Reg(lr=1e-3))
    _train(Reg(lr=0.5))
    _train(Reg(lr=np.float32(0.01)))
    assert nitro_ipy.cache_stats() == CacheStats(hits=2 + 4 + 4, misses=2, entries=2)


def test_host_change_hits():
    _train(Reg())
    _train(Reg(notes="a different note", seed_note=7))
    assert nitro_ipy.cache_stats() == CacheStats(hits=6, misses=2, entries=2)


def test_equal_graphconst_built_again_hits():
    _train(Reg(hidden=16))
    _train(Reg(hidden=int("16")))
    assert nitro_ipy.cache_stats() == CacheStats(hits=6, misses=2, entries=2)


def test_new_batch_size_misses_gradient_only():
    _train(Reg(), batch_size=32)
    _train(Reg(), batch_size=16)  # 4 steps: grad recompiles, opt (no batch argument) is reused
    assert nitro_ipy.cache_stats() == CacheStats(hits=2 + 7, misses=3, entries=3)
    assert len(_entries("grad")) == 2 and len(_entries("opt")) == 1


def test_validation_adds_one_program():
    data = {"train": _split(64), "valid": _split(40, seed=1)}  # ragged: 40 = 32 + 8
    _train(Reg(), data=data)
    s = nitro_ipy.cache_stats()
    assert (s.misses, s.entries) == (3, 3)
    assert sorted(e.kind for e in _cache.live_entries()) == ["eval", "grad", "opt"]


def test_two_experiment_types_never_share_programs():
    @dataclasses.dataclass
    class Twin(Reg):
        pass

    _train(Reg())
    _train(Twin())
    assert nitro_ipy.cache_stats() == CacheStats(hits=4, misses=4, entries=4)


# ---------------------------------------------------------------- miss explanations


def test_first_compile_has_no_explanation():
    _train(Reg())
    assert [e.why for e in _cache.live_entries()] == [None, None]


def test_graphconst_miss_names_the_field():
    _train(Reg(hidden=16))
    before = set(map(id, _cache.live_entries()))
    _train(Reg(hidden=8))
    new = [e for e in _cache.live_entries() if id(e) not in before]
    assert sorted(e.kind for e in new) == ["grad", "opt"]
    grad = next(e for e in new if e.kind == "grad")
    assert grad.why == (
        "GraphConst `hidden`: 16 -> 8; argument `params['w1']` shape: [4, 16] -> [4, 8]; "
        "argument `params['w2']` shape: [16] -> [8]"
    )
    opt = next(e for e in new if e.kind == "opt")
    assert opt.why.startswith("GraphConst `hidden`: 16 -> 8; ")


def test_batch_size_miss_names_the_argument_and_shapes():
    _train(Reg(), batch_size=32)
    before = set(map(id, _cache.live_entries()))
    _train(Reg(), batch_size=16)
    (grad,) = [e for e in _cache.live_entries() if id(e) not in before]
    assert grad.kind == "grad"
    assert grad.why == (
        "argument `batch['x']` shape: [32, 4] -> [16, 4]; argument `batch['y']` shape: [32] -> [16]"
    )


def test_compile_line_carries_the_explanation(capsys):
    _train(Reg(hidden=16))
    capsys.readouterr()
    _train(Reg(hidden=8))
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("nitro_ipy: compiled grad")]
    assert len(lines) == 1
    # The line names the cause and counts what moved with it; the entry keeps every change.
    assert lines[0].endswith("(GraphConst `hidden`: 16 -> 8, and 2 argument shapes with it)")
    grad = [e for e in _cache.live_entries() if e.kind == "grad"][-1]
    assert grad.why.causes == ("GraphConst `hidden`: 16 -> 8",)
    assert grad.why.follows == ("argument `params['w1']` shape: [4, 16] -> [4, 8]",
                                "argument `params['w2']` shape: [16] -> [8]")
    msg = _report.message("compile", entry=grad)
    assert msg.more == (_report.Fold("all 3 changes", (*grad.why.causes, *grad.why.follows)),)
    # In HTML the full list is one click away, in a <details> under the line.
    html = _html.message_html(msg)
    assert html.count("<details") == 1 and "<summary" in html and "all 3 changes</summary>" in html
    assert "argument <code" in html and "params[&#x27;w2&#x27;]</code> shape: [16] -&gt; [8]" in html


def test_explanation_summaries_name_the_cause_and_count_the_rest():
    E = _report.Explanation
    shapes = [f"argument `params['w{i}']` shape: [32] -> [8192]" for i in range(6)]
    why = E(["GraphConst `hidden`: 32 -> 8192"], shapes)
    assert why == "; ".join(["GraphConst `hidden`: 32 -> 8192", *shapes])  # still the full text as a str
    assert why.summary() == "GraphConst `hidden`: 32 -> 8192, and 6 argument shapes with it"
    two = E(["GraphConst `hidden`: 32 -> 64", "hook `loss` was redefined"], shapes[:1] + ["argument `lr` dtype: float32 -> int32"])
    assert two.summary() == "GraphConst `hidden`: 32 -> 64; hook `loss` was redefined, and 2 argument changes with them"
    batch = E([], [f"argument `batch['x{i}']` shape: [32] -> [16]" for i in range(7)])
    assert batch.summary() == "; ".join(batch.follows[:3]) + "; and 4 more argument changes"
    few = E([], batch.follows[:2])
    assert few.summary() == str(few) and few.folded() == ()
    assert _report.why_summary("recompiling against edited code: m.f") == "recompiling against edited code: m.f"
    assert pickle.loads(pickle.dumps(why)).summary() == why.summary()


def test_names_beyond_a_few_are_counted_and_kept_whole():
    names = tuple(f"m.f{i}" for i in range(7))
    msg = _report.message("stale-cache", count=2, names=names, kinds=("grad", "eval"))
    assert "redefined: m.f0, m.f1, m.f2 and 4 more." in msg.text
    assert msg.more == (_report.Fold("all 7 names", names),)
    assert _html.message_html(msg).count("<div><code") == 0 and "m.f6" in _html.message_html(msg)
    short = _report.message("stale-cache", count=1, names=names[:4], kinds=("grad",))
    assert "redefined: m.f0, m.f1, m.f2, m.f3." in short.text and short.more == ()


def _sig(path, shape, dtype="float32", weak=False, sharding=None):
    return _cache.ArgSig(path, shape, dtype, weak, sharding)


def test_diff_args_formats_shape_dtype_and_weak_type():
    old = ("tree", (_sig("batch['x']", (32, 4)), _sig("lr", (), "float32", True)))
    new = ("tree", (_sig("batch['x']", (32, 4), "int32"), _sig("lr", (), "float32", False)))
    assert _explain.diff_args(old, new) == [
        "argument `batch['x']` dtype: float32 -> int32",
        "argument `lr` weak_type: True -> False",
    ]
    assert _explain.diff_args(old, ("other tree", old[1])) == ["argument structure: tree -> other tree"]


def test_arg_signature_labels_positional_arguments():
    tree, sigs = _cache.arg_signature(({"w": np.zeros((2, 3), np.float32)}, {"x": np.zeros(4, np.int32)}),
                                      ("params", "batch"))
    assert [(s.path, s.shape, s.dtype, s.weak) for s in sigs] == [
        ("params['w']", (2, 3), "float32", False),
        ("batch['x']", (4,), "int32", False),
    ]


def _reference_signature(args, names=()):
    """`arg_signature` worked out leaf by leaf with nothing remembered: what its memos must agree with."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(args)
    sigs = []
    for path, leaf in leaves:
        if names and path and isinstance(path[0], jax.tree_util.SequenceKey) and path[0].idx < len(names):
            label = names[path[0].idx] + jax.tree_util.keystr(path[1:])
        else:
            label = jax.tree_util.keystr(path)
        sharding = getattr(leaf, "sharding", None)
        sharding = None if sharding is None or len(sharding.device_set) == 1 else _cache.sharding_signature(sharding)
        sigs.append(_cache.ArgSig(label, tuple(np.shape(leaf)), str(getattr(leaf, "dtype", None) or np.result_type(leaf)),
                                  bool(getattr(leaf, "weak_type", False)), sharding))
    return (str(treedef), tuple(sigs))


class _Unhashable:
    """A pytree node whose aux data cannot be hashed (a list), as some user containers have."""

    def __init__(self, children, meta):
        self.children, self.meta = children, meta


jax.tree_util.register_pytree_node(_Unhashable, lambda u: (u.children, u.meta), lambda meta, ch: _Unhashable(ch, meta))


def _signature_corpus():
    import equinox as eqx
    from flax import linen

    mlp = eqx.nn.MLP(3, 2, 4, 2, key=jax.random.PRNGKey(0))
    flax_params = linen.Dense(3).init(jax.random.PRNGKey(1), jnp.zeros((1, 2)))
    return [
        (({"w": np.zeros((2, 3), np.float32)}, {"x": np.zeros(4, np.int32)}), ("params", "batch")),
        (({"w": jnp.zeros((2, 3))}, {"w": jnp.zeros((3, 2))}), ("params", "batch")),  # same leaf names, other shapes
        (([jnp.zeros(2), jnp.ones((2, 2), jnp.bfloat16)], None, 1.5, 3, np.float64(2.0)), ("params", "state", "lr")),
        ((eqx.filter(mlp, eqx.is_array), jnp.zeros((5, 3))), ("model", "x", "more names than arguments")),
        ((flax_params, {"x": jnp.zeros((4, 2), jnp.float16)}, jax.random.key(0)), ()),
        ((_Unhashable([jnp.zeros(2), jnp.zeros((), jnp.int32)], ["a", "b"]),), ("params",)),
        ((jnp.asarray(1.0), jnp.asarray(1.0, jnp.float32)), ("weak", "strong")),
    ]


def test_arg_signature_agrees_with_the_leaf_by_leaf_reference_every_time():
    # Each case twice (the second answer comes from the memos), and the corpus twice in another order:
    # a structure seen before under other names, or names under another structure, is not mixed up.
    corpus = _signature_corpus()
    for args, names in corpus + corpus[::-1] + corpus:
        assert _cache.arg_signature(args, names) == _reference_signature(args, names)
        assert _cache.arg_signature(args) == _reference_signature(args)


def test_arg_signature_memos_stay_bounded_under_a_moving_structure():
    for i in range(3 * _cache._MEMO_LIMIT):  # a structure that moves every call, as in a recompile loop
        args = ({f"w{i}": np.zeros(2, np.float32)},)
        assert _cache.arg_signature(args, ("params",))[1][0].path == f"params['w{i}']"
    assert len(_cache._structures) <= _cache._MEMO_LIMIT


def test_explanations_only_compare_the_same_kind_and_owner():
    @dataclasses.dataclass
    class Other(Reg):
        pass

    _train(Reg())
    _train(Other(hidden=8))  # another owner: no similar entry to compare with
    other = [e for e in _cache.live_entries() if e.key.owner.endswith("Other")]
    assert len(other) == 2 and [e.why for e in other] == [None, None]


# ---------------------------------------------------------------- poisoning


def test_poisoned_entry_is_never_served_again(capsys):
    n = _train(Reg())
    (grad,) = _entries("grad")
    _cache.poison(grad, ["__main__.f"])
    assert grad.poisoned and grad.drifted == ("__main__.f",)
    assert _cache.poisoned_entries() == [grad]
    assert grad not in _cache.live_entries()
    assert nitro_ipy.cache_stats() == CacheStats(hits=2, misses=2, entries=1)

    _train(Reg())  # a new handle: the grad program recompiles, the optimizer is still served
    assert nitro_ipy.cache_stats() == CacheStats(hits=2 + 3, misses=3, entries=2)
    (fresh,) = _entries("grad")
    assert fresh is not grad and not fresh.poisoned
    assert fresh.why == "recompiling against edited code: __main__.f"
    assert _cache.poisoned_entries() == [grad]

    # The old handle keeps running the program it holds (fixed point) and says so.
    capsys.readouterr()
    n.train()
    out = capsys.readouterr().out
    assert "! this handle's compiled programs had dependency methods redefined: __main__.f (grad)" in out
    assert nitro_ipy.cache_stats().misses == 3


def test_poison_is_idempotent():
    _train(Reg())
    (grad,) = _entries("grad")
    _cache.poison(grad, ["__main__.f"])
    _cache.poison(grad, ["__main__.g"])
    assert _cache.poisoned_entries() == [grad]
    assert grad.drifted == ("__main__.f",)


def test_reset_forgets_poisoned_entries():
    _train(Reg())
    _cache.poison(_entries("grad")[0], ["__main__.f"])
    nitro_ipy.cache_reset()
    assert _cache.poisoned_entries() == []
    _train(Reg())
    assert [e.why for e in _entries("grad")] == [None]


class _Spy:
    """A real `Lowered`, with the compiler options of each `compile` call written down."""

    def __init__(self, lowered):
        self.lowered, self.calls = lowered, []

    def compile(self, compiler_options=None):
        self.calls.append(dict(compiler_options or {}))
        return self.lowered.compile(compiler_options=compiler_options)


@cpu_only
def test_compile_leaves_out_only_the_options_this_xla_does_not_know():
    spy = _Spy(jax.jit(lambda x: x * 2.0).lower(jnp.ones(3)))
    options = {"nitro_no_such_option": True, "xla_backend_optimization_level": 1}
    compiled, used = _compile.xla_compile(spy, dict(options))
    np.testing.assert_allclose(compiled(jnp.ones(3)), 2.0)
    assert spy.calls == [options, {"xla_backend_optimization_level": 1}]
    assert used == {"xla_backend_optimization_level": 1}


# ---------------------------------------------------------------- compiler options per program

LEVEL_2 = {"xla_backend_optimization_level": 2}
NO_YNN = {**LEVEL_2, "xla_cpu_experimental_ynn_fusion_type": ""}


def _jaxpr(fn, *shapes):
    return jax.make_jaxpr(fn)(*(jnp.ones(s, jnp.float32) for s in shapes))


@cpu_only
def test_a_program_whose_multiplies_are_all_narrow_compiles_without_ynnpack():
    # a wide batch is fine: each multiply has at most one dimension above NARROW_DOT (64)
    narrow = _jaxpr(lambda x, w: jnp.tanh(x @ w) @ w.T, (512, 64), (64, 64))
    assert _compile.program_options(narrow) == NO_YNN
    assert _compile.program_options(narrow, {"xla_backend_optimization_level": 1}) == {
        **NO_YNN, "xla_backend_optimization_level": 1}
    mine = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
    assert _compile.program_options(narrow, mine) == {**LEVEL_2, **mine}  # options given explicitly win


@cpu_only
def test_one_wide_multiply_anywhere_keeps_ynnpack():
    wide = lambda x, w: x @ w  # [8, 128] x [128, 128]: rows 8, columns 128, contracted 128
    assert _compile.program_options(_jaxpr(wide, (8, 128), (128, 128))) == LEVEL_2
    assert _compile.program_options(_jaxpr(wide, (8, 128), (128, 64))) == NO_YNN  # only 128 is above 64

    def nested(w):  # the wide multiply sits in a jit inside a scan inside a grad
        body = lambda c, _: (c + jax.jit(wide)(jnp.ones((8, 128)), w).sum(), None)
        return jax.lax.scan(body, 0.0, None, length=2)[0]

    assert _compile.program_options(_jaxpr(jax.grad(nested), (128, 128))) == LEVEL_2
    assert _compile.program_options(_jaxpr(jax.grad(nested), (128, 32))) == NO_YNN
    assert _compile.program_options(_jaxpr(lambda x: jnp.tanh(x) * 2.0, (256, 256))) == LEVEL_2  # no multiply


@cpu_only
def test_a_program_with_a_convolution_compiles_with_the_classic_emitters_and_keeps_ynnpack():
    conv = lambda x, k: jax.lax.conv_general_dilated(x, k, (1, 1), "SAME")
    classic = {"xla_cpu_use_fusion_emitters": False}
    assert _compile.program_options(_jaxpr(conv, (8, 1, 8, 8), (4, 1, 3, 3))) == classic
    # narrow multiplies beside it do not turn YNNPACK off: it runs the convolution too
    head = lambda x, k, w: conv(x, k).reshape((8, -1)) @ w
    assert _compile.program_options(_jaxpr(head, (8, 1, 8, 8), (4, 1, 3, 3), (256, 10))) == classic
    assert _compile.program_options(_jaxpr(jax.grad(lambda k, x: conv(x, k).sum()), (4, 1, 3, 3), (8, 1, 8, 8))) == classic
    mine = {"xla_cpu_use_fusion_emitters": True}
    assert _compile.program_options(_jaxpr(conv, (8, 1, 8, 8), (4, 1, 3, 3)), mine) == mine  # explicit wins


@cpu_only
def test_handle_programs_record_the_options_they_were_compiled_with():
    n = _train(Reg())
    grad, opt = _entries("grad")[0], _entries("opt")[0]
    assert grad.compiler_options == NO_YNN
    assert opt.compiler_options.get("xla_backend_optimization_level") == 1
    assert "xla_cpu_experimental_ynn_fusion_type" not in opt.compiler_options  # no multiply in it
    # the option takes effect: this XLA uses YNNPACK for the same program compiled by default, ours does not
    fn = jax.jit(lambda p, x: Reg().forward(p, x=x))
    default = fn.lower(n.params, DATA["train"]["x"]).compile().as_text()
    ours = fn.lower(n.params, DATA["train"]["x"]).compile(compiler_options=grad.compiler_options).as_text()
    assert "ynn" not in ours
    if "ynn" not in default:
        pytest.skip(f"jax {jax.__version__}: XLA does not use YNNPACK for multiplies here")
