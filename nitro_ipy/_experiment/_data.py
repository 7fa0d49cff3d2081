"""Splits, batches and padding. Everything here is host-side; nothing is traced.

A split is either a dict of arrays with a common leading axis (numpy, JAX, or memory-mapped: `np.memmap`,
`np.load(path, mmap_mode="r")`, which are never read whole) or a `Loader`: a re-iterable of batches
(`{field: array}` dicts), as image and text pipelines and PyTorch's `DataLoader` produce them.
"""

import numpy as np

from .._base._errors import NitroTypeError, NitroValueError
from ._checks import check_column

_ONE_SHOT = (
    "split `{split}` is a one-shot iterator ({what}): it would be empty from the second epoch on. Pass "
    "something that starts a new pass each epoch: the generator function itself (`data={{\"{split}\": "
    "make_batches}}`, called again every epoch, not `make_batches()`), a list of batches, or an object "
    "whose `__iter__` starts over (a PyTorch `DataLoader` does)."
)
_TUPLES = (
    "split `{split}` yields {what} (batch {step}); a batch must be a dict naming its fields, as the hooks "
    "take them by name. Name them in a re-iterable wrapper: `data={{\"{split}\": lambda: ({{\"x\": x, "
    "\"y\": y}} for x, y in loader)}}`."
)


