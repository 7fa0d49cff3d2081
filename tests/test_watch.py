"""The file watcher (`nitro_ipy._watch`) as the extension drives it, and the core without watchdog.

Watchdog is a dependency of the `jupyter` extra only: the core never imports the watcher.
"""

import sys
import textwrap

import test_extension
from _cells import TINY_EXPERIMENT
from _modules import json_in_child
from test_extension import EXPERIMENT, _run

from nitro_ipy import _watch

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
                                     if mod is not None and m.startswith(("watchdog", "nitro_ipy._watch")))]))
            """
        )
    )
    assert json_in_child(code, tmp_path, "0") == [1, 3, []]
