"""Background runs, stop, Ctrl-C, `n.set`, early stopping and `n.history.table()`: real threads, real
SIGINT, exact steps and counts. Worker threads are steered with schedules that wait on events at a chosen
step (a schedule runs on the worker, just before that step is dispatched), so no test depends on timing.
"""

import dataclasses
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _experiments import Reg  # the tiny regression most tests train, and its data
from _experiments import data as _data

import nitro_ipy
from nitro_ipy import Device, Nitro

ROOT = Path(__file__).resolve().parents[1]
INTERRUPTED = "training interrupted at epoch {}, step {}/{}; the handle is usable"


def _pin_helper(r):
    return r ** 2


@dataclasses.dataclass
class Knob(Reg):
    """The tiny regression with a spare Device field, `knob`, whose schedule steers the worker thread, and
    a loss through a helper of this module (`_pin_helper`, the one a test edits)."""

    knob: Device[float] = 0.0
    notes: str = ""

    def loss(self, outputs, *, y):
        return jnp.mean(_pin_helper(outputs - y))


DATA = {"train": _data(160), "valid": _data(40, 1)}  # 10 steps per epoch at batch_size=16


class Steer:
    """A `knob` schedule that, at step `at`, reports `reached` and waits for `go` (or calls `then()`)."""

    def __init__(self, at: int, then=None):
        self.at, self.then = at, then
        self.reached, self.go = threading.Event(), threading.Event()

    def __call__(self, step):
        if step == self.at:
            self.reached.set()
            if self.then is not None:
                self.then()
            else:
                assert self.go.wait(60), "the test never released the worker"
        return 0.0


def _handle(steer=None, **kw):
    kw.setdefault("max_epochs", 3)
    return Nitro(Knob(), data=DATA, batch_size=16, progress=False,
                 schedules={"knob": steer or (lambda s: 0.0)}, **kw)


def _leaves(n):
    return [np.asarray(x) for x in jax.tree.leaves((n.params, n.state))]


def test_background_run_returns_at_once_and_matches_a_foreground_run_exactly():
    steer = Steer(at=0)
    n = _handle(steer)
    run = n.train(background=True)  # the worker waits at step 0: train() returned while it cannot finish
    assert steer.reached.wait(60) and run.running and not run.done and run.status == "running"
    assert isinstance(run, nitro_ipy.Run) and n.step == 0
    assert repr(run) == "<nitro_ipy run of Knob: training at epoch 1, step 0/10, 0/3 epochs done, step 0>"
    steer.go.set()
    rows = run.wait()
    assert (run.done, run.running, run.status) == (True, False, "finished")
    assert nitro_ipy.cache_stats().misses == nitro_ipy.cache_stats().entries == 3  # what a foreground run compiles
    ref = _handle()
    assert ref.train() == rows == n.history == run.rows
    assert [r["epoch"] for r in rows] == [1, 2, 3] and (n.step, n.epoch) == (30, 3)
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(n), _leaves(ref)))
    assert nitro_ipy.cache_stats().misses == nitro_ipy.cache_stats().entries == 3
    assert run.wait() == rows  # a second wait returns the same rows
    assert repr(run) == "<nitro_ipy run of Knob: finished, 3/3 epochs done; `run.wait()` returns them, step 30>"


def test_stop_completes_the_step_in_flight_and_keeps_completed_epochs():
    box, started = {}, threading.Event()
    # Asked for while step 14 is being dispatched (once the test holds the run).
    n = _handle(Steer(at=14, then=lambda: (started.wait(60), box["run"].stop())), max_epochs=5)
    run = box["run"] = n.train(background=True)
    started.set()
    rows = run.wait()
    assert run.status == "stopped" and len(rows) == 1 and rows == n.history == run.rows
    assert (n.step, n.epoch) == (15, 1)  # step 14 completed; the cut epoch 2 does not count
    assert "stopped (stopped by `run.stop()`)" in repr(run)
    assert not any(x.is_deleted() for x in jax.tree.leaves((n.params, n.state)))
    # Nothing lost: the next train() finishes the cut epoch 2 at its next batch (an uninterrupted run's steps).
    assert [r["epoch"] for r in n.train(1)] == [2] and (n.step, n.epoch) == (20, 2)
    assert nitro_ipy.cache_stats().misses == nitro_ipy.cache_stats().entries == 3


