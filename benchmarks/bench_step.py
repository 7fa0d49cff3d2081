"""Benchmark: the step loop on any backend, against the hand-written loop it replaces (issue 39).

The hand loop is what a JAX user writes: a per-epoch permutation, numpy batches by fancy indexing, one
`jax.jit` fused step (gradient + optax update) with params and optimizer state donated. nitro_ipy trains
the same model, data, batch size and optimizer (adam 1e-3) at default settings, and the dispatch-bound
MLP again with `steps_per_execution=16`. Models are sized for the backend (a GPU gets the issue's sizes):

- dispatch-bound MLP: 32-32-1, batch 64 (every backend);
- mid MLP: 512-8x2048-1, batch 512 on an accelerator; 64-4x256-1, batch 128 on the CPU;
- small causal LM: 6 layers x 768, seq 256, vocab 8192, batch 32 on an accelerator; 2 x 64, seq 32,
  vocab 256, batch 8 on the CPU.

Figures (lower ratio = nitro faster):
1. steady ms/step of each side, epochs interleaved (A B B A ...) in one process; the ratio is the median
   over rounds of nitro epoch / adjacent hand epoch. Targets on an accelerator: every model <= 1.0x, the
   MLPs <= 0.8x, the dispatch-bound MLP with `steps_per_execution=16` <= 0.1x. On the CPU they are
   reported for context (bench_handle.py holds the CPU targets).
2. per-step host us: the main thread's CPU time per step (`time.thread_time`: the loop's Python and
   the dispatch), nitro's and the hand loop's. On an accelerator the device's work is not in it; on the
   CPU, XLA may run a small program on the calling thread, so there it includes some of the compute.
3. cold first epoch, each side in a fresh process (nothing compiled, no program store, no JAX cache):
   in one process whichever side compiles first would pay the GPU's autotuning for both.

Usage:
    python3 benchmarks/bench_step.py            # full run
    python3 benchmarks/bench_step.py --quick    # smoke run: fewer rounds, the LM's cold start skipped
    python3 benchmarks/bench_step.py --json out.json
    python3 benchmarks/bench_step.py --per-execution 4,16   # every model again at K=4 and K=16
                                                            # (default: K=16 on the dispatch-bound MLP only)
"""

import dataclasses
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as H  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _harness import log  # noqa: E402

import nitro_ipy  # noqa: E402
from nitro_ipy import GraphConst, Nitro  # noqa: E402

ACCEL = jax.default_backend() != "cpu"


