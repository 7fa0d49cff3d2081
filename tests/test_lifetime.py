"""Handles let go: nothing process-wide keeps a strong reference to a handle (the progress the panel
reads, the panel, background runs, compile ahead, the stale messages and their Rebuild buttons), so
`del n` and `n = n.rebuild()` free the old handle and its device arrays at once, with the garbage
collector off."""

import contextlib
import gc
import sys
import weakref

import pytest
from _cells import TINY_EXPERIMENT
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

from nitro_ipy._notebook import _extension, _magics
from nitro_ipy._training import _ahead, _progress

# A tiny experiment whose optimizer has a decay mask: the flat layout's groups are part of what must go.
EXPERIMENT = TINY_EXPERIMENT.replace(
    "return optax.sgd(self.lr)",
    "return optax.adamw(self.lr, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))")


def _holders(obj) -> str:
    """Who holds `obj` (for the failure message): the referrers' types, and what holds those."""
    lines = []
    for r in gc.get_referrers(obj):
        if r is sys._getframe():
            continue
        lines.append(f"{type(r).__qualname__}: {repr(r)[:120]}")
        for rr in gc.get_referrers(r)[:4]:
            lines.append(f"    <- {type(rr).__qualname__}: {repr(rr)[:100]}")
    return "\n".join(lines)


@contextlib.contextmanager
def _no_gc():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _dead(ref, arrays=()):
    alive = ref()
    if alive is not None:
        holders = _holders(alive)
        del alive
        pytest.fail(f"the handle outlived its last name; held by:\n{holders}")
    assert [a() for a in arrays] == [None] * len(arrays)  # its device arrays went with it


def _weak_arrays(n):
    import jax

    return [weakref.ref(x) for x in jax.tree.leaves((n._params, n._opt_state)) if isinstance(x, jax.Array)]


def _ns():
    ns = {}
    exec(EXPERIMENT, ns)
    return ns


@pytest.mark.parametrize("progress", [True, False])
def test_del_frees_the_handle_after_train_validate_predict_and_a_background_run(progress):
    ns = _ns()
    with _no_gc():
        n = ns["Nitro"](ns["Tiny"](), data=ns["data"], batch_size=16, max_epochs=2, progress=progress)
        n.train()
        n.validate()
        n.evaluate("valid")
        n.predict({"x": ns["X"]})
        run = n.train(1, background=True)
        run.wait()
        assert _progress.latest() is not None or not progress  # the panel's data stays
        ref, arrays = weakref.ref(n), _weak_arrays(n)
        del n, run
        _dead(ref, arrays)
        if progress:
            assert _progress.latest().train_points  # the curve it drew is kept, not the handle


def test_rebinding_the_name_to_the_rebuild_frees_the_old_handle():
    ns = _ns()
    with _no_gc():
        n = ns["Nitro"](ns["Tiny"](), data=ns["data"], batch_size=16)
        n.train()
        ref, arrays = weakref.ref(n), _weak_arrays(n)
        n = n.rebuild()
        _dead(ref, arrays)
        n.train()
        ref = weakref.ref(n)
        del n
        _dead(ref)


@pytest.fixture
def notebook(monkeypatch):
    """A real `InteractiveShell` with the extension loaded as in a widget kernel (the rich sink, the
    panel), compile ahead on; unloaded afterwards."""
    monkeypatch.setattr(_magics, "widget_kernel", lambda shell: True)
    ahead = _ahead.compile_ahead_enabled()
    _ahead.set_compile_ahead(True)
    ip = InteractiveShell.instance()
    ip.reset(new_session=False)
    ip.run_line_magic("load_ext", "nitro_ipy")
    try:
        yield ip
    finally:
        _ahead.wait(60)
        ip.run_line_magic("unload_ext", "nitro_ipy")
        _extension.unload(ip)
        ip.reset(new_session=False)
        _ahead.set_compile_ahead(ahead)


def _cell(ip, code):
    with capture_output() as cap:
        ip.run_cell(code).raise_error()
    return cap


def test_in_a_notebook_with_the_panel_open_a_stale_handle_goes_at_del(notebook):
    ip = notebook
    with _no_gc():
        _cell(ip, EXPERIMENT + "n = Nitro(Tiny(), data=data, batch_size=16, max_epochs=2)\n")
        _cell(ip, "%nitro_panel")
        _cell(ip, "n.train(); n.validate(); None")
        _cell(ip, "def helper(r):\n    return abs(r)\n")  # an edit: n's programs are stale
        out = _cell(ip, "n.train(); None")  # the stale messages, with their Rebuild button
        sink = _extension.loaded_magics(ip).sink
        assert len(sink.buttons) == 1 and any("this handle" in str(o.data) for o in out.outputs)
        ahead_jobs = _ahead.status()  # compile ahead is working on n's replacements (or has)
        assert isinstance(ahead_jobs, str)
        ref, arrays = weakref.ref(ip.user_ns["n"]), _weak_arrays(ip.user_ns["n"])
        _cell(ip, "n2 = n.rebuild(); n2.train(); None")
        _cell(ip, "run = n.train(1, background=True); run.wait(); del run")  # the panel's Stop button
        _cell(ip, "del n")
        _dead(ref, arrays)
        panel = _extension.loaded_magics(ip).panel
        assert panel is not None and panel.outputs()[0].html  # the panel still draws its figures
        _cell(ip, "run = n2.train(1, background=True); run.wait(); del run")
        ref2 = weakref.ref(ip.user_ns["n2"])
        _cell(ip, "n2 = n2.rebuild()")
        _dead(ref2)
