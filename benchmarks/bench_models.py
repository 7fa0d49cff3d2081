"""Benchmark: a Flax CNN (Conv + BatchNorm + Dropout) on sklearn digits, nitro_ipy against the hand-written
Flax loop a user writes today: a `jax.jit` train step over a `flax.training.train_state.TrainState` (same
CNN, data, batch size, optimizer, dropout key per step, batch statistics carried), validation by a jitted
eval step. Same process; sides interleaved (A B B A ...), ratios are medians over rounds of nitro / hand.

Rows (targets from issue 12):
- steady-state epoch (programs compiled, warm):                 <= 1.1x
- first epoch, compiles included (fresh caches, init included):  <= 1.0x
- live-edit cycle (edit a layer in the model file, reload, rebuild / re-run the cells, one epoch with
  validation):                                                    <= 0.5x
- evaluation program compile (nitro's exact ragged eval vs a plain eval `jit` of forward + mean loss):
                                                                  <= 1.5x

Parameter groups on the flat layout (issue 35): AdamW decaying kernels only (`mask=`), on a Flax
transformer block and a ResNet-style CNN with BatchNorm:
- steady-state epoch, grouped flat layout / `flat_params=False`:  <= 0.9x
- optimizer program compile (trace + XLA), grouped / ungrouped flat layout (plain AdamW):  <= 1.2x

Usage:
    python3 benchmarks/bench_models.py            # full run (~6 min on 2 busy cores)
    python3 benchmarks/bench_models.py --quick    # CI smoke run
    python3 benchmarks/bench_models.py --json out.json
"""

import atexit
import dataclasses
import importlib
import io
import os
import pathlib
import shutil
import sys
import tempfile
import time
from contextlib import redirect_stdout

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as H  # noqa: E402
from _harness import log  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import nitro_ipy  # noqa: E402
from nitro_ipy import GraphConst, Nitro  # noqa: E402

BATCH, LR, FEATURES, DROP = 64, 3e-3, 8, 0.1
MODEL = """
import flax.linen as nn

class CNN(nn.Module):
    features: int
    drop: float

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(self.features, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.relu(x) * {scale}
        x = x.reshape((x.shape[0], -1))
        x = nn.Dropout(self.drop, deterministic=not train)(x)
        return nn.Dense(10)(x)
"""

_folder = pathlib.Path(tempfile.mkdtemp(prefix="bench_models_"))
atexit.register(shutil.rmtree, _folder, ignore_errors=True)
sys.path.insert(0, str(_folder))
_edits = iter(range(1, 10**6))


def write_model(scale: str = "1.0"):
    """(Re)write the model file and (re)load it: the live edit both sides make."""
    (_folder / "bench_cnn.py").write_text(MODEL.format(scale=scale))
    if "bench_cnn" in sys.modules:
        return importlib.reload(sys.modules["bench_cnn"])
    return importlib.import_module("bench_cnn")


def digits():
    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
    order = np.random.default_rng(0).permutation(len(X))
    X, y = X[order], y[order].astype(np.int32)
    return {"train": {"x": X[:1400], "y": y[:1400]}, "valid": {"x": X[1400:], "y": y[1400:]}}


