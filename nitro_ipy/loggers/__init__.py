"""Experiment tracking: TensorBoard, Weights & Biases, MLflow, or any callable `(event) -> None`.

`Nitro(e, loggers=[TensorBoard("runs/a")])` (or `n.train(loggers=[...])` for one call) hands each logger
an `Event` for what training does: an epoch's end, a validation, a block of steps (`log_every=k`), a
compile, a stale program, a stop, a checkpoint, a rebuild, a resume. The step loop only starts an
asynchronous copy of a value and appends it to a bounded queue; a logger thread reads it and writes
(`_tracker.py`). See docs/tracking.md.

May import `_base` and `_experiment`; `_training` and `_notebook` may import it.
"""

from ._event import Event as Event
from ._tracker import Tracker as Tracker
from ._writers import MLflow as MLflow
from ._writers import TensorBoard as TensorBoard
from ._writers import WandB as WandB

__all__ = ["Event", "MLflow", "TensorBoard", "Tracker", "WandB"]
