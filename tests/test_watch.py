"""The file watcher (`nitro_ipy._notebook._watch`) as the extension drives it, and the core without watchdog.

Watchdog is a dependency of the `jupyter` extra only: the core never imports the watcher.
"""

import sys
import textwrap

import test_extension
from _cells import TINY_EXPERIMENT
from _modules import json_in_child
from test_extension import EXPERIMENT, _run

from nitro_ipy._notebook import _watch

# The shell fixtures of test_extension.py, shared (assigned, so that pytest finds them in this module).
shell = test_extension.shell
loaded = test_extension.loaded
trained = test_extension.trained


def test_watcher_follows_user_module_files(loaded, tmp_path, monkeypatch):
    """Files of user modules in the cache entries' closures are watched after the cell; unload stops it."""
    (tmp_path / "nitro_helpers_mod.py").write_text("def helper(r):\n    return r ** 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "nitro_helpers_mod", raising=False)
    _run(loaded, "from nitro_helpers_mod import helper\n" + EXPERIMENT.replace("def helper(r):\n    return r ** 2\n", ""))
    assert _watch.watched() == set()
    _run(loaded, "n.train()")
    assert _watch.watched() == {str((tmp_path / "nitro_helpers_mod.py").resolve())}
    loaded.run_line_magic("unload_ext", "nitro_ipy")
    assert _watch.watched() == set()


def test_notebook_cells_are_not_watched(trained):
    assert _watch.watched() == set()


def test_the_core_trains_without_watchdog(tmp_path):
    code = (
        "import sys; sys.modules['watchdog'] = None  # `import watchdog` raises ImportError\n"
        + TINY_EXPERIMENT
        + textwrap.dedent(
            """
            n = Nitro(Tiny(), data=data, batch_size=16, progress=False)
            records = n.train()
            import json
            print(json.dumps([len(records), nitro_ipy.cache_stats().entries,
                              sorted(m for m, mod in sys.modules.items()
                                     if mod is not None and m.startswith(("watchdog", "nitro_ipy._notebook._watch")))]))
            """
        )
    )
    assert json_in_child(code, tmp_path, "0") == [1, 3, []]


# ---------------------------------------------------------------- the watcher under filesystem churn
import os  # noqa: E402
import shutil  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

from nitro_ipy._base import _world  # noqa: E402


@pytest.fixture
def watched_file(tmp_path):
    """A watched `pkg/m.py`; thread exceptions collected; the watcher stopped afterwards."""
    errors = []
    previous = threading.excepthook
    threading.excepthook = errors.append
    d = tmp_path / "pkg"
    d.mkdir()
    f = d / "m.py"
    f.write_text("x = 1\n")
    _watch.watch([str(f)])
    try:
        yield f, errors
    finally:
        _watch.stop()
        threading.excepthook = previous


def _bumps(action, settle=None, wait=10.0) -> int:
    """World bumps caused by `action`: waits (up to `wait` s) for the first, then for quiet."""
    w0 = _world.world()
    action()
    deadline = time.monotonic() + wait
    while _world.world() == w0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(settle if settle is not None else 4 * _watch.DEBOUNCE_S)
    return _world.world() - w0


def test_watcher_survives_its_directory_removed_and_recreated(watched_file):
    f, errors = watched_file
    assert _bumps(lambda: shutil.rmtree(f.parent)) >= 1
    assert _bumps(lambda: (f.parent.mkdir(), f.write_text("x = 2\n"))) >= 1
    assert _bumps(lambda: f.write_text("x = 3\n")) == 1  # the new directory is watched again
    assert _bumps(lambda: f.write_text("x = 4\n")) == 1
    assert errors == []


def test_watcher_follows_a_file_replaced_by_a_symlink(watched_file, tmp_path):
    f, errors = watched_file
    target = tmp_path / "elsewhere.py"
    target.write_text("y = 1\n")
    assert _bumps(lambda: (f.unlink(), os.symlink(target, f))) >= 1
    assert _bumps(lambda: f.write_text("x = 5\n")) == 1  # writes through the link land in the target
    assert _bumps(lambda: target.write_text("x = 6\n")) == 1
    assert errors == []


def test_watcher_fires_on_delete_and_again_on_recreate(watched_file):
    f, errors = watched_file
    assert _bumps(lambda: f.unlink()) == 1
    assert _bumps(lambda: f.write_text("x = 7\n")) == 1
    assert _bumps(lambda: f.write_text("x = 8\n")) == 1
    assert errors == []


def test_a_flood_of_saves_coalesces_and_the_watcher_fires_after(watched_file):
    f, errors = watched_file
    saves = 2000

    def flood():
        for i in range(saves):
            f.write_text(f"x = {i}\n")

    n = _bumps(flood)
    assert 1 <= n < saves // 20  # one bump per debounce window, not per save
    assert _bumps(lambda: f.write_text("x = -1\n")) == 1
    assert errors == []


def test_a_watched_directory_missing_at_resync_waits_for_its_parent(watched_file):
    f, errors = watched_file
    parent = f.parent
    assert _bumps(lambda: shutil.rmtree(parent)) >= 1
    assert _bumps(lambda: f.parent.parent.joinpath("unrelated.txt").write_text("z"), wait=0.5) == 0
    assert _bumps(lambda: (parent.mkdir(), f.write_text("x = 9\n"))) >= 1
    assert _bumps(lambda: f.write_text("x = 10\n")) == 1
    assert errors == []
