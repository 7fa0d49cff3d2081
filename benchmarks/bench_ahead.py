"""Benchmark: the live-edit cycle with compile ahead, through real IPython cells, against the hand-written
user who re-runs the cell defining a jitted step.

Everything is a ratio against the baseline measured in the same process, on the 120-layer MLP
(benchmarks/_models.py), editing the loss (a new expression each cycle, so no cache at any layer can
serve an old program). The extension is loaded in a real `InteractiveShell`; each cell is `run_cell`.

Targets (lower = nitro faster):
1. pause: edit cell, 3 s (a user reading the message), then the rebuild cell; its time to the first
   finished step vs the hand-written re-run jit cell's time to its first step ................. <= 0.10x
2. no pause: the whole cycle (rebuild cell: rebuild + one epoch with validation) vs the re-run jit cell
   + one epoch + evaluation (its own jitted eval, re-defined in the same cell) ................... <= 0.30x
3. a foreground step loop (the tiny MLP) started after an edit whose compile ahead is due, for 2.5 s
   (the compile takes about half that idle) vs the same loop idle for 2.5 s before the edit and as
   many epochs after the window ................................................................ <= 1.10x
   (information: the same loop started 0.35 s after the edit, while that compile is in flight)
And, for context, the no-pause rebuild cell's time to its first step against the hand-written one's,
and the parts: how long the edit cell took (post-cell hook included), what the rebuild
waited for, the compile seconds of each program made ahead.

Usage:
    python3 benchmarks/bench_ahead.py [--quick] [--json PATH]

`--quick` (CI's smoke run) makes one round on a 16-layer MLP (`_harness.QUICK_DEPTH`): the same code
paths, at a fraction of the 120-layer programs' compile time; its figures are indicative only.
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as H  # noqa: E402
import _models as M  # noqa: E402
from _harness import log  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402

import nitro_ipy  # noqa: E402
from nitro_ipy._training import _ahead, _loop  # noqa: E402

TARGETS = {"pause": 0.10, "cycle": 0.30, "foreground": 1.10}
DEEP = dict(in_dim=16, width=32, depth=120, batch=64, steps=48, valid=256)
TINY = dict(in_dim=32, width=32, depth=1, batch=64, steps=256)
PAUSE_S = 3.0
WINDOW_S = 2.5  # how long the foreground loop trains after the edit

BASELINE_EVAL = '''
@jax.jit
def evaluate(params, x, y):
    return loss_fn(mlp_forward(params, x), y)
'''


class Shell:
    """A real `InteractiveShell` with nitro_ipy loaded; `run(src)` is running a cell."""

    def __init__(self):
        sys.modules.setdefault("_nitro_bench_models", M)
        self.ip = InteractiveShell.instance()
        self.ip.run_line_magic("load_ext", "nitro_ipy")
        self.ns = self.ip.user_ns

    def run(self, src: str) -> float:
        t0 = time.perf_counter()
        result = self.ip.run_cell(src)
        result.raise_error()
        return time.perf_counter() - t0


class FirstStep:
    """When the first step of the next epoch finished: the loop asks for its second batch once the
    first step was dispatched; the handle's parameters are then waited for."""

    def __init__(self, ns):
        self.ns, self.t = ns, None
        self.source = _loop.train_batches
        _loop.train_batches = self.batches

    def batches(self, *args):
        for i, batch in enumerate(self.source(*args)):
            if i == 1 and self.t is None:
                jax.block_until_ready(self.ns["n"].params)
                self.t = time.perf_counter()
            yield batch


def experiment_cell(k: int) -> str:
    return M.EXPERIMENT_CELL.format(name="Deep", in_dim=DEEP["in_dim"], width=DEEP["width"],
                                    depth=DEEP["depth"], loss_expr=M.edited_loss(k), helper_expr=M.BASE_LOSS)


def baseline_cell(k: int) -> str:
    return M.BASELINE_CELL.format(loss_expr=M.edited_loss(k), decorator="@jax.jit") + BASELINE_EVAL


BASELINE_FIRST_STEP = '''
_perm = np.random.default_rng(_epoch).permutation(len(X))
_idx = _perm[:BS]
params, opt_state, _loss = step(params, opt_state, X[_idx], Y[_idx])
_ = jax.block_until_ready((params, opt_state))
'''

