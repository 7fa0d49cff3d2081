"""Where the handle's time goes: the measurements behind the recommendations of `bench_handle.py`.

Each probe isolates one cost with a micro-benchmark (best-of-N and median, on the 120-layer MLP unless
stated) so it can be re-measured after a change:

    python3 benchmarks/profile_handle.py            # every probe (~4 min on 2 cores)
    python3 benchmarks/profile_handle.py loop dispatch recorder optflags rebuild dots convflags levels floor
    python3 benchmarks/profile_handle.py --quick    # every probe, few repetitions, 16 layers: CI's smoke run
    python3 benchmarks/profile_handle.py --json out.json   # also write the measurements as JSON (`-`: stdout)

- `loop`: host-side cost per step of the step loop itself, programs stubbed out (nitro's `_train_epoch`
  vs the hand-written loop): the handle's own Python overhead, no dispatch, no compute.
- `dispatch`: per-step cost of the programs: fused step vs grad + opt, `Compiled.__call__` vs `._call`,
  numpy vs device batches; tiny and 120-layer MLP.
- `recorder`: first call (trace + lower, then XLA) of the grad program without recording and under each
  way of recording this Python offers (3.11: the jaxpr's tracebacks, the default, and sys.setprofile).
- `optflags`: XLA compile time and run time of the optimizer program (242 slices in its unravel) under
  XLA CPU compiler options, next to a per-array (tree) optimizer.
- `rebuild`: `n.rebuild()` after an edit, and three ways to copy the carried state.
- `guard`: the non-finite guard's cost in the optimizer program (XLA compile CPU at 242 arrays, CPU per
  call on the tiny MLP): as built (`lax.cond`), without a guard, and with the updates masked by a select.
- `dots`: first call and run time of MLP gradient programs over a grid of widths and batch sizes, with
  XLA:CPU's YNNPACK multiplies (the default) and without (XLA's own kernels): the data behind
  `_compile.NARROW_DOT`.
- `convflags`: compile CPU time and run time of the gradient programs of two small Flax CNNs and of an
  8-layer MLP, with XLA:CPU's fusion emitters (the default) and with the classic ones: the data behind
  `_compile.CONVOLUTION_OPTIONS`.
- `levels`: compile time and run time of gradient programs over a grid of models (MLPs, attention, a CNN)
  at XLA's backend optimization level 3 and 2: the data behind `_compile.LEVEL`.
- `floor`: what XLA:CPU charges any loop on the deep MLP, whoever writes it: the gradient program's
  kernels (thunks) and its run time per kernel, the cost of passing its parameter arrays one by one (a
  program that reads none of them) and of updating them one by one (242 donated arrays + 1, against one
  flat buffer of the same size): the floor under nitro's steady-state step. Then nitro's step (its grad and
  opt programs) against one program that carries the parameters as one flat buffer, and that program's
  compile time.
"""

import argparse
import gc
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as H  # noqa: E402
import _models as M  # noqa: E402
from _harness import log  # noqa: E402

CLOSURE = M.recording_mode()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import nitro_ipy  # noqa: E402
from nitro_ipy import Nitro  # noqa: E402
from nitro_ipy._training import _ahead, _guard, _programs
from nitro_ipy._compiler import _cache, _compile, _reuse
from nitro_ipy._base import _report

DEEP = dict(in_dim=16, width=32, depth=120, batch=64)
TINY = dict(in_dim=8, width=32, depth=1, batch=32)
OUT: dict = {}

# How many repetitions each probe makes; `--quick` measures the same things, fewer times and on a smaller
# grid, so its figures are indicative only.
FULL = dict(loop_steps={"tiny": 2000, "deep": 400}, loop_reps=7, dispatch_inner={"tiny": 300, "deep": 20},
            dispatch_rounds=5, recorder_rounds=7, optflags=None, optflag_rounds=5, rebuild_edits=5,
            dot_widths=(16, 32, 64, 128, 256), dot_batches=(8, 64, 256), dot_rounds=7, conv_rounds=5,
            level_rounds=7, conv_cases=None, conv_flags=None, level_cases=None)
# The quick run's "deep" MLP has 16 layers, not 120: the same code paths, without paying the 120-layer
# programs' compiles (4 s for its optimizer program alone) in CI's smoke run.
QUICK = dict(depth=H.QUICK_DEPTH, loop_steps={"tiny": 200, "deep": 40}, loop_reps=3, dispatch_inner={"tiny": 30, "deep": 2},
             dispatch_rounds=1, recorder_rounds=1, optflags=("default", "O0"), optflag_rounds=1, rebuild_edits=2,
             dot_widths=(32, 256), dot_batches=(8,), dot_rounds=2, conv_rounds=1,
             level_rounds=1, conv_cases=("two-conv CNN",), conv_flags=("fusion emitters", "classic O1"),
             level_cases=("1-layer MLP, 32 wide, batch 32", "two-conv CNN"))
CFG = FULL


def chosen(cases: dict, names) -> dict:
    """`cases` cut to `names` (all of them when None): the quick run measures a few of a grid."""
    return cases if names is None else {k: v for k, v in cases.items() if k in names}


