"""The IPython extension, magics and widgets, driven through a real `InteractiveShell` (terminal IPython).

The kernel side (rich messages, comms) is in test_kernel.py; the quickstart notebook in test_notebook.py;
the file watcher in test_watch.py.
"""

import gc
import importlib
import re
import subprocess
import sys
import threading

import pytest
from _cells import TINY_EXPERIMENT
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

import nitro_ipy
from nitro_ipy._base import _events, _html, _report, _world
from nitro_ipy._compiler import _cache
from nitro_ipy._notebook import _extension, _magics
from nitro_ipy._training import _ahead

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
        "import nitro_ipy._compiler._stats as m; print(m.stats_table().summary())",
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
    assert [r.inputs for r in table.rows] == [
        "parameters 16 float32 (v, w); batch x [16, 3], y [16]",
        "parameters 16 float32 (v, w); gradients 16 float32",
        "parameters 16 float32 (v, w); inputs x [16, 3]; targets y [16]",
    ]
    html = table._repr_html_()
    # State and hits first, text left-aligned, headers that do not wrap, full shapes on demand.
    assert html.index(f"hits {stats.hits}") < html.index("<table")
    assert [h.split(">")[-1] for h in html.split("</th>")[:-1]] == ["state", "program", "inputs", "compile s", "hits"]
    assert html.count("white-space: nowrap'>") >= 5 and "text-align: left" in html
    assert "<details><summary>parameters 16 float32 (v, w); batch x [16, 3], y [16]</summary>" in html
    assert "params[&#x27;w&#x27;][3, 4]" in html  # the full shapes, inside the <details>


def test_nitro_stats_after_an_edit_shows_poisoned_and_why(trained, capsys):
    _run(trained, EDIT)
    table = trained.run_line_magic("nitro_stats", "")  # the scan runs first: the table is honest
    assert "nitro_ipy: 2 cached programs (eval, grad) poisoned" in capsys.readouterr().out
    assert [(r.kind, r.state) for r in table.rows] == [
        ("opt", "live"),
        ("grad", "poisoned (__main__.helper)"),
        ("eval", "poisoned (__main__.helper)"),
    ]
    # Compile ahead (on, as users have it) builds the replacements after the edit's cell; waiting for it
    # makes the table's states deterministic: the rebuild takes both, and the table says for whom.
    assert _ahead.wait(60)
    _run(trained, "n = n.rebuild(); n.train()")
    table = trained.run_line_magic("nitro_stats", "")
    assert [(r.kind, r.state, r.why) for r in table.rows][:3] == [
        ("opt", "live", ""),
        ("grad", "live, compiled ahead for `n`", "recompiling against edited code: __main__.helper"),
        ("eval", "live, compiled ahead for `n`", "recompiling against edited code: __main__.helper"),
    ]
    assert repr(table).splitlines()[0].endswith("| misses 5 | entries 3 | poisoned 2")
    assert "  why grad compiled: recompiling against edited code: __main__.helper" in repr(table).splitlines()


def test_nitro_stats_why_lists_every_change_the_lines_sum_up(trained, capsys):
    _run(trained, "m = Nitro(Tiny(hidden=9), data=data, batch_size=2, progress=False); m.train(1)")
    out = capsys.readouterr().out
    grad_line = next(ln for ln in out.splitlines() if ln.startswith("nitro_ipy: compiled grad"))
    assert grad_line.endswith("(GraphConst `hidden`: 4 -> 9, and 4 argument shapes with it)")
    grad = [e for e in _cache.live_entries() if e.kind == "grad"][-1]
    short = repr(trained.run_line_magic("nitro_stats", "")).splitlines()
    full = repr(trained.run_line_magic("nitro_stats", "--why")).splitlines()
    assert "  why grad compiled: GraphConst `hidden`: 4 -> 9, and 4 argument shapes with it" in short
    at = full.index("  why grad compiled: GraphConst `hidden`: 4 -> 9, and 4 argument shapes with it:")
    assert full[at + 1:at + 6] == [f"    {c}" for c in (*grad.why.causes, *grad.why.follows)]
    assert len(grad.why.follows) == 4 and all(" shape: " in f for f in grad.why.follows)
    html = trained.run_line_magic("nitro_stats", "")._repr_html_()
    assert "all 5 changes</summary>" in html and "<details class='nitro-more'" in html
    assert "<details open class='nitro-more'" in trained.run_line_magic("nitro_stats", "--why")._repr_html_()