def test_stop_at_an_epochs_last_step_lets_that_epoch_count_with_its_validation():
    box, go = {}, threading.Event()
    n = _handle(Steer(at=19, then=lambda: (go.wait(60), box["run"].stop())), max_epochs=5)
    box["run"] = run = n.train(background=True)
    go.set()
    rows = run.wait()
    assert (n.step, n.epoch, len(rows)) == (20, 2, 2)
    assert set(rows[-1]) == {"epoch", "loss", "valid_loss"}


def test_entry_points_refuse_a_busy_handle_and_set_works_meanwhile(tmp_path):
    steer = Steer(at=5)
    n = _handle(steer, max_epochs=1)
    run = n.train(background=True)
    assert steer.reached.wait(60)
    for call, what in [(lambda: n.train(), "train"), (lambda: n.validate(), "validate"),
                       (lambda: n.evaluate("valid"), "evaluate"), (lambda: n.predict({"x": DATA["valid"]["x"]}), "predict"),
                       (lambda: n.rebuild(), "rebuild"), (lambda: n.train(background=True), "train"),
                       # A save would read parameters the worker's next step donates ("Array has been
                       # deleted"), or a mix of two steps; `checkpoint_every=` saves from the worker itself.
                       (lambda: n.save(tmp_path / "busy"), "save")]:
        with pytest.raises(nitro_ipy.HandleBusyError) as err:
            call()
        assert str(err.value) == (
            f"`{what}` on a handle that is training in the background (epoch 1, step 5/10): both would use "
            f"its parameters. Wait for the run, `run.wait()`, or stop it at the next step, "
            f"`run.stop(); run.wait()`, then call `{what}` again. (`n.set(...)` and reading `n.history` "
            f"work meanwhile.)"
        )
    n.set(lr=1e-3)  # allowed while training: step 5 on runs with it
    steer.go.set()
    run.wait()
    ref_n = Nitro(Knob(), data=DATA, batch_size=16, progress=False, max_epochs=1,
                  schedules={"knob": lambda s: 0.0, "lr": lambda s: 1e-2 if s < 5 else 1e-3})
    ref_n.train()
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(n), _leaves(ref_n)))
    assert n.validate() == ref_n.validate()  # idle again: entry points work



def test_a_background_run_writes_its_periodic_checkpoints(tmp_path):
    """`n.save` is refused from other threads while the run trains; the run's own `checkpoint_every=`
    saves are not: one per epoch, each the state at that epoch's end."""
    n = _handle(max_epochs=3, checkpoint_dir=tmp_path, checkpoint_every=1)
    assert n.train(background=True).wait() == n.history
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step-{s:08d}.nitro.npz" for s in (10, 20, 30)]
    resumed = _handle(resume=tmp_path / "step-00000030.nitro.npz")
    assert (resumed.step, resumed.epoch) == (30, 3)
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(resumed), _leaves(n)))

def test_a_failing_run_raises_its_error_from_wait():
    @dataclasses.dataclass
    class Explodes(Knob):
        def loss(self, outputs, *, y):
            return jnp.mean(jnp.log(outputs * 0.0))

    n = Nitro(Explodes(), data=DATA, batch_size=16, progress=False)
    run = n.train(background=True)
    with pytest.raises(nitro_ipy.NonFiniteLossError, match=r"became -inf at step 1 \(epoch 1\)"):
        run.wait()
    assert run.status == "failed" and isinstance(run.error, nitro_ipy.NonFiniteLossError)
    with pytest.raises(nitro_ipy.NonFiniteLossError):
        run.wait()
    n.validate()  # a failed run leaves the handle idle


