"""Benchmark: what the Jupyter extension costs. Everything against a baseline measured in the same run.

1. Cell hook: `ip.run_cell("pass")` in a real `InteractiveShell`, with and without `%load_ext nitro_ipy`
   (the cache holding a trained model's programs, as in a working session). Reports the added
   microseconds per cell. Target: < 50 us.
2. Live panel: a training epoch of a tiny MLP (dispatch-bound, the worst case for any per-event cost) with
   the panel shown (figures, loss chart as SVG, display updates) and attached to the cache callbacks, and
   the notebook message sink installed (so `train()` draws its HTML progress display, updated at sync
   points), against the same epoch with the terminal's text reporter. Target: < 2 %.
   The panel's own work per epoch (refreshes x microseconds per refresh) is what the target is judged on:
   the ratio measures it plus timing noise, and an A/A run (the same epoch against itself) shows how much
   noise there is on this machine. Also reports what the panel would cost at the throttle's ceiling (4
   refreshes per second, were the step loop to call the cache's "progress" subscribers at its 0.25 s sync points).

Rounds alternate the two sides (A B B A ...) and report the best of each (as `timeit` does), so drift and
load on a shared machine hit both sides alike and inflate neither figure.
Widgets are created without a kernel (ipywidgets' no-op comm): this times our Python, not the frontend.

Usage:
    python3 benchmarks/bench_jupyter.py            # full run (~30 s)
    python3 benchmarks/bench_jupyter.py --quick    # smoke run
    python3 benchmarks/bench_jupyter.py --json out.json   # also write the results as JSON (`-`: stdout)
"""

import dataclasses
import io
import os
import statistics
import sys
import time
from contextlib import redirect_stderr, redirect_stdout

import jax
import jax.numpy as jnp
import numpy as np
import optax
from IPython.core.interactiveshell import InteractiveShell

import nitro_ipy
from nitro_ipy import Device, GraphConst, Nitro, _cache, _report

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as H  # noqa: E402
from _harness import log  # noqa: E402

TARGETS = {"cell_hook_us": 50.0, "panel_epoch_ratio": 1.02}


@dataclasses.dataclass
class TinyMLP:
    width: GraphConst[int] = 32
    lr: Device[float] = 1e-3

    def init(self, rng):
        k1, k2 = jax.random.split(rng)
        return {"w1": jax.random.normal(k1, (8, self.width)) / np.sqrt(8), "b1": jnp.zeros(self.width),
                "w2": jax.random.normal(k2, (self.width,)) / np.sqrt(self.width)}

    def forward(self, params, *, x):
        return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)

    def optimizer(self):
        return optax.adam(self.lr)


def _data(n: int) -> dict:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 8)).astype(np.float32)
    return {"train": {"x": x, "y": np.sin(x.sum(1)).astype(np.float32)}}


def _alternate(a, b, rounds: int):
    """Best times of `a()` and `b()` over `rounds`, interleaved with the garbage collector paused, so
    neither side pays for the other's garbage. The best of N (as `timeit` reports) estimates the cost
    itself; on a shared machine a median mostly measures the load."""
    ta, tb = H.interleaved(rounds, a, b, pause_gc=True)
    return min(ta), min(tb)


def bench_cell_hook(ip, cells: int, rounds: int) -> dict:
    def per_cell():
        t0 = time.perf_counter()
        for _ in range(cells):
            ip.run_cell("pass")
        return (time.perf_counter() - t0) / cells

    def without():
        ip.run_line_magic("unload_ext", "nitro_ipy")
        return per_cell()

    def with_ext():
        ip.run_line_magic("load_ext", "nitro_ipy")
        t = per_cell()
        ip.run_line_magic("unload_ext", "nitro_ipy")
        return t

    base, ext = _alternate(without, with_ext, rounds)

    # The two callbacks on their own, called as IPython's event loop calls them: the deterministic part.
    ip.run_line_magic("load_ext", "nitro_ipy")
    callbacks = [ip.events.callbacks[e][-1] for e in ("pre_run_cell", "post_run_cell")]
    t0 = time.perf_counter()
    for _ in range(cells * 10):
        for fn in callbacks:
            fn(None)
    own = (time.perf_counter() - t0) / (cells * 10)
    ip.run_line_magic("unload_ext", "nitro_ipy")
    return {"cell_base_us": base * 1e6, "cell_ext_us": ext * 1e6, "cell_hook_us": (ext - base) * 1e6,
            "callbacks_us": own * 1e6}


