"""Experiment tracking (`nitro_ipy.loggers`): what each logger receives, read back from real files with
each library's own reader (TensorBoard's event accumulator, MLflow's client, W&B's own record protobuf),
foreground and background, with `steps_per_execution`, a raising logger, across a resume."""

import glob
import struct
import sys
import time

import numpy as np
import pytest
from _experiments import Reg, data

import nitro_ipy
from nitro_ipy import Nitro, NitroTypeError
from nitro_ipy._base import _report
from nitro_ipy.loggers import Event, MLflow, TensorBoard, WandB

TRAIN, VALID = data(64), data(32, 1)


class Catch:
    """A callable logger that keeps what it is told; `log_every` for the step events."""

    def __init__(self, log_every=None):
        self.log_every, self.events = log_every, []

    def __call__(self, event):
        self.events.append(event)

    def kinds(self):
        return [e.kind for e in self.events]

    def at(self, kind, tag):
        return [(e.step, e.values[tag]) for e in self.events if e.kind == kind and tag in e.values]


@pytest.fixture
def messages():
    got = []
    previous = _report.set_sink(got.append)
    yield got
    _report.set_sink(previous)


def _handle(batch_size=16, **kw):
    kw.setdefault("data", {"train": TRAIN, "valid": VALID})
    return Nitro(Reg(), batch_size=batch_size, max_epochs=2, progress=False, seed=3, **kw)


def test_a_callable_gets_the_epochs_validations_and_hyperparameters_as_floats():
    log = Catch()
    n = _handle(loggers=[log])
    n.train()
    assert [k for k in log.kinds() if k != "compile"] == ["start", "validation", "epoch", "validation", "epoch"]
    start = log.events[0]
    assert start.params == {"GraphConst/hidden": 8, "Device/lr": 0.01} and start.step == 0
    assert log.at("epoch", "train/loss") == [(4, n.history[0]["loss"]), (8, n.history[1]["loss"])]
    assert log.at("validation", "valid/loss") == [(4, n.history[0]["valid_loss"]), (8, n.history[1]["valid_loss"])]
    assert all(type(v) is float for e in log.events for v in e.values.values())
    assert sorted(list(e.values) for e in log.events if e.kind == "compile") == [["compile/eval"], ["compile/grad"],
                                                                                 ["compile/opt"]]
    assert "step" not in log.kinds()  # per epoch by default


def test_log_every_counts_optimizer_steps_and_a_block_logs_its_mean_loss(messages):
    # 64 rows / 8 = 8 steps an epoch; with K=3: step 1 alone, blocks ending at 4 and 7, step 8 alone.
    per_step, blocks = Catch(log_every=1), Catch(log_every=2)
    _handle(batch_size=8, data={"train": TRAIN}, loggers=[per_step]).train(1)
    _handle(batch_size=8, data={"train": TRAIN}, loggers=[blocks], steps_per_execution=3).train(1)
    losses = dict(per_step.at("step", "step/loss"))
    assert sorted(losses) == list(range(1, 9))
    got = blocks.at("step", "step/loss")
    assert [s for s, _ in got] == [4, 7, 8]  # the first step past each multiple of 2: true steps, not calls
    want = [np.mean([losses[i] for i in range(1, 5)]), np.mean([losses[i] for i in (5, 6, 7)]), losses[8]]
    np.testing.assert_allclose([v for _, v in got], want, rtol=1e-5)
    assert [m.text for m in messages if m.kind == _report.Kind.LOGGER] == []  # none dropped, none lost


def test_a_raising_logger_is_detached_with_one_line_and_training_goes_on(messages):
    calls = []

    def broken(event):
        calls.append(event.kind)
        if event.kind == "validation":
            raise ValueError("disk full")

    good = Catch()
    n = _handle(loggers=[broken, good])
    n.train()
    assert n.epoch == 2 and calls == ["start", "compile", "compile", "compile", "validation"]
    assert [k for k in good.kinds() if k != "compile"] == ["start", "validation", "epoch", "validation", "epoch"]
    said = [m.text for m in messages if m.kind == _report.Kind.LOGGER]
    assert said == ["nitro_ipy.loggers: `test_a_raising_logger_is_detached_with_one_line_and_training_goes_on"
                    ".<locals>.broken` raised ValueError: disk full; it is detached for the rest of this "
                    "train() call, which goes on."]


