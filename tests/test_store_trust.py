"""The program store runs only what this user compiled (issue 38): each way an attacker could plant a
stored program (a pickle payload that runs `os.system` to create a marker file, with its checksum
recomputed) is refused before any of it is interpreted, a second process still trains, and the store says
once why it is off or why it refused the file. Then: a symbolic link swapped in between the check and the
open, parent directories others can write, JAX's cache directory, each refusal's exact message, and the
parts (the names a pickle asks for, found by a dry run; tree definitions as records).

Ownership by another user is made with `os.chown` to uid 65534 (`nobody`); the checks compare owners with
`os.getuid()`, so they hold for root too (which bypasses permission checks, not ownership ones).

Cost: six child processes (about 5 s each); the rest runs in this process."""

import collections
import dataclasses
import hashlib
import json
import os
import pickle
import pwd
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
from nitro_ipy._base import _report
from nitro_ipy._compiler import _store, _trust
from nitro_ipy._training import _ahead

NOBODY = 65534
ME = f"{pwd.getpwuid(os.getuid()).pw_name} (uid {os.getuid()})"
OTHER = f"{pwd.getpwuid(NOBODY).pw_name} (uid {NOBODY})"
TAIL = ("and a stored program is code this process runs; the store is off for this process, programs "
        "compile as usual. Fix: ")


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "cache"
    nitro_ipy.set_cache_dir(path)
    yield path
    _store._override = _store._UNSET
    _store._max_bytes = None
    from jax._src import compilation_cache

    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()


@pytest.fixture
def messages():
    got = []
    previous = _report.set_sink(got.append)
    yield got
    _report.set_sink(previous)


@dataclasses.dataclass
class Tiny:
    hidden: GraphConst[int] = 8
    lr: Device[float] = 1e-2

    def init(self, rng):
        k1, k2 = jax.random.split(rng)
        return {"w1": jax.random.normal(k1, (3, self.hidden)) * 0.5, "w2": jax.random.normal(k2, (self.hidden,)) * 0.5}

    def forward(self, params, *, x):
        return jnp.tanh(x @ params["w1"]) @ params["w2"]

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)

    def optimizer(self):
        return optax.adam(self.lr)


X = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
DATA = {"train": {"x": X, "y": np.sin(X.sum(1))}, "valid": {"x": X[:16], "y": np.sin(X[:16].sum(1))}}


def _train():
    n = Nitro(Tiny(), data=DATA, batch_size=16, max_epochs=1, progress=False)
    n.train()
    assert _ahead.wait(60)  # compile ahead (on for users) settled: every load and store said
    return n


def _said(messages, kind):
    return [m.text for m in messages if m.kind == kind]


def _compiles(messages):
    return [(m.text.split()[2], " from disk " in m.text) for m in messages if m.kind == _report.Kind.COMPILE]


class _Plant:
    """What `pickle` turns into `os.system(command)` when it loads it."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _plant(path, marker, payload=None):
    """Rewrite the stored program at `path` with a payload that runs `touch marker` when unpickled, and
    its checksum recomputed: every check the store had before issue 38 passes."""
    header, _ = _store.read_header(path.read_bytes())
    payload = payload if payload is not None else pickle.dumps(_Plant(f"touch {marker}"), protocol=4)
    header["payload"] = {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    head = json.dumps(header, sort_keys=True).encode()
    path.write_bytes(b"NITROPS1" + struct.pack(">Q", len(head)) + head + payload)


def _grad_file(store):
    grad = next(e for e in nitro_ipy._compiler._cache.live_entries() if e.kind == "grad")
    return store / "programs" / (_store.key_digest(grad.key) + ".nxp")


CHILD = textwrap.dedent('''
    import dataclasses, json, sys
    sys.path.insert(0, {tests!r})
    import nitro_ipy
    from nitro_ipy._base import _report
    from test_store_trust import Tiny, DATA
    from nitro_ipy import Nitro

    said = []
    _report.set_sink(said.append)
    n = Nitro(Tiny(), data=DATA, batch_size=16, max_epochs=1, progress=False)
    n.train()
    print("RESULT", json.dumps({{
        "loss": n.history[0]["loss"],
        "compiles": [(m.text.split()[2], " from disk " in m.text) for m in said if m.kind == _report.Kind.COMPILE],
        "store": [m.text for m in said if m.kind in (_report.Kind.STORE_OFF, _report.Kind.STORE_REFUSED)],
    }}))
''')


def _second_process(tmp_path, store):
    """A second process trains with the store in `store` (the same module, so the same keys)."""
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(tests=os.path.dirname(__file__)))
    env = {**os.environ, "NITRO_IPY_CACHE_DIR": str(store)}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
    result["compiles"] = [tuple(c) for c in result["compiles"]]
    return result


FRESH = [("grad", False), ("opt", False), ("eval", False)]


def _populated(tmp_path, store):
    """The store as a first process leaves it (3 programs), the marker path an attacker's payload touches,
    and that payload planted in the gradient program's file."""
    _train()
    marker = tmp_path / "planted-code-ran"
    path = _grad_file(store)
    _plant(path, marker)
    assert len(list((store / "programs").glob("*.nxp"))) == 3
    return path, marker


