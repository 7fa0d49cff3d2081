"""Content fingerprints: equal content -> equal fingerprint, any moved value -> a different one, stable
across processes, and a refusal that says where inside the value the identity-only object sits."""

import dataclasses
import enum
import functools
import typing

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _modules import import_source, json_in_child

from nitro_ipy import NitroTypeError, Unfingerprintable, fingerprint
from nitro_ipy._base._fingerprint import code_fingerprint


@dataclasses.dataclass(frozen=True)
class Inner:
    width: int = 3
    act: str = "tanh"


@dataclasses.dataclass(frozen=True)
class Cfg:
    inner: Inner = Inner()
    depth: int = 2
    widths: tuple = (8, 8)


class Point(typing.NamedTuple):
    x: int
    y: float


class Act(enum.Enum):
    RELU = "relu"
    TANH = "tanh"


def _scaled(x, k=1.0, *, bias=0.0):
    return x * k + bias


def _make_scaler(k):
    def scale(x):
        return x * k

    return scale


def _make_default(k):
    def scale(x, k=k):
        return x * k

    return scale


def _make_kwdefault(k):
    def scale(x, *, k=k):
        return x * k

    return scale


def _builders():
    """Each entry builds an equal-content value afresh on every call."""
    return {
        "frozen config dataclass": lambda: Cfg(Inner(3), 2, (8, 8)),
        "optax adam": lambda: optax.adam(1e-3),
        "optax chain": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1)),
        "closure": lambda: _make_scaler(2.0),
        "default argument": lambda: _make_default(2.0),
        "partial": lambda: functools.partial(_scaled, 2.0, bias=1.0),
        "NamedTuple": lambda: Point(1, 2.0),
        "Enum": lambda: Act("relu"),
        "numpy array": lambda: np.arange(6, dtype=np.float32).reshape(2, 3),
        "numpy scalar": lambda: np.float32(0.5),
        "JAX array": lambda: jnp.arange(6.0).reshape(2, 3),
        "jnp dtype": lambda: jnp.float32,
        "np dtype": lambda: np.dtype("float32"),
        "set": lambda: {"a", "b", "c"},
        "dict": lambda: {"lr": 0.1, "widths": [4, 8], "act": "relu"},
        "nested containers": lambda: [({"k": (1, 2.5, None, True)}, frozenset({3, 4}))],
        "str": lambda: "".join(["hid", "den"]),
        "bytes": lambda: bytes([1, 2, 3]),
        "complex": lambda: complex(1, -2),
        "big int": lambda: 10**40 + 1,
        "range and slice": lambda: (range(0, 10, 2), slice(1, None)),
    }


@pytest.mark.parametrize("name", list(_builders()))
def test_equal_content_built_twice_fingerprints_equal(name):
    build = _builders()[name]
    a, b = build(), build()
    if not isinstance(a, (str, int, type, enum.Enum, np.dtype, bytes, complex)):
        assert a is not b  # really two objects, not one cached one
    assert fingerprint(a) == fingerprint(b)


def test_fingerprint_is_a_32_digit_hex_string():
    fp = fingerprint(Cfg())
    assert isinstance(fp, str) and len(fp) == 32
    int(fp, 16)


def test_lambda_defined_twice_identically():
    f = lambda x: x * 2 + 1  # noqa: E731
    g = lambda x: x * 2 + 1  # noqa: E731
    assert f is not g
    assert fingerprint(f) == fingerprint(g)


def test_dtype_spellings_are_one_dtype():
    assert fingerprint(jnp.float32) == fingerprint(np.dtype("float32")) == fingerprint(np.float32)
    assert fingerprint(jnp.dtype("float32")) == fingerprint(np.dtype("float32"))
    assert fingerprint(jnp.bfloat16) == fingerprint(np.dtype(jnp.bfloat16))
    assert fingerprint(jnp.float32) != fingerprint(jnp.float16)
    assert fingerprint(jnp.float16) != fingerprint(jnp.bfloat16)
    assert fingerprint(jnp.int32) != fingerprint(jnp.uint32)


def test_low_precision_dtypes_fingerprint_apart():
    assert fingerprint(jnp.float8_e4m3fn) != fingerprint(jnp.int4)
    assert fingerprint(jnp.float8_e4m3fn) != fingerprint(jnp.float8_e4m3fnuz)
    zeros = lambda dt: np.zeros(4, dt)  # noqa: E731
    assert fingerprint(zeros(jnp.float8_e4m3fn)) != fingerprint(zeros(jnp.float8_e4m3fnuz))