def arrays() -> int:
    """The deep MLP's parameter arrays: a weight and a bias per layer, and the output layer's two."""
    return 2 * DEEP["depth"] + 2


def best(fn, reps: int, inner: int, sync=lambda: None) -> dict:
    """Best and median per call (us) of `inner` calls of `fn`, over `reps` repetitions; plus the main
    thread's CPU time per call (median)."""
    wall, cpu = [], []
    fn()
    sync()
    for _ in range(reps):
        gc.collect()
        c0, t0 = time.thread_time(), time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        wall.append((time.perf_counter() - t0) / inner * 1e6)
        cpu.append((time.thread_time() - c0) / inner * 1e6)
    return {"best_us": min(wall), "median_us": statistics.median(wall), "cpu_median_us": statistics.median(cpu)}


def show(label: str, r: dict):
    log(f"   {label:<52}{r['best_us']:>10.1f} us best {r['median_us']:>10.1f} us median "
        f"{r['cpu_median_us']:>10.1f} us cpu")


def handle_for(cells, cfg, steps=64, name="Exp"):
    cls = cells.define_experiment(name, **{k: cfg[k] for k in ("in_dim", "width", "depth")})
    data = M.make_data(cfg["batch"] * steps, cfg["in_dim"])
    n = Nitro(cls(), data={"train": data}, batch_size=cfg["batch"], progress=False)
    n.train()
    ent = {e.kind: e for e in _cache.live_entries() if e.key.owner.endswith("." + name)}
    return n, data, ent


# ---------------------------------------------------------------------------------------------- probes
def probe_loop(cells):
    """The step loop's own host cost: programs replaced by stubs returning their inputs' worth."""
    log("loop: host cost per step with the programs stubbed out (slicing + loop + handle bookkeeping)")
    res = {}
    for label, cfg in (("tiny", TINY), ("deep", DEEP)):
        steps = CFG["loop_steps"][label]
        nitro_ipy.cache_reset()
        n, data, ent = handle_for(cells, cfg, steps, name=f"Loop{label}")
        grad, opt = ent["grad"], ent["opt"]
        g_out = grad.call(n._params, None, n._dev, {k: v[: cfg["batch"]] for k, v in data.items()}, None)
        real = grad.call, opt.call
        grad.call = lambda p, st, d, b, r: g_out  # (flat grads, loss, model state)
        opt.call = lambda p, g, s, d, loss, guard, st, new: (p, s, guard, new)
        try:
            r_n = best(lambda: n.train(), CFG["loop_reps"], 1)
        finally:
            grad.call, opt.call = real
        params = M.init_mlp(jax.random.PRNGKey(0), cfg["in_dim"], cfg["width"], cfg["depth"])
        loss = jnp.zeros(())
        b = M.Baseline(lambda p, s, x, y: (p, s, loss), optax.adam(1e-3), params, data, cfg["batch"])
        r_b = best(lambda: b.run_epoch(), CFG["loop_reps"], 1)
        per = lambda r: {k: v / steps for k, v in r.items()}
        res[label] = {"nitro": per(r_n), "baseline": per(r_b)}
        show(f"{label}: baseline loop, step stubbed", per(r_b))
        show(f"{label}: nitro train(), grad+opt stubbed", per(r_n))
    OUT["loop"] = res


def probe_dispatch(cells):
    log("dispatch: per-step cost of the programs (no host slicing; device or numpy batch)")
    res = {}
    for label, cfg in (("tiny", TINY), ("deep", DEEP)):
        inner = CFG["dispatch_inner"][label]
        nitro_ipy.cache_reset()
        n, data, ent = handle_for(cells, cfg, name=f"Disp{label}")
        G, O = ent["grad"].call, ent["opt"].call
        Gc, Oc = G._call, O._call
        bs = cfg["batch"]
        xb = {"x": data["x"][:bs], "y": data["y"][:bs]}
        xd = jax.device_put(xb)
        step, opt = cells.define_baseline()
        p0 = M.init_mlp(jax.random.PRNGKey(0), cfg["in_dim"], cfg["width"], cfg["depth"])
        bst = [p0, opt.init(p0)]
        nst = [n._params, n._opt_state]
        dev = n._dev
        guard = [_guard.fresh(_guard.n_parts(n._layout, n._model.split.trainable(n._params), dev))]
        sync = lambda: jax.block_until_ready((nst, bst))

        def base(batch):
            def f():
                bst[0], bst[1], _ = step(bst[0], bst[1], batch["x"], batch["y"])
            return f

        def nit(batch, g, o):
            def f():
                fg, loss, _ = g(nst[0], None, dev, batch, None)
                nst[0], nst[1], guard[0], _ = o(nst[0], fg, nst[1], dev, loss, guard[0], None, None)
            return f

        fg0, loss0, _ = G(nst[0], None, dev, xd, None)
        last = [fg0]

        def grad_only():  # waits for its output: the timed loop's sync only covers params and state
            last[0] = G(nst[0], None, dev, xd, None)[0]
            jax.block_until_ready(last[0])

        def opt_only():
            nst[0], nst[1], guard[0], _ = O(nst[0], fg0, nst[1], dev, loss0, guard[0], None, None)

        rows = [
            ("baseline fused step, numpy batch", base(xb)),
            ("baseline fused step, device batch", base(xd)),
            ("nitro grad + opt, numpy batch", nit(xb, G, O)),
            ("nitro grad + opt, device batch", nit(xd, G, O)),
            ("nitro grad + opt via Compiled._call, device batch", nit(xd, Gc, Oc)),
            ("nitro grad only, device batch", grad_only),
            ("nitro opt only", opt_only),
        ]
        out = {}
        # interleave the rows, several rounds, keep each row's best and median
        acc = {k: [] for k, _ in rows}
        for _ in range(CFG["dispatch_rounds"]):
            for k, f in rows:
                acc[k].append(best(f, 3, inner, sync))
        for k, _ in rows:
            rs = acc[k]
            out[k] = {"best_us": min(r["best_us"] for r in rs),
                      "median_us": statistics.median(r["median_us"] for r in rs),
                      "cpu_median_us": statistics.median(r["cpu_median_us"] for r in rs)}
            show(f"{label}: {k}", out[k])
        res[label] = out
    OUT["dispatch"] = res


