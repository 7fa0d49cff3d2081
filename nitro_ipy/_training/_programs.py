"""What each program traces. Pure JAX: functions in, arrays out; no counters, no messages.

Every builder takes the hooks as plain functions (bound later to the compile view) and returns the
function that `jax.jit(...).lower(...)` traces:

- gradient: `(params, state, dev, batch, rng) -> (flat grads, mean loss, new state)`, a `lax.scan` over
  `accum` micro-batches (`rng` is the step's guard, which holds the step's key, or None when no hook
  declares `rng`);
- optimizer: `(params, flat grads, opt state, dev, loss, guard, state, new state) -> (params, opt state,
  guard, state)`, separate even at accum=1; a step it does not apply (non-finite) keeps the old params,
  optimizer state and model state (`_guard`), and it derives the next step's rng into the guard;
- evaluation forward: `(params, state, dev, inputs, targets, n_valid) -> (outputs, loss sum over valid rows)`;
- device metric: `(dev, outputs, fields) -> {name: (sum, count)}`;
- predict: `(params, state, dev, inputs) -> outputs`;
- steps (`steps_per_execution=K`): `(params, state, opt state, dev, batches, schedule, guard) -> (params,
  state, opt state, guard)`, K optimizer steps (gradient then optimizer, as above) in one `lax.scan` over
  K stacked batches and the K steps' scheduled Device values.

`params` is the dynamic tree of `_model.ParamSplit` (static leaves are None and baked in); `state` is the
model state (None when `forward` does not declare it).

`SPECS` holds one `Spec` per kind (the hooks it traces, its argument names, its builder, the handle
settings in its key, donation, XLA options), and `program_key` composes every key from a spec.
"""

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from .._compiler import _reuse
from .._compiler._cache import Key, arg_signature
from .._compiler._compile import OPTIMIZER_OPTIONS
from .._experiment import _inputs
from .._experiment._checks import check_loss, check_metric_result
from .._experiment._model import EVAL_KEY_SEED, forward_result
from .._experiment._optimizer import update_args
from ._guard import decide, gated, parts, select, step_rng


def call_forward(model, owner, forward, view, params, inputs: dict, state, key, train: bool):
    """`(outputs, new_state)`: `forward` called with the reserved parameters it declares."""
    reserved = model.reserved.get("forward", ())
    extra = {}
    if "rng" in reserved:
        extra["rng"] = key
    if "train" in reserved:
        extra["train"] = train
    if not model.has_state:
        return _explained(forward, f"{owner}.forward", inputs, params=params)(view, params, **inputs, **extra), state
    # `forward` gets a container of its own: one it consumes (an `eqx.nn.State` a layer `set` outside a
    # `vmap` is invalid after) never breaks what reads `state` after it (the shape check, the guard).
    leaves, treedef = jax.tree_util.tree_flatten(state)
    own = jax.tree_util.tree_unflatten(treedef, leaves)
    result = _explained(forward, f"{owner}.forward", inputs, params=params)(view, params, **inputs, state=own, **extra)
    return forward_result(owner, result, (treedef, leaves))


def call_loss(model, loss, view, outputs, targets: dict, train: bool, owner: str = ""):
    """The `loss` hook's value, checked to be a real scalar (`_checks.check_loss`); a loss that
    broadcasts outputs against a target of another rank is warned about (`_inputs.broadcast_warning`)."""
    extra = {"train": train} if "train" in model.reserved.get("loss", ()) else {}
    hook = f"{owner}.loss" if owner else getattr(loss, "__qualname__", "loss")
    value = _explained(loss, hook, targets, outputs=outputs)(view, outputs, **targets, **extra)
    _inputs.broadcast_warning(hook, lambda o, t: loss(view, o, **t, **extra), outputs, targets)
    return check_loss(value)


def _explained(hook, name: str, given: dict, **context):
    """`hook`, whose failure on wrong inputs raises `HookInputError` (`_inputs.explain`) at trace time."""
    def call(*args, **kwargs):
        try:
            return hook(*args, **kwargs)
        except Exception as err:
            explained = _inputs.explain(err, name, given, **context)
            if explained is None:
                raise
            raise explained from None
    return call


def make_training_forward(view_of, forward, model, owner: str = ""):
    """The forward as the gradient program calls it: `(dev, params, trainable, inputs, state, key, view=None)
    -> (outputs, new state)`, the trainable leaves put back into `params` (a `_reuse.Forward` calls it
    without `view`, which it then makes from `dev`)."""
    split = model.split

    def forward_of(dev, params, trainable, inputs, state, key, view=None):
        full = split.combine(split.with_trainable(params, trainable))
        view = view_of(dev) if view is None else view
        return call_forward(model, owner, forward, view, full, inputs, state, key, True)

    return forward_of


