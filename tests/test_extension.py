"""The IPython extension, magics and widgets, driven through a real `InteractiveShell` (terminal IPython).

The kernel side (rich messages, comms) is in test_kernel.py; the quickstart notebook in test_notebook.py;
the file watcher in test_watch.py.
"""

import gc
import importlib
import subprocess
import sys
import threading

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

import nitro_ipy
from _cells import TINY_EXPERIMENT
from nitro_ipy import _cache, _extension, _magics, _report, _world

EXPERIMENT = TINY_EXPERIMENT + "n = Nitro(Tiny(), data=data, batch_size=16, progress=False)\n"
EDIT = "def helper(r):\n    return abs(r)\n"


def _callbacks(ip):
    return {event: len(ip.events.callbacks[event]) for event in ("pre_run_cell", "post_run_cell")}


def _run(ip, code):
    result = ip.run_cell(code)
    result.raise_error()
    return result


@pytest.fixture
def shell():
    """The process's `InteractiveShell`, with a fresh namespace and the extension unloaded afterwards."""
    ip = InteractiveShell.instance()
    ip.reset(new_session=False)
    baseline = _callbacks(ip)
    yield ip
    ip.run_line_magic("unload_ext", "nitro_ipy")
    _extension.unload(ip)  # also when a test loaded by calling `load` directly
    assert _callbacks(ip) == baseline
    ip.reset(new_session=False)


@pytest.fixture
def loaded(shell):
    shell.run_line_magic("load_ext", "nitro_ipy")
    return shell


@pytest.fixture
def trained(loaded, capsys):
    """A trained tiny experiment in the shell: grad, opt and eval compiled (3 entries)."""
    _run(loaded, EXPERIMENT)
    _run(loaded, "n.train()")
    capsys.readouterr()
    return loaded


# ------------------------------------------------------------------------------------------------ imports
@pytest.mark.parametrize(
    "code",
    [
        "import nitro_ipy",
        # The stats table is a plain function: usable (and importable) without IPython.
        "import nitro_ipy._stats as m; print(m.stats_table().summary())",
    ],
)
def test_import_never_pulls_in_ipython_or_ipywidgets(code):
    check = "; import sys; assert 'IPython' not in sys.modules and 'ipywidgets' not in sys.modules, sorted(sys.modules)"
    out = subprocess.run([sys.executable, "-c", code + check], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


# ------------------------------------------------------------------------------------------------ cell callbacks
def test_load_registers_one_set_of_callbacks_and_magics(shell):
    before = _callbacks(shell)
    shell.run_line_magic("load_ext", "nitro_ipy")
    assert _callbacks(shell) == {k: v + 1 for k, v in before.items()}
    for name in ("nitro_stats", "nitro_reset", "nitro_panel"):
        assert name in shell.magics_manager.magics["line"]

    shell.run_line_magic("load_ext", "nitro_ipy")  # IPython: "already loaded"
    nitro_ipy.load_ipython_extension(shell)  # and a direct second load
    assert _callbacks(shell) == {k: v + 1 for k, v in before.items()}
    shell.run_line_magic("reload_ext", "nitro_ipy")
    assert _callbacks(shell) == {k: v + 1 for k, v in before.items()}

    shell.run_line_magic("unload_ext", "nitro_ipy")
    assert _callbacks(shell) == before
    for name in ("nitro_stats", "nitro_reset", "nitro_panel"):
        assert name not in shell.magics_manager.magics["line"]
    assert "NitroMagics" not in shell.magics_manager.registry


def test_load_survives_a_reload_of_the_extension_module(shell):
    """Callbacks left by an earlier copy of `_magics` (after `importlib.reload`) are found and removed."""
    before = _callbacks(shell)
    _extension.load(shell)
    importlib.reload(_magics)  # the registered callbacks' class is no longer `_magics.NitroMagics`
    importlib.reload(_extension)
    _extension.load(shell)
    assert _callbacks(shell) == {k: v + 1 for k, v in before.items()}


def test_every_cell_bumps_the_world(loaded):
    w = _world.world()
    _run(loaded, "pass")
    _run(loaded, "x = 1")
    assert _world.world() == w + 2


def test_the_world_is_not_bumped_once_unloaded(loaded):
    loaded.run_line_magic("unload_ext", "nitro_ipy")
    w = _world.world()
    _run(loaded, "pass")
    assert _world.world() == w


def test_a_failing_callback_never_breaks_the_cell(loaded, monkeypatch, capsys):
    def boom():
        raise RuntimeError("kaput")

    monkeypatch.setattr(_world, "bump_world", boom)
    monkeypatch.setattr(_magics.NitroMagics, "refresh_watch", lambda self: boom())
    result = loaded.run_cell("y = 41 + 1")
    assert result.success and loaded.user_ns["y"] == 42
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "nitro_ipy: the pre-cell hook failed (RuntimeError: kaput); your cell ran normally.",
        "nitro_ipy: the post-cell hook failed (RuntimeError: kaput); your cell ran normally.",
    ]


