"""Data as users have it: host splits in bounded memory, memory-mapped splits, loaders (re-iterables of
batch dicts) as splits, device-resident splits (`data_on_device=`), and the errors for what cannot work.

Memory is measured in subprocesses (`/proc/self/status`), so this process's heap does not blur it."""

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import threading

import jax
import numpy as np
import pytest

import nitro_ipy
from nitro_ipy import Nitro
from nitro_ipy._base._errors import NitroTypeError, NitroValueError
from nitro_ipy._experiment import _data
from nitro_ipy._training import _checkpoint, _pipeline, _progress

from _experiments import Reg, data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _misses_entries():
    s = nitro_ipy.cache_stats()
    return s.misses, s.entries


# ---------------------------------------------------------------- loaders
D = data(100)


def gen_batches():
    """A generator function: called again each epoch; 100 rows in batches of 16 (the last has 4)."""
    for i in range(0, 100, 16):
        yield {"x": D["x"][i : i + 16], "y": D["y"][i : i + 16]}


class Reiterable:
    """An object whose `__iter__` starts a new pass (no length)."""

    def __iter__(self):
        return gen_batches()


class TorchStyle:
    """What a PyTorch `DataLoader` looks like to us: `__len__` (batches a pass) and `__iter__`, yielding
    dicts (here of JAX arrays, as a `collate_fn` converting to JAX would)."""

    def __len__(self):
        return 7

    def __iter__(self):
        return ({k: jax.numpy.asarray(v) for k, v in b.items()} for b in gen_batches())


def _array_twin():
    """The loader's 96 full rows as an array split: with batch_size=16 and no shuffle difference
    mattering for counts, the same 6 steps an epoch."""
    return {"x": D["x"][:96], "y": D["y"][:96]}


@pytest.mark.parametrize("source", [gen_batches, Reiterable(), TorchStyle(), list(gen_batches())],
                         ids=["generator-function", "reiterable", "torch-style", "list"])
def test_a_loader_trains_an_epoch_a_pass_dropping_its_ragged_last_batch(source):
    n = Nitro(Reg(), data={"train": source, "valid": source}, batch_size=16, progress=False)
    rows = n.train(2)
    assert n.step == 12  # 6 full batches a pass; the 4-row last one is dropped
    assert [r["epoch"] for r in rows] == [1, 2]
    # grad + opt once; eval twice (the full width and the padded ragged last batch: one program each)
    assert _misses_entries() == (3, 3)
    # The batches are the loader's own, in its order: the same steps as those batches fed one by one.
    ref = Nitro(Reg(), data={"train": list(gen_batches())[:6]}, batch_size=16, progress=False)
    ref.train(2)
    assert _equal(n.params, ref.params)


def test_a_loaders_validation_is_exact_over_every_row_ragged_last_included():
    n = Nitro(Reg(), data={"train": gen_batches, "valid": gen_batches, "test": D}, batch_size=16, progress=False)
    got, want = n.validate(), n.evaluate("test")
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)


def test_progress_total_is_the_loaders_length_or_unknown_until_a_pass_counted_it():
    n = Nitro(Reg(), data={"train": TorchStyle()}, batch_size=16)
    n.train(1)
    assert _progress._latest.steps == 7  # len(loader): the progress total before any pass
    n = Nitro(Reg(), data={"train": gen_batches}, batch_size=16)
    n.train(1)
    p = _progress._latest
    assert p.steps is None and "step 6/?" in p.line()
    n.train(1)  # a pass has counted the steps
    assert _progress._latest.steps == 6 and "step 6/6" in _progress._latest.line()


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


# Ctrl-C mid-epoch 2 (global step 8, 6 steps an epoch), and at epoch 1's last step (all its steps taken,
# the epoch not counted): the torch-style loader's length (7) counts its ragged batch, so the next call
# finds the pass ended before the progress total.
@pytest.mark.parametrize("at, where", [(8, (9, 1, 3)), (5, (6, 0, 6))], ids=["mid-epoch", "after-last-step"])
@pytest.mark.parametrize("source", [gen_batches, TorchStyle()], ids=["generator-function", "torch-style"])
def test_a_loader_interrupted_and_resumed_from_a_checkpoint_equals_an_uninterrupted_run(tmp_path, source, at, where):
    straight = Nitro(Reg(), data={"train": source}, batch_size=16, progress=False, schedules={"lr": lambda s: 1e-2})
    straight.train(3)
    cut = Nitro(Reg(), data={"train": source}, batch_size=16, progress=False, schedules={"lr": _ctrl_c_at(at)})
    with pytest.raises(nitro_ipy.TrainingInterrupted):
        cut.train(3)
    assert (cut.step, cut.epoch, cut._cursor[0]) == where
    path = cut.save(tmp_path / "mid", wait=True)
    info, _ = _checkpoint.read(path)
    assert info["data"]["kind"] == "loader" and info["data"]["batches_taken"] == where[2]
    assert info["data"]["exact"] is False  # said: a loader is replayed, not restored
    resumed = Nitro(Reg(), data={"train": source}, batch_size=16, progress=False,
                    schedules={"lr": lambda s: 1e-2}, resume=path)
    notes = _checkpoint.resume_data_notes(info, resumed)
    assert notes and "loader" in notes[0] and f"first {where[2]} batches" in notes[0]
    resumed.train(3 - resumed.epoch)
    cut.train(3 - cut.epoch)  # and in this process: the next train() goes on at batch 3
    for n in (resumed, cut):
        assert (n.step, n.epoch) == (18, 3)
        assert _equal(n.params, straight.params)


