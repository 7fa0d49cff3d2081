"""The GPU protocol: everything a session lent an accelerator measures first, as one command.

A GPU is lent to some sessions only, for minutes (a whole protocol must fit one call of about ten minutes
and leave time to run it again). So this script runs, in order of what users feel most, each stage in its
own process with a time limit of its own, writing as it goes:

1. **environment**: backend, device kind, versions (`env.json`);
2. **step loop**: `bench_step.py` on its three models (dispatch-bound MLP, mid MLP, causal LM, sized for the
   backend) against the hand-written `jax.jit` + optax loop, with `steps_per_execution` 1, 4 and 16
   (`step.json`). Goals on an accelerator: the MLPs <= 0.8x, the LM <= 1.0x, K=16 on the dispatch-bound
   MLP <= 0.1x;
3. **restart**: `bench_restart.py`, a kernel restart from the program store against the `jax.jit` loop
   with JAX's persistent cache (`restart.json`);
4. **suite**: the test suite on the accelerator (`suite.log`), with pytest-xdist where it is installed. A
   test dependency missing on the machine (the GPU image has JAX, Flax, Equinox and pytest, not the Jupyter
   stack) is named, and the suite runs without the files that need it.

Then `summary.md`: one table of every figure against its goal. Stages that do not fit the time left
(`--budget`) are skipped with a line saying so; a stage that crashes or runs out of time is reported and
the next one runs. On the CPU the same script runs unchanged (`--quick`: each stage's short form and a
collection-only suite; CI runs it so), which is how its plumbing is tested where no GPU is.

Usage:
    python3 benchmarks/gpu_protocol.py --out DIR               # the whole protocol (DIR: $OUT on the device)
    python3 benchmarks/gpu_protocol.py --out DIR --stages step,restart   # one device call; `suite` in a second
    python3 benchmarks/gpu_protocol.py --out DIR --budget 540  # stop starting stages past 540 s
    python3 benchmarks/gpu_protocol.py --quick                 # the CPU smoke run
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# What the test suite imports beyond JAX and pytest: where one is missing, the files that need it are left
# out (and named), rather than the whole suite failing at collection.
SUITE_NEEDS = {"IPython": "the extension, magics, shells", "ipywidgets": "the panel and messages",
               "ipykernel": "kernel tests", "jupyter_client": "kernel tests", "nbclient": "notebook tests",
               "nbformat": "notebook tests", "watchdog": "the file watcher", "flax": "Flax models",
               "equinox": "Equinox models", "optax": "every test", "tqdm": "progress"}
GOALS = {  # steady-step figure -> its goal on an accelerator (issues 39 and 48); none on the CPU
    "dispatch-bound MLP": 0.8, "mid MLP": 0.8, "causal LM": 1.0, "dispatch-bound MLP, K=16": 0.1,
}


def log(msg: str = "") -> None:
    print(msg, flush=True)


def environment() -> dict:
    import jax

    dev = jax.devices()[0]
    return {"backend": jax.default_backend(), "device": dev.device_kind, "devices": jax.device_count(),
            "python": sys.version.split()[0], "jax": jax.__version__,
            "missing": sorted(m for m in SUITE_NEEDS if importlib.util.find_spec(m) is None)}


def run_stage(name: str, cmd: list, timeout: float, out_dir: str) -> dict:
    """Run one stage's command, its output to `<name>.log`; `{"rc", "seconds", "timed_out"}`."""
    log(f"[{name}] {' '.join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd)}"
        f" (limit {timeout:.0f} s)")
    t0 = time.perf_counter()
    with open(os.path.join(out_dir, f"{name}.log"), "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
            timed_out = False
        except subprocess.TimeoutExpired:
            rc, timed_out = None, True
    seconds = time.perf_counter() - t0
    log(f"[{name}] {'ran out of time' if timed_out else f'exit {rc}'} after {seconds:.0f} s")
    return {"rc": rc, "seconds": seconds, "timed_out": timed_out}


def suite_command(missing: list, quick: bool) -> list:
    """pytest over the suite, without the test files that import a missing dependency."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if quick:
        cmd.append("--collect-only")
    elif importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(min(8, os.cpu_count() or 1))]
    tests = os.path.join(ROOT, "tests")
    for path in sorted(os.listdir(tests)):
        if not path.startswith("test_") or not path.endswith(".py"):
            continue
        with open(os.path.join(tests, path)) as f:
            text = f.read()
        if any(f"import {m}" in text or f"from {m}" in text for m in missing):
            cmd += ["--ignore", os.path.join(tests, path)]
    return cmd


def figures(out_dir: str, env: dict) -> list:
    """`(figure, measured, goal or None)` rows from the stages' JSON."""
    rows = []
    accel = env["backend"] != "cpu"
    step = _read(os.path.join(out_dir, "step.json"))
    for name, r in (step or {}).get("steady", {}).items():
        short = next((g for g in ("dispatch-bound MLP", "mid MLP", "causal LM") if name.startswith(g)),
                     name.split(",")[0])
        k = name.rsplit("K=", 1)[1] if "K=" in name else "1"
        goal = GOALS.get(short if k == "1" else f"{short}, K={k}") if accel else None
        rows.append((f"steady step, {short}, K={k} (nitro / hand loop)", f"{r['ratio']:.3f}x", goal, r["ratio"]))
        rows.append((f"host us/step, {short}, K={k} (nitro | hand)",
                     f"{r['nitro_host_us']:.0f} | {r['hand_host_us']:.0f}", None, None))
    for name, c in (step or {}).get("cold", {}).items():
        rows.append((f"cold first epoch, {name.split(',')[0]} (nitro / hand)", f"{c['ratio']:.2f}x", None, None))
    restart = _read(os.path.join(out_dir, "restart.json"))
    if restart:
        rows.append(("restart / cold, nitro_ipy", f"{restart['restart']:.3f}x", 0.2, restart["restart"]))
        rows.append(("restart ratio / jax.jit + JAX cache's", f"{restart['vs_jax_cache']:.3f}", 0.5,
                     restart["vs_jax_cache"]))
    return rows


def _read(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def summary(out_dir: str, env: dict, stages: dict) -> str:
    lines = [f"# GPU protocol: {env['device']} ({env['backend']}, {env['devices']} device(s)), "
             f"Python {env['python']}, jax {env['jax']}", "",
             "| stage | result | seconds |", "|---|---|---|"]
    for name, s in stages.items():
        result = s.get("skipped") or ("ran out of time" if s.get("timed_out") else f"exit {s['rc']}")
        lines.append(f"| {name} | {result} | {s.get('seconds', 0):.0f} |")
    lines += ["", "| figure | measured | goal | verdict |", "|---|---|---|---|"]
    for label, measured, goal, value in figures(out_dir, env):
        verdict = "-" if goal is None else ("pass" if value <= goal else "MISS")
        lines.append(f"| {label} | {measured} | {'-' if goal is None else f'<= {goal}'} | {verdict} |")
    if env["missing"]:
        lines += ["", "Not installed here, so the suite ran without the files that need them: "
                  + ", ".join(env["missing"]) + " (carry them as wheels: the device tool's README)."]
    suite_log = os.path.join(out_dir, "suite.log")
    if os.path.exists(suite_log):
        with open(suite_log) as f:
            tail = [line for line in f.read().splitlines() if line.strip()][-1:]
        lines += ["", f"Suite: {tail[0] if tail else '(no output)'}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="directory for the logs, JSON and summary.md (default: a temp dir)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds: no stage starts past them (default 540, what one device call allows with room"
                        " for a rerun; 1800 with --quick, a smoke run on a loaded CPU)")
    p.add_argument("--quick", action="store_true", help="each stage's short form, a collection-only suite")
    p.add_argument("--stages", default="step,restart,suite",
                   help="which stages, in order (a device call of ten minutes fits `step,restart`; `suite` in a"
                        " second call)")
    args = p.parse_args(argv)
    if args.budget is None:
        args.budget = 1800.0 if args.quick else 540.0
    out_dir = args.out or tempfile.mkdtemp(prefix="gpu_protocol_")
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.perf_counter()
    env = environment()
    with open(os.path.join(out_dir, "env.json"), "w") as f:
        json.dump(env, f, indent=1)
    log(f"GPU protocol on {env['device']} ({env['backend']}), jax {env['jax']}; output in {out_dir}")
    quick = ["--quick"] if args.quick else []
    # (name, command, the share of the budget it may take at most, the least it needs to be worth starting)
    plan = [
        ("step", [sys.executable, os.path.join(HERE, "bench_step.py"), *quick,
                  "--per-execution", "16" if args.quick else "4,16",
                  "--json", os.path.join(out_dir, "step.json")], 0.45, 60),
        ("restart", [sys.executable, os.path.join(HERE, "bench_restart.py"), *quick,
                     "--json", os.path.join(out_dir, "restart.json")], 0.25, 40),
        ("suite", suite_command(env["missing"], args.quick), 1.0, 60),
    ]
    wanted = [x.strip() for x in args.stages.split(",") if x.strip()]
    unknown = sorted(set(wanted) - {name for name, *_ in plan})
    if unknown:
        p.error(f"--stages: unknown stage(s) {', '.join(unknown)}; the stages are step, restart, suite")
    stages = {}
    for name, cmd, share, least in plan:
        if name not in wanted:
            continue
        left = args.budget - (time.perf_counter() - t0)
        if left < least:
            stages[name] = {"skipped": f"skipped: {left:.0f} s of the budget left, {least} s needed"}
            log(f"[{name}] {stages[name]['skipped']}")
            continue
        stages[name] = run_stage(name, cmd, max(least, min(left, share * args.budget)), out_dir)
    text = summary(out_dir, env, stages)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(text)
    log("")
    log(text)
    # Exit 0 unless a stage crashed: a MISS is information, a skipped or timed-out stage is said above, and
    # failed tests (pytest's 1) are in the summary; a suite that cannot even be collected (2-5) crashed.
    return 1 if any(s.get("rc") not in (0, None) and not (n == "suite" and s["rc"] == 1)
                    for n, s in stages.items()) else 0


if __name__ == "__main__":
    sys.exit(main())
