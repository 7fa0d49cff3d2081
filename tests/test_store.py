"""The program store: programs written by one process and loaded by another without tracing, exactly the
drifted ones recompiled after an edit, bad files refused, the directory's permissions checked.

Cost: three child processes (about 4 s each) in `test_restart_*`; the rest runs in this process."""

import dataclasses
import json
import os
import re
import struct
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import nitro_ipy
from nitro_ipy import Device, GraphConst, Nitro
from nitro_ipy._base import _events, _report
from nitro_ipy._compiler import _stats, _store
from nitro_ipy._training import _ahead


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "cache"
    nitro_ipy.set_cache_dir(path)
    yield path
    _store._override = _store._UNSET  # back to the environment's choice (off in tests)
    _store._max_bytes = None
    _forget_jax_cache()


def _forget_jax_cache():
    """The store pointed JAX's own cache at the (temporary) directory: point it nowhere again."""
    from jax._src import compilation_cache

    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()


@pytest.fixture
def messages():
    got = []
    previous = _report.set_sink(got.append)
    yield got
    _report.set_sink(previous)


SCALE = 2.0


def helper(x):
    return jnp.tanh(x) * SCALE


@dataclasses.dataclass
class Tiny:
    hidden: GraphConst[int] = 8
    lr: Device[float] = 1e-2

    def init(self, rng):
        k1, k2 = jax.random.split(rng)
        return {"w1": jax.random.normal(k1, (3, self.hidden)) * 0.5, "w2": jax.random.normal(k2, (self.hidden,)) * 0.5}

    def forward(self, params, *, x):
        return helper(x @ params["w1"]) @ params["w2"]

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)

    def optimizer(self):
        return optax.adam(self.lr)


X = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
DATA = {"train": {"x": X, "y": np.sin(X.sum(1))}, "valid": {"x": X[:16], "y": np.sin(X[:16].sum(1))}}


def _train(e=None):
    n = Nitro(e or Tiny(), data=DATA, batch_size=16, max_epochs=1, progress=False)
    n.train()
    return n


def _compiles(messages):
    return [m.text for m in messages if m.kind == _report.Kind.COMPILE]


def _files(store):
    return sorted((store / "programs").glob("*.nxp"))


def test_a_stored_program_loads_after_a_reset_and_counts_as_a_miss(store, messages):
    first = _train()
    assert len(_files(store)) == 3
    assert not any("from disk" in t for t in _compiles(messages))
    nitro_ipy.cache_reset()
    messages.clear()
    second = _train()
    lines = _compiles(messages)
    assert [t.split()[2] for t in lines] == ["grad", "opt", "eval"]
    assert all(" from disk in " in t and "(loaded, no trace)" in t for t in lines), lines
    stats = nitro_ipy.cache_stats()
    assert stats.misses == stats.entries == 3
    assert second.history == first.history
    assert jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), first.params, second.params) == {"w1": True, "w2": True}
    table = _stats.stats_table()
    assert [r.state for r in table.rows] == ["live, from disk"] * 3
    assert repr(table).splitlines()[-1].startswith("nitro_ipy program store: 3 programs, ")
    assert repr(table).splitlines()[-1].endswith(f"in {store} ({_store.loaded_count} loaded from disk this session)")


def _wait_preloaded():
    for slot in list(_store.preloaded.values()):
        assert slot.done.wait(60)


