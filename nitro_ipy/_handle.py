"""`Nitro`: the training handle. Setup, the step loop, evaluation, prediction and rebuilds.

The handle owns the side effects (counters, messages, progress); the programs in `_programs.py` stay pure.
"""

import contextlib
import dataclasses
import signal
import threading
import time
from typing import Callable

import jax
import numpy as np
import optax

from . import _cache, _closure, _compile, _report
from ._report import Kind
from ._compat import compiled_in_avals, compiled_out_avals
from ._data import check_splits, eval_batches, split_len, steps_per_epoch, train_batches
from ._errors import NitroTypeError, NitroValueError, NonFiniteLossError
from ._fields import (
    CompileView,
    assert_graphconst_hashable,
    field_kinds,
    graphconst_field_hash,
    graphconst_fields,
)
from ._fingerprint import Unfingerprintable, code_fingerprint, fingerprint, function_fingerprint
from ._hooks import field_names, hook, live_class, metric_hooks
from ._layout import FlatLayout, TreeLayout
from . import _programs


def _default_optimizer(self):
    return optax.adam(1e-3)


def _short_repr(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _strong(x):
    """A fresh, strongly typed device copy: a Python scalar from `init` would otherwise be weakly typed,
    and the optimizer's strongly typed output would move the key at step 2."""
    return jax.device_put(np.asarray(x))


def _device_value(cls, name: str, value):
    try:
        arr = np.asarray(value)
    except Exception:
        arr = None
    if arr is None or arr.dtype.kind not in "biufc":
        raise NitroTypeError(
            f"Device field `{cls.__qualname__}.{name}` must hold a number or numeric array; got "
            f"{type(value).__qualname__} ({_short_repr(value)}). Mark it `GraphConst[...]` if it shapes "
            f"the graph, or `Host[...]` if compiled code does not need it."
        )
    dtype = jax.dtypes.canonicalize_dtype(arr.dtype)
    if isinstance(value, bool):
        dtype = np.dtype(bool)
    return np.asarray(arr, dtype)


@contextlib.contextmanager
def _deferred_interrupts(gate: list):
    """While `gate[0]` is True, Ctrl-C is held until the step in flight has stored its results, so an
    interrupt never leaves the handle with donated-away buffers. Outside the gate it raises at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if gate[0]:
            gate[1] = True
        else:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@dataclasses.dataclass
class _Route:
    """Which batch fields a hook wants: the required ones, and optional ones sent when a split has them."""

    required: tuple
    optional: tuple
    takes_all: bool

    def pick(self, available) -> tuple:
        if self.takes_all:
            return tuple(available)
        return self.required + tuple(f for f in self.optional if f in available)


class Nitro:
    """A training handle on experiment `e`. Construction runs setup only; programs compile on first use.

    **Arguments:**
    - `e`: the experiment, a dataclass with `GraphConst` / `Device` / `Host` fields and hook methods.
    - `data`: `{"train": split, "valid": split, "test": split}`, each split a dict of arrays with a common
      leading axis; default: the experiment's `data(self)` hook.
    - `batch_size`, `max_epochs` (epochs per `train()` call), `accum` (micro-batches per optimizer step).
    - `schedules`: `{device_field: fn(step) -> value}`, applied before every step.
    - `seed`: seeds `init` and the per-epoch shuffle.
    - `progress`: show a progress bar while training (a widget in notebooks, text in terminals).
    - `flat_params`: update parameters as one flat buffer per dtype (default). Set False for optimizers
      whose maths is per array (LAMB, LARS, factored Adafactor, masks by parameter path).
    """

    def __init__(
        self,
        e,
        data=None,
        *,
        batch_size: int = 128,
        max_epochs: int = 1,
        accum: int = 1,
        schedules: dict | None = None,
        seed: int = 0,
        progress: bool = True,
        flat_params: bool = True,
        _carry=None,
    ):
        field_kinds(e)  # a non-dataclass is refused here, with the fix
        cls = live_class(type(e))
        if cls is not type(e):
            e = _rebind(e, cls)
        self.experiment = e
        self._cls = cls
        for name, value in (("batch_size", batch_size), ("max_epochs", max_epochs), ("accum", accum)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise NitroValueError(f"`{name}` must be a positive integer; got {value!r}.")
        self.batch_size, self.max_epochs, self.accum = int(batch_size), int(max_epochs), int(accum)
        self.seed, self.progress, self.flat_params = seed, progress, flat_params
        self._options = dict(
            data=data, batch_size=batch_size, max_epochs=max_epochs, accum=accum,
            schedules=schedules, seed=seed, progress=progress, flat_params=flat_params,
        )

        assert_graphconst_hashable(e)
        self._owner = f"{cls.__module__}.{cls.__qualname__}"
        self._gc_hash = graphconst_field_hash(e)
        self._gc_values = {n: getattr(e, n) for n in graphconst_fields(cls)}
        self._info = {
            "graphconst": {n: (fingerprint(v, n), _short_repr(v)) for n, v in self._gc_values.items()}
        }
        kinds = field_kinds(cls)
        self._hosts = tuple(n for n, k in kinds.items() if k == "Host")

        # Hooks, bound through the live class now: the handle is a fixed point from here on.
        self._init = hook(cls, "init")
        self._forward = hook(cls, "forward")
        self._loss = hook(cls, "loss", required=False)
        self._optimizer = hook(cls, "optimizer", required=False) or _default_optimizer
        self._metrics = metric_hooks(cls)
        field_names(cls, self._init, 2)
        self._routes = {"forward": _Route(*field_names(cls, self._forward, 2))}
        if self._loss is not None:
            self._routes["loss"] = _Route(*field_names(cls, self._loss, 2))
        for name, (fn, _) in self._metrics.items():
            self._routes[name] = _Route(*field_names(cls, fn, 2))
        self._hook_fps = {
            name: _hook_fingerprint(fn)
            for name, fn in (("init", self._init), ("forward", self._forward), ("loss", self._loss),
                             ("optimizer", self._optimizer), *((n, f) for n, (f, _) in self._metrics.items()))
            if fn is not None
        }

        if data is None and hook(cls, "data", required=False) is not None:
            data = cls.data(e)
        self._splits = check_splits(data)
        self._check_routes()

        # Device fields: converted once, strongly typed, passed to every program as traced inputs.
        self._dev_np = {n: _device_value(cls, n, getattr(e, n)) for n, k in kinds.items() if k == "Device"}
        self._dev = {n: jax.device_put(v) for n, v in self._dev_np.items()}
        self._schedules = dict(schedules or {})
        for name, fn in self._schedules.items():
            if name not in self._dev:
                raise NitroValueError(
                    f"schedule for `{name}`, which is not a Device field of `{cls.__qualname__}` "
                    f"(Device fields: {', '.join(map(repr, self._dev)) or 'none'}); mark it `Device[float]` "
                    f"so a schedule can set it without recompiling."
                )
            if not callable(fn):
                raise NitroTypeError(f"schedule for `{name}` must be callable as `fn(step)`; got {fn!r}.")

        if _carry is not None:
            params, opt_state, self.step, self.epoch = _carry
            # One transfer for every buffer, no per-shape copy programs: the old handle keeps its own.
            self._params, opt_state = jax.device_put((params, opt_state), may_alias=False)
        else:
            rng = jax.random.PRNGKey(seed)
            self._params = jax.tree.map(_strong, self._init(e, rng))
            opt_state, self.step, self.epoch = None, 0, 0
        layout_cls = FlatLayout if flat_params else TreeLayout
        self._layout = layout_cls(self._params)
        if opt_state is None:
            tx = self._optimizer(self._view(self._dev))
            opt_state = tx.init(self._layout.ravel(self._params))
            self._state = jax.tree.map(_strong, opt_state)
        else:
            self._state = opt_state

        self._programs: dict = {}  # key -> Entry: what this handle runs (kept even if poisoned)
        self._kinds_seen: dict = {}  # kind -> key of the first program of that kind
        self._loops_reported: set = set()
        self.history: list[dict] = []

    # ---------------------------------------------------------------- state
    @property
    def params(self):
        """The current parameters (the pytree `init` returned, updated by training)."""
        return self._params

    @property
    def state(self):
        """The optimizer state (over the flat parameter buffers unless `flat_params=False`)."""
        return self._state

    def rebuild(self) -> "Nitro":
        """A new handle on the same experiment with the current state carried over and hooks re-bound
        through the class as it is now: the way to pick up an edit."""
        return Nitro(self.experiment, _carry=(self._params, self._state, self.step, self.epoch), **self._options)

    def __repr__(self):
        return (
            f"Nitro({type(self.experiment).__qualname__}, step={self.step}, epoch={self.epoch}, "
            f"programs={len(self._programs)}, stale={any(e.poisoned for e in self._programs.values())})"
        )

    # ---------------------------------------------------------------- setup helpers
    def _view(self, dev) -> CompileView:
        return CompileView(self._cls, {**self._gc_values, **dev}, self._hosts, _closure.note_class_attr)

    def _check_routes(self):
        for split_name, split in self._splits.items():
            hooks = ["forward"]
            if split_name == "train":
                hooks += ["loss"] if self._loss is not None else []
            else:
                hooks += [h for h in self._routes if h != "forward" and (h != "loss" or self._loss)]
            for h in hooks:
                missing = [f for f in self._routes[h].required if f not in split]
                if missing:
                    raise NitroValueError(
                        f"hook `{self._cls.__qualname__}.{h}` wants batch field "
                        f"{', '.join(f'`{m}`' for m in missing)}, which split `{split_name}` does not provide "
                        f"(it has {', '.join(f'`{k}`' for k in split)}). Add the field to the split, or give "
                        f"the parameter a default in `{h}`."
                    )

    def _split(self, name: str) -> dict:
        if name not in self._splits:
            have = ", ".join(f"`{k}`" for k in self._splits) or "no splits"
            raise NitroValueError(
                f"no `{name}` split: this handle has {have}. Pass it as `Nitro(e, data={{\"{name}\": "
                f"{{...}}}})` or return it from the experiment's `data(self)` hook."
            )
        return self._splits[name]

    def _need_loss(self, what: str):
        if self._loss is None:
            raise NitroTypeError(
                f"`{self._cls.__qualname__}` has no `loss` hook, which {what} needs; add "
                f"`def loss(self, outputs, *, y): return scalar`."
            )

    def _hooks_key(self, *names) -> tuple:
        return tuple((n, self._hook_fps[n]) for n in names)

    # ---------------------------------------------------------------- programs
    def _resolve(self, kind: str, build: Callable, args: tuple, names: tuple, hooks: tuple,
                 options: tuple = (), donate=(), compiler_options=None):
        key = _cache.Key(kind, self._owner, self._hooks_key(*hooks), _cache.arg_signature(args, names),
                         self._gc_hash, options)
        entry = self._programs.get(key)
        if entry is not None:
            _cache.count_hit(entry)
            return entry
        entry = _cache.lookup(key)
        if entry is None:
            entry = _compile.compile_program(key, build(), args, donate_argnums=donate, info=self._info,
                                           record=_closure.record, compiler_options=compiler_options)
            first = self._kinds_seen.get(kind)
            if first is not None and first.hooks == key.hooks and kind not in self._loops_reported:
                self._report_loop(kind, first, entry)
        self._kinds_seen.setdefault(kind, key)
        self._programs[key] = entry
        return entry

    def _report_loop(self, kind, first_key, entry):
        if kind not in ("grad", "opt"):
            return
        self._loops_reported.add(kind)
        _report.emit(Kind.RECOMPILE_LOOP, program=kind, why=entry.why or "the key moved")

    def _options_key(self) -> tuple:
        return (("accum", self.accum), ("layout", self._layout.signature))

    def _grad_entry(self, batch):
        inputs = self._routes["forward"].pick(batch)
        targets = self._routes["loss"].pick(batch)
        build = lambda: _programs.make_gradient(self._view, self._forward, self._loss, inputs, targets,
                                                 self._layout, self.accum)
        return self._resolve("grad", build, (self._params, self._dev, batch),
                             ("params", "device", "batch"), ("forward", "loss"),
                             self._options_key())

    def _opt_entry(self, flat_grads):
        build = lambda: _programs.make_optimizer(self._view, self._optimizer, self._layout)
        return self._resolve("opt", build, (self._params, flat_grads, self._state, self._dev),
                             ("params", "grads", "opt_state", "device"), ("optimizer",),
                             (("layout", self._layout.signature),), donate=(0, 2),
                             compiler_options=_compile.OPTIMIZER_OPTIONS)

    # ---------------------------------------------------------------- entry points
    def _enter(self):
        _cache.ensure_fresh()
        stale = [e for e in self._programs.values() if e.poisoned]
        if stale:
            _report.emit(Kind.STALE_HANDLE, handle=self, names=_report.merge_names(stale),
                         kinds=tuple(e.kind for e in stale))

    def train(self, epochs: int | None = None) -> list[dict]:
        """Train for `epochs` (default `max_epochs`) epochs, validating after each one when a `valid`
        split exists. Returns this call's per-epoch records (also appended to `n.history`)."""
        self._enter()
        self._need_loss("training")
        split = self._split("train")
        steps = steps_per_epoch(split, self.batch_size, self.accum)
        if steps == 0:
            raise NitroValueError(
                f"the train split has {split_len(split)} examples, fewer than one step "
                f"(batch_size={self.batch_size} x accum={self.accum}); lower `batch_size`."
            )
        fields = sorted(set(self._routes["forward"].pick(split)) | set(self._routes["loss"].pick(split)))
        records = []
        for _ in range(self.max_epochs if epochs is None else epochs):
            record = {"epoch": self.epoch + 1, "loss": self._train_epoch(split, fields, steps)}
            self.epoch += 1
            if "valid" in self._splits:
                record.update({f"valid_{k}": v for k, v in self._evaluate("valid").items()})
            self.history.append(record)
            records.append(record)
            if self.progress:
                _report.emit(Kind.EPOCH, record=record)
        return records

    def _train_epoch(self, split, fields, steps) -> float:
        batches = train_batches(split, fields, self.batch_size, self.accum, (self.seed, self.epoch))
        bar = None  # opened after the first step, so compile lines print above it, not through it
        schedules = self._schedules
        gate = [False, False]  # [defer Ctrl-C now, Ctrl-C pending]
        losses, total, n_loss = [], 0.0, 0
        reused, grad, opt = 0, None, None  # steady-state steps that reused the resolved programs
        try:
            with _deferred_interrupts(gate):
                # First step: resolve both programs (maybe compiling); they stay fixed for the epoch when
                # the optimizer hands back parameters and state of the avals it was compiled for.
                batch = next(batches)
                if schedules:
                    self._apply_schedules()
                grad, opt, loss = self._keyed_step(batch, gate)
                stable = _returns_its_inputs(opt)
                self.step += 1
                losses.append(loss)
                gate[0] = False
                if self.progress:
                    bar = _progress_bar(steps, f"epoch {self.epoch + 1}")
                    bar.update(1)
                grad_call, opt_call = grad.call, opt.call
                next_sync = time.perf_counter() + 0.25
                for batch in batches:
                    if gate[1]:
                        raise KeyboardInterrupt
                    gate[0] = True  # from here to the stored results, Ctrl-C waits for the step
                    if schedules:
                        self._apply_schedules()
                    if stable:
                        flat_grads, loss = grad_call(self._params, self._dev, batch)
                        self._params, self._state = opt_call(self._params, flat_grads, self._state, self._dev)
                        reused += 1
                    else:  # slow path: re-key every step (and report the loop)
                        gate[0] = False  # nothing is donated yet, and a compile may follow
                        grad, opt, loss = self._keyed_step(batch, gate)
                    self.step += 1
                    gate[0] = False
                    losses.append(loss)
                    if bar is not None:
                        bar.update(1)
                    if time.perf_counter() > next_sync:
                        total, n_loss = self._check_losses(losses, total, n_loss, bar)
                        losses = []
                        _count_reuse(grad, opt, reused)
                        reused = 0
                        _cache.publish("progress")  # the live panel, never per step
                        next_sync = time.perf_counter() + 0.25
                if gate[1]:
                    raise KeyboardInterrupt
        finally:
            _count_reuse(grad, opt, reused)
            if bar is not None:
                bar.close()
        total, n_loss = self._check_losses(losses, total, n_loss, None)
        return total / max(n_loss, 1)

    def _keyed_step(self, batch, gate):
        """One step that keys (and maybe compiles) both programs: the first step of an epoch, or every
        step when the optimizer's outputs would move its key. Ctrl-C is held only once the optimizer
        program, which donates params and state, is about to run."""
        grad = self._grad_entry(batch)
        flat_grads, loss = grad.call(self._params, self._dev, batch)
        opt = self._opt_entry(flat_grads)
        gate[0] = True
        self._params, self._state = opt.call(self._params, flat_grads, self._state, self._dev)
        return grad, opt, loss

    def _check_losses(self, losses, total, count, bar):
        if not losses:
            return total, count
        values = np.asarray(jax.device_get(losses), dtype=np.float64)
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            step = self.step - len(values) + int(bad[0]) + 1
            raise NonFiniteLossError(
                f"the training loss became {values[bad[0]]} at step {step} (epoch {self.epoch + 1}). "
                f"Check the `loss` hook for log(0) or division by zero and lower the learning rate; "
                f"the handle stays usable (`n.params` holds the parameters after step {self.step})."
            )
        if bar is not None:
            bar.set_postfix(loss=f"{values[-1]:.4g}", refresh=False)
        return total + float(values.sum()), count + len(values)

    def _apply_schedules(self):
        step = self.step
        for name, fn in self._schedules.items():
            want = self._dev_np[name]
            value = np.asarray(fn(step), dtype=want.dtype)
            if value.shape != want.shape:
                raise NitroValueError(
                    f"schedule for `{name}` returned shape {value.shape} at step {step}; the field has "
                    f"shape {want.shape}."
                )
            self._dev[name] = value

    def validate(self) -> dict:
        """Evaluate on the `valid` split: `{"loss": ..., <metric>: ...}`."""
        self._enter()
        return self._evaluate("valid")

    def evaluate(self, split: str = "test") -> dict:
        """Evaluate on `split`: the exact, example-weighted loss and every metric, over every example."""
        self._enter()
        return self._evaluate(split)

    def _evaluate(self, split_name: str) -> dict:
        split = self._split(split_name)
        n = split_len(split)
        inputs = self._routes["forward"].pick(split)
        targets = self._routes["loss"].pick(split) if self._loss is not None else ()
        metric_fields = {name: self._routes[name].pick(split) for name in self._metrics}
        fields = sorted(set(inputs) | set(targets) | {f for fs in metric_fields.values() for f in fs})
        build = lambda: _programs.make_eval(self._view, self._forward, self._loss, inputs, targets)
        hooks = ("forward", "loss") if self._loss is not None else ("forward",)
        host_view = self._view(self._dev_np)
        loss_sums, sums = [], {}
        entry = None
        for batch, n_valid in eval_batches(split, fields, self.batch_size):
            x = {k: batch[k] for k in inputs}
            t = {k: batch[k] for k in targets}
            args = (self._params, self._dev, x, t, np.int32(n_valid))
            if entry is None:
                entry = self._resolve("eval", build, args, ("params", "device", "inputs", "targets", "n_valid"), hooks)
            else:
                _cache.count_hit(entry)
            outputs, loss_sum = entry.call(*args)
            loss_sums.append(loss_sum)
            if not self._metrics:
                continue
            if n_valid < self.batch_size:
                outputs = jax.tree.map(lambda o: o[:n_valid], outputs)
            for name, (fn, residency) in self._metrics.items():
                f = {k: batch[k][:n_valid] for k in metric_fields[name]}
                if residency == "device":
                    margs = (self._dev, outputs, f)
                    mentry = self._resolve(
                        f"metric:{name}", lambda fn=fn: _programs.make_metric(self._view, fn), margs,
                        ("device", "outputs", "fields"), (name,)
                    )
                    result = mentry.call(*margs)
                else:
                    result = fn(host_view, jax.tree.map(np.asarray, outputs), **f)
                _accumulate(sums, name, result)
        out = {}
        if self._loss is not None:
            out["loss"] = float(np.sum(np.asarray(jax.device_get(loss_sums), np.float64)) / n)
        for name, (s, c) in sums.items():
            s, c = jax.device_get(s), jax.device_get(c)
            value = np.asarray(s) / c if c is not None else np.asarray(s)
            out[name] = float(value) if np.ndim(value) == 0 else value
        return out

    def predict(self, inputs: dict):
        """Run `forward` over `inputs` (a dict of arrays) in batches; returns the outputs as numpy."""
        self._enter()
        split = check_splits({"inputs": inputs})["inputs"]
        names = self._routes["forward"].pick(split)
        missing = [f for f in self._routes["forward"].required if f not in split]
        if missing:
            raise NitroValueError(
                f"`predict` needs the `forward` inputs {', '.join(f'`{m}`' for m in missing)}; got "
                f"{', '.join(f'`{k}`' for k in split)}."
            )
        build = lambda: _programs.make_predict(self._view, self._forward)
        pieces = []
        entry = None
        for batch, n_valid in eval_batches(split, names, self.batch_size):
            args = (self._params, self._dev, batch)
            if entry is None:
                entry = self._resolve("predict", build, args, ("params", "device", "inputs"), ("forward",))
            else:
                _cache.count_hit(entry)
            out = jax.device_get(entry.call(*args))
            pieces.append(jax.tree.map(lambda o: np.asarray(o)[:n_valid], out))
        return jax.tree.map(lambda *xs: np.concatenate(xs), *pieces)


def _accumulate(sums: dict, hook_name: str, result):
    if not isinstance(result, dict):
        raise NitroTypeError(
            f"metric hook `{hook_name}` must return `{{name: (sum, count)}}`; got {type(result).__qualname__}."
        )
    for name, pair in result.items():
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise NitroTypeError(
                f"metric `{name}` from hook `{hook_name}` must be a `(sum, count)` pair (count None to "
                f"never divide); got {_short_repr(pair)}."
            )
        s, c = pair
        if name in sums:
            s0, c0 = sums[name]
            sums[name] = (s0 + s, None if c is None else c0 + c)
        else:
            sums[name] = (s, c)


def _count_reuse(grad, opt, steps: int):
    """Steady-state steps reuse the two entries resolved at the first step; each use is a cache hit,
    counted in a local and folded into the counters at sync points rather than paid per step."""
    if steps:
        _cache.count_hit(grad, steps)
        _cache.count_hit(opt, steps)


def _returns_its_inputs(opt_entry) -> bool:
    """True when the optimizer program returns params and state of exactly the avals it takes, so the
    next step can skip re-keying. False means the key would move: the slow path re-keys every step."""
    in_avals, out_avals = compiled_in_avals(opt_entry.call), compiled_out_avals(opt_entry.call)
    if in_avals is None or out_avals is None:
        return True
    in_avals = jax.tree.leaves(in_avals[0]) + jax.tree.leaves(in_avals[2])
    out_avals = jax.tree.leaves(out_avals)
    norm = lambda a: (tuple(a.shape), str(a.dtype), bool(getattr(a, "weak_type", False)))
    return [norm(a) for a in in_avals] == [norm(a) for a in out_avals]


def _hook_fingerprint(fn) -> str:
    try:
        return function_fingerprint(fn)
    except Unfingerprintable:
        return code_fingerprint(fn.__code__)  # a closure cell we cannot read by content: code only


def _rebind(e, cls):
    """An instance of the live class `cls` carrying `e`'s field values (the class cell was re-run)."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    return cls(**{n: getattr(e, n) for n in names if hasattr(e, n)})


def _progress_bar(total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", leave=False, mininterval=0.25)


# Function forms, for those who prefer them.
def train(n: Nitro, epochs: int | None = None) -> list[dict]:
    """`n.train(epochs)`."""
    return n.train(epochs)


def validate(n: Nitro) -> dict:
    """`n.validate()`."""
    return n.validate()


def evaluate(n: Nitro, split: str = "test") -> dict:
    """`n.evaluate(split)`."""
    return n.evaluate(split)


def predict(n: Nitro, inputs: dict):
    """`n.predict(inputs)`."""
    return n.predict(inputs)