def test_nitro_stats_lists_untracked_values(loaded, capsys):
    code = EXPERIMENT.replace(
        "def helper(r):\n    return r ** 2\n",
        "import threading\nclass Knob:\n    pass\nknob = Knob()\nknob.power = 2\nknob.lock = threading.Lock()\n"
        "def helper(r):\n    return r ** knob.power\n",
    )
    _run(loaded, code)
    _run(loaded, "n.train()")
    table = loaded.run_line_magic("nitro_stats", "")
    assert table.untracked == ["__main__.knob"]
    # Per program: the gradient and evaluation programs call `helper`; the optimizer does not.
    assert [(r.kind, r.untracked) for r in table.rows] == [
        ("grad", ("__main__.knob",)), ("opt", ()), ("eval", ("__main__.knob",))]
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
    with pytest.raises(UsageError, match=r"^`%nitro_stats`: unrecognized arguments: --bogus. Valid options: --reset, --why.$"):
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
    from nitro_ipy._notebook._widgets import RichSink

    _widget_kernel(monkeypatch)
    previous = _report.sink()
    shell.run_line_magic("load_ext", "nitro_ipy")
    assert isinstance(_report.sink(), RichSink) and _report.sink().previous is previous
    shell.run_line_magic("reload_ext", "nitro_ipy")
    assert isinstance(_report.sink(), RichSink) and _report.sink().previous is previous
    shell.run_line_magic("unload_ext", "nitro_ipy")
    assert _report.sink() is previous


def _captured(fn, *args):
    """Run `fn(*args)` capturing its display outputs, as a kernel would publish them (with updates)."""
    from IPython.utils.capture import capture_output

    with capture_output() as cap:
        fn(*args)
    return cap.outputs


def _sinked(monkeypatch, shell):
    from nitro_ipy._notebook._widgets import RichSink

    sink = RichSink(shell, _report.sink())
    monkeypatch.setattr(_report, "_sink", sink)
    return sink


def test_stale_messages_are_html_boxes_with_one_button(trained, monkeypatch):
    sink = _sinked(monkeypatch, trained)
    # The cache-level box comes at the end of the edit's cell (compile ahead scans there) or, with compile
    # ahead off, from the next entry point.
    outputs = _captured(_run, trained, EDIT) + _captured(_run, trained, "records = n.train()")
    cache_out, handle_out, button_out = [o.data for o in outputs]
    assert [o.metadata for o in outputs] == [{}, {}, {"nitro_ipy": {"live": "rebuild"}}]
    assert set(cache_out) == set(handle_out) == {"text/plain", "text/html"}
    # text/plain is the line a terminal prints; the HTML has a title line and the details.
    assert cache_out["text/plain"].startswith("nitro_ipy: 2 cached programs (eval, grad) poisoned; redefined: __main__.helper.")
    assert handle_out["text/plain"].startswith(
        "! this handle's compiled programs had dependency methods redefined: __main__.helper (eval, grad).")
    assert "border-left: 4px solid var(--jp-info-color1, #0288d1)" in cache_out["text/html"]
    assert "border-left: 4px solid var(--jp-warn-color1, #f57c00)" in handle_out["text/html"]
    assert "line-height: 1.4" in handle_out["text/html"] and "color: var(--jp-content-font-color1, inherit)" in handle_out["text/html"]
    assert ">This handle runs code compiled before your edit</div><div style='margin-top: 2px'>This handle&#x27;s" in handle_out["text/html"]
    assert handle_out["text/html"].endswith("rebuild it: <code style='" + nitro_ipy._base._html._MONO + "'>n = n.rebuild()</code></div></div>")
    assert set(button_out) == {"application/vnd.jupyter.widget-view+json", "text/plain", "text/html"}
    assert button_out["text/plain"] == "not clicked when the notebook was saved; to use the current code: `n = n.rebuild()`"
    (button,) = sink.buttons
    assert button_out["application/vnd.jupyter.widget-view+json"]["model_id"] == button.widget.model_id
    assert (button.widget.description, button.widget.button_style, button.state) == ("Rebuild handle", "warning", "ready")


