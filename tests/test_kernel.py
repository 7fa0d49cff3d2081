"""The extension in a real kernel (`jupyter_client`): rich messages as widgets over comms, the button
clicked the way a front end clicks it, `%nitro_stats` and `%nitro_panel` outputs.

One kernel for the module. Cell files here are `.../ipykernel_PID/HASH.py`, not `<ipython-input-N-...>`.
"""

import json
import sys
import textwrap
from pathlib import Path

import pytest
from _cells import TINY_EXPERIMENT

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository's tools/ (not installed with the package)
from tools.nbrun import kernel_manager  # noqa: E402

STALE_LINE = "! this handle's compiled programs had dependency methods redefined"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


class Kernel:
    def __init__(self, client):
        self.client = client

    def run(self, code: str, timeout: float = 120) -> list[dict]:
        """Execute `code`; returns its iopub messages (up to idle). Fails the test on an error reply."""
        msg_id = self.client.execute(code)
        messages = []
        while True:
            msg = self.client.get_iopub_msg(timeout=timeout)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
            messages.append(msg)
        reply = self.client.get_shell_msg(timeout=timeout)
        assert reply["content"]["status"] == "ok", reply["content"]
        return messages

    def value(self, expr: str):
        """`expr` evaluated in the kernel, transported as JSON."""
        out = self.run(f"import json as _json; print(_json.dumps({expr}))")
        return json.loads("".join(m["content"]["text"] for m in out if m["msg_type"] == "stream"))

    def send_comm(self, comm_id: str, data: dict) -> None:
        content = {"comm_id": comm_id, "data": data}
        msg = self.client.session.msg("comm_msg", content)
        self.client.shell_channel.send(msg)


@pytest.fixture(scope="module")
def kernel():
    with kernel_manager() as km:
        km.start_kernel(cwd=str(ROOT))
        client = km.client()
        client.start_channels()
        try:
            client.wait_for_ready(timeout=120)
            yield Kernel(client)
        finally:
            client.stop_channels()
            km.shutdown_kernel(now=True)


EXPERIMENT = TINY_EXPERIMENT + textwrap.dedent(
    """
    nitro_ipy.cache_reset()
    n = Nitro(Tiny(), data=data, batch_size=16, progress=False)
    n_alias = n
    records = n.train()
    """
)


def _of(messages, msg_type):
    return [m for m in messages if m["msg_type"] == msg_type]


def _widget_opens(messages):
    opens = [m["content"] for m in _of(messages, "comm_open")]
    assert all(c["target_name"] == "jupyter.widget" for c in opens)
    return {c["comm_id"]: c["data"]["state"] for c in opens}


def _stream(messages) -> str:
    return "".join(m["content"]["text"] for m in _of(messages, "stream"))


@pytest.fixture(scope="module")
def session(kernel):
    """The extension loaded and a tiny experiment trained, then its helper edited: the story's setup."""
    kernel.run("%load_ext nitro_ipy")
    kernel.run(EXPERIMENT)
    kernel.run("def helper(r):\n    return abs(r)\n")
    return kernel


def test_the_extension_installs_the_rich_sink_and_one_set_of_callbacks(session):
    session.run("%load_ext nitro_ipy")  # already loaded: harmless
    session.run("%reload_ext nitro_ipy")
    assert session.value(
        "[type(nitro_ipy._report._sink).__name__, len(get_ipython().events.callbacks['pre_run_cell']), "
        "type(get_ipython()).__name__]"
    ) == ["RichSink", 1, "ZMQInteractiveShell"]


def test_cells_are_not_watched(session):
    """Kernel cells live in `.../ipykernel_PID/HASH.py` files: they are cells, not user modules."""
    assert session.value("sorted(nitro_ipy._watch.watched())") == []


