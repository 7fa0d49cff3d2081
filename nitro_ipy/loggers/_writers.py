"""The trackers: TensorBoard (through `tensorboardX`), Weights & Biases and MLflow, each through its own
library's API. Each is a callable logger (`(event) -> None`) with a `log_every`, a `flush()` the logger
thread calls after each drain and a `close()`. The library is imported when the logger is made, so a
missing one is one line at setup naming the extra to install; the writer itself opens at the first event,
in the logger thread, never on the step path.

TensorBoard is written with `tensorboardX` (numpy and protobuf only): `tensorboard`'s own package has no
writer without TensorFlow or PyTorch (`torch.utils.tensorboard`), and is needed only to view or read.
"""

import importlib
import itertools
import os
import threading

from .._base._errors import NitroError
from ._tracker import check_log_every

MISSING = "`nitro_ipy.loggers.{cls}` writes with `{module}`, which is not installed. Fix: `pip install nitro_ipy[{extra}]`."


class MissingTracker(NitroError, ImportError):
    """A tracker's library is not installed."""


def _require(cls: str, module: str, extra: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingTracker(MISSING.format(cls=cls, module=module, extra=extra)) from None


class _Writer:
    """What the three trackers share: the cadence, a lazily opened writer, a count per text event."""

    def __init__(self, log_every):
        self.log_every = check_log_every(log_every)
        self._lock = threading.Lock()  # `close()` may run in the user's thread while the logger thread writes
        self._open = False
        self._counts: dict = {}

    def __call__(self, event):
        with self._lock:
            if not self._open:
                self._start()
                self._open = True
            if event.kind == "start":
                self._hparams(event)
            elif event.kind not in ("step", "epoch", "validation", "compile"):
                self._counts[event.kind] = self._counts.get(event.kind, 0) + 1
                self._text(event, {f"events/{event.kind}": float(self._counts[event.kind])})
            if event.values:
                self._scalars(event)

    def flush(self):
        with self._lock:
            if self._open:
                self._flush()

    def close(self):
        """Flush and close the writer (the run, for W&B and MLflow); a later event opens it again."""
        with self._lock:
            if self._open:
                self._flush()
                self._close()
                self._open = False

    def _text(self, event, counts: dict):
        self._scalars(type(event)(event.kind, event.step, event.epoch, counts, {}, event.time))

    def _flush(self):
        pass


_files = itertools.count()  # this process's event files, for their names


class TensorBoard(_Writer):
    """Writes TensorBoard event files under `logdir` (a run's directory: `tensorboard --logdir runs`).

    **Arguments:**
    - `logdir`: the run's directory; a resumed run may write to the same one, its curves go on.
    - `log_every`: also log every `k` optimizer steps (`step/loss`, ...); default: per epoch only.

    Written with `tensorboardX`'s event file writer and summaries, from the logger thread itself
    (its `SummaryWriter` would add a process queue and a thread of its own to every scalar).
    """

    def __init__(self, logdir, *, log_every: int | None = None):
        super().__init__(log_every)
        _require("TensorBoard", "tensorboardX", "tensorboard")
        self.logdir, self.writer = str(logdir), None

    def _start(self):
        from tensorboardX.event_file_writer import EventsWriter

        os.makedirs(self.logdir, exist_ok=True)
        # tensorboardX names a file by the second and the host alone: a second writer on the same run
        # within that second (a resume, a rebuild) would write over the first one's file.
        self.writer = EventsWriter(os.path.join(self.logdir, "events"), f".{os.getpid()}.{next(_files)}")

    def _write(self, event, summary):
        from tensorboardX.proto.event_pb2 import Event

        self.writer.write_event(Event(wall_time=event.time, step=event.step, summary=summary))

    def _hparams(self, event):
        # In the run's own file (`SummaryWriter.add_hparams` would open a sub-run), as the HParams tab reads it.
        from tensorboardX.summary import hparams

        for summary in hparams(event.params, {}):
            self._write(event, summary)

    def _scalars(self, event):
        from tensorboardX.proto.summary_pb2 import Summary

        self._write(event, Summary(value=[Summary.Value(tag=tag, simple_value=value)
                                          for tag, value in event.values.items()]))

    def _text(self, event, counts: dict):
        from tensorboardX.summary import text

        super()._text(event, counts)
        said = ", ".join(f"{k}={v}" for k, v in event.params.items())
        self._write(event, text(f"events/{event.kind}", f"{event.kind} at step {event.step}: {said}"))

    def _flush(self):
        self.writer.flush()

    def _close(self):
        self.writer.close()


class WandB(_Writer):
    """Logs to a Weights & Biases run (offline too: `WANDB_MODE=offline`, then `wandb sync`).

    **Arguments:**
    - `project`: the W&B project; `log_every`: as for `TensorBoard`.
    - `**init`: passed to `wandb.init` (`name`, `dir`, `mode`, `entity`, `tags`, ...). The experiment's
      fields go to the run's config, under `GraphConst/`, `Device/` and `Host/`.
    """

    def __init__(self, project: str | None = None, *, log_every: int | None = None, **init):
        super().__init__(log_every)
        self._wandb = _require("WandB", "wandb", "wandb")
        self._init = dict(init, project=project) if project is not None else dict(init)
        self.run = None
        self._id = None

    def _start(self):
        again = {} if self._id is None else {"id": self._id, "resume": "allow"}
        self.run = self._wandb.init(**self._init, **again)
        self._id = self.run.id

    def _hparams(self, event):
        self.run.config.update(event.params, allow_val_change=True)

    def _scalars(self, event):
        self.run.log(dict(event.values), step=event.step)

    def _close(self):
        self.run.finish()


class MLflow(_Writer):
    """Logs to an MLflow run through `MlflowClient` (`mlflow-skinny` is enough).

    **Arguments:**
    - `experiment`: the MLflow experiment's name (made if missing; default: MLflow's default experiment).
    - `tracking_uri`: where to (default: MLflow's own setting, `MLFLOW_TRACKING_URI`); e.g. a
      `file:` store, `sqlite:///mlflow.db` or a server's URL.
    - `run_name`, `log_every`: the run's name; the step cadence, as for `TensorBoard`.
    """

    def __init__(self, experiment: str | None = None, *, tracking_uri: str | None = None,
                 run_name: str | None = None, log_every: int | None = None):
        super().__init__(log_every)
        _require("MLflow", "mlflow", "mlflow")
        self.experiment, self.tracking_uri, self.run_name = experiment, tracking_uri, run_name
        self.client = self.run_id = None
        self._metrics, self._params, self._logged = [], [], set()

    def _start(self):
        from mlflow.tracking import MlflowClient

        self.client = client = MlflowClient(self.tracking_uri)
        if self.run_id is None:
            exp_id = "0"
            if self.experiment is not None:
                found = client.get_experiment_by_name(self.experiment)
                exp_id = found.experiment_id if found is not None else client.create_experiment(self.experiment)
            self.run_id = client.create_run(exp_id, run_name=self.run_name).info.run_id
        else:
            client.update_run(self.run_id, status="RUNNING")

    def _hparams(self, event):
        from mlflow.entities import Param

        for key, value in event.params.items():  # an MLflow param is written once per run
            if key not in self._logged:
                self._logged.add(key)
                self._params.append(Param(key.replace("/", "."), str(value)[:6000]))

    def _scalars(self, event):
        from mlflow.entities import Metric

        ms = int(event.time * 1000)
        self._metrics.extend(Metric(tag, value, ms, event.step) for tag, value in event.values.items())
        if len(self._metrics) >= 1000:  # a whole batch: written now, not held (a backlog's drain would hold
            self._flush()  # tens of thousands of objects, each collection of the oldest generation longer)

    def _flush(self):
        while self._metrics or self._params:  # MLflow takes at most 1000 metrics and 100 params a batch
            metrics, self._metrics = self._metrics[:1000], self._metrics[1000:]
            params, self._params = self._params[:100], self._params[100:]
            self.client.log_batch(self.run_id, metrics=metrics, params=params)

    def _close(self):
        self.client.set_terminated(self.run_id)