def test_rebuild_button_rebinds_every_name_and_ends_as_html(trained, monkeypatch, capsys):
    sink = _sinked(monkeypatch, trained)
    _run(trained, "n_alias = n; runs = [n]; _ = n; _7 = n")
    _captured(_run, trained, EDIT + "n.train()")
    old = trained.user_ns["n"]
    (button,) = sink.buttons
    (update,) = _captured(button.widget.click)
    ns = trained.user_ns
    new = ns["n"]
    assert new is not old and ns["n_alias"] is new and type(new) is type(old)
    assert ns["runs"][0] is old and ns["_"] is old and ns["_7"] is old  # containers and output history untouched
    assert new.step == old.step
    # The button's own output becomes what it did, as HTML: the saved notebook keeps that, not a widget.
    assert update.update and update.transient["display_id"] == button.handle.display_id
    assert update.data["text/plain"] == "rebuilt: n, n_alias -> new handle"
    assert set(update.data) == {"text/plain", "text/html"} and "jp-success-color1" in update.data["text/html"]
    assert button.state == "done" and button.widget.comm is None  # closed
    outputs = _captured(_run, trained, "records = n.train()")
    # The rebuilt handle compiles what the edit changed, and says nothing about staleness: its lines
    # share the cell's one output.
    assert {o.transient["display_id"] for o in outputs} == {sink.block.handle.display_id}
    lines = outputs[-1].data["text/plain"].splitlines()
    assert [line.split()[2] for line in lines if " compiled " in line] == ["grad", "eval"]
    assert [e.kind for e in _cache.live_entries()] == ["opt", "grad", "eval"]


def test_rebuild_button_with_no_name_left_rebuilds_nothing(trained, monkeypatch):
    sink = _sinked(monkeypatch, trained)
    _captured(_run, trained, EDIT + "n.train()")
    (button,) = sink.buttons
    _run(trained, "n = None")
    gc.collect()
    assert button._handle() is None  # the message does not keep a stale handle (and its device state) alive
    (update,) = _captured(button.widget.click)
    assert update.data["text/plain"].startswith("nothing rebuilt: no name in the namespace holds this handle")


def test_rebuild_failure_is_shown_as_the_buttons_result(trained, monkeypatch):
    sink = _sinked(monkeypatch, trained)
    _captured(_run, trained, EDIT + "n.train()")
    _run(trained, "del Tiny.forward")  # the live class lost a required hook: rebuild refuses
    (button,) = sink.buttons
    old = trained.user_ns["n"]
    (update,) = _captured(button.widget.click)
    assert trained.user_ns["n"] is old and button.state == "failed"
    assert update.data["text/plain"].startswith("failed: ")
    assert "jp-error-color1" in update.data["text/html"]


def test_unclicked_buttons_are_retired_after_a_cell_once_nothing_holds_their_handle(trained, monkeypatch):
    sink = _sinked(monkeypatch, trained)
    _captured(_run, trained, EDIT + "n.train()")
    (button,) = sink.buttons
    sink.retire()
    assert button.state == "ready"  # `n` still holds the stale handle: the button stays useful
    _run(trained, "n = n.rebuild()")
    (update,) = _captured(sink.retire)
    assert button.state == "retired" and sink.buttons == []
    assert update.data["text/plain"] == "no longer needed: no name holds that handle any more (it was rebuilt or dropped)"


def test_unclicked_buttons_end_as_html_once_the_user_moves_on(trained, monkeypatch):
    sink = _sinked(monkeypatch, trained)
    _captured(_run, trained, EDIT + "n.train()")
    _captured(_run, trained, "n.train()")  # the same stale handle again: a second button
    first, second = sink.buttons
    updates = _captured(lambda: sink.retire(moved_on=True))
    assert [u.transient["display_id"] for u in updates] == [first.handle.display_id, second.handle.display_id]
    assert {u.data["text/plain"] for u in updates} == {
        "not clicked before the next cell ran; to use the current code: `n = n.rebuild()`"}
    assert all(set(u.data) == {"text/plain", "text/html"} and "nitro-retired" in u.data["text/html"] for u in updates)
    assert (first.state, second.state, sink.buttons) == ("retired", "retired", [])
    assert first.widget.comm is None and second.widget.comm is None  # closed: the kernel keeps no model
    assert _captured(lambda: sink.retire(moved_on=True)) == []  # nothing left to retire


