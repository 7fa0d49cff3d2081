"""Benchmark: a `Nitro(..., mesh=mesh)` handle on 4 simulated CPU devices against the sharded `jax.jit`
training step a JAX user writes by hand, with the same shardings.

Both sides train the same MLP (adam 1e-3) on the same data with the same host batching (a shuffled
permutation per epoch, numpy fancy indexing, partial batch dropped); both split each batch along the
mesh's `data` axis (`NamedSharding(mesh, P("data"))`) and replicate params and optimizer state. The
baseline is one fused `jax.jit(step, in_shardings=..., out_shardings=..., donate_argnums=...)` fed with
`jax.device_put(batch, batch_sharding)`. Epochs are interleaved (A B C D, then rotated); each ratio is
the median over rounds of (one side's epoch / the other side's epoch in the same round). When the
paired ratios spread wide (interquartile range over 10% of the median, a loaded machine), more rounds
run, up to three times as many.

Both sides stay at most `_sharding.CPU_STEPS_AHEAD` steps ahead of the devices, as the handle does on a
CPU mesh: XLA:CPU deadlocks when a few dozen launches of collective programs queue on simulated
devices, hand-written loop or not (this benchmark hung on it twice before the bound).

Targets (lower = nitro faster):
1. steady-state epoch on 4 devices, nitro / hand-written sharded step (one fused jit) ... <= 1.10x;
   for information, nitro against the same step written as two jits (gradient, update), as nitro runs it
2. per-step host overhead of sharding batches: the hand-written loop putting each batch on the mesh
   against the same loop on batches already resident on the mesh, in microseconds a step; and one
   `device_put` onto the 4-device sharding against one device: for information.

Usage:
    python3 benchmarks/bench_scale.py            # full run
    python3 benchmarks/bench_scale.py --quick    # CI smoke run
    python3 benchmarks/bench_scale.py --json out.json
"""

import os
import statistics
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
from nitro_ipy import Nitro  # noqa: E402
from nitro_ipy._base import _report, _sharding

TARGET = 1.10
# A dispatch-bound MLP: each step is a few microseconds of maths, so what shows is the per-step host
# work and the program launches.
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
    difference between the two baselines is what the second program launch costs on this mesh.
    `resident=True` shards the epoch's batches before the loop (not timed: `prepare`), so the loop
    only launches programs: against the same loop putting each batch, the host cost of sharding."""

    def __init__(self, mesh, params, data: dict, batch_size: int, split: bool = False, resident: bool = False):
        self.rep, self.split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        self.opt = optax.adam(1e-3)
        self.resident, self.ready = resident, None

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

    def host_batches(self):
        n, bs = len(self.x), self.batch_size
        perm = np.random.default_rng((0, self.epoch)).permutation(n)
        X, Y = self.x, self.y
        for s in range(n // bs):
            idx = perm[s * bs : (s + 1) * bs]
            yield X[idx], Y[idx]

    def prepare(self):
        """The resident side: this epoch's batches on the mesh, before the timed loop."""
        if self.resident:
            self.ready = jax.block_until_ready([jax.device_put(b, self.split) for b in self.host_batches()])

    def run_epoch(self):
        step, put, split, ahead = self.step, jax.device_put, self.split, _sharding.CPU_STEPS_AHEAD
        params, opt_state, losses = self.params, self.opt_state, []
        for x, y in (self.ready if self.resident else self.host_batches()):
            if not self.resident:
                x, y = put((x, y), split)
            params, opt_state, loss = step(params, opt_state, x, y)
            losses.append(loss)
            if len(losses) > ahead:  # the run-ahead bound a CPU mesh needs (see the module docstring)
                losses[-ahead - 1].block_until_ready()
        jax.block_until_ready((params, opt_state))
        self.params, self.opt_state, self.ready = params, opt_state, None
        self.epoch += 1
        return float(np.mean(jax.device_get(losses)))