def test_a_new_handle_loads_its_classs_stored_programs_while_its_init_runs(store, messages):
    first = _train()
    digests = [_store.key_digest(k) + ".nxp" for k in first._programs]  # in the order the handle took them
    (index,) = (store / "programs").glob("*.nxg")
    assert json.loads(index.read_text()) == {"group": f"{Tiny.__module__}.Tiny", "programs": digests}
    nitro_ipy.cache_reset()  # as a new process: nothing in memory
    messages.clear()
    taken, loaded = _store.preloaded_taken, _store.loaded_count
    n = Nitro(Tiny(), data=DATA, batch_size=16, max_epochs=1, progress=False)  # the prefetch starts here
    _wait_preloaded()
    assert sorted(_store.preloaded) == sorted(digests)
    assert all(slot.compiled is not None for slot in _store.preloaded.values())
    n.train()
    assert _store.preloaded == {} and _store.preloaded_taken - taken == 3 and _store.loaded_count - loaded == 3
    assert [(t.split()[2], "from disk" in t) for t in _compiles(messages)] == [("grad", True), ("opt", True),
                                                                              ("eval", True)]
    assert n.history == first.history
    assert json.loads(index.read_text())["programs"] == digests  # unchanged: not written again
    Nitro(Tiny(), data=DATA, batch_size=16, max_epochs=1, progress=False)  # the in-memory cache serves it
    assert _store.preloaded == {}


def test_a_preloaded_executable_is_taken_only_for_the_file_it_was_loaded_from(store, messages):
    first = _train()
    grad, opt, _ = (_store.key_digest(k) + ".nxp" for k in first._programs)
    nitro_ipy.cache_reset()
    messages.clear()
    taken = _store.preloaded_taken
    n = Nitro(Tiny(), data=DATA, batch_size=16, max_epochs=1, progress=False)
    _wait_preloaded()
    _store.preloaded[grad].sha = "0" * 64  # as if another process rewrote the file since it was preloaded
    (store / "programs" / opt).write_bytes(b"NITROPS1 truncated")  # and a damaged file
    n.train()
    assert _store.preloaded_taken - taken == 1  # eval's alone
    refused = [m.data["reason"] for m in messages if m.kind == _report.Kind.STORE_REFUSED]
    assert refused == ["truncated"]  # said once, by the load, as without a prefetch
    assert [(t.split()[2], "from disk" in t) for t in _compiles(messages)] == [("grad", True), ("opt", False),
                                                                              ("eval", True)]
    # Another class's handle loads nothing of Tiny's.
    nitro_ipy.cache_reset()
    Nitro(Scored(), data=DATA, batch_size=16, max_epochs=1, progress=False)
    assert _store.preloaded == {}


@dataclasses.dataclass
class Scored(Tiny):
    @nitro_ipy.metrics("device")
    def mae(self, outputs, *, y):
        return {"mae": (jnp.sum(jnp.abs(outputs - y)), outputs.shape[0])}


def test_after_a_restart_the_metrics_load_in_the_background_after_the_evaluation_program(store, messages, monkeypatch):
    """With compile ahead on, a run after a restart loads its evaluation program in the background as
    it trains, and then its device metrics' programs (one per batch length: 16 rows at batch 12), keyed
    from the loaded program's outputs: validation loads nothing itself."""
    def run():
        return Nitro(Scored(), data=DATA, batch_size=12, max_epochs=1, progress=False).train()

    previous = _ahead.set_compile_ahead(True)
    try:
        first = run()
        assert _ahead.wait(60)
        nitro_ipy.cache_reset()
        _ahead.reset()
        messages.clear()
        waited = []

        def first_step_waits(running, thread):  # the first step is done: let the background finish before step 2
            if running and not waited:
                waited.append(_ahead.wait(60))

        unsubscribe = _events.subscribe("stepping", first_step_waits)  # after `_ahead`'s own subscriber
        try:
            second = run()
        finally:
            unsubscribe()
    finally:
        _ahead.set_compile_ahead(previous)
    assert waited == [True]
    assert [(o.kind, o.status) for o in _ahead.history()] == [("eval", "compiled"), ("metric:mae", "compiled"),
                                                              ("metric:mae", "compiled")]
    lines = _compiles(messages)
    assert [t.split()[2] for t in lines] == ["grad", "opt", "eval", "metric:mae", "metric:mae"]
    assert all(" from disk in " in t for t in lines), lines
    stats = nitro_ipy.cache_stats()
    assert stats.misses == stats.entries == 5
    assert second == first


