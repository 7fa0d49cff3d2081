"""A hook that fails on what it was given, said in the user's words; a loss that broadcasts its outputs
against its targets, warned about.

Bad input shows itself while a program traces `forward` or `loss` (the gradient program at the first
step, evaluation at the first validation, predict at the first `predict`): JAX raises from deep inside
the user's expression (`dot_general requires contracting dimensions to have the same shape`) with a
traceback through JAX and nitro_ipy. The first trace's failure is re-explained here rather than a trace
added before it: a `jax.eval_shape` of the hooks at setup would trace them once more at every handle
(the rebuild after an edit included), for a message the real trace can give at no cost when it fails.
`HookInputError` names the hook, the fields that arrived (shapes and dtypes), the parameters' shapes,
the user's line that raised, JAX's words, and the fix; in IPython its traceback is cut to the user's
frames (`_render_traceback_`), in a script to the entry point's call (`user_traceback`, 15 lines in all
against 45-75).

`broadcast_warning`: a loss whose outputs and a target have different ranks and broadcast to a shape
larger than both (`y` (64, 1) against outputs (64,) -> (64, 64)) trains on every pair of examples; the
loss is traced once more on shapes only (just in that case) to see that it does form that shape.
"""

import functools
import linecache
import traceback
import warnings

import jax
import numpy as np

from .._base._errors import HookInputError, NitroError, NitroWarning
from .._base._origin import is_user_file

# What a hook raises when its arguments have the wrong shape or kind (jnp's shape errors are TypeError,
# ValueError or IndexError); JAX's own errors about Python control flow on traced values are not about
# the input, and keep their words.
_EXPLAINED = (TypeError, ValueError, IndexError)
_NOT_INPUT = (NitroError, jax.errors.JAXTypeError, jax.errors.JAXIndexError)
_SHOWN_PARAMS = 6


def aval(x) -> str:
    """`float32[16,3]` for an array or a traced value; the type's name otherwise."""
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        return type(x).__name__ if x is not None else "None"
    return f"{np.dtype(dtype).name}[{','.join(str(d) for d in shape)}]"