def epoch_seconds(run, prepare=None):
    if prepare is not None:
        prepare()
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def spread(a: list, b: list) -> float:
    """The interquartile range of the paired ratios a / b over their median: how noisy the rounds were."""
    r = H.paired_ratios(a, b)
    q = statistics.quantiles(r, n=4) if len(r) > 1 else [r[0]] * 3
    return (q[2] - q[0]) / statistics.median(r)


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
    """Interleaved steady-state epochs of the handle and the hand-written loops on one MLP size."""
    e = cells.module.ScaleMLP(in_dim=cfg["in_dim"], width=cfg["width"], depth=cfg["depth"])
    data = M.make_data(cfg["batch"] * cfg["steps"], cfg["in_dim"])
    n = Nitro(e, data={"train": data}, batch_size=cfg["batch"], max_epochs=1, progress=False, mesh=mesh)
    init = lambda: M.init_mlp(jax.random.PRNGKey(0), cfg["in_dim"], cfg["width"], cfg["depth"])  # noqa: E731
    base = ShardedBaseline(mesh, init(), data, cfg["batch"])
    split = ShardedBaseline(mesh, init(), data, cfg["batch"], split=True)
    resident = ShardedBaseline(mesh, init(), data, cfg["batch"], resident=True)
    n.train()
    for side in (base, split, resident):  # warm: all compiled
        side.prepare()
        side.run_epoch()
    misses = nitro_ipy.cache_stats().misses
    sides = (lambda: epoch_seconds(n.train), lambda: epoch_seconds(base.run_epoch),
             lambda: epoch_seconds(split.run_epoch), lambda: epoch_seconds(resident.run_epoch, resident.prepare))
    times = H.interleaved(cfg["rounds"], *sides, pause_gc=True)
    rounds = cfg["rounds"]
    while spread(times[0], times[1]) > 0.10 and rounds < 3 * cfg["rounds"]:  # noisy: more rounds
        for t, more in zip(times, H.interleaved(cfg["rounds"], *sides, pause_gc=True)):
            t.extend(more)
        rounds += cfg["rounds"]
    assert nitro_ipy.cache_stats().misses == misses, "a timed epoch compiled"
    nitro_t, base_t, split_t, resident_t = times
    steps = cfg["steps"]
    per_step = lambda t: statistics.median(t) / steps * 1e6  # noqa: E731
    return {"ratio": H.paired_ratio(nitro_t, base_t), "split_ratio": H.paired_ratio(nitro_t, split_t),
            "two_programs_ratio": H.paired_ratio(split_t, base_t), "rounds": rounds,
            "spread": spread(nitro_t, base_t),
            "put_overhead_us": statistics.median(b - r for b, r in zip(base_t, resident_t)) / steps * 1e6,
            "nitro_step_us": per_step(nitro_t), "baseline_step_us": per_step(base_t),
            "resident_step_us": per_step(resident_t),
            "_batch": {"x": data["x"][: cfg["batch"]], "y": data["y"][: cfg["batch"]]}}


def main(argv=None) -> int:
    H.parse_args(__doc__, argv)
    return measure()


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
        log(f"{name}: {c['depth']} x {c['width']} MLP, batch {c['batch']}, {c['steps']} steps, {r['rounds']} "
            f"rounds (spread {r['spread']:.0%}): nitro {r['nitro_step_us']:.0f} us/step, hand-written sharded jit "
            f"{r['baseline_step_us']:.0f} us/step, on resident batches {r['resident_step_us']:.0f} us/step")
        rows.append(H.Row(f"{name} epoch, nitro / sharded jax.jit", f"{r['ratio']:.3f}x", f"<= {TARGET:.2f}x",
                          r["ratio"] <= TARGET))
        rows.append(H.Row(f"{name} epoch, nitro / the same as two jits", f"{r['split_ratio']:.3f}x"))
        rows.append(H.Row(f"{name} epoch, two jits / one", f"{r['two_programs_ratio']:.3f}x"))
        rows.append(H.Row(f"{name} host overhead of sharding batches", f"{r['put_overhead_us']:.0f} us/step"))
    batch = res["tiny"]["_batch"]
    sharded_us = put_microseconds(batch, NamedSharding(mesh, P("data")), cfg["puts"])
    single_us = put_microseconds(batch, jax.devices()[0], cfg["puts"])
    res.update(put_sharded_us=sharded_us, put_one_device_us=single_us)
    rows += [
        H.Row(f"batch of {len(batch['x'])} put onto 4-device sharding", f"{sharded_us:.0f} us"),
        H.Row(f"batch of {len(batch['x'])} put onto one device", f"{single_us:.0f} us"),
        H.Row("one put: 4-device sharding - one device", f"{sharded_us - single_us:.0f} us"),
    ]
    return H.finish(res, rows)


if __name__ == "__main__":
    sys.exit(main())