def probe_recorder(cells):
    log(f"recorder: first call (trace+lower, then XLA) of the grad program at {arrays()} arrays, per way of recording")
    from nitro_ipy import _closure

    nitro_ipy.cache_reset()
    n, data, _ = handle_for(cells, DEEP, 8, name="Rec")
    batch = {k: v[: DEEP["batch"]] for k, v in data.items()}
    args = (n._params, None, n._dev, batch, None)
    modes = ["monitoring", "traceback"] if sys.version_info >= (3, 12) else ["traceback", "profile"]
    functions = {}

    def first_call(mode):
        """As `compile_program` does: record the trace (or not), lower, compile. -> (trace+lower, XLA) s"""
        fn = _programs.make_gradient(n._view, n._forward, n._loss, ("x",), ("y",), n._model, 1)
        if mode is not None:
            os.environ["NITRO_IPY_RECORDER"] = mode
        try:
            t0 = time.perf_counter()
            if mode is None:
                lowered = jax.jit(fn).trace(*args).lower()
            else:
                with _closure.record() as rec:
                    traced = jax.jit(fn).trace(*args)
                    rec.traced(traced.jaxpr, fn)
                lowered = traced.lower()
                functions[mode] = sorted(d.qualname for d in rec.closure.functions)
            t1 = time.perf_counter()
            lowered.compile()
            return t1 - t0, time.perf_counter() - t1
        finally:
            os.environ.pop("NITRO_IPY_RECORDER", None)

    for m in (None, *modes):  # warm-up: JAX's and nitro_ipy's own first-use costs
        first_call(m)
    sides = (None, *modes)  # interleaved, the order alternating against drift
    res = dict(zip(sides, H.interleaved(CFG["recorder_rounds"], *[lambda m=m: first_call(m) for m in sides])))
    out = {"default_mode": modes[0], "functions": functions}
    med = lambda rows, j: statistics.median(row[j] for row in rows)  # noqa: E731
    base_trace, base_total = med(res[None], 0), statistics.median(a + b for a, b in res[None])
    for m, rows in res.items():
        total = statistics.median(a + b for a, b in rows)
        out[m or "plain"] = {"trace_lower_s": med(rows, 0), "xla_s": med(rows, 1), "first_call_s": total,
                             "trace_added_pct": (med(rows, 0) / base_trace - 1) * 100,
                             "first_call_added_pct": (total / base_total - 1) * 100}
        o = out[m or "plain"]
        log(f"   {m or 'plain':<12} trace+lower {o['trace_lower_s']:.3f} s  XLA {o['xla_s']:.3f} s  "
            f"first call {o['first_call_s']:.3f} s  ({o['trace_added_pct']:+.0f}% trace, "
            f"{o['first_call_added_pct']:+.1f}% first call; medians of {CFG['recorder_rounds']})")
    for m, fns in functions.items():
        log(f"   {m} saw {fns}")
    OUT["recorder"] = out


OPT_FLAGS = {
    "default": None,
    "no fusion emitters": {"xla_cpu_use_fusion_emitters": False},
    "no fusion emitters + O1": {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 1},
    "no fusion emitters + O0": {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 0},
    "O0": {"xla_backend_optimization_level": 0},
}