# ---------------------------------------------------------------- the table, row by row
def test_a_store_root_owned_by_another_user_is_off(tmp_path, store):
    _, marker = _populated(tmp_path, store)
    os.chown(store, NOBODY, NOBODY)
    store.chmod(0o755)
    child = _second_process(tmp_path, store)
    assert not marker.exists()
    assert np.isfinite(child["loss"]) and child["compiles"] == FRESH
    assert child["store"] == [
        f"nitro_ipy: refusing the program store `{store}`: it is owned by {OTHER}, not by you ({ME}), " + TAIL
        + "point `NITRO_IPY_CACHE_DIR` (or `nitro_ipy.set_cache_dir`) at a directory of your own."]


def test_a_programs_directory_others_can_write_is_off(tmp_path, store):
    _, marker = _populated(tmp_path, store)
    (store / "programs").chmod(0o777)
    child = _second_process(tmp_path, store)
    assert not marker.exists()
    assert np.isfinite(child["loss"]) and child["compiles"] == FRESH
    assert child["store"] == [
        f"nitro_ipy: refusing the program store `{store}`: `{store / 'programs'}` is writable by others "
        f"(mode 777), " + TAIL + f"`chmod 700 {store / 'programs'}`."]


def test_a_program_file_owned_by_another_user_turns_the_store_off(tmp_path, store):
    path, marker = _populated(tmp_path, store)
    os.chown(path, NOBODY, NOBODY)
    child = _second_process(tmp_path, store)
    assert not marker.exists()
    assert np.isfinite(child["loss"]) and child["compiles"] == FRESH  # grad read first: off before opt, eval
    assert child["store"] == [
        f"nitro_ipy: refusing the program store `{store}`: `{path}` is owned by {OTHER}, not by you ({ME}), "
        + TAIL + f"`rm {path}` (a file you did not write)."]
    assert path.exists()  # not ours to delete: the user decides


def test_a_program_file_replaced_by_a_symlink_turns_the_store_off(tmp_path, store):
    path, marker = _populated(tmp_path, store)
    elsewhere = tmp_path / "elsewhere.nxp"
    path.rename(elsewhere)  # the planted file, the user's own, outside the store
    path.symlink_to(elsewhere)
    child = _second_process(tmp_path, store)
    assert not marker.exists()
    assert np.isfinite(child["loss"]) and child["compiles"] == FRESH
    assert child["store"] == [
        f"nitro_ipy: refusing the program store `{store}`: `{path}` is a symbolic link (the store follows "
        f"none), " + TAIL + f"`rm {path}`."]


def test_a_planted_file_in_the_users_own_private_store_is_refused_before_it_runs(tmp_path, store):
    path, marker = _populated(tmp_path, store)
    child = _second_process(tmp_path, store)
    assert not marker.exists()
    assert np.isfinite(child["loss"])
    assert child["compiles"] == [("grad", False), ("opt", True), ("eval", True)]  # only the planted one
    assert child["store"] == [
        f"nitro_ipy: stored program {path.name} refused (names `posix.system`, which a stored program never "
        f"loads); deleted, it compiles as usual."]
    _store.read_header(path.read_bytes())  # written again, whole, by the child's compile
    assert _second_process(tmp_path, store)["compiles"] == [("grad", True), ("opt", True), ("eval", True)]


# ---------------------------------------------------------------- the same, in the metadata and elsewhere
def _rewrite_header(path, edit):
    header, payload = _store.read_header(path.read_bytes())
    edit(header)
    head = json.dumps(header, sort_keys=True).encode()
    path.write_bytes(b"NITROPS1" + struct.pack(">Q", len(head)) + head + payload)


