"""Dependency closures (`nitro_ipy._closure`) and the file watcher (`nitro_ipy._notebook._watch`).

Helpers live in real module files under `tmp_path` (imported, edited, reloaded) or in real IPython cells;
every program is really traced with `jax.jit(...).lower(...)`.
"""

import importlib
import re
import sys
import textwrap
import threading
import time
import types

import jax
import jax.numpy as jnp
import pytest

from nitro_ipy._notebook import _watch

from nitro_ipy._base import _world
from nitro_ipy._closure import ClassAttrDep, ValueDep, note_class_attr, record
from nitro_ipy._experiment._fields import CompileView
from nitro_ipy._base._fingerprint import fingerprint

X = jnp.ones(3)

# Every test runs under both ways of recording this Python offers: the default (sys.monitoring on 3.12+,
# the trace's tracebacks on 3.11) and the other one (NITRO_IPY_RECORDER selects it).
MODES = ["monitoring", "traceback"] if sys.version_info >= (3, 12) else ["traceback", "profile"]


@pytest.fixture(autouse=True, params=MODES)
def recorder_mode(request, monkeypatch):
    monkeypatch.setenv("NITRO_IPY_RECORDER", request.param)
    return request.param


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """`make(source) -> module`: a real module file in `tmp_path`, imported; removed afterwards."""
    # Without .pyc files a reload always recompiles the source (an edit within the same second and of
    # the same size would otherwise load the stale bytecode).
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.syspath_prepend(str(tmp_path))
    created = []

    def make(source: str):
        name = re.sub(r"\W", "_", f"nitro_cl_{tmp_path.name}_{len(created)}")
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        created.append(name)
        return importlib.import_module(name)

    yield make
    for name in created:
        sys.modules.pop(name, None)


def rewrite(mod, source: str, reload: bool = True):
    with open(mod.__file__, "w") as f:
        f.write(textwrap.dedent(source))
    return importlib.reload(mod) if reload else mod


def recorded(fn, *args):
    """The recorder of tracing `fn` as `compile_program` does (a fresh jit wrapper: JAX caches traces by
    identity)."""
    wrapper = lambda *a: fn(*a)  # noqa: E731
    with record() as rec:
        rec.traced(jax.jit(wrapper).trace(*args).jaxpr, wrapper)
    return rec


def lower(fn, *args):
    """The closure `fn`'s trace records."""
    return recorded(fn, *args).closure


def mine(names, mod):
    prefix = mod.__name__ + "."
    return [n[len(prefix) :] for n in names if n.startswith(prefix)]


BASE = """
import jax.numpy as jnp

SCALE = 2.0

def leaf(x):
    return x * SCALE

def mid(x):
    return jnp.sin(leaf(x))

def top(x):
    return mid(x) + 1.0

def unused(x):
    return x
"""


def test_records_helpers_two_levels_down(user_module, recorder_mode):
    m = user_module(BASE)
    closure = lower(m.top, X)
    assert mine(closure.names(), m) == ["SCALE", "jnp", "leaf", "mid", "top"]
    funcs = {d.qualname: d for d in closure.functions if d.module == m.__name__}
    assert sorted(funcs) == ["leaf", "mid", "top"]
    assert all(d.filename == m.__file__ and d.file_digest for d in funcs.values())
    assert ValueDep(m.__name__, "jnp", "module:jax.numpy") in closure.values
    assert m.__file__ in closure.files()
    assert closure.untracked == ()
    assert closure.drift({}) == [] and closure.disk_edits({}) == []
    with record() as rec:
        assert rec._mode == recorder_mode


PURE_PYTHON = """
import jax.numpy as jnp

def n_terms():
    return 3

def scale_of(k):
    return 0.5 * k

def top(x):
    return jnp.sin(x) * scale_of(n_terms())
"""


def test_helpers_that_bind_no_primitive_are_recorded(user_module):
    """`n_terms` and `scale_of` only compute Python numbers, so no equation's traceback shows them: they
    are found through the globals `top` reads, and an edit to either drifts."""
    m = user_module(PURE_PYTHON)
    closure = lower(m.top, X)
    assert sorted(d.qualname for d in closure.functions if d.module == m.__name__) == ["n_terms", "scale_of", "top"]
    rewrite(m, PURE_PYTHON.replace("return 3", "return 4"))
    assert closure.drift({}) == [f"{m.__name__}.n_terms"]


