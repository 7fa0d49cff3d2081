"""What a model is to the programs: params split into trained, carried and static leaves, the model
state, and the reserved keyword-only hook parameters (`rng`, `train`, `state`).

Everything here is decided at setup, from the values `init` returned, so a leaf the programs cannot take
is refused before anything is traced, naming its path.

- `leaf_kind` is the one leaf rule (Equinox's `eqx.partition(tree, eqx.is_inexact_array)`, plus carried
  integer arrays): a float array is trained, any other array is carried, anything else is static.
- `ParamSplit` holds the static leaves and moves between the user's pytree, the *dynamic* tree the
  programs take (statics replaced by None) and the *trainable* tree the optimizer sees (floats only).
- `step_key` is the per-step PRNG key rule, the one place it is written; `step_keys` computes one
  step's keys on the host, bit for bit (the first step's keys of a guard, `_training._guard.fresh`).
"""

import collections.abc
import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np

from .._base._errors import NitroTypeError, NitroValueError
from .._base._fingerprint import Unfingerprintable, fingerprint
from ._fields import short_repr

RESERVED = ("rng", "train", "state")
# Which hooks may declare which reserved parameters.
_ALLOWED = {"forward": ("rng", "train", "state"), "loss": ("train",)}

TRAIN, CARRY, STATIC = "train", "carry", "static"


def reserved_params(cls, name: str, fn) -> frozenset:
    """The reserved parameters hook `fn` (named `name`) declares; refused when positional or not
    allowed for that hook, with the fix."""
    found = set()
    for p in inspect.signature(fn).parameters.values():
        if p.name not in RESERVED:
            continue
        if p.kind is not p.KEYWORD_ONLY:
            raise NitroTypeError(
                f"hook `{cls.__qualname__}.{name}`: `{p.name}` is a reserved parameter and must be "
                f"keyword-only; write `def {name}(self, ..., *, {p.name})`."
            )
        if p.name not in _ALLOWED.get(name, ()):
            where = ", ".join(f"`{h}` ({', '.join(r)})" for h, r in _ALLOWED.items())
            raise NitroTypeError(
                f"hook `{cls.__qualname__}.{name}` declares the reserved parameter `{p.name}`, which "
                f"only these hooks receive: {where}. Rename the parameter if it is a batch field."
            )
        found.add(p.name)
    return frozenset(found)


