"""Benchmark: a kernel restart, and a checkpoint save, on the 120-layer MLP.

Kernel restart: a fresh process runs the same cells (define the experiment, build the handle, train one
epoch) twice in a row against one cache directory: the first is cold, the second is the restart. The
same two-process setup runs the hand-written `jax.jit` loop with JAX's persistent compilation cache.
Each figure is the time from the first cell to the end of the first epoch (imports excluded: the same on
both sides); a round is one cold and one warm process on a fresh directory, and the ratio is the median
over rounds.

Targets:
1. nitro restart / nitro cold ............................................... <= 0.20x
2. nitro's restart ratio <= half of the jax.jit loop's ratio with JAX's persistent cache
3. a checkpoint save of the 120-layer MLP's state (params + adam state) .... < 10% of an epoch
   (what training waits for: the manifest and the host copy; the file write and fsyncs are committed
   in the background while the next epoch trains, and reported beside it, with the epoch they overlap)

Usage:
    python3 benchmarks/bench_restart.py            # 3 rounds (~2 min on 2 cores)
    python3 benchmarks/bench_restart.py --quick    # 1 round on a 16-layer MLP (CI smoke)
    python3 benchmarks/bench_restart.py --json out.json
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CFG = dict(in_dim=16, width=32, depth=120, batch=64, steps=48)
TARGETS = {"restart": 0.20, "vs_jax_cache": 0.50, "save": 0.10}


def child(mode: str, cache: str) -> dict:
    """One process's cells: `nitro` (the program store in `cache`) or `jit` (JAX's cache in `cache`)."""
    sys.path.insert(0, HERE)
    import jax

    import _models as M  # its `_harness` turns the store off for every other benchmark: on again after it

    if mode == "nitro":
        os.environ["NITRO_IPY_CACHE_DIR"] = cache

    if mode == "jit":
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    import nitro_ipy
    from nitro_ipy import Nitro
    from nitro_ipy._base import _report

    lines = []
    _report.set_sink(lambda m: lines.append(m.text))
    data = M.make_data(CFG["batch"] * CFG["steps"], CFG["in_dim"])
    t0 = time.perf_counter()
    cells = M.Cells()
    out = {}
    if mode == "nitro":
        cls = cells.define_experiment("Deep", in_dim=CFG["in_dim"], width=CFG["width"], depth=CFG["depth"])
        n = Nitro(cls(), data={"train": data}, batch_size=CFG["batch"], max_epochs=1, progress=False)
        n.train()
        jax.block_until_ready(n.params)
        out["first_epoch_s"] = time.perf_counter() - t0
        from nitro_ipy._training import _checkpoint

        parts = {k: [] for k in ("save", "save_waited", "manifest", "host_copy", "commit", "epoch_after_save",
                                 "epoch")}
        with tempfile.TemporaryDirectory() as d:
            for i in range(5):  # each save after an epoch, as in training (fresh buffers, the last commit done)
                t2 = time.perf_counter()
                n.train()  # an epoch with no commit under way: the save's yardstick
                jax.block_until_ready(n.params)
                parts["epoch"].append(time.perf_counter() - t2)
                t2 = time.perf_counter()
                n.save(os.path.join(d, f"c{i}"))  # what training waits for: the state on the host
                parts["save"].append(time.perf_counter() - t2)
                t3 = time.perf_counter()
                n.train()  # the epoch the background commit overlaps
                jax.block_until_ready(n.params)
                parts["epoch_after_save"].append(time.perf_counter() - t3)
                t2 = time.perf_counter()
                n.save(os.path.join(d, f"w{i}"), wait=True)  # committed: on disk, fsync'ed
                parts["save_waited"].append(time.perf_counter() - t2)
                t2 = time.perf_counter()
                _checkpoint.manifest(n)
                t3 = time.perf_counter()
                info, blob = _checkpoint.snapshot(n)
                t4 = time.perf_counter()
                _checkpoint.commit(os.path.join(d, f"p{i}.nitro.npz"), info, blob)
                t5 = time.perf_counter()
                parts["manifest"].append(t3 - t2)
                parts["host_copy"].append(t4 - t3 - (t3 - t2))  # the snapshot less its manifest
                parts["commit"].append(t5 - t4)
        out.update({f"{k}_s": statistics.median(v) for k, v in parts.items()})  # `epoch_s`: median of 5
        out["from_disk"] = sum(" from disk " in line for line in lines if line.startswith("nitro_ipy: compiled"))
        out["compiled"] = sum(line.startswith("nitro_ipy: compiled") for line in lines)
        out["stats"] = list(nitro_ipy.cache_stats())
    else:
        step, opt = cells.define_baseline()
        b = M.Baseline(step, opt, M.init_mlp(jax.random.PRNGKey(0), CFG["in_dim"], CFG["width"], CFG["depth"]),
                       data, CFG["batch"])
        b.run_epoch()
        out["first_epoch_s"] = time.perf_counter() - t0
    return out


def run_child(mode: str, cache: str) -> dict:
    env = {**os.environ}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, cache, str(CFG["depth"])]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-2000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        CFG["depth"] = int(sys.argv[4])
        print(json.dumps(child(sys.argv[2], sys.argv[3])))
        return 0
    sys.path.insert(0, HERE)
    import _harness as H

    H.parse_args(__doc__)
    rounds = 1 if H.quick() else 3
    if H.quick():
        CFG["depth"] = H.QUICK_DEPTH
    H.log(H.env_line(f"{rounds} round(s)", f"{CFG['depth']}-layer MLP"))
    # A round: one cold and one warm process per side, on a fresh directory; sides alternate per round.
    rows = {"nitro": [], "jit": []}

    def side(mode):
        def run():
            with tempfile.TemporaryDirectory() as d:
                os.chmod(d, 0o700)
                cold = run_child(mode, d)
                warm = run_child(mode, d)
            if mode == "nitro":  # the restart loaded grad and opt, traced and compiled nothing
                assert warm["from_disk"] == warm["compiled"] == 2 and cold["from_disk"] == 0, (cold, warm)
            rows[mode].append((cold, warm))
            return warm["first_epoch_s"] / cold["first_epoch_s"]
        return run

    ratio_n, ratio_j = H.interleaved(rounds, side("nitro"), side("jit"))
    restart, jit_restart = statistics.median(ratio_n), statistics.median(ratio_j)
    vs = H.paired_ratio(ratio_n, ratio_j)
    saves = [w["save_s"] / w["epoch_s"] for _, w in rows["nitro"]]
    med = {m: (statistics.median(c["first_epoch_s"] for c, _ in r), statistics.median(w["first_epoch_s"] for _, w in r))
           for m, r in rows.items()}
    res = {
        "restart": restart, "jit_restart_with_jax_cache": jit_restart, "vs_jax_cache": vs,
        "save_of_epoch": statistics.median(saves),
        "seconds": {m: {"cold": c, "restart": w} for m, (c, w) in med.items()},
        "epoch_s": statistics.median(w["epoch_s"] for _, w in rows["nitro"]),
        "save_s": statistics.median(w["save_s"] for _, w in rows["nitro"]),
        "save_parts_s": {k: statistics.median(w[f"{k}_s"] for _, w in rows["nitro"])
                         for k in ("save_waited", "manifest", "host_copy", "commit", "epoch_after_save")},
    }
    H.log(f"{CFG['depth']}-layer MLP, {CFG['steps']} steps of {CFG['batch']}: first cell to the end of epoch 1, medians")
    for m, label in (("nitro", "nitro_ipy (program store)"), ("jit", "jax.jit loop (JAX's persistent cache)")):
        c, w = med[m]
        H.log(f"  {label:38s} cold {c:6.2f} s  restart {w:6.2f} s")
    rows_out = [
        H.Row("restart / cold, nitro_ipy", f"{restart:.3f}x", f"<= {TARGETS['restart']}", restart <= TARGETS["restart"]),
        H.Row("restart / cold, jax.jit + JAX cache", f"{jit_restart:.3f}x"),
        H.Row("nitro's ratio / jax.jit's ratio", f"{vs:.3f}", f"<= {TARGETS['vs_jax_cache']}", vs <= TARGETS["vs_jax_cache"]),
        H.Row("checkpoint save / epoch", f"{res['save_of_epoch']:.3f}", f"< {TARGETS['save']}",
              res["save_of_epoch"] < TARGETS["save"]),
        H.Row("checkpoint save, training waits (ms)", f"{res['save_s'] * 1e3:.1f}"),
        H.Row("  of which the manifest (ms)", f"{res['save_parts_s']['manifest'] * 1e3:.2f}"),
        H.Row("  of which the host copy (ms)", f"{res['save_parts_s']['host_copy'] * 1e3:.2f}"),
        H.Row("background commit: write+fsync+rename+dir fsync (ms)", f"{res['save_parts_s']['commit'] * 1e3:.1f}"),
        H.Row("checkpoint save, waited for the commit / epoch",
              f"{res['save_parts_s']['save_waited'] / res['epoch_s']:.3f}"),
        H.Row("epoch overlapping a commit / steady epoch",
              f"{res['save_parts_s']['epoch_after_save'] / res['epoch_s']:.3f}"),
        H.Row("steady epoch, no commit under way (s)", f"{res['epoch_s']:.3f}"),
    ]
    return H.finish(res, rows_out)


if __name__ == "__main__":
    sys.exit(main())
