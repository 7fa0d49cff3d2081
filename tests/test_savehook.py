"""The server extension `nitro_ipy_server`: a notebook saved while one of nitro_ipy's buttons is still
live is written with the button's static form, not its widget view (which a reopen on a fresh kernel
shows as "Error displaying widget: model not found"). Only nitro_ipy's own marked outputs change; other
libraries' widgets and every notebook without a live nitro_ipy button are saved exactly as sent; a hook
that fails saves the notebook unchanged.

The hook on real nbformat notebooks and real widget bundles (nitro_ipy's buttons, an ipywidgets slider),
in a real `FileContentsManager`, then a real `jupyter server` through its REST API, loading the
extension from its config (the browser walkthrough saves a live button from JupyterLab itself).
"""

import copy
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import ipywidgets
import nbformat
import pytest
from _browser import SERVER_CONFIG, Server

import nitro_ipy_server
from nitro_ipy._notebook import _widgets

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
ROOT = Path(__file__).resolve().parents[1]
SAVED_REBUILD = "not clicked when the notebook was saved; to use the current code: `n = n.rebuild()`"


def _output(bundle) -> dict:
    """A display_data output as a front end saves it, from a `_repr_mimebundle_` result."""
    data, metadata = bundle if isinstance(bundle, tuple) else (bundle, {})
    return nbformat.v4.new_output("display_data", data=data, metadata=metadata)


class _Handle:
    """What a Rebuild button needs of the stale handle: an object some names hold (a weak reference)."""


def _buttons():
    """A live Rebuild button (its handle held as `n`) and a live Stop button, as nitro_ipy shows them."""
    handle = _Handle()
    rebuild = _widgets.RebuildButton(handle, {"n": handle, "_": handle})
    stop = _widgets.ActionButton(_widgets.STOP, "stop", "danger", "stop", lambda: "stopped",
                                 _widgets.SAVED_STOP.format(what=" of `Regressor` (3 epochs)"), kind="stop")
    return handle, rebuild, stop


def _notebook():
    """A notebook with nitro_ipy's two live buttons, a retired one, another library's widget, and plain
    outputs of every kind, in markdown and code cells."""
    handle, rebuild, stop = _buttons()
    retired = _widgets.ActionButton(_widgets.REBUILD, "t", "warning", "refresh", lambda: "x")
    retired.retire(_widgets.RETIRED_MOVED_ON.format(name="n"))
    slider = ipywidgets.IntSlider(value=3)
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("# a notebook"),
        nbformat.v4.new_code_cell("n.train(1)", outputs=[
            nbformat.v4.new_output("stream", name="stdout", text="nitro_ipy: compiled grad\n"),
            _output(_widgets.message_output(_msg())._repr_mimebundle_()),
            _output(rebuild._repr_mimebundle_())]),
        nbformat.v4.new_code_cell("slider", outputs=[
            nbformat.v4.new_output("execute_result", data=slider._repr_mimebundle_(), execution_count=2)]),
        nbformat.v4.new_code_cell("run = n.train(3, background=True)", outputs=[
            _output(stop._repr_mimebundle_()), _output(retired._repr_mimebundle_())]),
        nbformat.v4.new_code_cell("1/0", outputs=[
            nbformat.v4.new_output("error", ename="ZeroDivisionError", evalue="division by zero", traceback=[]),
            nbformat.v4.new_output("display_data", data={"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"})]),
    ]
    for model in (rebuild.widget, stop.widget, retired.widget, slider):
        model.close()
    return json.loads(json.dumps(nb)), handle  # plain JSON, as the server receives it


def _msg():
    from nitro_ipy._base._report import Kind, Message

    return Message(Kind.STALE_HANDLE, "! this handle's compiled programs had dependency methods redefined",
                   {"handle": None})


def test_only_nitro_ipys_live_buttons_lose_their_widget_view():
    nb, _ = _notebook()
    before = copy.deepcopy(nb)
    assert nitro_ipy_server.strip_live_widgets(nb) == 2
    nbformat.validate(nbformat.from_dict(nb))  # still a valid notebook
    stale = nb["cells"][1]["outputs"][2]
    stop, retired = nb["cells"][3]["outputs"]
    for out, line, live in ((stale, SAVED_REBUILD, "rebuild"), (stop, _widgets.SAVED_STOP.format(
            what=" of `Regressor` (3 epochs)"), "stop")):
        assert set(out["data"]) == {"text/plain", "text/html"}  # the widget view went, the static form stayed
        assert out["data"]["text/plain"] == line
        assert "class='nitro-box nitro-plain nitro-action nitro-saved-live'" in out["data"]["text/html"]
        assert out["metadata"] == {"nitro_ipy": {"live": live, "saved": True}}
    # Everything else is as it was: the slider keeps its view, the retired button its line, the rest too.
    assert retired["data"]["text/plain"] == _widgets.RETIRED_MOVED_ON.format(name="n")
    for cell, old in zip(nb["cells"], before["cells"]):
        for out, was in zip(cell.get("outputs", ()), old.get("outputs", ())):
            if out is not stale and out is not stop:
                assert out == was
    assert WIDGET_VIEW in nb["cells"][2]["outputs"][0]["data"]
    assert nitro_ipy_server.strip_live_widgets(nb) == 0  # saving again changes nothing more