def test_a_cells_messages_share_one_output_each_in_its_kinds_look(monkeypatch):
    from nitro_ipy._notebook._widgets import RichSink

    previous = []
    ip = InteractiveShell.instance()
    sink = RichSink(ip, previous.append)
    said = [
        _report.Message("compile", "nitro_ipy: compiled grad [forward, loss] in 0.20 s", {}),
        _report.Message("disk-edit", "nitro_ipy: a disk-edit line with `code`", {"names": ("m.f",)}),
        _report.Message("epoch", "nitro_ipy: epoch 1 | loss 0.5", {}),
        _report.Message("compile", "nitro_ipy: compiled eval [forward, loss] in 0.10 s", {}),
        _report.Message("recompile-loop", "nitro_ipy: a recompile-loop line", {"program": "grad", "why": "x"}),
    ]
    outputs = [_captured(sink, msg) for msg in said]
    assert [len(o) for o in outputs] == [1, 1, 1, 1, 1]
    first, *later = [o[0] for o in outputs]
    assert not first.update and all(o.update for o in later)  # one output, updated in place
    assert {o.transient["display_id"] for o in later} == {first.transient["display_id"]}
    final = later[-1].data
    assert final["text/plain"] == "\n".join(m.text for m in said)  # what a terminal prints, in order
    html = final["text/html"]
    # Lines in muted monospace blocks (consecutive ones together), boxes between, in the order said.
    marks = re.findall(r"class='(nitro-lines|nitro-line nitro-\w+|nitro-box nitro-\w+ nitro-message nitro-[\w-]+)", html)
    assert marks == ["nitro-lines", "nitro-line nitro-compile", "nitro-box nitro-warning nitro-message nitro-disk-edit",
                     "nitro-lines", "nitro-line nitro-epoch", "nitro-line nitro-compile",
                     "nitro-box nitro-warning nitro-message nitro-recompile-loop"]
    assert ">Edited on disk, not loaded yet</div>" in html and "A disk-edit line with <code" in html
    assert ">Recompile loop in the <code" in html
    # Every line of one kind is drawn alike: the same markup as the reporter's own for that message.
    assert _html.message_html(said[0]).split("<div class='nitro-line")[1] in html
    assert previous == [] and sink.buttons == []
    ip.execution_count += 1  # the next cell starts an output of its own
    try:
        (nxt,) = _captured(sink, said[2])
    finally:
        ip.execution_count -= 1
    assert not nxt.update and nxt.data["text/plain"] == said[2].text


def test_a_line_on_screen_keeps_no_program_or_handle_alive(trained, monkeypatch):
    import weakref

    sink = _sinked(monkeypatch, trained)
    before = {id(e) for e in _cache.live_entries()}
    _captured(_run, trained, "q = Nitro(Tiny(hidden=5), data=data, batch_size=16, progress=False); rows = q.train(1)")
    mine = [weakref.ref(e) for e in _cache.live_entries() if id(e) not in before]
    handle = weakref.ref(trained.user_ns["q"])
    assert len(mine) == 3 and [m.kind for m in sink.block.messages].count("compile") == 3
    nitro_ipy.cache_reset()
    _run(trained, "del q")
    gc.collect()
    assert handle() is None and all(ref() is None for ref in mine)  # the cell's output still shows their lines
    assert sink.block.output().text.count("nitro_ipy: compiled ") == 3


