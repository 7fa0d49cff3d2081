"""Checkpoints: a resumed run equals an uninterrupted one (in this process and from a child process's
checkpoint), a GraphConst change is refused with the field diff, Device/Host changes and edited hooks
are listed, periodic saves keep what the retention policy says.

Cost: one child process (about 4 s), and three (4, 1, 4 devices: 30-60 s, mostly compiles) for the
checkpoints across device counts; the rest trains tiny models in this process."""

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import nitro_ipy
from nitro_ipy import Device, GraphConst, Nitro
from nitro_ipy._base import _report
from nitro_ipy._training._checkpoint import ResumeMismatchError


@pytest.fixture
def messages():
    got = []
    previous = _report.set_sink(got.append)
    yield got
    _report.set_sink(previous)


@dataclasses.dataclass
class Tiny:
    hidden: GraphConst[int] = 8
    table: GraphConst[tuple] = (1, 2, 3)
    lr: Device[float] = 1e-2
    notes: str = ""

    def init(self, rng):
        k1, k2 = jax.random.split(rng)
        return {"w1": jax.random.normal(k1, (3, self.hidden)) * 0.5, "w2": jax.random.normal(k2, (self.hidden,)) * 0.5}

    def forward(self, params, *, x):
        return jnp.tanh(x @ params["w1"]) @ params["w2"]

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)

    def optimizer(self):
        return optax.adam(self.lr)


X = np.random.default_rng(0).normal(size=(80, 3)).astype(np.float32)
DATA = {"train": {"x": X, "y": np.sin(X.sum(1))}, "valid": {"x": X[:16], "y": np.sin(X[:16].sum(1))}}


def _handle(e=None, **kw):
    return Nitro(e or Tiny(), data=DATA, batch_size=16, max_epochs=1, progress=False, seed=3, **kw)


def _equal(a, b):
    return all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), a, b)))


def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path, messages):
    straight = _handle()
    straight.train(3)
    first = _handle()
    first.train(1)
    path = first.save(tmp_path / "ckpt")
    assert path == str(tmp_path / "ckpt.nitro.npz")
    resumed = _handle(resume=path)
    assert (resumed.step, resumed.epoch) == (5, 1)
    assert _equal(resumed.params, first.params) and _equal(resumed.state, first.state)
    resumed.train(2)
    assert _equal(resumed.params, straight.params)
    assert _equal(resumed.state, straight.state)
    assert resumed.history == straight.history
    assert (resumed.step, resumed.epoch) == (straight.step, straight.epoch) == (15, 3)
    said = [m.text for m in messages if m.kind == _report.Kind.RESUMED]
    assert said == [f"nitro_ipy: resumed from {path} at step 5, epoch 1"]


def test_resume_refuses_a_graphconst_change_with_the_field_diff(tmp_path):
    n = _handle()
    n.train(1)
    path = n.save(tmp_path / "c.nitro.npz")
    with pytest.raises(ResumeMismatchError) as err:
        _handle(Tiny(hidden=16, table=(1, 2, 4)), resume=path)
    text = str(err.value)
    assert text.startswith(f"cannot resume from `{path}`: the experiment's GraphConst fields changed")
    assert "\n  GraphConst `hidden`: 8 -> 16\n  GraphConst `table`: (1, 2, 3) -> (1, 2, 4)\n" in text
    assert text.endswith("Fix: set those fields back to the saved values, or start a fresh run without `resume=`.")
    assert isinstance(err.value, nitro_ipy.NitroValueError)


@dataclasses.dataclass
class WithArray(Tiny):
    table: GraphConst[object] = dataclasses.field(default_factory=lambda: np.arange(200.0))


def test_same_repr_different_content_says_where(tmp_path):
    n = _handle(WithArray())
    path = n.save(tmp_path / "c")
    table = np.arange(200.0)
    table[150] = -1.0
    with pytest.raises(ResumeMismatchError) as err:
        _handle(WithArray(table=table), resume=path)
    line = next(l for l in str(err.value).splitlines() if "`table`" in l)
    assert "(same repr; the content differs" in line, line
    assert line.endswith("at `table[150]`)"), line  # narrowed down slice by slice


