"""Field markers, the compile view, `graphconst_field_hash` and the GraphConst hashability check."""

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _modules import import_source, json_in_child

import nitro_ipy
from nitro_ipy import (
    Device,
    GraphConst,
    GraphConstHashError,
    Host,
    HostFieldAccessError,
    Nitro,
    NitroError,
    NitroTypeError,
    assert_graphconst_hashable,
    compile_view,
    device_fields,
    graphconst_field_hash,
    graphconst_fields,
    host_fields,
)


@dataclasses.dataclass
class Marked:
    hidden: GraphConst[int] = 3
    act: GraphConst[str] = "tanh"
    lr: Device[float] = 0.5
    decay: Device[float] = 0.9
    seed: Host[int] = 0
    notes: str = "n"
    log: list = dataclasses.field(default_factory=list)

    SCALE = 7  # a class attribute, not a field

    def double(self):
        return self.hidden * 2

    def me(self):
        return self

    def scaled_lr(self):
        return self.lr * self.SCALE

    @staticmethod
    def plus_one(a):
        return a + 1

    @classmethod
    def which(cls):
        return cls

    @property
    def wide(self):
        return self.hidden + 100


# ---------------------------------------------------------------- markers


def test_field_name_tuples_on_class():
    assert graphconst_fields(Marked) == ("hidden", "act")
    assert device_fields(Marked) == ("lr", "decay")
    assert host_fields(Marked) == ("seed", "notes", "log")


def test_field_name_tuples_on_instance():
    e = Marked(hidden=5, notes="x")
    assert graphconst_fields(e) == ("hidden", "act")
    assert device_fields(e) == ("lr", "decay")
    assert host_fields(e) == ("seed", "notes", "log")


def test_unmarked_fields_are_host():
    @dataclasses.dataclass
    class Plain:
        a: int = 1
        b: float = 2.0
        c: Optional[str] = None

    assert host_fields(Plain) == ("a", "b", "c")
    assert graphconst_fields(Plain) == ()
    assert device_fields(Plain) == ()


def test_markers_accepted_through_the_package_attribute():
    @dataclasses.dataclass
    class Qualified:
        a: nitro_ipy.GraphConst[int] = 1
        b: nitro_ipy.Device[float] = 1.0
        c: nitro_ipy.Host[int] = 0

    assert (graphconst_fields(Qualified), device_fields(Qualified), host_fields(Qualified)) == (
        ("a",), ("b",), ("c",)
    )


def test_marker_around_a_generic_type():
    @dataclasses.dataclass
    class Generic:
        widths: GraphConst[tuple[int, ...]] = (4, 4)
        maybe: GraphConst[Optional[int]] = None

    assert graphconst_fields(Generic) == ("widths", "maybe")


def test_string_annotations_from_future_import(tmp_path, monkeypatch):
    mod = import_source(
        tmp_path,
        monkeypatch,
        "nitro_future_fields",
        """
        from __future__ import annotations

        import dataclasses
        from typing import Optional

        import nitro_ipy
        from nitro_ipy import Device, GraphConst, Host

        @dataclasses.dataclass
        class Fut:
            hidden: GraphConst[int] = 8
            lr: Device[float] = 0.1
            seed: Host[int] = 0
            notes: str = ""
            width: nitro_ipy.GraphConst[Optional[int]] = None
        """,
    )
    assert isinstance(dataclasses.fields(mod.Fut)[0].type, str)  # the annotations really are strings
    assert graphconst_fields(mod.Fut) == ("hidden", "width")
    assert device_fields(mod.Fut) == ("lr",)
    assert host_fields(mod.Fut) == ("seed", "notes")


def test_string_annotations_with_an_unresolvable_name(tmp_path, monkeypatch):
    # get_type_hints fails on `Undefined`; the markers are still read from the annotation strings.
    mod = import_source(
        tmp_path,
        monkeypatch,
        "nitro_future_unresolved",
        """
        from __future__ import annotations

        import dataclasses
        from nitro_ipy import Device, GraphConst

        @dataclasses.dataclass
        class Fut:
            hidden: GraphConst[int] = 8
            model: GraphConst[Undefined] = None
            lr: Device[float] = 0.1
            other: Undefined = None
        """,
    )
    assert graphconst_fields(mod.Fut) == ("hidden", "model")
    assert device_fields(mod.Fut) == ("lr",)
    assert host_fields(mod.Fut) == ("other",)


def test_field_marked_twice_is_refused_naming_the_field():
    @dataclasses.dataclass
    class Twice:
        ok: GraphConst[int] = 1
        x: GraphConst[Device[int]] = 1

    with pytest.raises(NitroTypeError) as info:
        graphconst_fields(Twice)
    msg = str(info.value)
    assert f"field `{Twice.__qualname__}.x` is marked both" in msg
    assert "marked both Device and GraphConst" in msg
    assert isinstance(info.value, TypeError)