def step_key(seed, step, micro):
    """The `rng` a hook gets at optimizer step `step`, micro-batch `micro`:
    `fold_in(fold_in(PRNGKey(seed), step), micro)`. Traceable: `seed` and `step` may be traced."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), step), micro)


# `step_key`, computed on the host, bit for bit JAX's threefry2x32: a guard starts with its first step's keys
# (`_training._guard.fresh`), and the optimizer program derives each next step's on the device.
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_U32 = 0xFFFFFFFF


def threefry2x32(k0, k1, x0, x1):
    """JAX's `threefry_2x32` hash of the counter pair `(x0, x1)` under the key `(k0, k1)`: 20 rounds, the
    key injected every 4. Python ints, every sum and shift taken mod 2**32; or traced uint32 scalars,
    which wrap by themselves. Traced, it is straight-line code that XLA fuses into one kernel, where
    `jax.random.fold_in` lowers to a `while` loop that XLA:CPU runs at about 13 us a hash."""
    traced = any(isinstance(v, jax.Array) for v in (k0, k1, x0, x1))
    wrap = (lambda v: v) if traced else (lambda v: v & _U32)  # noqa: E731
    ks = (k0, k1, k0 ^ k1 ^ 0x1BD11BDA)
    x0, x1 = wrap(x0 + ks[0]), wrap(x1 + ks[1])
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = wrap(x0 + x1)
            x1 = wrap(x1 << r) | (x1 >> (32 - r))
            x1 = x1 ^ x0
        x0 = wrap(x0 + ks[(i + 1) % 3])
        x1 = wrap(x1 + ks[(i + 2) % 3] + (i + 1))
    return x0, x1


def step_keys(seed: int, step: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """`step_key(seed, step, micro)`'s raw key as Python ints, before micro-batch 0 is folded in
    (`fold_in(PRNGKey(seed), step)`) and after."""
    base = threefry2x32(0, int(seed) & _U32, 0, int(step) & _U32)
    return base, threefry2x32(*base, 0, 0)


EVAL_KEY_SEED = 0  # evaluation and predict get `PRNGKey(0)`: deterministic, the same every batch


def leaf_kind(leaf, path: str) -> str:
    """`TRAIN` (a float array: differentiated and optimized), `CARRY` (any other array: integer, bool,
    PRNG key; carried unchanged) or `STATIC` (not an array: functions, Python scalars and strings,
    baked into the programs and fingerprinted into their key). A static leaf that has no content
    fingerprint is refused, naming `path`."""
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        return TRAIN if jnp.issubdtype(leaf.dtype, jnp.inexact) else CARRY
    try:
        fingerprint(leaf, path)
    except Unfingerprintable as err:
        raise NitroTypeError(
            f"`{path}` is {type(leaf).__name__} ({short_repr(leaf)}): neither an array (trained or "
            f"carried) nor a static value with a content fingerprint ({err}). Return an array there, or "
            f"keep the value out of `params` (a GraphConst field, or a static field of your module)."
        ) from None
    return STATIC


class ParamSplit:
    """A params pytree split by `leaf_kind`. The programs take the dynamic tree (the arrays, static
    leaves replaced by None); `combine` gives the hooks the user's tree back."""

    def __init__(self, params, root: str = "params"):
        with_path, self.treedef = jax.tree_util.tree_flatten_with_path(params)
        self.paths = [root + jax.tree_util.keystr(p) for p, _ in with_path]
        self.kinds = [leaf_kind(leaf, path) for path, (_, leaf) in zip(self.paths, with_path)]
        self.statics = {i: leaf for i, (k, (_, leaf)) in enumerate(zip(self.kinds, with_path)) if k == STATIC}
        # Static leaves shape the graph: their content is part of every params-taking program's key.
        self.signature = fingerprint(tuple(sorted(self.statics.items())), root) if self.statics else ""

    def trainable_paths(self) -> list[str]:
        """The paths of the trained leaves, in the order the trainable tree flattens them."""
        return [p for p, k in zip(self.paths, self.kinds) if k == TRAIN]

    def dynamic(self, params):
        """The tree the programs take: `params` with static leaves replaced by None."""
        leaves = self.treedef.flatten_up_to(params)
        return self.treedef.unflatten([None if k == STATIC else x for k, x in zip(self.kinds, leaves)])

    def combine(self, dynamic):
        """The user's tree from the dynamic one (static leaves put back)."""
        leaves = self.treedef.flatten_up_to(dynamic)
        return self.treedef.unflatten([self.statics[i] if k == STATIC else x
                                       for i, (k, x) in enumerate(zip(self.kinds, leaves))])

    def trainable(self, dynamic):
        """The float leaves only (others None): what is differentiated and what the optimizer sees."""
        leaves = self.treedef.flatten_up_to(dynamic)
        return self.treedef.unflatten([x if k == TRAIN else None for k, x in zip(self.kinds, leaves)])

    def with_trainable(self, dynamic, trainable):
        """`dynamic` with its float leaves taken from `trainable`."""
        leaves = self.treedef.flatten_up_to(dynamic)
        new = self.treedef.flatten_up_to(trainable)
        return self.treedef.unflatten([n if k == TRAIN else x for k, x, n in zip(self.kinds, leaves, new)])


def strong(x):
    """A fresh, strongly typed device copy: a Python scalar would otherwise be weakly typed, and the
    optimizer's strongly typed output would move the key at step 2. A typed PRNG key (an NNX `RngKey`)
    has no numpy form: it is copied on device."""
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.device_put(x, may_alias=False)
    return jax.device_put(np.asarray(x))