def test_numpy_and_jax_arrays_of_equal_content_agree():
    assert fingerprint(jnp.arange(3.0)) == fingerprint(np.arange(3.0, dtype=np.float32))


def test_sets_ignore_insertion_order():
    # 8, 16 and 24 collide in a small hash table, so insertion order really changes iteration order.
    a, b = set(), set()
    for item in [8, 16, 24]:
        a.add(item)
    for item in [24, 16, 8]:
        b.add(item)
    assert list(a) != list(b)
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint(frozenset(a)) == fingerprint(frozenset(b))
    assert fingerprint({"x", "y", ("t", 1), 2.5}) == fingerprint({2.5, ("t", 1), "y", "x"})


def test_dicts_ignore_insertion_order():
    assert fingerprint({"a": 1, "b": [2], 3: "c"}) == fingerprint({3: "c", "b": [2], "a": 1})


def test_partial_keywords_ignore_order():
    assert fingerprint(functools.partial(_scaled, k=2.0, bias=1.0)) == fingerprint(
        functools.partial(_scaled, bias=1.0, k=2.0)
    )


def _moved_pairs():
    """Each entry: two values that differ by one nested component."""
    return {
        "nested dataclass field": (Cfg(inner=Inner(width=3)), Cfg(inner=Inner(width=4))),
        "nested dataclass str": (Cfg(inner=Inner(act="tanh")), Cfg(inner=Inner(act="relu"))),
        "dataclass tuple field": (Cfg(widths=(8, 8)), Cfg(widths=(8, 16))),
        "dataclass type": (Inner(3), Point(3, "tanh")),
        "optax adam lr": (optax.adam(1e-3), optax.adam(1e-2)),
        "optax adam b1": (optax.adam(1e-3), optax.adam(1e-3, b1=0.8)),
        "optax transform": (optax.adam(1e-3), optax.sgd(1e-3)),
        "optax chain member": (
            optax.chain(optax.clip(1.0), optax.adam(1e-3)),
            optax.chain(optax.clip(2.0), optax.adam(1e-3)),
        ),
        "closure cell": (_make_scaler(2.0), _make_scaler(3.0)),
        "closure cell nested": (_make_scaler(Cfg()), _make_scaler(Cfg(depth=3))),
        "default argument": (_make_default(2.0), _make_default(3.0)),
        "keyword-only default": (_make_kwdefault(2.0), _make_kwdefault(3.0)),
        "partial args": (functools.partial(_scaled, 2.0), functools.partial(_scaled, 3.0)),
        "partial keywords": (functools.partial(_scaled, bias=1.0), functools.partial(_scaled, bias=2.0)),
        "partial func": (functools.partial(_scaled, 2.0), functools.partial(_make_scaler, 2.0)),
        "NamedTuple field": (Point(1, 2.0), Point(1, 3.0)),
        "NamedTuple vs tuple": (Point(1, 2.0), (1, 2.0)),
        "Enum member": (Act.RELU, Act.TANH),
        "Enum vs its value": (Act.RELU, "relu"),
        "array value": (np.arange(3.0), np.arange(1.0, 4.0)),
        "array dtype": (np.zeros(3, np.float32), np.zeros(3, np.float64)),
        "array shape": (np.zeros((2, 3)), np.zeros((3, 2))),
        "jax array value": (jnp.zeros(3), jnp.ones(3)),
        "dtype": (jnp.float32, jnp.float16),
        "set member": ({"a", "b"}, {"a", "c"}),
        "dict value": ({"a": 1}, {"a": 2}),
        "dict key": ({"a": 1}, {"b": 1}),
        "list vs tuple": ([1, 2], (1, 2)),
        "int vs float": (1, 1.0),
        "bool vs int": (True, 1),
        "str vs bytes": ("ab", b"ab"),
        "None vs 0": (None, 0),
        "float": (0.1, 0.1 + 1e-17 * 10),
        "deep list": ([[[[1]]]], [[[[2]]]]),
    }


@pytest.mark.parametrize("name", list(_moved_pairs()))
def test_moved_nested_value_changes_the_fingerprint(name):
    a, b = _moved_pairs()[name]
    assert fingerprint(a) != fingerprint(b)


def test_lambda_with_a_different_body():
    f = lambda x: x * 2  # noqa: E731
    g = lambda x: x * 3  # noqa: E731
    h = lambda x: x + 2  # noqa: E731
    assert len({fingerprint(f), fingerprint(g), fingerprint(h)}) == 3


def test_closure_cell_read_at_fingerprint_time():
    k = 2.0

    def scale(x):
        return x * k

    before = fingerprint(scale)
    k = 3.0  # noqa: F841 (the cell is what changes)
    assert fingerprint(scale) != before