def test_marker_nested_inside_another_type_is_refused():
    @dataclasses.dataclass
    class Nested:
        x: Optional[GraphConst[int]] = 1

    with pytest.raises(NitroTypeError) as info:
        graphconst_fields(Nested)
    assert f"`{Nested.__qualname__}.x`" in str(info.value)
    assert "markers go outermost" in str(info.value)


def test_non_dataclass_experiment_is_refused_with_the_fix():
    class NotADataclass:
        hidden: GraphConst[int] = 3

    for arg in (NotADataclass, NotADataclass()):
        with pytest.raises(NitroTypeError) as info:
            graphconst_fields(arg)
        msg = str(info.value)
        assert f"`{__name__}.{NotADataclass.__qualname__}`" in msg
        assert "`@dataclasses.dataclass`" in msg


def test_non_dataclass_refused_by_the_handle():
    class Loose:
        def init(self, rng):
            return {}

    with pytest.raises(NitroTypeError, match="an experiment must be a dataclass; got `.*Loose`"):
        Nitro(Loose(), progress=False)


# ---------------------------------------------------------------- the compile view


def test_compile_view_reads_graphconst_and_device_values():
    v = compile_view(Marked(hidden=4, lr=0.25))
    assert (v.hidden, v.act, v.lr, v.decay) == (4, "tanh", 0.25, 0.9)


def test_compile_view_device_values_replace_the_fields():
    v = compile_view(Marked(), device_values={"lr": 1.5, "decay": 0.5})
    assert (v.lr, v.decay, v.hidden) == (1.5, 0.5, 3)


def test_compile_view_methods_are_bound_to_the_view():
    v = compile_view(Marked(hidden=4))
    assert v.double() == 8
    assert v.me() is v
    assert v.scaled_lr() == 0.5 * 7
    assert v.plus_one(1) == 2
    assert v.which() is Marked
    assert v.wide == 104


def test_compile_view_reads_class_attributes():
    assert compile_view(Marked()).SCALE == 7


def test_compile_view_binds_methods_of_the_class_it_is_given():
    @dataclasses.dataclass
    class Edited(Marked):
        def double(self):
            return self.hidden * 3

    v = compile_view(Marked(hidden=2), cls=Edited)
    assert v.double() == 6


@pytest.mark.parametrize("name", ["seed", "notes", "log"])
def test_compile_view_host_field_read_names_field_and_both_fixes(name):
    v = compile_view(Marked())
    with pytest.raises(HostFieldAccessError) as info:
        getattr(v, name)
    msg = str(info.value)
    assert msg.startswith(f"`Marked.{name}` is a Host field, and compiled code never sees Host fields.")
    assert "mark it `GraphConst[...]`" in msg
    assert "mark it `Device[...]`" in msg
    assert isinstance(info.value, AttributeError) and isinstance(info.value, NitroError)


def test_compile_view_missing_attribute_and_read_only():
    v = compile_view(Marked())
    with pytest.raises(AttributeError, match="`Marked` has no attribute `nope`") as info:
        v.nope
    assert not isinstance(info.value, HostFieldAccessError)
    with pytest.raises(AttributeError, match="the compile view is read-only; cannot set `hidden`"):
        v.hidden = 5


def test_traced_hook_reading_a_host_field_fails_at_compile():
    @dataclasses.dataclass
    class ReadsHost:
        scale: float = 2.0  # Host: the forward below must not see it

        def init(self, rng):
            return {"w": jnp.ones((4,))}

        def forward(self, params, *, x):
            return x @ params["w"] * self.scale

        def loss(self, outputs, *, y):
            return jnp.mean((outputs - y) ** 2)

    data = {"train": {"x": np.ones((8, 4), np.float32), "y": np.ones((8,), np.float32)}}
    n = Nitro(ReadsHost(), data=data, batch_size=4, progress=False)
    with pytest.raises(HostFieldAccessError) as info:
        n.train()
    assert str(info.value).startswith(f"`{ReadsHost.__qualname__}.scale` is a Host field")


# ---------------------------------------------------------------- graphconst_field_hash


def test_graphconst_hash_ignores_device_and_host_fields():
    base = graphconst_field_hash(Marked())
    assert graphconst_field_hash(Marked()) == base
    assert graphconst_field_hash(Marked(lr=9.0, decay=0.1)) == base
    assert graphconst_field_hash(Marked(seed=3, notes="other", log=[1, 2])) == base
    # A Device field changing type (as the handle converts it to an array) moves nothing.
    assert graphconst_field_hash(Marked(lr=np.float32(0.5))) == base
    assert graphconst_field_hash(Marked(lr=jnp.asarray(0.5))) == base