def test_messages_off_the_main_thread_are_drawn_by_the_main_thread_alike():
    from nitro_ipy._notebook._widgets import RichSink

    previous = []
    sink = RichSink(InteractiveShell.instance(), previous.append)
    ahead = _report.Message("compile", "nitro_ipy: compiled eval [forward, loss] in 0.10 s (compiled ahead)", {})
    stale = _report.Message("stale-cache", "nitro_ipy: 1 cached program (grad) poisoned; redefined: m.f.",
                            {"count": 1, "names": ("m.f",), "kinds": ("grad",)})
    threads = [threading.Thread(target=sink, args=(m,)) for m in (ahead, stale)]
    drawn = _captured(lambda: [(t.start(), t.join()) for t in threads])
    assert drawn == [] and previous == [] and sink.pending == [ahead, stale]  # nothing printed, nothing shown
    epoch = _report.Message("epoch", "nitro_ipy: epoch 1 | loss 0.5", {})
    outputs = _captured(sink, epoch)  # the main thread draws the queued ones first, in order
    assert sink.pending == []
    assert outputs[-1].data["text/plain"] == "\n".join(m.text for m in (ahead, stale, epoch))
    # Drawn exactly as the same messages said on the main thread.
    main = RichSink(InteractiveShell.instance(), previous.append)
    alike = [_captured(main, m) for m in (ahead, stale, epoch)][-1]
    assert alike[-1].data == outputs[-1].data


def test_progress_display_one_per_train_call(trained, monkeypatch):
    sink = _sinked(monkeypatch, trained)
    _run(trained, "p = Nitro(Tiny(hidden=6), data=data, batch_size=2)")  # 24 steps an epoch
    misses = nitro_ipy.cache_stats().misses
    outputs = _captured(_run, trained, "p.train(3)")
    front = sink.front
    first, *updates = outputs
    assert not first.update and all(u.update for u in updates)
    assert {u.transient["display_id"] for u in updates} == {first.transient["display_id"]}
    # The display opens with the first step's compile lines, in the same look as every later line.
    assert first.data["text/plain"].startswith("nitro_ipy: compiled grad [forward, loss]")
    assert any(u.data["text/plain"].splitlines()[-1].startswith("nitro_ipy: epoch 1/3 | step ") for u in updates)
    # Updated at the epoch ends, at most every 0.25 s between, and once at the end: never per step.
    assert len(updates) == front.updates and 3 <= front.updates < 80
    final = updates[-1].data["text/plain"].splitlines()
    compiled = nitro_ipy.cache_stats().misses - misses
    assert [line.split()[1] for line in final] == ["compiled"] * compiled + ["epoch"] * 3
    assert final[compiled - 1].startswith("nitro_ipy: compiled eval [forward, loss]")
    assert updates[-1].data["text/html"].count("class='nitro-line nitro-compile'") == compiled
    assert [r["epoch"] for r in trained.user_ns["p"].history] == [1, 2, 3]
    assert final[-1] == _report.message("epoch", record=trained.user_ns["p"].history[-1]).text
    assert "nitro-progress-running" not in updates[-1].data["text/html"]


def test_progress_display_says_where_an_interrupt_landed(trained, monkeypatch):
    from nitro_ipy._training import _loop

    sink = _sinked(monkeypatch, trained)
    ns = trained.user_ns
    p = ns["Nitro"](ns["Tiny"](hidden=6), data=ns["data"], batch_size=16)
    real = _loop.check_losses

    def interrupt_in_epoch_2(n, *args):
        if n.epoch == 1:
            raise KeyboardInterrupt
        return real(n, *args)

    monkeypatch.setattr(_loop, "check_losses", interrupt_in_epoch_2)

    def train():
        with pytest.raises(KeyboardInterrupt):
            p.train(3)

    outputs = _captured(train)
    assert outputs[-1].data["text/plain"].splitlines()[-1] == (
        "nitro_ipy: training interrupted at epoch 2, step 3/3; the handle is usable")
    assert sink.front.stop_text.startswith("training interrupted") and sink.front.progress is None
    assert [r["epoch"] for r in p.history] == [1] and p.step == 6


def _stop_in_epoch(monkeypatch, epoch: int):
    """Press Ctrl-C at the first sync point of the handle's epoch `epoch` (1-based)."""
    from nitro_ipy._training import _loop

    real = _loop.check_losses

    def interrupt(n, *args):
        if n.epoch + 1 == epoch:
            raise KeyboardInterrupt
        return real(n, *args)

    monkeypatch.setattr(_loop, "check_losses", interrupt)


