"""Past one device: data parallel on a mesh, parameter sharding rules, two processes over loopback.

Every multi-device test runs in its own child Python (4 simulated CPU devices, `jax_num_cpu_devices`),
bounded in time; the two-process test runs two children of 2 devices each (gloo collectives) and
compares them with a one-device run here. Cost: about 25 s of the suite, most of it JAX start-up and
compiles in the children.
"""

import socket
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from conftest import tol  # by backend: a GPU multiplies float32 at TF32 precision

import nitro_ipy
from nitro_ipy._base import _sharding
from nitro_ipy._base._errors import NitroValueError
from jax.sharding import PartitionSpec as P

from _modules import child_env, import_source, json_in_child, last_json

CHILD_TIMEOUT = 120

# The experiment every test trains: one device metric (its own program) and one host metric, a ragged
# valid split (70 = 2 x 32 + 6), so a run builds grad, opt, eval and the metric twice: 5 programs.
EXPERIMENT = """
import dataclasses
import jax, jax.numpy as jnp, numpy as np, optax
import nitro_ipy
from nitro_ipy import Device, GraphConst, Nitro

def act(h):
    return jnp.tanh(h)

@dataclasses.dataclass
class Regression:
    hidden: GraphConst[int] = 16
    lr: Device[float] = 1e-2

    def init(self, rng):
        k1, k2 = jax.random.split(rng)
        return {"w1": jax.random.normal(k1, (4, self.hidden)) * 0.5,
                "w2": jax.random.normal(k2, (self.hidden,)) * 0.5}

    def forward(self, params, *, x):
        return act(x @ params["w1"]) @ params["w2"]

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)

    def optimizer(self):
        return optax.adam(self.lr)

    @nitro_ipy.metrics("device")
    def mae(self, outputs, *, y):
        return {"mae": (jnp.sum(jnp.abs(outputs - y)), outputs.shape[0])}

    @nitro_ipy.metrics
    def close(self, outputs, *, y):
        return {"close": (np.sum(np.abs(outputs - y) < 0.5), len(y))}

def data():
    x = np.random.default_rng(0).normal(size=(256, 4)).astype(np.float32)
    y = np.sin(x.sum(1))
    return {"train": {"x": x, "y": y}, "valid": {"x": x[:70], "y": y[:70]}}

def summary(n, rows):
    params = {k: np.asarray(v).tolist() for k, v in n._place.host(n.params).items()}
    return {"rows": rows, "params": params, "predict": np.asarray(n.predict({"x": data()["train"]["x"][:50]})).tolist()}
"""

PRELUDE = """
import json
def opt_state_of(n):  # `n.opt_state` once model state lands (issue 12), `n.state` before
    return n.opt_state if hasattr(type(n), "opt_state") else n.state
import jax
jax.config.update("jax_num_cpu_devices", 4)
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import nitro_ipy
from nitro_ipy import Nitro
import exp
mesh = Mesh(np.array(jax.devices()), ("data",))
"""


def in_child(tmp_path, body: str):
    """Run `PRELUDE + body` in a child Python with 4 CPU devices and the experiment module importable."""
    (tmp_path / "exp.py").write_text(EXPERIMENT)
    return json_in_child(PRELUDE + textwrap.dedent(body), tmp_path, "0", timeout=CHILD_TIMEOUT)


def assert_runs_agree(one: dict, many: dict):
    assert [r["epoch"] for r in one["rows"]] == [r["epoch"] for r in many["rows"]]
    for a, b in zip(one["rows"], many["rows"]):
        assert a.keys() == b.keys()
        np.testing.assert_allclose([a[k] for k in a], [b[k] for k in a], rtol=tol(1e-5)["rtol"])
    for k in one["params"]:
        np.testing.assert_allclose(one["params"][k], many["params"][k], **tol(1e-5, 1e-6))
    np.testing.assert_allclose(one["predict"], many["predict"], **tol(1e-5, 1e-6))