def test_the_hook_leaves_every_notebook_without_a_live_button_as_sent():
    """The shipped notebooks (saved with nitro_ipy outputs, no live button), a slider-only one, an empty
    one and a text file model: the content is the same object, equal to what it was."""
    models = [{"type": "notebook", "content": json.loads(p.read_text())} for p in sorted((ROOT / "notebooks").glob("*.ipynb"))]
    slider = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("s", outputs=[
        _output(ipywidgets.IntSlider()._repr_mimebundle_())])])
    models += [{"type": "notebook", "content": json.loads(json.dumps(slider))},
               {"type": "notebook", "content": json.loads(json.dumps(nbformat.v4.new_notebook()))},
               {"type": "file", "format": "text", "content": "{\"nitro_ipy\": 1}"}]
    assert len(models) >= 5
    for model in models:
        text = json.dumps(model, sort_keys=True)
        assert nitro_ipy_server.pre_save_hook(model=model, path="x.ipynb") is None
        assert json.dumps(model, sort_keys=True) == text
    # A marked output that lacks a static form to keep (not nitro_ipy's making) is left alone too.
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x", outputs=[nbformat.v4.new_output(
        "display_data", data={WIDGET_VIEW: {"model_id": "m"}, "text/plain": "x"}, metadata={"nitro_ipy": {"live": "rebuild"}})])])
    assert nitro_ipy_server.strip_live_widgets(json.loads(json.dumps(nb))) == 0


def test_a_hook_that_fails_saves_the_notebook_unchanged(caplog):
    nb, _ = _notebook()
    nb["cells"].append({"cell_type": "code", "source": "", "metadata": {}, "outputs": 7})  # malformed
    model = {"type": "notebook", "content": nb}
    text = json.dumps(model, sort_keys=True)
    with caplog.at_level(logging.WARNING, logger="nitro_ipy_server"):
        nitro_ipy_server.pre_save_hook(model=model, path="bad.ipynb")
    assert json.dumps(model, sort_keys=True) == text  # the live buttons before the bad cell were not touched
    assert [r.getMessage() for r in caplog.records] == ["nitro_ipy: the pre-save hook failed on bad.ipynb; saved unchanged"]
    assert caplog.records[0].exc_info[0] is TypeError


def test_a_contents_manager_with_the_hook_writes_the_static_form(tmp_path):
    from jupyter_server.services.contents.filemanager import FileContentsManager

    manager = FileContentsManager(root_dir=str(tmp_path))
    manager.register_pre_save_hook(nitro_ipy_server.pre_save_hook)
    nb, _ = _notebook()
    manager.save({"type": "notebook", "content": nb}, "live.ipynb")
    saved = json.loads((tmp_path / "live.ipynb").read_text())
    views = [o["metadata"].get("nitro_ipy") for c in saved["cells"] for o in c.get("outputs", ())
             if WIDGET_VIEW in o.get("data", {})]
    assert views == [None]  # the slider's view only
    assert sum(SAVED_REBUILD in json.dumps(c) for c in saved["cells"]) == 1


# ------------------------------------------------------------------------------------------------ server
def _installed_config() -> Path:
    return Path(sys.prefix, "etc", "jupyter", "jupyter_server_config.d", "nitro_ipy.json")


@pytest.fixture(scope="module")
def server():
    s = Server(installed_config=_installed_config().exists())
    try:
        yield s
    finally:
        s.close()


def _put(server, name: str, nb: dict) -> str:
    """Save `nb` through the REST API, as JupyterLab does; the file's text."""
    server.api(f"contents/{name}", "PUT", {"type": "notebook", "format": "json", "content": nb})
    return (server.dir / name).read_text()


def test_a_jupyter_server_loads_the_extension_and_rewrites_on_save(server):
    assert "nitro_ipy: saved notebooks keep nitro_ipy's live buttons as their static form" in server.server_log()
    nb, _ = _notebook()
    expected = copy.deepcopy(nb)
    assert nitro_ipy_server.strip_live_widgets(expected) == 2
    saved = nbformat.reads(_put(server, "live.ipynb", nb), 4)  # lines rejoined, as nbformat writes them split
    assert saved.cells == nbformat.from_dict(expected).cells  # on disk: the static forms, every other output as sent
    got = server.api("contents/live.ipynb")["content"]
    assert sum(WIDGET_VIEW in o.get("data", {}) for c in got["cells"] for o in c.get("outputs", ())) == 1  # the slider


def test_a_notebook_without_a_live_button_is_saved_as_sent(server):
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = json.loads(path.read_text())
        nb["metadata"].pop("signature", None)
        assert json.loads(_put(server, path.name, nb)) == nb, path.name


def test_installing_the_package_enables_the_extension():
    """`pip install` and `pip install -e` put the config into `sys.prefix` (setup.py makes editable
    installs ship data files): `jupyter server extension list` says it is enabled and loads."""
    if not _installed_config().exists():
        assert os.environ.get("CI") != "true", f"{_installed_config()} is missing: the install did not ship it"
        pytest.skip(f"{_installed_config()} is missing: this checkout is not installed here (`pip install -e .`)")
    assert json.loads(_installed_config().read_text()) == json.loads(SERVER_CONFIG.read_text())
    out = subprocess.run([sys.executable, "-m", "jupyter_server", "extension", "list"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.stdout + out.stderr)  # its colours
    section = text.split(f"Config dir: {Path(sys.prefix, 'etc', 'jupyter')}\n", 1)[1].split("Config dir:")[0]
    assert "    nitro_ipy_server enabled\n" in section and "      nitro_ipy_server  OK\n" in section, text