def test_resume_lists_device_host_and_hook_changes_without_refusing(tmp_path, messages, monkeypatch):
    n = _handle()
    n.train(1)
    path = n.save(tmp_path / "c")

    @dataclasses.dataclass
    class Edited(Tiny):
        def loss(self, outputs, *, y):
            return jnp.mean(jnp.abs(outputs - y))

    Edited.__qualname__ = Edited.__name__ = "Tiny"  # the class cell re-run with its loss edited
    monkeypatch.setitem(globals(), "Tiny", Edited)
    resumed = _handle(Edited(lr=1e-3, notes="run 2"), resume=path)
    assert resumed.step == 5
    said = [m for m in messages if m.kind == _report.Kind.RESUMED][0]
    assert said.data["notes"] == ("Device `lr`: 0.01 -> 0.001", "Host `notes`: '' -> 'run 2'",
                                  "hook `loss` edited since the checkpoint")
    assert said.text.endswith("changed since it was saved (not refused):\n  Device `lr`: 0.01 -> 0.001\n"
                              "  Host `notes`: '' -> 'run 2'\n  hook `loss` edited since the checkpoint")


def test_a_checkpoint_records_the_values_n_set_gave(tmp_path, messages):
    """`n.set` changes the handle's Device and Host values: the manifest holds those, so a resume with
    the experiment's own values says they differ."""
    n = _handle()
    n.train(1)
    n.set(lr=1e-3, notes="lower lr")
    path = n.save(tmp_path / "c")
    resumed = _handle(resume=path)
    said = [m for m in messages if m.kind == _report.Kind.RESUMED][0]
    assert said.data["notes"] == ("Device `lr`: 0.001 -> 0.01", "Host `notes`: 'lower lr' -> ''")
    assert float(resumed._dev["lr"]) == np.float32(1e-2)  # the experiment given wins; the note says so


def test_periodic_checkpoints_keep_the_newest_and_the_best(tmp_path):
    d = tmp_path / "run"
    n = _handle(checkpoint_dir=d, checkpoint_every=1, keep=2, keep_best=("valid_loss", "min"))
    n.train(4)
    losses = [r["valid_loss"] for r in n.history]
    best_epoch = int(np.argmin(losses)) + 1
    kept = sorted(p.name for p in d.glob("*.nitro.npz"))
    expected = {f"step-{5 * e:08d}.nitro.npz" for e in (3, 4, best_epoch)}
    assert kept == sorted(expected)
    auto = _handle(checkpoint_dir=d, resume="auto")
    assert (auto.step, auto.epoch) == (20, 4) and _equal(auto.params, n.params)
    assert _handle(checkpoint_dir=tmp_path / "empty", resume="auto").step == 0  # nothing yet: a fresh start


@dataclasses.dataclass
class Noisy(Tiny):
    """Tiny with a draw from the step's rng in every step: a resume must continue the rng stream too."""

    def forward(self, params, *, x, rng):
        return jnp.tanh((x + 0.3 * jax.random.normal(rng, x.shape)) @ params["w1"]) @ params["w2"]


def _ctrl_c_at(step):
    """A schedule of `lr` that presses Ctrl-C (a real SIGINT), once, while global step `step` is dispatched."""
    pressed = []

    def lr(s):
        if s == step and not pressed:
            pressed.append(s)
            t = threading.Timer(0, os.kill, (os.getpid(), signal.SIGINT))
            t.start()
            t.join()
        return 1e-2
    return lr


