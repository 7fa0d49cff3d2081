"""Benchmark: memory over a long edit session, nitro_ipy against a plain-JAX notebook doing the same work.

Two fresh interpreters, each running a real `InteractiveShell` through the same session of cells: a tiny
MLP is trained for one short epoch and asked for a prediction in every cell, and every few cells a cell
edits the helper the loss calls (a new constant, as a user tuning a loss would). The nitro_ipy side has the
extension loaded and rebuilds its handle after each edit (`n = n.rebuild()`); the plain side re-runs the
cell that defines its `jax.jit` step and predict functions, which is what picking up an edit costs in plain
JAX. Resident memory (`/proc/self/statm`) is read after the warm-up cells and at the end.

Target: the nitro_ipy session's RSS growth <= 1.10x the plain session's (+10%); each poisoned program's
executable is released once no handle holds it, so edits do not accumulate dead programs.

Then the memory training needs (issue 33), each in a fresh interpreter, a linear model so the data
dominates, programs compiled beforehand: the peak RSS growth (VmHWM, reset before `train()`) of two
epochs of a host split (1 GiB; quick: 256 MiB), the anonymous memory growth of an epoch of a sparse
memory-mapped `.npy` (4 GiB; quick: 1 GiB: its pages are the page cache's, reclaimable), and the growth
of two epochs of a loader (a generator function making the same batches on the fly). Target: each
<= 25% of the split's size (the whole-epoch gather this replaced took +200%).

Usage:
    python3 benchmarks/bench_memory.py            # 300 cells, 50 edits (~2 min on 2 cores)
    python3 benchmarks/bench_memory.py --quick    # 30 cells, 5 edits (CI smoke run)
    python3 benchmarks/bench_memory.py --json out.json
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as H  # noqa: E402
from _harness import log  # noqa: E402

TARGET = 1.10
FULL = dict(cells=300, edits=50, warmup=30, data_mib=1024, mmap_mib=4096)
QUICK = dict(cells=30, edits=5, warmup=8, data_mib=256, mmap_mib=1024)
DATA_TARGET = 0.25

DATA_CHILD = """
import dataclasses, json, os, sys
import jax.numpy as jnp, numpy as np
from nitro_ipy import Nitro

def status():
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out

@dataclasses.dataclass
class Lin:
    def init(self, rng):
        return {"w": jnp.zeros((WIDTH,))}
    def forward(self, params, *, x):
        return x @ params["w"]
    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)

KIND, MIB, PATH = sys.argv[1], int(sys.argv[2]), sys.argv[3]
WIDTH, BATCH = 1024, 1024
ROWS = (MIB << 20) // (WIDTH * 4)
y = np.zeros(ROWS, np.float32)
warm = Nitro(Lin(), data={"train": {"x": np.ones((BATCH, WIDTH), np.float32), "y": y[:BATCH]}},
             batch_size=BATCH, progress=False)
warm.train(1)
if KIND == "host":
    split, epochs = {"x": np.ones((ROWS, WIDTH), np.float32), "y": y}, 2
elif KIND == "mmap":
    np.lib.format.open_memmap(PATH, mode="w+", dtype=np.float32, shape=(ROWS, WIDTH)).flush()
    split, epochs = {"x": np.load(PATH, mmap_mode="r"), "y": y}, 1
else:
    def split():
        for i in range(ROWS // BATCH):
            yield {"x": np.full((BATCH, WIDTH), i % 7, np.float32), "y": y[:BATCH]}
    epochs = 2
n = Nitro(Lin(), data={"train": split}, batch_size=BATCH, progress=False)
before = status()
open("/proc/self/clear_refs", "w").write("5")
n.train(epochs)
after = status()
if KIND == "mmap":
    os.remove(PATH)
print(json.dumps({"before": before, "after": after, "steps": n.step}))
"""


def data_side(kind: str, mib: int) -> dict:
    folder = tempfile.mkdtemp(prefix="bench_memory_")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "NITRO_IPY_AHEAD": "0"}
    try:
        out = subprocess.run([sys.executable, "-c", DATA_CHILD, kind, str(mib), os.path.join(folder, "x.npy")],
                             env=env, capture_output=True, text=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if out.returncode != 0:
        raise RuntimeError(f"the {kind} data run failed:\n{out.stderr[-4000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if kind == "mmap":
        return {**got, "growth_mib": (got["after"]["RssAnon"] - got["before"]["RssAnon"]) / (1 << 20)}
    return {**got, "growth_mib": (got["after"]["VmHWM"] - got["before"]["VmRSS"]) / (1 << 20)}

COMMON = """
import jax, jax.numpy as jnp, numpy as np, optax
rs = np.random.RandomState(0)
X = rs.normal(size=(256, 8)).astype(np.float32)
Y = np.sin(X.sum(1)).astype(np.float32)
def act(z):
    return jnp.tanh(z) * 1.0
"""

NITRO_SETUP = COMMON + """
import dataclasses
from nitro_ipy import Device, GraphConst, Nitro

@dataclasses.dataclass
class MLP:
    hidden: GraphConst[int] = 32
    lr: Device[float] = 1e-2

    def init(self, rng):
        k1, k2 = jax.random.split(rng)
        return {"w1": jax.random.normal(k1, (8, self.hidden)) * 0.3, "w2": jax.random.normal(k2, (self.hidden,)) * 0.3}

    def forward(self, params, *, x):
        return act(x @ params["w1"]) @ params["w2"]

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)

    def optimizer(self):
        return optax.adam(self.lr)

