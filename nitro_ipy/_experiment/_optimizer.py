"""The optimizer at setup: refused where it would mean something else on the flat layout, or where a
Device field reaches a constructor that needs a Python number; then its initial state.

Both checks run before anything compiles, so the user sees the fix, not a trace.
"""

import collections
import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._base._errors import NitroTypeError, NitroValueError
from ._checks import check_optimizer
from ._groups import leaf_groups, substituted
from ._layout import FlatLayout, TreeLayout

FLAT_PATHS = (
    "the optimizer of `{owner}` computes something else depending on the parameters' paths (its update "
    "traced on the params tree and on the same arrays without their paths gives different programs), "
    "beyond the masks and labels nitro_ipy lays out as parameter groups (`optax.masked`, a weight-decay "
    "`mask=`, `multi_transform` / `partition` labels, `transforms.freeze`). Express the choice as one "
    "of those, or pass `Nitro(e, ..., flat_params=False)` so it sees the params tree."
)

FLAT_SHAPES = (
    "the optimizer of `{owner}` treats each parameter array by its own shape or norm ({why}: as "
    "`adafactor`, `lamb`, `lars` or a per-parameter clip do), but `flat_params=True` hands it one flat "
    "buffer per dtype, where it would compute something else. Pass `Nitro(e, ..., flat_params=False)` so "
    "it sees the params tree."
)

# Said after FLAT_SHAPES when the refusal comes from `rebuild()`: its optimizer state is the
# flat layout's, so the switch to the tree layout starts a new handle from the trained parameters.
AT_REBUILD = (
    " `rebuild()` carries the optimizer state of the flat layout; to change the layout, start a handle "
    "from the trained parameters: `Nitro(e, ..., flat_params=False, params=n.params{state})` (the "
    "optimizer state starts afresh)."
)

EXTRA_ARGUMENT = (
    "the optimizer of `{owner}` needs `{name}=` in its `update` (an optax transformation taking extra "
    "arguments, such as a line search's `value_fn`); the optimizer program passes only `value=`, the "
    "step's loss (enough for `reduce_on_plateau` and `polyak_sgd`). Pick a transformation that needs no "
    "more, or drive the step yourself with `optax` outside nitro_ipy."
)
_MISSING_ARGUMENT = re.compile(r"missing \d+ required keyword-only arguments?: '(\w+)'")

DEVICE_IN_CONSTRUCTOR = (
    "the optimizer of `{owner}` passes the Device field {fields} to something that needs a Python number "
    "at construction (an optax schedule constructor such as `warmup_cosine_decay_schedule` compares its "
    "arguments in Python), and a Device field is a traced array there ({error}). Either mark it "
    "`GraphConst[float]` (baked in; a new value recompiles the optimizer), or keep it Device and "
    "drive it per step with `Nitro(e, schedules={{{first!r}: fn}})` instead of an optax schedule."
)

GROUPS_CHANGED = (
    "the optimizer of `{owner}` now groups the parameters differently (its masks or labels moved), and "
    "`rebuild()` carries optimizer state laid out by the old groups. Start a handle from the trained "
    "parameters: `Nitro(e, ..., params=n.params{state})` (the optimizer state starts afresh)."
)


def make_layout(flat: bool, b, trainable, dev: dict, paths=None):
    """The handle's layout over `trainable`: `TreeLayout`, or `FlatLayout` grouped by the masks and labels
    of the experiment's optimizer (built with the Device values `dev`)."""
    if not flat:
        return TreeLayout(trainable)
    tx = b.optimizer(b.view(dev))
    cells, labels = leaf_groups(b.cls.__qualname__, tx, trainable, paths)
    return FlatLayout(trainable, labels, cells)


# Primitives that act on each element alone (or pass a value through): an optimizer built of these, full
# reductions over every parameter at once (a global norm) and scalars means the same on flat buffers.
_ELEMENTWISE = frozenset("""
    abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type copy cos
    cosh div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow is_finite le lgamma digamma log
    log1p logistic lt max min mul ne neg nextafter not or pow real reduce_precision rem round rsqrt select_n
    sign sin sinh sqrt square stop_gradient sub tan tanh xor shift_left shift_right_logical
    shift_right_arithmetic population_count optimization_barrier
""".split())
_ORDER_KEEPING = frozenset("reshape squeeze expand_dims".split())
_FULL_REDUCTIONS = frozenset("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin".split())