def test_graphconst_hash_moves_with_each_graphconst_field():
    base = graphconst_field_hash(Marked())
    assert graphconst_field_hash(Marked(hidden=4)) != base
    assert graphconst_field_hash(Marked(act="relu")) != base
    assert graphconst_field_hash(Marked(hidden=4)) != graphconst_field_hash(Marked(act="relu"))


def test_graphconst_hash_is_seeded_by_the_qualified_type_name():
    @dataclasses.dataclass
    class A:
        hidden: GraphConst[int] = 3

    @dataclasses.dataclass
    class B:
        hidden: GraphConst[int] = 3

    assert nitro_ipy.fingerprint(A()) != nitro_ipy.fingerprint(B())  # sanity: the classes differ by name only
    assert graphconst_field_hash(A()) != graphconst_field_hash(B())
    assert graphconst_field_hash(A()) == graphconst_field_hash(A())


def test_graphconst_hash_with_no_graphconst_fields():
    @dataclasses.dataclass
    class Empty:
        lr: Device[float] = 1.0

    assert graphconst_field_hash(Empty()) == graphconst_field_hash(Empty(lr=2.0))
    assert isinstance(graphconst_field_hash(Empty()), str) and len(graphconst_field_hash(Empty())) == 32


def test_graphconst_prints_fingerprint_each_value_once(monkeypatch):
    from nitro_ipy._experiment import _fields

    seen = []
    real = _fields.fingerprint_with_callables
    monkeypatch.setattr(_fields, "fingerprint_with_callables", lambda v, p: seen.append(p) or real(v, p))
    prints = _fields.graphconst_prints(Marked())
    assert seen == list(graphconst_fields(Marked()))  # one content pass per value, in field order
    assert prints.hash == graphconst_field_hash(Marked())
    assert prints.values == {n: getattr(Marked(), n) for n in graphconst_fields(Marked())}
    assert prints.info == {
        n: (nitro_ipy.fingerprint(v, n), repr(v)) for n, v in prints.values.items()
    }


_EXPERIMENT_MODULE = """
import dataclasses
from nitro_ipy import Device, GraphConst

@dataclasses.dataclass(frozen=True)
class Inner:
    width: int = 3
    names: frozenset = frozenset({"alpha", "beta", "gamma", "delta"})

@dataclasses.dataclass
class Exp:
    hidden: GraphConst[int] = 16
    tag: GraphConst[str] = "experiment"
    inner: GraphConst[Inner] = Inner()
    vocab: GraphConst[dict] = dataclasses.field(default_factory=lambda: {"b": 2, "a": 1, "c": 3})
    lr: Device[float] = 1e-3
"""


def test_graphconst_hash_is_stable_across_processes(tmp_path, monkeypatch):
    mod = import_source(tmp_path, monkeypatch, "nitro_gc_cross", _EXPERIMENT_MODULE)
    here = [graphconst_field_hash(mod.Exp()), graphconst_field_hash(mod.Exp(hidden=8))]
    code = (
        "import json, nitro_ipy, nitro_gc_cross as m; "
        "print(json.dumps([nitro_ipy.graphconst_field_hash(m.Exp()), "
        "nitro_ipy.graphconst_field_hash(m.Exp(hidden=8))]))"
    )
    for seed in ("1", "2", "random"):
        assert json_in_child(code, tmp_path, seed) == here
    assert here[0] != here[1]


# ---------------------------------------------------------------- hashability


class Tokenizer:
    """A plain class: no content equality, hashes by identity."""

    def __init__(self, vocab=10):
        self.vocab = vocab


@dataclasses.dataclass(frozen=True)
class TokCfg:
    width: int = 3
    tokenizer: Tokenizer = dataclasses.field(default_factory=Tokenizer)


@dataclasses.dataclass
class WithTokenizer:
    cfg: GraphConst[TokCfg] = dataclasses.field(default_factory=TokCfg)
    lr: Device[float] = 1e-3

    def init(self, rng):
        return {"w": jnp.zeros((4,))}

    def forward(self, params, *, x):
        return x @ params["w"]

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)


def _assert_tokenizer_refusal(err):
    msg = str(err)
    assert isinstance(err, GraphConstHashError)
    assert isinstance(err, TypeError)
    assert isinstance(err, NitroTypeError)
    assert "GraphConst field `cfg`" in msg
    assert "`cfg.tokenizer`: Tokenizer hashes by identity" in msg
    assert "frozen dataclass (`@dataclasses.dataclass(frozen=True)`)" in msg
    assert "split it into flat GraphConst fields" in msg
    assert "mark it `Host[...]`" in msg