def _exec_source(src: str, filename: str):
    ns: dict = {}
    exec(compile(src, filename, "exec"), ns)
    return ns


_PLAIN = """
def f(x):
    def inner(y):
        return y * 2
    return [inner(v) + 1 for v in x]

g = lambda x: x + 1
"""

_COMMENTED = """# a header comment


def f(x):
    # why: doubling
    def inner(y):

        return y * 2   # trailing comment

    # a blank line above, and a comment here
    return [inner(v) + 1 for v in x]


g = lambda x: x + 1  # comment
"""

_EDITED = _PLAIN.replace("y * 2", "y * 3")


def test_comments_blank_lines_and_line_numbers_do_not_count():
    a = _exec_source(_PLAIN, "<cell-1>")
    b = _exec_source(_COMMENTED, "<cell-2>")
    assert a["f"].__code__.co_firstlineno != b["f"].__code__.co_firstlineno
    assert a["f"](range(3)) == b["f"](range(3))
    assert fingerprint(a["f"]) == fingerprint(b["f"])
    assert code_fingerprint(a["f"].__code__) == code_fingerprint(b["f"].__code__)
    assert fingerprint(a["g"]) == fingerprint(b["g"])


def test_an_edit_in_a_nested_function_counts():
    a = _exec_source(_PLAIN, "<cell-1>")
    c = _exec_source(_EDITED, "<cell-3>")
    assert fingerprint(a["f"]) != fingerprint(c["f"])
    assert fingerprint(a["g"]) == fingerprint(c["g"])


def _module_class(tmp_path, monkeypatch, name, body):
    return import_source(tmp_path, monkeypatch, name, body).K


def test_user_module_class_fingerprints_by_its_methods(tmp_path, monkeypatch):
    a = _module_class(tmp_path, monkeypatch, "nitro_cls_a", "class K:\n    def m(self):\n        return 1\n")
    b = _module_class(tmp_path, monkeypatch, "nitro_cls_b", "class K:\n    # note\n    def m(self):\n        return 1\n")
    c = _module_class(tmp_path, monkeypatch, "nitro_cls_c", "class K:\n    def m(self):\n        return 2\n")
    for k in (a, b, c):
        k.__module__ = "nitro_cls_a"  # same qualified name: only the methods tell them apart
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint(a) != fingerprint(c)


def test_main_class_fingerprints_by_its_methods():
    def define(body):
        ns = {"__name__": "__main__"}
        exec(compile(body, "<cell>", "exec"), ns)
        return ns["K"]

    a = define("class K:\n    def m(self):\n        return 1\n")
    b = define("class K:\n    # note\n\n    def m(self):\n        return 1\n")
    c = define("class K:\n    def m(self):\n        return 2\n")
    assert a.__module__ == "__main__"
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint(a) != fingerprint(c)


def test_library_class_fingerprints_by_name():
    assert fingerprint(optax.GradientTransformation) == fingerprint(optax.GradientTransformation)
    assert fingerprint(optax.GradientTransformation) != fingerprint(optax.GradientTransformationExtraArgs)


def test_self_referencing_values_terminate():
    lst: list = [1]
    lst.append(lst)
    d: dict = {"a": 1}
    d["self"] = d
    assert fingerprint(lst) == fingerprint(lst)
    assert fingerprint(d) == fingerprint(d)
    assert fingerprint(lst) != fingerprint([1, [1]])

    def countdown(n):
        return countdown(n - 1) if n else 0

    assert fingerprint(countdown) == fingerprint(countdown)


# ---------------------------------------------------------------- refusals


class Tokenizer:
    def __init__(self):
        self.vocab = {"a": 0}


def test_identity_only_object_is_refused_with_its_path():
    @dataclasses.dataclass(frozen=True)
    class Holder:
        width: int = 3
        tokenizer: Tokenizer = dataclasses.field(default_factory=Tokenizer)

    with pytest.raises(Unfingerprintable) as info:
        fingerprint(Holder(), "cfg")
    err = info.value
    assert (err.path, err.what) == ("cfg.tokenizer", "Tokenizer hashes by identity")
    assert str(err) == "cfg.tokenizer: Tokenizer hashes by identity"
    assert isinstance(err, NitroTypeError) and isinstance(err, TypeError)


@pytest.mark.parametrize(
    "value, path",
    [
        ([1, {"k": Tokenizer()}], "value[1]['k']"),
        ((Point(1, Tokenizer()),), "value[0].y"),
        (functools.partial(_scaled, Tokenizer()), "value.args[0]"),
        (_make_scaler(Tokenizer()), "value (closure cell `k`)"),
    ],
    ids=["list-dict", "namedtuple", "partial", "closure"],
)
def test_refusal_paths_inside_containers(value, path):
    with pytest.raises(Unfingerprintable) as info:
        fingerprint(value)
    assert info.value.path == path
    assert info.value.what == "Tokenizer hashes by identity"


