"""`notebooks/quickstart.ipynb`, executed headless in a real kernel (nbclient, by `tools/nbrun.py`, the
runner `demo.py` prints it with).

One execution for the module; each test reads its outputs.
"""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository's tools/ (not installed with the package)
from tools import nbrun  # noqa: E402

NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
STALE_LINE = "! this handle's compiled programs had dependency methods redefined: __main__.huber (eval, grad)."
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
COMPILED = re.compile(r"^nitro_ipy: compiled (\S+) \[", re.M)


@pytest.fixture(scope="module")
def executed():
    nb, error = nbrun.execute_notebook(str(NOTEBOOK))
    assert error is None, str(error)
    return nb


def _cell(nb, startswith: str):
    (cell,) = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith(startswith)]
    return cell


def _stream(cell) -> str:
    return "".join(o.text for o in cell.outputs if o.output_type == "stream")


def _text(cell) -> str:
    """What a plain-text reader of the saved cell sees: printed lines and every display's text/plain."""
    parts = []
    for o in cell.outputs:
        if o.output_type == "stream":
            parts.append(o.text)
        elif o.output_type == "display_data" and o.data.get("text/plain"):
            parts.append(o.data["text/plain"] + "\n")
    return "".join(parts)


def _displays(cell) -> list:
    return [o.data for o in cell.outputs if o.output_type == "display_data"]


def test_the_notebook_is_stored_without_outputs():
    import nbformat

    nb = nbformat.read(str(NOTEBOOK), as_version=4)
    nbformat.validate(nb)
    assert all(not c.get("outputs") and not c.get("execution_count") for c in nb.cells if c.cell_type == "code")


def test_acceptance_check(executed):
    cell = _cell(executed, "nitro_ipy.cache_reset(); n = Nitro(e")
    out = _text(cell)
    assert COMPILED.findall(out) == ["grad", "opt", "eval"]
    assert "nitro_ipy:" not in _stream(cell)  # every line is the reporter's: none is raw text
    # One progress display for the call, ending as its lines: the compiles and the epoch line.
    (progress,) = [d for d in _displays(cell) if "nitro-progress" in d.get("text/html", "")]
    lines = progress["text/plain"].splitlines()
    assert [line.split()[1] for line in lines] == ["compiled", "compiled", "compiled", "epoch"]
    assert lines[3].startswith("nitro_ipy: epoch 1 | loss ") and " | valid_mae " in lines[3]
    assert "CacheStats(hits=21, misses=3, entries=3)\nmisses == entries: True\n" in out


def test_more_epochs_compile_nothing(executed):
    cell = _cell(executed, "n.train(3)")
    assert COMPILED.findall(_text(cell)) == []
    (progress,) = _displays(cell)
    assert [line.split()[:3] for line in progress["text/plain"].splitlines()] == [
        ["nitro_ipy:", "epoch", "2"], ["nitro_ipy:", "epoch", "3"], ["nitro_ipy:", "epoch", "4"]]
    (result,) = [o for o in cell.outputs if o.output_type == "execute_result"]
    assert result.data["text/plain"] == "CacheStats(hits=93, misses=3, entries=3)"


def test_training_the_old_handle_shows_both_messages(executed):
    # The cache-level message is said by the first cell that looks after the edit: with compile ahead on
    # (the default) that is the edit's own cell, which plans the replacements; the handle's, by its train.
    edit, cell = _cell(executed, "def huber(r, delta=0.5)"), _cell(executed, "n.train(1);")
    messages = [d for c in (edit, cell) for d in _displays(c) if "nitro-message" in d.get("text/html", "")]
    assert [m["text/plain"].split(":")[0] for m in messages] == ["nitro_ipy", STALE_LINE.split(":")[0]]
    cache_msg, handle_msg = messages
    assert cache_msg["text/plain"] == (
        "nitro_ipy: 2 cached programs (eval, grad) poisoned; redefined: __main__.huber. Handles built from "
        "now on recompile against the current code."
    )
    assert handle_msg["text/plain"].startswith(STALE_LINE)
    assert "nitro-info" in cache_msg["text/html"] and "nitro-warning" in handle_msg["text/html"]
    # The Rebuild button was retired when the next cell ran (it rebuilt `n` by hand): the saved output says so.
    (button,) = [d for d in _displays(cell) if "nitro-action" in d.get("text/html", "")]
    assert button["text/plain"] == "not clicked before the next cell ran; to use the current code: `n = n.rebuild()`"
    assert COMPILED.findall(_text(cell)) == []  # the old handle keeps its programs: nothing compiles


def test_the_saved_notebook_needs_no_widget(executed):
    """Every output is its final HTML + text: a reopen on a fresh kernel has no widget model to miss."""
    outputs = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs]
    assert [o for o in outputs if WIDGET_VIEW in o.get("data", {})] == []
    assert all({"text/plain", "text/html"} <= set(o.data) for o in outputs if o.output_type == "display_data")
    state = executed.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
    assert state.get("state", {}) == {}


def test_the_rebuilt_handle_recompiles_only_grad_and_eval(executed):
    out = _text(_cell(executed, "n = n.rebuild()"))
    assert COMPILED.findall(out) == ["grad", "eval"]
    assert out.count("(recompiling against edited code: __main__.huber)") == 2
    assert "dependency methods redefined" not in out


def test_nitro_stats(executed):
    cell = _cell(executed, "%nitro_stats")
    (result,) = [o for o in cell.outputs if o.output_type == "execute_result"]
    text = result.data["text/plain"].splitlines()
    assert re.fullmatch(r"nitro_ipy cache: hits \d+ \| misses 5 \| entries 3 \| poisoned 2", text[0])
    assert [line.split()[0] for line in text[2:7]] == ["opt", "grad", "eval", "grad", "eval"]
    assert [line.endswith("poisoned (__main__.huber)") for line in text[2:7]] == [False, False, False, True, True]
    assert "white-space: nowrap'>state</th>" in result.data["text/html"]
    assert "why: GraphConst" not in result.data["text/html"]


def test_the_panel_text_fallback_ends_up_current(executed):
    panel, latest, stop_slot = _displays(_cell(executed, "%nitro_panel"))
    assert stop_slot == {"text/plain": "", "text/html": ""}
    assert latest["text/plain"].startswith("latest compile: eval [forward, loss] in ")
    assert "<svg class='nitro-chart'" in panel["text/html"]  # the chart, saved as SVG
    assert re.fullmatch(
        r"nitro_ipy panel: hits \d+ \| misses 5 \| entries 3 \| poisoned 2 \| latest compile: "
        r"eval \[forward, loss\] in \d+\.\d\d s \(recompiling against edited code: __main__.huber\)",
        panel["text/plain"].splitlines()[0],
    )


def test_demo_prints_what_a_user_sees(executed):
    text = nbrun.render(executed)
    assert "In [6]:\n    nitro_ipy.cache_reset(); n = Nitro(e, batch_size=32, max_epochs=1)" in text
    assert "misses == entries: True" in text
    assert STALE_LINE in text
    assert "0/10 [" not in text  # progress bars closed when their epoch ended, as in the notebook
    assert COMPILED.findall(text) == ["grad", "opt", "eval", "grad", "eval"]
