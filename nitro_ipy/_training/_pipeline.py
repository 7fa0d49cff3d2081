"""The train input pipeline: per optimizer step, one batch (`{field: array}`; with `accum > 1` each array
stacks the step's micro-batches on a new leading axis), from one of three kinds of split.

- **Device-resident** (`Resident`): the split placed on the device once per handle; each epoch's shuffle
  (drawn on the host, as for a host split, so both give the same batches) is sent once, and the batches
  of a few steps are gathered on the device in one program. No host->device transfer and no Python
  `device_put` per step.
- **Host arrays** (a dict of numpy or memory-mapped arrays): gathered a few steps at a time (about
  `CHUNK_BYTES` per gather) into fresh chunks, each step a view of its chunk. Host memory grows by a
  chunk or two whatever the split's size (the old pipeline gathered the whole epoch: a full copy of the
  split), and a memory-mapped split is read as it is trained on.
- **Loaders** (`_data.Loader`): the batches as the loader yields them; an epoch is one pass.

On an accelerator a host batch is sent to the device one step ahead (double-buffered, as
`flax.jax_utils.prefetch_to_device` does): the step that runs never waits for its batch's transfer. On
the CPU a host batch stays numpy: a jitted call converts numpy arguments in its C++ dispatch for less than
`jax.device_put` of the same dict costs in Python (measured: 570 vs 105 us a step on the tiny MLP).

Where a split lives (`data_on_device="auto" | True | False`, the handle's option; `placement`): "auto"
places the train split on an accelerator when it takes at most a quarter of the device's free memory. On
the CPU "auto" keeps it on the host: `jax.device_put` of a numpy array copies it there (measured: +1 GiB
of RSS for a 1 GiB split), while host batches cost no copy of the split. True places it anyway (on the
CPU: one copy), False never does. A mesh keeps splits on the host (each batch is split along the data axis).

It also tells `_ahead` when a step loop runs (from its first step to its end): compiles queued for a
training handle wait for its first step and start while the epoch trains, and a compile ahead after an
edit waits while any step loop runs.
"""

import functools
import threading

import jax
import numpy as np

from .._base import _events
from .._base._errors import NitroTypeError, NitroValueError
from .._experiment._data import Loader, split_len, split_nbytes

# How far the loop may dispatch ahead of the device (`_loop`, `run_ahead`): a queued step holds its batch's
# copy until it runs, so without a bound a host faster than the device queues the epoch (measured on the
# CPU: +272 MiB for 64 steps of 16 MiB batches, +48 MiB when each step waited). The bound is in bytes of
# batches, at least RUN_AHEAD steps (the device stays fed); a small batch never waits in practice (a wait
# per step costs a tiny dispatch-bound model up to a third of its speed on the CPU).
RUN_AHEAD = 3
RUN_AHEAD_BYTES = 16 << 20
RUN_AHEAD_MAX = 1024
CHUNK_BYTES = 8 << 20  # a host gather's size: large enough that its Python cost is nothing per step
DEVICE_CHUNK_STEPS = 32  # steps a device gather takes at once (one program call)
DEVICE_CHUNK_BYTES = 64 << 20


def train_batches(split, fields, batch_size: int, accum: int, epoch_seed, start: int = 0):
    """The batches of `_data.train_batches` (same order, same shapes), each on the device when the split
    is device-resident, from the `start`-th on (an epoch an interrupt cut short goes on where it stopped,
    in the same order). `split` is a dict of host arrays, a `Resident` or a `_data.Loader`."""
    if isinstance(split, Resident):
        return _stepping(split.steps(fields, batch_size, accum, epoch_seed, start))
    if isinstance(split, Loader):
        steps = _loader_steps(split, fields, accum, start)
    else:
        steps = _host_steps(split, fields, batch_size, accum, epoch_seed, start)
    if jax.default_backend() != "cpu":  # host batches (a loader's too) go to the device a step ahead
        steps = _ahead_of_time(steps)
    return _stepping(steps)