def test_data_parallel_matches_one_device_with_the_same_counts(tmp_path):
    out = in_child(tmp_path, """
    def run(**kw):
        before = nitro_ipy.cache_stats()
        n = Nitro(exp.Regression(), data=exp.data(), batch_size=32, max_epochs=2, progress=False, **kw)
        rows = n.train()
        after = nitro_ipy.cache_stats()
        s = exp.summary(n, rows)
        s["misses"] = after.misses - before.misses
        s["entries"] = after.entries - before.entries
        return n, s

    _, one = run()
    n, many = run(mesh=mesh)  # the same experiment on 4 devices: every key moves (shardings), 5 new programs
    grad = next(e for e in n._programs.values() if e.kind == "grad")
    batch_specs = [s.spec for s in jax.tree.leaves(grad.call.input_shardings[0][3])]  # (params, state, dev, batch, rng)
    # Inside `jax.set_mesh`, a handle given no mesh runs on the ambient one. The ambient mesh is in JAX's
    # trace context (what `jax.jit` keys on too), so its programs compile once each, as `jax.jit` traces.
    before = nitro_ipy.cache_stats()
    with jax.set_mesh(mesh):
        ambient = Nitro(exp.Regression(), data=exp.data(), batch_size=32, progress=False)
        ambient.train()
    ambient_misses = nitro_ipy.cache_stats().misses - before.misses
    # A schedule's host value is replicated before the step: the same keys, the same run.
    before = nitro_ipy.cache_stats()
    _, scheduled = run(mesh=mesh, schedules={"lr": lambda step: 1e-2})
    scheduled_misses = nitro_ipy.cache_stats().misses - before.misses
    # `n.set` on a live mesh handle replicates the new value: the same keys.
    before = nitro_ipy.cache_stats()
    n.set(lr=5e-3)
    n.train(1)
    n.validate()
    set_misses = nitro_ipy.cache_stats().misses - before.misses
    # accum=2 stacks micro-batches: (2, 32, ...) split along the second axis.
    _, one_acc = run(accum=2)
    _, many_acc = run(accum=2, mesh=mesh)
    print(json.dumps({
        "one": one, "many": many, "one_acc": one_acc, "many_acc": many_acc, "scheduled": scheduled,
        "scheduled_misses": scheduled_misses, "set_misses": set_misses,
        "param_specs": [str(a.sharding.spec) for a in jax.tree.leaves(n.params)],
        "opt_specs": sorted({str(a.sharding.spec) for a in jax.tree.leaves(opt_state_of(n))}),
        "batch_specs": [str(s) for s in batch_specs],
        "all_reduce": "all-reduce" in grad.call.as_text(),
        "ambient_mesh": ambient._place.mesh is not None, "ambient_misses": ambient_misses,
        "kinds": sorted(e.kind for e in n._programs.values()),
    }))
    """)
    assert_runs_agree(out["one"], out["many"])
    assert_runs_agree(out["one_acc"], out["many_acc"])
    assert_runs_agree(out["one"], out["scheduled"])
    assert out["scheduled_misses"] == 0  # every program, predict included, hits the mesh run's
    assert out["set_misses"] == 0
    # The acceptance counts of one device: grad, opt, eval, the device metric x 2 (ragged valid split).
    assert (out["one"]["misses"], out["one"]["entries"]) == (5, 5)
    assert (out["many"]["misses"], out["many"]["entries"]) == (5, 5)
    assert (out["many_acc"]["misses"], out["many_acc"]["entries"]) == (1, 1)  # grad: accum is in its key, not opt's
    assert out["kinds"] == ["eval", "grad", "metric:mae", "metric:mae", "opt", "predict"]
    assert out["param_specs"] == [str(P()), str(P())]
    assert out["opt_specs"] == [str(P())]
    assert out["batch_specs"] == [str(P("data")), str(P("data"))]
    assert out["all_reduce"]  # XLA reduces the gradients inside the gradient program
    assert out["ambient_mesh"] and out["ambient_misses"] == 5