def test_unhashable_graphconst_refused_naming_field_and_path():
    with pytest.raises(GraphConstHashError) as info:
        assert_graphconst_hashable(WithTokenizer())
    _assert_tokenizer_refusal(info.value)


def test_unhashable_graphconst_refused_at_handle_setup():
    data = {"train": {"x": np.ones((8, 4), np.float32), "y": np.ones((8,), np.float32)}}
    with pytest.raises(TypeError) as info:
        Nitro(WithTokenizer(), data=data, batch_size=4, progress=False)
    _assert_tokenizer_refusal(info.value)
    assert nitro_ipy.cache_stats() == (0, 0, 0)


def test_unhashable_value_deep_inside_containers_names_the_path():
    @dataclasses.dataclass
    class Deep:
        layers: GraphConst[list] = dataclasses.field(default_factory=lambda: [{"tok": (1, Tokenizer())}])

    with pytest.raises(GraphConstHashError) as info:
        assert_graphconst_hashable(Deep())
    assert "`layers[0]['tok'][1]`: Tokenizer hashes by identity" in str(info.value)


def test_graphconst_equal_only_by_identity_is_refused():
    @dataclasses.dataclass(eq=False)
    class IdentityEq:
        width: int = 3

    @dataclasses.dataclass
    class E:
        cfg: GraphConst[IdentityEq] = dataclasses.field(default_factory=IdentityEq)

    with pytest.raises(GraphConstHashError) as info:
        assert_graphconst_hashable(E())
    msg = str(info.value)
    assert f"GraphConst field `cfg` ({IdentityEq.__qualname__}) does not compare equal to its deepcopy" in msg
    assert "frozen dataclass" in msg


def test_content_hashable_graphconst_values_pass():
    import optax

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        widths: tuple = (4, 4)
        table: np.ndarray = dataclasses.field(default_factory=lambda: np.arange(3))

    @dataclasses.dataclass
    class Fine:
        cfg: GraphConst[Cfg] = dataclasses.field(default_factory=Cfg)
        tx: GraphConst[object] = dataclasses.field(default_factory=lambda: optax.adam(1e-3))
        act: GraphConst[object] = jax.nn.gelu  # a plain function (relu/tanh are jitted: see below)
        dtype: GraphConst[object] = jnp.float32
        table: GraphConst[object] = dataclasses.field(default_factory=lambda: jnp.arange(3.0))
        host_tok: Tokenizer = dataclasses.field(default_factory=Tokenizer)  # Host: never checked

    assert assert_graphconst_hashable(Fine()) is None


@jax.jit
def _jitted_activation(x):
    return x * 2


@pytest.mark.parametrize("act", [jax.nn.relu, jnp.tanh, jax.nn.silu, _jitted_activation],
                         ids=["relu", "tanh", "silu", "user_jit"])
def test_jitted_activation_is_a_legal_graphconst(act):
    nitro_ipy.fingerprint(act)  # the value itself fingerprints fine
    chosen = act

    @dataclasses.dataclass
    class WithAct:
        act: GraphConst[object] = chosen

    assert assert_graphconst_hashable(WithAct()) is None


def _scaled(x, k=1.0):
    return x * k


def test_partial_is_a_legal_graphconst():
    @dataclasses.dataclass
    class WithPartial:
        act: GraphConst[object] = functools.partial(_scaled, k=0.5)

    assert assert_graphconst_hashable(WithPartial()) is None


# ---------------------------------------------------------------- Device values at setup


def test_device_field_holding_a_string_is_refused_at_setup():
    @dataclasses.dataclass
    class DevStr:
        lr: Device[float] = 1e-3
        act: Device[str] = "relu"

        def init(self, rng):
            return {"w": jnp.zeros((4,))}

        def forward(self, params, *, x):
            return x @ params["w"]

        def loss(self, outputs, *, y):
            return jnp.mean((outputs - y) ** 2)

    data = {"train": {"x": np.ones((8, 4), np.float32), "y": np.ones((8,), np.float32)}}
    with pytest.raises(NitroTypeError) as info:
        Nitro(DevStr(), data=data, batch_size=4, progress=False)
    msg = str(info.value)
    assert f"Device field `{DevStr.__qualname__}.act` must hold a number or numeric array; got str ('relu')" in msg
    assert "`GraphConst[...]`" in msg and "`Host[...]`" in msg
    assert nitro_ipy.cache_stats() == (0, 0, 0)


def test_a_multi_line_repr_is_shown_on_one_line_and_cut():
    from nitro_ipy._experiment._fields import short_repr

    class Tall:
        def __repr__(self):
            return "Tall(\n  a=1,\n\n  b=[1,\n     2]\n)"

    assert short_repr(Tall()) == "Tall( a=1, b=[1, 2] )"
    assert short_repr(Tall(), limit=10) == "Tall( a..."