def check_splits(data) -> dict:
    """Validate `{"train": split, ...}`: each split a dict of arrays with a common leading axis, or a
    re-iterable of batch dicts (a `Loader`, whose first batch is read here to know its fields)."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise NitroTypeError(
            f"`data` must be a dict of splits like `{{\"train\": {{\"x\": X, \"y\": Y}}}}`; "
            f"got {type(data).__qualname__}."
        )
    out = {}
    for split, fields in data.items():
        if isinstance(fields, Loader):  # checked already (a handle's splits bound again)
            out[split] = fields
            continue
        if not isinstance(fields, dict) and is_batch_source(fields):
            out[split] = Loader(split, fields)
            continue
        if not isinstance(fields, dict) or not fields:
            raise NitroTypeError(
                f"split `{split}` must be a non-empty dict of arrays (`{{\"x\": X, \"y\": Y}}`) or a "
                f"re-iterable of such dicts (a generator function, a `DataLoader`); got "
                f"{type(fields).__qualname__}."
            )
        arrays = {name: _column(split, name, value) for name, value in fields.items()}
        lengths = {name: len(a) for name, a in arrays.items()}
        if len(set(lengths.values())) > 1:
            shown = ", ".join(f"`{n}`: {k}" for n, k in lengths.items())
            raise NitroValueError(
                f"the fields of split `{split}` have different lengths ({shown}); every field of a split "
                f"needs the same number of examples along axis 0."
            )
        out[split] = arrays
    return out


def _column(split: str, name: str, value):
    if isinstance(value, LazyCast):
        return value
    mapped = _memory_mapped(value)
    try:
        arr = np.asarray(value)  # a memmap stays a view of its file: nothing is read
    except Exception as err:
        raise NitroTypeError(f"field `{name}` of split `{split}` is not array-like: {err}") from None
    check_column(split, name, arr, value)
    if arr.ndim == 0:
        raise NitroValueError(
            f"field `{name}` of split `{split}` is a scalar; every field needs a leading example axis."
        )
    dtype = canonical_dtype(arr.dtype)
    if dtype != arr.dtype:
        # JAX computes in float32 / int32 unless x64 is enabled. A memory-mapped file is converted batch
        # by batch as it is read, never whole (that would read the file into memory).
        return LazyCast(arr, dtype) if mapped else arr.astype(dtype)
    return arr


def canonical_dtype(dtype) -> np.dtype:
    return {np.dtype(np.float64): np.dtype(np.float32), np.dtype(np.int64): np.dtype(np.int32)}.get(
        np.dtype(dtype), np.dtype(dtype))


def _memory_mapped(value) -> bool:
    while value is not None:
        if isinstance(value, np.memmap) or type(value).__name__ == "mmap":
            return True
        value = getattr(value, "base", None)
    return False


class LazyCast:
    """A memory-mapped column of a 64-bit dtype, converted to 32 bits row by row as it is read: what
    `split[f][rows]` and `split[f][a:b]` give is the converted copy of those rows only."""

    def __init__(self, array: np.ndarray, dtype):
        self.array, self.dtype = array, np.dtype(dtype)
        self.shape, self.ndim = array.shape, array.ndim

    def __len__(self):
        return len(self.array)

    def __getitem__(self, index):
        return np.asarray(self.array[index], self.dtype)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize


def is_batch_source(value) -> bool:
    """Whether `value` is offered as a stream of batches (iterable or callable), not as arrays."""
    if isinstance(value, (str, bytes, np.ndarray)) or hasattr(value, "__array__"):
        return False
    return callable(value) or hasattr(value, "__iter__")


class Loader:
    """A split given as batches: a re-iterable (`__iter__` starts a new pass: a list, a `DataLoader`) or a
    function called each epoch for a fresh iterable (a generator function). Each batch is a dict of
    arrays; the first one, read at setup, fixes the fields, their shapes and dtypes, and the batch width.

    Every batch must match the first one's fields and shapes, save the last, which may be shorter (a
    ragged last batch): training drops it, as it drops an array split's partial batch; evaluation pads it
    and counts only its real rows, as it does an array split's short final batch.
    """

    def __init__(self, split: str, source):
        self.split, self.source = split, source
        if hasattr(source, "__iter__"):
            if iter(source) is source:
                raise NitroTypeError(_ONE_SHOT.format(split=split, what=f"a {type(source).__qualname__} object"))
            self.length = len(source) if hasattr(source, "__len__") else None
        else:
            self.length = None
        self.steps = None  # full batches per pass, once a pass has been counted
        it = self._open()
        try:
            first = next(it, None)
        finally:
            _close(it)
        if first is None:
            raise NitroValueError(f"split `{split}` yielded no batch; a split needs at least one.")
        arrays = self._arrays(first, 0)
        self.fields = {name: (a.shape[1:], a.dtype) for name, a in arrays.items()}
        self.width = len(next(iter(arrays.values())))
        self.specs = {name: _Spec((self.width,) + shape, dtype) for name, (shape, dtype) in self.fields.items()}

    def __repr__(self):
        return f"Loader({self.split!r}, {type(self.source).__qualname__}, fields={list(self.fields)}, width={self.width})"

    # A loader answers `in`, iteration over field names and `[name]` (the batch's shape and dtype) as an
    # array split does, so routes and checks read both alike.
    def __iter__(self):
        return iter(self.fields)

    def __contains__(self, name):
        return name in self.fields

    def __getitem__(self, name):
        return self.specs[name]

    def keys(self):
        return self.fields.keys()

    def _open(self):
        if hasattr(self.source, "__iter__"):
            return iter(self.source)
        got = self.source()
        if isinstance(got, dict) or not hasattr(got, "__iter__"):
            raise NitroTypeError(
                f"split `{self.split}`: `{getattr(self.source, '__qualname__', self.source)}()` returned "
                f"{type(got).__qualname__}; a function given as a split must return an iterable of batch "
                f"dicts (a generator function, say), called again each epoch."
            )
        return iter(got)

    def _arrays(self, batch, step: int) -> dict:
        if isinstance(batch, (tuple, list)):
            raise NitroTypeError(_TUPLES.format(split=self.split, what=f"a {type(batch).__name__} of "
                                                f"{len(batch)} values", step=step))
        if not isinstance(batch, dict) or not batch:
            raise NitroTypeError(_TUPLES.format(split=self.split, what=type(batch).__qualname__, step=step))
        out = {}
        for name, value in batch.items():
            if not hasattr(value, "dtype") or not hasattr(value, "shape") or isinstance(value, np.ndarray):
                value = np.asarray(value)
                check_column(self.split, name, value, value)
                if value.dtype != canonical_dtype(value.dtype):
                    value = value.astype(canonical_dtype(value.dtype))
            elif not _is_jax(value):  # a torch tensor, a memmap slice...
                value = np.asarray(value)
                check_column(self.split, name, value, value)
                value = value.astype(canonical_dtype(value.dtype), copy=False)
            if value.ndim == 0:
                raise NitroValueError(f"field `{name}` of split `{self.split}` is a scalar in batch {step}; "
                                      f"every field needs a leading example axis.")
            out[name] = value
        lengths = {name: value.shape[0] for name, value in out.items()}
        if len(set(lengths.values())) > 1:
            shown = ", ".join(f"`{n}`: {k}" for n, k in lengths.items())
            raise NitroValueError(f"batch {step} of split `{self.split}` has fields of different lengths "
                                  f"({shown}); every field of a batch needs the same number of rows.")
        return out

    def batches(self, skip: int = 0):
        """`(batch, rows)` for each batch of one pass after the first `skip` (a resume replays the pass
        and drops what was taken), each checked against the first batch; `rows < width` only for the
        last one. Raises an error naming the field, the batch and both shapes when one disagrees."""
        it = self._open()
        fields, width = self.fields, self.width
        try:
            step, short = -1, None
            for step, batch in enumerate(it):
                if step < skip:
                    continue
                arrays = self._arrays(batch, step)
                if arrays.keys() != fields.keys():
                    raise NitroValueError(
                        f"batch {step} of split `{self.split}` has fields {_names(arrays)}; the first batch had "
                        f"{_names(fields)}. Every batch of a split must carry the same fields."
                    )
                rows = None
                for name, a in arrays.items():
                    shape, dtype = fields[name]
                    if a.shape[1:] != shape or a.shape[0] > width or a.dtype != dtype:
                        raise NitroValueError(
                            f"field `{name}` of split `{self.split}`: batch {step} is {a.dtype}{list(a.shape)}, "
                            f"the first batch was {dtype}{[width, *shape]}. Every batch must have the first "
                            f"batch's shape and dtype (only the last may have fewer rows)."
                        )
                    rows = a.shape[0]
                if short is not None:
                    raise NitroValueError(
                        f"batch {short[0]} of split `{self.split}` has {short[1]} rows and is not the last "
                        f"(batch {step} follows it); only the last batch may be shorter than the first "
                        f"({width} rows)."
                    )
                if rows < width:
                    short = (step, rows)
                yield arrays, rows
        finally:
            _close(it)


def _is_jax(value) -> bool:
    return type(value).__module__.startswith(("jax", "jaxlib"))


def _names(d) -> str:
    return ", ".join(f"`{k}`" for k in d)


def _close(it):
    close = getattr(it, "close", None)
    if callable(close):
        close()


class _Spec:
    """The shape and dtype of a loader's batch field (what `split[name]` gives for a `Loader`)."""

    __slots__ = ("shape", "dtype", "ndim")

    def __init__(self, shape, dtype):
        self.shape, self.dtype, self.ndim = tuple(shape), np.dtype(dtype), len(shape)

    def __repr__(self):
        return f"{self.dtype}{list(self.shape)}"


