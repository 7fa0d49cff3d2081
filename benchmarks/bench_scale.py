"""Benchmark: a `Nitro(..., mesh=mesh)` handle on 4 simulated CPU devices against the sharded `jax.jit`
training step a JAX user writes by hand, with the same shardings.

Both sides train the same MLP (adam 1e-3) on the same data with the same host batching (a shuffled
permutation per epoch, numpy fancy indexing, partial batch dropped); both split each batch along the
mesh's `data` axis (`NamedSharding(mesh, P("data"))`) and replicate params and optimizer state. The
baseline is one fused `jax.jit(step, in_shardings=..., out_shardings=..., donate_argnums=...)` fed with
`jax.device_put(batch, batch_sharding)`. Epochs are interleaved (A B B A ...); the ratio is the median
over rounds of (nitro epoch / the adjacent baseline epoch).

Targets (lower = nitro faster):
1. steady-state epoch on 4 devices, nitro / hand-written sharded step (one fused jit) ... <= 1.10x;
   for information, nitro against the same step written as two jits (gradient, update), as nitro runs it
2. per-step host cost of sharding a batch (`device_put` onto the 4-device sharding), in microseconds,
   next to putting the same batch on one device: for information.

The 4-device part runs in a child Python with a time limit (`--timeout`, default 300 s quick, 3600 s
full): on this 2-core machine a 4-device XLA:CPU all-reduce deadlocked once (every XLA thread parked, no
CPU used). A child that runs out of time is killed and reported as a row of information, not a crash;
a child that fails still fails the run (CI's smoke check runs every `bench_*.py --quick`).

Usage:
    python3 benchmarks/bench_scale.py            # full run
    python3 benchmarks/bench_scale.py --quick    # CI smoke run
    python3 benchmarks/bench_scale.py --json out.json
"""

import os
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)  # before the CPU backend starts

import _harness as H  # noqa: E402
import _models as M  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _harness import log  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import nitro_ipy  # noqa: E402
from nitro_ipy import Nitro, _report  # noqa: E402

TARGET = 1.10
# A dispatch-bound MLP: each step is a few microseconds of maths, so what shows is the per-step host
# work and the program launches. (A 2 x 512 MLP at batch 256 was dropped: on this 2-core machine its
# 4-device all-reduce deadlocked once, every XLA thread parked, in a run that also ran the baselines.)
FULL = dict(tiny=dict(in_dim=8, width=32, depth=2, batch=64, steps=200, rounds=21), puts=2000)
QUICK = dict(tiny=dict(in_dim=8, width=32, depth=2, batch=64, steps=60, rounds=5), puts=300)

EXPERIMENT = '''
import dataclasses
import jax.numpy as jnp, optax
from nitro_ipy import GraphConst
import _models as M

@dataclasses.dataclass
class ScaleMLP:
    in_dim: GraphConst[int] = 8
    width: GraphConst[int] = 32
    depth: GraphConst[int] = 2

    def init(self, rng):
        return M.init_mlp(rng, self.in_dim, self.width, self.depth)

    def forward(self, params, *, x):
        return M.mlp_forward(params, x)

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)

    def optimizer(self):
        return optax.adam(1e-3)
'''


