"""Splits, batches and padding. Everything here is host-side numpy; nothing is traced."""

import numpy as np

from .._base._errors import NitroTypeError, NitroValueError
from ._checks import check_column


def check_splits(data) -> dict[str, dict[str, np.ndarray]]:
    """Validate `{"train": {field: array}, ...}`: a dict of dicts of arrays with a common leading axis."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise NitroTypeError(
            f"`data` must be a dict of splits like `{{\"train\": {{\"x\": X, \"y\": Y}}}}`; "
            f"got {type(data).__qualname__}."
        )
    out = {}
    for split, fields in data.items():
        if not isinstance(fields, dict) or not fields:
            raise NitroTypeError(
                f"split `{split}` must be a non-empty dict of arrays (`{{\"x\": X, \"y\": Y}}`); "
                f"got {type(fields).__qualname__}."
            )
        arrays = {}
        for name, value in fields.items():
            try:
                arr = np.asarray(value)
            except Exception as err:
                raise NitroTypeError(f"field `{name}` of split `{split}` is not array-like: {err}") from None
            check_column(split, name, arr, value)
            if arr.ndim == 0:
                raise NitroValueError(
                    f"field `{name}` of split `{split}` is a scalar; every field needs a leading example axis."
                )
            if arr.dtype == np.float64:
                arr = arr.astype(np.float32)  # JAX computes in float32 unless x64 is enabled
            elif arr.dtype == np.int64:
                arr = arr.astype(np.int32)
            arrays[name] = arr
        lengths = {name: len(a) for name, a in arrays.items()}
        if len(set(lengths.values())) > 1:
            shown = ", ".join(f"`{n}`: {k}" for n, k in lengths.items())
            raise NitroValueError(
                f"the fields of split `{split}` have different lengths ({shown}); every field of a split "
                f"needs the same number of examples along axis 0."
            )
        out[split] = arrays
    return out


def split_len(split: dict) -> int:
    return len(next(iter(split.values())))


def train_batches(split: dict, fields, batch_size: int, accum: int, epoch_seed):
    """Shuffled batches of one epoch; the partial final batch is dropped.

    With `accum > 1` each yielded batch stacks `accum` micro-batches along a new leading axis.
    """
    n = split_len(split)
    per_step = batch_size * accum
    steps = n // per_step
    perm = np.random.default_rng(epoch_seed).permutation(n)
    arrays = [(f, split[f]) for f in fields]
    for s in range(steps):
        idx = perm[s * per_step : (s + 1) * per_step]
        if accum == 1:
            yield {f: a[idx] for f, a in arrays}
        else:
            yield {f: a[idx].reshape((accum, batch_size) + a.shape[1:]) for f, a in arrays}


def steps_per_epoch(split: dict, batch_size: int, accum: int) -> int:
    return split_len(split) // (batch_size * accum)


def eval_batches(split: dict, fields, batch_size: int):
    """`(batch, n_valid)` in order over every example; the short final batch is padded to `batch_size`
    by repeating its last example (real data, so padding never produces NaNs) and sliced back later."""
    n = split_len(split)
    arrays = [(f, split[f]) for f in fields]
    for start in range(0, n, batch_size):
        stop = min(start + batch_size, n)
        batch = {}
        for f, a in arrays:
            chunk = a[start:stop]
            if stop - start < batch_size:
                pad = [(0, batch_size - (stop - start))] + [(0, 0)] * (a.ndim - 1)
                chunk = np.pad(chunk, pad, mode="edge")
            batch[f] = chunk
        yield batch, stop - start
