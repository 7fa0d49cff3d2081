"""Real faults of the disk under the program store and checkpoints: writers killed with SIGKILL between
their temp file and its rename (stopped there deterministically: the `temp_written` event), JAX cache
files truncated as a killed JAX leaves them, a full tmpfs, a file size limit (RLIMIT_FSIZE, in a child),
a read-only remount. Each leaves no litter past the next start, says one line, and trains on.

Cost: four child processes (~4 s each unloaded, 6-16 s at load 15 on 2 cores: three kills, one file
size limit); the rest (~10 s) runs in this process on the tiny model. The tmpfs tests need `mount` (root): they
skip, saying so, where it is not permitted.
"""

import dataclasses
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import nitro_ipy
from nitro_ipy import Device, GraphConst, Nitro
from nitro_ipy._base import _report, _writes
from nitro_ipy._compiler import _stats, _store, _xla
from nitro_ipy._training import _checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL = """
import dataclasses
import jax, jax.numpy as jnp, numpy as np, optax
from nitro_ipy import Device, GraphConst, Nitro

@dataclasses.dataclass
class Tiny:
    hidden: GraphConst[int] = 8
    lr: Device[float] = 1e-2

    def init(self, rng):
        k1, k2 = jax.random.split(rng)
        return {"w1": jax.random.normal(k1, (3, self.hidden)), "w2": jax.random.normal(k2, (self.hidden,))}

    def forward(self, params, *, x):
        return jnp.tanh(x @ params["w1"]) @ params["w2"]

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)

    def optimizer(self):
        return optax.adam(self.lr)

X = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
DATA = {"train": {"x": X, "y": np.sin(X.sum(1))}}
"""
exec(MODEL)  # the same model here and in the children
Tiny, DATA = globals()["Tiny"], globals()["DATA"]


@pytest.fixture
def messages():
    got = []
    previous = _report.set_sink(got.append)
    yield got
    _report.set_sink(previous)


@pytest.fixture(autouse=True)
def _fresh_store():
    """Each test starts with nothing swept and the store as the environment sets it (off), and leaves it so."""
    _writes.swept.clear()
    yield
    _writes.swept.clear()
    _store._override = _store._UNSET
    _store._refused_dirs.clear()
    _store._swept.clear()
    from jax._src import compilation_cache

    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()


def _mount(path, *options):
    """A real tmpfs at `path` (`options`: `size=2m`, ...); skips where mounting is not permitted."""
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no `mount` here: the full-disk tests need a real tmpfs")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(("mode=700", *options)), "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}): needs root")
    return path


@pytest.fixture
def tmpfs(tmp_path):
    mounted = []

    def make(name="disk", size="2m"):
        mounted.append(_mount(tmp_path / name, f"size={size}"))
        return mounted[-1]

    yield make
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _fill(disk, leave: int):
    """Fill the file system of `disk` until `leave` bytes are free."""
    free = _writes.free_bytes(str(disk))
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * max(free - leave, 0))


def _said(messages, kind):
    return [m.text for m in messages if m.kind == kind]


def _litter(root):
    """Temp files anywhere under `root`, and empty or truncated JAX cache files."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and (p.name.endswith(".part") or (p.name.endswith("-cache") and not _xla.whole(p.read_bytes()))))


def _train(epochs=1, **kw):
    n = Nitro(Tiny(), data=DATA, batch_size=16, max_epochs=epochs, progress=False, **kw)
    n.train()
    return n


def _same(a, b):
    return jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), a, b))


# ---------------------------------------------------------------- kill -9 at the temp file stage
KILLED = MODEL + """
import os, signal, sys
import nitro_ipy
from nitro_ipy._base import _events

where, target = sys.argv[1], sys.argv[2]

def stop(path):  # the temp file is written and synced, not renamed yet: the writer dies here
    if os.path.basename(os.path.dirname(path)) == target:
        os.kill(os.getpid(), signal.SIGKILL)