BASELINE_REST = '''
for _s in range(1, len(X) // BS):
    _idx = _perm[_s * BS : (_s + 1) * BS]
    params, opt_state, _loss = step(params, opt_state, X[_idx], Y[_idx])
_ = jax.block_until_ready((params, opt_state))
_vals = [evaluate(params, VX[i:i + BS], VY[i:i + BS]) for i in range(0, len(VX), BS)]
_valid = float(np.mean(jax.device_get(_vals)))
_epoch += 1
'''


def setup(sh: Shell):
    data = M.make_data(DEEP["batch"] * DEEP["steps"], DEEP["in_dim"])
    valid = M.make_data(DEEP["valid"], DEEP["in_dim"], seed=1)
    sh.ns.update(np=np, jax=jax, Nitro=nitro_ipy.Nitro, DATA={"train": data, "valid": valid},
                 X=data["x"], Y=data["y"], VX=valid["x"], VY=valid["y"], BS=DEEP["batch"], _epoch=0)
    sh.run(experiment_cell(0))
    sh.run("n = Nitro(Deep(), data=DATA, batch_size=BS, max_epochs=1, progress=False); n.train()")
    sh.run(baseline_cell(0))
    sh.run("params = init_mlp(jax.random.PRNGKey(0), %d, %d, %d); opt_state = opt.init(params)"
           % (DEEP["in_dim"], DEEP["width"], DEEP["depth"]))
    sh.run(BASELINE_FIRST_STEP + BASELINE_REST)
    H.settle()


def cycle(sh: Shell, k: int, pause: float) -> dict:
    """One edit of the loss, both sides; nitro's rebuild cell trains one epoch with validation."""
    stats0 = nitro_ipy.cache_stats()
    t_edit = sh.run(experiment_cell(k))
    time.sleep(pause)
    probe = FirstStep(sh.ns)
    t0 = time.perf_counter()
    try:
        t_rebuild = sh.run("n = n.rebuild(); n.train();")
    finally:
        _loop.train_batches = probe.source
    nitro_first = probe.t - t0
    ahead = [e for e in nitro_ipy._compiler._cache.live_entries() if e.kind in ("grad", "eval")]
    stats1 = nitro_ipy.cache_stats()
    if stats1.misses - stats0.misses != 2:  # grad and eval, nothing more (or the edit went unseen)
        raise RuntimeError(f"the edit compiled {stats1.misses - stats0.misses} programs, not 2 (grad, eval)")
    H.settle()
    # The hand-written side: re-run the cell defining the jitted step (and eval), then train and evaluate.
    t_define = sh.run(baseline_cell(k))
    t_step = sh.run(BASELINE_FIRST_STEP)
    t_rest = sh.run(BASELINE_REST)
    base_first = t_define + t_step
    return {
        "pause_s": pause, "edit_cell_s": t_edit,
        "nitro_first_step_s": nitro_first, "nitro_cycle_s": t_rebuild,
        "nitro_ahead_compile_s": {e.kind: e.trace_s + e.compile_s for e in ahead},
        "baseline_first_step_s": base_first, "baseline_cycle_s": base_first + t_rest,
        "first_step_ratio": nitro_first / base_first, "cycle_ratio": t_rebuild / (base_first + t_rest),
    }


def foreground(sh: Shell, rounds: int, delay: float = 0.0) -> dict:
    """Tiny-MLP epochs for `WINDOW_S` after an edit that compiles the deep model's grad and eval ahead
    (the loop starting `delay` seconds after the edit cell), against the epochs of an idle `WINDOW_S`
    before the edit and as many after the compile. Idle, that compile takes about half the window, so
    without holding back it would run beside these epochs."""
    data = M.make_data(TINY["batch"] * TINY["steps"], TINY["in_dim"])
    cls = M.Cells("_bench_ahead_tiny").define_experiment("Tiny", in_dim=TINY["in_dim"], width=TINY["width"],
                                                         depth=TINY["depth"])
    tiny = nitro_ipy.Nitro(cls(), data={"train": data}, batch_size=TINY["batch"], progress=True)

    def epoch():
        t0 = time.perf_counter()
        tiny.train()
        jax.block_until_ready(tiny.params)
        return time.perf_counter() - t0

    for _ in range(3):
        epoch()
    busy, idle, held, finished, beside = [], [], 0, [], []
    for r in range(rounds):
        # Idle epochs on both sides of the window (as many as it holds, before and after), so a drift
        # in this shared machine's speed over the round moves both sides alike.
        t_idle = time.perf_counter()
        before = []
        while time.perf_counter() - t_idle < WINDOW_S:
            before.append(epoch())
        sh.run(experiment_cell(2000 + 100 * int(delay * 10) + r))  # the edit: deep grad and eval due ahead
        t_edit = time.perf_counter()
        time.sleep(delay)
        during = []
        while time.perf_counter() - t_edit < WINDOW_S:
            compiling = bool(_ahead._busy)  # a compile ahead in flight as this epoch starts
            during.append(epoch())
            if compiling:
                beside.append(during[-1])
        held += not _ahead.wait(0)  # the compile ahead was still due when the loop stopped
        _ahead.wait(120)
        finished.append(time.perf_counter() - t_edit)
        busy += during
        idle += before + [epoch() for _ in before]
        sh.run("n = n.rebuild(); n.train()")  # its programs resolved: the next edit has work ahead
    return {"delay_s": delay, "busy_epoch_s": statistics.median(busy), "idle_epoch_s": statistics.median(idle),
            "epochs": len(busy), "ratio": statistics.median(busy) / statistics.median(idle),
            "rounds_held_back": held, "rounds": rounds, "ahead_done_after_edit_s": statistics.median(finished),
            "beside_epochs": len(beside),
            "beside_ratio": statistics.median(beside) / statistics.median(idle) if beside else None}