TREE_PLANTS = [
    (lambda h: h["trees"].__setitem__("in", ["os:system", None, []]),
     "names the tree node type `os.system`, which is not a pytree node type of this process"),
    (lambda h: h["trees"].__setitem__("in", ["tuple", {"o": "os:system"}, []]),
     "names `os.system` in a tree, which is not a constant of its module"),
    (lambda h: h["trees"].__setitem__("in", ["subprocess:Popen", None, []]),
     "names the tree node type `subprocess.Popen`, which is not a pytree node type of this process"),
    (lambda h: h["trees"].__setitem__("in", ["defaultdict", {"t": [{"n": "builtins:print"}, {"t": []}]}, []]),
     "names the tree node type `builtins.print`, which is not a pytree node type of this process"),
    (lambda h: h["trees"].__setitem__("out", {"__reduce__": "os.system"}),
     "has a tree record this loader does not read"),
]


def test_the_metadata_calls_nothing_a_record_naming_anything_else_is_refused(store, messages):
    _train()
    path = _grad_file(store)
    for plant, reason in TREE_PLANTS:
        _rewrite_header(path, plant)
        nitro_ipy.cache_reset()
        messages.clear()
        _train()
        assert _said(messages, _report.Kind.STORE_REFUSED) == [
            f"nitro_ipy: stored program {path.name} refused ({reason}); deleted, it compiles as usual."]
        assert _compiles(messages) == [("grad", False), ("opt", True), ("eval", True)]


def test_a_payload_hiding_its_global_behind_the_memo_is_found_and_refused(tmp_path, store, messages):
    _train()
    path = _grad_file(store)
    marker = tmp_path / "memo-code-ran"
    # protocol 4 memoizes "posix" and "system" as plain strings first: STACK_GLOBAL reaches them by BINGET
    hidden = pickle.dumps(("posix", "system", _Plant(f"touch {marker}")), protocol=4)
    assert ("posix", "system") in _trust.pickle_globals(hidden)
    _plant(path, marker, hidden)
    nitro_ipy.cache_reset()
    messages.clear()
    n = _train()
    assert not marker.exists() and np.isfinite(n.history[0]["loss"])
    assert _said(messages, _report.Kind.STORE_REFUSED) == [
        f"nitro_ipy: stored program {path.name} refused (names `posix.system`, which a stored program never "
        f"loads); deleted, it compiles as usual."]