def test_an_edit_and_a_call_in_the_same_cell_are_seen(trained, capsys):
    _run(trained, EDIT + "n.train()")
    out = capsys.readouterr().out
    assert "nitro_ipy: 2 cached programs (eval, grad) poisoned; redefined: __main__.helper." in out
    assert "! this handle's compiled programs had dependency methods redefined: __main__.helper (eval, grad)" in out


def test_terminal_messages_stay_plain_text(loaded):
    assert _report.sink() is _report.print_sink


# ------------------------------------------------------------------------------------------------ magics
def test_nitro_stats_table(trained):
    table = trained.run_line_magic("nitro_stats", "")
    stats = nitro_ipy.cache_stats()
    assert (stats.misses, stats.entries) == (3, 3)
    assert [(r.kind, r.hooks, r.state) for r in table.rows] == [
        ("grad", "forward, loss", "live"),
        ("opt", "optimizer", "live"),
        ("eval", "forward, loss", "live"),
    ]
    assert table.rows[0].shapes == "params['v'][4], params['w'][3, 4], batch['x'][16, 3], batch['y'][16]"
    assert [r.short_shapes for r in table.rows] == [
        "params: 2 arrays, batch['x'][16, 3], batch['y'][16]",
        "params: 2 arrays, grads: 1 array",  # sgd: an empty optimizer state
        "params: 2 arrays, inputs['x'][16, 3], targets['y'][16]",
    ]
    assert [r.hits for r in table.rows] == [2, 2, 0]  # 3 steps: 1 compile + 2 reuses; 1 eval batch
    text = repr(table).splitlines()
    assert text[0] == f"nitro_ipy cache: hits {stats.hits} | misses 3 | entries 3 | poisoned 0"
    assert text[1].split() == ["kind", "hooks", "argument", "shapes", "trace", "s", "compile", "s", "hits", "state"]
    assert [line.split()[0] for line in text[2:]] == ["grad", "opt", "eval"]
    # Aligned: text columns start, numeric columns end, at the header's offsets on every row.
    header = text[1]
    starts = [header.index(h) for h in ("hooks", "argument shapes", "state")]
    ends = [header.index(h) + len(h) for h in ("trace s", "compile s", "hits")]
    for line in text[2:]:
        assert all(line[s - 1] == " " and line[s] != " " for s in starts), line
        assert all(line[e - 1] != " " and line[e] == " " for e in ends), line
    html = table._repr_html_()
    for header in ("kind", "hooks", "argument shapes", "trace s", "compile s", "hits", "state"):
        assert f"<th>{header}</th>" in html
    assert "<td><code>grad</code></td>" in html