def probe_optflags(cells):
    log(f"optflags: optimizer program at {arrays()} arrays: XLA compile seconds and run time per call")
    nitro_ipy.cache_reset()
    n, _, ent = handle_for(cells, DEEP, 8, name="Flags")
    layout, dev = n._layout, n._dev
    fn = _programs.make_optimizer(n._view, n._optimizer, n._model)
    params, state = n._params, n._opt_state
    flat = layout.ravel(params)
    tx = optax.adam(1e-3)
    progs, out = {}, {}
    # The optimizer program as the handle runs it: with the step's loss and the non-finite guard.
    loss = jnp.zeros((), jnp.float32)
    guard = _guard.fresh(_guard.n_parts(layout, n._model.split.trainable(params), dev))
    lowered = jax.jit(fn, donate_argnums=(0, 2)).lower(params, flat, state, dev, loss, guard, None, None)
    for name, opts in OPT_FLAGS.items():
        if CFG["optflags"] is not None and name not in CFG["optflags"]:
            continue
        t0 = time.perf_counter()
        try:
            progs[name] = lowered.compile(compiler_options=opts) if opts else lowered.compile()
        except Exception as err:  # an option this XLA does not know
            log(f"   {name:<36} unavailable: {str(err)[:80]}")
            continue
        out[name] = {"xla_s": time.perf_counter() - t0}

    def tree_opt(p, g, s):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    t0 = time.perf_counter()
    tl = jax.jit(tree_opt, donate_argnums=(0, 2)).lower(params, params, tx.init(params))
    t1 = time.perf_counter()
    progs["tree (per-array adam)"] = tl.compile()
    out["tree (per-array adam)"] = {"xla_s": time.perf_counter() - t1, "trace_s": t1 - t0}
    grads_tree = jax.tree.map(jnp.copy, params)
    tree = "tree (per-array adam)"
    states = {k: [jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, state) if k != tree
                  else tx.init(params)] for k in progs}

    def runner(k):
        c, st = progs[k], states[k]
        if k != tree:
            def f():
                st[0], st[1], *_ = c(st[0], flat, st[1], dev, loss, guard, None, None)
        else:
            def f():
                st[0], st[1] = c(st[0], grads_tree, st[1])
        return f, lambda: jax.block_until_ready(st)

    acc = {k: [] for k in progs}
    for _ in range(CFG["optflag_rounds"]):
        for k in progs:
            f, sync = runner(k)
            acc[k].append(best(f, 3, 20, sync))
    for k in progs:
        out[k].update(best_us=min(r["best_us"] for r in acc[k]),
                      median_us=statistics.median(r["median_us"] for r in acc[k]))
        log(f"   {k:<44} XLA {out[k]['xla_s']:>6.2f} s   run {out[k]['best_us']:>8.1f} us best "
            f"{out[k]['median_us']:>8.1f} us median")
    OUT["optflags"] = out


def probe_rebuild(cells):
    log(f"rebuild: n.rebuild() after a class edit, and copying the carried state ({arrays()} + 3 arrays)")
    nitro_ipy.cache_reset()
    n, _, _ = handle_for(cells, DEEP, 8, name="Reb")
    times = []
    for k in range(CFG["rebuild_edits"]):
        cells.define_experiment("Reb", **{x: DEEP[x] for x in ("in_dim", "width", "depth")},
                                loss_expr=M.edited_loss(100 + k))
        nitro_ipy.bump_world()
        t0 = time.perf_counter()
        n = n.rebuild()
        times.append(time.perf_counter() - t0)
    tree = (n._params, n._opt_state)
    ways = {
        "tree.map(x.copy()) (now)": lambda t: jax.tree.map(lambda x: x.copy(), t),
        "jax.device_put(tree, may_alias=False)": lambda t: jax.device_put(t, may_alias=False),
        "one jitted copy of the tree": jax.jit(lambda t: jax.tree.map(jnp.copy, t)),
    }
    out = {"rebuild_s": times}
    log(f"   rebuild: first {times[0] * 1e3:.1f} ms, then {min(times[1:]) * 1e3:.1f} ms best")
    for name, f in ways.items():
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(f(tree))
            ts.append(time.perf_counter() - t0)
        out[name] = {"first_ms": ts[0] * 1e3, "best_after_ms": min(ts[1:]) * 1e3}
        log(f"   {name:<42} first {ts[0] * 1e3:>8.1f} ms   then {min(ts[1:]) * 1e3:>7.1f} ms best")
    OUT["rebuild"] = out


def probe_dots(cells):
    """Behind `_compile.NARROW_DOT`: for MLP gradient programs (8 layers) over a grid of widths and batch
    sizes, the first call of a new program (YNNPACK builds its runtime per multiply there) and the run time
    after it, with YNNPACK (XLA's default) and without (XLA's own kernels)."""
    log("dots: gradient program of an 8-layer MLP, multiplies by YNNPACK (default) vs XLA's own kernels")
    log(f"   {'width':>5}{'batch':>6} | {'first call: ynn':>16}{'own':>8} | {'run: ynn':>10}{'own':>10}{'own/ynn':>9}")
    out = []
    for width in CFG["dot_widths"]:
        for batch in CFG["dot_batches"]:
            params = M.init_mlp(jax.random.PRNGKey(0), width, width, 8)
            x = jnp.ones((batch, width), jnp.float32)
            y = jnp.zeros((batch,), jnp.float32)
            grad = jax.value_and_grad(lambda p, x, y: jnp.mean((M.mlp_forward(p, x) - y) ** 2))
            row, progs = {"width": width, "batch": batch}, {}
            for name, opts in (("ynn", {}), ("own", _compile.WITHOUT_YNN)):
                c = jax.jit(grad).lower(params, x, y).compile(compiler_options=opts)
                t0 = time.perf_counter()
                jax.block_until_ready(c(params, x, y))
                row[f"first_ms_{name}"] = (time.perf_counter() - t0) * 1e3
                progs[name] = c
            for name in progs:  # interleaved rounds, median of each side
                row[f"run_us_{name}"] = []
            for _ in range(CFG["dot_rounds"]):
                for name, c in progs.items():
                    t0 = time.perf_counter()
                    for _ in range(20):
                        res = c(params, x, y)
                    jax.block_until_ready(res)
                    row[f"run_us_{name}"].append((time.perf_counter() - t0) / 20 * 1e6)
            for name in progs:
                row[f"run_us_{name}"] = statistics.median(row[f"run_us_{name}"])
            row["own_over_ynn"] = row["run_us_own"] / row["run_us_ynn"]
            out.append(row)
            log(f"   {width:>5}{batch:>6} | {row['first_ms_ynn']:>13.1f} ms{row['first_ms_own']:>5.1f} ms |"
                f"{row['run_us_ynn']:>7.0f} us{row['run_us_own']:>7.0f} us{row['own_over_ynn']:>8.2f}x")
    OUT["dots"] = out