def test_param_sharding_rule_shards_params_and_their_optimizer_state(tmp_path):
    out = in_child(tmp_path, """
    import importlib, pathlib
    rule = lambda path, shape: P(None, "data") if path == "w1" else None
    one = Nitro(exp.Regression(), data=exp.data(), batch_size=32, max_epochs=2, progress=False, flat_params=False)
    one_s = exp.summary(one, one.train())
    n = Nitro(exp.Regression(), data=exp.data(), batch_size=32, max_epochs=2, progress=False,
              flat_params=False, mesh=mesh, param_sharding=rule)
    many = exp.summary(n, n.train())
    w1 = n.params["w1"]
    mu = opt_state_of(n)[0].mu["w1"]
    shard_shape = w1.addressable_shards[0].data.shape
    # The shardings survive a rebuild, and the rebuilt handle hits every program.
    before = nitro_ipy.cache_stats()
    r = n.rebuild()
    r.train(1)
    rebuilt_misses = nitro_ipy.cache_stats().misses - before.misses
    # An edit to a helper below `forward` poisons the mesh programs that traced it; a rebuild recompiles them.
    src = pathlib.Path(exp.__file__)
    src.write_text(src.read_text().replace("return jnp.tanh(h)", "return jnp.tanh(h) * 0.5"))
    importlib.reload(exp)
    nitro_ipy.bump_world()
    before = nitro_ipy.cache_stats()
    r2 = Nitro(exp.Regression(), data=exp.data(), batch_size=32, progress=False, flat_params=False,
               mesh=mesh, param_sharding=rule)
    r2.train()
    edited_misses = nitro_ipy.cache_stats().misses - before.misses
    print(json.dumps({"one": one_s, "many": many, "w1": str(w1.sharding.spec), "mu": str(mu.sharding.spec),
                      "w2": str(n.params["w2"].sharding.spec), "shard_shape": shard_shape,
                      "rebuilt": str(r.params["w1"].sharding.spec), "rebuilt_misses": rebuilt_misses,
                      "edited_misses": edited_misses}))
    """)
    assert_runs_agree(out["one"], out["many"])
    assert (out["w1"], out["mu"], out["w2"]) == (str(P(None, "data")), str(P(None, "data")), str(P()))
    assert out["shard_shape"] == [4, 4]  # each device holds a quarter of w1's 16 columns
    assert out["rebuilt"] == str(P(None, "data")) and out["rebuilt_misses"] == 0
    assert out["edited_misses"] == 2  # grad and eval traced `forward`'s helper; opt and the metrics did not