def test_nitro_stats_after_an_edit_shows_poisoned_and_why(trained, capsys):
    _run(trained, EDIT)
    table = trained.run_line_magic("nitro_stats", "")  # the scan runs first: the table is honest
    assert "nitro_ipy: 2 cached programs (eval, grad) poisoned" in capsys.readouterr().out
    assert [(r.kind, r.state) for r in table.rows] == [
        ("opt", "live"),
        ("grad", "poisoned (__main__.helper)"),
        ("eval", "poisoned (__main__.helper)"),
    ]
    _run(trained, "n = n.rebuild(); n.train()")
    table = trained.run_line_magic("nitro_stats", "")
    assert [(r.kind, r.state, r.why) for r in table.rows][:3] == [
        ("opt", "live", ""),
        ("grad", "live", "recompiling against edited code: __main__.helper"),
        ("eval", "live", "recompiling against edited code: __main__.helper"),
    ]
    assert repr(table).splitlines()[0].endswith("| misses 5 | entries 3 | poisoned 2")
    assert "  why grad compiled: recompiling against edited code: __main__.helper" in repr(table).splitlines()


def test_nitro_stats_lists_untracked_values(loaded, capsys):
    code = EXPERIMENT.replace(
        "def helper(r):\n    return r ** 2\n",
        "class Knob:\n    pass\nknob = Knob()\nknob.power = 2\ndef helper(r):\n    return r ** knob.power\n",
    )
    _run(loaded, code)
    _run(loaded, "n.train()")
    table = loaded.run_line_magic("nitro_stats", "")
    assert table.untracked == ["__main__.knob"]
    assert repr(table).splitlines()[-1] == (
        "not tracked (an edit to these is invisible; `nitro_ipy.cache_reset()` is the escape hatch): "
        "__main__.knob"
    )
    assert "<b>not tracked</b>" in table._repr_html_()


def test_nitro_stats_without_entries(loaded):
    table = loaded.run_line_magic("nitro_stats", "")
    assert repr(table).splitlines() == [
        "nitro_ipy cache: hits 0 | misses 0 | entries 0 | poisoned 0",
        "(no compiled programs)",
    ]


@pytest.mark.parametrize("line", ["%nitro_stats --reset", "%nitro_reset"])
def test_reset_magics(trained, capsys, line):
    assert nitro_ipy.cache_stats().entries == 3
    _run(trained, line)
    assert nitro_ipy.cache_stats() == (0, 0, 0)
    assert capsys.readouterr().out == "nitro_ipy: compile cache emptied; counters zeroed.\n"


def test_unknown_options_are_usage_errors_listing_the_valid_ones(loaded):
    with pytest.raises(UsageError, match=r"^`%nitro_stats`: unrecognized arguments: --bogus. Valid options: --reset.$"):
        loaded.run_line_magic("nitro_stats", "--bogus")
    with pytest.raises(UsageError, match=r"^`%nitro_reset`: unrecognized arguments: now. Valid options: --disk.$"):
        loaded.run_line_magic("nitro_reset", "now")
    with pytest.raises(UsageError, match=r"^`%nitro_panel`: unexpected `-x`. Valid options: none.$"):
        loaded.run_line_magic("nitro_panel", "-x")


def test_nitro_panel_in_a_terminal_prints_the_summary(loaded, capsys):
    loaded.run_line_magic("nitro_panel", "")
    assert capsys.readouterr().out.splitlines() == [
        "nitro_ipy: the live panel needs a notebook kernel.",
        "nitro_ipy cache: hits 0 | misses 0 | entries 0 | poisoned 0",
    ]
    assert _extension.loaded_magics(loaded).panel is None


# ------------------------------------------------------------------------------------------------ widgets
def _widget_kernel(monkeypatch):
    """Make the extension treat the terminal shell as a widget kernel (the real one is in test_kernel.py)."""
    monkeypatch.setattr(_magics, "widget_kernel", lambda shell: True)


