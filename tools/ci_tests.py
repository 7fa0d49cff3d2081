"""Install and run the test suite on every supported Python found on this machine (3.11, 3.12, 3.13).

For each interpreter: `pip install -e ".[test]"` into a virtual environment under `.ci/venvs/` (made on
first use, remade with `--fresh`), then `pytest -q`. The interpreter running this script is used as it is
(the README's test command has just installed the package into it), so CI pays two fresh installs, not
three, and those are lean: a Python that skips the once-per-CI tests gets `.[test-core]` (no JupyterLab,
no Playwright), installed without compiling every file to bytecode; one import of the libraries the tests
use then writes the bytecode they need (about 60 s an install instead of 115 s on 2 cores). The tests
that do not depend on the Python minor version (browser and export rendering, meshes and processes,
checkpoints, the server's save hook, Flax and Equinox models, the pages and the digits
notebook: `ONCE_PER_CI` in `tests/conftest.py`) run on the first Python only. The tests that depend on
JAX's release but not on the interpreter's (`ONCE_PER_JAX`: the data pipeline, groups, the program
store, kernels, faults, ...) run on the first Python of each JAX release: 3.11 (JAX 0.10) and 3.12
(0.12), not again on 3.13, which gets 3.12's JAX and the same recorder (`sys.monitoring`). 3.13 runs
what its bytecode, frames and threads can change: the recorder, fingerprints, closures, staleness,
trace reuse, compile ahead, the extension, `nitro_ipy.jit`, errors and messages.

On a machine with 2 cores or more, two lanes run side by side (`--serial`: one Python after the other):
the first Python's tests, their output shown as it comes; and the later Pythons' tests, one after the
other, each one's output shown whole when it ends. A pytest run keeps about 1.1-1.4 cores busy (tracing
is one Python thread), so the two lanes share 2 cores with little loss. The installs run one at a time
(each writes this checkout's egg-info) in the background, from the start.

When a lane ends it touches the file named by `NITRO_IPY_CI_LANE_FREE`, if set: `.ci/run` then starts
its benchmarks on the core that lane leaves idle, beside the other lane's tests.

Fails if any Python's suite fails or an install fails; a Python that is not on the machine is skipped
with a line saying so (CI wants all three: `--require-all`). The last line is a pytest-style summary over
every Python: `N passed, N failed, ...`.

    python3 tools/ci_tests.py                 # every Python found
    python3 tools/ci_tests.py --python 3.12   # one of them
    python3 tools/ci_tests.py -- -k watch     # arguments after `--` go to pytest
"""

import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSIONS = ("3.11", "3.12", "3.13")
_SAY = threading.Lock()
_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?)")


def say(text: str) -> None:
    """Write whole lines, never broken up by the other lane's."""
    with _SAY:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()


def find_python(version: str) -> str | None:
    """An interpreter of `version`: on PATH as `python3.X`, or under pyenv's versions directory."""
    if "%d.%d" % sys.version_info[:2] == version:
        return sys.executable
    found = shutil.which(f"python{version}")
    if found and _version_of(found) == version:
        return found
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for candidate in sorted(root.glob(f"{version}.*"), reverse=True):
        exe = candidate / "bin" / "python3"
        if exe.exists() and _version_of(str(exe)) == version:
            return str(exe)
    return None


