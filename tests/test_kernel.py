"""The extension in a real kernel (`jupyter_client`): messages and the panel as HTML display outputs
updated in place, the Rebuild button (the one widget) clicked the way a front end clicks it, the progress
display, `%nitro_stats` and `%nitro_panel` outputs.

One kernel for the module. Cell files here are `.../ipykernel_PID/HASH.py`, not `<ipython-input-N-...>`.
"""

import json
import sys
import textwrap
import time
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

    def send_comm(self, comm_id: str, data: dict, timeout: float = 60) -> list[dict]:
        """Send a comm message as a front end does; returns the iopub messages it caused (up to idle)."""
        content = {"comm_id": comm_id, "data": data}
        msg = self.client.session.msg("comm_msg", content)
        self.client.shell_channel.send(msg)
        messages = []
        while True:
            reply = self.client.get_iopub_msg(timeout=timeout)
            if reply["parent_header"].get("msg_id") != msg["header"]["msg_id"]:
                continue
            if reply["msg_type"] == "status" and reply["content"]["execution_state"] == "idle":
                return messages
            messages.append(reply)


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


def _said(messages) -> str:
    """What a cell said, as a plain-text reader of it sees it: its printed text, then the last state of
    each display output, in the order they were first shown."""
    shown: dict = {}
    for m in messages:
        if m["msg_type"] in ("display_data", "update_display_data") and "transient" in m["content"]:
            shown[m["content"]["transient"]["display_id"]] = m["content"]["data"].get("text/plain", "")
    return _stream(messages) + "".join(text + "\n" for text in shown.values() if text)


@pytest.fixture(scope="module")
def session(kernel):
    """The extension loaded and a tiny experiment trained, then its helper edited: the story's setup."""
    kernel.run("%load_ext nitro_ipy")
    kernel.run(EXPERIMENT)
    kernel.edited = kernel.run("def helper(r):\n    return abs(r)\n")  # the edit's cell says what it poisoned
    return kernel


def test_the_extension_installs_the_rich_sink_and_one_set_of_callbacks(session):
    session.run("%load_ext nitro_ipy")  # already loaded: harmless
    session.run("%reload_ext nitro_ipy")
    assert session.value(
        "[type(nitro_ipy._base._report._sink).__name__, len(get_ipython().events.callbacks['pre_run_cell']), "
        "type(get_ipython()).__name__]"
    ) == ["RichSink", 1, "ZMQInteractiveShell"]


def test_cells_are_not_watched(session):
    """Kernel cells live in `.../ipykernel_PID/HASH.py` files: they are cells, not user modules."""
    assert session.value("sorted(nitro_ipy._notebook._watch.watched())") == []


def test_stale_messages_are_html_and_only_the_button_is_a_widget(session):
    # The cache-level message comes from the edit's cell (compile ahead looked at once); the handle's
    # message and its button from the train.
    messages = session.run("records = n.train()")
    shown = _of(session.edited, "display_data") + _of(messages, "display_data")
    displays = [m["content"]["data"] for m in shown]
    assert [d["text/plain"].split(":")[0] for d in displays] == ["nitro_ipy", STALE_LINE, "not clicked when the notebook was saved; to use the current code"]
    cache_msg, handle_msg, button_out = displays
    assert cache_msg["text/plain"].startswith(
        "nitro_ipy: 2 cached programs (eval, grad) poisoned; redefined: __main__.helper."
    )
    assert handle_msg["text/plain"].startswith(STALE_LINE + ": __main__.helper (eval, grad).")
    # The messages are HTML, styled with JupyterLab's variables (with fallbacks), a title line first.
    assert set(cache_msg) == set(handle_msg) == {"text/plain", "text/html"}
    assert "var(--jp-info-color1, #0288d1)" in cache_msg["text/html"]
    assert ">Edit seen: 2 cached programs poisoned</div>" in cache_msg["text/html"]
    assert "var(--jp-warn-color1, #f57c00)" in handle_msg["text/html"]
    assert ">This handle runs code compiled before your edit</div>" in handle_msg["text/html"]
    assert "! this" not in handle_msg["text/html"]
    # The button's output: the widget view, over the static form a notebook saved now keeps (the server
    # extension drops the view of outputs marked so; tests/test_savehook.py).
    assert set(button_out) == {WIDGET_VIEW, "text/plain", "text/html"}
    assert button_out["text/plain"] == "not clicked when the notebook was saved; to use the current code: `n = n.rebuild()`"
    assert "nitro-saved-live" in button_out["text/html"]
    assert [m["content"]["metadata"] for m in shown] == [{}, {}, {"nitro_ipy": {"live": "rebuild"}}]
    assert _stream(messages) == ""  # rich in a notebook: no duplicate text line

    states = _widget_opens(messages)
    assert sorted(s["_model_name"] for s in states.values()) == ["ButtonModel", "ButtonStyleModel", "LayoutModel"]
    (button_id, button), = [(cid, s) for cid, s in states.items() if s["_model_name"] == "ButtonModel"]
    assert (button["_model_name"], button["description"], button["button_style"]) == (
        "ButtonModel", "Rebuild handle", "warning")
    assert button_out[WIDGET_VIEW]["model_id"] == button_id
    (button_display,) = [m["content"]["transient"]["display_id"] for m in _of(messages, "display_data")
                         if WIDGET_VIEW in m["content"]["data"]]

    # Click as a front end does: a custom comm message to the button's model. Its output becomes the
    # result as HTML (what the saved notebook keeps) and the widget is closed.
    clicked = session.send_comm(button_id, {"method": "custom", "content": {"event": "click"}})
    (update,) = [m["content"] for m in _of(clicked, "update_display_data")]
    assert update["transient"]["display_id"] == button_display
    assert update["data"]["text/plain"] == "rebuilt: n, n_alias -> new handle"
    assert set(update["data"]) == {"text/plain", "text/html"}
    assert update["metadata"] == {}  # no longer live: nothing for the server extension to change
    assert "var(--jp-success-color1" in update["data"]["text/html"]
    assert button_id in [m["content"]["comm_id"] for m in _of(clicked, "comm_close")]
    assert session.value("[n is n_alias, n.step, type(n).__name__]") == [True, 6, "Nitro"]
    messages = session.run("records = n.train()")
    assert _stream(messages) == ""  # the compile lines are the reporter's: one output, no raw text
    assert [line.split()[2] for line in _said(messages).splitlines()] == ["grad", "eval"]
    assert len(_of(messages, "display_data")) == 1