@dataclasses.dataclass
class Digits:
    features: GraphConst[int] = FEATURES
    drop: GraphConst[float] = DROP

    def init(self, rng):
        v = sys.modules["bench_cnn"].CNN(self.features, self.drop).init(rng, jnp.zeros((1, 8, 8, 1)), train=False)
        return v["params"], {"batch_stats": v["batch_stats"]}

    def forward(self, params, *, x, state, rng, train):
        out, upd = sys.modules["bench_cnn"].CNN(self.features, self.drop).apply(
            {"params": params, **state}, x, train=train, rngs={"dropout": rng},
            mutable=["batch_stats"] if train else [])
        return out, (upd if train else state)

    def loss(self, outputs, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(outputs, y).mean()

    def optimizer(self):
        return optax.adam(LR)


# ---------------------------------------------------------------------------------------------- hand-written
class TrainState(train_state.TrainState):
    batch_stats: dict


class Hand:
    """The cells a user writes today: model, state, a jitted train step and eval step, the epoch loop."""

    def __init__(self, data, seed=0):
        self.data, self.seed = data, seed
        self.define()
        self.state = self.create()
        self.step = 0

    def define(self):  # the "train step" cell, re-run after an edit
        cnn = sys.modules["bench_cnn"].CNN(FEATURES, DROP)

        @jax.jit
        def train_step(state, x, y, key):
            def loss_fn(params):
                out, upd = cnn.apply({"params": params, "batch_stats": state.batch_stats}, x, train=True,
                                     rngs={"dropout": key}, mutable=["batch_stats"])
                return optax.softmax_cross_entropy_with_integer_labels(out, y).mean(), upd

            (loss, upd), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
            state = state.apply_gradients(grads=grads, batch_stats=upd["batch_stats"])
            return state, loss

        @jax.jit
        def eval_step(state, x, y):
            out = cnn.apply({"params": state.params, "batch_stats": state.batch_stats}, x, train=False)
            return optax.softmax_cross_entropy_with_integer_labels(out, y).sum()

        self.cnn, self.train_step, self.eval_step = cnn, train_step, eval_step

    def create(self):
        v = self.cnn.init(jax.random.PRNGKey(self.seed), jnp.zeros((1, 8, 8, 1)), train=False)
        return TrainState.create(apply_fn=self.cnn.apply, params=v["params"], tx=optax.adam(LR),
                                 batch_stats=v["batch_stats"])

    def epoch(self, epoch: int, validate: bool):
        tr = self.data["train"]
        perm = np.random.default_rng((self.seed, epoch)).permutation(len(tr["x"]))
        base = jax.random.PRNGKey(self.seed)
        state, losses = self.state, []
        for s in range(len(perm) // BATCH):
            idx = perm[s * BATCH:(s + 1) * BATCH]
            state, loss = self.train_step(state, tr["x"][idx], tr["y"][idx], jax.random.fold_in(base, self.step))
            self.step += 1
            losses.append(loss)
        self.state = state
        float(np.mean(jax.device_get(losses)))
        if validate:  # a ragged last batch is a second eval program here (the user's own loop)
            va = self.data["valid"]
            total = sum(self.eval_step(state, va["x"][i:i + BATCH], va["y"][i:i + BATCH])
                        for i in range(0, len(va["x"]), BATCH))
            float(total) / len(va["x"])
        jax.block_until_ready(self.state)


# ---------------------------------------------------------------------------------------------- timings
def _quiet(fn):
    with redirect_stdout(io.StringIO()):
        return fn()


def _timed(fn) -> float:
    t0 = time.perf_counter()
    _quiet(fn)
    return time.perf_counter() - t0


def steady(data, rounds: int):
    n = Nitro(Digits(), data={"train": data["train"]}, batch_size=BATCH, progress=False)
    hand = Hand(data)
    _quiet(lambda: (n.train(1), hand.epoch(0, False)))  # compile, warm up

    def nit():
        return _timed(lambda: (n.train(1), jax.block_until_ready(n.params)))

    def man():
        return _timed(lambda: hand.epoch(1, False))

    a, b = H.interleaved(rounds, nit, man, pause_gc=True)
    return H.paired_ratio(a, b), np.median(a), np.median(b)


def first_epoch(data, rounds: int):
    def fresh():
        jax.clear_caches()
        nitro_ipy.cache_reset()
        write_model(f"1.0{next(_edits)}")  # new code: no trace of an earlier round can be reused

    def nit():
        fresh()
        return _timed(lambda: Nitro(Digits(), data=data, batch_size=BATCH, progress=False).train(1))

    def man():
        fresh()
        return _timed(lambda: Hand(data).epoch(0, True))

    a, b = H.interleaved(rounds, nit, man)
    return H.paired_ratio(a, b), np.median(a), np.median(b)


def edit_cycle(data, rounds: int):
    nitro_ipy.cache_reset()
    holder = {"n": Nitro(Digits(), data=data, batch_size=BATCH, progress=False)}
    hand = Hand(data)
    _quiet(lambda: (holder["n"].train(1), hand.epoch(0, True)))

    def nit():
        def cycle():
            write_model(f"1.0{next(_edits)}")
            nitro_ipy.bump_world()  # what the extension does before the next cell
            holder["n"] = holder["n"].rebuild()
            holder["n"].train(1)  # one epoch, validating after it
            jax.block_until_ready(holder["n"].params)
        return _timed(cycle)

    def man():
        def cycle():
            write_model(f"1.0{next(_edits)}")
            hand.define()  # re-run the train-step cell; the TrainState carries over
            hand.epoch(1, True)
        return _timed(cycle)

    a, b = H.interleaved(rounds, nit, man)
    return H.paired_ratio(a, b), np.median(a), np.median(b)


def eval_compile(data, rounds: int):
    va = data["valid"]

    def nit():
        jax.clear_caches()
        nitro_ipy.cache_reset()
        n = Nitro(Digits(), data=data, batch_size=BATCH, progress=False)
        _quiet(n.validate)
        (entry,) = [e for e in nitro_ipy._compiler._cache.live_entries() if e.key.kind == "eval"]
        return entry.trace_s + entry.compile_s

    def man():
        jax.clear_caches()
        hand = Hand(data)
        t0 = time.perf_counter()
        hand.eval_step.lower(hand.state, va["x"][:BATCH], va["y"][:BATCH]).compile()
        return time.perf_counter() - t0

    a, b = H.interleaved(rounds, nit, man)
    return H.paired_ratio(a, b), np.median(a), np.median(b)


# ---------------------------------------------------------------------------------------------- groups
GROUPED = """
import flax.linen as nn
import jax.numpy as jnp

class Block(nn.Module):
    width: int
    heads: int

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(self.heads)(h, h)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(self.width)(nn.gelu(nn.Dense(4 * self.width)(h)))

class Transformer(nn.Module):
    width: int = 32
    heads: int = 4
    depth: int = 2

    @nn.compact
    def __call__(self, tokens, train: bool = True):
        x = nn.Embed(64, self.width)(tokens)
        for _ in range(self.depth):
            x = Block(self.width, self.heads)(x)
        return nn.Dense(64)(nn.LayerNorm()(x))

class ResBlock(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x, train: bool):
        h = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Conv(self.features, (3, 3))(x)))
        h = nn.BatchNorm(use_running_average=not train)(nn.Conv(self.features, (3, 3))(h))
        return nn.relu(x + h)

class ResNet(nn.Module):
    features: int = 16
    blocks: int = 3

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.relu(nn.Conv(self.features, (3, 3))(x))
        for _ in range(self.blocks):
            x = ResBlock(self.features)(x, train)
        return nn.Dense(10)(x.mean((1, 2)))
"""


def _decay_mask(params):
    """Decay kernels and embeddings, not biases or LayerNorm / BatchNorm scales: the usual AdamW mask."""
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key in ("kernel", "embedding"), params)


@dataclasses.dataclass
class MaskedTransformer:
    masked: GraphConst[bool] = True

    def init(self, rng):
        return sys.modules["bench_grouped"].Transformer().init(rng, jnp.zeros((1, 16), jnp.int32))["params"]

    def forward(self, params, *, tokens):
        return sys.modules["bench_grouped"].Transformer().apply({"params": params}, tokens)

    def loss(self, outputs, *, targets):
        return optax.softmax_cross_entropy_with_integer_labels(outputs, targets).mean()

    def optimizer(self):
        return optax.adamw(1e-3, weight_decay=0.05, mask=_decay_mask if self.masked else None)


@dataclasses.dataclass
class MaskedResNet:
    masked: GraphConst[bool] = True

    def init(self, rng):
        v = sys.modules["bench_grouped"].ResNet().init(rng, jnp.zeros((1, 8, 8, 1)), train=False)
        return v["params"], {"batch_stats": v["batch_stats"]}

    def forward(self, params, *, x, state, train):
        out, upd = sys.modules["bench_grouped"].ResNet().apply(
            {"params": params, **state}, x, train=train, mutable=["batch_stats"] if train else [])
        return out, (upd if train else state)

    def loss(self, outputs, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(outputs, y).mean()

    def optimizer(self):
        return optax.adamw(1e-3, weight_decay=0.05, mask=_decay_mask if self.masked else None)


def grouped_models(data, quick: bool):
    """`(name, experiment class, train split)` of the two grouped benchmarks."""
    (_folder / "bench_grouped.py").write_text(GROUPED)
    importlib.import_module("bench_grouped")
    r = np.random.default_rng(0)
    n = 256 if quick else 1024
    tokens = r.integers(0, 64, size=(n, 16)).astype(np.int32)
    text = {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1)}
    return [("transformer block", MaskedTransformer, text), ("ResNet-style CNN", MaskedResNet, data["train"])]


def grouped_steady(cls, train, rounds: int):
    """Steady epoch, AdamW with a decay mask: the grouped flat layout against `flat_params=False`."""
    handles = [Nitro(cls(), data={"train": train}, batch_size=BATCH, progress=False, flat_params=flat)
               for flat in (True, False)]
    assert handles[0]._layout.grouped, "the masked AdamW should group the flat layout"
    for n in handles:
        _quiet(lambda: n.train(1))  # compile, warm up

    def side(n):
        return lambda: _timed(lambda: (n.train(1), jax.block_until_ready(n.params)))

    a, b = H.interleaved(rounds, side(handles[0]), side(handles[1]), pause_gc=True)
    return H.paired_ratio(a, b), np.median(a), np.median(b)


def opt_compile(cls, train, rounds: int):
    """The optimizer program's compile (trace + XLA): masked AdamW on the grouped flat layout against plain
    AdamW on the ungrouped one."""
    batch = {k: v[:BATCH] for k, v in train.items()}

    def side(masked):
        def run():
            jax.clear_caches()
            nitro_ipy.cache_reset()
            n = Nitro(cls(masked), data={"train": batch}, batch_size=BATCH, progress=False)
            assert n._layout.grouped == masked
            _quiet(lambda: n.train(1))
            (entry,) = [e for e in nitro_ipy._compiler._cache.live_entries() if e.key.kind == "opt"]
            return entry.trace_s + entry.compile_s
        return run

    a, b = H.interleaved(rounds, side(True), side(False))
    return H.paired_ratio(a, b), np.median(a), np.median(b)


def main(argv=None) -> int:
    H.parse_args(__doc__, argv)
    quick = H.quick()
    write_model()
    data = digits()
    if quick:
        data = {"train": {k: v[:320] for k, v in data["train"].items()}, "valid": data["valid"]}
    log(H.env_line())
    res, rows = {}, []
    for name, fn, target, rounds in (
        ("steady-state epoch, nitro / hand-written", steady, 1.1, 3 if quick else 11),
        # fresh caches make every eager op of both inits recompile (~15 s a side): not in the smoke run
        *(() if quick else (("first epoch incl. compiles, nitro / hand-written", first_epoch, 1.0, 5),)),
        ("live-edit cycle, nitro / hand-written", edit_cycle, 0.5, 1 if quick else 5),
        ("eval program compile, nitro / plain eval jit", eval_compile, 1.5, 1 if quick else 7),
    ):
        ratio, a, b = fn(data, rounds)
        res[name] = {"ratio": ratio, "nitro_s": float(a), "hand_s": float(b), "rounds": rounds}
        log(f"{name}: {ratio:.2f}x ({a:.3f} s vs {b:.3f} s, median of {rounds})")
        rows.append(H.Row(name, f"{ratio:.2f}x", f"<= {target}x", ratio <= target))
    for model, cls, train in grouped_models(data, quick):
        for name, fn, target, rounds in (
            (f"{model}, masked AdamW: steady epoch, grouped flat / tree layout", grouped_steady, 0.9,
             3 if quick else 9),
            (f"{model}: optimizer compile, masked (grouped) / plain flat", opt_compile, 1.2, 1 if quick else 5),
        ):
            ratio, a, b = fn(cls, train, rounds)
            res[name] = {"ratio": ratio, "a_s": float(a), "b_s": float(b), "rounds": rounds}
            log(f"{name}: {ratio:.2f}x ({a:.3f} s vs {b:.3f} s, median of {rounds})")
            rows.append(H.Row(name, f"{ratio:.2f}x", f"<= {target}x", ratio <= target))
    return H.finish(res, rows)


if __name__ == "__main__":
    sys.exit(main())