def check_state(state, root: str = "state"):
    """Model state must be a pytree of arrays (it is carried through the gradient program)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, bool)):
            raise NitroTypeError(
                f"`{root}{jax.tree_util.keystr(path)}` is {type(leaf).__qualname__} ({short_repr(leaf)}); "
                f"model state is carried through the gradient program, so every leaf must be an array."
            )


def split_init(cls, result, has_state: bool):
    """`(params, state)` from what `init` returned, refusing the wrong arity or no parameters with the fix."""
    if not has_state:
        return _some_params(cls, result), None
    if not (isinstance(result, tuple) and len(result) == 2):
        raise NitroTypeError(
            f"`{cls.__qualname__}.forward` declares `state`, so `init` must return `(params, state)`; "
            f"got {type(result).__qualname__} ({short_repr(result)}). Return "
            f"`params, {{\"batch_stats\": ...}}`, or drop `state` from `forward`."
        )
    return _some_params(cls, result[0]), result[1]


def _some_params(cls, params):
    """`params`, unless `init` returned None for them (a missing `return`)."""
    if params is None:
        raise NitroTypeError(
            f"`{cls.__qualname__}.init` returned None, not the parameters: `init(self, rng)` must return the "
            f"params pytree (a dict of arrays, a model). Fix: end `init` with `return params` (or "
            f"`return params, state` when `forward` declares `state`)."
        )
    return params


def forward_result(owner: str, result, given: tuple):
    """`(outputs, new_state)` from a stateful `forward`'s return value, refusing the wrong arity, or a
    new state whose structure differs from the state it was given; new leaves take the old dtypes so
    the gradient program's outputs never move its own key.

    `given` is the given state as `(treedef, leaves)`, taken before `forward` ran: the container itself
    may be spent by then (Equinox marks an `eqx.nn.State` old once a layer has `set` it)."""
    if not (isinstance(result, tuple) and len(result) == 2):
        raise NitroTypeError(
            f"`{owner}.forward` declares `state`, so it must return `(outputs, new_state)`; got "
            f"{type(result).__qualname__}. Return `out, new_state` (or `out, state` when it does not change)."
        )
    outputs, new_state = result
    old, leaves = given
    if jax.tree_util.tree_structure(new_state) != old:
        diff = tree_diff(jax.tree_util.tree_unflatten(old, leaves), new_state, "state")
        raise NitroTypeError(
            f"`{owner}.forward` returned a new state whose structure differs from the state it was given "
            f"({'; '.join(diff) or 'containers differ'}). Return the state with the same keys: with Flax "
            f"`mutable=[\"batch_stats\"]` return the updated collections as `{{\"batch_stats\": ...}}`."
        )
    new = old.flatten_up_to(new_state)
    return outputs, jax.tree_util.tree_unflatten(old, [jnp.asarray(n, o.dtype) for n, o in zip(new, leaves)])


def _shape_dtype(x):
    return tuple(np.shape(x)), str(getattr(x, "dtype", None) or np.result_type(x))


def tree_diff(expected, got, root: str) -> list[str]:
    """Path-level differences between two trees of arrays: missing, unexpected, shape or dtype."""
    def table(tree):
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {root + jax.tree_util.keystr(p): x for p, x in leaves}

    want, have = table(expected), table(got)
    lines = [f"`{p}` missing" for p in want if p not in have]
    lines += [f"`{p}` unexpected" for p in have if p not in want]
    for p in want:
        if p in have and not (_is_array(want[p]) ^ _is_array(have[p])):
            if _is_array(want[p]) and _shape_dtype(want[p]) != _shape_dtype(have[p]):
                (ws, wd), (hs, hd) = _shape_dtype(want[p]), _shape_dtype(have[p])
                lines.append(f"`{p}`: expected {wd}{list(ws)}, got {hd}{list(hs)}")
        elif p in have:
            lines.append(f"`{p}`: expected {type(want[p]).__qualname__}, got {type(have[p]).__qualname__}")
    return lines


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _arrays_of_init(b, statics: dict):
    """`init` as a function of the key returning its array leaves only (None elsewhere); the treedef and
    the non-array leaves land in `statics`, so it can run under `jax.jit` or `jax.eval_shape`."""
    def arrays_only(rng):
        leaves, statics["treedef"] = jax.tree_util.tree_flatten(b.init(b.experiment, rng))
        statics["leaves"] = {i: x for i, x in enumerate(leaves) if not _is_array(x)}
        return [x if _is_array(x) else None for x in leaves]

    return arrays_only


def _rebuilt(statics: dict, arrays: list):
    leaves = [statics["leaves"].get(i, x) for i, x in enumerate(arrays)]
    return jax.tree_util.tree_unflatten(statics["treedef"], leaves)


def run_init(b, rng):
    """`(params, state)` from `init`, run eagerly. (Not under `jax.jit`: XLA compiles a program of many
    `jax.random` calls far slower than eager dispatch runs them, 30 s against 5 s for 20 layers.)"""
    return split_init(b.cls, b.init(b.experiment, rng), b.has_state)


def _abstract_init(b, rng):
    """`init`'s `(params, state)` as shapes and dtypes only (`jax.eval_shape`), its static leaves kept."""
    statics = {}
    shapes = jax.eval_shape(_arrays_of_init(b, statics), rng)
    return split_init(b.cls, _rebuilt(statics, shapes), b.has_state)