def test_loggers_that_fall_behind_lose_step_events_counted_never_the_epochs(messages, monkeypatch):
    # The logger thread is held in the first event until the loop has offered all 40 step events: the
    # queue takes `QUEUE` of them, the loop drops the rest and says how many, once, at the call's end.
    from nitro_ipy.loggers import _tracker

    monkeypatch.setattr(_tracker, "QUEUE", 8)
    n = _handle(batch_size=8, data={"train": data(320)})

    def held(event):
        if event.kind == "start":
            session = n._tracking.session
            while session.steps_queued + session.dropped < 40:
                time.sleep(0.001)

    log = Catch(log_every=1)
    n.train(1, loggers=[held, log])
    assert n.step == 40 and [s for s, _ in log.at("step", "step/loss")] == list(range(1, 9))
    assert log.at("epoch", "train/loss") == [(40, n.history[0]["loss"])]
    assert [m.text for m in messages if m.kind == _report.Kind.LOGGER] == [
        "nitro_ipy.loggers: 32 step events were dropped: the loggers fell behind the steps (8 were waiting). "
        "Fix: a larger `log_every`."]


def test_while_the_call_runs_the_logger_thread_works_in_slices_and_writes_the_rest_when_it_ends(monkeypatch):
    # A slice is one event here, and the rest after it lasts until the call ends: every event but the
    # first is delivered after the loop finished, in order, and the call returns once all are delivered.
    from nitro_ipy.loggers import _tracker

    monkeypatch.setattr(_tracker, "SLICE", 0.0)
    monkeypatch.setattr(_tracker, "DUTY", 1e-9)
    monkeypatch.setattr(_tracker, "REST_MAX", 600.0)
    n = _handle(batch_size=8, data={"train": TRAIN})
    seen, session = [], []

    def when(event):
        session[:] = session or [n._tracking.session]  # the call's session (the handle lets go of it at the end)
        seen.append((event.kind, event.step, session[0].closing))

    when.log_every = 1

    n.train(2, loggers=[when])
    assert seen[0] == ("start", 0, False) and all(closing for _, _, closing in seen[1:])
    steps = [step for kind, step, _ in seen if kind == "step"]
    assert steps == list(range(1, 17)) and [k for k, _, _ in seen][-1] == "epoch" and len(seen) > 19


def test_the_logger_threads_share_of_the_time_follows_how_idle_the_training_thread_was_while_it_rested():
    from nitro_ipy.loggers import _tracker
    from nitro_ipy.loggers._tracker import DUTY, SHARE_MAX, Session

    session = Session([Catch()], [], 0, None, None)  # never started: its rule alone
    session.cpus = 2
    rest = (10.0, 5.0, 20.0)  # (wall, the training thread's CPU, the process's CPU) when a rest began
    after = lambda wall, trainer, process: session._share(rest, (10.0 + wall, 5.0 + trainer, 20.0 + process))
    assert after(0.1, 0.095, 0.1) == DUTY  # a dispatch-bound loop: busy 95% of the rest
    assert after(0.1, 0.06, 0.12) == DUTY  # busy 60%: the loop still needs the interpreter most of the time
    assert after(0.1, 0.02, 0.05) == pytest.approx(0.4)  # waiting for an accelerator: half its idle time
    assert after(0.1, 0.0, 0.0) == SHARE_MAX
    assert after(0.1, 0.02, 0.198) == DUTY  # idle, but the process keeps both CPUs busy (XLA's own threads)
    assert after(0.1, 0.02, 0.15) == pytest.approx(0.25)  # half a CPU left: a quarter of the time
    assert after(_tracker.REST_MIN / 4, 0.0, 0.0) == DUTY  # woken early (the call ended): nothing measured
    session.trainer = None  # no thread CPU clock on this system
    assert after(0.1, 0.0, 0.0) == DUTY