def _button_shown(messages):
    (button_id,) = [cid for cid, s in _widget_opens(messages).items() if s["_model_name"] == "ButtonModel"]
    (display_id,) = [m["content"]["transient"]["display_id"] for m in _of(messages, "display_data")
                     if WIDGET_VIEW in m["content"]["data"]]
    return button_id, display_id


def _button_retired(messages, button_id, display_id) -> str:
    """The line an unclicked button's output ended as (its model closed, its output HTML + text)."""
    (update,) = [m["content"] for m in _of(messages, "update_display_data")
                 if m["content"]["transient"]["display_id"] == display_id]
    assert set(update["data"]) == {"text/plain", "text/html"}
    assert button_id in [m["content"]["comm_id"] for m in _of(messages, "comm_close")]
    return update["data"]["text/plain"]


def test_an_unclicked_rebuild_button_is_retired_when_no_name_holds_its_handle(session):
    session.run("def helper(r):\n    return r ** 2\n")
    # Rebuilt by hand in the cell that showed the button: retired after that cell, nothing to do.
    messages = session.run("n.train(); n = n.rebuild(); n_alias = n")
    button_id, display_id = _button_shown(messages)
    assert _button_retired(messages, button_id, display_id) == (
        "no longer needed: no name holds that handle any more (it was rebuilt or dropped)")
    session.run("records = n.train()")


def test_one_progress_display_per_train_call_ending_as_its_lines(session):
    messages = session.run("p = Nitro(Tiny(hidden=7), data=data, batch_size=16); records = p.train(2)")
    assert _stream(messages) == ""  # the first step's compile lines open the display: no raw text
    (shown,) = _of(messages, "display_data")
    display_id = shown["content"]["transient"]["display_id"]
    assert set(shown["content"]["data"]) == {"text/plain", "text/html"}
    assert shown["content"]["data"]["text/plain"].startswith("nitro_ipy: compiled grad [forward, loss]")
    updates = [m["content"] for m in _of(messages, "update_display_data")]
    assert {u["transient"]["display_id"] for u in updates} == {display_id}
    assert any(u["data"]["text/plain"].splitlines()[-1].startswith("nitro_ipy: epoch 1/2 | step ") for u in updates)
    final = updates[-1]["data"]["text/plain"].splitlines()
    assert [line.split()[1:3] for line in final] == [["compiled", "grad"], ["compiled", "opt"], ["compiled", "eval"],
                                                     ["epoch", "1"], ["epoch", "2"]]
    assert final[3].startswith("nitro_ipy: epoch 1 | loss ") and "valid_loss" in final[3]
    assert updates[-1]["data"]["text/html"].count("class='nitro-line nitro-compile'") == 3
    assert "nitro-progress-running" not in updates[-1]["data"]["text/html"]
    assert _widget_opens(messages) == {}  # no widget: nothing to lose on a reopen