def check_given(b, rng, params, state):
    """`(params, state)` given to `Nitro(e, params=..., state=...)`, refused with a path-level diff when
    they do not match what `init` builds; a value not given is taken from a real `init`."""
    cls = b.cls
    if state is not None and not b.has_state:
        raise NitroValueError(
            f"`state=` was given, but `{cls.__qualname__}.forward` does not declare `state`; add "
            f"`*, state` to `forward` (returning `(outputs, new_state)`) or drop `state=`."
        )
    want_params, want_state = _abstract_init(b, rng)
    for what, want, got in (("params", want_params, params), ("state", want_state, state)):
        if got is None:
            continue
        lines = tree_diff(want, got, what)
        if not lines and jax.tree_util.tree_structure(want) != jax.tree_util.tree_structure(got):
            regrouped = _in_containers_of(want, got)
            if regrouped is None:
                lines = [f"containers differ: expected {jax.tree_util.tree_structure(want)}, got "
                         f"{jax.tree_util.tree_structure(got)}"]
            elif what == "params":
                params = regrouped
            else:
                state = regrouped
        if lines:
            shown = "\n  ".join(lines[:12]) + ("\n  ..." if len(lines) > 12 else "")
            raise NitroValueError(
                f"the given `{what}=` does not match what `{cls.__qualname__}.init` builds:\n  {shown}\n"
                f"Pass values with `init`'s structure (load the checkpoint into the same model), or change "
                f"the GraphConst fields so `init` builds the model the values came from."
            )
    if params is None or (state is None and b.has_state):
        real_params, real_state = run_init(b, rng)
        params = real_params if params is None else params
        state = real_state if state is None else state
    return params, state


def _plain(tree):
    """`tree` with every mapping (a Flax `FrozenDict`, an `nnx.State`) as a plain dict, recursively; the
    leaves are the same objects."""
    if isinstance(tree, collections.abc.Mapping):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(_plain(v) for v in tree)
    return tree


def _in_containers_of(want, got):
    """`got` rebuilt in `want`'s containers when the two differ only in the kind of mapping that holds
    the same keys (a checkpoint loaded as a `FrozenDict` for an `init` that returns dicts, or the other
    way round); None when anything else differs (an Equinox module's static fields, a list for a tuple)."""
    plain_want, plain_got = _plain(want), _plain(got)
    if jax.tree_util.tree_structure(plain_want) != jax.tree_util.tree_structure(plain_got):
        return None
    order = jax.tree_util.tree_leaves(want)
    if [id(x) for x in order] != [id(x) for x in jax.tree_util.tree_leaves(plain_want)]:
        return None  # `want`'s containers order their keys differently from a dict's: no safe regroup
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(want), jax.tree_util.tree_leaves(plain_got))


@dataclasses.dataclass(frozen=True, slots=True)
class Model:
    """What the program builders need about the model: the param split, the layout of the trainable
    leaves, whether `forward` is stateful, and which reserved parameters each hook declares."""

    split: ParamSplit
    layout: object  # `_layout.FlatLayout` or `TreeLayout`, over the trainable tree
    has_state: bool
    reserved: dict  # {hook name: frozenset of reserved names}

