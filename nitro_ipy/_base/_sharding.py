"""Where arrays live: one device, a mesh of many, or a mesh spanning processes (`jax.distributed`).

A handle asks its `Placement` at a few points: where params, optimizer state, model state and Device
values go at setup (`params`, `opt_state`, `state`, `replicate`), where each batch goes (`batch`,
`batches`), which output shardings a program is compiled with (`out_shardings`), and how a result comes
back to the host (`host`). `SingleDevice` answers "as before" to every question at no cost, so a handle
without a mesh runs exactly the code it ran before meshes existed.

The engine is JAX's own: batches are sharded along the mesh's data axis, the programs are plain `jax.jit`
programs traced at arguments that carry their shardings, and XLA inserts the gradient all-reduce (no pmap,
no hand-written psum). Under `jax.distributed` every process holds the same data and feeds only its own
rows of each global batch (`jax.make_array_from_process_local_data`).

`is_main_process()` is the one rule for "this process prints, shows widgets and writes files".
"""

import contextlib
import functools
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._compat import ambient_mesh, auto_axes, mesh_context
from ._errors import NitroTypeError, NitroValueError


def is_main_process() -> bool:
    """True in process 0 of a `jax.distributed` run, and in every single-process run: the process that
    prints messages, shows progress bars and widgets, and writes checkpoints and the program store."""
    return jax.process_index() == 0