def test_a_background_run_logs_as_the_foreground_does_and_a_stop_is_logged():
    fg, bg = Catch(log_every=2), Catch(log_every=2)
    _handle().train(loggers=[fg])
    n = _handle()
    run = n.train(background=True, loggers=[bg])
    run.wait()
    strip = lambda log: [(e.kind, e.step, e.epoch, sorted(e.values)) for e in log.events if e.kind != "compile"]
    assert strip(bg) == strip(fg)
    assert bg.at("epoch", "train/loss") == fg.at("epoch", "train/loss")
    stopped = Catch()
    n = _handle(data={"train": data(4096)})
    run = n.train(10, background=True, loggers=[stopped])
    run.stop()
    run.wait()
    assert stopped.events[-1].kind == "stop" and stopped.events[-1].step == n.step
    assert stopped.events[-1].params == {"reason": "interrupted (Ctrl-C or `run.stop()`)"}


def test_checkpoints_a_stale_program_and_a_rebuild_are_logged_in_order(tmp_path, messages):
    from nitro_ipy._compiler import _cache

    log = Catch()
    n = _handle(data={"train": TRAIN}, loggers=[log], checkpoint_dir=tmp_path, checkpoint_every=1)
    n.train(1)
    (grad,) = [e for e in n._programs.values() if e.kind == "grad"]
    _cache.poison(grad, ["__main__.f"])  # as an edit of a helper the gradient program ran would
    n.train(1)
    n = n.rebuild()
    n.train(1)
    said = [(e.kind, e.step, e.params.get("path") or e.params.get("names")) for e in log.events
            if e.kind in ("start", "checkpoint", "stale", "rebuild")]
    ckpt = lambda step: str(tmp_path / f"step-{step:08d}.nitro.npz")
    assert said == [("start", 0, None), ("checkpoint", 4, ckpt(4)),
                    ("start", 4, None), ("stale", 4, "__main__.f"), ("checkpoint", 8, ckpt(8)),
                    ("start", 8, None), ("rebuild", 8, None), ("checkpoint", 12, ckpt(12))]


def test_loggers_are_checked_at_setup():
    with pytest.raises(NitroTypeError, match="got `str` 'runs/a' at position 0"):
        Nitro(Reg(), data={"train": TRAIN}, loggers=["runs/a"])
    with pytest.raises(nitro_ipy.NitroValueError, match="`log_every` is a number of optimizer steps.*; got 0"):
        Nitro(Reg(), data={"train": TRAIN}, loggers=[Catch(log_every=0)])
    n = _handle()
    with pytest.raises(NitroTypeError, match="got `int` 3 at position 0"):  # at the call, not in the run's thread
        n.train(background=True, loggers=[3])
    assert n._run is None and n.step == 0


def test_a_missing_tracker_library_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(ImportError) as err:
        TensorBoard("runs")
    assert str(err.value) == ("`nitro_ipy.loggers.TensorBoard` writes with `tensorboardX`, which is not installed. "
                              "Fix: `pip install nitro_ipy[tensorboard]`.")


# ------------------------------------------------------------------ TensorBoard, read by TensorBoard itself
def _tensorboard(logdir):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = accumulator.EventAccumulator(str(logdir), size_guidance={accumulator.SCALARS: 0, accumulator.TENSORS: 0})
    acc.Reload()
    return acc


