"""Bad input said in the user's words: a hook that fails on the batch it was given (wrong feature count, a
1-D input, `forward` returning a tuple), `init` returning None, a loss that broadcasts outputs against a
target of another rank, a GraphConst value mutated in place, a checkpoint directory that cannot be made.
"""

import dataclasses
import os
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import nitro_ipy
from nitro_ipy import (
    GraphConst,
    HookInputError,
    Nitro,
    NitroTypeError,
    NitroValueError,
    NitroWarning,
)

BS = 8


@dataclasses.dataclass
class Reg:
    hidden: GraphConst[int] = 4

    def init(self, rng):
        return {"w1": jax.random.normal(rng, (4, self.hidden)) * 0.1, "w2": jnp.ones((self.hidden,)) * 0.1}

    def forward(self, params, *, x):
        return jnp.tanh(x @ params["w1"]) @ params["w2"]  # the user's line the error points at

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)


class Pair(Reg):
    def forward(self, params, *, x):
        out = jnp.tanh(x @ params["w1"]) @ params["w2"]
        return out, out


class NoReturn(Reg):
    def init(self, rng):
        {"w1": jnp.zeros((4, 4)), "w2": jnp.zeros(4)}  # noqa: B018 - the missing `return` is the bug


def _data(n=32, features=4):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, features)).astype(np.float32)
    return {"x": x, "y": x.sum(1).astype(np.float32)}


def _handle(e=None, **splits):
    return Nitro(e or Reg(), data=splits or {"train": _data()}, batch_size=BS, progress=False)


def _user_lines(err) -> list[str]:
    return [line for line in err._render_traceback_() if line.startswith("  File ")]


@pytest.mark.parametrize("entry", ["train", "validate", "predict"])
def test_a_wrong_feature_count_names_the_hook_the_shapes_and_the_fix(entry):
    nitro_ipy.cache_reset()
    bad = _data(features=3)
    if entry == "train":
        n, call = _handle(train=bad), lambda n: n.train()
    elif entry == "validate":
        n, call = _handle(train=_data(), valid=bad), lambda n: n.validate()
    else:
        n, call = _handle(), lambda n: n.predict({"x": bad["x"][:5]})
    with pytest.raises(HookInputError) as info:
        call(n)
    text = str(info.value)
    assert text.startswith("`Reg.forward` failed on the batch it was given: TypeError: dot_general requires "
                           "contracting dimensions to have the same shape, got (3,) and (4,).")
    assert "arrived: `x` float32[" in text and ",3]" in text.split("arrived: ")[1].splitlines()[0]
    assert "the parameters: params['w1'] float32[4,4], params['w2'] float32[4]" in text
    assert 'return jnp.tanh(x @ params["w1"]) @ params["w2"]' in text
    assert "Fix: give each input field a leading batch axis" in text
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)  # as the errors it explains
    # IPython shows the hook's frames only: this file's `forward`, not JAX's or nitro_ipy's
    lines = _user_lines(info.value)
    assert lines and all(__file__ in line for line in lines) and "in forward" in lines[-1]
    # and a script's traceback starts at the entry point: no frame of JAX's tracing or nitro_ipy's programs
    frames = traceback.extract_tb(info.value.__traceback__)
    assert [f.name for f in frames if f.filename.startswith(os.path.dirname(nitro_ipy.__file__))] == ["called"]
    assert not [f for f in frames if f"{os.sep}jax{os.sep}" in f.filename]
    assert not any("JAX has removed" in note for note in getattr(info.value, "__notes__", ()))
    stats = nitro_ipy.cache_stats()
    assert stats.misses == stats.entries  # the failed trace stored nothing


def test_a_1d_input_says_to_add_the_feature_axis():
    n = _handle(train={"x": _data()["x"][:, 0], "y": _data()["y"]})
    with pytest.raises(HookInputError, match=r"arrived: `x` float32\[8\]") as info:
        n.train()
    assert "Fix: `x` is 1-D, one number per example: if that is one feature, give the split `x[:, None]`" in str(info.value)


def test_forward_returning_a_tuple_is_said_at_the_loss():
    with pytest.raises(HookInputError) as info:
        _handle(Pair()).train()
    text = str(info.value)
    assert text.startswith("`Pair.loss` failed on the batch it was given: TypeError: unsupported operand")
    assert "outputs (what `forward` returned): a tuple of 2: (float32[8], float32[8])" in text
    assert "targets: `y` float32[8]" in text
    assert "Fix: `forward` returned a tuple of 2, which `loss` gets whole as `outputs`" in text


def test_init_returning_none_is_refused_at_setup():
    with pytest.raises(NitroTypeError, match=r"`NoReturn.init` returned None, not the parameters") as info:
        _handle(NoReturn())
    assert "Fix: end `init` with `return params`" in str(info.value)