def split_len(split) -> int | None:
    """Examples in an array split; None for a loader (known only by reading it)."""
    if isinstance(split, Loader):
        return None
    return len(next(iter(split.values())))


def split_nbytes(split: dict) -> int:
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in split.values())


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


def steps_per_epoch(split, batch_size: int, accum: int) -> int | None:
    """Optimizer steps in an epoch of `split`; for a loader, what one counted pass took, else
    `len(loader) // accum` when it has a length, else None (not known before a pass)."""
    if isinstance(split, Loader):
        if split.steps is not None:
            return split.steps
        return None if split.length is None else split.length // accum
    return split_len(split) // (batch_size * accum)


def eval_batches(split, fields, batch_size: int):
    """`(batch, n_valid)` in order over every example; the short final batch is padded to `batch_size`
    by repeating its last example (real data, so padding never produces NaNs) and sliced back later.
    A loader's batches come as it yields them (its width is its first batch's), the short last one
    padded likewise."""
    if isinstance(split, Loader):
        for arrays, rows in split.batches():
            batch = {f: arrays[f] for f in fields}
            if rows < split.width:
                batch = {f: _pad(np.asarray(a), split.width) for f, a in batch.items()}
            yield batch, rows
        return
    n = split_len(split)
    arrays = [(f, split[f]) for f in fields]
    for start in range(0, n, batch_size):
        stop = min(start + batch_size, n)
        batch = {}
        for f, a in arrays:
            chunk = a[start:stop]
            if stop - start < batch_size:
                chunk = _pad(chunk, batch_size)
            batch[f] = chunk
        yield batch, stop - start


def _pad(chunk, width: int):
    pad = [(0, width - len(chunk))] + [(0, 0)] * (chunk.ndim - 1)
    return np.pad(chunk, pad, mode="edge")