@pytest.mark.parametrize("progress", [True, False])
def test_a_stop_is_said_once_in_the_handles_epochs(trained, monkeypatch, capsys, progress):
    _widget_kernel(monkeypatch)
    trained.run_line_magic("reload_ext", "nitro_ipy")  # the rich sink, which says a stop once
    _run(trained, f"p = Nitro(Tiny(hidden=6), data=data, batch_size=16, progress={progress}); p.train(2)")
    _stop_in_epoch(monkeypatch, 4)  # the second epoch of the next call: the handle's fourth
    capsys.readouterr()
    results = []
    outputs = _captured(lambda: results.append(trained.run_cell("p.train(3)")))
    (result,) = results
    err = result.error_in_exec
    p = trained.user_ns["p"]
    line = "training interrupted at epoch 4, step 3/3; the handle is usable"
    assert isinstance(err, nitro_ipy.TrainingInterrupted) and str(err) == line  # what a script prints
    assert (err.epoch, err.step, err.steps, p.epoch, [r["epoch"] for r in err.rows]) == (4, 3, 3, 3, [3])
    assert not result.success  # the cell still ends in an error: a "Run All" stops there
    # Said once: the last state of each output, and nothing printed (no traceback under it).
    finals = {o.transient["display_id"]: o.data for o in outputs}
    said = [d for d in finals.values() if "training interrupted" in d["text/plain"]]
    out = capsys.readouterr()
    assert "training interrupted" not in out.out + out.err
    assert len(said) == 1 and said[0]["text/plain"].count("training interrupted") == 1
    assert said[0]["text/plain"].splitlines()[-1] == (f"nitro_ipy: {line}" if progress else line)
    html = said[0]["text/html"]
    assert html.count("nitro-message nitro-interrupted") == 1 and "jp-warn-color1" in html
    if progress:  # in the call's display, where its progress line was; the epoch lines above it agree
        assert "nitro-progress-stopped" in html and "epoch 3/5" not in html
        assert [ln for ln in said[0]["text/plain"].splitlines() if " | loss " in ln][-1].startswith("nitro_ipy: epoch 3 |")


def test_the_progress_line_counts_the_handles_epochs(trained, monkeypatch):
    sink = _sinked(monkeypatch, trained)
    _run(trained, "p = Nitro(Tiny(hidden=6), data=data, batch_size=16); p.train(2)")
    outputs = _captured(_run, trained, "p.train(2)")
    lines = [o.data["text/plain"].splitlines()[-1] for o in outputs]
    running = [ln for ln in lines if " | step " in ln]
    assert running and {ln.split(" | ")[0] for ln in running} <= {"nitro_ipy: epoch 3/4", "nitro_ipy: epoch 4/4"}
    assert nitro_ipy._training._progress.latest().last == 4 == trained.user_ns["p"].epoch


def test_plot_is_the_panels_chart_of_the_history(trained):
    n = trained.user_ns["n"]  # trained with progress=False: the curve is per epoch
    _run(trained, "n.train(2)")
    chart = n.plot()
    assert chart.train == [(1, n.history[0]["loss"]), (2, n.history[1]["loss"]), (3, n.history[2]["loss"])]
    assert chart.valid == [(float(r["epoch"]), r["valid_loss"]) for r in n.history]
    bundle = chart._repr_mimebundle_()
    assert bundle["text/html"].count("nitro-valid-point") == 3 and "<polyline class='nitro-train'" in bundle["text/html"]
    assert bundle["text/plain"] == (f"nitro_ipy loss chart: train loss {n.history[0]['loss']:.4g} → "
                                    f"{n.history[-1]['loss']:.4g} (3 points), valid loss "
                                    f"{n.history[-1]['valid_loss']:.4g} at epoch 3")


def test_missing_ipywidgets_degrades_to_text_with_one_hint(shell, monkeypatch, capsys):
    _widget_kernel(monkeypatch)
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # `import ipywidgets` raises ImportError
    monkeypatch.delitem(sys.modules, "nitro_ipy._notebook._widgets", raising=False)
    monkeypatch.delattr(nitro_ipy._notebook, "_widgets", raising=False)  # (its home since the move)
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
def _shown(panel):
    """Show `panel`, returning its three outputs' first data."""
    return [o.data for o in _captured(panel.show)]


