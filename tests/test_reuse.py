"""Trace reuse (`_reuse`), through a real `InteractiveShell`: after a loss edit the new gradient program
traces through the forward's cached trace, computes exactly what a plain trace computes, and still
depends on the forward's code; an edit anywhere below the forward (a helper, a GraphConst, a class
attribute, the forward itself) is never served the old trace.

Every test runs under both ways of recording this Python offers (as test_closure does): the replay of
what the forward's first trace recorded is what keeps the probe modes honest."""

import sys

import jax
import numpy as np
import pytest
from IPython.core.interactiveshell import InteractiveShell

import nitro_ipy
from nitro_ipy._training import _ahead
from nitro_ipy._notebook import _extension
from nitro_ipy._compiler import _reuse

MODES = ["monitoring", "traceback"] if sys.version_info >= (3, 12) else ["traceback", "profile"]

HELPERS = '''
import dataclasses
import jax, jax.numpy as jnp, numpy as np, optax
from nitro_ipy import Device, GraphConst, Nitro

SCALE = 1.0

def layer(h, w):
    return jnp.tanh(h @ w) * SCALE

def block(params, x):
    h = x
    for w in params["ws"]:
        h = layer(h, w)
    return h @ params["v"]
'''
CLASS = '''
@dataclasses.dataclass
class Reuse:
    hidden: GraphConst[int] = 4
    lr: Device[float] = 1e-2

    def init(self, rng):
        k1, k2, k3 = jax.random.split(rng, 3)
        return {"ws": [jax.random.normal(k1, (3, self.hidden)) * 0.5,
                       jax.random.normal(k2, (self.hidden, self.hidden)) * 0.5],
                "v": jax.random.normal(k3, (self.hidden,)) * 0.5}

    def forward(self, params, *, x):
        return block(params, x)

    def loss(self, outputs, *, y):
        return {loss}

    def optimizer(self):
        return optax.sgd(self.lr)
'''
BASE_LOSS = "jnp.mean((outputs - y) ** 2)"
EDITED_LOSS = "jnp.mean(jnp.abs(outputs - y)) + 0.1 * jnp.mean(outputs ** 2)"


def _cell(loss: str) -> str:
    """The cell defining the experiment class (only: the helpers are another cell's), with `loss`."""
    return CLASS.replace("{loss}", loss)


DATA = '''
rs = np.random.RandomState(0)
X = rs.normal(size=(64, 3)).astype(np.float32)
Y = X.sum(1).astype(np.float32)
data = {"train": {"x": X[:48], "y": Y[:48]}, "valid": {"x": X[48:], "y": Y[48:]}}
'''


@pytest.fixture(autouse=True, params=MODES)
def recorder_mode(request, monkeypatch):
    monkeypatch.setenv("NITRO_IPY_RECORDER", request.param)
    return request.param


def _run(ip, code):
    result = ip.run_cell(code)
    result.raise_error()
    return result


@pytest.fixture
def ip(capsys):
    shell = InteractiveShell.instance()
    shell.reset(new_session=False)
    shell.run_line_magic("load_ext", "nitro_ipy")
    _run(shell, HELPERS)
    _run(shell, _cell(BASE_LOSS))
    _run(shell, DATA)
    _run(shell, "n = Nitro(Reuse(), data=data, batch_size=16, progress=False)\nn.train()")
    assert _reuse.wait(60)
    capsys.readouterr()
    assert _reuse.stats["warmed"] >= 1  # the first gradient compile warmed a forward, once idle
    _before.clear()
    _before.update(_reuse.stats)  # `_stats()` counts from here
    yield shell
    shell.run_line_magic("unload_ext", "nitro_ipy")
    _extension.unload(shell)
    shell.reset(new_session=False)


def _stats():
    return {k: v - _before.get(k, 0) for k, v in _reuse.stats.items()}


_before: dict = {}


def _stale(n) -> bool:
    """Whether a program the handle runs was poisoned (what its runs warn about)."""
    return any(e.poisoned for e in n._programs.values())


def _leaves(params):
    return [np.asarray(a) for a in jax.tree.leaves(params)]


def _scenario(ip, *edits):
    """Train, make each edit (a cell), rebuild and train after each: the handle at the end."""
    for edit in edits:
        _run(ip, edit)
        # The edit's replacements compile ahead, and their forward warms; the next cell comes once they
        # did, as after a reading pause (a cell started beside a background trace has it traced again, or
        # the warming dropped: `tests/test_ahead.py`, "a cell beside a background trace").
        assert _ahead.wait(60) and _reuse.wait(60)
        _run(ip, "n = n.rebuild()\nn.train()")
        assert _reuse.wait(60)  # the warming is idle work: it runs once training stopped
        assert not _stale(ip.user_ns["n"])
    return ip.user_ns["n"]


def _plainly(ip, *edits):
    """The same scenario from scratch with trace reuse off: every gradient program traced plainly."""
    nitro_ipy.cache_reset()
    previous = nitro_ipy.set_trace_reuse(False)
    try:
        _run(ip, HELPERS)
        _run(ip, _cell(BASE_LOSS))
        _run(ip, "n = Nitro(Reuse(), data=data, batch_size=16, progress=False)\nn.train()")
        assert _reuse.wait(60)
        return _scenario(ip, *edits)
    finally:
        nitro_ipy.set_trace_reuse(previous)