def test_recording_under_a_c_profiler(user_module, recorder_mode):
    """cProfile holds the profile hook on 3.11 (and a monitoring tool id on 3.12): recording still sees
    every function, through the trace's tracebacks where it cannot hook the interpreter."""
    import cProfile

    m = user_module(BASE)
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        rec = recorded(m.top, X)
    finally:
        profiler.disable()
    assert rec._mode == ("traceback" if recorder_mode == "profile" else recorder_mode)
    assert mine(rec.closure.names(), m) == ["SCALE", "jnp", "leaf", "mid", "top"]


def test_without_usable_tracebacks_recording_hooks_the_interpreter(user_module, recorder_mode, monkeypatch):
    """The traceback mode rests on a jaxlib internal (`Traceback.raw_frames`); without it, sys.setprofile."""
    if recorder_mode != "traceback":
        pytest.skip("only the traceback mode falls back")
    from nitro_ipy import _closure

    monkeypatch.setattr(_closure._probes, "_tracebacks_usable", lambda: False)
    m = user_module(BASE)
    rec = recorded(m.top, X)
    assert rec._mode == "profile"
    assert mine(rec.closure.names(), m) == ["SCALE", "jnp", "leaf", "mid", "top"]


def test_reload_of_edited_helper_drifts(user_module):
    m = user_module(BASE)
    closure = lower(m.top, X)
    rewrite(m, BASE.replace("return x * SCALE", "return x * SCALE + 1.0"))
    assert closure.drift({}) == [f"{m.__name__}.leaf"]
    assert closure.disk_edits({}) == []


def test_disk_edit_not_loaded_yet(user_module):
    m = user_module(BASE)
    closure = lower(m.top, X)
    rewrite(m, BASE.replace("return x * SCALE", "return x * SCALE - 1.0"), reload=False)
    assert closure.drift({}) == []
    assert closure.disk_edits({}) == [f"{m.__name__}.leaf"]
    importlib.reload(m)
    assert closure.drift({}) == [f"{m.__name__}.leaf"]
    assert closure.disk_edits({}) == []


def test_comment_and_blank_line_edits_do_not_drift(user_module):
    m = user_module(BASE)
    closure = lower(m.top, X)
    edited = BASE.replace("def leaf(x):\n", "# a comment\n\n\ndef leaf(x):\n    # why\n\n")
    edited = edited.replace("return x * SCALE", "return x * SCALE  # trailing")
    rewrite(m, edited, reload=False)
    assert closure.disk_edits({}) == []
    importlib.reload(m)
    assert m.leaf.__code__.co_firstlineno != 6  # the line numbers did move
    assert closure.drift({}) == []
    assert closure.disk_edits({}) == []


def test_code_swap_in_place_drifts(user_module):
    # `%autoreload 2` patches `fn.__code__` in place: same function object, new code.
    m = user_module(BASE)
    closure = lower(m.top, X)
    leaf = m.leaf
    ns = {}
    exec("def leaf(x):\n    return x * 3.0\n", ns)
    m.leaf.__code__ = ns["leaf"].__code__
    assert m.leaf is leaf
    assert closure.drift({}) == [f"{m.__name__}.leaf"]


def test_global_constant_change_drifts(user_module):
    m = user_module(BASE)
    closure = lower(m.top, X)
    rewrite(m, BASE.replace("SCALE = 2.0", "SCALE = 3.0"))
    assert closure.drift({}) == [f"{m.__name__}.SCALE"]
    m.SCALE = 2.0
    assert closure.drift({}) == []


def test_unread_edits_and_identical_reload_do_not_drift(user_module):
    m = user_module(BASE)
    closure = lower(m.top, X)
    importlib.reload(m)
    assert closure.drift({}) == []
    rewrite(
        m, BASE.replace("def unused(x):\n    return x", "def unused(x):\n    return x + 1") + "\nOTHER = 5\n"
    )
    assert closure.drift({}) == []


