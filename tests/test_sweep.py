"""The line sweep: a Ctrl-C at every line a window of `train()` executes leaves a handle that, trained
on, equals an uninterrupted one bit for bit (params, optimizer state, model state, step, epoch, cursor,
the epoch rows).

A window is every line of nitro_ipy's own code the main thread runs between two handle states: from the
line after an epoch's last optimizer step stores its results to the next epoch's first step, or to
`train()`'s return (`END`); and a mid-epoch window around a sync point (`MID`). A first run records the
window's lines, each named by `(file, line, occurrence in the window)`; then one run per line raises
SIGINT there (`signal.raise_signal` from a trace function: the handler, the step gate's, runs at that
line) and trains on to the reference's epoch. A point that a run never reaches is counted as not fired.

The sync period is set to never (`END`) or every step (`MID`), so which lines run does not depend on the
machine's speed; compile ahead stays on (it runs in other threads, which the trace does not see).
"""

import dataclasses
import os
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import nitro_ipy
from nitro_ipy import Device, GraphConst, Nitro
from nitro_ipy._compiler import _reuse
from nitro_ipy._training import _ahead, _loop

PACKAGE = os.path.dirname(nitro_ipy.__file__)
BS, STEPS, EPOCHS = 4, 3, 2  # 3 steps an epoch, 2 epochs


@dataclasses.dataclass
class Lin:
    width: GraphConst[int] = 2
    lr: Device[float] = 0.05

    def init(self, rng):
        return {"w": jax.random.normal(rng, (3, self.width)), "b": jnp.zeros((self.width,))}, jnp.zeros(3)

    def forward(self, params, *, x, state):  # the state: a running mean of the inputs (as batch norm's)
        return (x @ params["w"] + params["b"]).sum(-1), 0.9 * state + 0.1 * x.mean(0)

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)

    def optimizer(self):  # with momentum, so the optimizer state moves too (and setup is 20 ms, not adam's 50)
        return optax.sgd(self.lr, momentum=0.9)


def _data(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    return {"x": x, "y": x.sum(1).astype(np.float32)}


TRAIN, VALID = _data(BS * STEPS, 0), _data(6, 1)
# Every occurrence of every line, validation included (~1600 points, ~2 min): `NITRO_IPY_SWEEP=full`.
# Otherwise each line of the window once, at its first occurrence, with no valid split (~160 points).
FULL = os.environ.get("NITRO_IPY_SWEEP") == "full"


def handle():
    data = {"train": TRAIN, "valid": VALID} if FULL else {"train": TRAIN}
    return Nitro(Lin(), data=data, batch_size=BS, max_epochs=EPOCHS, progress=False)


def snapshot(n) -> dict:
    """What an uninterrupted run and an interrupted one trained on must agree on, bit for bit."""
    rows = [{k: v for k, v in r.items()} for r in n.history]
    return {"params": jax.device_get(n.params), "opt_state": jax.device_get(n.opt_state),
            "state": jax.device_get(n.state), "step": n.step, "epoch": n.epoch, "cursor": tuple(n._cursor),
            "rows": rows}


def differences(got: dict, want: dict, validating: bool) -> list[str]:
    out = []
    for k in ("step", "epoch", "cursor"):
        if got[k] != want[k]:
            out.append(f"{k}: {got[k]} != {want[k]}")
    for k in ("params", "opt_state", "state"):
        a, b = jax.tree.leaves(got[k]), jax.tree.leaves(want[k])
        if len(a) != len(b) or not all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b)):
            out.append(f"{k} differ")
    if len(got["rows"]) != len(want["rows"]):
        out.append(f"{len(got['rows'])} epoch rows != {len(want['rows'])}")
    for r, w in zip(got["rows"], want["rows"]):
        # a Ctrl-C during validation leaves that epoch's row without its validation metrics (the
        # epoch counted, its validation cut): every other key is the uninterrupted run's, exactly
        keys = set(w) if not validating else {k for k in w if not k.startswith("valid_")} | set(r)
        if any(r.get(k) != w.get(k) for k in keys):
            out.append(f"row {r} != {w}")
    return out


