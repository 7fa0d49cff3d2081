"""Carrying values across an edit: user-class instances and schedules re-bound to the live code, and the
check that carried parameters still fit the experiment's `init`.

A notebook user re-runs a class cell (or `importlib.reload`s a module) and rebuilds. The experiment class
is re-bound by `_binding.bind`; this module does the same for what the experiment and the training state
hold: instances of user classes in GraphConst fields (a head, a Flax Linen or Equinox module definition),
in the parameter pytree (an Equinox model) and in the optimizer state, and the `schedules=` callables. An
instance keeps its field values; only its class becomes the live one.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import numpy as np

from .. import _closure
from .._base._compat import jax_jit
from .._base._errors import NitroValueError
from .._base._fingerprint import Unfingerprintable, fingerprint, function_fingerprint
from .._base._live import live_callable, live_value
from .._base._memo import Memo
from ._fields import graphconst_fields


def live_experiment(e):
    """`e` with its GraphConst fields' values re-bound to the live classes (`live_value`); `e` itself when
    none changed. Only GraphConst fields: a Host field holds the user's data and loggers, as they are."""
    changed = {}
    for name in graphconst_fields(type(e)):
        value = getattr(e, name)
        new = live_value(value)
        if new is not value:
            changed[name] = new
    if not changed:
        return e
    return dataclasses.replace(e, **changed)


def _code_of(fn) -> str | None:
    try:
        return function_fingerprint(fn.func if isinstance(fn, functools.partial) else fn)
    except (Unfingerprintable, Exception):  # a cell with no content fingerprint: compared by object
        return None


def live_schedules(schedules: dict) -> dict:
    """`schedules` with each callable re-bound to the code its name holds now."""
    return {name: live_callable(fn) for name, fn in schedules.items()}


def edited_schedules(schedules: dict) -> tuple:
    """`"schedule `lr` (`__main__.warmup`)"` for each schedule whose name now holds other code."""
    out = []
    for name, fn in schedules.items():
        live = live_callable(fn)
        if live is fn:
            continue
        if _code_of(live) is None or _code_of(live) != _code_of(fn):
            target = fn.func if isinstance(fn, functools.partial) else fn
            out.append(f"schedule `{name}` (`{target.__module__}.{target.__qualname__}`)")
    return tuple(out)


