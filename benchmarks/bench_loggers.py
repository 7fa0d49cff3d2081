"""Benchmark: the steady step time with each logger at `log_every=1`, against no logger (issue 47).

The tiny MLP (4-32-1, batch 32: dispatch-bound, where a stall on the step path shows most) trains a few
epochs in one `train()` call a round on each side, sides interleaved in one process
(`_harness.interleaved`). A side's figure is the median ms/step of the call's epochs after its first
(from each epoch event's `train/steps_per_s`, a per-epoch logger on every side): steady training with
the logger thread writing beside it (and, for W&B, its service process), never the first epoch, which
may run beside the previous side's leftovers. The ratio is the median over rounds of logger / adjacent
no-logger figure. The whole call's ms/step (its end waits until the loggers have written everything) is
reported beside it, with how many step events each logger wrote while the call ran. Each side is its own
handle on the same cached programs. Sides: a callable that keeps the events (the step path's cost alone:
an append), TensorBoard, MLflow (a file store), W&B (offline), each whose library is installed, and a
second no-logger side (A/A: the machine's own spread). Target: <= 1.05x.

Usage:
    python3 benchmarks/bench_loggers.py            # full run
    python3 benchmarks/bench_loggers.py --quick    # smoke run: fewer rounds, shorter epochs
    python3 benchmarks/bench_loggers.py --json out.json
"""

import dataclasses
import importlib.util
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as H  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _harness import log  # noqa: E402

from nitro_ipy import Device, GraphConst, Nitro  # noqa: E402
from nitro_ipy import loggers as L  # noqa: E402


@dataclasses.dataclass
class Tiny:
    hidden: GraphConst[int] = 32
    lr: Device[float] = 1e-3

    def init(self, rng):
        k1, k2 = jax.random.split(rng)
        return {"w1": jax.random.normal(k1, (4, self.hidden)) * 0.5, "w2": jax.random.normal(k2, (self.hidden,)) * 0.5}

    def forward(self, params, *, x):
        return jnp.tanh(x @ params["w1"]) @ params["w2"]

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)

    def optimizer(self):
        return optax.adam(self.lr)


class Keep:
    log_every = 1

    def __init__(self):
        self.n = 0

    def __call__(self, event):
        self.n += 1


class During:
    """A step logger after the side's tracker: how many step events reached the loggers while the call
    trained (the rest were written at its end)."""

    log_every = 1

    def __init__(self):
        self.handle, self.n = None, 0

    def __call__(self, event):
        session = self.handle._tracking.session if self.handle is not None else None
        if event.kind == "step" and session is not None and not session.closing:
            self.n += 1


class Clock:
    """On every side, per epoch only: each epoch event's `train/steps_per_s` (the epoch's training time,
    the logger thread running beside it; not the call's end, which waits for the loggers to finish)."""

    def __init__(self):
        self.rates = []

    def __call__(self, event):
        if event.kind == "epoch":
            self.rates.append(event.values["train/steps_per_s"])


def main(argv=None) -> int:
    H.parse_args(__doc__, argv)
    steps, rounds, epochs = (500, 5, 3) if H.quick() else (2000, 9, 4)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * 32, 4)).astype(np.float32)
    data = {"train": {"x": x, "y": np.sin(x.sum(1)).astype(np.float32)}}
    tmp = tempfile.mkdtemp(prefix="bench_loggers_")
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_CONSOLE="off")
    # "none (A/A)": a second side with no logger, how far two equal sides land on this machine.
    makers = {"none": lambda: [], "none (A/A)": lambda: [], "callable": lambda: [Keep()]}
    if importlib.util.find_spec("tensorboardX"):
        makers["tensorboard"] = lambda: [L.TensorBoard(os.path.join(tmp, "tb"), log_every=1)]
    if importlib.util.find_spec("mlflow"):
        makers["mlflow"] = lambda: [L.MLflow("bench", tracking_uri="file:" + os.path.join(tmp, "mlruns"), log_every=1)]
    if importlib.util.find_spec("wandb"):
        makers["wandb"] = lambda: [L.WandB("bench", dir=tmp, log_every=1)]
    clocks, during = {name: Clock() for name in makers}, {name: During() for name in makers}
    handles = {name: Nitro(Tiny(), data=data, batch_size=32, progress=False,
                           loggers=[clocks[name], *make(), *([during[name]] if name.startswith(("c", "t", "m", "w")) else [])])
               for name, make in makers.items()}
    for name, n in handles.items():
        during[name].handle = n
    for n in handles.values():  # compile, open each writer (W&B's init is seconds), warm
        n.train(1)

    def side(name):
        def run():
            clocks[name].rates.clear()
            during[name].n = 0
            t, cpu = time.perf_counter(), time.thread_time()
            handles[name].train(epochs)  # returns once the logger thread has written and flushed everything
            host = (time.thread_time() - cpu) / (steps * epochs) * 1e6
            steady = float(np.median([1e3 / r for r in clocks[name].rates[1:]]))
            return steady, (time.perf_counter() - t) / (steps * epochs) * 1e3, host, during[name].n
        return run

    names = list(handles)
    times = H.interleaved(rounds, *(side(k) for k in names))
    steady = [[r[0] for r in t] for t in times]
    whole = [[r[1] for r in t] for t in times]
    host = [[r[2] for r in t] for t in times]  # the training thread's own CPU us/step: the step path's cost
    res, rows = {"steps_per_epoch": steps, "epochs_per_call": epochs, "rounds": rounds}, []
    log(H.env_line())
    log(f"{'':>12}  steady ms/step  call ms/step (its end waits for the loggers)  training thread CPU us/step")
    for i, name in enumerate(names):
        res[name] = {"steady_ms_per_step": float(np.median(steady[i])), "call_ms_per_step": float(np.median(whole[i])),
                     "host_us_per_step": float(np.median(host[i]))}
        log(f"{name:>12}: {np.median(steady[i]):14.4f}  {np.median(whole[i]):12.4f}  {np.median(host[i]):10.1f}")
        if name != "none":
            ratio, call = H.paired_ratio(steady[i], steady[0]), H.paired_ratio(whole[i], whole[0])
            res[name].update(ratio=ratio, call_ratio=call)
            rows.append(H.at_most(f"{name} at log_every=1 / no logger (steady step)", ratio, 1.05))
            rows.append(H.Row(f"{name}: the whole call, its loggers' drain included", f"{call:.2f}x"))
            if name != "none (A/A)":
                written = float(np.median([r[3] for r in times[i]])) / (steps * epochs)
                res[name]["written_while_training"] = written
                rows.append(H.Row(f"{name}: step events written while the call trained", f"{written:.0%}"))
            extra = np.median(host[i]) - np.median(host[0])
            rows.append(H.Row(f"{name}: training thread CPU us/step over no logger", f"{extra:+.1f} us"))
    for n in handles.values():
        for logger in n._tracking.loggers:
            getattr(logger, "close", lambda: None)()
    shutil.rmtree(tmp, ignore_errors=True)  # the three trackers' files: a benchmark leaves nothing behind
    return H.finish(res, rows)


if __name__ == "__main__":
    sys.exit(main())