def test_widget_kernel_installs_the_rich_sink_and_unload_restores(shell, monkeypatch):
    from nitro_ipy._widgets import RichSink

    _widget_kernel(monkeypatch)
    previous = _report.sink()
    shell.run_line_magic("load_ext", "nitro_ipy")
    assert isinstance(_report.sink(), RichSink) and _report.sink().previous is previous
    shell.run_line_magic("reload_ext", "nitro_ipy")
    assert isinstance(_report.sink(), RichSink) and _report.sink().previous is previous
    shell.run_line_magic("unload_ext", "nitro_ipy")
    assert _report.sink() is previous


def test_stale_messages_render_as_widgets(trained, monkeypatch, capsys):
    from nitro_ipy._widgets import RichSink

    sink = RichSink(trained, _report.sink())
    monkeypatch.setattr(_report, "_sink", sink)
    _run(trained, EDIT)
    _run(trained, "records = n.train()")
    out = capsys.readouterr().out
    cache_view, handle_view = sink.views
    assert cache_view.msg.kind == "stale-cache" and handle_view.msg.kind == "stale-handle"
    assert cache_view.widget.box_style == "info" and cache_view.button is None
    assert handle_view.widget.box_style == "warning"
    assert handle_view.button.description == "Rebuild handle"
    assert handle_view.button.button_style == "warning"
    assert handle_view.body.value.startswith(
        "! this handle&#x27;s compiled programs had dependency methods redefined: __main__.helper (eval, grad)."
    )
    assert handle_view.body.value.endswith("rebuild it: <code>n = n.rebuild()</code>")
    # The displays' text/plain fallback is the message's own line (what the terminal prints here).
    bundle = handle_view._repr_mimebundle_()
    assert bundle["text/plain"] == handle_view.msg.text
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert "border-left: 4px solid #f57c00" in bundle["text/html"]
    assert "border-left: 4px solid #0288d1" in cache_view._repr_mimebundle_()["text/html"]
    assert out.splitlines() == [cache_view.msg.text, handle_view.msg.text]


def test_rebuild_button_rebinds_every_name(trained, monkeypatch, capsys):
    from nitro_ipy._widgets import RichSink

    sink = RichSink(trained, _report.sink())
    monkeypatch.setattr(_report, "_sink", sink)
    _run(trained, "n_alias = n; runs = [n]; _ = n; _7 = n")
    _run(trained, EDIT + "n.train()")
    old = trained.user_ns["n"]
    view = sink.views[-1]
    view.button.click()
    ns = trained.user_ns
    new = ns["n"]
    assert new is not old and ns["n_alias"] is new and type(new) is type(old)
    assert ns["runs"][0] is old and ns["_"] is old and ns["_7"] is old  # containers and output history untouched
    assert new.step == old.step
    assert view.output.outputs == (
        {"output_type": "stream", "name": "stdout", "text": "rebuilt: n, n_alias -> new handle\n"},
    )
    b = view.button
    assert (b.description, b.button_style, b.disabled, b.icon) == ("Rebuilt", "success", True, "check")
    capsys.readouterr()
    _run(trained, "records = n.train()")
    # The rebuilt handle compiles what the edit changed, and says nothing about staleness.
    assert [line.split()[2] for line in capsys.readouterr().out.splitlines()] == ["grad", "eval"]
    assert [e.kind for e in _cache.live_entries()] == ["opt", "grad", "eval"]


def test_rebuild_button_with_no_name_left_rebuilds_nothing(trained, monkeypatch):
    from nitro_ipy._widgets import RichSink

    sink = RichSink(trained, _report.sink())
    monkeypatch.setattr(_report, "_sink", sink)
    _run(trained, EDIT + "n.train()")
    _run(trained, "n = None")
    view = sink.views[-1]
    gc.collect()
    assert view._handle() is None  # the message does not keep a stale handle (and its device state) alive
    view.button.click()
    assert view.button.description == "Rebuild handle"
    assert view.output.outputs[0]["text"].startswith("nothing rebuilt: no name in the namespace holds this handle")


