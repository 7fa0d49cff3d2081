"""Non-finite steps never reach the parameters.

The optimizer program checks, on device, the step's loss, each gradient buffer and each floating Device
field (`parts`), and when any is non-finite applies nothing: the whole update is one `lax.cond` (`gated`)
whose other branch hands back the parameters and optimizer state it was given, inside the program that
donates them. A small `guard` (one int32 vector, so a step dispatches one more buffer, not four) is
carried from step to step through the same program:

- `guard[STEPS]`: steps seen since the guard was made (the epoch's start);
- `guard[BAD]`: how many of them were not applied;
- `guard[FIRST]`: the index of the first bad one (-1: none); `guard[WHY:]`: which parts were non-finite
  at that step (1 = non-finite);
- `guard[FINITE]`, `guard[SUM]`, `guard[COMP]`: how many steps had a finite loss, and the sum of those
  losses (float32 bits: a compensated sum and its compensation), so a sync point learns the epoch's loss
  from the one transfer of the guard rather than one transfer per step's loss (`loss_sum`);
- `guard[SEED]`, `guard[ORIGIN]`: the handle's seed (its 32 bits) and the optimizer step the guard was
  made at; `guard[BASE:BASE + 2]` and `guard[KEY:KEY + 2]`: the next step's key (`step_key`'s rule) before
  and after micro-batch 0 is folded in. The optimizer program derives them for step `ORIGIN + STEPS` on
  the device, and the gradient program takes its key from there (`step_rng`): no step hands the device
  a host value, and the two threefry hashes are compiled once, into the program an edit of the model
  leaves alone, not into the gradient program it recompiles (bench_models' Flax CNN: 363 -> 322 ms of
  XLA per edit).

`halt=True` (`on_nonfinite="raise"`) makes a bad step sticky: no later step of the epoch applies either,
so the handle holds exactly the parameters of the last finite step when the loop sees the guard at its
next sync point (no per-step host sync). `halt=False` (`"skip"`) skips each bad step on its own.

The host side (`diagnose`) turns a guard into the error: which step, what was non-finite, the fix.
"""

import jax
import jax.numpy as jnp
import numpy as np

from .._base._errors import NonFiniteLossError
from .._experiment._checks import kind
from .._experiment._model import step_keys, threefry2x32

STEPS, BAD, FIRST, FINITE, SUM, COMP, SEED, ORIGIN, BASE, KEY, WHY = 0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12


