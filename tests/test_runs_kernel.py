"""Background runs and Ctrl-C in a real kernel (`jupyter_client`): the interrupt shows one line and aborts
the queued cells (a "Run All" stops), a background run leaves the kernel free for cells and widget
messages (a Stop button works between cells), and its messages appear in the cell that waits for it only.

One kernel for the module (start-up and three small compiles: about 15 s on a quiet 2-core machine).
"""

import re
import sys
import textwrap
from pathlib import Path

import pytest
from _cells import TINY_EXPERIMENT
from test_kernel import Kernel, _of, _said, _stream

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository's tools/ (not installed with the package)
from tools.nbrun import kernel_manager  # noqa: E402

SETUP = TINY_EXPERIMENT + textwrap.dedent(
    """
    import threading
    import ipywidgets as widgets

    class Steer:
        def __init__(self, at):
            self.at, self.reached, self.go = at, threading.Event(), threading.Event()
        def __call__(self, step):
            if step == self.at:
                self.reached.set()  # no print here: a worker thread's own prints land in the current cell
                self.go.wait(120)
            return 0.0
    """
)


@pytest.fixture(scope="module")
def kernel():
    with kernel_manager() as km:
        km.start_kernel(cwd=str(ROOT))
        client = km.client()
        client.start_channels()
        try:
            client.wait_for_ready(timeout=120)
            k = Kernel(client)
            k.km = km
            k.run(SETUP)
            yield k
        finally:
            client.stop_channels()
            km.shutdown_kernel(now=True)


def _until_idle(client, msg_id, timeout=120):
    messages = []
    while True:
        msg = client.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return messages
        messages.append(msg)


def _reply(client, msg_id, timeout=120):
    while True:
        reply = client.get_shell_msg(timeout=timeout)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"]


def test_interrupt_shows_one_line_and_stops_the_queued_cells(kernel):
    c = kernel.client
    train = c.execute(
        "nitro_ipy.cache_reset()\n"
        "n = Nitro(Tiny(), data=data, batch_size=16, max_epochs=100000, progress=False,\n"
        "          schedules={'lr': lambda s: print('at step 7', flush=True) or 1e-2 if s == 7 else 1e-2})\n"
        "n.train()\n"
    )
    queued = c.execute("after_the_train = True\n")
    # Interrupt once the loop is past step 7: the kernel is inside the epoch loop for sure.
    while True:
        msg = c.get_iopub_msg(timeout=120)
        if msg["parent_header"].get("msg_id") == train and msg["msg_type"] == "stream":
            if "at step 7" in msg["content"]["text"]:  # after the compile lines
                break
    kernel.km.interrupt_kernel()
    messages = _until_idle(c, train)
    # Without the extension (no rich output), the stop is said once: as the error's one line.
    (error,) = [m["content"] for m in _of(messages, "error")]
    assert error["ename"] == "TrainingInterrupted"
    (line,) = error["traceback"]  # one line, no traceback into nitro_ipy
    assert "training interrupted" not in _said(messages)
    # The interrupt lands in an epoch's steps or in its validation (3 steps an epoch, then validation).
    found = re.fullmatch(r"training interrupted at epoch (\d+), (?:step (\d+)/3|(validating)); the handle is usable",
                         line)
    assert found, line
    epoch = int(found.group(1))
    # In the steps: the epoch is not counted. In validation: its steps and its row are kept.
    done, step = (epoch, 3 * epoch) if found.group(3) else (epoch - 1, (epoch - 1) * 3 + int(found.group(2)))
    assert _reply(c, train)["status"] == "error"
    assert _reply(c, queued)["status"] == "aborted"  # the rest of a Run All does not run
    _until_idle(c, queued)
    assert kernel.value("['after_the_train' in globals(), n.step, n.epoch, len(n.history), "
                        "any(x.is_deleted() for x in jax.tree.leaves((n.params, n.state)))]") == [
        False, step, done, done, False]


def test_a_background_run_leaves_the_kernel_free_and_stops_from_a_button(kernel):
    kernel.run(
        "nitro_ipy.cache_reset()\n"
        "steer = Steer(at=1)\n"
        "n = Nitro(Tiny(), data=data, batch_size=16, max_epochs=100000, progress=False,\n"
        "          schedules={'lr': lambda s: steer(s) or 1e-2})\n"
        "run = n.train(background=True)\n"
    )
    # The worker compiled grad and opt and waits before step 1; this cell runs meanwhile and shows only
    # its own output: the compile lines stay on the run.
    out = kernel.run("assert steer.reached.wait(60)\nprint('a cell runs', run.status)\n")
    assert _stream(out) == "a cell runs running\n"
    assert kernel.value("[m.kind for m in run.messages]") == ["compile", "compile"]
    out = kernel.run("stop = widgets.Button(description='Stop')\nstop.on_click(lambda _: run.stop())\n"
                     "print(stop.model_id)\nsteer.go.set()\n")
    button = _stream(out).split()[0]
    # The run trains on (100000 epochs) while cells run: this one waits for its first validated epoch
    # (so the eval program is compiled whatever the load), then a click, as a front end sends it, stops it.
    out = kernel.run("import time\nt0 = time.monotonic()\n"
                     "while n.epoch < 1 and time.monotonic() - t0 < 60:\n    time.sleep(0.005)\n"
                     "print(n.epoch >= 1, run.status)\n")
    assert _stream(out) == "True running\n"
    kernel.send_comm(button, {"method": "custom", "content": {"event": "click"}})
    out = kernel.run("rows = run.wait(timeout=60)\n"
                     "print(run.status, len(rows) == n.epoch == len(n.history), 0 <= n.step - 3 * n.epoch < 3)\n")
    lines = _said(out).splitlines()
    assert [line.split(" in ")[0] for line in lines[:3]] == [
        "nitro_ipy: compiled grad [forward, loss]", "nitro_ipy: compiled opt [optimizer]",
        "nitro_ipy: compiled eval [forward, loss]"]
    assert lines[3:] == ["stopped True True"]  # rows, epochs and steps agree: nothing lost
    assert kernel.value("[s.misses == s.entries == 3 for s in [nitro_ipy.cache_stats()]]") == [True]