def test_a_stale_stored_program_is_never_loaded(store, messages):
    global SCALE
    _train()
    nitro_ipy.cache_reset()
    messages.clear()
    old = SCALE
    SCALE = 3.0  # the helper's global moved: grad and eval depend on it, opt does not
    try:
        _train()
    finally:
        SCALE = old
    lines = _compiles(messages)
    assert [(t.split()[2], "from disk" in t) for t in lines] == [("grad", False), ("opt", True), ("eval", False)]


def test_closure_records_round_trip_and_still_see_drift(store):
    global SCALE
    _train()
    entry = next(e for e in nitro_ipy._compiler._cache.live_entries() if e.kind == "grad")
    records = json.loads(json.dumps(nitro_ipy._closure.closure_records(entry.closure)))
    rebuilt = nitro_ipy._closure.closure_from_records(records)
    assert rebuilt.names() == entry.closure.names()
    assert rebuilt.drift({}) == []
    old, SCALE = SCALE, 5.0
    try:
        assert rebuilt.drift({}) == [f"{__name__}.SCALE"]
    finally:
        SCALE = old


def _rewrite(path, edit_header=None, payload=None):
    blob = path.read_bytes()
    header, body = _store.read_header(blob)
    if edit_header:
        edit_header(header)
    head = json.dumps(header).encode()
    path.write_bytes(b"NITROPS1" + struct.pack(">Q", len(head)) + head + (body if payload is None else payload))


def _foreign_version(h):
    h["validity"]["versions"]["jaxlib"] = "0.0.1"


def _foreign_cpu(h):
    h["validity"]["cpu"] = "0" * 16


DAMAGES = [
    (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "truncated"),
    (lambda p: p.write_bytes(p.read_bytes()[:-10] + b"\0" * 10), "corrupt (checksum mismatch)"),
    (lambda p: p.write_bytes(b"garbage"), "not a nitro_ipy program file"),
    (lambda p: p.write_bytes(b"NITROPS1" + struct.pack(">Q", 5) + b"{nope"), "corrupt header"),
    (lambda p: _rewrite(p, _foreign_version), "foreign: written by jaxlib 0.0.1, this is jaxlib "),
    (lambda p: _rewrite(p, _foreign_cpu), "foreign: written on a CPU with other features"),
]


def test_bad_files_are_refused_deleted_and_reported_once(store, messages):
    _train()
    grad = next(e for e in nitro_ipy._compiler._cache.live_entries() if e.kind == "grad")
    path = store / "programs" / (_store.key_digest(grad.key) + ".nxp")
    for damage, reason in DAMAGES:
        damage(path)
        nitro_ipy.cache_reset()
        messages.clear()
        n = _train()
        refused = [m for m in messages if m.kind == _report.Kind.STORE_REFUSED]
        assert len(refused) == 1, reason
        assert refused[0].data["reason"].startswith(reason)
        assert refused[0].text.startswith(f"nitro_ipy: stored program {path.name} refused (")
        assert [(t.split()[2], "from disk" in t) for t in _compiles(messages)] == [
            ("grad", False), ("opt", True), ("eval", True)]
        assert np.isfinite(n.history[0]["loss"])
        _store.read_header(path.read_bytes())  # deleted, then written again whole by the fresh compile
    # Said once: the same bad file with the same fault again is deleted silently.
    DAMAGES[0][0](path)
    nitro_ipy.cache_reset()
    messages.clear()
    _train()
    assert [m for m in messages if m.kind == _report.Kind.STORE_REFUSED] == []


def test_a_directory_others_can_write_to_is_refused(tmp_path, monkeypatch, messages):
    open_dir = tmp_path / "shared"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(nitro_ipy.NitroValueError, match=r"refusing the program store .*writable by others \(mode 777\).*chmod 700"):
        nitro_ipy.set_cache_dir(open_dir)
    monkeypatch.setenv("NITRO_IPY_CACHE_DIR", str(open_dir))
    _train()
    _train()
    off = [m for m in messages if m.kind == _report.Kind.STORE_OFF]
    assert len(off) == 1 and "writable by others" in off[0].text
    assert not (open_dir / "programs").exists()


