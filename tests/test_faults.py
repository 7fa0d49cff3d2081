"""Fault injection: real SIGINTs at random points of train, validate, predict, a compile and the drift
scan; exceptions raised by user hooks at trace time; a NaN at a random step. Each trial asserts the
handle is usable afterwards, its parameters finite and equal to those of its last applied step, and the
cache's counts consistent (misses == entries). Seeded: a failing seed replays.

Budget: ~25 s on a loaded 2-core machine (tiny models; programs compiled once per test and reused by
the trials, except the compile trials, which need a cold cache each).
"""

import contextlib
import dataclasses
import gc
import os
import random
import time
import signal
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import nitro_ipy
from nitro_ipy import Device, GraphConst, Nitro
from nitro_ipy._compiler import _cache

BS = 8
FAULT = {"hook": None}  # which hook raises at trace time (a dict mutated in place: invisible to the closure)


class Injected(RuntimeError):
    pass


def maybe_fail(hook: str):
    if FAULT["hook"] == hook:
        raise Injected(f"injected in `{hook}`")


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    return {"x": x, "y": np.sin(x.sum(1)).astype(np.float32)}


@dataclasses.dataclass
class Tiny:
    hidden: GraphConst[int] = 4
    lr: Device[float] = 1e-2

    def init(self, rng):
        k1, k2 = jax.random.split(rng)
        return {"w1": jax.random.normal(k1, (3, self.hidden)), "w2": jax.random.normal(k2, (self.hidden,))}

    def forward(self, params, *, x):
        maybe_fail("forward")
        return jnp.tanh(x @ params["w1"]) @ params["w2"]

    def loss(self, outputs, *, y):
        maybe_fail("loss")
        return jnp.mean((outputs - y) ** 2)

    def optimizer(self):
        maybe_fail("optimizer")
        return optax.adam(self.lr)

    @nitro_ipy.metrics("device")
    def mae(self, outputs, *, y):
        maybe_fail("mae")
        return {"mae": (jnp.sum(jnp.abs(outputs - y)), outputs.shape[0])}


TRAIN, VALID = _data(480), _data(37, seed=1)
DATA = {"train": TRAIN, "valid": VALID}


class Stop(Exception):
    pass


def reference_params(steps: int, data=TRAIN):
    """The parameters after exactly `steps` applied steps of a clean run (cache hits, no compile)."""
    def lr(step):
        if step == steps:
            raise Stop
        return 1e-2

    n = Nitro(Tiny(), data={"train": data}, batch_size=BS, max_epochs=100, progress=False, schedules={"lr": lr})
    with pytest.raises(Stop):
        n.train()
    return jax.device_get(n.params)


def sigint_during(op, delay: float) -> bool:
    """Run `op` with a real SIGINT sent to this process after `delay` s; True if it was interrupted."""
    timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
    interrupted = False
    try:
        try:
            timer.start()
            op()
        finally:
            timer.cancel()
            timer.join()
            for _ in range(1000):  # a signal sent just before the join is handled here, not later
                pass
    except KeyboardInterrupt:
        interrupted = True
    return interrupted


def assert_usable(n, steps_expected=None):
    leaves = jax.tree.leaves(jax.device_get(n.params))
    assert all(np.isfinite(np.asarray(p)).all() for p in leaves)
    s = nitro_ipy.cache_stats()
    assert s.misses == s.entries
    if steps_expected is not None:
        for got, want in zip(leaves, jax.tree.leaves(reference_params(steps_expected))):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # and it still works: a validation, a prediction
    assert np.isfinite(n.validate()["loss"])
    assert n.predict({"x": VALID["x"][:3]}).shape == (3,)


SEEDS = range(10)


@pytest.fixture
def warm():
    """Every program compiled once, so trials interrupt running code, not compiles."""
    n = Nitro(Tiny(), data=DATA, batch_size=BS, progress=False)
    n.train()
    n.predict({"x": VALID["x"][:3]})
    return n


def paced(step):
    """The learning rate every run here uses, one millisecond a step: 4 epochs take at least 0.24 s, so
    a SIGINT sent in the first 0.15 s lands inside training however fast the machine is."""
    time.sleep(0.001)
    return 1e-2


def test_sigint_during_train_keeps_the_last_applied_step(warm):
    interrupted = 0
    for seed in SEEDS:
        rng = random.Random(seed)
        n = Nitro(Tiny(), data=DATA, batch_size=BS, max_epochs=4, progress=False, schedules={"lr": paced})
        interrupted += sigint_during(n.train, rng.uniform(0.0, 0.15))
        # interrupted or not, the parameters are exactly those of `n.step` applied steps
        assert_usable(n, steps_expected=n.step)
        n.train(1)  # and training continues
        assert_usable(n)
    assert interrupted >= len(SEEDS) // 2  # the trials did land inside training


def test_sigint_during_validate_predict_and_the_scan(warm):
    rng = random.Random(99)
    n = warm
    for trial in range(15):
        what = rng.choice(["validate", "predict", "scan"])
        if what == "validate":
            op = n.validate
        elif what == "predict":
            op = lambda: n.predict({"x": np.repeat(VALID["x"], 40, axis=0)})
        else:
            def op():
                nitro_ipy.bump_world()
                _cache.ensure_fresh()
        before = n.step
        sigint_during(op, rng.uniform(0.0, 0.02))
        assert n.step == before
        _cache.ensure_fresh()  # an interrupted scan runs again to completion
        assert_usable(n)
    assert not any(e.poisoned for e in n._programs.values())


ARMED = {"gc": False}


