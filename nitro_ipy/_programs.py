"""What each program traces. Pure JAX: functions in, arrays out; no counters, no messages.

Every builder takes the hooks as plain functions (bound later to the compile view) and returns the
function that `jax.jit(...).lower(...)` traces:

- gradient: `(params, dev, batch) -> (flat grads, mean loss)`, a `lax.scan` over `accum` micro-batches;
- optimizer: `(params, flat grads, opt state, dev, loss, guard) -> (params, opt state, guard)`, separate
  even at accum=1; a non-finite step keeps the old params and state (`_guard`);
- evaluation forward: `(params, dev, inputs, targets, n_valid) -> (outputs, loss sum over valid rows)`;
- device metric: `(dev, outputs, fields) -> {name: (sum, count)}`;
- predict: `(params, dev, inputs) -> outputs`.

`SPECS` holds one `Spec` per kind (the hooks it traces, its argument names, its builder, the handle
settings in its key, donation, XLA options), and `program_key` composes every key from a spec.
"""

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from ._cache import Key, arg_signature
from ._checks import check_loss, check_metric_result
from ._compile import OPTIMIZER_OPTIONS
from ._guard import guarded, parts


def make_gradient(view_of, forward, loss, input_names, target_names, layout, accum: int):
    def loss_of(params, view, batch):
        outputs = forward(view, params, **{k: batch[k] for k in input_names})
        return check_loss(loss(view, outputs, **{k: batch[k] for k in target_names}))

    def gradient(params, dev, batch):
        view = view_of(dev)
        value_and_grad = jax.value_and_grad(loss_of)
        if accum == 1:
            value, grads = value_and_grad(params, view, batch)
        else:
            def micro(carry, micro_batch):
                total, acc = carry
                value, grads = value_and_grad(params, view, micro_batch)
                return (total + value, jax.tree.map(jnp.add, acc, grads)), None

            zeros = jax.tree.map(jnp.zeros_like, params)
            (total, grads), _ = jax.lax.scan(micro, (jnp.zeros((), jnp.float32), zeros), batch)
            value = total / accum
            grads = jax.tree.map(lambda g: g / accum, grads)
        return layout.ravel(grads), value

    return gradient


def make_optimizer(view_of, optimizer, layout, halt: bool = True):
    def update(params, flat_grads, opt_state, dev, loss, guard):
        tx = optimizer(view_of(dev))
        # The flat params are only built for an optimizer that reads them (weight decay, say): for one
        # that does not, XLA drops the concatenation, and a step never copies the whole model. The
        # updates are then added array by array, exactly as `apply_updates` on the flat buffer would.
        updates, new_state = tx.update(flat_grads, opt_state, layout.ravel(params))
        new_params = optax.apply_updates(params, layout.unravel(updates))
        # A non-finite loss, gradient or Device value keeps the old buffers (`_guard`): checked here,
        # where params and state are donated, so no step ever syncs with the host to find out.
        return guarded(guard, parts(loss, flat_grads, dev), (new_params, new_state), (params, opt_state), halt)

    return update


def per_example_loss(view, loss, outputs, targets: dict):
    """The loss of each example on its own (the hook applied to batches of one), so a padded batch
    can be masked and the split's loss weighted by examples exactly, whatever the batch layout."""

    def one(o, t):
        add_axis = lambda a: a[None]
        return check_loss(loss(view, jax.tree.map(add_axis, o), **jax.tree.map(add_axis, t)))

    return jax.vmap(one)(outputs, targets)


def make_eval(view_of, forward, loss, input_names, target_names):
    def evaluate(params, dev, inputs, targets, n_valid):
        view = view_of(dev)
        outputs = forward(view, params, **inputs)
        if loss is None:
            return outputs, jnp.zeros((), jnp.float32)
        per = per_example_loss(view, loss, outputs, targets)
        mask = jnp.arange(per.shape[0]) < n_valid
        return outputs, jnp.sum(jnp.where(mask, per, 0.0))

    return evaluate


def make_metric(view_of, hook):
    def metric(dev, outputs, fields):
        return check_metric_result(hook.__name__, hook(view_of(dev), outputs, **fields))

    return metric


def make_predict(view_of, forward):
    def predict(params, dev, inputs):
        return forward(view_of(dev), params, **inputs)

    return predict


# ---------------------------------------------------------------- the table of program kinds
@dataclasses.dataclass(frozen=True, slots=True)
class Spec:
    """How one kind of program is keyed and built."""

    kind: str
    hooks: tuple  # the experiment hooks it traces; a missing optional hook (`loss`) is left out of the key
    args: tuple  # its argument names, in the key and in miss explanations
    build: Callable  # `build(binding, layout, accum, hook, **fields)` -> the function `jax.jit` traces
    options: tuple = ()  # the handle settings that shape it: names in `program_key`'s `settings`
    donate: tuple = ()  # argument numbers whose buffers it reuses for its outputs
    compiler_options: dict | None = None  # XLA options on top of `_compile.program_options`' policy
    loops: bool = False  # a recompile with the same hooks is a loop worth a message (the training step)


def _build_grad(b, layout, accum, hook, *, inputs, targets):
    return make_gradient(b.view, b.forward, b.loss, inputs, targets, layout, accum)


def _build_opt(b, layout, accum, hook, *, halt=True):
    return make_optimizer(b.view, b.optimizer, layout, halt)


def _build_eval(b, layout, accum, hook, *, inputs, targets):
    return make_eval(b.view, b.forward, b.loss, inputs, targets)


def _build_metric(b, layout, accum, hook):
    return make_metric(b.view, b.metrics[hook][0])


def _build_predict(b, layout, accum, hook):
    return make_predict(b.view, b.forward)


GRAD = Spec("grad", ("forward", "loss"), ("params", "device", "batch"), _build_grad,
            options=("accum", "layout"), loops=True)
OPT = Spec("opt", ("optimizer",), ("params", "grads", "opt_state", "device", "loss", "guard"), _build_opt,
           options=("layout", "on_nonfinite"), donate=(0, 2, 5), compiler_options=OPTIMIZER_OPTIONS, loops=True)
EVAL = Spec("eval", ("forward", "loss"), ("params", "device", "inputs", "targets", "n_valid"), _build_eval)
METRIC = Spec("metric", (), ("device", "outputs", "fields"), _build_metric)  # one per hook: `metric:<hook>`
PREDICT = Spec("predict", ("forward",), ("params", "device", "inputs"), _build_predict)
SPECS = {s.kind: s for s in (GRAD, OPT, EVAL, METRIC, PREDICT)}


def program_key(spec: Spec, binding, args: tuple, settings: dict, hook: str | None = None) -> Key:
    """The cache key of one program, the only place a `Key` is composed.

    **Arguments:**
    - `spec`: the program's kind, from `SPECS`.
    - `binding`: the handle's `Binding` (owner, hook fingerprints, GraphConst hash).
    - `args`: the arguments the program is called with; their signature is part of the key.
    - `settings`: the handle settings a spec's `options` name (`accum`, `layout`).
    - `hook`: for a per-hook kind (`metric`), the hook it traces.

    **Returns:** the `_cache.Key`.
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
    )