# Global steps (5 a epoch): the first step of all, mid-epoch 2, the last step of epoch 1 (all its steps
# taken, the epoch not counted: Ctrl-C cuts it before validation), the first step of epoch 3.
@pytest.mark.parametrize("at", [0, 7, 4, 10])
def test_a_run_cut_mid_epoch_and_resumed_equals_an_uninterrupted_one(tmp_path, at):
    straight = _handle(Noisy(), schedules={"lr": lambda s: 1e-2})
    straight.train(3)
    cut = _handle(Noisy(), schedules={"lr": _ctrl_c_at(at)})
    with pytest.raises(nitro_ipy.TrainingInterrupted):
        cut.train(3)
    taken = at + 1 if at % 5 else at  # Ctrl-C in an epoch's first step lands before it (its schedule runs first)
    assert (cut.step, cut.epoch) == (taken, at // 5)
    path = cut.save(tmp_path / "mid")  # a checkpoint in the middle of an epoch
    resumed = _handle(Noisy(), schedules={"lr": lambda s: 1e-2}, resume=path)
    assert (resumed.step, resumed.epoch) == (cut.step, cut.epoch)
    resumed.train(3 - resumed.epoch)
    cut.train(3 - cut.epoch)  # and in this process: the next train() goes on where Ctrl-C stopped it
    for n in (resumed, cut):
        assert (n.step, n.epoch) == (15, 3)
        assert _equal(n.params, straight.params) and _equal(n.state, straight.state)
        assert [r["epoch"] for r in n.history] == [1, 2, 3]
        for got, want in zip(n.history, straight.history):  # a cut epoch's mean loss spans both parts
            assert got.keys() == want.keys()
            assert all(got[k] == pytest.approx(want[k], rel=1e-12) for k in got)


def test_an_epoch_whose_steps_all_ran_but_was_not_counted_is_counted_next_not_replayed():
    """What a Ctrl-C leaves when it lands after an epoch's last step but before the epoch is counted
    (between the step loop's return and `n.epoch += 1`): the next `train()` counts that epoch without
    running its steps again. The window is a few bytecodes wide, so it is entered here by running the
    step loop the way `train()` does and not counting the epoch."""
    from nitro_ipy._training import _loop, _runs

    straight = _handle(Noisy())
    straight.train(2)
    cut = _handle(Noisy())
    cut.train(1)
    b = cut._binding
    split = b.split("train")
    fields = sorted(set(b.routes["forward"].pick(split)) | set(b.routes["loss"].pick(split)))  # as train() picks
    control = _runs.RunControl(cut, 5)
    control.begin_epoch()
    _loop.train_epoch(cut._state, cut._resolve, split, fields, 5, control)  # epoch 2's steps; not counted
    assert (cut.step, cut.epoch, cut._cursor[0]) == (10, 1, 5)
    assert control.where() == "epoch 2, step 5/5"
    cut.train(1)
    assert (cut.step, cut.epoch, cut._cursor) == (10, 2, (0, 0.0, 0))  # counted, not replayed
    assert _equal(cut.params, straight.params)
    assert [r["loss"] for r in cut.history] == pytest.approx([r["loss"] for r in straight.history], rel=1e-12)


def test_a_failed_background_write_is_raised_by_the_next_save_and_leaves_nothing_behind(tmp_path):
    n = _handle()
    n.train(1)
    (tmp_path / "c.nitro.npz" / "in-the-way").mkdir(parents=True)  # a directory where the file goes
    assert n.save(tmp_path / "c") == str(tmp_path / "c.nitro.npz")  # returns; the rename fails behind it
    with pytest.raises(nitro_ipy.NitroValueError) as err:
        n.save(tmp_path / "d")
    assert str(err.value).startswith(f"the checkpoint `{tmp_path / 'c.nitro.npz'}` could not be written: ")
    assert str(err.value).endswith(". Nothing of it is on disk; the checkpoints written before it are whole.")
    assert not (tmp_path / "d.nitro.npz").exists()  # refused before it was taken
    assert not list(tmp_path.glob(".tmp-*"))  # the failed write's temp file, and the one reserved for `d`, are gone
    path = n.save(tmp_path / "e", wait=True)  # and saving works again, on disk when it returns
    assert os.path.isfile(path) and _handle(resume=path).step == 5


@pytest.mark.parametrize("kw, match", [
    (dict(checkpoint_every=1), r"`checkpoint_every=` needs `checkpoint_dir=`"),
    (dict(checkpoint_dir="x", checkpoint_every=0), r"`checkpoint_every` must be a positive number of epochs; got 0"),
    (dict(checkpoint_dir="x", checkpoint_every=1, keep=0), r"`keep` must be a positive integer"),
    (dict(checkpoint_dir="x", checkpoint_every=1, keep_best="valid_loss"), r'`keep_best` must be `\(metric, "min" \| "max"\)`'),
    (dict(resume="auto"), r'`resume="auto"` resumes from the newest checkpoint of `checkpoint_dir=`'),
    (dict(resume="/nonexistent/c.nitro.npz"), r"no checkpoint at `/nonexistent/c.nitro.npz`"),
])
def test_bad_checkpoint_settings_are_refused_at_setup(kw, match):
    with pytest.raises(nitro_ipy.NitroValueError, match=match):
        _handle(**kw)


CHILD = textwrap.dedent('''
    import sys
    sys.path.insert(0, {tests!r})
    import test_checkpoint as t
    n = t._handle()
    n.train(1)
    print(n.save({path!r}))
''')


def test_a_checkpoint_from_another_process_resumes_here(tmp_path):
    path = str(tmp_path / "child.nitro.npz")
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(tests=os.path.dirname(__file__), path=path))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    straight = _handle()
    straight.train(2)
    resumed = _handle(resume=path)
    resumed.train(1)
    assert _equal(resumed.params, straight.params) and _equal(resumed.state, straight.state)
    assert resumed.history == straight.history


