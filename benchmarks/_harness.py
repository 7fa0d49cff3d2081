"""What every benchmark script shares: the command line, the interleaved runner, the environment line,
the results table with its verdicts, and the JSON output.

- `parse_args(doc, quick=...)`: `--quick` (a short run, what CI's smoke step runs) and `--json [PATH]`
  (`-` or no PATH: JSON on stdout, the human report on stderr); `log()` then writes where the report goes.
- `interleaved(rounds, a, b, ...)`: every side once per round, the order alternating (A B B A ...), so a
  burst of load on a shared machine lands on both sides of a pair. `paired_ratio` is the median over
  rounds of a / b (the figure a target judges); `aa_ratio` runs one side against itself, the noise floor.
- `env_line()`: Python, jax, cpus and load average (at parse time -> now), quick or full.
- `Row` and `finish(res, rows)`: the results table, a verdict per row (`pass`, `MISS`, `-` for context),
  then the JSON. A MISS is information, never a failure: `finish` returns 0 whatever the verdicts, so the
  exit code says only whether the script crashed (CI's smoke run relies on it).

Benchmarks read nitro_ipy's figures through its public and documented internal functions (`cache_stats`,
`_cache.live_entries()` ...); `recorder_mode()` below is the one place that asks a recorder which hook it
installed, which no public function says.
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import NamedTuple

# Every benchmark compares compiles against a hand-written `jit` in one process: a program store (or the
# JAX cache it turns on) left by an earlier run would serve one side and not the other. So the store is
# off here; bench_restart, which measures it, points its children at a directory of its own.
os.environ["NITRO_IPY_CACHE_DIR"] = ""

import jax  # noqa: E402

from nitro_ipy import _closure  # noqa: E402

# The depth of the 120-layer MLP in a `--quick` run (CI's smoke run): the same code paths, at a fraction of
# the 120-layer programs' compiles. Its figures are indicative only.
QUICK_DEPTH = 16

_args = argparse.Namespace(quick=False, json=None)
_started = (time.perf_counter(), os.getloadavg()[0])


def parse_args(doc: str, argv=None, *, quick: str = "a short run (CI's smoke run)", extra=None):
    """The common command line; `extra(parser)` adds a script's own arguments."""
    global _args, _started
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="also write the results as JSON to PATH (`-` or no PATH: stdout, the report to stderr)")
    if extra is not None:
        extra(p)
    _args = p.parse_args(argv)
    _started = (time.perf_counter(), os.getloadavg()[0])
    return _args


def quick() -> bool:
    return bool(_args.quick)


def log(msg: str = "") -> None:
    """A report line: on stdout, or on stderr when the JSON goes to stdout."""
    print(msg, file=sys.stderr if _args.json == "-" else sys.stdout, flush=True)


def elapsed() -> float:
    """Seconds since `parse_args`."""
    return time.perf_counter() - _started[0]


# ---------------------------------------------------------------------------------------------- runner
def settle(timeout: float = 120) -> None:
    """Wait for nitro_ipy's idle-time background work (a compile ahead, a trace-reuse warming): it runs
    in a user's reading time, so no timed side, nitro's or the baseline's, runs beside it."""
    from nitro_ipy._training import _ahead
    from nitro_ipy._compiler import _reuse

    _ahead.wait(timeout)
    _reuse.wait(timeout)


def interleaved(rounds: int, *sides, pause_gc: bool = False) -> list[list]:
    """`rounds` results of each of `sides()`: even rounds in order, odd rounds with the first side moved
    last (for two sides A B B A ...), each after `settle()`. `pause_gc`: a collection before each call and
    the collector off during it, so no side pays for another's garbage. Returns one list of results per
    side."""
    out = [[] for _ in sides]
    order = list(range(len(sides)))
    for r in range(rounds):
        for i in order if r % 2 == 0 else order[1:] + order[:1]:
            settle()
            if not pause_gc:
                out[i].append(sides[i]())
                continue
            gc.collect()
            gc.disable()
            try:
                out[i].append(sides[i]())
            finally:
                gc.enable()
    return out


def paired_ratios(a: list, b: list) -> list[float]:
    """a / b round by round, sorted."""
    return sorted(x / y for x, y in zip(a, b))


def paired_ratio(a: list, b: list) -> float:
    """The median over rounds of a / b: load that hits one round hits both sides of its pair."""
    return statistics.median(paired_ratios(a, b))