def make_gradient(view_of, forward, loss, input_names, target_names, model, accum: int, owner: str = "",
                  reuse=None, warming: bool = False):
    """The gradient program. `reuse`: a `_reuse.Forward` to call the forward through, where its argument
    types fit (always when `warming`: that trace is what makes it fit)."""
    split, layout = model.split, model.layout
    forward_of = make_training_forward(view_of, forward, model, owner)

    def loss_of(trainable, params, state, dev, view, batch, key):
        inputs = {k: batch[k] for k in input_names}
        args = (dev, params, trainable, inputs, state, key)
        if reuse is not None and (warming or reuse.fits(args)):
            outputs, state = reuse(*args, warming=warming)
        else:
            outputs, state = forward_of(*args, view=view)
        return call_loss(model, loss, view, outputs, {k: batch[k] for k in target_names}, True, owner), state

    def gradient(params, state, dev, batch, rng):
        view = view_of(dev)
        trainable = split.trainable(params)
        # `rng` is the step's guard, which holds the step's key (the `step_key` rule), derived on the device
        # by the optimizer program; micro-batch `i` folds in `i`, a whole batch 0 (held in the guard too).
        if rng is None:
            key = lambda i: None  # noqa: E731
        elif accum == 1:
            key = lambda i: step_rng(rng, 0)  # noqa: E731
        else:
            key = lambda i: step_rng(rng, i)  # noqa: E731
        value_and_grad = jax.value_and_grad(loss_of, has_aux=True)
        if accum == 1:
            (value, state), grads = value_and_grad(trainable, params, state, dev, view, batch, key(0))
        else:
            def micro(carry, xs):
                total, acc, state = carry
                i, micro_batch = xs
                (value, state), grads = value_and_grad(trainable, params, state, dev, view, micro_batch, key(i))
                return (total + value, jax.tree.map(jnp.add, acc, grads), state), None

            zeros = jax.tree.map(jnp.zeros_like, trainable)
            carry = (jnp.zeros((), jnp.float32), zeros, state)
            (total, grads, state), _ = jax.lax.scan(micro, carry, (jnp.arange(accum), batch))
            value = total / accum
            grads = jax.tree.map(lambda g: g / accum, grads)
        # The new model state goes out as it is: the optimizer program, which decides whether the step
        # applies, keeps the old one for a step it skips. Deciding here too cost the Flax CNN's gradient
        # program 12% more XLA time (bench_models: 322 -> 280 ms), paid at every edit of the model.
        return layout.ravel(grads), value, state

    return gradient


def make_optimizer(view_of, optimizer, model, halt: bool = True):
    split, layout = model.split, model.layout

    def step(params, flat_grads, opt_state, dev, loss):
        trainable = split.trainable(params)
        # On a grouped flat layout the optimizer sees the grouped tree, its masks and labels re-expressed
        # there (checked against the params as traced: the groups are the ones the buffers were laid by).
        tx = layout.adapt(optimizer(view_of(dev)), trainable)
        # The flat params are only built for an optimizer that reads them (weight decay, say): for one
        # that does not, XLA drops the concatenation, and a step never copies the whole model. The
        # updates are then added array by array, exactly as `apply_updates` on the flat buffer would.
        updates, new_state = tx.update(layout.for_tx(flat_grads), opt_state, layout.for_tx(layout.ravel(trainable)),
                                       **update_args(tx, loss))
        updates = layout.unravel(layout.from_tx(updates))
        return split.with_trainable(params, optax.apply_updates(trainable, updates)), new_state

    def update(params, flat_grads, opt_state, dev, loss, guard, state, new_state):
        # A non-finite loss, gradient or Device value keeps the old buffers (`_guard`): checked here,
        # where params and state are donated, so no step ever syncs with the host to find out. The model
        # state the gradient program computed (`new_state`) is kept exactly when the update is, so the
        # handle's params and model state are always those of one step.
        apply, guard = decide(guard, parts(loss, flat_grads, dev), halt)
        new_params, new_opt_state = gated(apply, step, params, flat_grads, opt_state, dev, loss)
        return new_params, new_opt_state, guard, select(apply, new_state, state)

    return update


