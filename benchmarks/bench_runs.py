"""Benchmark: a background run's steady-state step against a foreground one, same process, same model.

Two handles on the same tiny dispatch-bound MLP (the case where any per-step cost of the worker thread
would show): one trains an epoch with `n.train(1)`, the other with `n.train(1, background=True).wait()`
while the main thread waits (as a notebook kernel's main thread idles between cells). Both are warmed up
(programs compiled, first epoch discarded); epochs are interleaved (A B B A ...) and the ratio is the median
over rounds of (background epoch / the adjacent foreground epoch), so load on a shared machine hits both
sides of a pair alike. The background epoch includes starting and joining its thread.

Target: background / foreground steady-state epoch <= 1.05x.

Usage:
    python3 benchmarks/bench_runs.py            # full run (~1 min on 2 cores)
    python3 benchmarks/bench_runs.py --quick    # CI smoke run
    python3 benchmarks/bench_runs.py --json out.json   # also write the results as JSON (`-`: stdout)
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _models as M  # noqa: E402

import jax  # noqa: E402

import nitro_ipy  # noqa: E402
from nitro_ipy import Nitro  # noqa: E402

TARGET = 1.05
FULL = dict(in_dim=8, width=32, depth=1, batch=32, steps=400, rounds=31)
QUICK = dict(in_dim=8, width=32, depth=1, batch=32, steps=100, rounds=5)


def _epoch(n, background: bool) -> float:
    t0 = time.perf_counter()
    if background:
        n.train(1, background=True).wait()
    else:
        n.train(1)
    jax.block_until_ready(n.params)
    return time.perf_counter() - t0


def bench(cfg: dict) -> dict:
    cells = M.Cells()
    cls = cells.define_experiment("RunsMLP", in_dim=cfg["in_dim"], width=cfg["width"], depth=cfg["depth"])
    data = {"train": M.make_data(cfg["batch"] * cfg["steps"], cfg["in_dim"])}
    nitro_ipy.cache_reset()
    fg = Nitro(cls(), data=data, batch_size=cfg["batch"], progress=False)
    bg = Nitro(cls(), data=data, batch_size=cfg["batch"], progress=False)
    _epoch(fg, False), _epoch(bg, True)  # compile (once: the second handle hits the cache) and warm up
    _epoch(fg, False), _epoch(bg, True)
    misses = nitro_ipy.cache_stats().misses
    pairs, f_all, b_all = [], [], []
    for r in range(cfg["rounds"]):
        order = (False, True) if r % 2 == 0 else (True, False)  # A B, then B A
        t = {bg_: _epoch(bg if bg_ else fg, bg_) for bg_ in order}
        pairs.append(t[True] / t[False])
        f_all.append(t[False])
        b_all.append(t[True])
    assert nitro_ipy.cache_stats().misses == misses == 2, "a timed epoch compiled something"
    return {
        "steps": cfg["steps"],
        "rounds": cfg["rounds"],
        "foreground_epoch_ms": statistics.median(f_all) * 1e3,
        "background_epoch_ms": statistics.median(b_all) * 1e3,
        "foreground_step_us": statistics.median(f_all) / cfg["steps"] * 1e6,
        "background_step_us": statistics.median(b_all) / cfg["steps"] * 1e6,
        "ratio": statistics.median(pairs),
        "ratio_of_best": min(b_all) / min(f_all),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON (`-`: stdout)")
    args = parser.parse_args(argv)
    res = bench(QUICK if args.quick else FULL)
    ok = res["ratio"] <= TARGET
    print(f"nitro_ipy background-run benchmark (jax {jax.__version__}, {jax.default_backend()}, "
          f"{'quick' if args.quick else 'full'} run)")
    print(f"tiny MLP, {res['steps']} steps per epoch, {res['rounds']} interleaved rounds:")
    print(f"  foreground epoch {res['foreground_epoch_ms']:.1f} ms ({res['foreground_step_us']:.1f} us/step), "
          f"background {res['background_epoch_ms']:.1f} ms ({res['background_step_us']:.1f} us/step)")
    print(f"  background / foreground: median of paired ratios {res['ratio']:.3f}x, ratio of best epochs "
          f"{res['ratio_of_best']:.3f}x (target <= {TARGET:.2f}x) {'OK' if ok else 'OVER'}")
    if args.json:
        text = json.dumps({"bench_runs": res, "target": TARGET, "ok": ok}, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