def wait_for_all(name: str) -> None:
    """Under `jax.distributed`, return once every process got here (`name` tells the barrier apart);
    at once in a single-process run. After process 0 wrote a file, so the others may read it."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def sharding_signature(sharding) -> str | None:
    """What a leaf's placement contributes to a program key: None on one device (the default placement),
    else the sharding and the ids of the devices it spans, in mesh order (two meshes of the same shape on
    other devices are other programs)."""
    if sharding is None or len(sharding.device_set) == 1:
        return None
    mesh = getattr(sharding, "mesh", None)
    devices = getattr(mesh, "devices", None)
    ids = [d.id for d in devices.flat] if devices is not None else sorted(d.id for d in sharding.device_set)
    return f"{sharding!r} on devices {ids}"


def auto_context(mesh=None):
    """Where the caller made an Explicit-axes mesh current (`jax.set_mesh(jax.make_mesh(...))`), the
    Auto form of `mesh` (default: that one) as the current mesh for the block, so the handle's eager ops
    and traces meet arrays of the mesh they are on; otherwise nothing."""
    ambient = ambient_mesh()
    if ambient is None or auto_axes(ambient) is ambient:
        return contextlib.nullcontext()
    return mesh_context(auto_axes(ambient if mesh is None else mesh))


def in_mesh(mesh_of=None):
    """Decorate a handle method to run under `auto_context` of the handle's mesh (`mesh_of(self, *args)`
    picks it from the arguments, for setup, before the handle has a placement)."""

    def decorate(method):
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            if mesh_of is not None:
                mesh = mesh_of(self, *args, **kwargs)
            else:
                mesh = getattr(getattr(self, "_place", None), "mesh", None)
            with auto_context(mesh):
                return method(self, *args, **kwargs)

        return run

    return decorate


def placement(mesh=None, data_axis: str = "data", param_sharding=None):
    """The handle's placement: `SingleDevice()` without a mesh (neither given nor set by `jax.set_mesh`),
    else a `Sharded` over it. Raises the setup errors for a bad mesh, axis or rule."""
    if mesh is None:
        mesh = ambient_mesh()
    if mesh is None:
        if param_sharding is not None:
            raise NitroValueError(
                "`param_sharding=` needs a mesh to shard over; pass `mesh=Mesh(devices, (\"data\", ...))` "
                "or set one with `jax.set_mesh(mesh)`."
            )
        return SingleDevice()
    return Sharded(mesh, data_axis, param_sharding)


# How many steps a loop may dispatch ahead of a multi-device CPU mesh before it waits for the step that
# many back. XLA:CPU (jaxlib 0.10) deadlocks when a few dozen launches of programs with collectives
# queue on simulated devices: three devices park in an all-reduce's rendezvous and the fourth never
# joins (its launch waits for a slot the queued ones hold). A plain sharded `jax.jit` loop hangs the
# same way; 16 steps ahead hung, 8 did not, in every trial on this 2-core machine. On the CPU, running
# ahead buys nothing the devices can use (they share the host's cores), so the bound costs no speed.
CPU_STEPS_AHEAD = 4


def steps_ahead(mesh) -> int:
    """The run-ahead bound of a loop over `mesh`'s programs: `CPU_STEPS_AHEAD` on a CPU mesh of more
    than one device, else 0 (unbounded: accelerators queue work asynchronously as they should)."""
    if mesh is None or mesh.devices.size < 2 or mesh.devices.flat[0].platform != "cpu":
        return 0
    return CPU_STEPS_AHEAD


def pace(results: list, ahead: int):
    """Wait for `results[-ahead - 1]` (a device value of an earlier step) when `ahead` is set and
    there is one: a loop that calls this each step stays at most `ahead` steps ahead of the devices."""
    if ahead and len(results) > ahead:
        jax.block_until_ready(results[-ahead - 1])


class SingleDevice:
    """No mesh: every answer is the one a handle gave before meshes existed."""

    mesh = None
    shards = False  # whether any parameter is split across devices
    ahead = 0  # loops run ahead of the device unbounded

    def check_batch_size(self, batch_size: int):
        pass

    def check_layout(self, flat: bool):
        pass

    def params(self, tree):
        return tree

    opt_state = state = replicate = params

    def batches(self, iterator, stacked: bool = False):
        return iterator

    def batch(self, tree, stacked: bool = False):
        return tree

    def schedules(self, apply):
        return apply

    def out_shardings(self, kind: str, args: tuple, model=None):
        return None

    def metric_args(self, tree):
        return tree

    def like(self, tree, live):
        return jax.device_put(tree)

    def host(self, tree):
        return jax.device_get(tree)


_BAD_SPEC = (
    "`param_sharding` must return a `jax.sharding.PartitionSpec` (or None to replicate) for each parameter; "
    "for `{path}` (shape {shape}) it returned {got}"
)


class Sharded:
    """Data parallel over `mesh[data_axis]`, params replicated unless `param_sharding` says otherwise.

    **Arguments:**
    - `mesh`: a `jax.sharding.Mesh`.
    - `data_axis`: the mesh axis batches are split along.
    - `param_sharding`: `rule(path: str, shape: tuple) -> PartitionSpec | None`, called once per parameter
      at setup (`path` like `"w1"` or `"layers/0/kernel"`); None replicates that parameter.
    """

    shards = False

    def __init__(self, mesh, data_axis: str = "data", param_sharding=None):
        if not isinstance(mesh, Mesh):
            raise NitroTypeError(
                f"`mesh` must be a `jax.sharding.Mesh`; got {type(mesh).__qualname__}. Build one with "
                f"`jax.make_mesh((jax.device_count(),), (\"data\",))`."
            )
        if data_axis not in mesh.axis_names:
            raise NitroValueError(
                f"the mesh has no `{data_axis}` axis to split batches along (its axes: "
                f"{', '.join(f'`{a}`' for a in mesh.axis_names)}); pass `data_axis=` naming one of them, or "
                f"build the mesh with a `\"{data_axis}\"` axis."
            )
        if param_sharding is not None and not callable(param_sharding):
            raise NitroTypeError(
                f"`param_sharding` must be a function `(path, shape) -> PartitionSpec | None`; got "
                f"{type(param_sharding).__qualname__}."
            )
        mesh = auto_axes(mesh)  # shardings on the arguments, propagated by XLA: `jax.make_mesh`'s too
        self.mesh, self.data_axis, self.rule = mesh, data_axis, param_sharding
        self.data_size = int(mesh.shape[data_axis])
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self._batch = NamedSharding(mesh, PartitionSpec(data_axis))
        self._stacked = NamedSharding(mesh, PartitionSpec(None, data_axis))  # accum x batch x ...
        self.multi_process = jax.process_count() > 1
        self.ahead = steps_ahead(mesh)  # how far a loop may run ahead of the devices (`pace`)
        self._param_shardings = None  # the params tree's shardings, once `params` has placed them
        self._local_rows: dict = {}  # (global shape, stacked) -> this process's rows of a batch

    # ------------------------------------------------------------ setup
    def check_batch_size(self, batch_size: int):
        """Refuse a batch that does not split evenly over the data axis (every device gets equal rows)."""
        if batch_size % self.data_size:
            lower, upper = (batch_size // self.data_size) * self.data_size, -(-batch_size // self.data_size) * self.data_size
            fix = f"`batch_size={upper}`" if not lower else f"`batch_size={lower}` or `{upper}`"
            raise NitroValueError(
                f"`batch_size={batch_size}` does not divide over the mesh's `{self.data_axis}` axis of "
                f"{self.data_size} devices; every device takes an equal share of each batch. Use {fix} (a "
                f"multiple of {self.data_size})."
            )

    def check_layout(self, flat: bool):
        """Refuse the flat layout when the rule splits a parameter: concatenating parameters into one
        buffer per dtype would gather every shard onto every device, the opposite of what was asked."""
        if flat and self.shards:
            split = [(p, s.spec) for p, s in _named_leaves(self._param_shardings) if not s.is_fully_replicated]
            shown = ", ".join(f"`{p}` ({spec})" for p, spec in split[:3]) + (", ..." if len(split) > 3 else "")
            raise NitroValueError(
                f"`param_sharding` splits {shown} across devices, and the flat parameter layout "
                f"(`flat_params=True`, the default) concatenates parameters into one buffer per dtype, which "
                f"would gather them whole; pass `flat_params=False` with `param_sharding=`."
            )

    def _spec(self, path: str, shape: tuple):
        """The checked `NamedSharding` of one parameter under the rule."""
        spec = self.rule(path, shape) if self.rule is not None else None
        if spec is None:
            return self.replicated
        if not isinstance(spec, PartitionSpec):
            raise NitroTypeError(_BAD_SPEC.format(path=path, shape=shape, got=f"{type(spec).__qualname__} ({spec!r})") + ".")
        if len(spec) > len(shape):
            raise NitroValueError(
                _BAD_SPEC.format(path=path, shape=shape, got=repr(spec))
                + f", which names {len(spec)} dimensions for a {len(shape)}-D array."
            )
        used = []
        for dim, (size, entry) in enumerate(zip(shape, spec)):
            axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
            for a in axes:
                if a not in self.mesh.axis_names:
                    raise NitroValueError(
                        _BAD_SPEC.format(path=path, shape=shape, got=repr(spec))
                        + f": the mesh has no `{a}` axis (its axes: {', '.join(map(repr, self.mesh.axis_names))})."
                    )
                if a in used:
                    raise NitroValueError(
                        _BAD_SPEC.format(path=path, shape=shape, got=repr(spec)) + f": axis `{a}` is used twice."
                    )
                used.append(a)
            parts = math.prod(int(self.mesh.shape[a]) for a in axes)
            if size % parts:
                raise NitroValueError(
                    _BAD_SPEC.format(path=path, shape=shape, got=repr(spec))
                    + f": dimension {dim} has size {size}, which does not split into {parts} equal parts; "
                    f"return None for this parameter (replicate it) or shard a dimension that divides."
                )
        if used:
            self.shards = True
        return NamedSharding(self.mesh, spec)

    def params(self, tree):
        """`tree` (the params) placed by the rule; the first call fixes each parameter's sharding."""
        if self._param_shardings is None:
            self._param_shardings = jax.tree_util.tree_map_with_path(
                lambda path, leaf: self._spec(_path_name(path), tuple(np.shape(leaf))), tree
            )
        return jax.tree.map(self._put, tree, self._param_shardings)

    def opt_state(self, tree):
        """The optimizer state placed and strongly typed: a leaf that `tx.init` built sharded like its
        parameter (`zeros_like` keeps the sharding) stays so, every other leaf is replicated."""

        def place(leaf):
            sharding = getattr(leaf, "sharding", None)
            keep = sharding is not None and len(sharding.device_set) > 1
            if keep and not sharding.is_fully_replicated:
                return jax.numpy.asarray(leaf).astype(leaf.dtype)  # astype drops a weak type
            return self._put(leaf, self.replicated)

        return jax.tree.map(place, tree)

    def state(self, tree):
        """Model state (batch statistics): replicated."""
        return self.replicate(tree)

    def replicate(self, tree):
        """Every leaf of `tree` replicated on the mesh (Device values, scalars the programs take)."""
        return jax.tree.map(lambda leaf: self._put(leaf, self.replicated), tree)

    def like(self, tree, live):
        """`tree` (host arrays: a resumed checkpoint) placed leaf by leaf as `live` (the same structure,
        on this mesh) is."""
        return jax.tree.map(lambda new, old: self._put(new, getattr(old, "sharding", self.replicated)), tree, live)

    def _put(self, leaf, sharding):
        """`leaf` as a global array with `sharding`, strongly typed. A value every process holds alike
        (init's output, a host array) is built on each process from its own copy. A typed PRNG key (an
        NNX `RngKey` in the model state) has no numpy form: its key data is placed and re-wrapped."""
        if isinstance(leaf, jax.Array) and jax.numpy.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            data = self._put(jax.random.key_data(leaf), sharding)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(leaf))
        if isinstance(leaf, jax.Array):
            if not leaf.is_fully_addressable:  # a global array of a multi-process run: no host copy
                leaf = leaf.astype(leaf.dtype) if leaf.weak_type else leaf
                return leaf if leaf.sharding == sharding else jax.device_put(leaf, sharding)
            if leaf.sharding == sharding and not leaf.weak_type:
                return leaf
        value = np.asarray(leaf)
        if not self.multi_process:
            return jax.device_put(value, sharding)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    # ------------------------------------------------------------ per step
    def batch(self, tree, stacked: bool = False):
        """A host batch (`{field: array}`, leading axis the batch, or `accum` x batch when `stacked`) as
        global arrays split along the data axis. Under `jax.distributed` each process sends only its
        own rows."""
        sharding = self._stacked if stacked else self._batch
        if not self.multi_process:
            return jax.device_put(tree, sharding)
        return {k: self._local(v, sharding, stacked) for k, v in tree.items()}

    def _local(self, value, sharding, stacked: bool):
        shape = np.shape(value)
        rows = self._local_rows.get((shape, stacked))
        if rows is None:
            rows = self._local_rows[(shape, stacked)] = _process_rows(sharding, shape, 1 if stacked else 0)
        if rows is False:  # this process's rows are not one block: build the shards one by one
            return jax.make_array_from_callback(shape, sharding, lambda index: value[index])
        lo, hi = rows
        local = value[:, lo:hi] if stacked else value[lo:hi]
        return jax.make_array_from_process_local_data(sharding, local, shape)

    def batches(self, iterator, stacked: bool = False):
        """`iterator`'s host batches, each placed as it is drawn."""
        put = self.batch
        return (put(b, stacked) for b in iterator)

    def schedules(self, apply):
        """`apply(dev, step)` (the binding's schedule setter) followed by replicating what it set."""

        def apply_placed(dev, step):
            apply(dev, step)
            for name, value in dev.items():
                if not isinstance(value, jax.Array):
                    dev[name] = self._put(value, self.replicated)

        return apply_placed

    def out_shardings(self, kind: str, args: tuple, model=None):
        """The output shardings `kind`'s program is compiled with, so what it returns is placed as what
        it takes: params and optimizer state keep their shardings step after step; losses, the model
        state, the guard and gradients of replicated params are replicated. None lets XLA choose
        (evaluation and predict outputs, which follow the batch).

        `grad` returns `(flat grads, loss, new model state)`; `opt` takes `(params, grads, opt_state,
        dev, loss, guard, state, new state)` and returns `(params, opt_state, guard, model state)`.
        `model` (`_model.Model`) says which params leaves the gradients are of (the trainable ones)."""
        if kind == "grad":
            if not self.shards:
                return (self.replicated, self.replicated, self.replicated)
            # Only the tree layout can shard (`check_layout`): its gradients are the trainable tree.
            grads = model.split.trainable(self._param_shardings)
            return (grads, self.replicated, self.replicated)
        if kind == "opt":
            if not self.shards:
                return (self.replicated,) * 4
            opt_state = args[2]
            return (self._param_shardings, jax.tree.map(lambda leaf: leaf.sharding, opt_state), self.replicated,
                    self.replicated)
        return None

    def metric_args(self, tree):
        """A device metric's `(outputs, fields)`, sliced to the valid rows (any count, so no longer split
        evenly): gathered and replicated."""
        return self.replicate(self.host(tree))

    def host(self, tree):
        """`tree` as numpy on this process: a leaf split over processes is gathered whole."""
        if not self.multi_process:
            return jax.device_get(tree)
        from jax.experimental import multihost_utils

        def get(leaf):
            if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
                if leaf.is_fully_replicated:  # every process holds it whole: its own copy, no collective
                    return np.asarray(leaf.addressable_data(0))
                return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
            return np.asarray(leaf)

        return jax.tree.map(get, tree)


def _named_leaves(tree) -> list:
    """`(path name, leaf)` of every leaf of a tree of shardings."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, NamedSharding))
    return [(_path_name(path), leaf) for path, leaf in flat]


def _path_name(path) -> str:
    """A parameter's path as the rule sees it: `"w1"`, `"layers/0/kernel"`."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


def _process_rows(sharding, shape: tuple, axis: int):
    """`(lo, hi)`: the rows along `axis` this process's devices hold of an array of `shape`, when they
    are one contiguous block (the usual mesh over `jax.devices()`); False otherwise."""
    spans = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        s = index[axis]
        spans.add((s.start or 0, shape[axis] if s.stop is None else s.stop))
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    covered = sum(b - a for a, b in sorted(spans))
    return (lo, hi) if covered == hi - lo else False