def make_steps(gradient, update, wants_rng: bool):
    """K optimizer steps in one program: the gradient and optimizer programs' functions, called in a
    `lax.scan` over the stacked batches (leading axis K) and scheduled Device values (`{field: [K, ...]}`,
    each step's values as the per-step loop would set them). The guard is carried through, so each step's
    rng, skip decision and loss sum are those of the per-step loop."""

    def steps(params, state, opt_state, dev, batches, schedule, guard):
        def one(carry, xs):
            params, state, opt_state, guard = carry
            batch, values = xs
            step_dev = {**dev, **values}
            flat_grads, loss, new_state = gradient(params, state, step_dev, batch, guard if wants_rng else None)
            params, opt_state, guard, state = update(params, flat_grads, opt_state, step_dev, loss, guard, state,
                                                     new_state)
            return (params, state, opt_state, guard), None

        carry, _ = jax.lax.scan(one, (params, state, opt_state, guard), (batches, schedule))
        return carry

    return steps


def per_example_loss(view, loss, outputs, targets: dict):
    """The loss of each example on its own (the hook applied to batches of one), so a padded batch
    can be masked and the split's loss weighted by examples exactly, whatever the batch layout."""

    def one(o, t):
        add_axis = lambda a: a[None]
        return check_loss(loss(view, jax.tree.map(add_axis, o), **jax.tree.map(add_axis, t)))

    return jax.vmap(one)(outputs, targets)


def make_eval(view_of, forward, loss, input_names, target_names, model, owner: str = ""):
    split = model.split
    eval_loss = loss if loss is None else (lambda view, outputs, **t: call_loss(model, loss, view, outputs, t, False, owner))

    def evaluate(params, state, dev, inputs, targets, n_valid):
        view = view_of(dev)
        key = jax.random.PRNGKey(EVAL_KEY_SEED) if "rng" in model.reserved.get("forward", ()) else None
        outputs, _ = call_forward(model, owner, forward, view, split.combine(params), inputs, state, key, False)
        if loss is None:
            return outputs, jnp.zeros((), jnp.float32)
        per = per_example_loss(view, eval_loss, outputs, targets)
        mask = jnp.arange(per.shape[0]) < n_valid
        return outputs, jnp.sum(jnp.where(mask, per, 0.0))

    return evaluate


def make_metric(view_of, hook):
    def metric(dev, outputs, fields):
        return check_metric_result(hook.__name__, hook(view_of(dev), outputs, **fields))

    return metric


def make_predict(view_of, forward, model, owner: str = ""):
    split = model.split

    def predict(params, state, dev, inputs):
        view = view_of(dev)
        key = jax.random.PRNGKey(EVAL_KEY_SEED) if "rng" in model.reserved.get("forward", ()) else None
        return call_forward(model, owner, forward, view, split.combine(params), inputs, state, key, False)[0]

    return predict


# ---------------------------------------------------------------- the table of program kinds
@dataclasses.dataclass(frozen=True, slots=True)
class Spec:
    """How one kind of program is keyed and built."""

    kind: str
    hooks: tuple  # the experiment hooks it traces; a missing optional hook (`loss`) is left out of the key
    args: tuple  # its argument names, in the key and in miss explanations
    build: Callable  # `build(binding, model, accum, hook, **fields)` -> the function `jax.jit` traces
    options: tuple = ()  # the handle settings that shape it: names in `program_key`'s `settings`
    donate: tuple = ()  # argument numbers whose buffers it reuses for its outputs
    compiler_options: dict | None = None  # XLA options on top of `_compile.program_options`' policy
    loops: bool = False  # a recompile with the same hooks is a loop worth a message (the training step)

    def pack(self, **named) -> tuple:
        """The program's arguments in its order, from their names (`args`): the one place that order is
        written. A missing or unknown name is a bug here, said plainly."""
        if len(named) != len(self.args):
            extra, missing = set(named) - set(self.args), set(self.args) - set(named)
            raise TypeError(f"the {self.kind} program takes {self.args}; missing {sorted(missing)}, "
                            f"unknown {sorted(extra)}")
        return tuple(map(named.__getitem__, self.args))

    def packer(self, given: tuple, **sources: str):
        """`pack` for a hot loop: a function `(s, *given) -> arguments`, in this program's order, built once
        from `args` (as `collections.namedtuple` builds its methods): each argument is one of `given`
        or the expression `sources` names for it (reading the object `s`). A call costs what a tuple
        written out by hand would; `pack` costs a dict."""
        missing = [a for a in self.args if a not in given and a not in sources]
        if missing or set(given) & set(sources) or not set(given) | set(sources) <= set(self.args):
            raise TypeError(f"the {self.kind} program takes {self.args}; got {given} and {sorted(sources)}")
        items = ", ".join(a if a in given else f"({sources[a]})" for a in self.args)
        return eval(f"lambda s, {', '.join(given)}: ({items},)", {})  # noqa: S307 - our own names only