def test_rebuild_failure_is_shown_in_the_widget(trained, monkeypatch):
    from nitro_ipy._widgets import RichSink

    sink = RichSink(trained, _report.sink())
    monkeypatch.setattr(_report, "_sink", sink)
    _run(trained, EDIT + "n.train()")
    _run(trained, "del Tiny.forward")  # the live class lost a required hook: rebuild refuses
    view = sink.views[-1]
    old = trained.user_ns["n"]
    view.button.click()
    assert trained.user_ns["n"] is old
    assert view.button.button_style == "danger"
    assert view.output.outputs[0]["text"].startswith("rebuild failed: ")


def test_other_message_kinds(monkeypatch, capsys):
    from nitro_ipy._widgets import RichSink

    previous = []
    ip = InteractiveShell.instance()
    sink = RichSink(ip, previous.append)
    for kind in ("disk-edit", "recompile-loop"):
        sink(_report.Message(kind, f"nitro_ipy: a {kind} line with `code`", {}))
        assert sink.views[-1].widget.box_style == "warning" and sink.views[-1].button is None
        assert sink.views[-1].body.value == f"nitro_ipy: a {kind} line with <code>code</code>"
    sink(_report.Message("compile", "nitro_ipy: compiled grad", {}))
    sink(_report.Message("epoch", "nitro_ipy: epoch 1", {}))
    assert [m.kind for m in previous] == ["compile", "epoch"]  # plain text lines, through the old sink
    assert len(sink.views) == 2


def test_messages_off_the_main_thread_stay_text():
    from nitro_ipy._widgets import RichSink

    previous = []
    sink = RichSink(InteractiveShell.instance(), previous.append)
    t = threading.Thread(target=sink, args=(_report.Message("stale-cache", "x", {}),))
    t.start()
    t.join()
    assert sink.views == [] and [m.text for m in previous] == ["x"]


def test_missing_ipywidgets_degrades_to_text_with_one_hint(shell, monkeypatch, capsys):
    _widget_kernel(monkeypatch)
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # `import ipywidgets` raises ImportError
    monkeypatch.delitem(sys.modules, "nitro_ipy._widgets", raising=False)
    monkeypatch.delattr(nitro_ipy, "_widgets", raising=False)
    monkeypatch.setattr(_magics.NitroMagics, "hinted", False)
    shell.run_line_magic("load_ext", "nitro_ipy")
    shell.run_line_magic("reload_ext", "nitro_ipy")
    assert _report.sink() is _report.print_sink
    assert capsys.readouterr().out == _magics.NO_WIDGETS + "\n"  # once, not once per load
    shell.run_line_magic("nitro_panel", "")
    assert capsys.readouterr().out.splitlines() == [
        _magics.NO_WIDGETS,
        "nitro_ipy cache: hits 0 | misses 0 | entries 0 | poisoned 0",
    ]


