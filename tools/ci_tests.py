"""Install and run the test suite on every supported Python found on this machine (3.11, 3.12, 3.13).

For each interpreter: `pip install -e ".[test]"` into a virtual environment under `.ci/venvs/` (made on
first use, remade with `--fresh`), then `pytest -q`. The interpreter running this script is used as it is
(the README's test command has just installed the package into it), so CI pays two fresh installs, not
three, and pays them while the first Python's tests run. The tests that do not depend on the Python minor
version (browser and export rendering, meshes and processes, checkpoints, the server's save hook, Flax and
Equinox models, the pages and the digits notebook: `ONCE_PER_CI` in `tests/conftest.py`) run on the first
Python only. Fails if any Python's suite fails or an install fails; a Python that is not on the machine is
skipped with a line saying so (CI wants all three: `--require-all`). The last line is a pytest-style
summary over every Python: `N passed, N failed, ...`.

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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSIONS = ("3.11", "3.12", "3.13")
_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?)")


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


def install(version: str, exe: str, fresh: bool) -> Path:
    """The venv of `version`, with this checkout installed editable with its test extra (the running
    interpreter itself when it is `version` and not `fresh`)."""
    if not fresh and Path(exe) == Path(sys.executable):
        return Path(sys.executable)
    env_dir = ROOT / ".ci" / "venvs" / version
    if fresh and env_dir.exists():
        shutil.rmtree(env_dir)
    if not (env_dir / "bin" / "python").exists():
        subprocess.run([exe, "-m", "venv", str(env_dir)], check=True)
    py = env_dir / "bin" / "python"
    t0 = time.perf_counter()
    # Captured: it may run beside another Python's tests (`main`), whose output it would break up. Shown
    # whole when it fails.
    done = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-e",
                           f"{ROOT}[test]"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        sys.stdout.write(done.stdout)
        raise subprocess.CalledProcessError(done.returncode, done.args)
    print(f"[ci] Python {version}: installed in {time.perf_counter() - t0:.0f} s", flush=True)
    return py


def run_tests(version: str, py: Path, pytest_args: list, once: bool = True) -> dict:
    """Run pytest with `py`; returns the counts of its summary line (`{"passed": N, ...}`) and `rc`.
    Unless `once`, the tests that run once per CI run are skipped (`tests/conftest.py`'s `ONCE_PER_CI`)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # test this checkout, via the venv
    if not once:
        env["NITRO_IPY_CI_ONCE"] = "0"
    t0 = time.perf_counter()
    proc = subprocess.Popen([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    last = ""
    for line in proc.stdout:
        sys.stdout.write(line)
        if _COUNT.search(line):
            last = line
    rc = proc.wait()
    counts = {}
    for n, word in _COUNT.findall(last):
        word = {"error": "errors", "warning": "warnings"}.get(word, word)
        counts[word] = counts.get(word, 0) + int(n)
    shown = last.strip(" =\n") or "no summary"
    print(f"[ci] Python {version}: {shown} (rc {rc}, "
          f"{time.perf_counter() - t0:.0f} s)", flush=True)
    return {"rc": rc, **counts}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", action="append", choices=VERSIONS, help="only these versions")
    parser.add_argument("--fresh", action="store_true", help="recreate each virtual environment")
    parser.add_argument("--require-all", action="store_true", help="fail when a version is not found")
    parser.add_argument("--install-only", action="store_true", help="install, do not run the tests")
    parser.add_argument("pytest_args", nargs="*", help="after `--`: passed to pytest")
    args = parser.parse_args(argv)
    totals, failed_versions, ran_once = {}, [], False
    found = {}
    for version in args.python or VERSIONS:
        found[version] = find_python(version)
        if found[version] is None:
            print(f"[ci] Python {version}: not found on this machine, skipped", flush=True)
            if args.require_all:
                failed_versions.append(version)
    # One install at a time, in order, in the background: a later Python's install (mostly downloading
    # and unpacking, about 110 s each on 2 cores) runs while an earlier Python's tests do.
    installs = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    pending = {v: installs.submit(install, v, exe, args.fresh) for v, exe in found.items() if exe is not None}
    installs.shutdown(wait=False)
    for version, future in pending.items():
        try:
            py = future.result()
        except subprocess.CalledProcessError as err:
            print(f"[ci] Python {version}: install failed ({err})", flush=True)
            failed_versions.append(version)
            continue
        if args.install_only:
            continue
        # What does not depend on the Python minor version runs on the first Python only.
        result = run_tests(version, py, args.pytest_args, once=not ran_once)
        ran_once = True
        if result.pop("rc") != 0:
            failed_versions.append(version)
        for k, v in result.items():
            totals[k] = totals.get(k, 0) + v
    order = ("failed", "passed", "skipped", "deselected", "xfailed", "xpassed", "warnings", "errors")
    totals.setdefault("failed", 0)
    totals.setdefault("passed", 0)
    summary = ", ".join(f"{totals[k]} {k}" for k in order if k in totals)
    where = f" (failing on Python {', '.join(failed_versions)})" if failed_versions else ""
    print(f"{summary} on Python {', '.join(args.python or VERSIONS)}{where}", flush=True)
    return 1 if failed_versions else 0


if __name__ == "__main__":
    sys.exit(main())
