"""The counts move only when a program is compiled or loaded, and every such event is said (issue 46).

Counted through a real IPython shell with the extension loaded and compile ahead on (the default), as a
user runs it; background work is waited for (`_ahead.wait`, `_reuse.wait`), never slept on, so each test
reads the same counts in every run.
"""

import numpy as np

import nitro_ipy
from nitro_ipy._compiler import _cache, _reuse
from nitro_ipy._training import _ahead
from tests import test_staleness
from tests._cells import TINY_EXPERIMENT

run = test_staleness.run
ip = test_staleness.ip  # the staleness tests' shell fixture (assigned, so it is one fixture, not an import)

TRAIN = "n = Nitro(Tiny(), data=data, batch_size=16, max_epochs=1, progress=False); n.train()"
NO_OP_EDIT = "def helper(r):\n    # only a comment is new\n    return r ** 2\n"


def idle():
    """Whatever the background would do while the user reads: done, not slept on."""
    assert _ahead.wait(60) and _reuse.wait(60)


def test_a_handle_trained_after_a_reset_puts_nothing_in_the_cache(ip, capsys):
    # The handle holds its three programs from before the reset and runs them (a fixed point). Its
    # second `train()` queued its evaluation program to compile ahead anyway: after the next cell and the
    # quiet time, an entry no one asked for, with no compile line (misses 0 -> 1, entries 0 -> 1).
    run(ip, capsys, TINY_EXPERIMENT)
    run(ip, capsys, TRAIN)
    run(ip, capsys, "nitro_ipy.cache_reset()")
    out = run(ip, capsys, "n.train()")
    stats = nitro_ipy.cache_stats()
    assert (stats.misses, stats.entries) == (0, 0)
    out += run(ip, capsys, NO_OP_EDIT)
    idle()
    out += run(ip, capsys, "pass")
    assert nitro_ipy.cache_stats() == stats
    assert _cache.live_entries() == [] and "compiled" not in out, out


# ---------------------------------------------------------------- background compiles, the foreground's rules

PROBED = """
import threading
from nitro_ipy._base import _world

seen = []

def probe():  # what a background trace sees at this moment: may a statement of the cell be running?
    t = threading.Thread(target=lambda: seen.append(_world.cell_busy()))
    t.start()
    t.join()

class Probed(Tiny):
    def forward(self, params, *, x):
        probe()  # at trace time
        return Tiny.forward(self, params, x=x)

n = Nitro(Probed(), data=data, batch_size=16, max_epochs=1, progress=False)
"""


def test_validate_and_predict_count_as_inside_nitro(ip, capsys):
    # A cell waiting in `validate()` or `predict()` (here for the program its own thread compiles, as for
    # one compiled ahead) runs none of its statements: a background trace beside it is settled.
    run(ip, capsys, TINY_EXPERIMENT)
    run(ip, capsys, PROBED)
    run(ip, capsys, "n.validate(); n.predict({'x': X[:4]}); n.evaluate('valid')")
    assert ip.user_ns["seen"] == [False, False], ip.user_ns["seen"]  # eval and predict traced; evaluate hit


CROSSED = """
import threading
SCALE = 1.0
started, go = threading.Event(), threading.Event()

class Crossed(Tiny):
    def forward(self, params, *, x):
        s = SCALE  # read at trace time, baked into the program
        if threading.current_thread() is not threading.main_thread() and not started.is_set():
            started.set()  # the run's first trace: the cell's next statements run meanwhile
            go.wait(30)
        return Tiny.forward(self, params, x=x) + s  # (Tiny's output layer starts at zero)

t = Nitro(Crossed(lr=0.0), data={"train": data["train"]}, batch_size=16, max_epochs=1, progress=False)
"""


def test_a_background_run_s_trace_that_a_cell_crossed_is_traced_again(ip, capsys):
    # The run's gradient trace read SCALE = 1.0; the cell set SCALE = 3.0 before the trace ended, and a
    # recording reads globals when the trace ends: a program of 1.0 recorded as one of 3.0, served as
    # current. A background run's trace follows the compile-ahead rule: traced again after the cell.
    run(ip, capsys, TINY_EXPERIMENT)
    run(ip, capsys, CROSSED)
    run(ip, capsys, "r = t.train(background=True); started.wait(30); SCALE = 3.0; go.set()")
    run(ip, capsys, "r.wait(); fresh = Nitro(Crossed(lr=0.0), data={'train': data['train']}, batch_size=16, "
                    "max_epochs=1, progress=False); rows = fresh.train()")
    ns = ip.user_ns
    params = {k: np.asarray(v) for k, v in ns["fresh"].params.items()}
    x, y = ns["data"]["train"]["x"], ns["data"]["train"]["y"]
    want = np.mean((np.tanh(x @ params["w"]) @ params["v"] + 3.0 - y) ** 2)
    np.testing.assert_allclose(ns["rows"][0]["loss"], want, rtol=1e-5)
    np.testing.assert_allclose(ns["t"].history[0]["loss"], want, rtol=1e-5)  # the run's own steps too


def test_a_program_compiled_ahead_shows_in_the_panel_when_its_miss_is_counted(ip, capsys):
    # Compile ahead counts its miss when the program enters the cache; its compile line waits for the
    # handle that takes it. Meanwhile the panel shows it, marked as the background's.
    from nitro_ipy._notebook._panel import AHEAD_NOTE, Panel

    run(ip, capsys, TINY_EXPERIMENT)
    run(ip, capsys, TRAIN)
    idle()
    panel = Panel(min_interval=0)
    panel.attach()
    try:
        assert not panel.figures()["latest compile"].endswith(AHEAD_NOTE)
        out = run(ip, capsys, "def helper(r):\n    return r ** 2 * 3\n")
        idle()
        stats = nitro_ipy.cache_stats()
        assert (stats.misses, "compiled" in out) == (5, False)  # grad and eval compiled ahead, unsaid
        figures = panel.figures()
        assert figures["misses"] == "5" and figures["latest compile"].endswith(AHEAD_NOTE), figures
        out = run(ip, capsys, "n2 = n.rebuild(); n2.train()")
        assert out.count("compiled ahead after your edit") == 2, out  # said where the rebuild takes them
        assert nitro_ipy.cache_stats().misses == 5
        assert not panel.figures()["latest compile"].endswith(AHEAD_NOTE)
    finally:
        panel.detach()