def path_dependent(tx, trainable, layout) -> bool:
    """Whether `tx` decides by the parameters' paths anything that is not one of the masks and labels
    the layout groups by (a hand-written transformation reading `tree_map_with_path`, say), which the
    flat buffers could not mean: its update is traced (nothing compiles) on the params tree and on the
    same arrays as a plain list, its masks and labels given as the same per-array values in both, and
    the two programs compared."""
    leaves, treedef = jax.tree_util.tree_flatten(trainable)
    if len(leaves) < 2:
        return False
    per_leaf = ([layout.values[g] for i in range(len(leaves)) for g, idx in layout.groups.items() if i in idx]
                if layout.grouped else None)

    def given(unflatten):  # `tx`, its masks and labels as their per-array values in `unflatten`'s container
        return tx if per_leaf is None else substituted(
            tx, [unflatten([v[k] for v in per_leaf]) for k in range(len(layout.cells))])

    if library_only(given(list)):
        return False  # optax's own transformations read paths through their masks and labels alone
    avals = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in leaves]
    value = jnp.zeros((), jnp.float32)

    def program(unflatten):
        seen, tree = given(unflatten), unflatten(avals)
        fn = lambda g, p: seen.update(g, seen.init(p), p, **update_args(seen, value))[0]  # noqa: E731
        return str(jax.make_jaxpr(fn)(tree, tree))

    on_tree = program(treedef.unflatten)
    try:
        return program(list) != on_tree
    except Exception:  # noqa: BLE001 - it needs the paths to run at all (`path[-1].key` on a list)
        return True


_LIBRARIES = frozenset({"optax", "jax", "jaxlib", "numpy", "chex", "nitro_ipy", "functools", "builtins"})
_PLAIN = (type(None), bool, int, float, complex, str, bytes, np.ndarray, np.generic, np.dtype, jax.Array)


def _library(obj) -> bool:
    return (getattr(obj, "__module__", None) or "").split(".")[0] in _LIBRARIES


