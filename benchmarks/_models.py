"""Shared pieces for the handle benchmarks: MLP models, synthetic data, "notebook cells", the baseline.

The experiment class and the hand-written baseline are both defined by *executing cell source* into a
module registered in `sys.modules`, the way a notebook cell defines them in `__main__`. An edit is the
same cell re-run with a different loss body, so both sides see exactly the same code change:

- nitro: the class is re-defined in its namespace (live dispatch) or a module-level helper is
  re-defined, then `nitro_ipy.bump_world()` and `n.rebuild()`;
- baseline: the cell defining `@jax.jit def step(...)` runs again, which makes a NEW `jax.jit` object
  (a full trace + XLA compile on its first call), exactly what a JAX user gets today.
"""

import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
from _harness import recorder_mode

CELL_MODULE = "nitro_bench_cells"  # stands in for a notebook's `__main__`


# ---------------------------------------------------------------------------------------------- setup
def recording_mode() -> str:
    """How dependency closures are recorded on this Python (the report says which)."""
    return {"monitoring": "sys.monitoring", "traceback": "jaxpr tracebacks", "profile": "sys.setprofile"}[
        recorder_mode()]


# ---------------------------------------------------------------------------------------------- model
def init_mlp(rng, in_dim: int, width: int, depth: int, out_dim: int = 1):
    """`depth` hidden tanh layers of `width`, then a linear head: `2 * (depth + 1)` arrays."""
    sizes = [in_dim] + [width] * depth + [out_dim]
    keys = jax.random.split(rng, len(sizes) - 1)
    params = []
    for k, (a, b) in zip(keys, zip(sizes[:-1], sizes[1:])):
        params.append({"w": jax.random.normal(k, (a, b), jnp.float32) / np.sqrt(a), "b": jnp.zeros((b,), jnp.float32)})
    return params


def mlp_forward(params, x):
    h = x
    for layer in params[:-1]:
        h = jnp.tanh(h @ layer["w"] + layer["b"])
    return (h @ params[-1]["w"] + params[-1]["b"])[:, 0]


def make_data(n: int, in_dim: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, in_dim)).astype(np.float32)
    w = rng.standard_normal((in_dim,)).astype(np.float32) / np.sqrt(in_dim)
    y = (np.sin(x @ w) + 0.1 * rng.standard_normal(n)).astype(np.float32)
    return {"x": x, "y": y}


BASE_LOSS = "jnp.mean((outputs - y) ** 2)"


def edited_loss(k: int) -> str:
    """The k-th edit of the loss: different code and a different constant each time (a new graph for
    XLA too, so no layer of any cache can serve an old program)."""
    return f"jnp.mean((outputs - y) ** 2) + {1e-3 * (k + 1)!r} * jnp.mean(jnp.abs(outputs))"


# ---------------------------------------------------------------------------------------------- cells
EXPERIMENT_CELL = '''
import dataclasses
import jax, jax.numpy as jnp, optax
from nitro_ipy import GraphConst
from _nitro_bench_models import init_mlp, mlp_forward

def loss_term(outputs, y):
    return {helper_expr}

@dataclasses.dataclass
class {name}:
    in_dim: GraphConst[int] = {in_dim}
    width: GraphConst[int] = {width}
    depth: GraphConst[int] = {depth}

    def init(self, rng):
        return init_mlp(rng, self.in_dim, self.width, self.depth)

    def forward(self, params, *, x):
        return mlp_forward(params, x)

    def loss(self, outputs, *, y):
        return {loss_expr}
'''

HELPER_CELL = '''
def loss_term(outputs, y):
    return {helper_expr}
'''

BASELINE_CELL = '''
import functools
import jax, jax.numpy as jnp, optax
from _nitro_bench_models import mlp_forward

opt = optax.adam(1e-3)

def loss_fn(outputs, y):
    return {loss_expr}

{decorator}
def step(params, opt_state, x, y):
    def objective(p):
        return loss_fn(mlp_forward(p, x), y)
    loss, grads = jax.value_and_grad(objective)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
'''


class Cells:
    """A module standing in for a notebook's namespace; `run(src)` is running a cell."""

    def __init__(self, name: str = CELL_MODULE):
        sys.modules.setdefault("_nitro_bench_models", sys.modules[__name__])
        self.module = types.ModuleType(name)
        sys.modules[name] = self.module
        self.count = 0

    def run(self, src: str) -> dict:
        self.count += 1
        # an IPython cell filename: user code to the dependency recorder (`<string>` would count as library)
        code = compile(src, f"<ipython-input-{self.count}-{self.module.__name__}>", "exec")
        exec(code, self.module.__dict__)
        return self.module.__dict__

    def define_experiment(self, name: str, *, in_dim: int, width: int, depth: int,
                          loss_expr: str = BASE_LOSS, helper_expr: str = BASE_LOSS):
        ns = self.run(EXPERIMENT_CELL.format(name=name, in_dim=in_dim, width=width, depth=depth,
                                             loss_expr=loss_expr, helper_expr=helper_expr))
        return ns[name]

    def redefine_helper(self, helper_expr: str):
        self.run(HELPER_CELL.format(helper_expr=helper_expr))

    def define_baseline(self, loss_expr: str = BASE_LOSS, donate: bool = False, compiler_options=None):
        """Run the user's training cell: returns the (new) jitted fused `step` and its optimizer.
        `donate=True` is the careful user's `jax.jit(step, donate_argnums=(0, 1))` (params, opt state);
        `compiler_options` go to `jax.jit` as they are."""
        kw = (["donate_argnums=(0, 1)"] if donate else []) + (
            [f"compiler_options={compiler_options!r}"] if compiler_options else [])
        decorator = f"@functools.partial(jax.jit, {', '.join(kw)})" if kw else "@jax.jit"
        ns = self.run(BASELINE_CELL.format(loss_expr=loss_expr, decorator=decorator))
        return ns["step"], ns["opt"]


# ---------------------------------------------------------------------------------------------- baseline
class Baseline:
    """The hand-written loop: host numpy slicing of a per-epoch permutation, one fused jitted step."""

    def __init__(self, step, opt, params, data: dict, batch_size: int, seed: int = 0):
        self.step, self.opt = step, opt
        self.params = params
        self.opt_state = opt.init(params)
        self.x, self.y = data["x"], data["y"]
        self.batch_size, self.seed, self.epoch = batch_size, seed, 0

    @property
    def steps(self) -> int:
        return len(self.x) // self.batch_size

    def run_epoch(self) -> float:
        n, bs = len(self.x), self.batch_size
        perm = np.random.default_rng((self.seed, self.epoch)).permutation(n)
        step, params, opt_state, X, Y = self.step, self.params, self.opt_state, self.x, self.y
        losses = []
        for s in range(n // bs):
            idx = perm[s * bs : (s + 1) * bs]
            params, opt_state, loss = step(params, opt_state, X[idx], Y[idx])
            losses.append(loss)
        jax.block_until_ready((params, opt_state))
        self.params, self.opt_state = params, opt_state
        self.epoch += 1
        return float(np.mean(jax.device_get(losses)))


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def count_arrays(params) -> int:
    return len(jax.tree.leaves(params))