@pytest.mark.parametrize("layout", ["flat", "sharded", "ambient"])
def test_a_mesh_handle_s_programs_compile_ahead(tmp_path, layout):
    """On a 4-device mesh, as on one device: validation's programs (evaluation, and the device metric at
    both batch lengths of the 70-row split) compile beside the first epoch under the keys validation asks
    for, an edit's replacements compile in the background with the handle's shardings, and the rebuilt
    handle is served them (no second compile), placed as before. The experiment is this file's, defined
    in a cell of a real `InteractiveShell` in the child, and a later cell edits the helper its forward calls."""
    out = in_child(tmp_path, f"""
    import contextlib, io, os
    from IPython.core.interactiveshell import InteractiveShell
    from nitro_ipy._training import _ahead
    _ahead.set_compile_ahead(True)  # the suite's children inherit it off
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "nitro_ipy")
    ip.user_ns.update(Nitro=Nitro, mesh=mesh, P=P)
    def run(code):
        said = io.StringIO()
        with contextlib.redirect_stdout(said):
            ip.run_cell(code).raise_error()
        return said.getvalue()
    kw = {{"flat": ", mesh=mesh", "ambient": "",
          "sharded": ", mesh=mesh, flat_params=False, param_sharding=lambda path, shape: "
                     "P(None, 'data') if path == 'w1' else None"}}[{layout!r}]
    if {layout!r} == "ambient":  # no `mesh=`: the one `jax.set_mesh` made current (Explicit axes)
        jax.set_mesh(jax.make_mesh((4,), ("data",)))
    run({EXPERIMENT!r})
    run("n = Nitro(Regression(), data=data(), batch_size=32, max_epochs=1, progress=False" + kw + "); rows = n.train()")
    _ahead.wait(120)
    first = {{"history": [[o.kind, o.status] for o in _ahead.history()], "stats": list(nitro_ipy.cache_stats()[1:3])}}
    _ahead.reset()
    run("def act(h):\\n    return jnp.tanh(h) * 0.5\\n")  # the post-cell hook poisons grad and eval, queues both
    _ahead.wait(120)
    edit = {{"history": [[o.kind, o.status] for o in _ahead.history()], "stats": list(nitro_ipy.cache_stats()[1:3])}}
    said = run("n = n.rebuild(); rows = n.train()")
    n = ip.user_ns["n"]
    print(json.dumps({{"first": first, "edit": edit, "after": list(nitro_ipy.cache_stats()[1:3]),
                      "compiled": [line for line in said.splitlines() if line.startswith("nitro_ipy: compiled")],
                      "w1": str(n.params["w1"].sharding.spec), "devices": len(n.params["w1"].sharding.device_set),
                      "loss": ip.user_ns["rows"][-1]["loss"],
                      "stale": any(e.poisoned for e in n._programs.values())}}))
    """)
    # grad, opt; eval and the metric's two programs in the background (or, where validation got to one
    # first, found there): no key validation would not ask for
    assert out["first"]["stats"] == [5, 5]
    if layout == "ambient":
        # The mesh `jax.set_mesh` made current is in JAX's trace context, which a key carries, and the
        # compile-ahead thread does not trace under the cell's context: the evaluation prefetch is
        # cancelled and validation compiles it and the metrics on demand (counts exact, said once).
        assert out["first"]["history"] == [["eval", "cancelled"]], out["first"]
    else:
        assert sorted(kind for kind, _ in out["first"]["history"]) == ["eval", "metric:mae", "metric:mae"]
        assert {status for _, status in out["first"]["history"]} <= {"compiled", "had"}
    if layout == "ambient":  # (as above) nothing compiles ahead: the rebuilt handle compiles grad and eval
        assert out["edit"] == {"history": [], "stats": [5, 3]}
        assert out["after"] == [7, 5]
        assert [line.split()[2] for line in out["compiled"]] == ["grad", "eval"]
    else:
        assert out["edit"] == {"history": [["grad", "compiled"], ["eval", "compiled"]], "stats": [7, 5]}
        assert out["after"] == [7, 5]  # the rebuilt handle compiled nothing
        assert [line.split()[2] for line in out["compiled"]] == ["grad", "eval"]
        assert all("compiled ahead after your edit" in line for line in out["compiled"])
    assert out["w1"] == (str(P(None, "data")) if layout == "sharded" else str(P())) and out["devices"] == 4
    assert np.isfinite(out["loss"]) and not out["stale"]