def _same(a, b) -> None:
    assert [h["loss"] for h in a.history] == [h["loss"] for h in b.history]
    for x, y in zip(_leaves(a.params), _leaves(b.params), strict=True):
        assert np.array_equal(x, y)


def test_a_loss_edit_traces_through_the_forward_s_cached_trace_and_computes_the_same(ip):
    edits = (_cell(EDITED_LOSS), _cell("jnp.mean((outputs - y) ** 4)"))
    n = _scenario(ip, *edits)
    # both rebuilt gradient programs traced through the forward warmed by the first one
    assert _stats() == {"warmed": 0, "reused": 2, "discarded": 0, "retraced": 0, "redone": 0}
    _before.update(_reuse.stats)
    _same(n, _plainly(ip, *edits))
    assert _stats() == {"warmed": 0, "reused": 0, "discarded": 0, "retraced": 0, "redone": 0}  # off: nothing at all


def test_the_reused_program_still_depends_on_the_forward_s_helpers(ip, capsys):
    """The trace JAX served runs none of the forward's Python: the forward's recording is replayed into
    the new program's, so an edit two levels below the forward poisons the reused program."""
    _scenario(ip, _cell(EDITED_LOSS))
    assert _stats()["reused"] == 1
    capsys.readouterr()
    _run(ip, "def layer(h, w):\n    return jnp.sin(h @ w) * SCALE\n")
    _run(ip, "n.train()")
    out = capsys.readouterr().out
    assert "poisoned; redefined: __main__.layer." in out, out
    assert [e.kind for e in ip.user_ns["n"]._programs.values() if e.poisoned] == ["grad", "eval"]


@pytest.mark.parametrize("edit", [
    "def layer(h, w):\n    return jnp.sin(h @ w) * SCALE\n",  # a helper two levels below the forward
    "SCALE = 0.5\n",  # a global that helper reads
    "def block(params, x):\n    h = x\n    for w in params['ws']:\n        h = layer(h, w) + h.mean()\n"
    "    return h @ params['v']\n",  # the helper the forward calls
])
def test_an_edit_below_the_forward_is_never_served_the_old_trace(ip, edit):
    """The stale forward is discarded; the rebuilt handle, and the next loss edit's (which reuses the
    forward warmed on the new code), train exactly what plain traces of the same edits train."""
    edits = (_cell(EDITED_LOSS), edit, _cell("jnp.mean((outputs - y) ** 4)"))
    n = _scenario(ip, *edits)
    assert _stats() == {"warmed": 1, "reused": 2, "discarded": 1, "retraced": 0, "redone": 0}
    _same(n, _plainly(ip, *edits))


@pytest.fixture
def on_demand():
    """Compile ahead off: the test counts the warmings and traces of programs compiled on demand, in the
    main thread (compile ahead makes an edit's programs in its own threads, for the newest handle of a
    class, and its compiles warm too: tests/test_ahead.py)."""
    previous = _ahead.set_compile_ahead(False)
    yield
    _ahead.set_compile_ahead(previous)


def test_a_graphconst_change_or_a_forward_edit_traces_plainly(ip, on_demand):
    _run(ip, "n2 = Nitro(Reuse(hidden=5), data=data, batch_size=16, progress=False)\nn2.train()")
    assert _reuse.wait(60)
    assert _stats() == {"warmed": 1, "reused": 0, "discarded": 0, "retraced": 0, "redone": 0}  # another key: its own
    _run(ip, _cell(BASE_LOSS).replace("return block(params, x)", "return block(params, x) * 2.0"))
    _run(ip, "n = n.rebuild()\nn.train()")
    assert _reuse.wait(60)
    assert _stats() == {"warmed": 2, "reused": 0, "discarded": 0, "retraced": 0, "redone": 0}


def test_the_warming_runs_once_training_stopped_and_prints_nothing(ip, capsys, on_demand):
    """A print in the forward prints once per compile; the warming trace, in its own thread, runs only
    when no handle trained for `QUIET_S` (it takes the GIL and a core)."""
    _run(ip, "import threading, time\nTRACES = []")
    _run(ip, _cell(BASE_LOSS).replace(
        "return block(params, x)",
        "TRACES.append((threading.current_thread().name, time.monotonic()))\n"
        "        print('tracing forward')\n        return block(params, x)"))
    capsys.readouterr()
    _run(ip, "n = n.rebuild()\nn.train()")
    assert _reuse.wait(60)
    out = capsys.readouterr().out
    # the gradient program (traced plainly: the forward changed) and the evaluation program; the warming
    # trace of the gradient program prints nothing
    assert out.count("tracing forward") == 2, out
    assert _stats()["warmed"] == 1
    traces = ip.user_ns["TRACES"]
    assert [name for name, _ in traces] == ["MainThread", "MainThread", "nitro_ipy-warm"]
    assert traces[2][1] >= _reuse._trained[0] + _reuse.QUIET_S  # after train() returned, and quiet
