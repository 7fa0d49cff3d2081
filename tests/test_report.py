"""The reporter: one look per message kind, in text and HTML; the loss chart's axes, read from its SVG."""

import io
import sys
import types
import xml.etree.ElementTree as ET

import pytest

import nitro_ipy
from nitro_ipy import Nitro
from nitro_ipy._base import _html, _report
from nitro_ipy._base._report import Kind
from nitro_ipy._training import _loop, _progress

import _experiments
from _experiments import Reg

SVG = "{http://www.w3.org/2000/svg}"

# A message of every kind, as the core composes them.
CORPUS = {
    Kind.STALE_CACHE: dict(count=2, names=("m.f", "m.g"), kinds=("grad", "eval")),
    Kind.STALE_HANDLE: dict(names=("m.f",), kinds=("grad",)),
    Kind.DISK_EDIT: dict(names=tuple(f"m.f{i}" for i in range(6))),
    Kind.RECOMPILE_LOOP: dict(program="opt", why=_report.Explanation([], ["argument `opt_state` shape: [1] -> [2]"])),
    Kind.EPOCH: dict(record={"epoch": 4, "loss": 0.25, "valid_loss": 0.3}),
    Kind.LARGE_CONSTANT: dict(program="grad", nbytes=8 << 20, shape=(1024, 2048), dtype="float32", origin="table"),
    Kind.STORE_REFUSED: dict(name="abc.nitro", reason="bad header"),
    Kind.STORE_FALLBACK: dict(program="grad", reason="a host callback", path=None),
    Kind.STORE_OFF: dict(text="nitro_ipy: the program store is off."),
    Kind.RESUMED: dict(path="/tmp/ckpt", step=40, epoch=4, notes=()),
    Kind.MIXED_CODE: dict(program="eval", names=("m.f",), others=("grad",)),
    Kind.INTERRUPTED: dict(where="epoch 4, step 422/427"),
    Kind.LOGGER: dict(text="nitro_ipy.loggers: `f` raised ValueError: x; it is detached"),
}


def test_every_kind_has_one_look_and_one_text():
    assert set(CORPUS) | {Kind.COMPILE} == set(Kind) == set(_report.LOOKS) == set(_report.TEXT)
    for kind, data in CORPUS.items():
        msg = _report.message(kind, **data)
        look = _report.LOOKS[kind]
        html = _html.message_html(msg)
        assert html == _html.message_html(_report.message(kind, **data))  # the same message, drawn the same
        if look.box:
            accent = _html._TONES[look.tone][0]
            assert f"nitro-message nitro-{kind}'" in html and f"border-left: 4px solid {accent}" in html
            assert not _html.esc(msg.text).startswith("nitro_ipy: ") or "nitro_ipy: " not in html.split("</div>")[0]
        else:  # a quiet line: monospace, muted, wrapping at spaces, its text as a terminal prints it
            assert html.startswith("<div class='nitro-lines' style='font-family: var(--jp-code-font-family")
            assert "white-space: pre-wrap; overflow-wrap: anywhere" in html
            assert f"<div class='nitro-line nitro-{kind}'>{_html.esc(msg.text)}</div>" in html


def test_the_text_front_prints_the_line(capsys):
    msg = _report.message(Kind.INTERRUPTED, where="epoch 4, validating")
    _report.print_sink(msg)
    assert capsys.readouterr().out == "training interrupted at epoch 4, validating; the handle is usable\n"
    assert _report.message(Kind.INTERRUPTED, where="epoch 2, step 3/10", reason="stopped by `run.stop()`").text == (
        "training stopped at epoch 2, step 3/10: stopped by `run.stop()`; the handle is usable")