class ShardedBaseline:
    """The hand-written loop: one fused jitted step with explicit shardings, each batch put on the mesh.
    `split=True` writes it as two jitted programs (gradient, then update), as nitro runs it: the
    difference between the two baselines is what the second program launch costs on this mesh."""

    def __init__(self, mesh, params, data: dict, batch_size: int, split: bool = False):
        self.rep, self.split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        self.opt = optax.adam(1e-3)

        def step(params, opt_state, x, y):
            loss, grads = jax.value_and_grad(lambda p: jnp.mean((M.mlp_forward(p, x) - y) ** 2))(params)
            updates, opt_state = self.opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self.step = jax.jit(step, in_shardings=(self.rep, self.rep, self.split, self.split),
                            out_shardings=(self.rep, self.rep, self.rep), donate_argnums=(0, 1))
        if split:
            def grad(params, x, y):
                return jax.value_and_grad(lambda p: jnp.mean((M.mlp_forward(p, x) - y) ** 2))(params)

            def update(params, grads, opt_state):
                updates, opt_state = self.opt.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state

            g = jax.jit(grad, in_shardings=(self.rep, self.split, self.split), out_shardings=self.rep)
            u = jax.jit(update, out_shardings=self.rep, donate_argnums=(0, 2))

            def two(params, opt_state, x, y):
                loss, grads = g(params, x, y)
                return (*u(params, grads, opt_state), loss)

            self.step = two
        self.params = jax.device_put(params, self.rep)
        self.opt_state = jax.device_put(self.opt.init(params), self.rep)
        self.x, self.y, self.batch_size, self.epoch = data["x"], data["y"], batch_size, 0

    def run_epoch(self):
        n, bs = len(self.x), self.batch_size
        perm = np.random.default_rng((0, self.epoch)).permutation(n)
        step, put, split = self.step, jax.device_put, self.split
        params, opt_state, X, Y, losses = self.params, self.opt_state, self.x, self.y, []
        for s in range(n // bs):
            idx = perm[s * bs : (s + 1) * bs]
            x, y = put((X[idx], Y[idx]), split)
            params, opt_state, loss = step(params, opt_state, x, y)
            losses.append(loss)
        jax.block_until_ready((params, opt_state))
        self.params, self.opt_state = params, opt_state
        self.epoch += 1
        return float(np.mean(jax.device_get(losses)))


def epoch_seconds(run) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def put_microseconds(batch: dict, sharding, count: int) -> float:
    """Median over 5 blocks of the per-call time of `jax.device_put(batch, sharding)`, waited for."""
    blocks = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(count // 5):
            jax.block_until_ready(jax.device_put(batch, sharding))
        blocks.append((time.perf_counter() - t0) / (count // 5) * 1e6)
    return statistics.median(blocks)


def compare(cells, mesh, cfg: dict) -> dict:
    """Interleaved steady-state epochs of the handle and the hand-written step on one MLP size."""
    e = cells.module.ScaleMLP(in_dim=cfg["in_dim"], width=cfg["width"], depth=cfg["depth"])
    data = M.make_data(cfg["batch"] * cfg["steps"], cfg["in_dim"])
    n = Nitro(e, data={"train": data}, batch_size=cfg["batch"], max_epochs=1, progress=False, mesh=mesh)
    base = ShardedBaseline(mesh, M.init_mlp(jax.random.PRNGKey(0), cfg["in_dim"], cfg["width"], cfg["depth"]),
                           data, cfg["batch"])
    split = ShardedBaseline(mesh, M.init_mlp(jax.random.PRNGKey(0), cfg["in_dim"], cfg["width"], cfg["depth"]),
                            data, cfg["batch"], split=True)
    n.train()
    base.run_epoch()  # warm: all compiled
    split.run_epoch()
    misses = nitro_ipy.cache_stats().misses
    nitro_t, base_t, split_t = H.interleaved(cfg["rounds"], lambda: epoch_seconds(n.train),
                                             lambda: epoch_seconds(base.run_epoch),
                                             lambda: epoch_seconds(split.run_epoch), pause_gc=True)
    assert nitro_ipy.cache_stats().misses == misses, "a timed epoch compiled"
    steps = cfg["steps"]
    return {"ratio": H.paired_ratio(nitro_t, base_t), "split_ratio": H.paired_ratio(nitro_t, split_t),
            "two_programs_ratio": H.paired_ratio(split_t, base_t),
            "nitro_step_us": statistics.median(nitro_t) / steps * 1e6,
            "baseline_step_us": statistics.median(base_t) / steps * 1e6,
            "_batch": {"x": data["x"][: cfg["batch"]], "y": data["y"][: cfg["batch"]]}}


def _extra_args(p):
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="time limit of the 4-device child run (default: 300 quick, 3600 full)")
    p.add_argument("--in-child", action="store_true", help="(internal) be the 4-device run itself")


def main(argv=None) -> int:
    args = H.parse_args(__doc__, argv, extra=_extra_args)
    if not args.in_child:
        return supervise(sys.argv[1:] if argv is None else list(argv), args)
    return measure()


def supervise(argv: list, args) -> int:
    """Run `measure` in a child Python (the same arguments plus `--in-child`; its report and JSON go
    to this process's stdout and stderr as they are), killed after the time limit. Returns the child's
    exit code; a timeout is reported, with exit code 0."""
    limit = args.timeout if args.timeout is not None else (300.0 if H.quick() else 3600.0)
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--in-child"]
    child = subprocess.Popen(cmd, start_new_session=True)  # its own group: a kill takes XLA's threads too
    try:
        return child.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    log(f"the 4-device run did not finish in {limit:.0f} s and was killed (a 4-device XLA:CPU all-reduce "
        f"deadlocked like this once on a 2-core machine): no figures this run")
    res = {"timeout_s": limit, "timed_out": True}
    return H.finish(res, [H.Row("4-device run", f"timeout {limit:.0f} s")])


def measure() -> int:
    cfg = QUICK if H.quick() else FULL
    log(H.env_line(f"{jax.device_count()} devices"))
    _report.set_sink(lambda msg: None)  # compile lines would interleave with the report
    cells = M.Cells("nitro_bench_scale_cells")
    cells.run(EXPERIMENT)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    res = {"config": cfg}
    rows = []
    for name in ("tiny",):
        c = cfg[name]
        r = res[name] = compare(cells, mesh, c)
        log(f"{name}: {c['depth']} x {c['width']} MLP, batch {c['batch']}, {c['steps']} steps: nitro "
            f"{r['nitro_step_us']:.0f} us/step, hand-written sharded jit {r['baseline_step_us']:.0f} us/step")
        rows.append(H.Row(f"{name} epoch, nitro / sharded jax.jit", f"{r['ratio']:.3f}x", f"<= {TARGET:.2f}x",
                          r["ratio"] <= TARGET))
        rows.append(H.Row(f"{name} epoch, nitro / the same as two jits", f"{r['split_ratio']:.3f}x"))
        rows.append(H.Row(f"{name} epoch, two jits / one", f"{r['two_programs_ratio']:.3f}x"))
    batch = res["tiny"]["_batch"]
    sharded_us = put_microseconds(batch, NamedSharding(mesh, P("data")), cfg["puts"])
    single_us = put_microseconds(batch, jax.devices()[0], cfg["puts"])
    res.update(put_sharded_us=sharded_us, put_one_device_us=single_us)
    rows += [
        H.Row(f"batch of {len(batch['x'])} put onto 4-device sharding", f"{sharded_us:.0f} us"),
        H.Row(f"batch of {len(batch['x'])} put onto one device", f"{single_us:.0f} us"),
        H.Row("host overhead of sharding a batch", f"{sharded_us - single_us:.0f} us/step"),
    ]
    return H.finish(res, rows)


if __name__ == "__main__":
    sys.exit(main())