MUTABLE = """
import functools
import numpy as np
import jax.numpy as jnp

CFG = {"scale": 2.0, "widths": [1.0, 2.0]}
TABLE = np.arange(3.0)
clip = functools.partial(jnp.clip, min=-1.0)

def make_offset():
    offset = 1.0
    def get():
        return offset
    def set(value):
        nonlocal offset
        offset = value
    return get, set

get_offset, set_offset = make_offset()

def scaled(x, k=2.0):
    return x * k

def top(x):
    y = scaled(x) * CFG["scale"] + CFG["widths"][0] + TABLE + get_offset()
    return clip(y)
"""


def test_in_place_mutations_drift(user_module):
    m = user_module(MUTABLE)
    closure = lower(m.top, X)
    name = m.__name__
    memo = {}
    assert closure.drift(memo) == []
    mutations = [
        ("CFG", lambda: m.CFG.__setitem__("scale", 3.0), lambda: m.CFG.__setitem__("scale", 2.0)),
        ("CFG", lambda: m.CFG["widths"].append(3.0), lambda: m.CFG["widths"].pop()),
        ("TABLE", lambda: m.TABLE.__setitem__(0, 7.0), lambda: m.TABLE.__setitem__(0, 0.0)),
        (
            "clip",
            lambda: m.clip.keywords.__setitem__("min", 0.0),
            lambda: m.clip.keywords.__setitem__("min", -1.0),
        ),
        ("get_offset", lambda: m.set_offset(5.0), lambda: m.set_offset(1.0)),
        (
            "scaled",
            lambda: setattr(m.scaled, "__defaults__", (3.0,)),
            lambda: setattr(m.scaled, "__defaults__", (2.0,)),
        ),
    ]
    for what, mutate, undo in mutations:
        mutate()
        assert closure.drift({}) == [f"{name}.{what}"], what
        undo()
        assert closure.drift({}) == [], what


def test_deleted_function_drifts(user_module):
    m = user_module(BASE)
    closure = lower(m.top, X)
    del m.leaf
    assert closure.drift({}) == [f"{m.__name__}.leaf"]


def test_untracked_value_is_listed(user_module):
    m = user_module(
        """
        import threading

        class Opaque:
            def __init__(self):
                self.lock = threading.Lock()  # no content fingerprint: the object has none either

        CONFIG = Opaque()

        def top(x):
            return x * 2.0 if CONFIG is not None else x
        """
    )
    closure = lower(m.top, X)
    assert closure.untracked == (f"{m.__name__}.CONFIG",)
    assert ValueDep(m.__name__, "CONFIG", None) in closure.values
    m.CONFIG.lock = None  # a mutation inside it is invisible by construction: that is what "untracked" says
    assert closure.drift({}) == []
    m.CONFIG = m.Opaque()  # but it is held to its identity: rebinding it is drift
    assert closure.drift({}) == [f"{m.__name__}.CONFIG"]
    del m.CONFIG
    assert closure.drift({}) == [f"{m.__name__}.CONFIG"]


INNER = """
import jax

SCALE = 2.0

class Calls:
    inner = 0
    ck = 0

def helper2(x):
    return x * SCALE

@jax.jit
def inner(x):
    Calls.inner += 1
    return helper2(x) + 1.0

def _ck(x):
    Calls.ck += 1
    return x * 3.0

ck = jax.checkpoint(_ck)

def outer(x):
    return inner(x) + ck(x)
"""


def test_jit_and_checkpoint_helpers_recorded_when_jax_skips_their_python(user_module):
    m = user_module(INNER)
    first = lower(m.outer, X)
    second = lower(m.outer, X)
    assert (m.Calls.inner, m.Calls.ck) == (1, 1)  # JAX served the inner traces from its cache
    want = ["_ck", "helper2", "inner", "outer"]
    for closure in (first, second):
        assert sorted(d.qualname for d in closure.functions if d.module == m.__name__) == want
    rewrite(m, INNER.replace("return x * SCALE", "return x * SCALE * SCALE"))
    assert second.drift({}) == [f"{m.__name__}.helper2"]


def test_closure_factory_value_drifts_via_its_global(user_module):
    m = user_module(
        """
        def make_loss(k):
            def loss(x):
                return x * k
            return loss

        loss_fn = make_loss(2.0)

        def top(x):
            return loss_fn(x)
        """
    )
    closure = lower(m.top, X)
    assert f"{m.__name__}.make_loss.<locals>.loss" in closure.names()
    assert f"{m.__name__}.make_loss.<locals>.loss.k" in closure.names()  # the cell, seen at call time
    m.loss_fn = m.make_loss(3.0)
    assert closure.drift({}) == [f"{m.__name__}.loss_fn"]
    m.loss_fn = m.make_loss(2.0)
    assert closure.drift({}) == []