def test_wait_timeout_leaves_the_run_going():
    steer = Steer(at=2)
    n = _handle(steer, max_epochs=1)
    run = n.train(background=True)
    assert steer.reached.wait(60)
    with pytest.raises(TimeoutError, match=r"still training after 0.01 s \(epoch 1, step 2/10\); call `run.wait\(\)`"):
        run.wait(timeout=0.01)
    steer.go.set()
    assert len(run.wait()) == 1 and n.step == 10


def test_worker_messages_are_kept_on_the_run_and_shown_by_wait(capsys):
    steer = Steer(at=3)
    n = Nitro(Knob(), data=DATA, batch_size=16, progress=True, max_epochs=1, schedules={"knob": steer})
    run = n.train(background=True)
    assert steer.reached.wait(60)
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""  # the worker printed nothing, and drew no bar
    assert [m.kind for m in run.messages] == ["compile", "compile"]
    steer.go.set()
    run.wait()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" in ")[0] for line in lines[:3]] == [
        "nitro_ipy: compiled grad [forward, loss]", "nitro_ipy: compiled opt [optimizer]",
        "nitro_ipy: compiled eval [forward, loss]"]
    assert lines[3].startswith("nitro_ipy: epoch 1 | loss ") and len(lines) == 4
    run.wait()
    assert capsys.readouterr().out == ""  # each message shown once


def test_run_events_for_front_ends():
    seen = []
    unsubscribe = nitro_ipy._base._events.subscribe("run", lambda run: seen.append((run.done, threading.current_thread().name)))
    try:
        run = _handle(max_epochs=1).train(background=True)
        run.wait()
    finally:
        unsubscribe()
    assert seen == [(False, threading.current_thread().name), (True, "nitro_ipy run (Knob)")]


def test_background_runs_reuse_an_idle_worker_and_side_by_side_runs_get_their_own():
    """A warm worker thread dispatches faster than a new one (bench_runs), so an ended run's worker
    trains the next run; two runs at once each have one, and an idle worker is named as such."""
    threads = []
    for _ in range(2):
        run = _handle(max_epochs=1).train(background=True)
        run.wait()
        threads.append(run._thread)
    assert threads[0] is threads[1] and threads[0].is_alive() and threads[0].name == "nitro_ipy run (idle)"
    first, second = Steer(at=2), Steer(at=2)
    runs = [_handle(first, max_epochs=1).train(background=True), _handle(second, max_epochs=1).train(background=True)]
    assert first.reached.wait(60) and second.reached.wait(60)  # both hold a step at once: two workers
    assert runs[0]._thread is not runs[1]._thread and threads[0] in (runs[0]._thread, runs[1]._thread)
    assert sorted(r._thread.name for r in runs) == ["nitro_ipy run (Knob)"] * 2
    first.go.set(), second.go.set()
    assert [len(r.wait()) for r in runs] == [1, 1]