def _version_of(exe: str) -> str | None:
    try:
        out = subprocess.run([exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


# What the tests import, imported once after a venv's install with bytecode writing on: pip's own
# compile of every installed file (`--no-compile` skips it) costs more CPU than the rest of the install.
WARM = ("jax, jax.numpy, jaxlib, optax, numpy, tqdm, flax.linen, flax.nnx, equinox, IPython, ipykernel.kernelapp, "
        "ipywidgets, jupyter_client, nbclient, nbformat, watchdog.observers, platformdirs, pytest")


def install(version: str, exe: str, fresh: bool, once: bool = True) -> Path:
    """The venv of `version`, with this checkout installed editable with its test extra (the running
    interpreter itself when it is `version` and not `fresh`); `.[test-core]` unless it runs the
    once-per-CI tests (`once`)."""
    if not fresh and Path(exe) == Path(sys.executable):
        return Path(sys.executable)
    env_dir = ROOT / ".ci" / "venvs" / version
    if fresh and env_dir.exists():
        shutil.rmtree(env_dir)
    if not (env_dir / "bin" / "python").exists():
        subprocess.run([exe, "-m", "venv", str(env_dir)], check=True)
    py = env_dir / "bin" / "python"
    t0 = time.perf_counter()
    # Captured: it runs beside the other lane's tests, whose output it would break up. Shown whole when it
    # fails.
    extra = "test" if once else "test-core"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPATH")}
    for step in ([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile", "-e",
                  f"{ROOT}[{extra}]"], [str(py), "-c", f"import {WARM}"]):
        done = subprocess.run(step, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.returncode != 0:
            say(done.stdout)
            raise subprocess.CalledProcessError(done.returncode, done.args)
    say(f"[ci] Python {version}: installed in {time.perf_counter() - t0:.0f} s")
    return py


def jax_version(py: Path) -> str | None:
    """The JAX release installed for `py` (from its metadata: JAX is not imported)."""
    try:
        out = subprocess.run([str(py), "-c", "import importlib.metadata as m; print(m.version('jax'))"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def run_tests(version: str, py: Path, pytest_args: list, once: bool = True, live: bool = True,
              jax_once: bool = True) -> dict:
    """Run pytest with `py`; returns the counts of its summary line (`{"passed": N, ...}`) and `rc`.
    Unless `once`, the tests that run once per CI run are skipped (`tests/conftest.py`'s `ONCE_PER_CI`);
    unless `jax_once`, also those that run once per JAX release (`ONCE_PER_JAX`). Its output is shown as
    it comes when `live`, else whole at its end."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # test this checkout, via the venv
    if not once:
        env["NITRO_IPY_CI_ONCE"] = "0"
    if not jax_once:
        env["NITRO_IPY_CI_JAX_ONCE"] = "0"
    t0 = time.perf_counter()
    if not live:
        say(f"[ci] Python {version}: tests started; their output comes whole when they end")
    proc = subprocess.Popen([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    last, kept = "", []
    for line in proc.stdout:
        if live:
            say(line)
        else:
            kept.append(line)
        if _COUNT.search(line):
            last = line
    rc = proc.wait()
    counts = {}
    for n, word in _COUNT.findall(last):
        word = {"error": "errors", "warning": "warnings"}.get(word, word)
        counts[word] = counts.get(word, 0) + int(n)
    shown = last.strip(" =\n") or "no summary"
    if kept:
        say(f"[ci] ---- Python {version}'s pytest output ----\n" + "".join(kept) + f"[ci] ---- end of Python {version} ----")
    say(f"[ci] Python {version}: {shown} (rc {rc}, {time.perf_counter() - t0:.0f} s)")
    return {"rc": rc, **counts}


def first_of_its_jax(version: str, py: Path, every: dict) -> bool:
    """Whether `version` is the first Python (in `VERSIONS` order) of those installed (`every`: version ->
    the future of its install) to get its JAX release: it runs the once-per-JAX tests."""
    mine = jax_version(py)
    for earlier in VERSIONS[:VERSIONS.index(version)]:
        if earlier in every:
            try:
                if jax_version(every[earlier].result()) == mine:
                    return False
            except subprocess.CalledProcessError:
                continue
    return True


def lane(installs: dict, args, once: str | None, live: bool, every: dict | None = None) -> list:
    """Test each Python of `installs` (version -> the future of its install) in turn, once installed;
    version `once` runs the once-per-CI tests too, and the first Python of each JAX release of `every`
    (all the installs) the once-per-JAX tests. Returns (version, result) pairs, a result being None
    when the install failed."""
    out = []
    for version, installed in installs.items():
        try:
            py = installed.result()
        except subprocess.CalledProcessError as err:
            say(f"[ci] Python {version}: install failed ({err})")
            out.append((version, None))
            continue
        if not args.install_only:
            jax_once = first_of_its_jax(version, py, every or installs)
            if not jax_once:
                say(f"[ci] Python {version}: JAX {jax_version(py)}, as an earlier Python's: the once-per-JAX "
                    "tests are skipped")
            out.append((version, run_tests(version, py, args.pytest_args, once=version == once, live=live,
                                           jax_once=jax_once)))
    lane_free = os.environ.get("NITRO_IPY_CI_LANE_FREE")
    if lane_free:  # `.ci/run` starts its benchmarks on the core this lane leaves idle
        Path(lane_free).touch()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", action="append", choices=VERSIONS, help="only these versions")
    parser.add_argument("--fresh", action="store_true", help="recreate each virtual environment")
    parser.add_argument("--require-all", action="store_true", help="fail when a version is not found")
    parser.add_argument("--install-only", action="store_true", help="install, do not run the tests")
    parser.add_argument("--serial", action="store_true", help="one Python after the other, not two lanes")
    parser.add_argument("pytest_args", nargs="*", help="after `--`: passed to pytest")
    args = parser.parse_args(argv)
    failed_versions, found = [], {}
    for version in args.python or VERSIONS:
        exe = find_python(version)
        if exe is not None:
            found[version] = exe
            continue
        say(f"[ci] Python {version}: not found on this machine, skipped")
        if args.require_all:
            failed_versions.append(version)
    # One install at a time, in order, in the background (each writes this checkout's egg-info).
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as installer:
        versions = list(found)
        once = versions[0] if versions else None  # the first Python found runs the once-per-CI tests
        installs = {v: installer.submit(install, v, exe, args.fresh, once=v == once) for v, exe in found.items()}
        if args.serial or (os.cpu_count() or 1) < 2 or len(versions) < 2:
            results = lane(installs, args, once, live=True)
        else:
            rest = {v: installs[v] for v in versions[1:]}
            with concurrent.futures.ThreadPoolExecutor(max_workers=1) as second_lane:
                later = second_lane.submit(lane, rest, args, once, False, installs)
                results = lane({versions[0]: installs[versions[0]]}, args, once, live=True, every=installs)
                results += later.result()
    totals = {}
    for version, result in sorted(results, key=lambda r: VERSIONS.index(r[0])):
        if result is None or result.pop("rc") != 0:
            failed_versions.append(version)
        for k, v in (result or {}).items():
            totals[k] = totals.get(k, 0) + v
    order = ("failed", "passed", "skipped", "deselected", "xfailed", "xpassed", "warnings", "errors")
    totals.setdefault("failed", 0)
    totals.setdefault("passed", 0)
    summary = ", ".join(f"{totals[k]} {k}" for k in order if k in totals)
    where = f" (failing on Python {', '.join(failed_versions)})" if failed_versions else ""
    say(f"{summary} on Python {', '.join(args.python or VERSIONS)}{where}")
    return 1 if failed_versions else 0


if __name__ == "__main__":
    sys.exit(main())