def test_module_level_lambda_is_checked_through_its_holder(user_module):
    m = user_module(
        """
        act = lambda x: x + 1.0

        def top(x):
            return act(x)
        """
    )
    closure = lower(m.top, X)
    assert closure.anonymous == (f"{m.__name__}.<lambda>",)
    m.act = lambda x: x + 2.0
    assert closure.drift({}) == [f"{m.__name__}.act"]


DECORATED = """
import functools

def traced(fn):
    @functools.wraps(fn)
    def wrapper(x):
        return fn(x)
    return wrapper

def plain(fn):
    def inner(x):
        return fn(x)
    return inner

@traced
def helper(x):
    return x * 2.0

@plain
def other(x):
    return x + 1.0

def top(x):
    return helper(x) + other(x) + (lambda y: y * 0.5)(x)
"""


def test_decorated_helpers_drift_under_their_own_names(user_module):
    m = user_module(DECORATED)
    closure = lower(m.top, X)
    assert mine(closure.names(), m) == [
        "helper",
        "other",
        "plain.<locals>.inner",
        "plain.<locals>.inner.fn",  # closure cells of the wrappers (made at import, before the trace)
        "top",
        "top.<locals>.<lambda>",
        "traced.<locals>.wrapper",
        "traced.<locals>.wrapper.fn",
    ]
    assert mine(closure.anonymous, m) == ["other"]  # its name is bound to `inner`, held by global `other`
    importlib.reload(m)
    assert closure.drift({}) == []
    rewrite(m, DECORATED.replace("return x * 2.0", "return x * 4.0"))
    assert closure.drift({}) == [f"{m.__name__}.helper"]
    rewrite(m, DECORATED.replace("return x + 1.0", "return x + 3.0"))
    assert closure.drift({}) == [f"{m.__name__}.other"]


CLASSY = """
import jax.numpy as jnp

def leaf(x):
    return x * 2.0

class Net:
    width = 3

    def forward(self, x):
        return jnp.tanh(leaf(x)) * self.width
"""


def test_class_method_via_compile_view_and_reload(user_module):
    m = user_module(CLASSY)

    def program(m):
        view = CompileView(m.Net, {}, (), on_attr=note_class_attr)
        return lambda x: view.forward(x)

    closure = lower(program(m), X)
    name = m.__name__
    assert ClassAttrDep(name, "Net", "width", fingerprint(3)) in closure.values
    assert mine(closure.names(), m) == ["Net.forward", "Net.width", "jnp", "leaf"]
    importlib.reload(m)  # the class is re-created, identically
    assert closure.drift({}) == []
    rewrite(m, CLASSY.replace("* self.width", "* self.width + 1.0"))
    assert closure.drift({}) == [f"{name}.Net.forward"]
    rewrite(m, CLASSY.replace("width = 3", "width = 4"))
    assert closure.drift({}) == [f"{name}.Net.width"]


CELL_CLASS = """
import jax.numpy as jnp

def loss_term(x):
    return jnp.sin(x) * 2.0

class Net:
    def forward(self, x):
        return loss_term(x) + 1.0
"""


@pytest.mark.parametrize("via", ["view", "direct"])
def test_cells_run_in_a_module_without_a_file(monkeypatch, via):
    """Cells exec'd into a module of their own (no file; the benchmarks' notebook stand-in): the helper
    the hook calls is found through the hook's own globals, whether the hook is read through the compile
    view or called directly (as the programs call `forward` and `loss`), and redefining it drifts."""
    module = types.ModuleType("nitro_cl_cells")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    run = lambda src, k: exec(compile(src, f"<ipython-input-{k}-cells>", "exec"), module.__dict__)  # noqa: E731
    run(CELL_CLASS, 1)
    if via == "view":
        view = CompileView(module.Net, {}, (), on_attr=note_class_attr)
        closure = lower(lambda x: view.forward(x), X)
    else:
        forward = module.Net.forward
        closure = lower(lambda x: forward(None, x), X)
    assert mine(closure.names(), module) == ["Net.forward", "jnp", "loss_term"]
    run(CELL_CLASS.split("class Net")[0], 2)  # the same helper, re-run: nothing moved
    assert closure.drift({}) == []
    run("def loss_term(x):\n    return jnp.sin(x) * 3.0\n", 3)
    assert closure.drift({}) == ["nitro_cl_cells.loss_term"]