def test_a_symlink_swapped_in_between_the_check_and_the_open_does_not_pass(tmp_path, store, messages, monkeypatch):
    """The directory checks pass and the file is a regular one of the user's when the load starts; an
    attacker swaps a symbolic link in just before the open. The open refuses to follow it (O_NOFOLLOW),
    and a file swapped in under another owner is caught on the descriptor (fstat), not by its path."""
    path, marker = _populated(tmp_path, store)
    elsewhere = tmp_path / "elsewhere.nxp"
    real_open = os.open
    swapped = []

    def swap_then_open(name, flags, mode=0o777, *, dir_fd=None):
        if dir_fd is not None and str(name).endswith(".nxp") and not swapped:
            assert os.lstat(path).st_mode & 0o170000 == 0o100000  # a regular file until now
            path.rename(elsewhere)
            path.symlink_to(elsewhere)
            swapped.append(name)
        return real_open(name, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(_trust.os, "open", swap_then_open)
    nitro_ipy.cache_reset()
    n = _train()
    monkeypatch.undo()
    assert swapped == [path.name] and not marker.exists() and np.isfinite(n.history[0]["loss"])
    assert _said(messages, _report.Kind.STORE_OFF) == [
        f"nitro_ipy: refusing the program store `{store}`: `{path}` is a symbolic link (the store follows "
        f"none), " + TAIL + f"`rm {path}`."]
    assert _compiles(messages)[-3:] == FRESH


def test_a_file_swapped_in_under_another_owner_is_caught_on_the_descriptor(tmp_path, store, messages, monkeypatch):
    path, marker = _populated(tmp_path, store)
    real_open = os.open

    def swap_then_open(name, flags, mode=0o777, *, dir_fd=None):
        if dir_fd is not None and str(name).endswith(".nxp"):
            os.chown(path, NOBODY, NOBODY)  # after every check by path could have run
        return real_open(name, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(_trust.os, "open", swap_then_open)
    nitro_ipy.cache_reset()
    _train()
    monkeypatch.undo()
    assert not marker.exists()
    assert _said(messages, _report.Kind.STORE_OFF) == [
        f"nitro_ipy: refusing the program store `{store}`: `{path}` is owned by {OTHER}, not by you ({ME}), "
        + TAIL + f"`rm {path}` (a file you did not write)."]


def test_off_stays_off_for_the_process_until_set_cache_dir_checks_again(tmp_path, store, messages):
    _populated(tmp_path, store)
    (store / "programs").chmod(0o777)
    nitro_ipy.cache_reset()
    _train()
    (store / "programs").chmod(0o700)  # fixed, but the store said it is off for this process
    nitro_ipy.cache_reset()
    messages.clear()
    _train()
    assert _compiles(messages) == FRESH and _said(messages, _report.Kind.STORE_OFF) == []
    nitro_ipy.set_cache_dir(store)  # checks again: on
    nitro_ipy.cache_reset()
    messages.clear()
    _train()
    assert _compiles(messages) == [("grad", False), ("opt", True), ("eval", True)]  # grad's file: planted
    assert len(_said(messages, _report.Kind.STORE_REFUSED)) == 1


# ---------------------------------------------------------------- parents and JAX's cache directory
def test_a_parent_others_can_write_is_refused_unless_sticky(tmp_path, monkeypatch, messages):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    root = shared / "cache"
    want = (f"nitro_ipy: refusing the program store `{root}`: `{shared}` (a parent) is writable by others "
            f"without the sticky bit (mode 777), so anyone could replace the store, " + TAIL
            + f"`chmod o-w {shared}`, or a store under a directory only you can write.")
    with pytest.raises(nitro_ipy.NitroValueError) as err:
        nitro_ipy.set_cache_dir(root)
    assert str(err.value) == want
    monkeypatch.setenv("NITRO_IPY_CACHE_DIR", str(root))
    _train()
    _train()
    assert _said(messages, _report.Kind.STORE_OFF) == [want]  # once
    assert not (root / "programs").exists()
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)  # as /tmp: others can add entries, not replace ours
    nitro_ipy.set_cache_dir(sticky / "cache")
    _store._override = _store._UNSET


def test_a_parent_owned_by_another_user_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    mine = theirs / "cache"
    mine.mkdir(mode=0o700)  # owned by this user, in a directory someone else controls
    with pytest.raises(nitro_ipy.NitroValueError) as err:
        nitro_ipy.set_cache_dir(mine)
    assert str(err.value) == (
        f"nitro_ipy: refusing the program store `{mine}`: `{theirs}` (a parent) is owned by {OTHER}, who could "
        f"replace the store, " + TAIL + "a store under directories owned by you or root: `NITRO_IPY_CACHE_DIR` "
        "or `nitro_ipy.set_cache_dir`.")


def test_a_store_reached_through_a_symlink_is_checked_where_it_resolves(tmp_path, messages):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    nitro_ipy.set_cache_dir(link)
    try:
        _train()
        assert len(list((real / "programs").glob("*.nxp"))) == 3
        real.chmod(0o770)
        with pytest.raises(nitro_ipy.NitroValueError, match=r"`.*/real` is writable by its group \(mode 770\)"):
            nitro_ipy.set_cache_dir(link)
    finally:
        _store._override = _store._UNSET
        jax.config.update("jax_compilation_cache_dir", None)


def test_jax_cache_directory_gets_the_same_checks(tmp_path, store, messages):
    planted = store / "xla" / "jit_step-0123-cache"
    planted.write_bytes(b"not ours")
    os.chown(planted, NOBODY, NOBODY)
    _store._xla_checked.clear()
    jax.config.update("jax_compilation_cache_dir", None)
    n = _train()
    assert np.isfinite(n.history[0]["loss"])
    assert jax.config.jax_compilation_cache_dir is None  # never pointed at a directory it cannot trust
    assert _said(messages, _report.Kind.STORE_OFF) == [
        f"nitro_ipy: refusing the program store `{store}`: `{planted}` is owned by {OTHER}, not by you ({ME}), "
        + TAIL + f"`rm {planted}` (a file you did not write)."]
    assert list((store / "programs").glob("*.nxp")) == []


def test_xla_directory_others_can_write_is_refused(store):
    (store / "xla").chmod(0o757)
    with pytest.raises(nitro_ipy.NitroValueError) as err:
        nitro_ipy.set_cache_dir(store)
    assert str(err.value) == (f"nitro_ipy: refusing the program store `{store}`: `{store / 'xla'}` is writable "
                              f"by others (mode 757), " + TAIL + f"`chmod 700 {store / 'xla'}`.")


# ---------------------------------------------------------------- the parts
def test_pickle_globals_finds_every_name_without_running_any(tmp_path):
    marker = tmp_path / "ran"
    blob = pickle.dumps([_Plant(f"touch {marker}"), collections.OrderedDict(a=1)], protocol=2)
    assert _trust.pickle_globals(blob) == [("posix", "system"), ("collections", "OrderedDict")]
    for protocol in (0, 1, 3, 5):
        names = _trust.pickle_globals(pickle.dumps(_Plant(f"touch {marker}"), protocol=protocol))
        assert names == [("posix", "system")], protocol
    assert not marker.exists()
    import copyreg

    copyreg.add_extension("posix", "system", 240)  # an extension code: a global by number
    try:
        assert _trust.pickle_globals(b"\x80\x02\x82\xf0.") == [("posix", "system")]  # EXT1 240
    finally:
        copyreg.remove_extension("posix", "system", 240)
    with pytest.raises(_trust.Refused, match=r"^its executable is not a pickle this loader reads"):
        _trust.pickle_globals(b"\x80\x04garbage")
    with pytest.raises(_trust.Refused, match=r"^names `builtins.eval`, which a stored program never loads$"):
        _trust.check_executable(pickle.dumps(eval, protocol=4))


@dataclasses.dataclass
class _Registered:
    a: jax.Array
    tag: str = "x"


jax.tree_util.register_dataclass(_Registered, data_fields=["a"], meta_fields=["tag"])
_Pair = collections.namedtuple("_Pair", "left right")


def test_tree_records_round_trip_json_and_refuse_what_they_cannot_record():
    import equinox as eqx

    tree = ({"b": _Pair(1, [2, None]), "a": collections.OrderedDict(z=1, y=2)},
            collections.defaultdict(list, {"k": 1}), _Registered(3, "tagged"),
            eqx.nn.MLP(2, 1, 3, 1, key=jax.random.PRNGKey(0)), optax.adam(1e-3).init({"w": jnp.ones(2)}))
    treedef = jax.tree.structure(tree)
    records = json.loads(json.dumps(_trust.tree_records(treedef)))
    assert _trust.tree_from_records(records) == treedef
    with pytest.raises(_trust.Unrecordable, match=r"^its tree carries a function in a node's aux data$"):
        _trust.tree_records(jax.tree.structure(jax.tree_util.Partial(lambda x: x, 1)))

    class Local:  # a node type no other process can find by name
        pass

    jax.tree_util.register_pytree_node(Local, lambda v: ((), None), lambda aux, ch: Local())
    with pytest.raises(_trust.Unrecordable, match=r"^its tree has a node type with no importable name"):
        _trust.tree_records(jax.tree.structure(Local()))


def test_jax_cache_files_pass_group_writable_only_under_a_umask_that_writes_them_so(tmp_path):
    """JAX writes its cache files with the process's umask: under 002 they are group-writable, inside the
    private `xla/`; they pass then, and only then. Writable by others never passes."""
    xla = tmp_path / "xla"
    xla.mkdir(mode=0o700)
    f = xla / "jit_f-0123-cache"
    f.write_bytes(b"x")
    f.chmod(0o664)
    previous = os.umask(0o002)
    try:
        _trust.check_entries(str(tmp_path), str(xla))
        f.chmod(0o666)
        with pytest.raises(_trust.Untrusted, match=r"is writable by others \(mode 666\)"):
            _trust.check_entries(str(tmp_path), str(xla))
    finally:
        os.umask(previous)
    f.chmod(0o664)
    os.umask(0o022)
    try:
        with pytest.raises(_trust.Untrusted) as err:
            _trust.check_entries(str(tmp_path), str(xla))
    finally:
        os.umask(previous)
    assert str(err.value) == (f"nitro_ipy: refusing the program store `{tmp_path}`: `{f}` is writable by its "
                              f"group (mode 664), " + TAIL + f"`chmod 600 {f}`.")
