"""`Nitro`: the training handle, a facade over its binding, its programs and the epoch loop.

Setup binds the experiment (`_binding.py`); programs are keyed from the spec table and built by the pure
builders (`_programs.py`); the epoch loop lives in `_loop.py`. The handle owns the side effects
(counters, messages) and the state that training advances.

Internal names other code relies on (benchmarks/profile_handle.py, bench_staleness.py): `_params` (the
dynamic params tree, `_model.ParamSplit`), `_model_state`, `_opt_state`, `_model`, `_dev` (the Device values
the programs get), `_layout`, `_programs` (key -> Entry this handle runs), `_enter()`, `_run` (the
background run training it, or None), and `_view`, `_forward`, `_loss`, `_optimizer`, which forward to the
binding.
"""

import time

import jax
import numpy as np

from .. import _closure
from .._base import _html, _report, _world
from .._base._errors import NitroValueError
from .._base._live import live_value
from .._base._report import Kind
from .._base._sharding import in_mesh, pace, placement
from .._compiler import _cache, _compile, _prefetch, _reuse, _store
from .._experiment import _carry
from .._experiment._binding import bind
from .._experiment._checks import (
    check_metric_count,
    check_metric_result,
    check_metric_sum_shape,
    check_not_empty,
    check_on_nonfinite,
    check_positive_int,
)
from .._experiment._data import (
    Loader,
    check_splits,
    eval_batches,
    split_len,
    steps_per_epoch,
)
from .._experiment._inputs import user_traceback
from .._experiment._model import (
    ParamSplit,
    check_given,
    check_state,
    run_init,
    strong,
)
from .._experiment._optimizer import (
    AT_REBUILD,
    GROUPS_CHANGED,
    check_setup,
    init_optimizer,
    make_layout,
)
from ..loggers import Tracker
from . import _ahead, _checkpoint, _guard, _loop, _progress, _runs
from ._loop import EPOCH_START, StepState
from ._pipeline import carry_resident, check_data_on_device, train_split
from ._programs import EVAL, METRIC, PREDICT, make_predict, program_key
from ._staleness import model_for, stale


def _state_field(name: str) -> property:
    """A handle attribute stored in its `_loop.StepState` (read and written through)."""
    return property(lambda self: getattr(self._state, name), lambda self, v: setattr(self._state, name, v))


def _store_group(cls) -> str:
    """The program store's name for a handle's experiment class (`_prefetch`)."""
    return f"{cls.__module__}.{cls.__qualname__}"