def test_nested_recorders_both_record(user_module):
    m = user_module(BASE)
    with record() as outer:
        with record() as inner:
            inner.traced(jax.jit(lambda x: m.top(x)).trace(X).jaxpr)
    assert (
        mine(outer.closure.names(), m)
        == mine(inner.closure.names(), m)
        == ["SCALE", "jnp", "leaf", "mid", "top"]
    )


def test_recorders_in_two_threads_stay_apart(user_module):
    a = user_module(BASE)
    b = user_module(BASE.replace("def top(x):", "def other_top(x):"))
    closures, barrier = {}, threading.Barrier(2)

    def work(m, fn):
        barrier.wait()
        for _ in range(3):
            closures[m.__name__] = lower(fn, X)

    threads = [
        threading.Thread(target=work, args=(a, a.top)),
        threading.Thread(target=work, args=(b, b.other_top)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert mine(closures[a.__name__].names(), a) == ["SCALE", "jnp", "leaf", "mid", "top"]
    assert mine(closures[a.__name__].names(), b) == []
    assert mine(closures[b.__name__].names(), b) == ["SCALE", "jnp", "leaf", "mid", "other_top"]
    assert mine(closures[b.__name__].names(), a) == []
    assert sys.getprofile() is None


def test_previous_profiler_is_restored_and_chained(user_module, recorder_mode):
    if recorder_mode != "profile":
        pytest.skip("only the sys.setprofile recorder touches sys.setprofile")
    m = user_module(BASE)
    seen = []

    def profiler(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "leaf":
            seen.append(1)

    sys.setprofile(profiler)
    try:
        closure = lower(m.top, X)
        assert sys.getprofile() is profiler
    finally:
        sys.setprofile(None)
    assert seen == [1]
    assert "leaf" in mine(closure.names(), m)


def test_shared_memo_resolves_each_dependency_once(user_module):
    m = user_module(BASE)
    closures = [lower(m.top, X) for _ in range(3)]
    memo = {}
    assert [c.drift(memo) for c in closures] == [[], [], []]
    size = len(memo)
    for c in closures:
        c.drift(memo)
    assert len(memo) == size


# ---------------------------------------------------------------------------------------------------------
# Real IPython cells


@pytest.fixture
def shell(monkeypatch):
    from IPython.core.interactiveshell import InteractiveShell

    # The shell installs its user module as sys.modules["__main__"]; give pytest's back afterwards.
    monkeypatch.setitem(sys.modules, "__main__", sys.modules["__main__"])
    sh = InteractiveShell.instance()
    yield sh
    for name in ("helper", "top", "Model"):
        sh.user_ns.pop(name, None)


def run(shell, cell: str):
    result = shell.run_cell(textwrap.dedent(cell), store_history=True)
    result.raise_error()


HELPER = """
import jax.numpy as jnp

def helper(x):
    return jnp.cos(x) * 2.0
"""


def test_ipython_cell_redefinition(shell):
    run(shell, HELPER)
    run(shell, "def top(x):\n    return helper(x) + 1.0\n")
    closure = lower(shell.user_ns["top"], X)
    funcs = [d for d in closure.functions if d.module == "__main__"]
    assert sorted(d.qualname for d in funcs) == ["helper", "top"]
    assert all(d.filename.startswith("<ipython-input-") and d.file_digest is None for d in funcs)
    assert closure.files() == {f for f in closure.files() if "ipython" not in f}
    run(shell, HELPER)  # re-running the identical cell
    assert closure.drift({}) == []
    run(shell, HELPER.replace("* 2.0", "* 3.0"))
    assert closure.drift({}) == ["__main__.helper"]
    run(shell, HELPER)
    assert closure.drift({}) == []
    run(shell, "del helper")
    assert closure.drift({}) == ["__main__.helper"]


def test_ipython_class_redefinition(shell):
    model = """
    class Model:
        def forward(self, x):
            return x * 2.0
    """
    run(shell, model)
    view = CompileView(shell.user_ns["Model"], {}, (), on_attr=note_class_attr)
    closure = lower(lambda x: view.forward(x), X)
    assert [n for n in closure.names() if n.startswith("__main__.Model")] == ["__main__.Model.forward"]
    run(shell, model)
    assert closure.drift({}) == []
    run(shell, model.replace("* 2.0", "* 5.0"))
    assert closure.drift({}) == ["__main__.Model.forward"]


# ---------------------------------------------------------------------------------------------------------
# The file watcher


def _wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_watcher_bumps_world_on_save_and_stops_cleanly(tmp_path):
    before_threads = set(threading.enumerate())
    path = tmp_path / "lib.py"
    path.write_text("A = 1\n")
    other = tmp_path / "notes.txt"
    try:
        _watch.watch([str(path)])
        assert _watch.watched() == {str(path.resolve())}
        time.sleep(0.1)  # let the observer arm
        w0 = _world.world()
        path.write_text("A = 2\n")
        assert _wait_for(lambda: _world.world() > w0)

        w1 = _world.world()
        other.write_text("not watched\n")
        time.sleep(0.3)
        assert _world.world() == w1

        # An editor that saves by writing a temporary file and renaming it over the original.
        tmp = tmp_path / ".lib.py.swp"
        tmp.write_text("A = 3\n")
        tmp.replace(path)
        assert _wait_for(lambda: _world.world() > w1)
    finally:
        _watch.stop()
    assert _watch.watched() == set()
    assert _wait_for(lambda: set(threading.enumerate()) <= before_threads, timeout=2)
    w2 = _world.world()
    path.write_text("A = 4\n")
    time.sleep(0.2)
    assert _world.world() == w2


def test_watcher_debounces_a_burst_into_one_bump():
    w0 = _world.world()
    for _ in range(20):  # what one save looks like to the handler: several events within milliseconds
        _watch._schedule_bump()
    assert _wait_for(lambda: _world.world() > w0)
    time.sleep(3 * _watch.DEBOUNCE_S)
    assert _world.world() == w0 + 1


MEMO_HOLDERS = """
import jax.numpy as jnp
import numpy as np

TABLE = np.arange(3.0)


class Scale:
    factor = 2.0

    def apply(self, x):
        return x * self.factor


def helper(x):
    return x + jnp.asarray(TABLE)


def top(x):
    return Scale().apply(helper(x))
"""


def _held_by_memos(user_ns: dict) -> set[int]:
    """Ids of every object nitro_ipy's process-wide state reaches: the registered memos and every
    module-level value of its modules that is state (not a function, class or module). Weak references are
    not followed, nor library modules' globals (a clear function's), but the user's own are."""
    import gc

    from nitro_ipy._base import _memo

    library = {id(vars(m)) for m in list(sys.modules.values()) if isinstance(getattr(m, "__dict__", None), dict)}
    library.discard(id(user_ns))
    state = [
        value
        for name, module in list(sys.modules.items())
        if name.startswith("nitro_ipy.")
        for value in list(vars(module).values())
        if not isinstance(value, (types.ModuleType, types.FunctionType, type))
    ]
    seen, stack = set(), [*_memo.memos(), *state]
    while stack and len(seen) < 500_000:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, types.ModuleType) or id(obj) in library:
            continue
        seen.add(id(obj))
        stack.extend(gc.get_referents(obj))
    return seen


def test_cache_reset_leaves_no_memo_holding_user_objects(user_module):
    """`cache_reset()` is the escape hatch: afterwards no memo of the closure code keeps the user's
    functions, classes, arrays or code alive."""
    import nitro_ipy

    m = user_module(MEMO_HOLDERS)
    closure = lower(m.top, X)
    assert mine(closure.names(), m) == ["Scale", "Scale.apply", "Scale.factor", "TABLE", "helper", "jnp", "top"]
    user = [m.helper, m.Scale, m.TABLE, m.helper.__code__, m.Scale.apply.__code__]
    assert id(m.helper.__code__) in _held_by_memos(vars(m))  # the walk does see what a memo holds
    nitro_ipy.cache_reset()
    held = _held_by_memos(vars(m))
    assert [obj for obj in user if id(obj) in held] == []