def probe_guard(cells):
    """The non-finite guard's cost: the optimizer program as the handle builds it (`_guard.gated`, one
    `lax.cond` around the update) against the same update without a guard and against the earlier form
    (updates masked by a select, state selected back). XLA compile CPU seconds (this process, every thread:
    steadier than wall time on a shared machine) at 242 arrays, and main-thread CPU per call on the tiny
    MLP."""
    log("guard: optimizer program with the guard as built (cond), without one, and with masked updates")
    out = {}
    for label, cfg in (("deep", DEEP), ("tiny", TINY)):
        nitro_ipy.cache_reset()
        n, data, ent = handle_for(cells, cfg, 4, name=f"Guard{label}")
        b, model = n._binding, n._model
        split, layout = model.split, model.layout
        built = _programs.make_optimizer(b.view, b.optimizer, model, True)

        def step(params, flat_grads, opt_state, dev):
            tx = b.optimizer(b.view(dev))
            trainable = split.trainable(params)
            updates, new_state = tx.update(flat_grads, opt_state, layout.ravel(trainable))
            return split.with_trainable(params, optax.apply_updates(trainable, layout.unravel(updates))), new_state

        def unguarded(params, flat_grads, opt_state, dev, loss, guard, model_state, new_model_state):
            return (*step(params, flat_grads, opt_state, dev), guard, new_model_state)

        def masked(params, flat_grads, opt_state, dev, loss, guard, model_state, new_model_state):
            apply, guard = _guard.decide(guard, _guard.parts(loss, flat_grads, dev), True)
            tx = b.optimizer(b.view(dev))
            trainable = split.trainable(params)
            updates, new_state = tx.update(flat_grads, opt_state, layout.ravel(trainable))
            updates = jax.tree.map(lambda u: jnp.where(apply, u, jnp.zeros_like(u)), updates)
            new_params = split.with_trainable(params, optax.apply_updates(trainable, layout.unravel(updates)))
            return new_params, _guard.select(apply, new_state, opt_state), guard, new_model_state

        batch = {k: v[: cfg["batch"]] for k, v in data.items()}
        flat, loss, _ = ent["grad"].call(n._params, None, n._dev, batch, None)
        guard = _guard.fresh(_guard.n_parts(layout, split.trainable(n._params), n._dev))
        args = (n._params, flat, n._opt_state, n._dev, loss, guard, None, None)
        res, progs = {}, {}
        for name, fn in (("guard (cond), as built", built), ("no guard", unguarded), ("masked updates", masked)):
            low = jax.jit(fn, donate_argnums=(0, 2, 5)).lower(*args)
            c0 = time.process_time()
            progs[name] = _compile.xla_compile(low, _programs.OPT.compiler_options)[0]
            res[name] = {"xla_cpu_s": time.process_time() - c0}
        if label == "tiny":
            for name, c in progs.items():
                st = [jax.tree.map(jnp.copy, n._params), jax.tree.map(jnp.copy, n._opt_state), jnp.asarray(guard)]

                def f(c=c, st=st):
                    st[0], st[1], st[2], _ = c(st[0], flat, st[1], n._dev, loss, st[2], None, None)
                res[name].update(best(f, CFG["dispatch_rounds"] * 3, CFG["dispatch_inner"]["tiny"] * 3,
                                      lambda st=st: jax.block_until_ready(st)))
        for name, r in res.items():
            extra = f"{r['cpu_median_us']:>9.1f} us cpu/call {r['best_us']:>9.1f} us best" if "best_us" in r else ""
            log(f"   {label}: {name:<28} XLA {r['xla_cpu_s']:>6.2f} s cpu   {extra}")
        out[label] = res
    OUT["guard"] = out



def mlp_loss(in_dim: int, width: int, depth: int, batch: int):
    """`(loss, args)`: the mean squared error of a `depth`-layer MLP, and its params and a batch."""
    args = (M.init_mlp(jax.random.PRNGKey(0), in_dim, width, depth), jnp.ones((batch, in_dim)), jnp.zeros((batch,)))
    return (lambda p, x, y: jnp.mean((M.mlp_forward(p, x) - y) ** 2)), args


