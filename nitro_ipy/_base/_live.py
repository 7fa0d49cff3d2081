"""The live code: a class, a function or a value as its name gives it *now*, after a notebook user
re-ran a cell or reloaded a module.

Instances of a redefined user class are re-made as instances of the live class (same attributes), user
functions re-resolved by qualified name; everything else is kept as it is (identity too, so fingerprints and
snapshots of the unchanged stay valid). The handle's rebuild, the carried training state and compiled
programs whose arguments hold user instances all ask here.
"""

from __future__ import annotations

import dataclasses
import functools
import types

from ._origin import class_namespace, is_user_function, is_user_module

_MAX_DEPTH = 64  # nesting bound: a cycle in a user's object graph is not followed forever


def live_class(cls):
    """The class as it is *now* in its namespace (module + qualified name), or `cls` if it is gone."""
    parts = cls.__qualname__.split(".")
    if "<locals>" in parts:
        return cls
    obj = (class_namespace(cls) or {}).get(parts[0])
    for part in parts[1:]:
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) else cls


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
        return live_callable(value)
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


def live_callable(fn):
    """The callable `fn` names now: a user function re-resolved by its qualified name in its module (a
    partial's function likewise); anything else as it is."""
    if isinstance(fn, functools.partial):
        func = live_callable(fn.func)
        return fn if func is fn.func else functools.partial(func, *fn.args, **fn.keywords)
    if not is_user_function(fn) or "<" in fn.__qualname__:
        return fn  # a lambda or a nested function has no name to find it again by
    head, *rest = fn.__qualname__.split(".")
    obj = fn.__globals__.get(head)
    for part in rest:
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, types.FunctionType) else fn


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
