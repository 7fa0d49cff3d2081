"""`notebooks/digits_cnn.ipynb`, executed headless in a real kernel: a Flax CNN with Dropout + BatchNorm
on sklearn digits trains past 90% validation accuracy, a layer edited in its module file is picked up by a
rebuild that recompiles exactly the programs that traced it. Costs one kernel run, ~30 s on 2 cores."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "digits_cnn.ipynb"
COMPILED = re.compile(r"^nitro_ipy: compiled (\S+) \[", re.M)


@pytest.fixture(scope="module")
def outputs():
    spec = importlib.util.spec_from_file_location("nitro_demo", ROOT / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    nb, error = demo.execute_notebook(str(NOTEBOOK))
    assert error is None, str(error)
    return {c.source.splitlines()[0]: "".join(_text(o) for o in c.outputs) for c in nb.cells if c.cell_type == "code"}


def _text(output) -> str:
    """A stream's text, or a display's plain-text form (the stale messages are widgets in a notebook)."""
    if output.output_type == "stream":
        return output.text
    if output.output_type == "display_data":
        return output.data.get("text/plain", "") + "\n"
    return ""


def test_stored_without_outputs():
    import nbformat

    nb = nbformat.read(str(NOTEBOOK), as_version=4)
    nbformat.validate(nb)
    assert all(not c.get("outputs") and not c.get("execution_count") for c in nb.cells if c.cell_type == "code")


def test_trains_past_90_percent_with_the_acceptance_counts(outputs):
    out = outputs["nitro_ipy.cache_reset()"]
    assert COMPILED.findall(out) == ["grad", "opt", "eval"]
    assert re.search(r"CacheStats\(hits=\d+, misses=3, entries=3\)", out)
    accuracy = float(re.search(r"valid accuracy: ([0-9.]+)", out).group(1))
    assert accuracy > 0.90


def test_the_file_edit_recompiles_grad_and_eval_only(outputs):
    out = outputs["before = nitro_ipy.cache_stats().misses"]
    assert "redefined: digits_model.CNN.__call__" in out
    stale = "! this handle's compiled programs had dependency methods redefined: digits_model.CNN.__call__ (eval, grad)."
    assert stale in out
    assert COMPILED.findall(out) == ["grad", "eval"]
    assert "recompiled: 2\n" in out
    accuracy = float(re.search(r"valid accuracy after the edit: ([0-9.]+)", out).group(1))
    assert accuracy > 0.90