# ---------------------------------------------------------------- across device counts (issue 16)
DEVICES_CHILD = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", {devices})
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from nitro_ipy import Nitro
import exp

mesh = Mesh(np.array(jax.devices()), ("data",)) if {devices} > 1 else None
# Two layouts: the flat parameter buffers (replicated on the mesh), and per-array parameters with `w1`
# sharded along the data axis (FSDP-style) on the mesh.
LAYOUTS = {{"flat": {{}}, "sharded": {{"flat_params": False}}}}
rule = lambda path, shape: P(None, "data") if path == "w1" else None

def handle(layout, **kw):
    kw.update(LAYOUTS[layout])
    if mesh is not None:
        kw["mesh"] = mesh
        if layout == "sharded":
            kw["param_sharding"] = rule
    return Nitro(exp.Regression(), data=exp.data(), batch_size=32, max_epochs=2, progress=False, **kw)

out = {{"devices": len(jax.devices())}}
for layout in LAYOUTS:
    out[layout] = {{}}
    if sys.argv[2] != "-":  # the uninterrupted run the resumed one must equal
        straight = handle(layout)
        out[layout]["straight"] = exp.summary(straight, straight.train())
    half = handle(layout)
    half.train(1)
    half.save(sys.argv[1] + f"/{{layout}}-{devices}.nitro.npz")
    other = sys.argv[1] + f"/{{layout}}-{{sys.argv[2]}}.nitro.npz"
    if sys.argv[2] != "-":  # resume the checkpoint the other device count wrote
        n = handle(layout, resume=other)
        at = [n.step, n.epoch]
        n.train(1)
        out[layout]["resumed"] = exp.summary(n, list(n.history))
        out[layout]["at"] = at
        out[layout]["w1"] = str(n.params["w1"].sharding.spec) if layout == "sharded" and mesh is not None else None
print(json.dumps(out))
"""


def _devices_child(tmp_path, devices: int, other: str):
    from _modules import json_in_child
    from test_sharding import EXPERIMENT

    (tmp_path / "exp.py").write_text(EXPERIMENT)
    code = DEVICES_CHILD.format(devices=devices)
    script = tmp_path / f"child{devices}.py"
    script.write_text(code)
    wrapper = f"import sys; sys.argv = ['x', {str(tmp_path)!r}, {other!r}]; exec(open({str(script)!r}).read())"
    return json_in_child(wrapper, tmp_path, "0", timeout=240)


def _close(a: dict, b: dict):
    assert [r["epoch"] for r in a["rows"]] == [r["epoch"] for r in b["rows"]]
    for ra, rb in zip(a["rows"], b["rows"]):
        assert ra.keys() == rb.keys()
        np.testing.assert_allclose([ra[k] for k in ra], [rb[k] for k in ra], rtol=1e-5)
    for k in a["params"]:
        np.testing.assert_allclose(a["params"][k], b["params"][k], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a["predict"], b["predict"], rtol=1e-5, atol=1e-6)


def test_a_checkpoint_written_on_4_devices_resumes_on_1_and_back(tmp_path):
    # 4 devices write; 1 device writes its own and resumes theirs; 4 devices resume the 1-device one.
    four = _devices_child(tmp_path, 4, "-")
    one = _devices_child(tmp_path, 1, "4")
    four_again = _devices_child(tmp_path, 4, "1")
    assert (four["devices"], one["devices"], four_again["devices"]) == (4, 1, 4)
    for layout in ("flat", "sharded"):
        assert one[layout]["at"] == four_again[layout]["at"] == [8, 1]  # 256 examples, batches of 32
        # Resumed where the other device count left off, each equals its own uninterrupted run (to float
        # tolerance: the two device counts reduce in a different order).
        _close(one[layout]["resumed"], one[layout]["straight"])
        _close(four_again[layout]["resumed"], four_again[layout]["straight"])
        _close(one[layout]["straight"], four_again[layout]["straight"])
    assert four_again["sharded"]["w1"] == "P(None, 'data')"  # placed as the live handle's rule says