# ---------------------------------------------------------------------------------------------- models
def mlp_init(rng, sizes):
    keys = jax.random.split(rng, len(sizes) - 1)
    return [{"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros((b,))}
            for k, a, b in zip(keys, sizes[:-1], sizes[1:])]


def mlp_apply(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return (x @ params[-1]["w"] + params[-1]["b"])[:, 0]


def mse(out, y):
    return jnp.mean((out - y) ** 2)


@dataclasses.dataclass
class MLP:
    sizes: GraphConst[tuple] = (32, 32, 1)

    def init(self, rng):
        return mlp_init(rng, self.sizes)

    def forward(self, params, *, x):
        return mlp_apply(params, x)

    def loss(self, outputs, *, y):
        return mse(outputs, y)

    def optimizer(self):
        return optax.adam(1e-3)


def lm_init(rng, vocab, width, layers, seq):
    k = iter(jax.random.split(rng, 4 + 6 * layers))
    dense = lambda a, b: jax.random.normal(next(k), (a, b)) / np.sqrt(a)  # noqa: E731
    blocks = [{"qkv": dense(width, 3 * width), "o": dense(width, width), "up": dense(width, 4 * width),
               "down": dense(4 * width, width), "ln1": jnp.ones((width,)), "ln2": jnp.ones((width,))}
              for _ in range(layers)]
    return {"embed": jax.random.normal(next(k), (vocab, width)) * 0.02,
            "pos": jax.random.normal(next(k), (seq, width)) * 0.02, "blocks": blocks,
            "ln": jnp.ones((width,)), "head": dense(width, vocab)}


def _norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


def lm_apply(params, tokens, heads):
    x = params["embed"][tokens] + params["pos"][: tokens.shape[1]]
    b, t, d = x.shape
    mask = jnp.tril(jnp.ones((t, t), bool))
    for blk in params["blocks"]:
        q, k, v = jnp.split(_norm(x, blk["ln1"]) @ blk["qkv"], 3, -1)
        split = lambda a: a.reshape(b, t, heads, d // heads)  # noqa: E731
        att = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / np.sqrt(d // heads)
        att = jax.nn.softmax(jnp.where(mask, att, -1e9), -1)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", att, split(v)).reshape(b, t, d) @ blk["o"]
        x = x + jax.nn.gelu(_norm(x, blk["ln2"]) @ blk["up"]) @ blk["down"]
    return _norm(x, params["ln"]) @ params["head"]


def xent(logits, y):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1))


@dataclasses.dataclass
class LM:
    vocab: GraphConst[int] = 256
    width: GraphConst[int] = 64
    layers: GraphConst[int] = 2
    seq: GraphConst[int] = 32

    def init(self, rng):
        return lm_init(rng, self.vocab, self.width, self.layers, self.seq)

    def forward(self, params, *, x):
        return lm_apply(params, x, 4)

    def loss(self, outputs, *, y):
        return xent(outputs, y)

    def optimizer(self):
        return optax.adam(1e-3)


def models(quick: bool) -> dict:
    """`name: (experiment, hand forward, hand loss, data, batch size)`, sized for the backend."""
    rng = np.random.default_rng(0)

    def reg(rows, width):
        x = rng.normal(size=(rows, width)).astype(np.float32)
        return {"x": x, "y": np.sin(x.sum(1)).astype(np.float32)}

    def tokens(rows, seq, vocab):
        t = rng.integers(0, vocab, size=(rows, seq + 1), dtype=np.int32)
        return {"x": t[:, :-1], "y": t[:, 1:]}

    tiny_steps = 128 if quick else 512
    if ACCEL:
        mid, mid_bs, mid_steps = (512, *[2048] * 8, 1), 512, 64
        lm, lm_bs, lm_steps = LM(8192, 768, 6, 256), 32, 16 if quick else 32
    else:
        mid, mid_bs, mid_steps = (64, *[256] * 4, 1), 128, 32 if quick else 64
        lm, lm_bs, lm_steps = LM(256, 64, 2, 32), 8, 16 if quick else 32
    out = {
        "dispatch-bound MLP 32-32-1, batch 64": (MLP((32, 32, 1)), reg(64 * tiny_steps, 32), 64),
        f"mid MLP {mid[0]}-{len(mid) - 2}x{mid[1]}-1, batch {mid_bs}": (MLP(mid), reg(mid_bs * mid_steps, mid[0]), mid_bs),
        f"causal LM {lm.layers}x{lm.width}, seq {lm.seq}, vocab {lm.vocab}, batch {lm_bs}":
            (lm, tokens(lm_bs * lm_steps, lm.seq, lm.vocab), lm_bs),
    }
    return out


# ---------------------------------------------------------------------------------------------- sides
class Hand:
    """The hand loop: per-epoch permutation, numpy batches, one jitted fused step, donated state."""

    def __init__(self, e, data: dict, batch_size: int):
        tx = e.optimizer()

        def step(params, opt_state, x, y):
            loss, grads = jax.value_and_grad(lambda p: e.loss(e.forward(p, x=x), y=y))(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self.step = jax.jit(step, donate_argnums=(0, 1))
        self.params = e.init(jax.random.PRNGKey(0))
        self.opt_state = tx.init(self.params)
        self.x, self.y, self.bs, self.epoch = data["x"], data["y"], batch_size, 0

    def run_epoch(self) -> int:
        n, bs = len(self.x), self.bs
        perm = np.random.default_rng((0, self.epoch)).permutation(n)
        step, params, opt_state, X, Y = self.step, self.params, self.opt_state, self.x, self.y
        losses = []
        for s in range(n // bs):
            idx = perm[s * bs:(s + 1) * bs]
            params, opt_state, loss = step(params, opt_state, X[idx], Y[idx])
            losses.append(loss)
        jax.block_until_ready((params, opt_state))
        float(np.mean(jax.device_get(losses)))  # the epoch's loss, read once, as nitro reads it
        self.params, self.opt_state = params, opt_state
        self.epoch += 1
        return n // bs


def nitro_side(e, data: dict, batch_size: int, per_execution: int = 1):
    n = Nitro(e, data={"train": data}, batch_size=batch_size, progress=False, steps_per_execution=per_execution)

    def run_epoch() -> int:
        n.train(1)
        jax.block_until_ready(n._params)
        return n.step

    return n, run_epoch


def timed(run_epoch, steps: int):
    """`(seconds, main-thread CPU seconds)` of one epoch."""
    t0, c0 = time.perf_counter(), time.thread_time()
    run_epoch()
    return time.perf_counter() - t0, time.thread_time() - c0


def steady(name: str, e, data: dict, bs: int, rounds: int, per_execution: int = 1) -> dict:
    steps = len(data["x"]) // bs
    nitro_ipy.cache_reset()  # each model's programs on their own (no miss explained against another model)
    hand = Hand(e, data, bs)
    _, nitro_epoch = nitro_side(e, data, bs, per_execution)
    hand.run_epoch()  # warm: compiles, autotuning, first transfers
    nitro_epoch()
    H.settle()
    a, b = H.interleaved(rounds, lambda: timed(nitro_epoch, steps), lambda: timed(hand.run_epoch, steps),
                         pause_gc=True)
    ratio = H.paired_ratio([x[0] for x in a], [x[0] for x in b])
    res = {"nitro_ms": 1e3 * statistics.median(x[0] for x in a) / steps,
           "hand_ms": 1e3 * statistics.median(x[0] for x in b) / steps, "ratio": ratio,
           "nitro_host_us": 1e6 * statistics.median(x[1] for x in a) / steps,
           "hand_host_us": 1e6 * statistics.median(x[1] for x in b) / steps, "steps": steps}
    label = name + (f", steps_per_execution={per_execution}" if per_execution > 1 else "")
    log(f"   {label:<66} {res['nitro_ms']:8.3f} {res['hand_ms']:8.3f}  {ratio:5.2f}x   "
        f"{res['nitro_host_us']:7.1f} {res['hand_host_us']:7.1f}")
    return res


# ---------------------------------------------------------------------------------------------- cold
def cold(model: str, side: str, quick: bool) -> float:
    """In a fresh process: seconds from nothing compiled to the end of the first epoch."""
    env = {**os.environ, "NITRO_IPY_CACHE_DIR": "", "JAX_COMPILATION_CACHE_DIR": "", "NITRO_IPY_AHEAD": "0"}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--cold-child", model, side, str(int(quick))],
                         env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return float(out.stdout.strip().splitlines()[-1])


def cold_child(model: str, side: str, quick: bool) -> None:
    e, data, bs = models(quick)[model]
    t0 = time.perf_counter()
    if side == "hand":
        Hand(e, data, bs).run_epoch()
    else:
        nitro_side(e, data, bs)[1]()
    print(time.perf_counter() - t0)


def _per_execution(text: str) -> tuple:
    ks = tuple(int(k) for k in text.split(",") if k.strip())
    if any(k < 1 for k in ks):
        raise ValueError(f"--per-execution takes positive step counts, like `4,16`; got {text!r}")
    return ks


def main() -> int:
    args = H.parse_args(__doc__, extra=lambda p: p.add_argument(
        "--per-execution", type=_per_execution, default=None, metavar="K,K",
        help="also time every model at these steps_per_execution (default: 16, on the dispatch-bound MLP)"))
    quick = H.quick()
    rounds = 3 if quick else 7
    log(H.env_line(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind})"))
    log("\n1. steady state (ms per optimizer step) and 2. per-step host us (main-thread CPU)")
    log(f"   {'model':<66} {'nitro':>8} {'hand':>8}  ratio   {'host us':>7} {'hand us':>7}")
    res, rows = {"steady": {}, "cold": {}}, []
    table = models(quick)
    for i, (name, (e, data, bs)) in enumerate(table.items()):
        r = res["steady"][name] = steady(name, e, data, bs, rounds)
        target = 0.8 if i < 2 else 1.0
        rows.append(H.at_most(f"steady, {name.split(',')[0]}", r["ratio"], target) if ACCEL else
                    H.Row(f"steady, {name.split(',')[0]}", f"{r['ratio']:.2f}x"))
        rows.append(H.Row(f"host us/step, {name.split(',')[0]} (nitro | hand)",
                          f"{r['nitro_host_us']:.0f} | {r['hand_host_us']:.0f}"))
        for k in (16,) if args.per_execution is None and i == 0 else args.per_execution or ():
            if k == 1:
                continue  # the default row above
            r = res["steady"][f"{name}, K={k}"] = steady(name, e, data, bs, rounds, per_execution=k)
            label = f"steady, {name.split(',')[0]}, steps_per_execution={k}"
            # The goal for K=16 is on the dispatch-bound MLP (the hand-written scan reaches 0.072x)
            goal = 0.1 if (i == 0 and k == 16 and ACCEL) else None
            rows.append(H.at_most(label, r["ratio"], goal) if goal else H.Row(label, f"{r['ratio']:.2f}x"))
            rows.append(H.Row(f"host us/step, K={k} (nitro | hand)", f"{r['nitro_host_us']:.0f} | {r['hand_host_us']:.0f}"))
    log("\n3. cold first epoch, each side in a fresh process (seconds)")
    for i, name in enumerate(table):
        if quick and i == 2:
            continue
        c = res["cold"][name] = {"nitro": cold(name, "nitro", quick), "hand": cold(name, "hand", quick)}
        c["ratio"] = c["nitro"] / c["hand"]
        log(f"   {name:<66} nitro {c['nitro']:.2f} s, hand {c['hand']:.2f} s ({c['ratio']:.2f}x)")
        rows.append(H.Row(f"cold first epoch, {name.split(',')[0]}", f"{c['ratio']:.2f}x"))
    log(f"\ntotal wall time {H.elapsed():.1f} s")
    return H.finish(res, rows)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--cold-child":
        cold_child(sys.argv[2], sys.argv[3], sys.argv[4] == "1")
    else:
        sys.exit(main())
