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
    python3 benchmarks/bench_runs.py --json out.json   # also write the results as JSON (no PATH: stdout)
"""

import io
import os
import statistics
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
    with redirect_stdout(io.StringIO()):  # the compile lines
        for _ in range(2):  # compile (once: the second handle hits the cache), then warm up
            _epoch(fg, False), _epoch(bg, True)
    misses = nitro_ipy.cache_stats().misses
    f_all, b_all = H.interleaved(cfg["rounds"], lambda: _epoch(fg, False), lambda: _epoch(bg, True))
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
        "aa_ratio": H.aa_ratio(lambda: _epoch(fg, False), cfg["rounds"]),
    }


def main(argv=None) -> int:
    H.parse_args(__doc__, argv, quick="fewer steps and rounds")
    res = bench(QUICK if H.quick() else FULL)
    log(f"nitro_ipy background-run benchmark: {H.env_line(f'backend {jax.default_backend()}')}")
    log(f"tiny MLP, {res['steps']} steps per epoch, {res['rounds']} interleaved rounds: foreground epoch "
        f"{res['foreground_epoch_ms']:.1f} ms ({res['foreground_step_us']:.1f} us/step), background "
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