def aa_ratio(fn, rounds: int, *, pause_gc: bool = False, best: bool = False) -> float:
    """`fn` interleaved against itself: how far apart two identical sides land on this machine
    (`best`: the ratio of the best of each side, else the paired median)."""
    a, b = interleaved(rounds, fn, fn, pause_gc=pause_gc)
    return min(b) / min(a) if best else paired_ratio(b, a)


# ---------------------------------------------------------------------------------------------- report
def cpu_model() -> str:
    """The CPU's model name and its widest vector extension (`AMD EPYC, avx2`), read from
    /proc/cpuinfo. Ratios hold across machines better than seconds do, but not entirely: the same code
    read 0.58x on a Xeon with AVX-512 and 0.60-0.66x on an AMD EPYC with AVX2, where every XLA kernel
    costs about 4x as long. The figures say which machine measured them."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n")[0]  # the first processor's block
    except OSError:  # not Linux
        import platform

        return platform.processor() or platform.machine()
    info = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in first.splitlines() if ":" in line)}
    flags = set(info.get("flags", "").split())
    isa = next((x for x in ("avx512f", "avx2", "avx", "sse4_2", "asimd") if x in flags), None)
    name = info.get("model name") or info.get("CPU part") or "unknown CPU"
    return f"{name}, {isa}" if isa else name


def env() -> dict:
    return {"python": sys.version.split()[0], "jax": jax.__version__, "cpus": os.cpu_count(), "cpu": cpu_model(),
            "load": [_started[1], os.getloadavg()[0]], "quick": quick()}


def env_line(*extra: str) -> str:
    """`Python 3.11.9, jax 0.4.35, 2 cpus (AMD EPYC, avx2), load 0.4 -> 1.2, quick run[, extra ...]`."""
    e = env()
    parts = [f"Python {e['python']}", f"jax {e['jax']}", f"{e['cpus']} cpus ({e['cpu']})",
             f"load {e['load'][0]:.1f} -> {e['load'][1]:.1f}", "quick run" if e["quick"] else "full run", *extra]
    return ", ".join(parts)


class Row(NamedTuple):
    """One line of the results table; `ok` None is a figure for context (no target)."""

    measurement: str
    measured: str
    target: str = "-"
    ok: bool | None = None
    cpu: str = "-"


def verdict(ok: bool | None) -> str:
    return "-" if ok is None else "pass" if ok else "MISS"


def table(rows: list[Row]) -> None:
    """Print the results table (a CPU column only if some row has a CPU figure)."""
    cpu = any(r.cpu != "-" for r in rows)
    w = max(len(r.measurement) for r in rows)
    log(f"{'measurement':<{w}}  {'measured':>10}" + (f"  {'CPU':>9}" if cpu else "") + f"  {'target':>9}  result")
    log("-" * (w + (43 if cpu else 32)))
    for r in rows:
        log(f"{r.measurement:<{w}}  {r.measured:>10}" + (f"  {r.cpu:>9}" if cpu else "")
            + f"  {r.target:>9}  {verdict(r.ok)}")


def strip(obj):
    """`obj` without the keys starting with `_` (live objects a section hands to the next)."""
    if isinstance(obj, dict):
        return {k: strip(v) for k, v in obj.items() if not k.startswith("_")}
    if isinstance(obj, (list, tuple)):
        return [strip(v) for v in obj]
    return obj


def at_most(label: str, value: float, target: float, digits: int = 2) -> Row:
    """A row for a ratio whose target is `value <= target`, printed with `digits` decimals, or more where
    that many would print a miss as the target itself (0.3002x against 0.30x reads "0.3002x ... MISS")."""
    shown = digits
    while round(value, shown) == round(target, digits) and value != target and shown < 6:
        shown += 1
    return Row(label, f"{value:.{shown}f}x", f"<= {target:.{digits}f}x", value <= target)


def finish(res: dict, rows: list[Row] | None = None) -> int:
    """The results table (if any), then the JSON (if asked). Returns the exit code: 0, whatever the
    verdicts (a timing is information; only an exception fails a run)."""
    if rows:
        log()
        table(rows)
        res["table"] = [r._asdict() | {"result": verdict(r.ok)} for r in rows]
    res.setdefault("env", env())
    if _args.json:
        text = json.dumps(strip(res), indent=2, default=float)
        if _args.json == "-":
            print(text)
        else:
            with open(_args.json, "w") as f:
                f.write(text + "\n")
    return 0


# ---------------------------------------------------------------------------------------------- nitro_ipy
def recorder_mode() -> str:
    """The interpreter hook `_closure.record` installs on this Python: "monitoring", "traceback" or
    "profile" (read from a recorder: no public function says it)."""
    with _closure.record() as rec:
        return rec._mode