def test_off_by_none_or_empty_env(tmp_path, monkeypatch):
    monkeypatch.setenv("NITRO_IPY_CACHE_DIR", "")
    assert nitro_ipy.cache_dir() is None
    monkeypatch.setenv("NITRO_IPY_CACHE_DIR", str(tmp_path / "c"))
    assert nitro_ipy.cache_dir() == str(tmp_path / "c")
    nitro_ipy.set_cache_dir(None)
    try:
        _train()
        assert nitro_ipy.cache_dir() is None
        assert not (tmp_path / "c").exists()
    finally:
        _store._override = _store._UNSET


def test_the_store_is_capped_least_recently_used_first(store):
    _train()
    import shutil

    shutil.rmtree(store / "xla", ignore_errors=True)  # JAX's own cache files count toward the cap too
    files = _files(store)
    sizes = {p: p.stat().st_size for p in files}
    for age, p in enumerate(files):  # oldest first in this order
        os.utime(p, (1000 + age, 1000 + age))
    keep = sizes[files[-1]] + sizes[files[-2]]
    assert _store.evict(str(store / "programs"), cap=keep) == 1
    assert _files(store) == files[1:]


def test_a_program_with_a_host_callback_goes_through_jax_cache(store, messages):
    @dataclasses.dataclass
    class Printing(Tiny):
        def loss(self, outputs, *, y):
            jax.debug.callback(lambda v: None, outputs[0])
            return jnp.mean((outputs - y) ** 2)

    _train(Printing())
    fallback = [m for m in messages if m.kind == _report.Kind.STORE_FALLBACK]
    assert [m.data["program"] for m in fallback] == ["grad", "eval"]
    assert fallback[0].text.startswith("nitro_ipy: the `grad` program cannot be stored (it calls back into Python")
    assert f"JAX's persistent compilation cache in {store / 'xla'}" in fallback[0].text
    assert jax.config.jax_compilation_cache_dir == str(store / "xla")
    assert len(_files(store)) == 1  # the optimizer program only


def test_our_programs_stay_out_of_jax_cache(store):
    _train()
    assert len(_files(store)) == 3
    # JAX's cache (on for setup's eager operations) holds none of the three: the store holds them
    assert _jax_cache_programs(store) == []


def _jax_cache_programs(store):
    """The names of our programs (`jit_gradient`, `jit_update`, `jit_evaluate`) in JAX's cache."""
    names = ("jit_gradient-", "jit_update-", "jit_evaluate-")
    return sorted(p.name.split("-")[0] for p in (store / "xla").glob("*-cache") if p.name.startswith(names))


def test_a_program_served_by_jax_cache_is_not_stored_and_a_reload_still_runs(store, monkeypatch, messages):
    # XLA:CPU cannot serialize a deserialized executable (it fails on its first run after loading). An
    # earlier version wrote our programs to JAX's cache too; one found there must not reach our store.
    import contextlib

    from nitro_ipy._base import _compat

    with monkeypatch.context() as m:
        m.setattr(_compat, "_no_jax_cache_writes", contextlib.nullcontext)
        first = _train()
    assert _jax_cache_programs(store) == ["jit_evaluate", "jit_gradient", "jit_update"]
    for path in _files(store):
        path.unlink()  # what a changed key (or an eviction) leaves: JAX's cache has the HLO, we do not
    nitro_ipy.cache_reset()
    second = _train()
    assert _files(store) == []  # all three came out of JAX's cache: not re-serialized
    nitro_ipy.cache_reset()
    messages.clear()
    third = _train()  # compiled through JAX's cache again; before the fix: NOT_FOUND: Function ... fusion
    assert not any("from disk" in t for t in _compiles(messages))
    assert first.history == second.history == third.history