def _leaves(tree) -> dict:
    """`{path: (shape, dtype)}` of the array leaves of `tree` (other leaves are static, not carried)."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            # the dtype as it is: NumPy's, or JAX's own (an `nnx.Rngs` stream's typed key, `key<fry>`)
            out[jax.tree_util.keystr(path)] = (tuple(leaf.shape), leaf.dtype)
    return out


def check_fits(cls, init, experiment, seed: int, params, has_state: bool = False, state=None) -> None:
    """Refuse carried `params` (and, with `has_state`, the model `state`) that no longer fit what `init`
    returns now, with a path-level diff.

    `init` is traced abstractly (`jax.eval_shape`): nothing runs on the device, nothing compiles. With
    `has_state`, `init` returns `(params, state)`.
    """
    out = abstract_init(cls, init, experiment, seed)
    pairs = [("params", "parameters", out[0] if has_state else out, params)]
    if has_state:
        pairs.append(("state", "model state", out[1], state))
    lines = []
    for root, name, want, have in pairs:
        want, have = _leaves(want), _leaves(have)
        for path in sorted(want.keys() | have.keys()):
            if path not in have:
                lines.append(f"  {root}{path}: new in `init` {_sig(want[path])}, not in the carried {name}")
            elif path not in want:
                lines.append(f"  {root}{path}: carried {_sig(have[path])}, no longer in `init`")
            elif want[path] != have[path]:
                lines.append(f"  {root}{path}: carried {_sig(have[path])}, `init` now gives {_sig(want[path])}")
    if lines:
        shown = lines[:12] + ([f"  ... and {len(lines) - 12} more"] if len(lines) > 12 else [])
        what = "parameters" if all(ln.startswith("  params") for ln in lines) else "parameters or model state"
        raise NitroValueError(
            f"the training state of this handle does not fit `{cls.__qualname__}` as it is now: its "
            f"{what} differ from what `init` returns:\n" + "\n".join(shown) + "\nStart a fresh run "
            "with `Nitro(e, ...)`, or change `init` back so the parameters fit."
        )


def copy_arrays(tree):
    """`tree` with its arrays copied to fresh device buffers in one transfer; every other leaf (an
    Equinox model's activation function, a Python float or string) as it is, so a static leaf stays
    static (`_model.leaf_kind`) and keys the same programs."""
    leaves, treedef = jax.tree.flatten(tree)
    at = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray, np.generic))]
    for i, copy in zip(at, jax.device_put([leaves[i] for i in at], may_alias=False)):
        leaves[i] = copy
    return treedef.unflatten(leaves)


# `abstract_init`'s last results: {key: (closure, shapes)}. A rebuild traces `init` abstractly to check
# the carried state still fits; that trace is most of a rebuild (46 of 57 ms on the 120-layer MLP, 121
# `jax.random` calls), and it holds the GIL while a compile ahead of the same edit wants to trace. When
# nothing `init`'s trace depended on has moved, its shapes are the ones it gave before.
_INITS = Memo("abstract init shapes", maxsize=8)
_FIELD_BYTES = 1 << 16  # a field value larger than this (a dataset as a Host field) is not fingerprinted


def abstract_init(cls, init, experiment, seed: int):
    """`init(experiment, PRNGKey(seed))` as shapes and dtypes (`jax.ShapeDtypeStruct`s; non-array leaves
    None), traced abstractly (nothing runs, nothing compiles), or the shapes of the last such trace when
    its dependency closure has not moved and the experiment's field values are the same (by content)."""
    key = _init_key(cls, experiment, seed)
    if key is not None and key in _INITS:
        closure, shapes = _INITS[key]
        if not closure.drift({}):  # (a closure born stale, `superseded`, is never kept)
            return shapes
    fn = lambda: _arrays_only(init(experiment, jax.random.PRNGKey(seed)))  # noqa: E731
    with _closure.record() as recorder:
        traced = jax_jit(fn).trace()
        recorder.traced(traced.jaxpr, init)
    shapes = traced.out_info
    closure = recorder.closure
    if key is not None and not closure.anonymous and not closure.superseded:
        _INITS.pop(key, None)
        _INITS[key] = (closure, shapes)
    return shapes


def _init_key(cls, experiment, seed: int):
    """What `init`'s shapes may hang on besides its code: the class's name and which class defines each
    of its methods (`_methods_by_owner`), every field's value (Host fields too: `init` runs on the
    experiment itself), the seed and x64; None when a value has no cheap content fingerprint (then
    `init` is traced every time)."""
    parts = [cls.__module__, cls.__qualname__, _methods_by_owner(cls), int(seed), bool(jax.config.jax_enable_x64)]
    for f in dataclasses.fields(experiment):
        value = getattr(experiment, f.name, None)
        if getattr(value, "nbytes", 0) > _FIELD_BYTES:
            return None
        try:
            parts.append((f.name, fingerprint(value, f.name)))
        except (Unfingerprintable, TypeError, ValueError):
            return None
    return tuple(parts)


def _methods_by_owner(cls) -> tuple:
    """`(name, module, qualified name)` of the function each method name of `cls` resolves to.

    The recorded closure finds a function again by its own qualified name, so it cannot see a method
    move between classes: `class Exp(Base): pass` inheriting `Base.init`, re-run as a class defining its
    own `init` (or a `self.layers()` it now overrides) with the same field values, would get the old
    shapes. This table moves then; an edit inside a method is the closure's to see."""
    table = {}
    for klass in reversed(cls.__mro__[:-1]):  # `object` last in the MRO, and none of its methods are hooks
        for name, attr in vars(klass).items():
            fn = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
            if isinstance(fn, types.FunctionType):
                table[name] = (fn.__module__, fn.__qualname__)
            else:  # a subclass's value hides the base's method
                table.pop(name, None)
    return tuple(sorted((name,) + owner for name, owner in table.items()))


def _arrays_only(tree):
    """`tree` with its non-array leaves (an Equinox module's activation functions) as None, so that
    `jax.eval_shape` can return it."""
    return jax.tree.map(lambda x: x if isinstance(x, jax.Array) else None, tree)


def _sig(sig) -> str:
    shape, dtype = sig
    return f"{dtype.name}{list(shape)}"
