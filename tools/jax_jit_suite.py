"""Run JAX's own jit tests against `jax.jit` and against `nitro_ipy.jit`, and compare the pass sets.

JAX's test files are not part of this repository: give the path of a JAX checkout at the installed
version's tag (the tests change between releases), for example

    git --git-dir=<jax mirror> archive jax-v0.10.2 tests conftest.py pyproject.toml | tar -x -C /tmp/jax
    python3 tools/jax_jit_suite.py /tmp/jax --modes plain,nitro

The tests run are the classes JitTest, APITest and BufferDonationTest of `tests/api_test.py`, and
`tests/jax_jit_test.py`, serially, in one pytest process per mode:

- `plain`: as JAX ships them (`jax.jit`);
- `nitro`: `jax.jit` is `nitro_ipy.jit` before the test files are imported, so both the tests' `jit`
  (`from jax import jit`) and their `jax.jit` calls make a `nitro_ipy.jit`;
- `adopted`: `nitro_ipy.set_honest_jit(True)`, the switch that routes `jax.jit` to `nitro_ipy.jit` for
  the user's own functions (skipped, with a line, where this nitro_ipy has no such switch).

It prints each mode's counts and the tests whose outcome differs from `plain`'s. `--json PATH` writes
the per-test outcomes too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = ("tests/api_test.py::JitTest", "tests/api_test.py::APITest", "tests/api_test.py::BufferDonationTest",
           "tests/jax_jit_test.py")
MODES = ("plain", "nitro", "adopted")
_MODE_ENV = "NITRO_IPY_JAX_SUITE_MODE"


# ---------------------------------------------------------------- the pytest plugin (in the test process)
def pytest_configure(config):  # noqa: ARG001 - pytest's hook signature
    mode = os.environ.get(_MODE_ENV, "plain")
    if mode == "plain":
        return
    import jax

    import nitro_ipy

    if mode == "nitro":
        jax.jit = nitro_ipy.jit
    elif mode == "adopted":
        nitro_ipy.set_honest_jit(True)


# ---------------------------------------------------------------- the driver
def run_mode(jax_root: str, mode: str, extra: list[str], log: str | None = None) -> dict[str, str]:
    """`{test id: "passed" | "failed" | "skipped"}` of one pytest run in `mode` (its output in
    `<log>.<mode>.txt` when `log` is given)."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "junit.xml")
        env = dict(os.environ, **{_MODE_ENV: mode, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
                                  "NITRO_IPY_CACHE_DIR": "",
                                  "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))})
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "tools.jax_jit_suite", "-p", "no:cacheprovider",
               f"--junitxml={xml}", "-o", "junit_family=xunit1", *extra, *TARGETS]
        proc = subprocess.run(cmd, cwd=jax_root, env=env, capture_output=True, text=True)
        if log:
            with open(f"{log}.{mode}.txt", "w") as f:
                f.write(proc.stdout + proc.stderr)
        if not os.path.exists(xml):
            raise SystemExit(f"{mode}: pytest wrote no report (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
                             f"\n{proc.stderr[-3000:]}")
        return _outcomes(xml)


def _outcomes(path: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}.{case.get('name')}"
        tags = {child.tag for child in case}
        outcome = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
        # A test with failing subtests is reported once per subtest: any failure fails the test.
        if out.get(name) != "failed":
            out[name] = outcome
    return out


def _counts(outcomes: dict[str, str]) -> str:
    values = list(outcomes.values())
    return ", ".join(f"{values.count(k)} {k}" for k in ("passed", "failed", "skipped"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jax_root", help="a JAX checkout at the installed version's tag (holds tests/)")
    parser.add_argument("--modes", default="plain,nitro,adopted")
    parser.add_argument("--json", help="write every test's outcome per mode here")
    parser.add_argument("-k", help="pytest's -k expression, to run a subset")
    parser.add_argument("--log", help="keep each mode's pytest output in <LOG>.<mode>.txt")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if any(m not in MODES for m in modes):
        parser.error(f"--modes takes {', '.join(MODES)}; got {args.modes!r}")
    if not os.path.exists(os.path.join(args.jax_root, "tests", "api_test.py")):
        parser.error(f"{args.jax_root}/tests/api_test.py not found: give a JAX checkout (see this file's docstring)")
    extra = ["-k", args.k] if args.k else []
    results: dict[str, dict[str, str]] = {}
    for mode in modes:
        if mode == "adopted":
            sys.path.insert(0, REPO)
            import nitro_ipy

            if not hasattr(nitro_ipy, "set_honest_jit"):
                print("adopted: skipped (this nitro_ipy has no `set_honest_jit`)")
                continue
        results[mode] = run_mode(args.jax_root, mode, extra, args.log)
        print(f"{mode}: {_counts(results[mode])}", flush=True)
    base = results.get("plain")
    if base is not None:
        for mode, outcomes in results.items():
            if mode == "plain":
                continue
            lost = sorted(t for t, o in base.items() if o == "passed" and outcomes.get(t) != "passed")
            gained = sorted(t for t, o in outcomes.items() if o == "passed" and base.get(t) != "passed")
            print(f"{mode} vs plain: {len(lost)} pass only under plain, {len(gained)} only under {mode}")
            for t in lost:
                print(f"  - {t} ({outcomes.get(t, 'absent')})")
            for t in gained:
                print(f"  + {t}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