def _reserialize(path):
    """Rewrite a stored program with its executable loaded and serialized once more: a whole file that
    passes every check and loads, and whose first run fails (XLA:CPU cannot serialize a deserialized
    executable: the bug a JAX-cache hit written to the store caused)."""
    import hashlib

    from nitro_ipy._base._compat import deserialize_compiled, serialize_compiled
    from nitro_ipy._compiler import _trust

    header, payload = _store.read_header(path.read_bytes())
    trees = [_trust.tree_from_records(header["trees"][side]) for side in ("in", "out")]
    payload = serialize_compiled(deserialize_compiled(payload, *trees, header["meta"]["devices"]))[0]
    header["payload"] = {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    head = json.dumps(header, sort_keys=True).encode()
    path.write_bytes(b"NITROPS1" + struct.pack(">Q", len(head)) + head + payload)


@pytest.mark.skipif("__import__('jax').default_backend() != 'cpu'", reason="re-serializing makes an executable "
                    "that fails its first run on XLA:CPU only (the failure this recovers from)")
def test_a_stored_program_that_loads_but_fails_its_first_run_is_dropped_recompiled_and_retried(store, messages):
    first = _train()
    names = [p.name for p in _files(store)]
    for path in _files(store):
        _reserialize(path)
    nitro_ipy.cache_reset()
    messages.clear()
    second = _train()  # each program: loaded, its first run fails, compiled, that step retried
    refused = [m for m in messages if m.kind == _report.Kind.STORE_REFUSED]
    assert sorted(m.data["name"] for m in refused) == names  # each said once
    for m in refused:
        assert re.fullmatch(r"nitro_ipy: stored program [0-9a-f]{32}\.nxp refused \(loaded, but its first run "
                            r"failed: JaxRuntimeError: NOT_FOUND: Function \S+ not found \(type id: \d+\)\); "
                            r"deleted, it compiles as usual\.", m.text), m.text
    lines = _compiles(messages)
    assert [(t.split()[2], " from disk " in t) for t in lines] == [
        ("grad", True), ("grad", False), ("opt", True), ("opt", False), ("eval", True), ("eval", False)]
    stats = nitro_ipy.cache_stats()
    assert stats.misses == stats.entries == 3  # the recompile replaced the loaded program in its entry
    assert second.history == first.history and second.step == first.step
    assert jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), first.params, second.params) == {"w1": True, "w2": True}
    assert [p.name for p in _files(store)] == names  # stored again, from the fresh compile
    nitro_ipy.cache_reset()
    messages.clear()
    third = _train()  # and those load and run
    assert [(t.split()[2], " from disk " in t) for t in _compiles(messages)] == [
        ("grad", True), ("opt", True), ("eval", True)]
    assert not [m for m in messages if m.kind == _report.Kind.STORE_REFUSED]
    assert third.history == first.history


def test_reset_disk_magic_clears_and_stats_show_the_store(store):
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "nitro_ipy")
    try:
        _train()
        assert "nitro_ipy program store: 3 programs" in repr(ip.run_line_magic("nitro_stats", ""))
        ip.run_line_magic("nitro_reset", "--disk")
        assert _files(store) == []
        assert nitro_ipy.cache_stats() == (0, 0, 0)
    finally:
        ip.run_line_magic("unload_ext", "nitro_ipy")


