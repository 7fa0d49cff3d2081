"""The JAX configuration a program was traced under: the `context` component of every key.

A program traced with `jax_enable_x64` off computes float32 where the same code under x64 computes
float64; one traced without `jax_numpy_rank_promotion="raise"` adds a (2, 3) and a (3,) where JAX would
refuse. So a configuration change is an edit too: every key carries the configuration, and a program
compiled under another one is never served (nor loaded from the store: the key's repr names the file).

What goes in is what JAX's own jit caches key on, read from the same place: its trace context
(`jax._src.config.trace_context()`, one tuple of every setting that changes what a trace produces), not a
list kept here that a new JAX release would leave behind. Two settings are added that the trace context
leaves out because they change no trace: `jax_debug_nans` and `jax_debug_infs`. A program compiled under
them keeps its Python function so that a NaN in its outputs is re-run de-optimized and raises JAX's own
`FloatingPointError` naming the primitive, as `jax.jit` does (`_compile.Deoptimizing`); it is compiled
without donation (as `jax.jit` does under them) and not stored.

Cost: `current()` is called for every key made (each epoch's first step, each adoption of a
`nitro_ipy.jit` program). JAX's trace context is one C call; the same configuration as the last call
returns the same `Context` after one tuple comparison (its entries are the same objects: identity
decides), about 1 us. A new configuration is rendered once and memoized.
"""

import enum

from .._base import _memo
from .._base._compat import DEBUG_INFS, DEBUG_NANS, trace_context, trace_context_names

DEBUG_NAMES = ("jax_debug_nans", "jax_debug_infs")


# Values a setting holds when it is off: such an entry is left out of the key's text. A library imported
# later can register settings of its own (importing Flax registers two of Pallas's, at their defaults), so
# two processes under the same configuration hold contexts of different lengths: left out when off, their
# keys (and the store's file names) stay equal. An entry that is off and one never registered both mean
# the feature is not in use, for a trace alike; a setting turned on (or off from a default that is on)
# still moves the key.
_OFF = ("None", "False", "0", "()", "''")


class Context:
    """A configuration as a key component: `pairs` is `((setting, repr of its value), ...)`, every entry
    of JAX's trace context in JAX's order, then the two debug settings. Equal when the texts are equal:
    the texts name every entry that is not off (`_OFF`), so two processes under the same configuration
    (and JAX version) make equal contexts, and equal reprs, whatever else each imported."""

    __slots__ = ("pairs", "text", "storable", "debug", "_hash")

    def __init__(self, pairs: tuple, storable: bool):
        self.pairs = pairs
        self.text = "{" + ", ".join(f"{name}: {value}" for name, value in sorted(pairs) if value not in _OFF) + "}"
        self.storable = storable  # every value has a text that means the same in another process
        values = dict(pairs)
        self.debug = any(values.get(n) == "True" for n in DEBUG_NAMES)
        if self.debug:
            self.storable = False  # its programs hold their Python function (`_compile.Deoptimizing`)
        self._hash = hash(self.text)

    def __eq__(self, other):
        return self is other or (type(other) is Context and self.text == other.text)

    def __hash__(self):
        return self._hash

    def __repr__(self):
        return self.text

    def __reduce__(self):
        return (Context, (self.pairs, self.storable))


_last: tuple = (None, None, None, None)  # (JAX's trace context, debug_nans, debug_infs, Context)
_contexts = _memo.Memo("context.contexts", 64)  # (trace context, nans, infs) -> Context


def current() -> Context:
    """The configuration of the calling thread now (thread-local settings such as `jax.enable_x64(True)`
    included), as a key component."""
    global _last
    raw, nans, infs = trace_context(), DEBUG_NANS.value, DEBUG_INFS.value
    last = _last
    try:
        if nans is last[1] and infs is last[2] and raw == last[0]:
            return last[3]
    except Exception:  # noqa: BLE001 - an entry whose comparison raises: rendered again
        pass
    memo_key = (raw, nans, infs)
    try:
        found = _contexts.get(memo_key)
    except TypeError:  # an unhashable entry
        memo_key, found = None, None
    if found is None:
        found = _render(raw, nans, infs)
        if memo_key is not None:
            _contexts[memo_key] = found
    _last = (raw, nans, infs, found)
    return found