def test_bad_input_is_refused_at_setup(tmp_path):
    out = in_child(tmp_path, """
    from jax.sharding import Mesh
    def error(e=exp.Regression(), **kw):
        try:
            Nitro(e, data=exp.data(), progress=False, **kw)
        except Exception as err:
            return [type(err).__name__, str(err)]
        return None
    model_mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("batch", "model"))
    print(json.dumps({
        "batch": error(mesh=mesh, batch_size=30),
        "small": error(mesh=mesh, batch_size=2),
        "axis": error(mesh=model_mesh, batch_size=32),
        "not_a_mesh": error(mesh=jax.devices(), batch_size=32),
        "not_spec": error(mesh=mesh, batch_size=32, flat_params=False, param_sharding=lambda p, s: "data"),
        "rank": error(mesh=mesh, batch_size=32, flat_params=False,
                      param_sharding=lambda p, s: P(None, None, "data") if p == "w2" else None),
        "unknown": error(mesh=mesh, batch_size=32, flat_params=False, param_sharding=lambda p, s: P("model")),
        "twice": error(mesh=model_mesh, data_axis="batch", batch_size=32, flat_params=False,
                       param_sharding=lambda p, s: P("model", "model") if p == "w1" else None),
        "rows_rule": error(mesh=mesh, batch_size=32, flat_params=False,
                        param_sharding=lambda p, s: P("data") if p == "w1" else None),
        "flat": error(mesh=mesh, batch_size=32, param_sharding=lambda p, s: P(None, "data") if p == "w1" else None),
        "flat_replicated": error(mesh=mesh, batch_size=32, param_sharding=lambda p, s: None),
        "model_axis_ok": error(mesh=model_mesh, data_axis="batch", batch_size=32),
        "divide": error(mesh=mesh, batch_size=32, flat_params=False, e=exp.Regression(hidden=6),
                        param_sharding=lambda p, s: P(None, "data") if p == "w1" else None),
    }))
    """)
    assert out["batch"] == [
        "NitroValueError",
        "`batch_size=30` does not divide over the mesh's `data` axis of 4 devices; every device takes an equal "
        "share of each batch. Use `batch_size=28` or `32` (a multiple of 4).",
    ]
    assert out["small"][1].endswith("Use `batch_size=4` (a multiple of 4).")
    assert out["axis"] == [
        "NitroValueError",
        "the mesh has no `data` axis to split batches along (its axes: `batch`, `model`); pass `data_axis=` "
        "naming one of them, or build the mesh with a `\"data\"` axis.",
    ]
    assert out["not_a_mesh"][0] == "NitroTypeError" and "got list" in out["not_a_mesh"][1]
    assert out["not_spec"] == [
        "NitroTypeError",
        "`param_sharding` must return a `jax.sharding.PartitionSpec` (or None to replicate) for each "
        "parameter; for `w1` (shape (4, 16)) it returned str ('data').",
    ]
    assert out["rank"][1].endswith(f"for `w2` (shape (16,)) it returned {P(None, None, 'data')!r}, "
                                   "which names 3 dimensions for a 1-D array.")
    assert out["unknown"][1].endswith(": the mesh has no `model` axis (its axes: 'data').")
    assert out["twice"][1].endswith(f"{P('model', 'model')!r}: axis `model` is used twice.")
    assert out["rows_rule"] is None  # w1's 4 rows split into 4 parts: a valid rule
    assert out["flat"] == [
        "NitroValueError",
        f"`param_sharding` splits `w1` ({P(None, 'data')}) across devices, and the flat parameter "
        "layout (`flat_params=True`, the default) concatenates parameters into one buffer per dtype, which "
        "would gather them whole; pass `flat_params=False` with `param_sharding=`.",
    ]
    assert out["flat_replicated"] is None and out["model_axis_ok"] is None
    assert out["divide"] == [
        "NitroValueError",
        "`param_sharding` must return a `jax.sharding.PartitionSpec` (or None to replicate) for each parameter; "
        f"for `w1` (shape (4, 6)) it returned {P(None, 'data')!r}: dimension 1 has size 6, which does not split "
        "into 4 equal parts; return None for this parameter (replicate it) or shard a dimension that divides.",
    ]


STORE_RUN = """
import sys
from nitro_ipy._compiler import _store
nitro_ipy.set_cache_dir(sys.argv[1])
kw = {"flat": {}, "sharded": {"flat_params": False,
                              "param_sharding": lambda p, s: P(None, "data") if p == "w1" else None}}[sys.argv[2]]
n = Nitro(exp.Regression(), data=exp.data(), batch_size=32, max_epochs=2, progress=False, mesh=mesh, **kw)
out = exp.summary(n, n.train())
out.update(loaded=_store.loaded_count, stats=list(nitro_ipy.cache_stats()),
           specs=[str(a.sharding.spec) for a in jax.tree.leaves(n.params)])
print(json.dumps(out))
"""


