"""The counts move only when a program is compiled or loaded, and every such event is said (issue 46).

Counted through a real IPython shell with the extension loaded and compile ahead on (the default), as a
user runs it; background work is waited for (`_ahead.wait`, `_reuse.wait`), never slept on, so each test
reads the same counts in every run.
"""

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