def names() -> tuple:
    """The settings a key carries, in order: JAX's trace context entries (by position where this jaxlib
    does not name them), then `DEBUG_NAMES`."""
    n = len(trace_context())
    if _names[0] != n:
        known = trace_context_names()
        _names[:] = [n, known if known is not None and len(known) == n else tuple(
            f"trace_context[{i}]" for i in range(n))]
    return _names[1] + DEBUG_NAMES


_names: list = [None, ()]  # [length of JAX's trace context, its entries' names]


def _render(raw: tuple, nans, infs) -> Context:
    stable = [True]
    texts = [_text(v, stable) for v in raw] + [repr(bool(nans)), repr(bool(infs))]
    return Context(tuple(zip(names(), texts)), stable[0])


def _text(v, stable: list, depth: int = 0) -> str:
    """A text for `v` that means the same in another process; where there is none (an object known only
    by identity), one that means it in this process, and `stable[0]` is set False."""
    if v is None or isinstance(v, (bool, int, float, str, bytes, enum.Enum)):
        return repr(v)
    if depth > 4:
        stable[0] = False
        return f"<{type(v).__qualname__} at {id(v):#x}>"
    if isinstance(v, (tuple, list)):
        return "(" + ", ".join(_text(x, stable, depth + 1) for x in v) + ")"
    if isinstance(v, (set, frozenset)):
        return "{" + ", ".join(sorted(_text(x, stable, depth + 1) for x in v)) + "}"
    if isinstance(v, dict):
        return "{" + ", ".join(sorted(f"{_text(k, stable, depth + 1)}: {_text(x, stable, depth + 1)}"
                                      for k, x in v.items())) + "}"
    try:  # a mesh: its repr says the axes, not which devices (an abstract mesh has none: it raises)
        ids = getattr(v, "device_ids", None)
    except Exception:  # noqa: BLE001
        ids = None
    try:
        text = repr(v)
    except Exception:  # noqa: BLE001
        text = None
    if text is not None and type(v).__repr__ is not object.__repr__ and " at 0x" not in text:
        if ids is not None:
            try:
                text += f" on devices {[int(i) for i in getattr(ids, 'flat', ids)]}"
            except Exception:  # noqa: BLE001
                pass
        return text
    # An object with no content repr (JAX's `AxisEnv`): its attributes.
    slots = [s for c in type(v).__mro__ for s in getattr(c, "__slots__", ()) if s not in ("__weakref__", "__dict__")]
    attrs = {s: getattr(v, s) for s in slots if hasattr(v, s)}
    attrs.update(getattr(v, "__dict__", {}))
    if not attrs:
        stable[0] = False
        return f"<{type(v).__qualname__} at {id(v):#x}>"
    return type(v).__qualname__ + "(" + ", ".join(f"{k}={_text(x, stable, depth + 1)}" for k, x in sorted(attrs.items())) + ")"


def diff(old: Context, new: Context) -> list[str]:
    """`config `jax_enable_x64`: False -> True` for each setting that differs, in the key's order."""
    if old == new:
        return []
    a, b = dict(getattr(old, "pairs", ())), dict(new.pairs)
    # A setting one side has not registered is off there (`_OFF`): said only where it is on on the other.
    return [f"config `{name}`: {a.get(name, 'None')} -> {b.get(name, 'None')}" for name in [*a, *(n for n in b if n not in a)]
            if a.get(name, "None") != b.get(name, "None") and not (a.get(name, "None") in _OFF and b.get(name, "None") in _OFF)]