def flax_cnns() -> dict:
    """`{name: (loss, args)}`: a Conv + BatchNorm CNN and a two-Conv CNN (Flax), cross-entropy on a batch of
    64 8x8 images, differentiated in their params."""
    import flax.linen as nn

    class BN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.BatchNorm(use_running_average=False)(nn.Conv(8, (3, 3))(x)))
            return nn.Dense(10)(x.reshape((x.shape[0], -1)))

    class TwoConv(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(8, (3, 3))(nn.relu(nn.Conv(8, (3, 3))(x))))
            return nn.Dense(10)(x.reshape((x.shape[0], -1)))

    class ResBlock(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.relu(nn.BatchNorm(use_running_average=False)(nn.Conv(16, (3, 3))(x)))
            return nn.relu(x + nn.BatchNorm(use_running_average=False)(nn.Conv(16, (3, 3))(h)))

    class ResNet(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(16, (3, 3))(x))
            for _ in range(3):
                x = ResBlock()(x)
            return nn.Dense(10)(x.mean((1, 2)))

    def cnn(module, side=8, channels=1):
        x, y = jnp.ones((64, side, side, channels), jnp.float32), jnp.zeros((64,), jnp.int32)
        v = module.init(jax.random.PRNGKey(0), x)

        def loss(p, x, y):
            out, _ = module.apply({**v, "params": p}, x, mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()

        return loss, (v["params"], x, y)

    return {"conv + batchnorm CNN": cnn(BN()), "two-conv CNN": cnn(TwoConv()),
            "3-block ResNet, 32x32x3": cnn(ResNet(), 32, 3)}


def probe_convflags(cells):
    """Behind `_compile.CONVOLUTION_OPTIONS`: the gradient program (forward, loss, backward) of a Conv +
    BatchNorm CNN, of a two-Conv CNN and of an 8-layer MLP, each compiled with the fusion emitters and
    with the classic ones; the process's CPU time of the XLA compile (steadier than wall time on a busy
    machine) and the run time after it, medians of interleaved rounds."""
    cases = chosen({**flax_cnns(), "8-layer MLP (32 wide)": mlp_loss(16, 32, 8, 64)}, CFG["conv_cases"])
    flags = {"fusion emitters": {}, "classic emitters": {"xla_cpu_use_fusion_emitters": False},
             "classic O1": {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 1},
             "classic O2": {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 2},
             "classic cheap LLVM": {"xla_cpu_use_fusion_emitters": False, "xla_llvm_disable_expensive_passes": True},
             "classic O1 cheap LLVM": {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 1,
                                       "xla_llvm_disable_expensive_passes": True}}
    flags = chosen(flags, CFG["conv_flags"])
    log("convflags: gradient programs, XLA compile CPU time and run time, fusion emitters vs classic")
    out = {}
    for case, (loss, args) in cases.items():
        row = {name: {"compile_cpu_s": [], "compile_s": [], "run_us": []} for name in flags}
        for _ in range(CFG["conv_rounds"]):
            for name, opts in flags.items():
                jax.clear_caches()
                lowered = jax.jit(jax.value_and_grad(loss)).lower(*args)
                c0, w0 = time.process_time(), time.perf_counter()
                c = lowered.compile(compiler_options=dict(opts))
                row[name]["compile_cpu_s"].append(time.process_time() - c0)
                row[name]["compile_s"].append(time.perf_counter() - w0)
                jax.block_until_ready(c(*args))
                t0 = time.perf_counter()
                for _ in range(20):
                    res = c(*args)
                jax.block_until_ready(res)
                row[name]["run_us"].append((time.perf_counter() - t0) / 20 * 1e6)
        row = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in row.items()}
        out[case] = row
        for name, r in row.items():
            log(f"   {case:<24} {name:<22} compile {r['compile_cpu_s']:.2f} s CPU, {r['compile_s']:.2f} s wall; "
                f"run {r['run_us']:.0f} us")
    OUT["convflags"] = out


def probe_levels(cells):
    """Behind `_compile.LEVEL`: gradient programs over a grid of models (MLPs narrow and wide, shallow and
    120 deep, a small attention block, a CNN), each compiled with nitro's option policy at XLA's backend
    optimization level 3 (its default) and 2. Compile wall time, median over rounds (a distinct dump limit
    per compile keeps JAX's in-memory cache from answering), and run time as the median over interleaved
    pairs of level 2 / level 3."""

    def attention(d=32, t=16, b=16, blocks=2):
        key = jax.random.PRNGKey(1)
        init = lambda i, shape: jax.random.normal(jax.random.fold_in(key, i), shape) * 0.1
        ps = [{"qkv": init(5 * i, (d, 3 * d)), "o": init(5 * i + 1, (d, d)), "g": jnp.ones(d),
               "up": init(5 * i + 2, (d, 4 * d)), "down": init(5 * i + 3, (4 * d, d))} for i in range(blocks)]

        def norm(x, g):
            m = x.mean(-1, keepdims=True)
            return g * (x - m) * jax.lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5)

        def loss(ps, x, y):
            for p in ps:
                q, k, v = jnp.split(norm(x, p["g"]) @ p["qkv"], 3, -1)
                x = x + (jax.nn.softmax(q @ k.swapaxes(-1, -2) / d ** 0.5, -1) @ v) @ p["o"]
                x = x + jax.nn.gelu(norm(x, p["g"]) @ p["up"]) @ p["down"]
            return optax.softmax_cross_entropy_with_integer_labels(x[:, -1, :], y).mean()

        return loss, (ps, jnp.ones((b, t, d)), jnp.zeros((b,), jnp.int32))

    deep = f"{DEEP['depth']}-layer MLP, 32 wide"
    cases = {"1-layer MLP, 32 wide, batch 32": mlp_loss(8, 32, 1, 32), "8-layer MLP, 32 wide": mlp_loss(16, 32, 8, 64),
             deep: mlp_loss(16, 32, DEEP["depth"], 64), "4-layer MLP, 256 wide": mlp_loss(64, 256, 4, 64),
             "attention, 2 blocks": attention(), "two-conv CNN": flax_cnns()["two-conv CNN"]}
    cases = chosen(cases, CFG["level_cases"])
    log("levels: gradient programs under nitro's option policy, XLA backend optimization level 3 vs 2")
    out = {}
    stamp = iter(range(10**6))
    for case, (loss, args) in cases.items():
        fn = jax.value_and_grad(loss)
        lowered = jax.jit(fn).lower(*args)
        policy = _compile.program_options(jax.make_jaxpr(fn)(*args).jaxpr)
        policy.pop(_compile.OPTIMIZATION_LEVEL_OPTION, None)
        opts = lambda level: {**policy, _compile.OPTIMIZATION_LEVEL_OPTION: level,  # noqa: E731
                              "xla_dump_max_hlo_modules": 10**6 + next(stamp)}
        compile_s, progs = {3: [], 2: []}, {}
        for _ in range(CFG["level_rounds"]):
            for level in compile_s:
                t0 = time.perf_counter()
                progs[level] = lowered.compile(compiler_options=opts(level))
                compile_s[level].append(time.perf_counter() - t0)
        inner = CFG["dispatch_inner"]["deep" if case == deep else "tiny"]
        runs = {3: [], 2: []}
        for r in range(CFG["level_rounds"] * 2):
            for level in ((3, 2) if r % 2 else (2, 3)):
                c = progs[level]
                runs[level].append(best(lambda: jax.block_until_ready(c(*args)), 1, inner)["best_us"])
        pairs = [b / a for a, b in zip(runs[3], runs[2])]
        row = {"compile_s": {lv: statistics.median(v) for lv, v in compile_s.items()},
               "run_us": {lv: statistics.median(v) for lv, v in runs.items()},
               "run_ratio": statistics.median(pairs), "run_ratio_range": (min(pairs), max(pairs))}
        out[case] = row
        log(f"   {case:<32} compile {row['compile_s'][3]:.3f} -> {row['compile_s'][2]:.3f} s "
            f"({row['compile_s'][2] / row['compile_s'][3]:.2f}x); run {row['run_us'][3]:8.1f} -> "
            f"{row['run_us'][2]:8.1f} us (pairs {row['run_ratio']:.2f}x, {min(pairs):.2f}-{max(pairs):.2f})")
    OUT["levels"] = out


