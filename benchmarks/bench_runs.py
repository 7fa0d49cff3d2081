"""Benchmark: a background run's steady-state step against a foreground one, same process, same handle.

One handle on a tiny dispatch-bound MLP (the case where any per-step cost of the worker thread would show)
trains an epoch with `n.train(1)` and the next with `n.train(1, background=True).wait()` while the main
thread waits (as a notebook kernel's main thread idles between cells). Programs are compiled and warmed up
first; epochs are interleaved (A B B A ...) and a process's ratio is the median over rounds of (background
epoch / the adjacent foreground epoch), so load on a shared machine hits both sides of a pair alike. The
background epoch includes handing the run to its worker thread and waiting for it.

Processes differ more than rounds do: the same script's in-process ratio ranged 0.92-1.07x over five
processes on a quiet machine (each process places its threads and buffers its own way). So the full run
measures in `PROCESSES` fresh processes and reports the median of their ratios, with the range.

Target: background / foreground steady-state epoch <= 1.05x.

Usage:
    python3 benchmarks/bench_runs.py            # full run (~1 min on 2 cores)
    python3 benchmarks/bench_runs.py --quick    # CI smoke run
    python3 benchmarks/bench_runs.py --json out.json   # also write the results as JSON (no PATH: stdout)
"""

import io
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import redirect_stdout

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as H  # noqa: E402
import _models as M  # noqa: E402
from _harness import log  # noqa: E402

import jax  # noqa: E402

import nitro_ipy  # noqa: E402
from nitro_ipy import Nitro  # noqa: E402

TARGET = 1.05
PROCESSES = 5  # full run: fresh processes, each measuring its own paired median
CHILD = "NITRO_IPY_BENCH_RUNS_CHILD"
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
    n = Nitro(cls(), data=data, batch_size=cfg["batch"], progress=False)
    with redirect_stdout(io.StringIO()):  # the compile lines
        for _ in range(2):  # compile, then warm up (the worker thread too)
            _epoch(n, False), _epoch(n, True)
    misses = nitro_ipy.cache_stats().misses
    f_all, b_all = H.interleaved(cfg["rounds"], lambda: _epoch(n, False), lambda: _epoch(n, True))
    assert nitro_ipy.cache_stats().misses == misses == 2, "a timed epoch compiled something"
    return {
        "steps": cfg["steps"],
        "rounds": cfg["rounds"],
        "foreground_epoch_ms": statistics.median(f_all) * 1e3,
        "background_epoch_ms": statistics.median(b_all) * 1e3,
        "foreground_step_us": statistics.median(f_all) / cfg["steps"] * 1e6,
        "background_step_us": statistics.median(b_all) / cfg["steps"] * 1e6,
        "ratio": H.paired_ratio(b_all, f_all),
        "ratio_of_best": min(b_all) / min(f_all),
        "aa_ratio": H.aa_ratio(lambda: _epoch(n, False), cfg["rounds"]),
    }


def in_processes(count: int) -> dict:
    """`bench(FULL)` in `count` fresh processes, one after the other; the median of their figures."""
    runs = []
    for _ in range(count):
        out = subprocess.run([sys.executable, os.path.abspath(__file__)], env={**os.environ, CHILD: "1"},
                             capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    # Each float figure (the ratio among them) is the median over processes; the ratios are kept to show.
    res = {k: statistics.median(r[k] for r in runs) for k in runs[0] if isinstance(runs[0][k], float)}
    return {**res, "steps": runs[0]["steps"], "rounds": runs[0]["rounds"], "processes": count,
            "ratios": sorted(r["ratio"] for r in runs)}


def main(argv=None) -> int:
    if os.environ.get(CHILD):  # one process of a full run: its figures as one JSON line
        print(json.dumps(bench(FULL), default=float))
        return 0
    H.parse_args(__doc__, argv, quick="fewer steps and rounds, one process")
    res = bench(QUICK) if H.quick() else in_processes(PROCESSES)
    log(f"nitro_ipy background-run benchmark: {H.env_line(f'backend {jax.default_backend()}')}")
    where = (f"median of {res['processes']} processes (their ratios {', '.join(f'{r:.3f}' for r in res['ratios'])})"
             if "processes" in res else "one process")
    log(f"tiny MLP, {res['steps']} steps per epoch, {res['rounds']} interleaved rounds, {where}: foreground "
        f"epoch {res['foreground_epoch_ms']:.1f} ms ({res['foreground_step_us']:.1f} us/step), background "
        f"{res['background_epoch_ms']:.1f} ms ({res['background_step_us']:.1f} us/step)")
    rows = [
        H.Row("background / foreground epoch, paired median", f"{res['ratio']:.3f}x", f"<= {TARGET:.2f}x",
              res["ratio"] <= TARGET),
        H.Row("background / foreground, best epochs (context)", f"{res['ratio_of_best']:.3f}x"),
        H.Row("foreground against itself, A/A (noise, context)", f"{res['aa_ratio']:.3f}x"),
    ]
    return H.finish({"target": TARGET, **res}, rows)


if __name__ == "__main__":
    sys.exit(main())
