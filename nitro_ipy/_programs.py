"""What each program traces. Pure JAX: functions in, arrays out; no counters, no messages.

Every builder takes the hooks as plain functions (bound later to the compile view) and returns the
function that `jax.jit(...).lower(...)` traces:

- gradient: `(params, dev, batch) -> (flat grads, mean loss)`, a `lax.scan` over `accum` micro-batches;
- optimizer: `(params, flat grads, opt state, dev) -> (params, opt state)`, separate even at accum=1;
- evaluation forward: `(params, dev, inputs, targets, n_valid) -> (outputs, loss sum over valid rows)`;
- device metric: `(dev, outputs, fields) -> {name: (sum, count)}`;
- predict: `(params, dev, inputs) -> outputs`.
"""

import jax
import jax.numpy as jnp
import optax


def make_gradient(view_of, forward, loss, input_names, target_names, layout, accum: int):
    def loss_of(params, view, batch):
        outputs = forward(view, params, **{k: batch[k] for k in input_names})
        return loss(view, outputs, **{k: batch[k] for k in target_names})

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


def make_optimizer(view_of, optimizer, layout):
    def update(params, flat_grads, opt_state, dev):
        tx = optimizer(view_of(dev))
        # The flat params are only built for an optimizer that reads them (weight decay, say): for one
        # that does not, XLA drops the concatenation, and a step never copies the whole model. The
        # updates are then added array by array, exactly as `apply_updates` on the flat buffer would.
        updates, opt_state = tx.update(flat_grads, opt_state, layout.ravel(params))
        return optax.apply_updates(params, layout.unravel(updates)), opt_state

    return update


def per_example_loss(view, loss, outputs, targets: dict):
    """The loss of each example on its own (the hook applied to batches of one), so a padded batch
    can be masked and the split's loss weighted by examples exactly, whatever the batch layout."""

    def one(o, t):
        add_axis = lambda a: a[None]
        return loss(view, jax.tree.map(add_axis, o), **jax.tree.map(add_axis, t))

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
        return hook(view_of(dev), outputs, **fields)

    return metric


def make_predict(view_of, forward):
    def predict(params, dev, inputs):
        return forward(view_of(dev), params, **inputs)

    return predict