def test_a_line_said_mid_epoch_lands_above_a_terminals_bar(capsys, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    tty = Terminal()
    monkeypatch.setattr(sys, "stderr", tty)  # a terminal's stderr, where the bar is drawn
    front = _progress.TextFront()
    p = types.SimpleNamespace(steps=10, epoch=4, last=5, done=2, loss=0.5)
    front.begin_epoch(p)
    assert front.bar.desc == "epoch 4/5" and front.bar.n == 2  # the handle's epochs; a continued epoch's steps
    before = len(tty.getvalue())
    msg = _report.emit(Kind.RECOMPILE_LOOP, program="opt", why="argument `opt_state` shape: [1] -> [2]")
    during = tty.getvalue()[before:]  # the bar cleared for the line, then drawn again under it
    front.end_epoch(p)
    assert capsys.readouterr().out == msg.text + "\n"
    assert during.startswith("\r") and "epoch 4/5" in during and msg.text not in tty.getvalue()
    assert _report.bar_writer is None


def test_long_name_lists_are_summed_up_with_the_full_list_one_click_away():
    msg = _report.message(Kind.DISK_EDIT, **CORPUS[Kind.DISK_EDIT])
    assert "not loaded yet: m.f0, m.f1, m.f2 and 3 more." in msg.text
    html = _html.message_html(msg)
    assert "<details class='nitro-more'" in html and "all 6 names</summary>" in html
    assert all(f"m.f{i}" in html for i in range(6))


# ------------------------------------------------------------------------------------------------ chart
def _svg(train, valid, epochs=None):
    return ET.fromstring(_html.loss_svg(train, valid, epochs))


def _axis(svg, name):
    (g,) = [g for g in svg.iter(f"{SVG}g") if g.get("class") == name]
    return [t.text for t in g.iter(f"{SVG}text") if t.get("class") == "nitro-tick"]


def test_the_chart_has_epochs_on_x_with_whole_ticks_and_round_loss_ticks():
    train = [(0.25 * i, 1.0 / (1 + 0.25 * i)) for i in range(1, 13)]  # three epochs at 4 sync points each
    valid = [(1.0, 0.6), (2.0, 0.45), (3.0, 0.4)]
    svg = _svg(train, valid, epochs=5)
    assert _axis(svg, "nitro-x-axis") == ["0", "1", "2", "3", "4", "5"]
    assert [t.text for t in svg.iter(f"{SVG}text") if t.get("class") == "nitro-axis-label"] == ["epoch"]
    ys = [float(v) for v in _axis(svg, "nitro-y-axis")]
    assert 3 <= len(ys) <= 5 and ys == sorted(ys, reverse=False)
    step = ys[1] - ys[0]
    assert all(abs(b - a - step) < 1e-9 for a, b in zip(ys, ys[1:])) and round(step, 9) in (0.05, 0.1, 0.2, 0.25, 0.5)
    # Train and validation read apart without colour: a solid line, a dashed one through dots.
    lines = {p.get("class"): p.get("style") for p in svg.iter(f"{SVG}polyline")}
    assert "dasharray" not in lines["nitro-train"] and "stroke-dasharray: 4 3" in lines["nitro-valid"]
    dots = [c for c in svg.iter(f"{SVG}circle") if c.get("class") == "nitro-valid-point"]
    assert len(dots) == 3
    legend = [t.text for g in svg.iter(f"{SVG}g") if g.get("class") == "nitro-legend" for t in g.iter(f"{SVG}text")]
    assert legend == ["train loss", "valid loss"]


def test_many_epochs_tick_every_few_and_the_first_losses_do_not_squeeze_the_run():
    train = [(0.1, 50.0), (0.2, 20.0)] + [(0.5 * i, 0.5 - 0.001 * i) for i in range(1, 100)]
    svg = _svg(train, [])
    xs = [int(v) for v in _axis(svg, "nitro-x-axis")]
    assert xs[0] == 0 and xs[-1] >= 49 and len(xs) <= 9 and len({b - a for a, b in zip(xs, xs[1:])}) == 1
    ys = [float(v) for v in _axis(svg, "nitro-y-axis")]
    assert max(ys) < 1.0  # the run (0.40 to 0.50) fills the axis; the first two points leave it at the top


def test_one_history_across_train_calls_and_an_interrupted_epoch(monkeypatch):
    monkeypatch.setattr(_loop, "_SYNC_SECONDS", 0.0)  # a sync point every step: the curve's every x
    n = Nitro(Reg(), data={"train": _experiments.data(64), "valid": _experiments.data(16, seed=1)}, batch_size=16)
    n.train(1)
    real, calls = _loop.check_losses, []

    def interrupt(m, *args):
        calls.append(m.epoch)
        if m.epoch == 1 and len([e for e in calls if e == 1]) == 2:
            raise KeyboardInterrupt
        return real(m, *args)

    monkeypatch.setattr(_loop, "check_losses", interrupt)
    with pytest.raises(nitro_ipy.TrainingInterrupted, match="^training interrupted at epoch 2, step 3/4; the handle is usable$"):
        n.train(2)
    monkeypatch.setattr(_loop, "check_losses", real)
    n.train(2)
    assert n.epoch == 3
    xs = [x for x, _ in n._curve]
    assert xs == sorted(xs) and len(set(xs)) == len(xs), xs  # never back, never twice
    assert {1.0, 2.0, 3.0} <= set(xs) and all(0 < x <= 3 for x in xs) and all((4 * x) % 1 == 0 for x in xs), xs
    chart = n.plot()
    svg = ET.fromstring(chart.svg())
    assert _axis(svg, "nitro-x-axis") == ["0", "1", "2", "3"]
    assert [float(c.get("cx")) for c in svg.iter(f"{SVG}circle") if c.get("class") == "nitro-valid-point"] == sorted(
        float(c.get("cx")) for c in svg.iter(f"{SVG}circle") if c.get("class") == "nitro-valid-point")
    assert len(chart.valid) == 3