def test_the_program_store_keeps_sharded_programs_for_the_next_process(tmp_path):
    """A process on 4 devices writes its mesh programs to the store; the next one on the same mesh loads
    all of them (no trace, no XLA), placed as before, and trains to the same numbers."""
    (tmp_path / "exp.py").write_text(EXPERIMENT)
    for layout in ("flat", "sharded"):
        store = tmp_path / f"store-{layout}"
        store.mkdir(mode=0o700)
        code = PRELUDE + f"import sys; sys.argv = ['x', {str(store)!r}, {layout!r}]\n" + STORE_RUN
        first, second = (json_in_child(code, tmp_path, "0", timeout=CHILD_TIMEOUT) for _ in range(2))
        # grad, opt, eval, the device metric x 2 (ragged valid split), predict: compiled, then all loaded.
        assert (first["loaded"], second["loaded"]) == (0, 6), layout
        assert first["stats"][1:] == second["stats"][1:] == [6, 6]
        assert first["specs"] == second["specs"] == (
            [str(P()), str(P())] if layout == "flat" else [str(P(None, "data")), str(P())])
        assert first["rows"] == second["rows"] and first["params"] == second["params"]
        assert first["predict"] == second["predict"]


def test_loops_stay_a_few_steps_ahead_of_a_cpu_mesh(tmp_path):
    """XLA:CPU deadlocks when a few dozen launches of programs with collectives queue on its devices
    (a plain sharded `jax.jit` loop too): on a CPU mesh of several devices the step and evaluation
    loops wait for the step `CPU_STEPS_AHEAD` back; one device and accelerators are not bounded."""
    out = in_child(tmp_path, """
    from nitro_ipy._base import _sharding
    n = Nitro(exp.Regression(), data=exp.data(), batch_size=32, progress=False, mesh=mesh)
    one = Nitro(exp.Regression(), data=exp.data(), batch_size=32, progress=False)
    double = jax.jit(lambda a: a * 2, out_shardings=n._place.replicated)
    results = [double(jax.numpy.ones(4))]
    for _ in range(6):
        results.append(double(results[-1]))
    _sharding.pace(results, 2)
    print(json.dumps({"ahead": n._place.ahead, "one": one._place.ahead,
                      "one_device_mesh": _sharding.steps_ahead(Mesh(np.array(jax.devices()[:1]), ("data",))),
                      "ready": results[-3].is_ready(), "rows": len(n.train())}))
    """)
    assert out == {"ahead": _sharding.CPU_STEPS_AHEAD, "one": 0, "one_device_mesh": 0, "ready": True, "rows": 1}


def test_param_sharding_without_a_mesh_is_refused():
    with pytest.raises(NitroValueError, match=r"`param_sharding=` needs a mesh to shard over"):
        _sharding.placement(None, "data", lambda p, s: None)


def test_one_device_is_the_default_placement():
    assert isinstance(_sharding.placement(), _sharding.SingleDevice)
    assert _sharding.is_main_process()
    x = jax.device_put(np.ones(3))
    assert _sharding.sharding_signature(x.sharding) is None
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    with jax.set_mesh(mesh):
        place = _sharding.placement()
    assert isinstance(place, _sharding.Sharded) and place.data_size == 1


WORKER = """
import json, sys
pid, port = int(sys.argv[1]), int(sys.argv[2])
import jax
from nitro_ipy._base._compat import CPU_COLLECTIVES_OPTION
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update(CPU_COLLECTIVES_OPTION, "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
import numpy as np
from jax.sharding import Mesh
import nitro_ipy, exp
mesh = Mesh(np.array(jax.devices()), ("data",))
n = nitro_ipy.Nitro(exp.Regression(), data=exp.data(), batch_size=32, max_epochs=2, mesh=mesh)
rows = n.train()
local_rows = n._place._local_rows
out = exp.summary(n, rows)
out["stats"] = list(nitro_ipy.cache_stats())
out["validate"] = n.validate()
out["local"] = sorted(map(list, set(local_rows.values())))
out["main"] = nitro_ipy._base._sharding.is_main_process()
print(json.dumps(out))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_workers(tmp_path, *args) -> tuple[list, list, list]:
    """Run `worker.py` as processes 0 and 1 of a `jax.distributed` run on a free loopback port, each
    bounded in time; returns each one's last JSON line, its `nitro_ipy:` lines and its `(stdout, stderr)`."""
    port, env = free_port(), child_env(tmp_path)
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), str(i), str(port), *args], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=CHILD_TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    results = [last_json(o) for o, _ in outs]
    printed = [[ln for ln in o.splitlines() if ln.startswith("nitro_ipy:")] for o, _ in outs]
    return results, printed, outs