def test_an_array_splits_checkpoint_records_an_exact_position(tmp_path):
    n = Nitro(Reg(), data={"train": data(64)}, batch_size=16, progress=False)
    n.train(1)
    info, _ = _checkpoint.read(n.save(tmp_path / "c", wait=True))
    assert info["data"] == {"split": "train", "kind": "arrays", "examples": 64, "steps_into_epoch": 0, "exact": True,
                            "resume": "the epoch's seeded shuffle, from the step after the last taken"}


def test_a_loader_with_accum_stacks_consecutive_batches_per_step():
    n = Nitro(Reg(), data={"train": gen_batches}, batch_size=16, accum=2, progress=False)
    n.train(1)
    assert n.step == 3
    ref = Nitro(Reg(), data={"train": data(96)}, batch_size=16, accum=2, progress=False)
    assert _misses_entries()[0] == 2  # grad (accum 2) and opt


def test_predict_and_evaluate_take_a_loader_too():
    n = Nitro(Reg(), data={"train": D}, batch_size=16, progress=False)
    n.train(1)
    got = n.predict(gen_batches)
    assert got.shape == (100,) and np.allclose(got, n.predict({"x": D["x"]}), atol=1e-6)


# ---------------------------------------------------------------- errors
def test_a_one_shot_iterator_is_refused_at_setup():
    with pytest.raises(NitroTypeError, match=r"split `train` is a one-shot iterator \(a generator object\).*"
                                             r"the generator function itself"):
        Nitro(Reg(), data={"train": gen_batches()})
    with pytest.raises(NitroTypeError, match="one-shot iterator"):
        Nitro(Reg(), data={"train": D, "valid": iter(list(gen_batches()))})


def test_a_loader_of_tuples_is_refused_at_setup_with_how_to_name_the_fields():
    tuples = lambda: ((b["x"], b["y"]) for b in gen_batches())  # noqa: E731
    with pytest.raises(NitroTypeError, match=r"split `train` yields a tuple of 2 values \(batch 0\); a batch must "
                                             r"be a dict.*lambda: \(\{\"x\": x, \"y\": y\} for x, y in loader\)"):
        Nitro(Reg(), data={"train": tuples})


def test_a_batch_whose_shape_disagrees_with_the_first_names_field_batch_and_both_shapes():
    def bad():
        yield from list(gen_batches())[:3]
        yield {"x": np.zeros((16, 5), np.float32), "y": np.zeros(16, np.float32)}

    n = Nitro(Reg(), data={"train": bad}, batch_size=16, progress=False)
    with pytest.raises(NitroValueError, match=r"^field `x` of split `train`: batch 3 is float32\[16, 5\], the first "
                                             r"batch was float32\[16, 4\]"):
        n.train(1)


def test_a_batch_with_other_fields_and_a_short_batch_before_the_last_are_refused():
    def other():
        yield {"x": D["x"][:16], "y": D["y"][:16]}
        yield {"x": D["x"][:16]}

    def short_early():
        yield {"x": D["x"][:16], "y": D["y"][:16]}
        yield {"x": D["x"][:8], "y": D["y"][:8]}
        yield {"x": D["x"][:16], "y": D["y"][:16]}

    with pytest.raises(NitroValueError, match=r"batch 1 of split `train` has fields `x`; the first batch had `x`, `y`"):
        Nitro(Reg(), data={"train": other}, batch_size=16, progress=False).train(1)
    with pytest.raises(NitroValueError, match=r"batch 1 of split `train` has 8 rows and is not the last"):
        Nitro(Reg(), data={"train": short_early}, batch_size=16, progress=False).train(1)


def test_loader_setup_errors():
    with pytest.raises(NitroValueError, match="split `train` yielded no batch"):
        Nitro(Reg(), data={"train": lambda: iter(())})
    with pytest.raises(NitroTypeError, match=r"returned dict; a function given as a split must return an iterable"):
        Nitro(Reg(), data={"train": lambda: D})
    with pytest.raises(NitroValueError, match="`data_on_device` must be"):
        Nitro(Reg(), data={"train": D}, data_on_device="yes")
    with pytest.raises(NitroTypeError, match="`data_on_device=True` needs the train split as arrays"):
        Nitro(Reg(), data={"train": gen_batches}, data_on_device=True, progress=False).train(1)