def test_an_error_that_is_not_about_the_input_keeps_its_own_words():
    class Branchy(Reg):
        def forward(self, params, *, x):
            if x.sum() > 0:  # Python control flow on a traced value: JAX's own error
                return x @ params["w1"] @ params["w2"]
            return x @ params["w1"] @ params["w2"]

    with pytest.raises(jax.errors.TracerBoolConversionError):
        _handle(Branchy()).train()


def test_a_loss_that_broadcasts_outputs_against_targets_is_warned_about():
    d = _data()
    n = _handle(train={"x": d["x"], "y": d["y"][:, None]})
    with pytest.warns(NitroWarning) as record:
        n.train()
    texts = [str(w.message) for w in record if issubclass(w.category, NitroWarning)]
    assert texts == ["`Reg.loss` broadcasts outputs float32[8] against `y` float32[8,1] to [8,8]: every output "
                     "is compared with every target, not with its own. Fix: give them the same shape: "
                     "`y[:, 0]` in the split (or `outputs[:, None]` in `loss`)."]


@dataclasses.dataclass
class Classes:
    k: GraphConst[int] = 3

    def init(self, rng):
        return {"w": jax.random.normal(rng, (4, self.k))}

    def forward(self, params, *, x):
        return x @ params["w"]

    def loss(self, outputs, *, y):  # logits (B, 3) against labels (B,): ranks differ, no outer broadcast
        return optax.softmax_cross_entropy_with_integer_labels(outputs, y).mean()


class Picks(Reg):
    def loss(self, outputs, *, y):  # `y` (B, 1) read as one column: ranks differ, nothing broadcasts
        return jnp.mean((outputs - y[:, 0]) ** 2)


def test_ranks_that_differ_without_an_outer_broadcast_are_not_warned_about():
    d = _data()
    labels = {"x": d["x"], "y": (d["y"] > 0).astype(np.int32)}
    _handle(Classes(), train=labels).train()  # the suite turns a NitroWarning into an error
    _handle(Picks(), train={"x": d["x"], "y": d["y"][:, None]}).train()


@dataclasses.dataclass
class Scaled:
    scales: GraphConst[list] = dataclasses.field(default_factory=lambda: [1.0])

    def init(self, rng):
        return {"w": jnp.ones((4,))}

    def forward(self, params, *, x):
        return (x @ params["w"]) * sum(self.scales)

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)


def test_a_graphconst_value_mutated_in_place_is_a_drift(capsys):
    e = Scaled()
    n = _handle(e)
    n.train()
    before = np.asarray(n.predict({"x": np.ones((1, 4), np.float32)}))
    capsys.readouterr()
    e.scales.append(10.0)  # in place: no world counter moves
    n.train()
    out = capsys.readouterr().out
    assert out.count("! this handle's GraphConst field `scales` ([1.0] -> [1.0, 10.0]) changed in place since "
                     "it was built.") == 1
    assert "rebuild it: `n = n.rebuild()`" in out
    assert "stale=True" in repr(n)
    m = n.rebuild()  # compiles for the new value
    got = np.asarray(m.predict({"x": np.ones((1, 4), np.float32)}))
    np.testing.assert_allclose(got, np.asarray(n.predict({"x": np.ones((1, 4), np.float32)})) * 11.0, rtol=1e-5)
    assert "stale=False" in repr(m) and not np.allclose(got, before)


@dataclasses.dataclass(frozen=True)
class Frozen:
    widths: tuple = (64, 64)
    extra: object = None


def test_only_values_that_can_change_in_place_are_watched():
    # the entry points fingerprint these at each call (microseconds); immutable ones never move
    from nitro_ipy._experiment._binding import may_change_in_place

    assert [may_change_in_place(v) for v in (4, "gelu", (1, 2.0), Frozen(), jnp.ones(2), np.float32, len)] == [False] * 7
    assert [may_change_in_place(v) for v in ([1], {"a": 1}, np.ones(2), Frozen(extra=[1]), (1, [2]))] == [True] * 5


def test_a_checkpoint_directory_that_cannot_be_made_is_said(tmp_path, monkeypatch):
    n = _handle()
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file where a directory should be")
    with pytest.raises(NitroValueError) as info:
        n.save(blocker / "run1" / "ck", wait=True)
    assert str(info.value) == (
        f"cannot save the checkpoint `{blocker}/run1/ck.nitro.npz`: its directory `{blocker}/run1` does not exist "
        f"and could not be made (`{blocker}` is a file, not a directory). Fix: save under a directory you can "
        f"write to (`n.save(\"checkpoints/run1\")` makes `checkpoints/`), or make the directory first.")
    # a missing directory is made, and `~` is the home directory, not a folder named `~`
    assert os.path.exists(n.save(tmp_path / "new" / "deeper" / "ck", wait=True))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert n.save("~/ck", wait=True) == str(tmp_path / "home" / "ck.nitro.npz")
    assert os.path.exists(tmp_path / "home" / "ck.nitro.npz") and not os.path.exists(tmp_path / "~")