class Sweep:
    """One run of `train()` under a trace function: records the window's lines, or raises SIGINT at one."""

    def __init__(self, n, opens, at=None):
        self.n, self.opens, self.at = n, opens, at
        self.inside, self.seen, self.lines, self.names, self.fired = False, {}, [], set(), False

    def local(self, frame, event, arg):
        if event == "line":
            self.line(frame)
        return self.local

    def call(self, frame, event, arg):
        if not frame.f_code.co_filename.startswith(PACKAGE):
            return None
        if event == "call":
            self.line(frame)  # a function's first line is where its call lands
        return self.local

    def line(self, frame):
        if self.fired:
            return
        self.inside = self.opens(self.n._state, frame)
        if not self.inside:
            return
        point = (os.path.relpath(frame.f_code.co_filename, PACKAGE), frame.f_lineno)
        k = self.seen[point] = self.seen.get(point, 0) + 1
        point = (*point, k)
        if self.at is None:
            self.lines.append(point)
            self.names.add(frame.f_code.co_name)
        elif point == self.at:
            self.fired = True
            signal.raise_signal(signal.SIGINT)  # the handler (the gate's) runs here, at this line

    def train(self):
        sys.settrace(self.call)
        try:
            self.n.train()
        finally:
            sys.settrace(None)


def _window_opener(kind: str):
    src = open(_loop.__file__).read().splitlines()
    stored = next(i + 1 for i, t in enumerate(src) if t.strip() == "pairs += 1")  # after the step's store
    state = {"open": False}

    def opens(s, frame):
        stores = frame.f_code is _loop.train_epoch.__code__ and frame.f_lineno == stored
        if kind == "END":  # from an epoch's last step to the next epoch's first step, or the return
            if stores and s.step % STEPS == STEPS - 1:
                state["open"] = True
            elif s.step % STEPS == 1:
                state["open"] = False
        else:  # MID: from the epoch's second step to its third, a sync point between them
            if stores and s.step == 1:
                state["open"] = True
            elif s.step >= 3:
                state["open"] = False
        return state["open"]

    return opens


def sweep(kind: str, monkeypatch) -> tuple[int, int, int, list, set]:
    monkeypatch.setattr(_loop, "_SYNC_SECONDS", 1e9 if kind == "END" else 0.0)
    ref = handle()
    ref.train()
    want = snapshot(ref)
    recorder = Sweep(handle(), _window_opener(kind))
    recorder.train()
    assert snapshot(recorder.n)["step"] == want["step"]
    points, fired, consistent, bad = recorder.lines, 0, 0, []
    if not FULL:
        points = [p for p in points if p[2] == 1]
    for point in points:
        run = Sweep(handle(), _window_opener(kind), at=point)
        validating = False
        try:
            run.train()
        except KeyboardInterrupt as err:
            validating = "validating" in str(err)
        if not run.fired:
            continue
        fired += 1
        # nothing the call told the background workers outlives it: a step loop still running would
        # hold compile ahead back, a training still running would hold trace reuse's warmings back
        if _ahead._running or _reuse._calls:
            bad.append((point, [f"left running: step loops {_ahead._running}, train() calls {_reuse._calls}"]))
        n = run.n
        for _ in range(4):  # train on to the reference's epoch (a counted epoch with no steps left: one call)
            if n.epoch >= EPOCHS:
                break
            n.train(EPOCHS - n.epoch)
        diff = differences(snapshot(n), want, validating)
        consistent += not diff and (not bad or bad[-1][0] != point)
        if diff:
            bad.append((point, diff))
    _ahead.wait()
    return len(points), fired, consistent, bad, recorder.names


# What each window must run through, so a window that moved is seen: the steps' commits, the epoch's count,
# the next epoch's first (keyed) step; a sync point mid-epoch.
CROSSES = {"END": {"close_epoch", "_count_epoch", "keyed_step", "train_epoch", "_epochs"},
           "MID": {"sync", "check_losses", "count_reuse", "train_epoch"}}


@pytest.mark.parametrize("kind", ["END", "MID"])
def test_a_ctrl_c_at_any_line_leaves_a_consistent_handle(kind, monkeypatch):
    points, fired, consistent, bad, names = sweep(kind, monkeypatch)
    print(f"{kind}: {points} points, {fired} fired, {consistent} consistent")
    assert CROSSES[kind] <= names, CROSSES[kind] - names
    assert points >= 50 and fired == points  # the sync period pinned: every line recorded runs again
    assert consistent == fired, bad[:5]