def test_nitro_stats_output(session):
    (result,) = _of(session.run("%nitro_stats"), "execute_result")
    data = result["content"]["data"]
    assert data["text/plain"].splitlines()[0].endswith("| misses 10 | entries 6 | poisoned 4")
    assert "white-space: nowrap'>inputs</th>" in data["text/html"]
    assert "parameters 16 float32 (v, w); batch x [16, 3], y [16]" in data["text/html"]
    assert data["text/html"].count("poisoned (__main__.helper)") == 4


def test_nitro_panel_is_html_updated_in_place(session):
    messages = session.run("%nitro_panel")
    shown = [m["content"] for m in _of(messages, "display_data")]
    assert _widget_opens(messages) == {}
    main, latest, stop_slot = shown
    stats = session.value("list(nitro_ipy.cache_stats())")
    seconds = session.value("'%.2f' % (lambda e: e.trace_s + e.compile_s)(nitro_ipy._compiler._cache.live_entries()[-1])")
    assert main["data"]["text/plain"].splitlines()[0] == (
        f"nitro_ipy panel: hits {stats[0]} | misses {stats[1]} | entries {stats[2]} | poisoned 4 | latest compile: "
        f"eval [forward, loss] in {seconds} s (GraphConst `hidden`: 4 -> 7, and 2 argument shapes with it)"
    )
    assert "stale: 4 programs compiled before an edit" in main["data"]["text/html"]
    assert latest["data"]["text/plain"].startswith("latest compile: eval [forward, loss] in ")
    assert "<details><summary>" in latest["data"]["text/html"]
    assert stop_slot["data"] == {"text/plain": "", "text/html": ""}
    ids = [d["transient"]["display_id"] for d in shown]

    # Training updates the panel's outputs in place; a GraphConst change is summarised by its field.
    messages = session.run("q = Nitro(Tiny(hidden=5), data=data, batch_size=16, progress=False); records = q.train()")
    updates = [m["content"] for m in _of(messages, "update_display_data")]
    own = {m["content"]["transient"]["display_id"] for m in _of(messages, "display_data")}  # the cell's lines
    assert {u["transient"]["display_id"] for u in updates} <= set(ids[:2]) | own
    last_main = [u for u in updates if u["transient"]["display_id"] == ids[0]][-1]
    assert last_main["data"]["text/plain"].startswith(
        f"nitro_ipy panel: hits {session.value('nitro_ipy.cache_stats().hits')} | misses {stats[1] + 3} | "
        f"entries {stats[2] + 3} | poisoned 4 | latest compile: eval [forward, loss] in "
    )
    last_latest = [u for u in updates if u["transient"]["display_id"] == ids[1]][-1]
    assert last_latest["data"]["text/plain"].endswith("(GraphConst `hidden`: 4 -> 5, and 2 argument shapes with it)")
    html = last_latest["data"]["text/html"]
    assert "hidden</code>: 4 -&gt; 5, and 2 argument shapes with it<details class='nitro-more'" in html
    assert "shape:" not in html.split("<details class='nitro-more'")[0]  # the shapes: one click away
    assert html.split("<details class='nitro-more'")[1].count("shape: [") == 2
    assert _widget_opens(messages) == {}


def test_the_panel_draws_a_background_run_while_the_kernel_is_idle(session):
    """The worker never touches an output: the panel's refresh is scheduled on the kernel's event loop,
    which runs it between cells, so the figures move while nothing executes."""
    (main, *_rest) = [m["content"] for m in _of(session.run("%nitro_panel"), "display_data")]
    panel_id = main["transient"]["display_id"]
    session.run("r = Nitro(Tiny(hidden=9), data=data, batch_size=2); run = r.train(100000, background=True)")
    seen = []
    import time

    end = time.monotonic() + 60
    while time.monotonic() < end and len(seen) < 2:  # a compile and a sync point, at least
        msg = session.client.get_iopub_msg(timeout=60)
        if msg["msg_type"] == "update_display_data" and msg["content"]["transient"]["display_id"] == panel_id:
            seen.append(msg["content"]["data"]["text/plain"])
    session.run("run.stop(); rows = run.wait()")
    assert len(seen) == 2 and all(s.startswith("nitro_ipy panel: hits ") for s in seen)
    assert session.value("[run.done, r.step > 0]") == [True, True]


