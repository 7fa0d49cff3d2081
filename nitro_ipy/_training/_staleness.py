"""Whether a handle is stale, and what its rebuild re-binds: decided here, in one place.

- `stale(handle)`: the programs the handle runs that an edit poisoned, and its schedules whose name holds
  other code now. The entry points (`train`, `validate`, `evaluate`, `predict`) say the stale-handle line
  from it, `repr(n)` shows it, `rebuild()` asks it whether the optimizer may differ, and compile ahead
  (`_ahead`) compiles replacements only for a stale handle's programs.
- `rebind(handle)` / `rebound_model(handle, b)`: the binding and the `Model` a `rebuild()` of `handle`
  builds its programs with (hooks through the live class; the parameter tree's user classes re-bound to
  the live code). `Nitro._setup` builds its `Model` through `model_for`, the same rule.
"""

import dataclasses

from .._base._live import live_value
from .._compiler import _cache
from .._experiment._binding import bind
from .._experiment._model import Model, ParamSplit
from .._experiment._optimizer import make_layout


@dataclasses.dataclass(frozen=True)
class Staleness:
    """What makes a handle stale: `programs` (the poisoned entries it runs), `schedules` (its
    schedules redefined since it was built) and `graphconst` (its GraphConst fields changed in place
    since, `Binding.graphconst_moved`). Falsy when it is current."""

    programs: tuple = ()
    schedules: tuple = ()
    graphconst: tuple = ()

    def __bool__(self) -> bool:
        return bool(self.programs or self.schedules or self.graphconst)

    def kinds(self) -> tuple:
        return tuple(e.kind for e in self.programs)


def stale(handle, scan: bool = True) -> Staleness:
    """`handle`'s staleness now. `scan` (the default) re-resolves the cache's closures first when the
    world moved (one integer comparison when it did not)."""
    if scan:
        _cache.ensure_fresh()
    programs = tuple(e for e in handle._programs.values() if e.poisoned)
    b = handle._state.binding
    # A GraphConst value mutated in place moves no world counter: fingerprinted at each ask (microseconds
    # for the ints and tuples GraphConst fields hold), and only once the handle has programs to run stale.
    moved = b.graphconst_moved() if handle._programs and b.graphconst.values else ()
    return Staleness(programs, b.edited_schedules() if b.schedules else (), moved)


def rebind(handle):
    """The `Binding` a `rebuild()` of `handle` binds: its experiment through its live class, the
    splits and schedules it has. Raises what the rebuild would raise."""
    return bind(handle.experiment, handle._state.binding.splits, handle._options["schedules"])


def model_for(split: ParamSplit, layout, b) -> Model:
    """The `Model` programs of binding `b` are built with, for parameters split by `split` whose trainable
    arrays `layout` lays out (`FlatLayout` by the optimizer's groups, or `TreeLayout`)."""
    return Model(split, layout, b.has_state, b.reserved)


def rebound_model(handle, b) -> Model:
    """The `Model` a rebuild of `handle` builds its programs with, against binding `b`: the parameter
    tree's user classes re-bound to the live code (an Equinox model's, after its cell re-ran), split and
    laid out again (the flat layout's groups are the live optimizer's masks and labels, which an edit may
    move), and `b`'s hooks' reserved parameters. `handle._state.model` itself when none of it moved."""
    old = handle._state.model
    params = old.split.combine(handle._state.params)
    live = live_value(params)
    split = old.split if live is params else ParamSplit(live)
    try:
        layout = make_layout(old.layout.signature[0] == "flat", b, split.trainable(split.dynamic(live)),
                             handle._state.dev, split.trainable_paths())
    except Exception:  # noqa: BLE001 - a mask the rebuild will refuse, with its message, in the foreground
        layout = old.layout
    if (live is params and old.has_state == b.has_state and old.reserved == b.reserved
            and layout.signature == old.layout.signature):
        return old
    return model_for(split, layout, b)