def test_a_background_run_is_pinned_to_its_code():
    global _pin_helper
    steer = Steer(at=4)
    n = _handle(steer, max_epochs=1)
    # Validation compiled on demand, after the edit (the case the mixed-code line is for): with compile
    # ahead on, the run's evaluation program compiles as its first step starts, before any edit, and
    # the run validates with the code it started with.
    from nitro_ipy._training import _ahead

    previous = _ahead.set_compile_ahead(False)
    run = n.train(background=True)
    assert steer.reached.wait(60)
    old = _pin_helper
    try:
        _pin_helper = lambda r: jnp.abs(r)  # noqa: E731 - the "edit", while the run trains
        nitro_ipy.bump_world()
        steer.go.set()
        run.wait()
        _ahead.set_compile_ahead(previous)
        assert nitro_ipy.cache_stats().misses == 3  # nothing recompiled under the running train
        nitro_ipy._compiler._cache.ensure_fresh()
        assert [e.kind for e in n._programs.values() if e.poisoned] == ["grad"]  # it did move
        # Validation compiled after the edit, so it traced the new helper: the run says it mixes the two.
        assert [m.text for m in run.messages if m.kind == "mixed-code"] == [(
            "nitro_ipy: this run compiled its `eval` program after test_runs._pin_helper changed: `eval` runs "
            "the new code, `grad` the code the run started with. To train and validate one version: "
            "`run.stop(); run.wait(); n = n.rebuild()`, then train again.")]
        _pin_helper = old
        ref = _handle(max_epochs=1)
        ref.train()
    finally:
        _pin_helper = old
        _ahead.set_compile_ahead(previous)
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(n), _leaves(ref)))


def test_a_finished_run_and_its_handle_are_freed_without_a_garbage_collection():
    """Dropping a handle that trained in the background frees it (and so its programs) at once, as for a
    foreground one: the run and the handle do not hold each other in a cycle only `gc` would break.
    Else, after `cache_reset()`, the next scan still judged those programs, poisoning them under a new
    cache's counts (what made test_honest fail after this file)."""
    freed = {}
    gc.disable()
    try:
        for background in (False, True):
            n = _handle(max_epochs=1)
            run = n.train(background=background)
            if background:
                assert run.wait() == n.history
            entry = weakref.ref(next(iter(n._programs.values())))
            handle = weakref.ref(n)
            del n, run
            nitro_ipy.cache_reset()  # the cache lets its entries go: only a live handle still holds one
            freed[background] = (handle() is None, entry() is None)
    finally:
        gc.enable()
    assert freed == {False: (True, True), True: (True, True)}


# ---------------------------------------------------------------- Ctrl-C in the foreground
def _sigint_from_a_thread():
    # A real SIGINT, sent from another thread; joined, so it lands while this step is being dispatched.
    t = threading.Timer(0, os.kill, (os.getpid(), signal.SIGINT))
    t.start()
    t.join()


def test_ctrl_c_ends_a_foreground_train_with_one_line():
    n = _handle(lambda s: (_sigint_from_a_thread() or 0.0) if s == 13 else 0.0, max_epochs=3)
    with pytest.raises(nitro_ipy.TrainingInterrupted) as err:
        n.train()
    text = INTERRUPTED.format(2, 4, 10)
    assert str(err.value) == text and err.value._render_traceback_() == [text]
    assert isinstance(err.value, KeyboardInterrupt)
    assert (err.value.epoch, err.value.step, err.value.steps, len(err.value.rows)) == (2, 4, 10, 1)
    assert (n.step, n.epoch, len(n.history)) == (14, 1, 1)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert len(n.train(1)) == 1 and (n.step, n.epoch) == (20, 2)  # epoch 2 goes on at its 5th step


def test_ctrl_c_during_validation_keeps_the_epochs_row():
    @dataclasses.dataclass
    class SlowMetric(Knob):
        def metrics(self, outputs, *, y):
            _sigint_from_a_thread()
            return {"mae": (np.sum(np.abs(outputs - y)), len(y))}

    n = Nitro(SlowMetric(), data=DATA, batch_size=16, progress=False, max_epochs=2)
    with pytest.raises(nitro_ipy.TrainingInterrupted, match=r"^training interrupted at epoch 1, validating; the handle is usable$"):
        n.train()
    assert (n.step, n.epoch) == (10, 1) and [r["epoch"] for r in n.history] == [1]