def test_an_unclicked_rebuild_button_ends_as_html_when_the_next_cell_runs(session):
    """A button can act only between cells and shows only while its kernel holds its model: once the next
    cell runs it becomes the line saying how to rebuild by hand, so the saved notebook holds HTML."""
    session.run("def helper(r):\n    return r ** 3\n")
    stale = session.run("old = n; records = n.train()")
    button_id, display_id = _button_shown(stale)
    assert display_id not in [m["content"]["transient"]["display_id"] for m in _of(stale, "update_display_data")]
    messages = session.run("x = 1")  # any cell: the button was not clicked
    assert _button_retired(messages, button_id, display_id) == (
        "not clicked before the next cell ran; to use the current code: `n = n.rebuild()`")
    assert session.value("n is old") is True  # nothing was rebuilt
    # A button shown while nitro_ipy is unloaded ends the same way.
    button_id, display_id = _button_shown(session.run("records = n.train()"))
    messages = session.run("%unload_ext nitro_ipy")
    assert _button_retired(messages, button_id, display_id).startswith("not clicked before the next cell ran")
    session.run("%load_ext nitro_ipy")
    session.run("n = n.rebuild()")


WARMING_EXPERIMENT = textwrap.dedent(
    """
    import dataclasses, os, sys, threading, time
    import jax, jax.numpy as jnp, numpy as np
    from nitro_ipy import GraphConst, Nitro
    from nitro_ipy._compiler import _reuse

    @dataclasses.dataclass
    class SlowTrace:
        hidden: GraphConst[int] = 8

        def init(self, rng):
            return {"w": jax.random.normal(rng, (4, self.hidden)), "v": jnp.ones(self.hidden)}

        def forward(self, params, *, x):
            if threading.current_thread().name == "nitro_ipy-warm" and not os.path.exists(MARK):
                open(MARK, "w").close()  # the test starts its next cell now
                time.sleep(1.0)  # the first warming trace is still under way while that cell prints
            print("forward traced")
            return jnp.tanh(x @ params["w"]) @ params["v"]

        def loss(self, outputs, *, y):
            return jnp.mean((outputs - y) ** 2)

    xs = np.ones((64, 4), np.float32)
    slow = Nitro(SlowTrace(), data={"train": {"x": xs, "y": xs.sum(1)}}, batch_size=16, progress=False)
    slow.train()
    stdout0 = sys.stdout
    """
)
PRINTING_CELL = """
warming_seen = False
for i in range(20):
    print("line", i)
    warming_seen = warming_seen or bool(_reuse._running)
    time.sleep(0.05)
"""


def test_a_warming_beside_a_cell_drops_only_its_own_prints_and_is_made_again(kernel, tmp_path):
    """Trace reuse's warming traces the gradient program again in a thread once training stopped and the
    kernel is idle. A cell started during it prints every line of its own and none of the warming's;
    the warming it crossed is dropped and made again once the cell ended, and kept then. `sys.stdout` is
    the kernel's own stream again afterwards."""
    kernel.run("%load_ext nitro_ipy")  # what users run: the cell crossing the warming is seen
    mark = tmp_path / "warming"
    before = "from nitro_ipy._compiler import _reuse\nstats0 = dict(_reuse.stats)\n"
    assert _stream(kernel.run(before + f"MARK = {str(mark)!r}\n" + WARMING_EXPERIMENT)).count("forward traced") == 1
    deadline = time.monotonic() + 60
    while not mark.exists() and time.monotonic() < deadline:  # the warming started (the kernel idle)
        time.sleep(0.01)
    assert mark.exists()
    assert _stream(kernel.run(PRINTING_CELL)) == "".join(f"line {i}\n" for i in range(20))
    assert kernel.value("[warming_seen, _reuse.wait(60), _reuse.stats['redone'] - stats0['redone'] >= 1, "
                        "[k[0] for k in _reuse._forwards].count('__main__.SlowTrace')]") == [True, True, True, 1]
    assert kernel.value("[sys.stdout is stdout0, type(sys.stdout).__name__]") == [True, "OutStream"]


def test_no_warming_starts_while_a_cell_s_own_statements_run(kernel):
    """With the extension loaded, a warming waits for the cell that trained to end: a trace beside the
    cell's own statements would be dropped (they may redefine what it reads)."""
    kernel.run("%load_ext nitro_ipy")
    kernel.run("import os\nMARK = os.devnull\n" + WARMING_EXPERIMENT)  # a warming that does not wait
    assert kernel.value("_reuse.wait(60)") is True
    assert _stream(kernel.run(textwrap.dedent(
        """
        warmed0 = _reuse.stats["warmed"]
        other = Nitro(SlowTrace(hidden=6), data={"train": {"x": xs, "y": xs.sum(1)}}, batch_size=16,
                      progress=False)
        other.train()
        warming_seen, t0 = False, time.monotonic()
        while time.monotonic() - t0 < 1.0:  # four times the quiet time after training
            warming_seen = warming_seen or bool(_reuse._running)
            time.sleep(0.01)
        """
    ))).count("forward traced") == 1
    assert kernel.value("[warming_seen, _reuse.wait(60), _reuse.stats['warmed'] - warmed0]") == [False, True, 1]


    assert kernel.value("[sys.stdout is stdout0, type(sys.stdout).__name__]") == [True, "OutStream"]
