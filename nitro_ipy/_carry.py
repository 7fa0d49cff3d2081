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

from . import _closure
from ._errors import NitroValueError
from ._fields import graphconst_fields
from ._fingerprint import Unfingerprintable, fingerprint, function_fingerprint
from ._hooks import live_class
from ._memo import Memo
from ._origin import is_user_function, is_user_module

_MAX_DEPTH = 64  # nesting bound: a cycle in a user's object graph is not followed forever


def live_value(value, _depth: int = 0):
    """`value` with every instance of a user class whose class was redefined re-made as an instance of
    the live class, with the same attributes, and every user function (a partial's too) the one its name
    gives now; containers rebuilt around what changed.

    Returns `value` itself when nothing inside it changed (identity kept: fingerprints and snapshots of
    the unchanged stay valid).
    """
    if _depth > _MAX_DEPTH:
        return value
    t = type(value)
    if t in (list, tuple) or (isinstance(value, tuple) and hasattr(t, "_fields")):
        items = [live_value(v, _depth + 1) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return t(items) if t in (list, tuple) else t(*items)
    if t is dict:
        items = {k: live_value(v, _depth + 1) for k, v in value.items()}
        return value if all(items[k] is v for k, v in value.items()) else items
    if isinstance(value, (types.FunctionType, functools.partial)):  # an activation in a GraphConst field
        return _live_callable(value)
    if isinstance(value, type):  # a class named in a value (an NNX GraphDef's node types): the live one
        return live_class(value) if is_user_module(getattr(value, "__module__", "") or "") else value
    if not is_user_module(getattr(t, "__module__", "") or ""):
        return _live_record(value, _depth) if dataclasses.is_dataclass(value) else value
    attrs = getattr(value, "__dict__", None)
    if type(attrs) is not dict:
        return value
    live = live_class(t)
    new_attrs = {k: live_value(v, _depth + 1) for k, v in attrs.items()}
    if live is t and all(new_attrs[k] is v for k, v in attrs.items()):
        return value
    out = object.__new__(live)  # the live class, without running its `__init__`: the values are kept
    for k, v in new_attrs.items():
        object.__setattr__(out, k, v)  # frozen dataclasses and Equinox modules refuse plain setattr
    return out


def _live_record(value, _depth: int):
    """A library's dataclass instance with its fields made live (`live_value`): an NNX `GraphDef`, whose
    nodes name the user's module classes that `nnx.merge` instantiates. A copy made without `__init__`
    (an Equinox module's takes other arguments) where a field changed, else `value` itself."""
    fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if hasattr(value, f.name)}
    new = {k: live_value(v, _depth + 1) for k, v in fields.items()}
    changed = {k: v for k, v in new.items() if v is not fields[k]}
    if not changed:
        return value
    out = object.__new__(type(value))
    attrs = getattr(value, "__dict__", None)
    for k, v in (attrs if type(attrs) is dict else fields).items():
        object.__setattr__(out, k, v)
    for k, v in changed.items():
        object.__setattr__(out, k, v)  # a frozen dataclass refuses plain setattr
    return out


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


def _live_callable(fn):
    """The callable `fn` names now: a user function re-resolved by its qualified name in its module (a
    partial's function likewise); anything else as it is."""
    if isinstance(fn, functools.partial):
        func = _live_callable(fn.func)
        return fn if func is fn.func else functools.partial(func, *fn.args, **fn.keywords)
    if not is_user_function(fn) or "<" in fn.__qualname__:
        return fn  # a lambda or a nested function has no name to find it again by
    head, *rest = fn.__qualname__.split(".")
    obj = fn.__globals__.get(head)
    for part in rest:
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, types.FunctionType) else fn


def _code_of(fn) -> str | None:
    try:
        return function_fingerprint(fn.func if isinstance(fn, functools.partial) else fn)
    except (Unfingerprintable, Exception):  # a cell with no content fingerprint: compared by object
        return None


def live_schedules(schedules: dict) -> dict:
    """`schedules` with each callable re-bound to the code its name holds now."""
    return {name: _live_callable(fn) for name, fn in schedules.items()}


def edited_schedules(schedules: dict) -> tuple:
    """`"schedule `lr` (`__main__.warmup`)"` for each schedule whose name now holds other code."""
    out = []
    for name, fn in schedules.items():
        live = _live_callable(fn)
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
        traced = jax.jit(fn).trace()
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


def holds_user_instances(tree, _depth: int = 0) -> bool:
    """Whether `tree` (a program's arguments) holds an instance of a user class (an Equinox model)."""
    if _depth > _MAX_DEPTH:
        return False
    t = type(tree)
    if t in (list, tuple) or (isinstance(tree, tuple) and hasattr(t, "_fields")):
        return any(holds_user_instances(v, _depth + 1) for v in tree)
    if t is dict:
        return any(holds_user_instances(v, _depth + 1) for v in tree.values())
    if isinstance(tree, type):
        return False
    if is_user_module(getattr(t, "__module__", "") or ""):
        return True
    # A library's record holding one (a user layer in `eqx.nn.Sequential`), as `live_value` re-binds it.
    return dataclasses.is_dataclass(tree) and any(
        holds_user_instances(getattr(tree, f.name, None), _depth + 1) for f in dataclasses.fields(tree))


class Retreed:
    """A compiled program whose arguments hold instances of user classes, callable with instances of a
    redefined class of equal structure.

    The key holds a class by name and field structure, not by identity: re-running an Equinox model's
    cell, or editing a method the program never runs, changes no program. JAX checks the class object,
    though; so arguments whose tree differs only by that are re-treed into the compiled structure, and
    the results re-bound to the live classes (`live_value`), so the handle's state stays live.
    """

    __slots__ = ("compiled",)

    def __init__(self, compiled):
        self.compiled = compiled

    def __call__(self, *args):
        try:
            return self.compiled(*args)
        except TypeError as err:
            if "pytree" not in str(err):
                raise
        leaves = jax.tree_util.tree_leaves((args, {}))
        in_tree = self.compiled.in_tree
        if in_tree.num_leaves != len(leaves):
            raise NitroValueError(
                f"the arguments no longer fit this compiled program ({len(leaves)} arrays, the program takes "
                f"{in_tree.num_leaves}); rebuild the handle: `n = n.rebuild()`."
            )
        args, kwargs = jax.tree_util.tree_unflatten(in_tree, leaves)
        return live_value(self.compiled(*args, **kwargs))

    def __getattr__(self, name):
        return getattr(self.compiled, name)  # `in_avals`, `out_avals`, ... of the compiled program