n = Nitro(MLP(), data={"train": {"x": X, "y": Y}}, batch_size=32, progress=False)
"""
NITRO_WORK = "n.train(); p = n.predict({'x': X[:32]})"
NITRO_EDIT = "def act(z):\n    return jnp.tanh(z) * {c}\n"
NITRO_AFTER_EDIT = "n = n.rebuild()"

PLAIN_SETUP = COMMON + """
tx = optax.adam(1e-2)
k1, k2 = jax.random.split(jax.random.PRNGKey(0))
params = {"w1": jax.random.normal(k1, (8, 32)) * 0.3, "w2": jax.random.normal(k2, (32,)) * 0.3}
opt_state = tx.init(params)
"""
PLAIN_JIT = """
def forward(params, x):
    return act(x @ params["w1"]) @ params["w2"]

@jax.jit
def step(params, opt_state, x, y):
    loss, g = jax.value_and_grad(lambda p: jnp.mean((forward(p, x) - y) ** 2))(params)
    updates, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

predict = jax.jit(forward)
"""
PLAIN_WORK = """
for i in range(0, 256, 32):
    params, opt_state, loss = step(params, opt_state, X[i:i + 32], Y[i:i + 32])
p = np.asarray(predict(params, X[:32]))
"""
PLAIN_EDIT = NITRO_EDIT


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(side: str, cells: int, edits: int, warmup: int) -> dict:
    """One session in this process: returns RSS after the warm-up and at the end, and the cache figures."""
    import io
    from contextlib import redirect_stdout

    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    every = max(1, (cells - warmup) // edits) if edits else 0
    sink = io.StringIO()

    def cell(src):
        with redirect_stdout(sink):
            r = ip.run_cell(src, silent=True)
        if not r.success:
            raise RuntimeError(f"cell failed: {r.error_in_exec or r.error_before_exec}\n{src}")
        sink.seek(0)
        sink.truncate()

    if side == "nitro":
        cell("%load_ext nitro_ipy")
        cell(NITRO_SETUP)
    else:
        cell(PLAIN_SETUP)
        cell(PLAIN_JIT)
    done = 0
    start = None
    for i in range(cells):
        if i == warmup:
            import gc

            gc.collect()
            start = _rss()
        if every and i >= warmup // 2 and i % every == 0 and done < edits:
            done += 1
            cell(NITRO_EDIT.format(c=1.0 + 0.01 * done))
            cell(NITRO_AFTER_EDIT if side == "nitro" else PLAIN_JIT)
        cell(NITRO_WORK if side == "nitro" else PLAIN_WORK)
    import gc

    gc.collect()
    end = _rss()
    out = {"side": side, "start": start, "end": end, "edits": done}
    if side == "nitro":
        import nitro_ipy
        from nitro_ipy._compiler import _cache

        out["stats"] = list(nitro_ipy.cache_stats())
        out["held_poisoned"] = sum(1 for e in _cache.poisoned_entries() if e.call is not None)
    return out


def run_side(side: str, cfg: dict) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    args = [sys.executable, os.path.abspath(__file__), "--child", side, str(cfg["cells"]), str(cfg["edits"]),
            str(cfg["warmup"])]
    out = subprocess.run(args, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the {side} session failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        side, cells, edits, warmup = sys.argv[2], *map(int, sys.argv[3:6])
        print(json.dumps(child(side, cells, edits, warmup)))
        return 0
    H.parse_args(__doc__)
    cfg = QUICK if H.quick() else FULL
    log(H.env_line(f"{cfg['cells']} cells, {cfg['edits']} edits"))
    plain = run_side("plain", cfg)
    nitro = run_side("nitro", cfg)
    mib = 1 << 20
    grow_plain = (plain["end"] - plain["start"]) / mib
    grow_nitro = (nitro["end"] - nitro["start"]) / mib
    # A growth below a MiB is the allocator's noise: judge against at least that much.
    ratio = max(grow_nitro, 0.0) / max(grow_plain, 1.0)
    rows = [
        H.Row("plain-JAX session: RSS growth", f"{grow_plain:.1f} MiB"),
        H.Row("nitro_ipy session: RSS growth", f"{grow_nitro:.1f} MiB"),
        H.Row("nitro / plain RSS growth", f"{ratio:.2f}x", f"<= {TARGET:.2f}x", ratio <= TARGET),
        H.Row("nitro_ipy RSS at the end / plain", f"{nitro['end'] / plain['end']:.2f}x"),
        H.Row("poisoned programs still holding an executable", str(nitro["held_poisoned"]), "0",
              nitro["held_poisoned"] == 0),
    ]
    data = {"host": (data_side("host", cfg["data_mib"]), cfg["data_mib"], "host split, 2 epochs: peak RSS growth"),
            "mmap": (data_side("mmap", cfg["mmap_mib"]), cfg["mmap_mib"], "memory-mapped .npy, 1 epoch: anon growth"),
            "loader": (data_side("loader", cfg["data_mib"]), cfg["data_mib"], "loader, 2 epochs: peak RSS growth")}
    for kind, (got, mib, label) in data.items():
        share = got["growth_mib"] / mib
        rows.append(H.Row(f"{label} ({mib} MiB)", f"{got['growth_mib']:.0f} MiB ({share:.0%})",
                          f"<= {DATA_TARGET:.0%}", share <= DATA_TARGET))
    res = {"config": cfg, "plain": plain, "nitro": nitro, "growth_ratio": ratio,
           "data": {k: {"mib": mib, **got} for k, (got, mib, _) in data.items()}}
    return H.finish(res, rows)


if __name__ == "__main__":
    sys.exit(main())