def run_ahead(batch: dict) -> int:
    """Steps the loop may run ahead of the device with batches like `batch` in flight."""
    nbytes = sum(int(getattr(a, "nbytes", 0)) for a in batch.values())
    return max(RUN_AHEAD, min(RUN_AHEAD_MAX, RUN_AHEAD_BYTES // max(nbytes, 1)))


def _stepping(batches):
    """`batches`, telling `_ahead` that a step loop runs from its second batch (the first step and its
    compiles are done) to the end."""
    stepping = None  # the loop's thread, once it passed its first step (the end may come in another)
    try:
        for i, batch in enumerate(batches):
            if i == 1:
                stepping = threading.get_ident()
                _events.publish("stepping", True, stepping)
            yield batch
    finally:
        if stepping is not None:
            _events.publish("stepping", False, stepping)
        close = getattr(batches, "close", None)
        if close is not None:
            close()


def _ahead_of_time(batches):
    """Each batch sent to the device one step ahead: the next batch's transfer starts before the step
    of this one is dispatched."""
    it = iter(batches)
    try:
        ahead = next(it, None)
        if ahead is None:
            return
        ahead = jax.device_put(ahead)
        for nxt in it:
            batch, ahead = ahead, jax.device_put(nxt)
            yield batch
        yield ahead
    finally:
        it.close()  # a loader's pass closed when the loop stops early (Ctrl-C, an error)


def epoch_order(n: int, per_step: int, epoch_seed) -> np.ndarray:
    """The examples an epoch takes, in order: a shuffle of `n` seeded by `(seed, epoch)`, cut to whole
    steps. One rule for every kind of array split, so they all train on the same batches."""
    steps = n // per_step
    return np.random.default_rng(epoch_seed).permutation(n)[: steps * per_step]


def _host_steps(split: dict, fields, batch_size: int, accum: int, epoch_seed, start: int):
    n = split_len(split)
    per_step = batch_size * accum
    steps = n // per_step
    if start >= steps:
        return
    perm = epoch_order(n, per_step, epoch_seed)
    lead = (batch_size,) if accum == 1 else (accum, batch_size)
    columns = [split[f] for f in fields]
    step_bytes = per_step * sum(int(np.prod(c.shape[1:])) * np.dtype(c.dtype).itemsize for c in columns)
    per_chunk = max(1, min(steps, CHUNK_BYTES // max(step_bytes, 1)))
    for c0 in range(start, steps, per_chunk):
        c1 = min(c0 + per_chunk, steps)
        rows = perm[c0 * per_step : c1 * per_step]
        # A fresh chunk each time, never a reused buffer: on the CPU a step may still be reading the last
        # one (dispatch is asynchronous), and the chunk dies with the last step that holds it.
        chunk = [c[rows].reshape((c1 - c0,) + lead + c.shape[1:]) for c in columns]
        for i in range(c1 - c0):
            yield dict(zip(fields, [c[i] for c in chunk]))
        del chunk


def _loader_steps(loader: Loader, fields, accum: int, start: int):
    """One pass of `loader`, `accum` batches stacked per step, from step `start` on (the batches before
    are read and dropped: a loader that yields the same batches each pass resumes exactly). A ragged
    last batch is dropped, as an array split's partial batch is."""
    group, taken = [], start
    for arrays, rows in loader.batches(skip=start * accum):
        if rows < loader.width:  # the last (`Loader.batches` refuses a short one followed by more)
            continue
        group.append({f: arrays[f] for f in fields})
        if len(group) == accum:
            yield group[0] if accum == 1 else _stack(group)
            group, taken = [], taken + 1
    if taken == 0:
        raise NitroValueError(
            f"split `{loader.split}` yielded no full batch this epoch ({loader.width} rows, x accum={accum}); "
            f"a loader must yield at least one step's batches on every pass."
        )
    loader.steps = taken  # a pass counted: the progress total of the next epochs


def _stack(group: list) -> dict:
    out = {}
    for f in group[0]:
        values = [b[f] for b in group]
        out[f] = (jax.numpy.stack(values) if any(isinstance(v, jax.Array) for v in values)
                  else np.stack(values))
    return out


# ---------------------------------------------------------------- device-resident splits
class Resident:
    """A train split placed on the device: its fields as device arrays, and the batches of each epoch
    gathered there (`steps`), in the host pipeline's order."""

    def __init__(self, split: dict, device=None):
        self.source = split  # the host split it came from (the same arrays: `carry_resident`)
        self.n = split_len(split)
        self.nbytes = split_nbytes(split)
        self.arrays = {f: jax.device_put(np.asarray(a[:]) if not isinstance(a, np.ndarray) else a, device)
                       for f, a in split.items()}

    def __iter__(self):  # reads as the split's field names, as a host split does
        return iter(self.arrays)

    def __contains__(self, name):
        return name in self.arrays

    def __getitem__(self, name):
        return self.source[name]

    def steps(self, fields, batch_size: int, accum: int, epoch_seed, start: int):
        per_step = batch_size * accum
        steps = self.n // per_step
        if start >= steps:
            return
        perm = jax.device_put(epoch_order(self.n, per_step, epoch_seed).astype(np.int32))  # once per epoch
        columns = tuple(self.arrays[f] for f in fields)
        step_bytes = per_step * sum(c.nbytes // max(c.shape[0], 1) for c in columns)
        k = max(1, min(steps, DEVICE_CHUNK_STEPS, DEVICE_CHUNK_BYTES // max(step_bytes, 1)))
        lead = (batch_size,) if accum == 1 else (accum, batch_size)
        for c0 in range(start, steps, k):
            at = min(c0, steps - k)  # the last chunk ends at the epoch's end: one program for all
            chunk = _gather(columns, perm, np.int32(at * per_step), k, lead)
            for s in range(c0, min(c0 + k, steps)):
                yield dict(zip(fields, [c[s - at] for c in chunk]))


@functools.partial(jax.jit, static_argnums=(3, 4))
def _gather(columns: tuple, perm, offset, k: int, lead: tuple):
    """`k` steps' batches of each column, in the epoch's order from `offset`: one tuple of `k` arrays
    per column, so a step's batch is an array of its own (no slicing dispatch per step)."""
    rows = jax.lax.dynamic_slice(perm, (offset,), (k * int(np.prod(lead)),))
    out = []
    for c in columns:
        g = jax.numpy.take(c, rows, axis=0, mode="clip", unique_indices=True)
        g = g.reshape((k,) + lead + c.shape[1:])
        out.append(tuple(g[i] for i in range(k)))
    return tuple(out)


DATA_ON_DEVICE = ("auto", True, False)


def check_data_on_device(value):
    if not any(value is v or (isinstance(value, str) and value == v) for v in DATA_ON_DEVICE):
        raise NitroValueError(
            f"`data_on_device` must be \"auto\" (place the train split on an accelerator when it fits in "
            f"a quarter of its free memory), True or False; got {value!r}."
        )
    return value


def wants_device(option, split, mesh) -> bool:
    """Whether the train split `split` goes on the device under `data_on_device=option`."""
    if option is False or isinstance(split, (Loader, Resident)):
        if option is True and isinstance(split, Loader):
            raise NitroTypeError(
                f"`data_on_device=True` needs the train split as arrays; split `{split.split}` is a loader, "
                f"whose batches go to the device as it yields them. Pass arrays, or `data_on_device=\"auto\"`."
            )
        return False
    if mesh is not None:
        if option is True:
            raise NitroValueError(
                "`data_on_device=True` is not supported on a mesh yet: each batch is split along the data "
                "axis as it is drawn from the host. Leave `data_on_device=\"auto\"` there."
            )
        return False
    if option is True:
        return True
    return fits_on_device(split_nbytes(split))


def fits_on_device(nbytes: int, device=None) -> bool:
    """A quarter of the device's free memory or less. The CPU answers no (`jax.device_put` there copies
    the split, host batches do not); so does a device that reports no memory figures."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return False
    stats = device.memory_stats() or {}
    limit, used = stats.get("bytes_limit"), stats.get("bytes_in_use", 0)
    if not limit:
        return False
    return nbytes <= (limit - used) / 4


def train_split(n, name: str = "train"):
    """Handle `n`'s split `name` as its steps draw it: the device-resident copy (placed at its first
    train(), kept for the handle's life) or the host split."""
    split = n._binding.split(name)
    resident = n._resident.get(name)
    if resident is not None and same_arrays(split, resident.source):
        return resident
    if wants_device(n._options.get("data_on_device", "auto"), split, n._place.mesh):
        n._resident[name] = resident = Resident(split)
        return resident
    return split


def carry_resident(old, new) -> None:
    """A rebuilt handle keeps its predecessor's device copy when its split holds the same arrays."""
    for name, resident in old._resident.items():
        if same_arrays(new._binding.splits.get(name), resident.source):
            new._resident[name] = resident


def same_arrays(split, source: dict) -> bool:
    """`split` holds the very arrays of `source` (a handle's split bound again: a rebuild, say)."""
    return (isinstance(split, dict) and split.keys() == source.keys()
            and all(split[f] is source[f] for f in split))