def test_tensorboard_scalars_hparams_and_a_resume_that_continues_the_curves(tmp_path):
    pytest.importorskip("tensorboardX")
    logdir = tmp_path / "run"
    n = _handle(loggers=[TensorBoard(logdir, log_every=1)])
    n.train(1)
    path = n.save(tmp_path / "ckpt")
    resumed = _handle(resume=path, loggers=[TensorBoard(logdir, log_every=1)])
    resumed.train(1)
    acc = _tensorboard(logdir)
    scalars = lambda tag: [(s.step, s.value) for s in acc.Scalars(tag)]
    assert [s for s, _ in scalars("step/loss")] == list(range(1, 9))  # on at step 5 after the resume
    assert scalars("train/loss") == [(4, pytest.approx(n.history[0]["loss"])),
                                     (8, pytest.approx(resumed.history[1]["loss"]))]
    assert [s for s, _ in scalars("valid/loss")] == [4, 8]
    assert scalars("events/resume") == [(4, 1.0)]
    assert {"compile/grad", "compile/opt", "compile/eval", "step/steps_per_s", "train/steps_per_s"} <= set(
        acc.Tags()["scalars"])
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    assert {k: (v.number_value or v.string_value) for k, v in info.hparams.items()} == {
        "GraphConst/hidden": 8.0, "Device/lr": pytest.approx(0.01)}


# ------------------------------------------------------------------ MLflow, a local file store
def test_mlflow_logs_metrics_and_params_to_a_file_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store, in maintenance
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    logger = MLflow("tiny", tracking_uri=uri, log_every=2)
    n = _handle(loggers=[logger], steps_per_execution=3)
    n.train()
    logger.close()
    client = MlflowClient(uri)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"GraphConst.hidden": "8", "Device.lr": "0.01"}
    history = lambda tag: [(m.step, m.value) for m in client.get_metric_history(logger.run_id, tag)]
    assert history("train/loss") == [(4, pytest.approx(n.history[0]["loss"])), (8, pytest.approx(n.history[1]["loss"]))]
    assert [s for s, _ in history("step/loss")] == [4, 8]  # step 1 alone, then one K=3 block: steps 2-4


# ------------------------------------------------------------------ W&B offline, its own record format
def _wandb_records(path):
    """The records of a W&B run file (`run-<id>.wandb`): a LevelDB-style log of W&B's own `Record`
    protobufs (a 7-byte header, then 32 KiB blocks of chunks: crc32, length, type)."""
    from wandb.proto import wandb_internal_pb2

    raw = open(path, "rb").read()
    assert raw[:4] == b":W&B"
    pos, block, out, pending = 7, 32768, [], b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        chunk, pos = raw[pos + 7:pos + 7 + length], pos + 7 + length
        pending += chunk
        if kind in (1, 4):  # FULL, LAST
            out.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
        elif kind == 0:
            break
    return out


def test_wandb_offline_run_holds_the_config_and_history(tmp_path, monkeypatch, messages):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # W&B's console capture fails under pytest's
    logger = WandB("tiny", dir=str(tmp_path))
    n = _handle(loggers=[logger])
    n.train()
    logger.close()
    assert [m.text for m in messages if m.kind == _report.Kind.LOGGER] == []
    (path,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    for _ in range(100):  # W&B's own process may still be writing the file when `finish()` returns
        records = _wandb_records(path)
        if "exit" in [r.WhichOneof("record_type") for r in records]:
            break
        time.sleep(0.1)
    rows = [{i.key or "/".join(i.nested_key): i.value_json for i in r.history.item} for r in records
            if r.WhichOneof("record_type") == "history"]
    loss = [(int(r["_step"]), float(r["train/loss"])) for r in rows if "train/loss" in r]
    assert loss == [(4, pytest.approx(n.history[0]["loss"])), (8, pytest.approx(n.history[1]["loss"]))]
    config = {i.key: i.value_json for r in records if r.WhichOneof("record_type") == "config" for i in r.config.update}
    assert config["GraphConst/hidden"] == "8" and float(config["Device/lr"]) == pytest.approx(0.01)


def test_an_event_reads_as_one_line():
    e = Event("epoch", 8, 2, {"train/loss": 0.25}, {"stopped": "patience"})
    assert e.text() == "epoch at step 8 (epoch 2): train/loss=0.25, stopped=patience"