def test_a_loader_empty_on_a_later_pass_says_so():
    calls = []

    def once():
        calls.append(1)
        if len(calls) <= 2:  # setup's peek and the first epoch
            yield from gen_batches()

    n = Nitro(Reg(), data={"train": once}, batch_size=16, progress=False)
    n.train(1)
    with pytest.raises(NitroValueError, match="split `train` yielded no full batch this epoch"):
        n.train(1)


# ---------------------------------------------------------------- host and device pipelines
@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("start", [0, 3])
def test_host_chunks_and_device_gathers_give_the_reference_batches(monkeypatch, accum, start):
    split = {"x": np.arange(230 * 3, dtype=np.float32).reshape(230, 3), "y": np.arange(230, dtype=np.int32)}
    want = list(_data.train_batches(split, ["x", "y"], 8, accum, (0, 1)))[start:]
    monkeypatch.setattr(_pipeline, "CHUNK_BYTES", 3 * 8 * accum * 16)  # three steps a chunk: many chunks
    monkeypatch.setattr(_pipeline, "DEVICE_CHUNK_STEPS", 4)  # and the last device chunk clamped back
    host = list(_pipeline.train_batches(split, ["x", "y"], 8, accum, (0, 1), start))
    dev = list(_pipeline.train_batches(_pipeline.Resident(split), ["x", "y"], 8, accum, (0, 1), start))
    assert len(host) == len(dev) == len(want) == 230 // (8 * accum) - start
    for h, d, w in zip(host, dev, want):
        for f in ("x", "y"):
            assert np.array_equal(h[f], w[f]) and np.array_equal(np.asarray(d[f]), w[f])
            assert isinstance(d[f], jax.Array)


def test_on_an_accelerator_host_and_loader_batches_go_to_the_device_one_step_ahead(monkeypatch):
    split = data(64)
    want = list(_data.train_batches(split, ["x", "y"], 16, 1, (0, 0)))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the branch an accelerator takes
    host = list(_pipeline.train_batches(split, ["x", "y"], 16, 1, (0, 0)))
    loader = _data.Loader("train", lambda: iter(want))
    loaded = list(_pipeline.train_batches(loader, ["x", "y"], 16, 1, (0, 0)))
    for got in (host, loaded):
        assert len(got) == 4 and all(isinstance(b[f], jax.Array) for b in got for f in b)
        assert all(np.array_equal(np.asarray(g["x"]), w["x"]) for g, w in zip(got, want))


@pytest.mark.parametrize("accum", [1, 2])
def test_data_on_device_places_per_the_rule_and_trains_the_same_params(accum):
    split = data(200)
    runs = {}
    for option in (False, True, "auto"):
        n = Nitro(Reg(), data={"train": split, "valid": data(40, 1)}, batch_size=16, accum=accum,
                  progress=False, data_on_device=option)
        n.train(2)
        runs[option] = n
    # On the CPU "auto" keeps the split on the host (placing it would copy it); True places it once.
    assert runs["auto"]._resident == {} and runs[False]._resident == {}
    placed = runs[True]._resident["train"]
    assert isinstance(placed, _pipeline.Resident) and all(isinstance(a, jax.Array) for a in placed.arrays.values())
    for option in (True, "auto"):
        assert _equal(runs[option].params, runs[False].params)
        assert runs[option].history == runs[False].history
    # Once per handle: a second train() and a rebuild keep the same device arrays.
    runs[True].train(1)
    assert runs[True]._resident["train"] is placed
    assert runs[True].rebuild()._resident["train"] is placed


def test_auto_places_a_split_that_fits_in_a_quarter_of_free_memory():
    class Device:
        platform = "gpu"

        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats

    gib = 1 << 30
    assert _pipeline.fits_on_device(gib, Device({"bytes_limit": 8 * gib, "bytes_in_use": 4 * gib}))
    assert not _pipeline.fits_on_device(gib + 1, Device({"bytes_limit": 8 * gib, "bytes_in_use": 4 * gib}))
    assert not _pipeline.fits_on_device(1, Device(None))  # no figures: stays on the host
    assert not _pipeline.fits_on_device(1, jax.devices("cpu")[0])