def test_object_with_custom_hash_has_no_content_fingerprint():
    class Hashy:
        def __hash__(self):
            return 1

    with pytest.raises(Unfingerprintable) as info:
        fingerprint(Hashy())
    assert info.value.what == f"{Hashy.__qualname__} has no content fingerprint"


def test_tracer_is_refused():
    seen = []

    def f(x):
        try:
            fingerprint(x)
        except Unfingerprintable as err:
            seen.append(err.what)
        return x

    jax.jit(f)(1.0)
    assert seen == ["a JAX tracer (a traced value has no content yet)"]


def test_dict_with_equal_content_keys_does_not_crash():
    @dataclasses.dataclass(frozen=True, eq=False)
    class Key:
        a: int = 1

    assert fingerprint({Key(): 1, Key(): 2}) != fingerprint({Key(): 1, Key(): 3})


def test_custom_jvp_rule_is_part_of_the_fingerprint():
    def make(k):
        @jax.custom_jvp
        def f(x):
            return x

        f.defjvp(lambda primals, tangents: (primals[0], k * tangents[0]))
        return f

    assert fingerprint(make(1.0)) == fingerprint(make(1.0))
    assert fingerprint(make(1.0)) != fingerprint(make(2.0))


# ---------------------------------------------------------------- across processes

_CROSS_MODULE = '''
import dataclasses, enum, functools, typing
import jax.numpy as jnp, numpy as np, optax

@dataclasses.dataclass(frozen=True)
class Inner:
    width: int = 3
    tags: frozenset = frozenset({"alpha", "beta", "gamma", "delta", "epsilon"})

@dataclasses.dataclass(frozen=True)
class Cfg:
    inner: Inner = Inner()
    name: str = "experiment"
    table: dict = dataclasses.field(default_factory=lambda: {"zeta": 1, "alpha": 2, "mu": 3})

class Act(enum.Enum):
    RELU = 1

class P(typing.NamedTuple):
    a: int
    b: str

def helper(x, k=2):
    return [v * k for v in x if v]

def make(k):
    return lambda x: x * k

class Model:
    def forward(self, x):
        return helper(x) + [1]

def values():
    return {
        "str": "a string with ünïcode",
        "set of str": {"alpha", "beta", "gamma", "delta", "epsilon", "zeta"},
        "dict": {"b": 1, "a": [1.5, None], "c": ("x", b"y")},
        "dataclass": Cfg(),
        "function": helper,
        "closure": make(3),
        "class": Model,
        "enum": Act.RELU,
        "namedtuple": P(1, "b"),
        "partial": functools.partial(helper, k=5),
        "numpy": np.arange(6, dtype=np.int32).reshape(2, 3),
        "jax": jnp.linspace(0.0, 1.0, 5),
        "dtype": jnp.bfloat16,
        "optax": optax.adam(1e-3),
        "float": -0.1,
    }
'''


def test_fingerprints_are_stable_across_processes(tmp_path, monkeypatch):
    name = "nitro_fp_cross"
    mod = import_source(tmp_path, monkeypatch, name, _CROSS_MODULE)
    here = {k: fingerprint(v) for k, v in mod.values().items()}
    assert len(set(here.values())) == len(here)
    code = (
        f"import json, nitro_ipy, {name} as m; "
        "print(json.dumps({k: nitro_ipy.fingerprint(v) for k, v in m.values().items()}))"
    )
    for seed in ("1", "2"):
        there = json_in_child(code, tmp_path, seed)
        assert there == here, {k for k in here if here[k] != there.get(k)}


def test_a_library_model_definition_is_keyed_by_its_package_version(monkeypatch):
    """A Flax Linen or Equinox module in a GraphConst field is judged by its class's qualified name and
    its package's version: a program stored on disk never outlives an upgrade."""
    import equinox as eqx
    import flax.linen as nn

    from nitro_ipy._base import _fingerprint

    for value, package in ((nn.Dense(3), "flax"), (eqx.nn.Lambda(abs), "equinox")):
        before = _fingerprint.fingerprint(value)
        assert _fingerprint._library_version(type(value).__module__) != ""
        monkeypatch.setitem(_fingerprint._versions, package, "999.0")
        assert _fingerprint.fingerprint(value) != before
        monkeypatch.delitem(_fingerprint._versions, package)
        assert _fingerprint.fingerprint(value) == before