def _build_grad(b, model, accum, hook, *, inputs, targets):
    """The gradient program, calling its forward through a warmed `_reuse.Forward` when one is keyed
    alike and still fresh; else traced plainly, with `warm` set for `_compile._build`: once it compiled,
    a `Forward` is warmed for the next one, when the process is idle."""
    owner = b.cls.__qualname__
    key = _reuse.forward_key(b, model, inputs)
    found = _reuse.lookup(key)
    gradient = make_gradient(b.view, b.forward, b.loss, inputs, targets, model, accum, owner, reuse=found)
    if found is None and key is not None and not _reuse.pending(key):
        # What the warmed forward keeps (past this handle) holds no binding: its splits hold the data.
        viewer, view, forward_hook, loss = b.viewer, b.view, b.forward, b.loss

        def make():  # each try of the warming: a new Forward, and a program calling through it
            forward = _reuse.Forward(make_training_forward(viewer, forward_hook, model, owner), forward_hook)
            return forward, make_gradient(view, forward_hook, loss, inputs, targets, model, accum, owner,
                                          reuse=forward, warming=True)

        gradient.warm = lambda args: _reuse.schedule(key, make, args)
    return gradient


def _build_opt(b, model, accum, hook, *, halt=True):
    return make_optimizer(b.view, b.optimizer, model, halt)


def _build_steps(b, model, accum, hook, *, inputs, targets, halt=True):
    owner = b.cls.__qualname__
    gradient = make_gradient(b.view, b.forward, b.loss, inputs, targets, model, accum, owner)
    return make_steps(gradient, make_optimizer(b.view, b.optimizer, model, halt), b.wants_rng)


def _build_eval(b, model, accum, hook, *, inputs, targets):
    return make_eval(b.view, b.forward, b.loss, inputs, targets, model, b.cls.__qualname__)


def _build_metric(b, model, accum, hook):
    return make_metric(b.view, b.metrics[hook][0])


def _build_predict(b, model, accum, hook):
    return make_predict(b.view, b.forward, model, b.cls.__qualname__)


GRAD = Spec("grad", ("forward", "loss"), ("params", "state", "device", "batch", "rng"), _build_grad,
            options=("accum", "layout", "statics"), loops=True)
OPT = Spec("opt", ("optimizer",), ("params", "grads", "opt_state", "device", "loss", "guard", "state", "new_state"),
           _build_opt, options=("layout", "statics", "on_nonfinite"), donate=(0, 2, 5),
           compiler_options=OPTIMIZER_OPTIONS, loops=True)
EVAL = Spec("eval", ("forward", "loss"), ("params", "state", "device", "inputs", "targets", "n_valid"), _build_eval,
            options=("statics",))
METRIC = Spec("metric", (), ("device", "outputs", "fields"), _build_metric)  # one per hook: `metric:<hook>`
PREDICT = Spec("predict", ("forward",), ("params", "state", "device", "inputs"), _build_predict,
               options=("statics",))
# `steps_per_execution=K`: the one more program K > 1 adds (the per-step two still run an epoch's first step
# and the steps left over when K does not divide the rest). Params, optimizer state and guard are donated.
STEPS = Spec("steps", ("forward", "loss", "optimizer"),
             ("params", "state", "opt_state", "device", "batches", "schedule", "guard"), _build_steps,
             options=("accum", "layout", "statics", "on_nonfinite"), donate=(0, 2, 6), loops=True)
SPECS = {s.kind: s for s in (GRAD, OPT, STEPS, EVAL, METRIC, PREDICT)}


def program_key(spec: Spec, binding, args: tuple, settings: dict, hook: str | None = None) -> Key:
    """The cache key of one program, the only place a `Key` is composed.

    **Arguments:**
    - `spec`: the program's kind, from `SPECS`.
    - `binding`: the handle's `Binding` (owner, hook fingerprints, GraphConst hash).
    - `args`: the arguments the program is called with; their signature is part of the key.
    - `settings`: the handle settings a spec's `options` name (`accum`, `layout`, `statics`).
    - `hook`: for a per-hook kind (`metric`), the hook it traces.

    **Returns:** the `_cache.Key`. It carries each GraphConst field's fingerprint too: a live program
    whose trace read only fields this key fingerprints alike serves it (`_cache._serving`).
    """
    kind, hooks = (spec.kind, spec.hooks) if hook is None else (f"{spec.kind}:{hook}", (hook,))
    fps = binding.hook_fps
    return Key(
        kind,
        binding.owner,
        tuple((h, fps[h]) for h in hooks if h in fps),
        arg_signature(args, spec.args),
        binding.graphconst.hash,
        tuple((o, settings[o]) for o in spec.options),
        tuple((name, fp) for name, (fp, _shown) in binding.graphconst.info.items()),
    )