def probe_floor(cells):
    log(f"floor: per-kernel and per-array costs of XLA:CPU at {arrays()} arrays (nitro's own programs and "
        "stand-ins)")
    nitro_ipy.cache_reset()
    n, data, ent = handle_for(cells, DEEP, name="Floor")
    _ahead.wait(), _reuse.wait()  # the handle's background compiles would share the 2 cores with the timing
    G = ent["grad"].call
    hlo = G.as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    kernels = {op: len(re.findall(rf"= \S+ {op}\(", entry)) for op in ("fusion", "dot", "concatenate")}
    bs = DEEP["batch"]
    batch = jax.device_put({"x": data["x"][:bs], "y": data["y"][:bs]})
    params, dev, inner = n._params, n._dev, CFG["dispatch_inner"]["deep"]
    grad = best(lambda: jax.block_until_ready(G(params, None, dev, batch, None)), CFG["dispatch_rounds"], inner)
    flat = n._layout.ravel(params)["float32"]
    # padded to a multiple of 8: XLA:CPU's fusion emitters run an elementwise kernel over an odd-sized
    # buffer about 4x slower (126241 floats: 187 us, 126240: 44 us), which is not what this measures
    flat = jnp.pad(flat, (0, -flat.size % 8))
    x = batch["x"]
    reads = {"one array": (jax.jit(lambda p, x: x[0, 0] + 1).lower(flat, x).compile(), flat),
             f"{arrays()} arrays": (jax.jit(lambda p, x: x[0, 0] + 1).lower(params, x).compile(), params)}
    many = max(50, inner * 10)
    call = {k: best(lambda c=c, a=a: c(a, x), CFG["dispatch_rounds"], many, lambda: None) for k, (c, a) in reads.items()}
    step = jax.jit(lambda p: jax.tree.map(lambda a: a * 0.999 + 1e-3, p), donate_argnums=0)
    held = {"one array": [jnp.array(flat)], f"{arrays()} arrays": [jax.tree.map(jnp.array, params)]}
    programs = {k: step.lower(h[0]).compile() for k, h in held.items()}

    def update(k):
        def f():
            held[k][0] = programs[k](held[k][0])
        return f

    upd = {k: best(update(k), CFG["dispatch_rounds"], many, lambda k=k: jax.block_until_ready(held[k][0]))
           for k in held}
    steps, fused_xla_s = flat_step(n, ent, batch, flat, inner)
    count = sum(kernels[k] for k in ("fusion", "dot", "concatenate"))
    out = {"grad_kernels": kernels, "grad_us": grad["median_us"], "grad_us_per_kernel": grad["median_us"] / count,
           "call_us": {k: v["median_us"] for k, v in call.items()},
           "update_us": {k: v["median_us"] for k, v in upd.items()},
           "step_us": {k: v["median_us"] for k, v in steps.items()}, "flat_step_compile_s": fused_xla_s}
    log(f"   gradient program: {kernels['dot']} multiplies + {kernels['fusion']} fusions + "
        f"{kernels['concatenate']} concatenation; {grad['median_us']:.0f} us a call, "
        f"{out['grad_us_per_kernel']:.2f} us a kernel")
    for k in reads:
        log(f"   a program that reads none of its inputs, given {k:<12} {call[k]['median_us']:>8.1f} us a call")
    for k in held:
        log(f"   update {k:<12} in place (donated, a * 0.999 + 1e-3)        {upd[k]['median_us']:>8.1f} us a call")
    for k, v in steps.items():
        log(f"   a training step, {k:<38} {v['median_us']:>8.1f} us")
    log(f"   (the flat program's trace + XLA compile: {fused_xla_s:.2f} s)")
    OUT["floor"] = out