# ------------------------------------------------------------------------------------------------ panel
def test_panel_shows_the_cache_and_the_latest_compile(trained):
    from nitro_ipy._widgets import Panel

    panel = Panel(min_interval=0)
    panel.attach()
    try:
        _run(trained, EDIT + "n = n.rebuild(); n.train()")
        stats = nitro_ipy.cache_stats()
        values = [w.value for w in (panel.hits, panel.misses, panel.entries, panel.poisoned)]
        assert values[1:] == ["5", "3", "2"] and int(values[0]) <= stats.hits
        panel.flush()
        panel.refresh()
        assert panel.hits.value == str(stats.hits)
        assert [w.description for w in (panel.hits, panel.misses, panel.entries, panel.poisoned)] == [
            "hits", "misses", "entries", "poisoned"]
        assert panel.latest_entry.kind == "eval"
        assert panel.latest.value.startswith("eval [forward, loss] in ")
        assert panel.latest.value.endswith(" s (recompiling against edited code: __main__.helper)")
        assert panel.text() == (
            f"nitro_ipy panel: hits {stats.hits} | misses 5 | entries 3 | poisoned 2 | latest compile: "
            + panel.latest.value
        )
        bundle = panel._repr_mimebundle_()
        assert bundle["text/plain"] == panel.text()
        assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == panel.widget.model_id
        assert Panel().latest_entry is panel.latest_entry  # a new panel starts from the latest compile
        nitro_ipy.cache_reset()
        assert panel.text() == "nitro_ipy panel: hits 0 | misses 0 | entries 0 | poisoned 0 | latest compile: none yet"
        assert panel.hits.value == "0" and panel.latest.value == "none yet"
    finally:
        panel.detach()
    assert panel.on_compile not in _cache.subscribers("compile") and panel.on_reset not in _cache.subscribers("reset")
    assert panel.on_progress not in _cache.subscribers("progress")


def test_panel_updates_are_throttled_and_flushed(trained):
    from nitro_ipy._widgets import Panel

    panel = Panel(min_interval=3600)  # nothing but the first refresh gets through the throttle
    panel.attach()
    try:
        assert panel.refreshes == 0
        _run(trained, EDIT + "n = n.rebuild(); n.train()")
        for fn in _cache.subscribers("progress"):
            fn()  # what the handle's step loop calls at its sync points
        assert panel.refreshes == 0 and panel.misses.value == "3" and panel._dirty
        panel.flush()
        assert panel.refreshes == 1 and panel.misses.value == "5"
        panel.flush()  # nothing deferred: nothing sent
        assert panel.refreshes == 1
    finally:
        panel.detach()


def test_panel_is_never_touched_off_the_main_thread():
    from nitro_ipy._widgets import Panel

    panel = Panel(min_interval=0)
    t = threading.Thread(target=panel.refresh, kwargs={"force": True})
    t.start()
    t.join()
    assert panel.refreshes == 0 and panel._dirty
    panel.detach()


def test_a_failing_panel_never_breaks_training(trained, monkeypatch, capsys):
    from nitro_ipy._widgets import Panel

    panel = Panel(min_interval=0)
    panel.attach()

    def broken(force=False):
        raise RuntimeError("no frontend")

    monkeypatch.setattr(panel, "refresh", broken)
    try:
        _run(trained, EDIT + "n = n.rebuild(); n.train()")
    finally:
        panel.detach()
    assert nitro_ipy.cache_stats().misses == 5
    assert capsys.readouterr().out.count("nitro_ipy: the panel failed to update (RuntimeError: no frontend)") == 2


def test_nitro_panel_in_a_widget_kernel(shell, monkeypatch, capsys):
    _widget_kernel(monkeypatch)
    shell.run_line_magic("load_ext", "nitro_ipy")
    shell.run_line_magic("nitro_panel", "")
    shell.run_line_magic("nitro_panel", "")  # shown twice: one panel, two views
    panel = _extension.loaded_magics(shell).panel
    assert _report.sink().panel is panel and panel.on_compile in _cache.subscribers("compile")
    assert capsys.readouterr().out.splitlines() == [panel.text()] * 2
    shell.run_line_magic("unload_ext", "nitro_ipy")
    assert panel.on_compile not in _cache.subscribers("compile") and panel.on_progress not in _cache.subscribers("progress")
    assert panel.widget.comm is None and panel.hits.comm is None  # closed: its views disappear


def test_panel_recompile_loop_turns_it_warning():
    from nitro_ipy._widgets import Panel

    panel = Panel(min_interval=0)
    assert panel.widget.box_style == ""
    panel.on_message(_report.Message("recompile-loop", "nitro_ipy: recompile loop", {}))
    assert panel.widget.box_style == "warning"
    panel.on_reset()
    assert panel.widget.box_style == ""
    panel.detach()