def test_a_float64_memory_mapped_column_is_converted_batch_by_batch(tmp_path):
    d = data(64)
    mm = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.float64, shape=(64, 4))
    mm[:] = d["x"]
    mm.flush()
    x = np.load(tmp_path / "x.npy", mmap_mode="r")
    n = Nitro(Reg(), data={"train": {"x": x, "y": d["y"]}}, batch_size=16, progress=False)
    col = n._binding.splits["train"]["x"]
    assert isinstance(col, _data.LazyCast) and col.dtype == np.float32 and col[:2].dtype == np.float32
    n.train(1)
    ref = Nitro(Reg(), data={"train": d}, batch_size=16, progress=False)
    ref.train(1)
    assert _equal(n.params, ref.params)


# ---------------------------------------------------------------- memory, in subprocesses
_MEMORY = textwrap.dedent("""
    import dataclasses, json, sys
    import jax.numpy as jnp, numpy as np
    from nitro_ipy import Nitro

    def status():
        out = {}
        for line in open("/proc/self/status"):
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
        return out

    @dataclasses.dataclass
    class Lin:
        def init(self, rng):
            return {"w": jnp.zeros((WIDTH,))}
        def forward(self, params, *, x):
            return x @ params["w"]
        def loss(self, outputs, *, y):
            return jnp.mean((outputs - y) ** 2)

    WIDTH, ROWS, BATCH, EPOCHS, PATH = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    if PATH == "-":
        x = np.ones((ROWS, WIDTH), np.float32)
    else:
        np.lib.format.open_memmap(PATH, mode="w+", dtype=np.float32, shape=(ROWS, WIDTH)).flush()  # sparse
        x = np.load(PATH, mmap_mode="r")
    y = np.zeros(ROWS, np.float32)
    warm = Nitro(Lin(), data={"train": {"x": np.ones((BATCH, WIDTH), np.float32), "y": y[:BATCH]}},
                 batch_size=BATCH, progress=False)
    warm.train(1)  # the programs compiled, so what follows measures data only
    n = Nitro(Lin(), data={"train": {"x": x, "y": y}}, batch_size=BATCH, progress=False)
    before = status()
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM back to the current RSS
    n.train(EPOCHS)
    after = status()
    print(json.dumps({"before": before, "after": after, "steps": n.step}))
""")


def _measure(width, rows, batch, epochs, path="-"):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), NITRO_IPY_AHEAD="0",
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _MEMORY, str(width), str(rows), str(batch), str(epochs), str(path)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    import json
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_training_a_1gib_host_split_grows_host_memory_by_a_few_batches():
    got = _measure(width=256, rows=1 << 20, batch=4096, epochs=2)  # 1 GiB of x
    assert got["steps"] == 512
    growth = got["after"]["VmHWM"] - got["before"]["VmRSS"]
    assert growth < (1 << 30) // 4, f"peak RSS grew by {growth / 2**20:.0f} MiB training a 1 GiB split"


def test_a_4gib_memory_mapped_npy_trains_without_reading_it_into_memory(tmp_path):
    got = _measure(width=1024, rows=1 << 20, batch=16384, epochs=1, path=tmp_path / "x.npy")  # 4 GiB of x
    assert got["steps"] == 64
    assert got["before"]["RssFile"] < (256 << 20)  # setup read nothing of the file
    anon = got["after"]["RssAnon"] - got["before"]["RssAnon"]  # the file's pages are the page cache's, reclaimable
    assert anon < (1 << 30) // 4, f"anonymous memory grew by {anon / 2**20:.0f} MiB training a 4 GiB memmap"


_RUN_AHEAD = textwrap.dedent("""
    import dataclasses, json
    import jax.numpy as jnp, numpy as np
    from nitro_ipy import Nitro

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    @dataclasses.dataclass
    class Heavy:  # device-bound: a host making batches outruns it
        def init(self, rng):
            return {"w": jnp.zeros((1024, 256)), "v": jnp.zeros((256,))}
        def forward(self, params, *, x):
            return jnp.tanh(x @ params["w"]) @ params["v"]
        def loss(self, outputs, *, y):
            return jnp.mean((outputs - y) ** 2)

    y = np.zeros(4096, np.float32)
    def batches():  # 16 MiB batches, made fast
        for i in range(48):
            yield {"x": np.full((4096, 1024), i % 7, np.float32), "y": y}
    n = Nitro(Heavy(), data={"train": batches}, batch_size=4096, progress=False)
    n.train(1)  # compiles
    before = status("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")
    n.train(1)
    print(json.dumps({"growth": status("VmHWM") - before, "steps": n.step}))
""")


def test_a_host_outrunning_the_device_queues_a_few_batches_not_the_epoch():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), NITRO_IPY_AHEAD="0",
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _RUN_AHEAD], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    import json
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["steps"] == 96
    # 48 batches of 16 MiB an epoch: unbounded, the queue held most of them (+275 MiB measured; paced: +16 MiB)
    assert got["growth"] < (128 << 20), f"peak RSS grew by {got['growth'] / 2**20:.0f} MiB"