def test_two_processes_train_like_one(tmp_path, monkeypatch):
    (tmp_path / "exp.py").write_text(EXPERIMENT)
    (tmp_path / "worker.py").write_text(WORKER)
    results, printed, outs = _two_workers(tmp_path)

    # The reference: the same run on this process's one device.
    e = import_source(tmp_path, monkeypatch, "exp", EXPERIMENT)
    n = nitro_ipy.Nitro(e.Regression(), data=e.data(), batch_size=32, max_epochs=2, progress=False)
    one = e.summary(n, n.train())
    one["validate"] = n.validate()
    for r in results:
        assert_runs_agree(one, r)
        np.testing.assert_allclose(list(one["validate"].values()), list(r["validate"].values()), rtol=tol(1e-5)["rtol"])
        assert r["stats"][1:] == [6, 6]  # grad, opt, eval, metric x 2, predict, as on one device
    assert results[0]["rows"] == results[1]["rows"] and results[0]["validate"] == results[1]["validate"]
    # Each process sends only its own rows: half of each 32-row batch (and of the padded eval batches).
    assert results[0]["local"] == [[0, 16]] and results[1]["local"] == [[16, 32]]
    assert [r["main"] for r in results] == [True, False]
    # Only process 0 speaks: 6 compiles and 2 epoch lines; process 1 says nothing.
    assert sum(ln.startswith("nitro_ipy: compiled") for ln in printed[0]) == 6
    assert sum(ln.startswith("nitro_ipy: epoch") for ln in printed[0]) == 2
    assert printed[1] == [] and "epoch 1" not in outs[1][1]



CHECKPOINT_WORKER = """
import json, os, sys
pid, port, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
import jax
from nitro_ipy._base._compat import CPU_COLLECTIVES_OPTION
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update(CPU_COLLECTIVES_OPTION, "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import nitro_ipy, exp
mesh = Mesh(np.array(jax.devices()), ("data",))
rule = lambda path, shape: P(None, "data") if path == "w1" else None

def state(n):
    host = n._place.host
    return {"params": {k: np.asarray(v).tolist() for k, v in host(n.params).items()},
            "opt": [np.asarray(a).tolist() for a in jax.tree.leaves(host(n._opt_state))], "step": n.step,
            "epoch": n.epoch, "history": [sorted(r) for r in n.history]}

out = {}
for name, kw in (("flat", {}), ("sharded", {"flat_params": False, "param_sharding": rule})):
    mine = os.path.join(root, f"{name}-periodic-{pid}")  # a directory of this process's own
    n = nitro_ipy.Nitro(exp.Regression(), data=exp.data(), batch_size=32, max_epochs=1, mesh=mesh,
                        checkpoint_dir=mine, checkpoint_every=1, **kw)
    n.train()
    path = n.save(os.path.join(root, name))  # one path on every process: process 0 writes it
    saved = state(n)
    r = nitro_ipy.Nitro(exp.Regression(), data=exp.data(), batch_size=32, max_epochs=1, mesh=mesh,
                        resume=path, **kw)
    resumed = state(r)
    r.train()
    auto = nitro_ipy.Nitro(exp.Regression(), data=exp.data(), batch_size=32, mesh=mesh,
                           checkpoint_dir=os.path.join(root, f"{name}-periodic-0"), resume="auto", **kw)
    out[name] = {"path": os.path.relpath(path, root), "periodic": sorted(os.listdir(mine)) if os.path.isdir(mine) else None,
                 "saved": saved, "resumed": resumed, "auto": state(auto), "continued": exp.summary(r, [])["params"],
                 "spec": str(r.params["w1"].sharding.spec)}
print(json.dumps(out))
"""


