"""User modules for tests: written to a temporary directory and imported here, or in a fresh Python."""

import importlib
import json
import os
import subprocess
import sys
import textwrap


def import_source(tmp_path, monkeypatch, name: str, source: str):
    """Write `source` as module `name` in `tmp_path`, import it (fresh) and return it."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module(name)


def child_env(path, hash_seed: str = "0") -> dict:
    """The environment of a child Python: `PYTHONHASHSEED=hash_seed`, `path` first on its import path, then
    this process's own (the child must import the same nitro_ipy as we do), JAX on the CPU."""
    pythonpath = os.pathsep.join([str(path), *(p for p in sys.path if p)])
    return {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": pythonpath, "JAX_PLATFORMS": "cpu"}


def last_json(stdout: str):
    """The JSON a child printed last."""
    return json.loads(stdout.strip().splitlines()[-1])


def json_in_child(code: str, path, hash_seed: str, timeout: float | None = None):
    """Run `code` in a fresh Python (`child_env`), within `timeout` seconds; the JSON it printed last. A
    failing child's stderr is in the error."""
    out = subprocess.run([sys.executable, "-c", code], env=child_env(path, hash_seed), capture_output=True,
                         text=True, timeout=timeout)
    if out.returncode:
        raise AssertionError(f"the child failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return last_json(out.stdout)