def test_stale_messages_are_widgets_and_the_button_rebuilds(session):
    messages = session.run("records = n.train()")
    displays = [m["content"]["data"] for m in _of(messages, "display_data")]
    assert [d["text/plain"].split(":")[0] for d in displays] == ["nitro_ipy", STALE_LINE]
    cache_msg, handle_msg = displays
    assert cache_msg["text/plain"].startswith(
        "nitro_ipy: 2 cached programs (eval, grad) poisoned; redefined: __main__.helper."
    )
    assert handle_msg["text/plain"].startswith(STALE_LINE + ": __main__.helper (eval, grad).")
    assert all(set(d) == {WIDGET_VIEW, "text/plain", "text/html"} for d in displays)
    assert _stream(messages) == ""  # rich in a notebook: no duplicate text line

    states = _widget_opens(messages)
    boxes = {cid: s for cid, s in states.items() if s["_model_name"] == "VBoxModel"}
    assert sorted(s["box_style"] for s in boxes.values()) == ["info", "warning"]
    assert {d[WIDGET_VIEW]["model_id"] for d in displays} == set(boxes)
    (button_id, button), = [(cid, s) for cid, s in states.items() if s["_model_name"] == "ButtonModel"]
    assert (button["description"], button["button_style"]) == ("Rebuild handle", "warning")

    # Click as a front end does: a custom comm message to the button's model.
    session.send_comm(button_id, {"method": "custom", "content": {"event": "click"}})
    assert session.value("[n is n_alias, n.step, type(n).__name__]") == [True, 6, "Nitro"]
    assert session.value("nitro_ipy._extension.loaded_magics(get_ipython()).sink.views[-1].output.outputs[0]['text']") == (
        "rebuilt: n, n_alias -> new handle\n"
    )
    messages = session.run("records = n.train()")
    assert [line.split()[2] for line in _stream(messages).splitlines()] == ["grad", "eval"]
    assert _of(messages, "display_data") == []


def test_nitro_stats_output(session):
    (result,) = _of(session.run("%nitro_stats"), "execute_result")
    data = result["content"]["data"]
    assert data["text/plain"].splitlines()[0].endswith("| misses 5 | entries 3 | poisoned 2")
    assert "<th>argument shapes</th>" in data["text/html"]
    assert data["text/html"].count("poisoned (__main__.helper)") == 2


def test_nitro_panel_is_a_widget_with_text_fallbacks(session):
    messages = session.run("%nitro_panel")
    (display,) = [m["content"] for m in _of(messages, "display_data")]
    stats = session.value("list(nitro_ipy.cache_stats())")
    latest = "eval [forward, loss] in {} s (recompiling against edited code: __main__.helper)".format(
        session.value("'%.2f' % (lambda e: e.trace_s + e.compile_s)(nitro_ipy._cache.live_entries()[-1])"))
    assert display["data"]["text/plain"] == (
        f"nitro_ipy panel: hits {stats[0]} | misses 5 | entries 3 | poisoned 2 | latest compile: {latest}"
    )
    states = _widget_opens(messages)  # each widget opens with its value: no update message follows
    labels = {s["description"]: s["value"] for s in states.values() if s["_model_name"] == "HTMLModel" and s["description"]}
    assert labels == {"hits": str(stats[0]), "misses": "5", "entries": "3", "poisoned": "2", "latest compile": latest}
    assert _of(messages, "comm_msg") == []
    panel_id = display["data"][WIDGET_VIEW]["model_id"]
    assert states[panel_id]["_model_name"] == "VBoxModel"

    # Training updates the panel's widgets (comm updates), and the cell end refreshes the text fallback.
    messages = session.run("n = Nitro(Tiny(hidden=5), data=data, batch_size=16, progress=False); records = n.train()")
    updates = [m["content"]["data"] for m in _of(messages, "comm_msg") if m["content"]["data"].get("method") == "update"]
    assert any(u["state"].get("value") == "6" for u in updates)  # misses 5 -> 8 passes through 6
    (update,) = [m["content"] for m in _of(messages, "update_display_data")]
    assert update["data"]["text/plain"].startswith(
        f"nitro_ipy panel: hits {session.value('nitro_ipy.cache_stats().hits')} | misses 8 | entries 6 | "
        "poisoned 2 | latest compile: eval [forward, loss] in "
    )