_events.subscribe("temp_written", stop)
nitro_ipy.set_cache_dir(None if target == "checkpoints" else os.path.join(where, "store"))
n = Nitro(Tiny(), data=DATA, batch_size=16, max_epochs=1, progress=False)
n.train()
n.save(os.path.join(where, "checkpoints") + "/", wait=True)
print("not killed")
"""


def _child(script, *args, env=None):
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})


@pytest.mark.parametrize("target", ["programs", "xla", "checkpoints"])
def test_a_writer_killed_at_its_temp_file_leaves_nothing_past_the_next_start(tmp_path, target):
    done = _child(KILLED, tmp_path, target)
    assert done.returncode == -9, done.stdout + done.stderr
    directory = tmp_path / ("checkpoints" if target == "checkpoints" else f"store/{target}")
    left = sorted(p.name for p in directory.glob(".tmp-*.part"))
    assert len(left) == 1 and re.match(r"\.tmp-\d+@[A-Za-z0-9_.]+-\w+\.part$", left[0]), left
    nbytes = (directory / left[0]).stat().st_size
    live = directory / f"{_writes.temp_prefix()}alive.part"  # this process writes it: never swept
    live.write_bytes(b"being written")

    if target == "checkpoints":  # the next start: a handle resuming from the directory
        assert _checkpoint.newest(directory) is None
    else:
        nitro_ipy.set_cache_dir(tmp_path / "store")
        assert _store.activate()

    assert sorted(p.name for p in directory.glob(".tmp-*.part")) == [live.name]
    assert [(d, name, size) for d, name, size, _ in _writes.swept] == [(str(directory), left[0], nbytes)]
    assert _stats.stats_table().swept == (
        f"nitro_ipy swept: 1 temp file ({_report.size_text(nbytes)}) left by killed writers")
    assert repr(_stats.stats_table()).splitlines()[-1] == _stats.stats_table().swept


def test_an_old_temp_file_of_a_live_pid_or_another_host_goes_only_when_stale(tmp_path):
    fresh_other = tmp_path / ".tmp-1@otherhost-abc.part"
    old_other = tmp_path / ".tmp-1@otherhost-def.part"
    old_legacy = tmp_path / ".tmp-k3j4h5.part"  # a name of an older nitro_ipy: no owner in it
    mine = tmp_path / f"{_writes.temp_prefix()}ghi.part"
    for p in (fresh_other, old_other, old_legacy, mine):
        p.write_bytes(b"x")
    stale = os.path.getmtime(mine) - _writes.STALE_S - 60
    for p in (old_other, old_legacy):
        os.utime(p, (stale, stale))
    gone = _writes.sweep(str(tmp_path))
    assert sorted(name for name, _ in gone) == sorted([old_legacy.name, old_other.name])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([fresh_other.name, mine.name])

    writer = subprocess.Popen(["sleep", "60"])  # another live process of this host: its file stays
    try:
        theirs = tmp_path / f".tmp-{writer.pid}@{_writes.temp_prefix().split('@', 1)[1]}jkl.part"
        theirs.write_bytes(b"being written")
        assert _writes.sweep(str(tmp_path)) == [] and theirs.exists()
    finally:
        writer.kill()
        writer.wait()
    assert _writes.sweep(str(tmp_path)) == [(theirs.name, 13)]  # gone with its writer


# ---------------------------------------------------------------- truncated JAX cache files
def test_truncated_and_empty_jax_cache_files_are_removed_before_jax_reads_them(tmp_path):
    nitro_ipy.set_cache_dir(tmp_path / "store")
    assert _store.activate()
    f = jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)
    expected = np.asarray(f(jnp.arange(4.0)))
    written = sorted((tmp_path / "store" / "xla").glob("jit__lambda*-cache"))
    assert len(written) == 1 and _xla.whole(written[0].read_bytes())
    assert stat.S_IMODE(written[0].stat().st_mode) == _xla.WHOLE  # written whole: never read by the check
    assert _litter(tmp_path) == []  # written whole: no temp file left
    names = {p.name for p in written[0].parent.iterdir()}
    # What a JAX killed mid-write (or on a full disk) leaves: a cut stream, an empty file.
    data = written[0].read_bytes()
    written[0].chmod(0o644)  # as JAX's own cache writes its files, in place
    written[0].write_bytes(data[: len(data) // 2])
    empty = written[0].with_name("jit_other-00ff-cache")
    empty.write_bytes(b"")
    kept = written[0].with_name("jit_kept-0a0b-cache")
    kept.write_bytes(zlib.compress(b"\0" * 4096))

    # The next start (this process, as a fresh one sees the store):
    _store._swept.clear()
    jax.clear_caches()
    from jax._src import compilation_cache

    compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # JAX's "Error reading persistent compilation cache entry" fails here
        assert _store.activate()
        again = np.asarray(jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)(jnp.arange(4.0)))
    np.testing.assert_array_equal(again, expected)
    assert {p.name for p in written[0].parent.iterdir()} == names | {kept.name}
    assert _xla.whole(written[0].read_bytes())  # compiled again and written whole
    assert stat.S_IMODE(kept.stat().st_mode) == _xla.WHOLE  # checked once: not read at the next start
    assert sorted((name, size) for _, name, size, why in _writes.swept if why == "truncated") == sorted(
        [(written[0].name, len(data) // 2), (empty.name, 0)])
    assert _stats.stats_table().swept == "nitro_ipy swept: 2 empty or truncated JAX cache files"


# ---------------------------------------------------------------- a full disk, a file size limit, read-only
STORE_TAIL = (". The store is off for this process: training goes on, programs compile as usual and are not kept "
              "for a restart. Fix: free space there, or point `NITRO_IPY_CACHE_DIR` (or `nitro_ipy.set_cache_dir`) "
              "at a writable disk.")


def test_a_full_disk_under_the_store_is_one_line_and_training_goes_on(tmpfs, messages):
    disk = tmpfs()
    nitro_ipy.set_cache_dir(disk / "store")
    _fill(disk, 8 << 10)  # less than JAX's cache files of setup's eager operations take
    n = _train(2)
    off = _said(messages, _report.Kind.STORE_OFF)
    assert len(off) == 1, off
    assert off[0].startswith(f"nitro_ipy: the program store `{disk / 'store'}` could not be written: no space left "
                             "on the device (ENOSPC): it needs "), off
    assert " free there" in off[0] and off[0].endswith(STORE_TAIL)
    assert _litter(disk) == []  # no temp file, no empty JAX cache file
    assert n.step == 8 and _store.active_dir() is None
    nitro_ipy.set_cache_dir(None)
    assert _same(_train(2).params, n.params) == [True, True]  # trained as without a store


def test_a_checkpoint_on_a_full_disk_raises_at_save_and_periodic_ones_warn_once(tmpfs):
    disk = tmpfs()
    n = _train(1, checkpoint_dir=disk / "ck", checkpoint_every=1, keep=2)
    assert sorted(p.name for p in (disk / "ck").iterdir()) == ["step-00000004.nitro.npz"]
    _fill(disk, 4 << 10)
    with pytest.raises(_checkpoint.CheckpointWriteError) as err:
        n.save(disk / "explicit")
    assert str(err.value).startswith(f"the checkpoint `{disk / 'explicit'}.nitro.npz` could not be written: "
                                     "no space left on the device (ENOSPC): it needs ")
    assert str(err.value).endswith(" free there. Nothing of it is on disk; the checkpoints written before it are "
                                   "whole. Fix: free space there, or save to another disk.")
    with pytest.warns(nitro_ipy.NitroWarning) as said:
        n.train(3)  # three periodic saves fail: one warning
    assert n.epoch == 4
    assert len(said) == 1
    assert str(said[0].message).startswith(
        f"the periodic checkpoint `{disk / 'ck' / 'step-00000008.nitro.npz'}` could not be written: no space left")
    assert "keeps the last checkpoint written (`step-00000004.nitro.npz`)" in str(said[0].message)
    assert sorted(p.name for p in (disk / "ck").iterdir()) == ["step-00000004.nitro.npz"]
    assert _litter(disk) == []
    assert nitro_ipy.Nitro(Tiny(), data=DATA, batch_size=16, progress=False,
                           resume=disk / "ck" / "step-00000004.nitro.npz").step == 4


def test_a_read_only_store_and_checkpoint_directory(tmpfs, messages):
    disk = tmpfs()
    nitro_ipy.set_cache_dir(disk / "store")  # made while writable
    (disk / "ck").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    n = _train(1)
    off = _said(messages, _report.Kind.STORE_OFF)
    assert off == [f"nitro_ipy: the program store `{disk / 'store'}` could not be written: the file system is "
                   "read-only (EROFS)" + STORE_TAIL]
    with pytest.raises(_checkpoint.CheckpointWriteError, match=r"could not be written: the file system is read-only "
                       r"\(EROFS\)\. Nothing of it is on disk; .* Fix: free space there, or save to another disk\."):
        n.save(disk / "ck" / "c")


EFBIG = MODEL + """
import os, resource, sys
import nitro_ipy

nitro_ipy.set_cache_dir(os.path.join(sys.argv[1], "store"))
resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, resource.RLIM_INFINITY))  # SIGXFSZ: Python ignores it
n = Nitro(Tiny(), data=DATA, batch_size=16, max_epochs=1, progress=False)
n.train()
print("trained", n.step)
"""


def test_a_file_size_limit_is_one_line_in_a_child(tmp_path):
    done = _child(EFBIG, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    off = [line for line in lines if "program store" in line]
    assert len(off) == 1, lines
    assert off[0].startswith(f"nitro_ipy: the program store `{tmp_path / 'store'}` could not be written: the file is "
                             "larger than this process may write (EFBIG: `ulimit -f`): it needs ")
    assert off[0].endswith(", the limit is 16.0 KiB" + STORE_TAIL)
    assert "trained 4" in lines
    assert "Error writing persistent compilation cache" not in done.stderr
    assert _litter(tmp_path) == []