def test_panel_shows_the_cache_and_the_latest_compile(trained, monkeypatch):
    from nitro_ipy._notebook._panel import Panel

    panel = Panel(min_interval=0)
    panel.attach()
    try:
        main, latest, stop_slot = _shown(panel)
        assert main["text/plain"].startswith("nitro_ipy panel: hits 4 | misses 3 | entries 3 | poisoned 0 | "
                                             "latest compile: eval [forward, loss] in ")
        assert stop_slot == {"text/plain": "", "text/html": ""}
        assert "flex-wrap: wrap" in main["text/html"] and main["text/html"].count("nitro-chip-plain") == 4
        updates = _captured(_run, trained, EDIT + "n = n.rebuild(); n.train()")
        stats = nitro_ipy.cache_stats()
        main_id, latest_id, _ = [h.display_id for h in panel._displays[0]]
        assert {u.transient["display_id"] for u in updates} <= {main_id, latest_id}
        panel.flush()
        last_main = [u for u in updates if u.transient["display_id"] == main_id][-1].data
        assert panel.text() == (
            f"nitro_ipy panel: hits {stats.hits} | misses 5 | entries 3 | poisoned 2 | latest compile: "
            f"eval [forward, loss] in {panel.latest_entry.trace_s + panel.latest_entry.compile_s:.2f} s "
            "(recompiling against edited code: __main__.helper)"
        )
        # A warning chip while programs compiled before an edit are around.
        assert "stale: 2 programs compiled before an edit" in last_main["text/html"]
        last_latest = [u for u in updates if u.transient["display_id"] == latest_id][-1].data
        assert "<details><summary>latest compile: <code" not in last_latest["text/html"]
        assert "why: recompiling against edited code: __main__.helper" in last_latest["text/html"]
        assert Panel().latest_entry is panel.latest_entry  # a new panel starts from the latest compile
        nitro_ipy.cache_reset()
        assert panel.text() == "nitro_ipy panel: hits 0 | misses 0 | entries 0 | poisoned 0 | latest compile: none yet"
    finally:
        panel.detach()
    assert panel.on_compile not in _events.subscribers("compile") and panel.on_reset not in _events.subscribers("reset")
    assert panel.on_progress not in _events.subscribers("progress") and panel.on_run not in _events.subscribers("run")


def test_panel_draws_the_loss_chart_of_the_running_train(trained, monkeypatch):
    from nitro_ipy._notebook._panel import Panel

    _sinked(monkeypatch, trained)
    panel = Panel(min_interval=0)
    panel.attach()
    try:
        _shown(panel)
        _captured(_run, trained, "p = Nitro(Tiny(hidden=6), data=data, batch_size=16); p.train(2)")
        p = trained.user_ns["p"]
        chart = panel.chart()
        assert chart.valid == [(1.0, p.history[0]["valid_loss"]), (2.0, p.history[1]["valid_loss"])]
        assert chart.train[-1] == (2.0, pytest.approx(chart.train[-1][1])) and len(chart.train) >= 2
        main, _ = panel.outputs()
        assert "<svg class='nitro-chart'" in main.html and main.html.count("nitro-valid-point") == 2  # the validation dots
        assert main.text.splitlines()[1] == repr(chart)
    finally:
        panel.detach()


def test_panel_updates_are_throttled_and_flushed(trained):
    from nitro_ipy._notebook._panel import Panel

    panel = Panel(min_interval=3600)  # nothing but forced refreshes get through the throttle
    panel.attach()
    try:
        _shown(panel)
        panel._last = __import__("time").monotonic()
        _captured(_run, trained, EDIT + "n = n.rebuild(); n.train()")
        for fn in _events.subscribers("progress"):
            fn()  # what the handle's step loop calls at its sync points
        assert panel.refreshes == 0 and panel._dirty
        outputs = _captured(panel.flush)
        assert panel.refreshes == 1 and len(outputs) == 2  # both outputs changed
        assert "misses 5" in outputs[0].data["text/plain"]
        assert _captured(panel.flush) == [] and panel.refreshes == 1  # nothing deferred: nothing sent
        panel._dirty = True
        assert _captured(panel.flush) == [] and panel.refreshes == 1  # nothing changed: nothing sent
    finally:
        panel.detach()