def flat_step(n, ent, batch, fp, inner: int) -> tuple:
    """`({label: timing}, compile seconds)`: nitro's step (its two programs, as the step loop calls them)
    against one program that carries the parameters as one flat buffer (`fp`: the layout's, padded) and
    slices them apart itself: what the per-array costs leave on the table, and the XLA compile that would
    buy it back."""
    G, O, dev, x, y = ent["grad"].call, ent["opt"].call, n._dev, batch["x"], batch["y"]
    nst = [jax.tree.map(jnp.array, n._params), jax.tree.map(jnp.array, n._opt_state),
           _guard.fresh(_guard.n_parts(n._layout, n._model.split.trainable(n._params), dev))]

    def nitro_step():
        fg, loss, _ = G(nst[0], None, dev, batch, None)
        nst[0], nst[1], nst[2], _ = O(nst[0], fg, nst[1], dev, loss, nst[2], None, None)

    layout, tx = n._layout, optax.adam(1e-3)
    loss_of, _ = mlp_loss(DEEP["in_dim"], DEEP["width"], DEEP["depth"], DEEP["batch"])

    def fused(fp, opt_state, x, y):
        value, grads = jax.value_and_grad(loss_of)(layout.unravel({"float32": fp}), x, y)
        flat_grads = layout.ravel(grads)["float32"]
        updates, opt_state = tx.update(jnp.pad(flat_grads, (0, fp.size - flat_grads.size)), opt_state)
        return optax.apply_updates(fp, updates), opt_state, value

    t0 = time.perf_counter()
    options = _compile.program_options(jax.make_jaxpr(fused)(fp, tx.init(fp), x, y).jaxpr)
    F = jax.jit(fused, donate_argnums=(0, 1)).lower(fp, tx.init(fp), x, y).compile(compiler_options=options)
    compile_s = time.perf_counter() - t0
    fst = [jnp.array(fp), tx.init(fp)]

    def fused_step():
        fst[0], fst[1], _ = F(fst[0], fst[1], x, y)

    rounds = CFG["dispatch_rounds"]
    return {"nitro's grad + opt programs": best(nitro_step, rounds, inner, lambda: jax.block_until_ready(nst)),
            "one program over a flat buffer": best(fused_step, rounds, inner, lambda: jax.block_until_ready(fst))}, compile_s


PROBES = {"loop": probe_loop, "dispatch": probe_dispatch, "recorder": probe_recorder,
          "optflags": probe_optflags, "rebuild": probe_rebuild, "dots": probe_dots,
          "convflags": probe_convflags, "guard": probe_guard, "levels": probe_levels, "floor": probe_floor}


def main(argv=None) -> int:
    global CFG

    def probe(name: str) -> str:
        if name not in PROBES:
            raise argparse.ArgumentTypeError(f"unknown probe {name}; choose from {', '.join(PROBES)}")
        return name

    args = H.parse_args(__doc__, argv, quick="every probe with few repetitions (CI's smoke run)",
                        extra=lambda p: p.add_argument("probes", nargs="*", type=probe, metavar="PROBE",
                                                       help=f"any of {', '.join(PROBES)} (default: all)"))
    CFG = QUICK if H.quick() else FULL
    DEEP["depth"] = CFG.get("depth", DEEP["depth"])
    _report.set_sink(lambda m: None)  # compile lines would interleave with the tables
    cells = M.Cells()
    log(f"nitro_ipy handle profile: {H.env_line(f'closure recording: {CLOSURE}')}")
    for name in args.probes or PROBES:
        PROBES[name](cells)
    OUT["load_end"] = os.getloadavg()[0]
    return H.finish(OUT)


if __name__ == "__main__":
    sys.exit(main())