@contextlib.contextmanager
def dropped_sigints():
    """While active, `sigint_in_gc()` sends a SIGINT whose handler runs inside a gc callback (JAX
    registers one), where Python reports its exception as "Exception ignored" and drops it. Yields the
    exception types Python dropped."""
    dropped = []

    def collected(phase, info):
        if phase == "start" and ARMED["gc"]:
            ARMED["gc"] = False
            signal.raise_signal(signal.SIGINT)  # its handler runs at the next bytecode: inside this callback

    hook, sys.unraisablehook = sys.unraisablehook, lambda u: dropped.append(u.exc_type)
    gc.callbacks.append(collected)
    try:
        yield dropped
    finally:
        gc.callbacks.remove(collected)
        sys.unraisablehook = hook


def sigint_in_gc():
    ARMED["gc"] = True
    try:
        gc.collect()
    finally:
        ARMED["gc"] = False


def test_a_ctrl_c_dropped_in_a_gc_callback_still_interrupts_the_epoch(warm):
    def first_step_lr(step):  # called on the host before step 0, before the gate holds Ctrl-C
        if step == 0:
            sigint_in_gc()
        return 1e-2

    n = Nitro(Tiny(), data=DATA, batch_size=BS, max_epochs=4, progress=False, schedules={"lr": first_step_lr})
    with dropped_sigints() as dropped:
        with pytest.raises(nitro_ipy.TrainingInterrupted, match=r"at epoch 1, step 1/60;"):
            n.train()
    assert dropped == [KeyboardInterrupt]  # it did land in the callback, and Python dropped it there
    assert n.step == 1
    assert_usable(n, steps_expected=1)


@dataclasses.dataclass
class Counted(Tiny):
    @nitro_ipy.metrics("host")
    def rows(self, outputs, *, y):
        if DROP_IN_VALIDATION:
            DROP_IN_VALIDATION.pop()
            sigint_in_gc()
        return {"rows": (float(len(y)), None)}


DROP_IN_VALIDATION = []


@pytest.mark.parametrize("epochs", [1, 2])
def test_a_ctrl_c_dropped_during_validation_still_interrupts_the_call(epochs):
    """Dropped in the first epoch's validation: with more epochs to go the next one does not start, and
    after the last one `train()` does not return as if it finished."""
    n = Nitro(Counted(), data=DATA, batch_size=BS, max_epochs=epochs, progress=False)
    DROP_IN_VALIDATION.append(True)
    with dropped_sigints() as dropped:
        with pytest.raises(nitro_ipy.TrainingInterrupted, match=r"at epoch 1, validating;"):
            n.train()
    assert dropped == [KeyboardInterrupt]
    assert (n.epoch, n.step) == (1, 60)
    assert [row["epoch"] for row in n.history] == [1]
    assert n.history[0]["valid_rows"] == 37.0  # the epoch's validation finished before the interrupt
    assert_usable(n, steps_expected=60)


def test_sigint_during_a_compile_leaves_no_half_entry():
    for seed in range(3):
        rng = random.Random(seed)
        nitro_ipy.cache_reset()
        n = Nitro(Tiny(), data=DATA, batch_size=BS, progress=False)
        sigint_during(n.train, rng.uniform(0.0, 0.4))
        s = nitro_ipy.cache_stats()
        assert s.misses == s.entries
        assert_usable(n, steps_expected=n.step)
        n.train(1)
        s = nitro_ipy.cache_stats()
        # grad, opt, eval, metric:mae twice (37 valid rows: batch and remainder width), predict
        assert s.misses == s.entries == 6


@pytest.mark.parametrize("hook,entry", [
    ("loss", "train"), ("optimizer", "train"), ("mae", "validate"), ("forward", "predict"),
])
def test_an_exception_in_a_hook_at_trace_time_leaves_the_handle_usable(hook, entry):
    n = Nitro(Tiny(), data=DATA, batch_size=BS, progress=False)
    FAULT["hook"] = hook
    try:
        with pytest.raises(Injected, match=f"injected in `{hook}`"):
            if entry == "predict":
                n.predict({"x": VALID["x"]})
            else:
                getattr(n, entry)()
    finally:
        FAULT["hook"] = None
    s = nitro_ipy.cache_stats()
    assert s.misses == s.entries  # a failed trace is no entry and no miss
    assert n.step == 0
    n.train()
    assert_usable(n, steps_expected=n.step)


def test_nan_at_a_random_step_keeps_the_step_before(warm):
    for seed in range(10):
        nan_trial(random.Random(seed))


def nan_trial(rng):
    steps_per_epoch = len(TRAIN["x"]) // BS
    bad = rng.randrange(1, steps_per_epoch + 1)
    where = rng.choice(["x", "y", "schedule"])
    data, schedules = {k: v.copy() for k, v in TRAIN.items()}, None
    if where == "schedule":
        schedules = {"lr": lambda step: float("nan") if step == bad - 1 else 1e-2}
    else:
        perm = np.random.default_rng((0, 0)).permutation(len(TRAIN["x"]))
        data[where][perm[(bad - 1) * BS + rng.randrange(BS)]] = rng.choice([np.nan, np.inf, -np.inf])
    n = Nitro(Tiny(), data={"train": data, "valid": VALID}, batch_size=BS, progress=False, schedules=schedules)
    with pytest.raises(nitro_ipy.NonFiniteLossError, match=rf"at step {bad} \(epoch 1\)"):
        n.train()
    assert n.step == bad - 1
    assert_usable(n, steps_expected=bad - 1)