def bench_panel(ip, steps: int, rounds: int) -> dict:
    from nitro_ipy._widgets import Panel, RichSink

    batch = 32
    # progress=True, as in a notebook: the epoch line is one of the panel's events (the bar costs both sides).
    n = Nitro(TinyMLP(), data=_data(batch * steps), batch_size=batch, progress=True)
    n.train(1)  # compile outside the timing

    def epoch():
        t0 = time.perf_counter()
        n.train(1)
        jax.block_until_ready(n.params)
        return time.perf_counter() - t0

    panel = Panel()
    panel.show()  # shown, so every refresh renders the figures and the SVG chart and sends display updates
    sink = RichSink(ip, _report.sink())  # the notebook sink: train() draws its HTML progress display too
    sink.panel = panel

    refreshes = []

    def with_panel():
        before = panel.refreshes
        panel.attach()
        previous = _report.set_sink(sink)
        try:
            return epoch()
        finally:
            _report.set_sink(previous)
            panel.detach()
            refreshes.append(panel.refreshes - before)

    base, panelled = _alternate(epoch, with_panel, rounds)
    aa = H.aa_ratio(epoch, rounds, pause_gc=True, best=True)  # how far apart two identical sides land here
    panel.close()

    # One refresh that changes a value (what a training update does), timed on its own: the figures, the
    # chart of the last epoch's sync points as SVG, and the display update.
    panel = Panel(min_interval=0)
    panel.show()
    costs = []
    for i in range(200):
        _cache.count_hit(_cache.live_entries()[0])  # a new figure to send
        t0 = time.perf_counter()
        panel.refresh()
        costs.append(time.perf_counter() - t0)
    panel.close()
    refresh_us = statistics.median(costs) * 1e6
    per_epoch = statistics.median(refreshes)
    return {
        "panel_refreshes_per_epoch": per_epoch,
        "panel_work_pct": per_epoch * refresh_us / (base * 1e6) * 100,
        "epoch_base_ms": base * 1e3,
        "epoch_panel_ms": panelled * 1e3,
        "panel_epoch_ratio": panelled / base,
        "aa_ratio": aa,
        "panel_refresh_us": refresh_us,
        "panel_ceiling_pct": refresh_us * 4 / 1e6 * 100,
    }


def rows(results: dict) -> list:
    work_target = (TARGETS["panel_epoch_ratio"] - 1) * 100
    return [
        H.Row("cell hook, added per cell", f"{results['cell_hook_us']:+.1f} us",
              f"< {TARGETS['cell_hook_us']:.0f} us", results["cell_hook_us"] < TARGETS["cell_hook_us"]),
        H.Row("live panel, its own work per epoch", f"{results['panel_work_pct']:.3f} %", f"< {work_target:.0f} %",
              results["panel_work_pct"] < work_target),
        H.Row("live panel, epoch ratio (context)", f"{results['panel_epoch_ratio']:.3f}"),
        H.Row("same epoch against itself, A/A (noise, context)", f"{results['aa_ratio']:.3f}"),
    ]


def main(argv=None) -> int:
    H.parse_args(__doc__, argv, quick="fewer cells, steps and rounds")
    cells, steps, rounds = (1000, 200, 5) if H.quick() else (2000, 1000, 21)

    ip = InteractiveShell.instance()
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):  # epoch lines, progress bars
        nitro_ipy.cache_reset()
        results = {}
        results.update(bench_panel(ip, steps, rounds))  # also leaves programs in the cache for the cell bench
        results.update(bench_cell_hook(ip, cells, rounds))

    log(f"nitro_ipy Jupyter benchmark: {H.env_line(f'backend {jax.default_backend()}')}")
    log(f"1. cell hook: run_cell('pass') {results['cell_base_us']:.1f} us -> {results['cell_ext_us']:.1f} us: "
        f"{results['cell_hook_us']:+.1f} us per cell (target < {TARGETS['cell_hook_us']:.0f} us)")
    log(f"   the two callbacks themselves: {results['callbacks_us']:.2f} us per cell")
    log(f"2. panel: tiny-MLP epoch ({steps} steps) {results['epoch_base_ms']:.1f} ms -> "
        f"{results['epoch_panel_ms']:.1f} ms: ratio {results['panel_epoch_ratio']:.3f}; the same epoch against "
        f"itself (A/A, the noise floor here): {results['aa_ratio']:.3f}")
    log(f"   the panel's own work: {results['panel_refreshes_per_epoch']:.0f} refresh(es) per epoch x "
        f"{results['panel_refresh_us']:.0f} us = {results['panel_work_pct']:.3f} % of the epoch "
        f"(target < {(TARGETS['panel_epoch_ratio'] - 1) * 100:.0f} %)")
    log(f"   at the throttle's ceiling of 4 refreshes/s: {results['panel_ceiling_pct']:.3f} % of wall time")
    return H.finish({"targets": TARGETS, **results}, rows(results))


if __name__ == "__main__":
    sys.exit(main())