def tree_avals(tree, root: str, limit: int = _SHOWN_PARAMS) -> str:
    """`params['w1'] float32[4,4], params['w2'] float32[4]`, the first `limit` leaves of `tree`."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    shown = [f"{root}{jax.tree_util.keystr(path)} {aval(leaf)}" for path, leaf in leaves[:limit]]
    more = f", ... ({len(leaves) - limit} more)" if len(leaves) > limit else ""
    return (", ".join(shown) + more) if shown else f"{root}: no arrays"


def _outputs(outputs) -> str:
    if isinstance(outputs, (tuple, list)):
        return f"a {type(outputs).__name__} of {len(outputs)}: ({', '.join(aval(o) for o in outputs)})"
    if isinstance(outputs, dict):
        return "a dict: " + tree_avals(outputs, "outputs")
    return aval(outputs)


def user_frames(err: BaseException) -> list:
    """The frames of `err`'s traceback that run the user's code (cells and the user's files)."""
    return [f for f in traceback.extract_tb(err.__traceback__) if is_user_file(f.filename)]


def explain(err: BaseException, hook: str, given: dict, params=None, outputs=None) -> HookInputError | None:
    """The `HookInputError` for `err`, raised by hook `hook` (`Cls.forward`, `Cls.loss`) at trace time,
    or None when `err` is not one a wrong input raises.

    **Arguments:**
    - `given`: the batch fields the hook got (traced values).
    - `params`: the parameters `forward` got; `outputs`: what `loss` got as `outputs`.
    """
    if not isinstance(err, _EXPLAINED) or isinstance(err, _NOT_INPUT):
        return None
    frames = user_frames(err)
    name = hook.rsplit(".", 1)[-1]
    fields = ", ".join(f"`{k}` {aval(v)}" for k, v in given.items()) or "no fields"
    said = str(err).strip().replace("\n", "\n    ")  # JAX's words, whole
    lines = [f"`{hook}` failed on the batch it was given: {type(err).__name__}: {said}"]
    if frames:
        f = frames[-1]
        code = (f.line or linecache.getline(f.filename, f.lineno)).strip()
        lines.append(f"  at {f.filename}:{f.lineno}: {code}")
    if name == "forward":
        lines.append(f"  arrived: {fields}")
        lines.append(f"  the parameters: {tree_avals(params, 'params')}")
        flat = [k for k, v in given.items() if len(getattr(v, "shape", (0, 0))) == 1]
        fix = ("Fix: give each input field a leading batch axis, then the features `init` sized the "
               "parameters for (or size them in `init` from the data); `n.predict` takes the same fields.")
        if flat:
            fix = (f"Fix: `{flat[0]}` is 1-D, one number per example: if that is one feature, give the split "
                   f"`{flat[0]}[:, None]` (shape (N, 1)); otherwise give it the features `init` sized the "
                   f"parameters for.")
    else:
        lines.append(f"  outputs (what `forward` returned): {_outputs(outputs)}")
        lines.append(f"  targets: {fields}")
        fix = ("Fix: make `forward`'s outputs and the targets fit (the same shape: reshape the split's target "
               "field, or index the outputs in `loss`).")
        if isinstance(outputs, (tuple, list)):
            fix = (f"Fix: `forward` returned a {type(outputs).__name__} of {len(outputs)}, which `loss` gets "
                   f"whole as `outputs`: return one array from `forward` (or unpack the {type(outputs).__name__} "
                   f"in `loss`); model state is returned only when `forward` declares `*, state`.")
    lines.append(fix)
    return HookInputError("\n".join(lines), frames)


def user_traceback(entry):
    """Entry point `entry` (`Nitro.train`, `predict`, ...) raising a `HookInputError` with a traceback
    that starts at its own call rather than running through nitro_ipy and JAX down to the trace: the
    error's text already names the user's line that raised."""

    @functools.wraps(entry)
    def called(*args, **kwargs):
        try:
            return entry(*args, **kwargs)
        except HookInputError as err:
            # JAX's note that it filtered its frames (the error crossed its tracing) is moot here
            notes = getattr(err, "__notes__", None)
            if notes:
                err.__notes__ = [n for n in notes if "JAX has removed its internal frames" not in n and set(n) != {"-"}]
            raise err.with_traceback(None) from None

    return called


def broadcast_warning(hook: str, loss_of, outputs, targets: dict) -> None:
    """Warn (`NitroWarning`) when `loss_of(outputs, targets)` forms a shape from `outputs` and a target
    field of another rank larger than both (an outer broadcast: (64,) against (64, 1) gives (64, 64)).
    Called at trace time, on traced values; costs a trace of the loss only in that case."""
    if not hasattr(outputs, "shape"):
        return
    for name, y in targets.items():
        shape = getattr(y, "shape", None)
        if shape is None or len(shape) == len(outputs.shape) or not shape or not outputs.shape:
            continue
        try:
            both = np.broadcast_shapes(tuple(outputs.shape), tuple(shape))
        except ValueError:
            continue
        size = int(np.prod(both))
        if size <= max(int(np.prod(outputs.shape)), int(np.prod(shape))):
            continue
        if not _forms(loss_of, outputs, targets, both):
            continue
        fix = (f"`{name}[:, 0]` in the split (or `outputs[:, None]` in `loss`)" if len(shape) > len(outputs.shape)
               else f"`{name}[:, None]` in the split (or `outputs[:, 0]` in `loss`)")
        warnings.warn(
            f"`{hook}` broadcasts outputs {aval(outputs)} against `{name}` {aval(y)} to "
            f"[{','.join(map(str, both))}]: every output is compared with every target, not with its own. "
            f"Fix: give them the same shape: {fix}.", NitroWarning, stacklevel=2)
        return


def _forms(loss_of, outputs, targets: dict, shape: tuple) -> bool:
    """Whether `loss_of` computes a value of `shape` (traced on shapes only)."""
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    try:
        jaxpr = jax.make_jaxpr(loss_of)(spec(outputs), {k: spec(v) for k, v in targets.items()})
    except Exception:  # noqa: BLE001 - the real trace raises it, with its own words
        return False
    return any(tuple(getattr(v.aval, "shape", ())) == shape for eqn in _eqns(jaxpr.jaxpr) for v in eqn.outvars)


def _eqns(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs its equations hold (a `jit` inside the loss)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)
