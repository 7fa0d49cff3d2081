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


def json_in_child(code: str, path, hash_seed: str):
    """Run `code` in a fresh Python with `PYTHONHASHSEED=hash_seed` and `path` first on its import path,
    then this process's own (the child must import the same nitro_ipy as we do); the JSON it printed last."""
    pythonpath = os.pathsep.join([str(path), *(p for p in sys.path if p)])
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": pythonpath, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])