def test_ctrl_c_in_a_script_ends_with_the_message(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from test_runs import _handle
        _handle(lambda s: (os.kill(os.getpid(), signal.SIGINT) or 0.0) if s == 4 else 0.0).train()
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == "nitro_ipy.TrainingInterrupted: " + INTERRUPTED.format(1, 5, 10)


# ---------------------------------------------------------------- n.set
def test_set_changes_a_device_field_with_no_recompile():
    e = Knob()
    n = Nitro(e, data=DATA, batch_size=16, progress=False)
    n.train()
    before = nitro_ipy.cache_stats()
    n.set(lr=1e-4)  # a Python float, coerced to the field's float32
    n.set(notes="after the lr drop")
    assert n.experiment.lr == 1e-4 and n.experiment.notes == "after the lr drop"
    assert e.lr == 1e-2 and e.notes == ""  # the user's experiment object is not touched
    assert n._dev["lr"].dtype == np.float32 and float(n._dev["lr"]) == np.float32(1e-4)
    n.train()
    after = nitro_ipy.cache_stats()
    assert (after.misses, after.entries) == (before.misses, before.entries) == (3, 3)
    rebuilt = n.rebuild()  # carries the set value
    assert float(rebuilt._dev["lr"]) == np.float32(1e-4) and rebuilt.experiment.notes == "after the lr drop"


def test_set_refuses_what_it_cannot_do_and_sets_nothing_then():
    @dataclasses.dataclass
    class Vec(Knob):
        scale: Device[jax.Array] = dataclasses.field(default_factory=lambda: np.ones(3, np.float32))
        count: Device[int] = 2

    n = Nitro(Vec(), data=DATA, batch_size=16, progress=False, schedules={"knob": lambda s: 0.0})
    with pytest.raises(nitro_ipy.NitroTypeError, match=r"^`hidden` is a GraphConst field: it is baked into the compiled programs.*"
                       r"`Nitro\(dataclasses.replace\(n.experiment, hidden=16\), \.\.\.\)`.*`n = n.rebuild\(\)`"):
        n.set(lr=1.0, hidden=16)
    assert float(n._dev["lr"]) == np.float32(1e-2)  # checked before anything is set
    with pytest.raises(nitro_ipy.NitroValueError, match=r"^`Vec` has no field `lrr` \(Device: `lr`, `knob`, `scale`, `count`; Host: `notes`; GraphConst: `hidden`\)\.$"):
        n.set(lrr=1.0)
    with pytest.raises(nitro_ipy.NitroValueError, match=r"^`knob` follows its schedule"):
        n.set(knob=1.0)
    with pytest.raises(nitro_ipy.NitroValueError, match=r"has shape \(3,\); got shape \(2,\)"):
        n.set(scale=[1.0, 2.0])
    with pytest.raises(nitro_ipy.NitroValueError, match=r"`count` is int32; 2.5 would be cut to 2"):
        n.set(count=2.5)
    with pytest.raises(nitro_ipy.NitroTypeError, match=r"`lr` holds a float32 array of shape \(\); got str"):
        n.set(lr="fast")
    for bad in (float("nan"), float("inf"), [1.0, float("nan"), 1.0]):  # as a schedule's value is refused
        with pytest.raises(nitro_ipy.NitroValueError, match=r"would be .*, which is not finite; a non-finite "
                                                             r"hyperparameter turns every parameter into NaN"):
            n.set(lr=bad) if np.ndim(bad) == 0 else n.set(scale=bad)
    n.set(scale=0.5, count=3.0)  # a scalar broadcasts; a whole float is a fine int
    assert n._dev["scale"].tolist() == [0.5, 0.5, 0.5] and n._dev["count"].dtype == np.int32
    n.train()
    assert nitro_ipy.cache_stats().misses == nitro_ipy.cache_stats().entries == 3


# ---------------------------------------------------------------- early stopping
def test_early_stopping_fires_after_patience_and_says_so(capsys):
    n = Nitro(Knob(lr=0.0), data=DATA, batch_size=16, max_epochs=10, stop_when=("valid_loss", "min", 2))
    rows = n.train()  # lr 0: the valid loss never improves on epoch 1's
    assert [r["epoch"] for r in rows] == [1, 2, 3] and [("stopped" in r) for r in rows] == [False, False, True]
    best = rows[0]["valid_loss"]
    assert rows[-1]["stopped"] == f"valid_loss did not improve for 2 epochs (best {best:.4g} at epoch 1)"
    epoch_lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("nitro_ipy: epoch")]
    assert epoch_lines[-1].endswith(f"| stopped: valid_loss did not improve for 2 epochs (best {best:.4g} at epoch 1)")
    assert [r["epoch"] for r in n.train(2)] == [4, 5]  # patience counts per train() call