class Nitro:
    """A training handle on experiment `e`. Construction runs setup only; programs compile on first use.

    **Arguments:**
    - `e`: the experiment, a dataclass with `GraphConst` / `Device` / `Host` fields and hook methods.
    - `data`: `{"train": split, "valid": split, "test": split}`, each split a dict of arrays with a common
      leading axis (numpy, JAX, memory-mapped), or a re-iterable of batch dicts (a generator function,
      a `DataLoader`-like object); default: the experiment's `data(self)` hook. See docs/experiments.md.
    - `data_on_device`: `"auto"` (default) places the train split on an accelerator once, when it takes at
      most a quarter of its free memory, and takes each step's batch there; on the CPU it stays on the
      host (placing it would copy it). True always places it (on the CPU: one copy), False never.
    - `batch_size`, `max_epochs` (epochs per `train()` call), `accum` (micro-batches per optimizer step).
    - `schedules`: `{device_field: fn(step) -> value}`, applied before every step.
    - `seed`: seeds `init` and the per-epoch shuffle.
    - `progress`: show a progress bar while training (a widget in notebooks, text in terminals).
    - `flat_params`: update parameters as one flat buffer per dtype and parameter group (default; the
      groups are the optimizer's masks and labels: a weight-decay `mask=`, `optax.masked`,
      `multi_transform`). Set False for optimizers whose maths is per array (LAMB, LARS, factored
      Adafactor), which are refused on the flat layout at setup.
    - `mesh`: a `jax.sharding.Mesh` to run data parallel on (default: the mesh `jax.set_mesh` set, else
      one device); each batch is split along its `data_axis` (default `"data"`), which `batch_size` must
      divide. `param_sharding`: `(path, shape) -> PartitionSpec | None` to shard large parameters
      (needs `flat_params=False`); params and optimizer state are replicated otherwise. See docs/scale.md.
    - `params`, `state`: start from these values (pretrained, checkpointed) instead of `init`'s; checked
      against the structure, shapes and dtypes `init` builds (abstractly: no real init is paid).
    - `resume`: a checkpoint file (`n.save(path)`) to continue from, or `"auto"`: the newest checkpoint in
      `checkpoint_dir` (a fresh start when there is none). A changed GraphConst field is refused.
    - `checkpoint_dir`, `checkpoint_every` (epochs), `keep` (newest checkpoints kept; None: all),
      `keep_best` (`(metric, "min" | "max")`, e.g. `("valid_loss", "min")`: that one is kept too).
    - `on_nonfinite`: what a step with a NaN or infinite loss, gradient or Device value does. Either way
      its update is never applied (checked on device, inside the optimizer program). `"raise"` (default):
      training stops with `NonFiniteLossError` naming the step and the cause, the handle holding the last
      finite parameters; `"skip"`: the step is skipped and counted (`skipped` on the epoch line).
    - `stop_when`: `(metric, "min" | "max", patience)`: early stopping on an epoch row's metric, e.g.
      `("valid_loss", "min", 3)`; the row where it fires says so in `row["stopped"]`.
    - `steps_per_execution`: K optimizer steps per program call (Keras's name; default 1): K steps run in
      one `lax.scan` program, so the host dispatches once per K steps. Adds one program (`steps`) to the
      two per-step ones, which still run each epoch's first step and the steps left over when K does not
      divide the rest. Results equal the per-step loop's (same rng, schedules, skipped steps); Ctrl-C and
      `run.stop()` land between calls, every K steps. One device only (no `mesh`).
    - `loggers`: experiment trackers told what training does (`nitro_ipy.loggers.TensorBoard(logdir)`,
      `WandB(...)`, `MLflow(...)`, or any callable `(event) -> None`), per epoch or every `log_every`
      steps, from a logger thread: see docs/tracking.md.
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
        mesh=None,
        data_axis: str = "data",
        param_sharding=None,
        params=None,
        state=None,
        resume=None,
        checkpoint_dir=None,
        checkpoint_every: int | None = None,
        keep: int | None = None,
        keep_best: tuple | None = None,
        on_nonfinite: str = "raise",
        stop_when: tuple | None = None,
        steps_per_execution: int = 1,
        data_on_device="auto",
        loggers=None,
    ):
        options = dict(
            data=data, batch_size=batch_size, max_epochs=max_epochs, accum=accum,
            schedules=schedules, seed=seed, progress=progress, flat_params=flat_params,
            mesh=mesh, data_axis=data_axis, param_sharding=param_sharding,
            on_nonfinite=on_nonfinite, stop_when=stop_when, steps_per_execution=steps_per_execution,
            data_on_device=check_data_on_device(data_on_device), loggers=Tracker(loggers).loggers,
        )
        # Checkpointing is checked before setup: a bad setting fails fast, before `init` runs.
        checkpoints = (None if checkpoint_every is None
                       else _checkpoint.Policy(checkpoint_dir, checkpoint_every, keep, keep_best))
        if resume == "auto":
            if checkpoint_dir is None:
                raise NitroValueError('`resume="auto"` resumes from the newest checkpoint of `checkpoint_dir=`; '
                                      "pass it (or a checkpoint file as `resume=`).")
            resume = _checkpoint.newest(checkpoint_dir)
        options["checkpoints"] = checkpoints
        _store.activate()  # before setup: its eager operations compile too
        given = None if params is None and state is None else (params, state)
        self._setup(e, options, carry=None, given=given)
        if resume is not None:
            _checkpoint.restore(self, resume)
            self._tracking.note("resume", self.step, self.epoch, path=str(resume))

    @classmethod
    def _carrying(cls, e, options: dict, carry: tuple) -> "Nitro":
        """A handle set up with `options` whose `(params, model state, optimizer state, step, epoch)` are
        `carry` (`params` the user's tree; optimizer state None to initialize it)."""
        n = cls.__new__(cls)
        n._setup(e, options, carry)
        return n

    @in_mesh(lambda self, e, options, carry, given=None: options["mesh"])
    def _setup(self, e, options: dict, carry: tuple | None, given: tuple | None = None):
        # What training advances (params, states, step, epoch, cursor, guard) lives in one object the
        # step loop receives (`_loop.StepState`); the handle's attributes of the same names forward to it.
        self._state = StepState()
        batch_size, max_epochs, accum = options["batch_size"], options["max_epochs"], options["accum"]
        per_execution = options.get("steps_per_execution", 1)
        for name, value in (("batch_size", batch_size), ("max_epochs", max_epochs), ("accum", accum),
                            ("steps_per_execution", per_execution)):
            check_positive_int(name, value)
        if per_execution > 1 and options["mesh"] is not None:
            raise NitroValueError(
                f"`steps_per_execution={per_execution}` runs on one device; got a `mesh=` too. Fix: drop "
                f"`steps_per_execution` (a mesh runs one step a call) or the mesh.")
        self.batch_size, self.max_epochs, self.accum = int(batch_size), int(max_epochs), int(accum)
        self.seed, self.progress, self.flat_params = options["seed"], options["progress"], options["flat_params"]
        self._options = options
        self.on_nonfinite = check_on_nonfinite(options.get("on_nonfinite", "raise"))
        # Where arrays live (one device, or a mesh): asked at setup, per batch and per compile.
        self._place = place = placement(options["mesh"], options["data_axis"], options["param_sharding"])
        place.check_batch_size(self.batch_size)
        # The handle is a fixed point from here on: hooks, routes and fingerprints are bound now.
        self._binding = b = bind(e, options["data"], options["schedules"])
        self.experiment = b.experiment
        if carry is None:  # a new process's handle: its class's stored programs load while `init` runs
            _prefetch.start(_store_group(b.cls))
        # Device fields: converted once, strongly typed, passed to every program as traced inputs.
        self._dev = place.replicate({n: jax.device_put(v) for n, v in b.device_host.items()})

        if carry is not None:
            params, state, opt_state, self.step, self.epoch = carry
            if opt_state is not None:  # a rebuild: the new handle's own buffers (the old one keeps its
                # own), one transfer for all; static leaves (an Equinox model's functions, floats) stay static
                params, state, opt_state = _carry.copy_arrays((params, state, opt_state))
            # User classes in the training state (an Equinox model) re-bound to the live code, values kept.
            params, state, opt_state = live_value(params), live_value(state), live_value(opt_state)
            _carry.check_fits(b.cls, b.init, b.experiment, self.seed, params, b.has_state, state)
        elif given is not None:
            params, state = check_given(b, jax.random.PRNGKey(self.seed), *given)
            opt_state, self.step, self.epoch = None, 0, 0
        else:
            params, state = run_init(b, jax.random.PRNGKey(self.seed))
            opt_state, self.step, self.epoch = None, 0, 0
        if state is not None:
            check_state(state)
        split = ParamSplit(params)  # refuses, at setup, a leaf neither array nor static, naming its path
        on_mesh = place.mesh is not None  # a mesh's placement makes leaves strong itself, with no host copy
        dynamic = split.dynamic(params)
        # The dynamic tree (static leaves are None, so a `param_sharding` rule never sees them) is placed.
        self._params = place.params(jax.tree.map(strong, dynamic) if opt_state is None and not on_mesh else dynamic)
        place.check_layout(self.flat_params)
        if state is not None:
            state = place.state(state) if on_mesh else jax.tree.map(strong, state)
        self._model_state = state
        trainable = split.trainable(self._params)
        # One buffer per (dtype, group) on the flat layout: the groups are the optimizer's masks and labels.
        self._layout = make_layout(self.flat_params, b, trainable, self._dev, split.trainable_paths())
        self._model = model_for(split, self._layout, b)
        if opt_state is None:
            opt_state = init_optimizer(b, self._layout, trainable, self._dev)
            opt_state = place.opt_state(opt_state) if on_mesh else jax.tree.map(strong, opt_state)
        else:
            opt_state = place.opt_state(opt_state)
        self._opt_state = opt_state
        self._settings = {"accum": self.accum, "layout": self._layout.signature, "statics": split.signature,
                          "on_nonfinite": self.on_nonfinite}  # what specs' options name
        st = self._state  # the rest of what the step loop reads, fixed from here on
        st.binding, st.model, st.layout, st.place = b, self._model, self._layout, place
        st.batch_size, st.accum, st.on_nonfinite = self.batch_size, self.accum, self.on_nonfinite
        st.per_execution, st.wants_rng = int(per_execution), b.wants_rng
        # Where an epoch an interrupt cut short stopped (`_loop.Cursor`: its steps taken, their loss sum
        # and count); the next train() goes on from there. `EPOCH_START` at an epoch boundary.
        self._cursor = EPOCH_START
        self._resident: dict = {}  # split name -> `_pipeline.Resident`: placed at its first train(), kept
        self._programs: dict = {}  # key -> Entry: what this handle runs (kept even if poisoned)
        self._curve: list = []  # (epoch position, train loss) at sync points: the chart of the panel and `plot()`
        self._kinds_seen: dict = {}  # kind -> key of the first program of that kind
        self._loops_reported: set = set()
        self._checkpoints = options.get("checkpoints")
        self.history: list[dict] = _runs.History()  # a list of epoch rows, with `.table()`
        self._stop_when = _runs.early_stop(options.get("stop_when"), b.splits)
        self._run = None  # the background run training this handle, if any (`_runs.check_idle`)
        self._tracking = Tracker(options.get("loggers"))  # `loggers=`: told what training does
        _ahead.track(self)  # weakly: an edit that poisons its programs compiles their replacements ahead

    # ---------------------------------------------------------------- state
    @property
    def params(self):
        """The current parameters: the pytree `init` returned (an Equinox module, Flax variables, a dict),
        updated by training, static leaves included. Arrays you keep stay valid: the next step copies
        the parameters before it donates them (once per read, not per step)."""
        self._shared = True
        return self._model.split.combine(self._params)

    @property
    def state(self):
        """The model state (batch statistics, say): the second value `init` returned when `forward`
        declares `state`, updated by every training step; None when the model has none."""
        return self._model_state

    @property
    def opt_state(self):
        """The optimizer state (over the flat parameter buffers unless `flat_params=False`). Arrays you
        keep stay valid, as with `params`."""
        self._shared = True
        return self._opt_state

    def save(self, path, *, wait: bool = False) -> str:
        """Write a checkpoint (params, model and optimizer state, step, epoch, seed, the position in a cut
        epoch, history and the experiment's manifest) to `path`, atomically; a directory gets
        `step-<step>.nitro.npz`. Resume it with `Nitro(e, resume=path)`. Returns the file's path.

        The state is copied off the device before this returns; the file is written and fsync'ed in the
        background (`wait=True`: before this returns). nitro_ipy waits for it before the next save,
        before reading a checkpoint and at exit (a kernel restart included). Refused while a background
        run trains this handle (`HandleBusyError`): its steps donate the arrays a save reads;
        `checkpoint_every=` saves from the run itself."""
        _runs.check_idle(self, "save")
        return _checkpoint.save(self, path, wait=wait)

    def rebuild(self, e=None) -> "Nitro":
        """A new handle with the current params, model state and optimizer state carried over and hooks
        re-bound through the class as it is now: the way to pick up an edit.

        **Arguments:**
        - `e`: the experiment to carry the state onto (say, re-created by the re-run cell); default this
          handle's. Refused, with a per-parameter diff, when the parameters no longer fit its `init`.
        """
        _runs.check_idle(self, "rebuild")
        carry = (self.params, self._model_state, self._opt_state, self.step, self.epoch)
        new = Nitro._carrying(self.experiment if e is None else e, self._options, carry)
        if new._layout.signature != self._layout.signature:  # the optimizer state is laid by the old groups
            state = ", state=n.state" if new._model_state is not None else ""
            raise NitroValueError(GROUPS_CHANGED.format(owner=new._binding.cls.__qualname__, state=state))
        if self._optimizer_may_differ(new):
            # The state carries over, so the optimizer's setup checks run again without its `init`: an
            # edit that keeps the state's structure (`clip_by_global_norm` to `adaptive_grad_clip`) would
            # otherwise train other maths on the flat layout, in silence.
            try:
                check_setup(new._binding, new._layout, new._model.split.trainable(new._params), new._dev)
            except NitroValueError as err:
                state = ", state=n.state" if new._model_state is not None else ""
                raise NitroValueError(str(err) + AT_REBUILD.format(state=state)) from None
        new._curve = list(self._curve)  # the loss chart goes on where it was
        new._cursor = self._cursor  # and a cut epoch where it stopped
        new._tracking.pending = self._tracking.pending  # said at the new handle's first train()
        self._tracking.pending = []
        new._tracking.note("rebuild", new.step, new.epoch)
        _ahead.rebuilt(self, new)  # this handle is superseded: compile ahead serves the new one
        carry_resident(self, new)  # and a split placed on the device stays there, once
        return new

    def _optimizer_may_differ(self, new: "Nitro") -> bool:
        """Whether `new` (this handle rebuilt) may build another optimizer than this one was checked
        with: its hook or GraphConst values moved, or this handle's optimizer program went stale (a
        helper it calls was edited), or it never ran one (nothing would have told)."""
        a, b = self._binding, new._binding
        opt = [e for e in self._programs.values() if e.kind == "opt"]
        return (a.hook_fps.get("optimizer") != b.hook_fps.get("optimizer") or a.graphconst.hash != b.graphconst.hash
                or not opt or "opt" in stale(self).kinds())

    def __repr__(self):
        now = stale(self, scan=False)
        return (
            f"Nitro({type(self.experiment).__qualname__}, step={self.step}, epoch={self.epoch}, "
            f"programs={len(self._programs)}, stale={bool(now.programs or now.graphconst)})"
        )

    # What training advances lives in the step state (`_loop.StepState`); these names forward to it.
    step = property(lambda self: self._state.step, lambda self, v: setattr(self._state, "step", v),
                    doc="Optimizer steps taken.")
    epoch = property(lambda self: self._state.epoch, lambda self, v: setattr(self._state, "epoch", v),
                     doc="Epochs completed.")
    seed = property(lambda self: self._state.seed, lambda self, v: setattr(self._state, "seed", v),
                    doc="Seeds `init`, the per-epoch shuffle and each step's `rng`.")
    _params = _state_field("params")
    _model_state = _state_field("model_state")
    _opt_state = _state_field("opt_state")
    _dev = _state_field("dev")
    _cursor = _state_field("cursor")
    _guard = _state_field("guard")
    _shared = _state_field("shared")
    _progress = _state_field("progress")

    # Documented internal names (see the module docstring): the binding's, under the handle's old names.
    _view = property(lambda self: self._binding.view)
    _forward = property(lambda self: self._binding.forward)
    _loss = property(lambda self: self._binding.loss)
    _optimizer = property(lambda self: self._binding.optimizer)

    # ---------------------------------------------------------------- programs
    def _resolve(self, spec, args: tuple, hook: str | None = None, **fields):
        """The entry of `spec`'s program for `args`: this handle's, the cache's, or compiled now.

        **Arguments:**
        - `spec`: the program's kind, from `_programs.SPECS`.
        - `args`: the arguments it will be called with.
        - `hook`: for a per-hook kind (`metric`), the hook it traces.
        - `fields`: the batch fields the builder routes (`inputs`, `targets`), if it takes any.

        **Returns:** the `_cache.Entry`; a hit is counted, a compile reported.
        """
        key = program_key(spec, self._binding, args, self._settings, hook)
        entry = self._programs.get(key)
        if entry is not None:
            _cache.count_hit(entry)
            return entry
        # The key holds the GraphConst fingerprints taken at setup, the trace reads the live values: a
        # value mutated in place since would put a program of the new value under the old key.
        self._binding.check_graphconst_unchanged()
        entry = _cache.lookup(key)
        taken = "cache" if entry is not None else "now"  # compiled earlier (another handle, ahead, the store)
        if entry is None:
            fn = spec.build(self._binding, self._model, self.accum, hook, **fields)
            entry = _compile.compile_program(key, fn, args, donate_argnums=spec.donate,
                                             info={"graphconst": self._binding.graphconst.info},
                                             record=_closure.record_hooks(self._binding.cls, key.hooks),
                                             compiler_options=spec.compiler_options,
                                             sources=self._binding.graphconst_sources,
                                             out_shardings=self._place.out_shardings(spec.kind, args, self._model))
            first = self._kinds_seen.get(key.kind)
            if spec.loops and first is not None and first.hooks == key.hooks and key.kind not in self._loops_reported:
                self._loops_reported.add(key.kind)
                _report.emit(Kind.RECOMPILE_LOOP, program=key.kind, why=entry.why or "the key moved")
        self._kinds_seen.setdefault(key.kind, key)
        self._programs[key] = entry
        if entry.origin == "disk" or not entry.unstorable:  # what the next process's handle loads first
            _prefetch.note(_store_group(self._binding.cls), key)
        self._tracking.compiled(entry, self.step, self.epoch, taken)
        _ahead.resolved(self, spec, key, args, hook, fields)
        return entry

    # ---------------------------------------------------------------- entry points
    def _enter(self, what: str = "this entry point"):
        _runs.check_idle(self, what)
        now = stale(self)
        if now:
            self._tracking.note("stale", self.step, self.epoch, names=", ".join(_report.merge_names(now.programs)))
            _report.emit(Kind.STALE_HANDLE, handle=self, names=_report.merge_names(now.programs),
                         kinds=now.kinds(), schedules=now.schedules, graphconst=now.graphconst)

    @user_traceback
    def train(self, epochs: int | None = None, *, background: bool = False, loggers=None):
        """Train for `epochs` (default `max_epochs`) epochs, validating after each one when a `valid`
        split exists. Returns this call's epoch rows (also appended to `n.history`).

        With `background=True`, returns a `Run` at once and trains in a worker thread: `run.stop()`,
        `run.wait()` (see `_runs.py`). Ctrl-C in the foreground raises `TrainingInterrupted`, one line,
        with the handle usable. `loggers`: more loggers for this call only (docs/tracking.md).
        """
        if epochs is not None:  # before anything runs: `train(0)` would return [] as if it had trained
            check_positive_int("epochs", epochs, " (or None for `max_epochs`)")
        self._enter("train")
        b = self._binding
        b.need_loss("training")
        given = b.split("train")
        steps = steps_per_epoch(given, self.batch_size, self.accum)  # None: a loader not counted yet
        if steps == 0 and isinstance(given, Loader):
            raise NitroValueError(
                f"the train split is a loader of {given.length} batches, fewer than one step "
                f"(accum={self.accum}); lower `accum`."
            )
        if steps == 0:
            raise NitroValueError(
                f"the train split has {split_len(given)} examples, fewer than one step "
                f"(batch_size={self.batch_size} x accum={self.accum}); lower `batch_size`."
            )
        split = train_split(self)  # the device-resident copy (placed once per handle), or the split
        fields = sorted(set(b.routes["forward"].pick(split)) | set(b.routes["loss"].pick(split)))
        epochs = self.max_epochs if epochs is None else epochs
        loggers = Tracker(loggers).loggers  # checked here, not in a background run's thread
        control = _runs.RunControl(self, steps, quiet=background)
        work = lambda: self._train_epochs(control, split, fields, steps, epochs, loggers)  # noqa: E731
        if background:
            return _runs.start(self, control, work, epochs)
        return _runs.foreground(control, work)

    @in_mesh()  # here, not on `train`: a background run trains in its own thread
    def _train_epochs(self, control, split: dict, fields, steps: int, epochs: int, extra=None) -> list[dict]:
        # This call's progress report (None with `progress=False`); the loop reads it from the handle.
        progress = self._progress = _progress.start(self, epochs, steps, quiet=control.quiet, control=control)
        b = self._binding
        tracking = self._state.tracking = self._tracking.begin(
            self.step, self.epoch, self.experiment, extra, guard_read=_guard.origin_and_losses,
            schedules=b.apply_schedules if b.schedules else None)
        err = None
        training = _reuse.training_began()  # no trace-reuse warming while this trains
        try:
            try:
                with _world.inside_nitro():  # a trace beside it meets no statement of the cell
                    rows = self._epochs(control, split, fields, epochs, progress)
            finally:
                _reuse.training_ended(training)
        except BaseException as e:
            err = e
            _reuse.training_ended(training)  # again: a Ctrl-C at the first one skipped it (held from then on)
            if progress is not None:
                progress.close(err)
            raise
        finally:
            self._progress = self._state.tracking = None
            self._tracking.end(tracking, err, self.step, self.epoch)  # every event logged, each logger flushed
        if self._checkpoints is not None:  # the last periodic checkpoint is on disk when train() returns
            _checkpoint.wait()
        if progress is not None:
            progress.close()
        return rows

    def _epochs(self, control, split: dict, fields, epochs: int, progress) -> list[dict]:
        steps = control.steps
        b = self._binding
        rows = control.rows
        stopper = self._stop_when.fresh() if self._stop_when is not None else None
        _ahead.prefetch_eval(self)  # validation's program compiles while the first epoch trains
        for _ in range(epochs):
            if control.pending:  # a stop asked for between epochs (during validation)
                raise KeyboardInterrupt
            control.begin_epoch()
            step0, clock = self.step, time.perf_counter()
            loss, skipped = _loop.train_epoch(self._state, self._resolve, split, fields, steps, control)
            took = time.perf_counter() - clock
            row = {"epoch": self.epoch + 1, "loss": loss}
            if self.on_nonfinite == "skip":
                row["skipped"] = skipped
            # Counted: cursor, epoch and row stored with Ctrl-C held (in the history before validation,
            # so an interrupt there keeps the epoch's row); a Ctrl-C held over them ends the call here.
            control.commit(self._count_epoch, row, rows)
            if control.pending and control.cuts_epoch():
                raise KeyboardInterrupt
            if "valid" in b.splits:
                control.validating = True
                row.update({f"valid_{k}": v for k, v in self._evaluate("valid").items()})
            if stopper is not None and (reason := stopper.update(row)):
                row["stopped"] = reason
            if self._checkpoints is not None:  # after validation: `keep_best` ranks by the row's metrics
                if (path := self._checkpoints.after_epoch(self)) is not None:
                    self._tracking.note("checkpoint", self.step, self.epoch, path=path)
            if self._state.tracking is not None:
                self._state.tracking.epoch(row, self.step, self.epoch, self.step - step0, took)
            if progress is not None:
                progress.end_epoch(row)
            if self.progress:
                _report.emit(Kind.EPOCH, record=row)  # `record` is the EPOCH message's field name
            if row.get("stopped"):
                break
        if control.pending and control.cuts_epoch():  # a Ctrl-C dropped in the last validation
            raise KeyboardInterrupt
        return list(rows)

    def _count_epoch(self, row: dict, rows: list):
        """The epoch counted: the cursor back at an epoch's start, the epoch advanced, its row kept (with
        Ctrl-C held: `InterruptGate.commit`)."""
        self._cursor, self.epoch = EPOCH_START, self.epoch + 1
        self.history.append(row)
        rows.append(row)

    def set(self, **values) -> None:
        """Set Device fields of this live handle with no recompile: `n.set(lr=1e-4)`. Each value is
        coerced to the field's dtype and shape and used from the next step on (also while a background
        run trains). A Host field is set on `n.experiment` (compiled code never reads it). A GraphConst
        field is refused: a new value means new programs (a new experiment, or an edit and `rebuild`)."""
        _runs.set_fields(self, values)

    def plot(self) -> "_html.LossChart":
        """The loss chart of this handle's training: train loss at each sync point (per epoch when it
        trained with `progress=False`), validation loss per epoch, as the live panel draws it. Displays as
        SVG in a notebook and as a one-line summary elsewhere."""
        curve = self._curve or [(r["epoch"], r["loss"]) for r in self.history]
        valid = [(float(r["epoch"]), r["valid_loss"]) for r in self.history if "valid_loss" in r]
        return _html.LossChart(curve, valid)

    @user_traceback
    @in_mesh()
    def validate(self) -> dict:
        """Evaluate on the `valid` split: `{"loss": ..., <metric>: ...}`."""
        self._enter("validate")
        with _world.inside_nitro():  # a compile ahead it waits for traces beside no statement of the cell
            return self._evaluate("valid")

    @user_traceback
    @in_mesh()
    def evaluate(self, split: str = "test") -> dict:
        """Evaluate on `split`: the exact, example-weighted loss and every metric, over every example."""
        self._enter("evaluate")
        with _world.inside_nitro():
            return self._evaluate(split)

    def _evaluate(self, split_name: str) -> dict:
        b = self._binding
        split = b.split(split_name)
        n = split_len(split)  # None for a loader: its batches' real rows are counted as they come
        if n is not None:
            check_not_empty(split_name, n, "evaluating it")
        inputs = b.routes["forward"].pick(split)
        targets = b.routes["loss"].pick(split) if b.loss is not None else ()
        metric_fields = {name: b.routes[name].pick(split) for name in b.metrics}
        fields = sorted(set(inputs) | set(targets) | {f for fs in metric_fields.values() for f in fs})
        host_view = b.view(b.device_host)
        place = self._place
        loss_sums, sums = [], {}
        entry = None
        rows = 0
        for batch, n_valid in eval_batches(split, fields, self.batch_size):
            rows += n_valid
            x = place.batch({k: batch[k] for k in inputs})
            t = place.batch({k: batch[k] for k in targets})
            args = (self._params, self._model_state, self._dev, x, t, place.replicate(np.int32(n_valid)))
            if entry is None:
                entry = self._resolve(EVAL, args, inputs=inputs, targets=targets)
            else:
                _cache.count_hit(entry)
            outputs, loss_sum = entry.call(*args)
            loss_sums.append(loss_sum)
            pace(loss_sums, place.ahead)  # a CPU mesh deadlocks when too many steps queue (`_sharding`)
            if not b.metrics:
                continue
            if n_valid < self.batch_size:
                outputs = jax.tree.map(lambda o: o[:n_valid], outputs)
            for name, (fn, residency) in b.metrics.items():
                f = {k: batch[k][:n_valid] for k in metric_fields[name]}
                if residency == "device":
                    margs = (self._dev, *place.metric_args((outputs, f)))
                    result = self._resolve(METRIC, margs, hook=name).call(*margs)
                else:
                    result = fn(host_view, jax.tree.map(np.asarray, place.host(outputs)), **f)
                _accumulate(sums, name, result)
        out = {}
        if b.loss is not None:
            out["loss"] = float(np.sum(np.asarray(place.host(loss_sums), np.float64)) / rows)
        for name, (s, c) in sums.items():
            s, c = place.host(s), place.host(c)
            if c is not None:
                check_metric_count(split_name, name, c)
            value = np.asarray(s) / c if c is not None else np.asarray(s)
            out[name] = float(value) if np.ndim(value) == 0 else value
        return out

    @user_traceback
    @in_mesh()
    def predict(self, inputs: dict):
        """Run `forward` over `inputs` (a dict of arrays) in batches; returns the outputs as numpy."""
        self._enter("predict")
        with _world.inside_nitro():  # as `validate`
            return self._predict(inputs)

    def _predict(self, inputs: dict):
        split = check_splits({"inputs": inputs})["inputs"]
        route = self._binding.routes["forward"]
        names = route.pick(split)
        missing = [f for f in route.required if f not in split]
        if missing:
            raise NitroValueError(
                f"`predict` needs the `forward` inputs {', '.join(f'`{m}`' for m in missing)}; got "
                f"{', '.join(f'`{k}`' for k in split)}."
            )
        if split_len(split) == 0:  # zero rows: empty outputs of the right shape, traced, never compiled
            fn = make_predict(self._binding.view, self._binding.forward, self._model, self._binding.cls.__qualname__)
            shapes = jax.eval_shape(fn, self._params, self._model_state, self._dev, {k: split[k] for k in names})
            return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
        pieces = []
        entry = None
        for batch, n_valid in eval_batches(split, names, self.batch_size):
            args = (self._params, self._model_state, self._dev, self._place.batch(batch))
            if entry is None:
                entry = self._resolve(PREDICT, args)
            else:
                _cache.count_hit(entry)
            out = self._place.host(entry.call(*args))
            pieces.append(jax.tree.map(lambda o: np.asarray(o)[:n_valid], out))
        return jax.tree.map(lambda *xs: np.concatenate(xs), *pieces)


def _accumulate(sums: dict, hook_name: str, result):
    for name, (s, c) in check_metric_result(hook_name, result).items():
        if name in sums:
            s0, c0 = sums[name]
            check_metric_sum_shape(hook_name, name, s0, s)
            sums[name] = (s0 + s, None if c is None else c0 + c)
        else:
            sums[name] = (s, c)


# Function forms, for those who prefer them.
def train(n: Nitro, epochs: int | None = None, *, background: bool = False, loggers=None):
    """`n.train(epochs, background=background, loggers=loggers)`."""
    return n.train(epochs, background=background, loggers=loggers)


def validate(n: Nitro) -> dict:
    """`n.validate()`."""
    return n.validate()


def evaluate(n: Nitro, split: str = "test") -> dict:
    """`n.evaluate(split)`."""
    return n.evaluate(split)


def predict(n: Nitro, inputs: dict):
    """`n.predict(inputs)`."""
    return n.predict(inputs)