def main(argv=None) -> int:
    H.parse_args(__doc__, argv)
    if H.quick():
        DEEP["depth"] = H.QUICK_DEPTH
    nitro_ipy.set_cache_dir(None)  # the compile seconds, not a load from an earlier run's program store
    rounds = 1 if H.quick() else 3
    sh = Shell()
    setup(sh)
    k = 1
    res = {"pause": [], "nopause": []}
    for _ in range(rounds):
        res["pause"].append(cycle(sh, k, PAUSE_S))
        res["nopause"].append(cycle(sh, k + 1, 0.0))
        k += 2
    res["foreground"] = foreground(sh, 1 if H.quick() else 3)
    # information: the loop starts while the grad program's compile ahead is in flight (its trace, or
    # its XLA compile, runs to its end; what comes after waits for the loop)
    res["foreground_late"] = foreground(sh, 1 if H.quick() else 3, delay=0.35)
    med = lambda rows, f: statistics.median(r[f] for r in rows)  # noqa: E731
    pause_ratio, cycle_ratio = med(res["pause"], "first_step_ratio"), med(res["nopause"], "cycle_ratio")
    first_ratio = med(res["nopause"], "first_step_ratio")
    log(H.env_line(f"recorder {H.recorder_mode()}", f"{DEEP['depth']}-layer MLP"))
    for name, rows in (("3 s pause", res["pause"]), ("no pause", res["nopause"])):
        log(f"{name}: edit cell {med(rows, 'edit_cell_s'):.2f} s | nitro first step {med(rows, 'nitro_first_step_s'):.3f} s, "
            f"cycle {med(rows, 'nitro_cycle_s'):.2f} s | hand-written first step "
            f"{med(rows, 'baseline_first_step_s'):.2f} s, cycle {med(rows, 'baseline_cycle_s'):.2f} s | "
            f"compiled ahead {rows[-1]['nitro_ahead_compile_s']}")
    fg = res["foreground"]
    for f in (fg, res["foreground_late"]):
        log(f"foreground tiny epochs from {f['delay_s']:.2f} s after the edit, for {WINDOW_S} s: "
            f"{f['busy_epoch_s'] * 1e3:.1f} ms vs idle {f['idle_epoch_s'] * 1e3:.1f} ms ({f['ratio']:.2f}x) over "
            f"{f['epochs']} epochs; compile ahead held back in {f['rounds_held_back']} of {f['rounds']} rounds, "
            f"done {f['ahead_done_after_edit_s']:.2f} s after the edit; {f['beside_epochs']} epochs started "
            f"while a compile was in flight" + (f" ({f['beside_ratio']:.2f}x)" if f["beside_ratio"] else ""))
    rows = [
        H.at_most("rebuild cell to first step, 3 s after the edit", pause_ratio, TARGETS["pause"], 3),
        H.at_most("whole cycle, no pause (rebuild + epoch + valid)", cycle_ratio, TARGETS["cycle"]),
        H.Row("rebuild cell to first step, no pause (context)", f"{first_ratio:.2f}x"),
        H.at_most("foreground epoch while compiling ahead", fg["ratio"], TARGETS["foreground"]),
    ]
    res["ratios"] = {"pause": pause_ratio, "cycle": cycle_ratio, "foreground": fg["ratio"],
                     "nopause_first_step": first_ratio}
    return H.finish(res, rows)


if __name__ == "__main__":
    sys.exit(main())