CHILD = textwrap.dedent('''
    import dataclasses, json, sys
    import jax, jax.numpy as jnp, numpy as np, optax
    import nitro_ipy
    from nitro_ipy import GraphConst, Device, Nitro

    SCALE = {scale}

    def helper(x):
        return jnp.tanh(x) * SCALE

    @dataclasses.dataclass
    class Regression:
        hidden: GraphConst[int] = 8
        lr: Device[float] = 1e-2

        def init(self, rng):
            k1, k2 = jax.random.split(rng)
            return {{"w1": jax.random.normal(k1, (3, self.hidden)) * 0.5,
                     "w2": jax.random.normal(k2, (self.hidden,)) * 0.5}}

        def forward(self, params, *, x):
            return helper(x @ params["w1"]) @ params["w2"]

        def loss(self, outputs, *, y):
            return jnp.mean((outputs - y) ** 2)

        def optimizer(self):
            return optax.adam(self.lr)

    x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    data = {{"train": {{"x": x, "y": np.sin(x.sum(1))}}, "valid": {{"x": x[:16], "y": np.sin(x[:16].sum(1))}}}}
    n = Nitro(Regression(), data=data, batch_size=16, max_epochs=1, progress=False)
    n.train()
    from nitro_ipy._compiler import _store
    print("PRELOADED", _store.preloaded_taken)
    print("RESULT", json.dumps({{"stats": list(nitro_ipy.cache_stats()), "history": n.history}}))
''')


def _child(tmp_path, store, scale, devices: int = 1, cpu: bool = False):
    script = tmp_path / f"child_{scale}.py"
    script.write_text(CHILD.format(scale=scale))
    env = {**os.environ, "NITRO_IPY_CACHE_DIR": str(store), "JAX_NUM_CPU_DEVICES": str(devices)}
    if cpu:  # device counts are the CPU's (`JAX_NUM_CPU_DEVICES`): on a GPU host the child would take the GPU
        env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "refused" not in out.stdout, out.stdout
    lines = out.stdout.splitlines()
    compiles = [(l.split()[2], "from disk" in l) for l in lines if l.startswith("nitro_ipy: compiled ")]
    result = json.loads(next(l for l in lines if l.startswith("RESULT "))[7:])
    preloaded = int(next(l for l in lines if l.startswith("PRELOADED "))[10:])
    return compiles, result, preloaded


def test_restart_loads_every_program_and_an_edit_recompiles_exactly_the_drifted(tmp_path):
    store = tmp_path / "cache"
    store.mkdir(mode=0o700)
    cold, first, preloaded = _child(tmp_path, store, 2.0)
    assert cold == [("grad", False), ("opt", False), ("eval", False)] and preloaded == 0
    warm, second, preloaded = _child(tmp_path, store, 2.0)
    assert warm == [("grad", True), ("opt", True), ("eval", True)]  # nothing traced, nothing compiled
    assert preloaded == 3  # each loaded while the handle's setup ran, before its first step asked
    assert second == first  # same counts (3 misses, 3 entries), same losses
    assert first["stats"][1:] == [3, 3]
    edited, third, preloaded = _child(tmp_path, store, 3.0)  # the helper's global changed between the processes
    assert edited == [("grad", False), ("opt", True), ("eval", False)]
    assert preloaded == 1  # the drifted ones were preloaded too, and never served
    assert third["stats"][1:] == [3, 3]


def test_processes_of_other_device_counts_share_one_store_without_deleting_each_others_programs(tmp_path):
    """A one-device handle compiles the same key in a process of 1 CPU device and in one of 4 (a notebook
    before and after `jax_num_cpu_devices`, a 3.11 and a 3.12 kernel): each environment's programs are
    files of their own, so neither refuses and deletes the other's, and each one's next run loads them."""
    store = tmp_path / "cache"
    store.mkdir(mode=0o700)
    cold = [("grad", False), ("opt", False), ("eval", False)]
    warm = [("grad", True), ("opt", True), ("eval", True)]
    assert _child(tmp_path, store, 2.0, devices=1, cpu=True)[0] == cold
    assert _child(tmp_path, store, 2.0, devices=4, cpu=True)[0] == cold  # other devices: its own compile, files
    assert len(list((store / "programs").glob("*.nxp"))) == 6
    assert _child(tmp_path, store, 2.0, devices=1, cpu=True)[0] == warm  # `_child` asserts nothing was refused
    assert _child(tmp_path, store, 2.0, devices=4, cpu=True)[0] == warm