def test_early_stopping_max_mode_and_in_a_background_run():
    n = Nitro(Knob(), data=DATA, batch_size=16, progress=False, max_epochs=10, stop_when=("valid_loss", "max", 1))
    run = n.train(background=True)  # a learning model: the valid loss falls, so "max" fires at epoch 2
    rows = run.wait()
    assert len(rows) == 2 and rows[1]["stopped"].startswith("valid_loss did not improve for 1 epoch (best ")
    assert run.status == "stopped"


def test_stop_when_is_checked_at_setup():
    train_only = {"train": DATA["train"]}
    cases = [
        (("valid_loss", "min", 2), train_only, r"watches `valid_loss`, a validation metric, but this handle has no `valid` split \(splits: `train`\)"),
        (("valid_loss", "lowest", 2), DATA, r"the mode must be \"min\" or \"max\", got 'lowest'"),
        (("valid_loss", "min", 0), DATA, r"the patience must be a positive integer of epochs, got 0"),
        ("valid_loss", DATA, r"^`stop_when=\(metric, \"min\" \| \"max\", patience\)`"),
    ]
    for rule, data, message in cases:
        with pytest.raises(nitro_ipy.NitroValueError, match=message):
            Nitro(Knob(), data=data, stop_when=rule)
    n = Nitro(Knob(), data=DATA, batch_size=16, progress=False, stop_when=("valid_acc", "max", 2))
    with pytest.raises(nitro_ipy.NitroValueError, match=r"watches `valid_acc`, which the epoch rows do not have \(they have `epoch`, `loss`, `valid_loss`\)"):
        n.train()
    assert [r["epoch"] for r in n.history] == [1]


# ---------------------------------------------------------------- n.history as a table
def test_history_stays_a_list_of_dicts_and_prints_as_a_table():
    n = Nitro(Knob(lr=0.0), data=DATA, batch_size=16, progress=False, max_epochs=3, stop_when=("valid_loss", "min", 2))
    rows = n.train()
    assert isinstance(n.history, list) and n.history == rows and type(rows) is list
    table = nitro_ipy.History(rows).table()
    try:
        import pandas
    except ImportError:
        assert table.columns == ["epoch", "loss", "valid_loss", "stopped"]
        lines = repr(table).splitlines()
        assert lines[0].split() == ["epoch", "loss", "valid_loss", "stopped"] and len(lines) == 4
        assert lines[1].split() == ["1", f"{rows[0]['loss']:.4g}", f"{rows[0]['valid_loss']:.4g}"]
        assert lines[3].endswith(rows[2]["stopped"])
        assert table._repr_html_().count("<tr>") == 4
    else:
        assert isinstance(table, pandas.DataFrame) and list(table.columns) == ["epoch", "loss", "valid_loss", "stopped"]
    assert repr(Nitro(Knob(), data=DATA).history.table()) in ("(no epochs yet)", "Empty DataFrame\nColumns: []\nIndex: []")


def _main_thread_waits():
    # Until the main thread is blocked inside `run.wait()` (read from its frame, not guessed from time).
    main = threading.main_thread().ident
    for _ in range(100000):
        frame = sys._current_frames().get(main)
        names = []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        if "wait" in names and any(n.startswith("test_ctrl_c_during_wait") for n in names):
            return
        threading.Event().wait(0.001)
    raise AssertionError("the main thread never waited")