def _floating(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return jnp.issubdtype(np.asarray(x).dtype if dtype is None else dtype, jnp.inexact)


def parts(loss, flat_grads, dev: dict) -> list:
    """The values a step checks, in the order of `labels`: the loss, each gradient leaf (one per flat
    buffer), each floating Device field."""
    grads = [g for g in jax.tree.leaves(flat_grads) if _floating(g)]
    return [loss, *grads, *(dev[k] for k in sorted(dev) if _floating(dev[k]))]


def labels(flat_grads, dev: dict) -> list[str]:
    """What each of `parts` is, for the error message (works on arrays or avals)."""
    out = ["the training loss"]
    for path, g in jax.tree_util.tree_flatten_with_path(flat_grads)[0]:
        if _floating(g):
            out.append(f"the gradient of {_buffer_name(path)}")
    out += [f"Device field `{k}`" for k in sorted(dev) if _floating(dev[k])]
    return out


def _buffer_name(path) -> str:
    text = jax.tree_util.keystr(path)
    key = getattr(path[0], "key", None) if len(path) == 1 else None
    # a flat buffer is named by its dtype, and its parameter group after a colon (`float32:mask`)
    flat = isinstance(key, str) and key.split(":")[0] in np.sctypeDict
    return f"the flat {key} buffer" if flat else f"`params{text}`"


def _u32(x):
    """The 32 bits of an int32 guard entry, as the uint32 the host wrote (`fresh`)."""
    return jax.lax.bitcast_convert_type(x, jnp.uint32)


def fresh(n_parts: int, seed: int = 0, step: int = 0) -> np.ndarray:
    """A guard with no steps seen, made at optimizer step `step` of a handle seeded `seed` (a host value:
    transferred once, at the epoch's first step), holding that step's keys."""
    guard = np.zeros(WHY + n_parts, np.int32)
    guard[FIRST] = -1
    guard[SEED], guard[ORIGIN] = np.array([int(seed) & 0xFFFFFFFF, int(step) & 0xFFFFFFFF], np.uint32).view(np.int32)
    base, key = step_keys(seed, step)
    guard[BASE:WHY] = np.array([*base, *key], np.uint32).view(np.int32)
    return guard


def step_rng(guard, micro=None):
    """The rng of the step a guard is at (`_model.step_key`, bit for bit): `fold_in(PRNGKey(seed), step)`,
    then `fold_in(., micro)` unless `micro` is None. Traced inside the gradient program: the keys live on
    the device, in the guard the optimizer program advances (`next_keys`); only a micro-batch after the
    first is folded in here."""
    if micro is None:
        return _u32(guard[BASE:BASE + 2])
    if isinstance(micro, int) and micro == 0:
        return _u32(guard[KEY:KEY + 2])
    base = _u32(guard[BASE:BASE + 2])
    return jnp.stack(threefry2x32(base[0], base[1], jnp.zeros((), jnp.uint32), jnp.asarray(micro).astype(jnp.uint32)))


def next_keys(guard, steps):
    """`guard[BASE:WHY]` for step `ORIGIN + steps` (`steps`: the new step count): the key before and
    after micro-batch 0 is folded in, as int32 bits. Traced inside the optimizer program, as one fused
    kernel (`_model.threefry2x32`: `jax.random.fold_in` would add two `while` loops to every step, 27 us
    of the tiny MLP's 64 us step on XLA:CPU)."""
    zero = jnp.zeros((), jnp.uint32)
    # fold_in(PRNGKey(seed), step)
    base = threefry2x32(zero, _u32(guard[SEED]), zero, _u32(guard[ORIGIN]) + _u32(steps))
    key = threefry2x32(*base, zero, zero)  # fold_in(., 0); the sum above wraps at 2**32, as the host's
    return jax.lax.bitcast_convert_type(jnp.stack([*base, *key]), jnp.int32)


def bad_steps(guard) -> int:
    """How many steps of a (host) guard were not applied."""
    return int(guard[BAD])


def first_bad(guard) -> int:
    """The index, since the guard was made, of its first bad step (-1: none)."""
    return int(guard[FIRST])


def loss_sum(guard) -> tuple[float, int]:
    """`(sum, count)` of the finite losses a (host) guard has seen."""
    hi, lo = np.asarray(guard[SUM:COMP + 1], np.int32).view(np.float32).astype(np.float64)
    return float(hi + lo), int(guard[FINITE])


def origin_and_losses(guard) -> tuple[int, float, int]:
    """`(origin, sum, count)` of a guard (on the device or the host): the step it was made at, and its
    finite losses (the loggers' mean loss of a `steps_per_execution` block, `nitro_ipy.loggers`)."""
    guard = np.asarray(guard)
    return (int(guard[ORIGIN]), *loss_sum(guard))


def _add_loss(guard, loss):
    """`(finite count, sum bits, compensation bits)` after adding `loss` when it is finite: Neumaier's
    compensated sum in float32, so an epoch's mean loss is as exact as the host's float64 sum was."""
    finite = jnp.isfinite(loss)
    x = jnp.where(finite, loss, 0).astype(jnp.float32)
    bits = lambda v: jax.lax.bitcast_convert_type(v, jnp.int32)
    s, c = (jax.lax.bitcast_convert_type(guard[i], jnp.float32) for i in (SUM, COMP))
    t = s + x
    c = c + jnp.where(jnp.abs(s) >= jnp.abs(x), (s - t) + x, (x - t) + s)
    return guard[FINITE] + finite.astype(jnp.int32), bits(t), bits(c)


def _bad_parts(checked: list):
    """One bool per value of `checked`: whether any of its elements is non-finite."""
    return jnp.stack([~jnp.all(jnp.isfinite(c)) for c in checked])


def decide(guard, checked: list, halt: bool):
    """`(apply, new guard)`: whether this step's update applies (every value of `checked` is finite and,
    with `halt`, no earlier step was bad), and the guard that records it (and the loss, `checked[0]`).
    Traced inside the optimizer program."""
    bad_parts = _bad_parts(checked)
    bad = jnp.any(bad_parts)
    apply = ~bad & (guard[BAD] == 0) if halt else ~bad
    first_time = bad & (guard[FIRST] < 0)
    steps = guard[STEPS] + 1
    head = jnp.stack([steps, guard[BAD] + bad.astype(jnp.int32),
                      jnp.where(first_time, guard[STEPS], guard[FIRST]), *_add_loss(guard, checked[0]),
                      guard[SEED], guard[ORIGIN]])
    why = jnp.where(first_time, bad_parts.astype(jnp.int32), guard[WHY:])
    return apply, jnp.concatenate([head, next_keys(guard, steps), why])


def gated(apply, step, params, flat_grads, opt_state, *rest):
    """`step(params, flat_grads, opt_state, *rest)` -> `(params, opt_state)` where `apply`, else
    `(params, opt_state)` as they came in, exactly. Traced inside the optimizer program.

    One `lax.cond` around the whole update: XLA:CPU runs the branch taken, and the update's arrays are
    compiled as they are without the guard (selecting the updates instead put a select into each
    parameter's slice of the flat buffer: +25% XLA time at 242 arrays, measured in
    benchmarks/profile_handle.py `guard`). An optimizer whose state changes structure, shape or dtype
    (one that grows it, which recompiles anyway) cannot be a branch of the same type as its input: its
    updates are masked to zeros (one select per flat buffer) and its new state taken as it is.
    """
    keep = lambda params, flat_grads, opt_state, *rest: (params, opt_state)
    try:
        return jax.lax.cond(apply, step, keep, params, flat_grads, opt_state, *rest)
    except TypeError:  # the branches' types differ: the state moved
        pass
    new_params, new_state = step(params, flat_grads, opt_state, *rest)
    new_params = jax.tree.map(lambda n, o: jnp.where(apply, n, o), new_params, params)
    return new_params, select(apply, new_state, opt_state)


def select(apply, new, old):
    """`new` where `apply`, else `old`, leaf by leaf; a state whose structure or shapes moved cannot go
    back and is taken as it is."""
    same = jax.tree.structure(new) == jax.tree.structure(old) and all(
        jnp.shape(a) == jnp.shape(b) for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old)))
    if not same:
        return new
    return jax.tree.map(lambda n, o: jnp.where(apply, n, o).astype(jnp.result_type(n)), new, old)