def library_only(tx) -> bool:
    """Whether every function `tx` can reach (through closures, defaults, partials, methods, containers,
    the attributes of library objects and what a jitted function wraps) is optax's, JAX's, NumPy's or
    nitro_ipy's own, its masks and labels given as values. Then nothing in it decides by a parameter's
    path but those masks and labels (optax reads paths only there), and `path_dependent` need not trace
    the update twice over every parameter array: 0.5 s a handle at 242 arrays, paid at every kernel
    restart. Anything else (a function of yours, an object of another library) says False: checked."""
    stack, seen = [tx], set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _PLAIN):
            continue
        seen.add(id(obj))
        wrapped = getattr(obj, "__wrapped__", None) if not isinstance(obj, type) else None
        if wrapped is not None:
            stack.append(wrapped)
        if isinstance(obj, types.FunctionType):
            if not _library(obj):
                return False
            for cell in obj.__closure__ or ():
                try:
                    stack.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    pass
            stack.extend(obj.__defaults__ or ())
            stack.extend((obj.__kwdefaults__ or {}).values())
        elif isinstance(obj, functools.partial):
            stack.extend([obj.func, *obj.args, *obj.keywords.values()])
        elif isinstance(obj, types.MethodType):
            stack.extend([obj.__func__, obj.__self__])
        elif isinstance(obj, (tuple, list, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, type) or isinstance(obj, types.BuiltinFunctionType) or not _library(type(obj)):
            if not _library(obj):
                return False
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return True


def shape_dependence(tx, trainable, layout=None) -> str | None:
    """Why `tx` would compute something else on the flat layout than on the params tree, or None.

    `tx.update` is traced (no compile) on the tree of one leaf per distinct shape, dtype and parameter
    group (two at least of a group of several), its masks and labels re-expressed on that tree, and the
    jaxpr is followed from the gradients and params to the updates. It means the same on one flat buffer
    per group when every update element depends on its own gradient and param elements, on reductions
    over whole groups (a global norm, over every parameter or over those a mask selects), and on nothing
    else of theirs: an update that reads a reduction over its own array alone (`lamb`'s trust ratio,
    `adafactor`'s clip), a reduction along some axes (`adafactor`'s factored moments) or a matrix product
    does not."""
    leaves = jax.tree_util.tree_leaves(trainable)
    if not leaves:
        return None
    grouped = layout is not None and layout.grouped
    group_of = ({i: g for g, idx in layout.groups.items() for i in idx} if grouped
                else {i: str(leaf.dtype) for i, leaf in enumerate(leaves)})
    sample, groups, firsts, seen = [], [], [], set()
    for i, leaf in enumerate(leaves):
        sig = (tuple(leaf.shape), str(leaf.dtype), group_of[i])
        if sig not in seen:
            seen.add(sig)
            sample.append(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
            groups.append(group_of[i])
            firsts.append(i)
    sizes = collections.Counter(group_of.values())
    for j in range(len(sample)):  # a group of several arrays gets two: a reduction over one array shows
        if sizes[groups[j]] > 1 and groups.count(groups[j]) == 1:
            sample.append(sample[j])
            groups.append(groups[j])
            firsts.append(firsts[j])
    if grouped:
        trees = [[layout.values[g][k] for g in groups] for k in range(len(layout.cells))]
        tx = substituted(tx, trees)
    value = jnp.zeros((), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda g, p: tx.update(g, tx.init(p), p, **update_args(tx, value))[0])(sample, sample).jaxpr
    k = len(sample)
    # each input (the gradients, then the params, leaf by leaf) depends element by element on its own leaf
    try:
        outs = _follow(jaxpr, [(frozenset([i % k]), frozenset()) for i in range(len(jaxpr.invars))])
    except _ShapeDependent as err:
        return str(err)
    members = [frozenset(j for j in range(k) if groups[j] == g) for g in dict.fromkeys(groups)]
    for i, (elem, reduced) in enumerate(outs):
        if elem - {i}:
            return "an update reads another array's elements"
        if any(reduced & m and not m <= reduced for m in members):
            return "an update reads a reduction over its own array"
    return None


_NONE = (frozenset(), frozenset())


class _ShapeDependent(Exception):
    pass


_CALLS = frozenset("jit pjit closed_call core_call custom_jvp_call custom_vjp_call custom_vjp_call_jaxpr remat "
                   "checkpoint cond".split())


def _sub_jaxprs(eqn) -> list:
    """The jaxprs an equation calls (a `jit`'s, each branch of a `cond`)."""
    subs = [p for p in eqn.params.values() if hasattr(p, "jaxpr") or hasattr(p, "eqns")]
    return subs + [b for p in eqn.params.values() if isinstance(p, tuple) for b in p if hasattr(b, "jaxpr")]


def _full_contraction(eqn) -> bool:
    """A `dot_general` contracting every axis of both operands (`jnp.vdot` of two arrays of one shape)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval
    return not lb and not rb and len(lc) == lhs.ndim and len(rc) == rhs.ndim and lhs.shape == rhs.shape


def _follow(jaxpr, in_tags: list) -> list:
    """The tags of `jaxpr`'s outputs given its inputs' (see `shape_dependence`); raises `_ShapeDependent`
    naming the first primitive that treats a parameter's elements by their place in its array."""
    tags = dict(zip(jaxpr.invars, in_tags))
    get = lambda v: tags.get(v, _NONE) if not hasattr(v, "val") else _NONE  # noqa: E731 - a literal is _NONE
    for eqn in jaxpr.eqns:
        ins = [get(v) for v in eqn.invars]
        elem = frozenset().union(*(t[0] for t in ins))
        reduced = frozenset().union(*(t[1] for t in ins))
        name = eqn.primitive.name
        if not elem:
            out = [(frozenset(), reduced)] * len(eqn.outvars)  # nothing of a parameter's elements: no layout
        elif name in _ELEMENTWISE or name in _ORDER_KEEPING or (
                name == "broadcast_in_dim" and all(getattr(v.aval, "size", 2) == 1 for v in eqn.invars[:1])):
            # (A reshape keeps the elements' row-major order, which the flat buffer has too: what comes
            # after it along some axes is judged where it happens.)
            out = [(elem, reduced)] * len(eqn.outvars)
        elif name == "dot_general" and _full_contraction(eqn):  # a `vdot`: a full reduction of a product
            out = [(frozenset(), elem | reduced)] * len(eqn.outvars)
        elif name in _FULL_REDUCTIONS:
            operand = eqn.invars[0].aval
            if len(eqn.params.get("axes", ())) != operand.ndim and operand.size != 1:
                raise _ShapeDependent(f"`{name}` along some axes of a parameter")
            out = [(frozenset(), elem | reduced)] * len(eqn.outvars)
        elif name in _CALLS and (subs := _sub_jaxprs(eqn)):
            out = None
            for sub in subs:
                inner = sub.jaxpr if hasattr(sub, "jaxpr") else sub
                n_in = len(inner.invars)
                got = _follow(inner, ins[len(ins) - n_in:])
                out = got if out is None else [(a[0] | b[0], a[1] | b[1]) for a, b in zip(out, got)]
            if name == "cond":  # the branch taken hangs on the predicate
                out = [(e, r | ins[0][0] | ins[0][1]) for e, r in out]
        else:
            raise _ShapeDependent(f"`{name}` on a parameter")
        for v, t in zip(eqn.outvars, out):
            tags[v] = t
    return [get(v) for v in jaxpr.outvars]


def _concretization_errors() -> tuple:
    return tuple(e for e in (getattr(jax.errors, "TracerBoolConversionError", None),
                             getattr(jax.errors, "ConcretizationTypeError", None),
                             getattr(jax.errors, "TracerIntegerConversionError", None)) if e is not None)


def _trace(b, layout, flat, dev: dict, concrete: str | None = None):
    """Build the optimizer with `dev` traced (but field `concrete`) and run init + one update abstractly."""
    # numpy, not a device array: a device array would be staged into the trace, and traced again
    fixed = {} if concrete is None else {concrete: np.asarray(dev[concrete])}

    def run(traced):
        tx = layout.adapt(b.optimizer(b.view({**traced, **fixed})))
        seen = layout.for_tx(flat)
        state = tx.init(seen)
        return tx.update(seen, state, seen, **update_args(tx, jnp.zeros((), jnp.float32)))

    jax.eval_shape(run, {k: v for k, v in dev.items() if k != concrete})


def update_args(tx, loss) -> dict:
    """The keyword arguments the optimizer program passes to `tx.update` besides updates, state and
    params: the step's loss as `value=`, for a transformation that takes extra arguments (optax's
    `reduce_on_plateau`, `polyak_sgd`; `optax.chain` hands each member what it accepts)."""
    return {"value": loss} if isinstance(tx, optax.GradientTransformationExtraArgs) else {}


def init_optimizer(b, layout, trainable, dev: dict):
    """The optimizer's initial state over `layout.ravel(trainable)`, after the setup checks
    (`check_setup`: the arguments are the same)."""
    tx, flat = check_setup(b, layout, trainable, dev)
    return tx.init(layout.for_tx(flat))


def check_setup(b, layout, trainable, dev: dict):
    """Check the experiment's optimizer for a handle, by tracing its `init` and one `update` abstractly
    (nothing compiles): at setup, and at a rebuild whose optimizer may have moved.

    **Arguments:**
    - `b`: the handle's `Binding`; `layout`: `FlatLayout` or `TreeLayout` over `trainable`.
    - `trainable`: the float params the optimizer sees; `dev`: the Device values.

    **Returns:** `(tx, flat params)`, `tx` adapted to the layout (`layout.adapt`). Raises
    `NitroValueError` for an optimizer that looks at each array's shape on the flat layout, and `NitroTypeError` for a Device field a constructor
    needs as a Python number or a transformation that needs more extra arguments than `value=`.
    """
    owner = b.cls.__qualname__
    flat = layout.ravel(trainable)
    tx = b.optimizer(b.view(dev))
    check_optimizer(b.cls, tx)
    flat_layout = layout.signature[0] == "flat"
    errors = _concretization_errors()
    try:
        _trace(b, layout, flat, dev)  # init and one update, abstractly: nothing compiles
    except errors as err:
        if not dev:
            raise
        culprits = []
        for name in dev:  # the fields whose concrete value makes the trace succeed
            try:
                _trace(b, layout, flat, dev, concrete=name)
            except errors:
                continue
            culprits.append(name)
        culprits = culprits or list(dev)
        first = str(err).strip().splitlines()[0]
        raise NitroTypeError(DEVICE_IN_CONSTRUCTOR.format(
            owner=owner, fields=", ".join(f"`{c}`" for c in culprits), first=culprits[0],
            error=f"{type(err).__name__}: {first[:160]}")) from None
    except TypeError as err:
        missing = _MISSING_ARGUMENT.search(str(err))
        if missing is None or missing.group(1) in ("updates", "state", "params", "value"):
            raise
        raise NitroTypeError(EXTRA_ARGUMENT.format(owner=owner, name=missing.group(1))) from None
    if flat_layout:  # after the trace: a transformation wanting more than `value=` is said first
        if path_dependent(tx, trainable, layout):
            raise NitroValueError(FLAT_PATHS.format(owner=owner))
        why = shape_dependence(tx, trainable, layout)
        if why is not None:
            raise NitroValueError(FLAT_SHAPES.format(owner=owner, why=why))
    return layout.adapt(tx), flat