def test_ctrl_c_during_wait_stops_the_run():
    held = {}

    def interrupt_the_waiter():
        _main_thread_waits()
        os.kill(os.getpid(), signal.SIGINT)
        # The worker holds its step until the waiter has asked the run to stop, so the stop lands at the
        # next boundary however the two threads are scheduled on a loaded machine.
        for _ in range(100000):
            if "run" in held and held["run"]._control.pending:
                return
            threading.Event().wait(0.001)

    n = _handle(Steer(at=13, then=interrupt_the_waiter), max_epochs=5)
    run = held["run"] = n.train(background=True)
    with pytest.raises(nitro_ipy.TrainingInterrupted, match=r"^training interrupted at epoch 2, step 4/10; the handle is usable$"):
        run.wait()
    assert run.status == "stopped" and (n.step, n.epoch, len(n.history)) == (14, 1, 1)
    assert "stopped (interrupted (Ctrl-C in `run.wait()`))" in repr(run)


def test_ctrl_c_in_an_ipython_shell_prints_one_line(capsys):
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.user_ns.update(_handle=_handle, os=os, signal=signal)
    try:
        result = ip.run_cell("n = _handle(lambda s: (os.kill(os.getpid(), signal.SIGINT) or 0.0) if s == 4 else 0.0)\nn.train()\n")
        assert isinstance(result.error_in_exec, nitro_ipy.TrainingInterrupted)
        lines = capsys.readouterr().out.strip().splitlines()
        assert [line for line in lines if not line.startswith("nitro_ipy: compiled")] == [INTERRUPTED.format(1, 5, 10)]
        assert ip.user_ns["n"].step == 5
    finally:
        ip.reset(new_session=False)  # the process's one shell: its `n` must not outlive this test


# ---------------------------------------------------------------- a terminal's progress
def _train_in_a_child(stderr_is_a_terminal: bool) -> tuple[list, str]:
    """Train 2 epochs (progress on) in a child Python whose stderr is a pseudo-terminal or a pipe: its
    `nitro_ipy:` stdout lines and everything it wrote to stderr."""
    import fcntl
    import pty
    import struct
    import termios

    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from test_runs import DATA, Knob
        from nitro_ipy import Nitro
        Nitro(Knob(), data=DATA, batch_size=16, max_epochs=2).train()
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    if not stderr_is_a_terminal:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr
        return [ln for ln in out.stdout.splitlines() if ln.startswith("nitro_ipy:")], out.stderr
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty is 0 columns wide
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=slave, text=True, env=env)
    os.close(slave)
    err = b""
    while True:  # drain the terminal as the child writes, or a full pty buffer would block it
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        err += chunk
    os.close(master)
    stdout = proc.stdout.read()
    assert proc.wait(timeout=300) == 0, err.decode(errors="replace")[-4000:]
    return [ln for ln in stdout.splitlines() if ln.startswith("nitro_ipy:")], err.decode(errors="replace")


def test_a_terminal_gets_a_bar_per_epoch_and_a_log_only_the_lines():
    tty_lines, tty_err = _train_in_a_child(True)
    log_lines, log_err = _train_in_a_child(False)
    # The same clean text lines either way: the compiles, then one line per epoch.
    assert [ln.split()[1] for ln in tty_lines] == [ln.split()[1] for ln in log_lines]
    assert [ln.split(" | ")[0] for ln in log_lines if " epoch " in ln] == ["nitro_ipy: epoch 1", "nitro_ipy: epoch 2"]
    # A terminal also sees a tqdm bar while each epoch runs (`leave=False`: it is erased at the epoch's end).
    assert "epoch 1/2" in tty_err and "epoch 2/2" in tty_err and "/10 [" in tty_err
    assert "epoch 1/2" not in log_err and "epoch 2/2" not in log_err  # a log file holds no bar