def n_parts(layout, params, dev: dict) -> int:
    """How many values a step of this handle checks (the length of the guard's `why`)."""
    return len(labels(layout.abstract(params), dev))


# ---------------------------------------------------------------- host side: the error
def _nonfinite_fields(batch: dict) -> list[str]:
    out = []
    for name, a in batch.items():
        a = np.asarray(a)
        if kind(a.dtype) in "fc":
            bad = ~np.isfinite(a)
            if bad.any():
                kinds = sorted({str(v) for v in np.unique(a[bad])})
                out.append(f"`{name}` ({int(bad.sum())} non-finite: {', '.join(kinds)})")
    return out


def _nonfinite_leaves(layout, flat_grads) -> list[str]:
    tree = layout.unravel(flat_grads)
    found = []
    for path, g in jax.tree_util.tree_flatten_with_path(tree)[0]:
        g = np.asarray(g)
        if kind(g.dtype) in "fc" and not np.isfinite(g).all():
            found.append(f"`params{jax.tree_util.keystr(path)}`")
    return found


def diagnose(s, guard, step0: int, batch_at, dev_at, regrad) -> NonFiniteLossError:
    """The error for the first bad step of `guard` of a handle's `_loop.StepState` `s`.

    **Arguments:**
    - `s`: the step state (its parameters are those before the bad step).
    - `guard`: the guard, on the host.
    - `step0`: the handle's step when the guard was made.
    - `batch_at(i)`: the epoch's `i`-th batch (regenerated: the loop's batches are deterministic).
    - `dev_at(step)`: the Device values the programs got at `step` (schedules re-applied).
    - `regrad(batch, dev)`: the gradient program's `(flat grads, loss)` at the current parameters.

    **Returns:** the `NonFiniteLossError` to raise, naming the step, what was non-finite and the fix.
    """
    index = first_bad(guard)
    step = step0 + index + 1
    batch, dev = batch_at(index), dev_at(step - 1)
    names = labels(s.layout.ravel(s.model.split.trainable(s.params)), dev)
    what = [name for name, bad in zip(names, np.asarray(guard[WHY:])) if bad]
    fields = _nonfinite_fields(batch)
    flat_grads, loss = regrad(batch, dev)
    leaves = _nonfinite_leaves(s.layout, flat_grads)
    dev_bad = [w for w in what if w.startswith("Device field")]
    loss_value = float(np.asarray(jax.device_get(loss)))
    if "the training loss" in what:
        head = f"the training loss became {loss_value}"
    elif dev_bad:
        head = f"{dev_bad[0]} became non-finite"
    else:
        head = f"{(leaves or [w for w in what if w.startswith('the gradient')] or ['a gradient'])[0]}"
        head = head if head.startswith("the gradient") else f"the gradient of {head}"
        head += " became non-finite"
    why = []
    if fields:
        why.append(f"the batch's inputs are non-finite: field {', '.join(fields)}. Fix: clean the split "
                   f"before training (drop the rows, `np.nan_to_num`, or impute).")
    if dev_bad:
        sched = [w for w in dev_bad if w.split("`")[1] in s.binding.schedules]
        shown = ", ".join(f"{w} = {np.asarray(dev[w.split('`')[1]]).tolist()}" for w in dev_bad)
        src = " (set by its schedule)" if sched else ""
        why.append(f"{shown}{src}. Fix: make the schedule return a finite value at step {step - 1}."
                   if sched else f"{shown}. Fix: give the field a finite value.")
    if leaves and not fields and not dev_bad:
        why.append(f"non-finite gradient in {', '.join(leaves)} (loss {loss_value}). Fix: look for log(0), "
                   f"sqrt(0) or division by zero in `forward` / `loss` (`jnp.log(x + 1e-8)`), clip gradients "
                   f"(`optax.clip_by_global_norm(1.0)`) or lower the learning rate.")
    elif not why:
        why.append("Fix: look for log(0) or division by zero in the `loss` hook (`jnp.log(x + 1e-8)`) and "
                   "lower the learning rate.")
    return NonFiniteLossError(
        f"{head} at step {step} (epoch {s.epoch + 1}); that step's update was not applied: `n.params` and "
        f"the optimizer state are those after step {step - 1}, the last finite one, and the handle stays "
        f"usable. Cause: {' '.join(why)} To skip such steps instead, pass "
        f"`Nitro(..., on_nonfinite=\"skip\")` (skipped steps are counted on the epoch line)."
    )