def test_panel_is_never_touched_off_the_main_thread():
    from nitro_ipy._notebook._panel import Panel

    panel = Panel(min_interval=0)
    t = threading.Thread(target=panel.refresh, kwargs={"force": True})
    t.start()
    t.join()
    assert panel.refreshes == 0 and panel._dirty
    panel.detach()


def test_a_failing_panel_never_breaks_training(trained, monkeypatch, capsys):
    from nitro_ipy._notebook._panel import Panel

    panel = Panel(min_interval=0)
    panel.attach()

    def broken(force=False):
        raise RuntimeError("no frontend")

    monkeypatch.setattr(panel, "refresh", broken)
    try:
        _run(trained, EDIT)
        _ahead.wait(60)  # grad and eval compiled ahead: each shown (failing) as its miss is counted
        _run(trained, "n = n.rebuild(); n.train()")  # and again as the rebuild takes it
    finally:
        panel.detach()
    assert nitro_ipy.cache_stats().misses == 5
    assert capsys.readouterr().out.count("nitro_ipy: the panel failed to update (RuntimeError: no frontend)") == 4


def test_nitro_panel_in_a_widget_kernel(shell, monkeypatch, capsys):
    _widget_kernel(monkeypatch)
    shell.run_line_magic("load_ext", "nitro_ipy")
    shell.run_line_magic("nitro_panel", "")
    shell.run_line_magic("nitro_panel", "")  # shown twice: one panel, two places
    panel = _extension.loaded_magics(shell).panel
    assert _report.sink().panel is panel and panel.on_compile in _events.subscribers("compile")
    assert len(panel._displays) == 2
    assert capsys.readouterr().out.splitlines() == [panel.text(), "latest compile: none yet", ""] * 2
    shell.run_line_magic("unload_ext", "nitro_ipy")
    assert panel.on_compile not in _events.subscribers("compile") and panel.on_progress not in _events.subscribers("progress")


def test_panel_recompile_loop_turns_it_warning():
    from nitro_ipy._notebook._panel import Panel

    panel = Panel(min_interval=0)
    assert "nitro-plain nitro-panel" in panel.outputs()[0].html
    panel.on_message(_report.Message("recompile-loop", "nitro_ipy: recompile loop", {"program": "grad"}))
    assert "nitro-warning nitro-panel" in panel.outputs()[0].html
    assert "recompile loop in <code" in panel.outputs()[0].html
    panel.on_reset()
    assert "nitro-plain nitro-panel" in panel.outputs()[0].html
    panel.detach()


class _Run:
    """A background run as the panel sees it: `stop()`, and `done` once it ended."""

    def __init__(self):
        self.done, self.stopped = False, 0

    def stop(self):
        self.stopped += 1
        self.done = True

    summary = "stopped at epoch 1"


def test_panel_stop_button_stops_a_background_run_and_ends_as_html():
    from nitro_ipy._notebook._panel import Panel

    panel = Panel(min_interval=0)
    panel.attach()
    try:
        _shown(panel)
        run = _Run()
        stop_id = panel._displays[0][2].display_id
        (shown,) = [o for o in _captured(_events.publish, "run", run)  # the runs side publishes its run at start
                    if o.transient["display_id"] == stop_id]
        assert "background run active" in panel.outputs()[0].html
        assert panel.stop_button.widget.description == "Stop"
        assert "application/vnd.jupyter.widget-view+json" in shown.data
        assert shown.metadata == {"nitro_ipy": {"live": "stop"}}
        assert shown.data["text/plain"] == (
            "live when the notebook was saved: a background run was training; the panel above shows how far "
            "it had got, its Stop button stops it only in the kernel that ran it")
        outputs = [o for o in _captured(panel.stop_button.widget.click) if o.transient["display_id"] == stop_id]
        assert run.stopped == 1
        assert outputs[0].data["text/plain"] == "stop asked: the run ends at the next step boundary, nothing lost"
        assert panel.stop_button.widget.comm is None
        # An unclicked button of a run that ended is retired with the run's summary.
        other = _Run()
        _captured(_events.publish, "run", other)
        other.done = True
        (retired,) = [o for o in _captured(panel.refresh, True) if "background run" in o.data["text/plain"]]
        assert retired.data["text/plain"] == "background run ended: stopped at epoch 1"
        assert panel.run is None
    finally:
        panel.detach()