def test_two_processes_checkpoint_on_process_0_and_resume_alike(tmp_path, monkeypatch):
    """Under `jax.distributed` every process calls `n.save` and `checkpoint_every=` saves alike, only
    process 0 writes (the others gather their shards for it and wait until the file is there), and
    every process resumes the same state: params, optimizer state, step, history."""
    (tmp_path / "exp.py").write_text(EXPERIMENT)
    (tmp_path / "worker.py").write_text(CHECKPOINT_WORKER)
    root = tmp_path / "ck"
    root.mkdir()
    results, printed, _ = _two_workers(tmp_path, str(root))

    # The reference: one epoch, save, resume, one more epoch, on this process's one device.
    e = import_source(tmp_path, monkeypatch, "exp", EXPERIMENT)
    n = nitro_ipy.Nitro(e.Regression(), data=e.data(), batch_size=32, max_epochs=1, progress=False)
    n.train()
    one = n._place.host(n.params)
    r = nitro_ipy.Nitro(e.Regression(), data=e.data(), batch_size=32, max_epochs=1, progress=False,
                        resume=n.save(tmp_path / "one"))
    r.train()
    for name in ("flat", "sharded"):
        p0, p1 = results[0][name], results[1][name]
        assert p0["path"] == p1["path"] == f"{name}.nitro.npz"
        # Only process 0 wrote: its periodic directory has the epoch's checkpoint, process 1's was never made.
        assert p0["periodic"] == ["step-00000008.nitro.npz"] and p1["periodic"] is None
        for r_ in (p0, p1):
            assert r_["resumed"] == r_["saved"] == p0["saved"]  # every process resumes what was saved
            assert r_["auto"] == p0["saved"]  # `resume="auto"` finds process 0's newest checkpoint
            assert r_["saved"]["step"] == 8 and r_["saved"]["epoch"] == 1
            for k in one:
                np.testing.assert_allclose(r_["saved"]["params"][k], np.asarray(one[k]), **tol(1e-5, 1e-6))
                np.testing.assert_allclose(r_["continued"][k], np.asarray(r.params[k]), **tol(1e-5, 1e-6))
        assert p0["continued"] == p1["continued"]
    assert results[0]["sharded"]["spec"] == str(P(None, "data"))  # resumed sharded as the rule says
    assert sum(ln.startswith("nitro_ipy: resumed") for ln in printed[0]) == 4 and printed[1] == []


def test_scale_page_runs_on_four_devices(tmp_path):
    """docs/scale.md's blocks (test_docs runs them on one device) on 4 devices, where they shard."""
    root = __import__("pathlib").Path(__file__).resolve().parent
    code = PRELUDE.replace("import exp\n", "") + textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {str(root)!r})
    from test_docs import ROOT, run_page
    ran = run_page(ROOT / "docs" / "scale.md")
    print(json.dumps({{"ran": ran, "devices": jax.device_count()}}))
    """)
    out = json_in_child(code, tmp_path, "0", timeout=CHILD_TIMEOUT)
    assert out == {"ran": 4, "devices": 4}  # the page's asserts ran on 4 devices: w1 in column slices of 4


def test_key_signatures_tell_meshes_apart_when_remembered(tmp_path):
    # `arg_signature` remembers each sharding's signature: two meshes of the same shape over other
    # devices, and a replicated placement, must still give the signatures worked out afresh.
    got = in_child(tmp_path, """
        from jax.sharding import NamedSharding
        from nitro_ipy._compiler import _cache
        from nitro_ipy._base import _sharding
        devs = jax.devices()
        meshes = [Mesh(np.array(devs[:2]), ("data",)), Mesh(np.array(devs[2:]), ("data",)),
                  Mesh(np.array(devs[::-1][:2]), ("data",))]
        x = np.zeros((4, 2), np.float32)
        rows = []
        for _ in range(2):  # the second pass answers from the memo
            for mesh in meshes:
                for spec in (P("data"), P()):
                    a = jax.device_put(x, NamedSharding(mesh, spec))
                    (sig,) = _cache.arg_signature((a,))[1]
                    rows.append([sig.sharding, _sharding.sharding_signature(a.sharding)])
        (one,) = _cache.arg_signature((jax.device_put(x, devs[1]),))[1]
        print(json.dumps({"rows": rows, "one": one.sharding}))
    """)
    assert all(mine == fresh for mine, fresh in got["rows"])
    assert len({mine for mine, _ in got["rows"]}) == 6  # three meshes x split/replicated
    assert got["one"] is None
