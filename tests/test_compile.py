"""How a program is compiled: what the compile says about a program that bakes in a large constant, and
how big a slow program is."""

import dataclasses
import sys
import types

import jax.numpy as jnp
import numpy as np

import nitro_ipy
from nitro_ipy import GraphConst, Nitro
from nitro_ipy._compiler import _compile
from nitro_ipy._base import _report
from nitro_ipy._compiler._cache import Entry, Key


def _module(name, **values):
    module = types.ModuleType(name)
    module.__dict__.update(values)
    sys.modules[name] = module
    return module


def _key():
    return Key("predict", "owner", (), ("t", ()), "gc", ())


def test_a_large_global_array_baked_into_a_program_is_said_with_its_size_and_name(capsys, tmp_path):
    source = (
        "import jax.numpy as jnp, numpy as np\n"
        "TABLE = np.ones((1024, 512), np.float32)\n"
        "SMALL = np.ones(8, np.float32)\n"
        "def forward(x):\n"
        "    return x @ TABLE + SMALL.sum()\n"
    )
    (tmp_path / "nitro_big_const.py").write_text(source)
    sys.path.insert(0, str(tmp_path))
    try:
        import nitro_big_const as mod

        entry = _compile.compile_program(_key(), mod.forward, (np.ones((2, 1024), np.float32),),
                                         record=__import__("nitro_ipy._closure", fromlist=["record"]).record)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("nitro_big_const", None)
    assert entry.constants == ((2 * 1024 * 1024, (1024, 512), "float32", "`nitro_big_const.TABLE`"),)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == (
        "nitro_ipy: the `predict` program bakes in a 2.0 MiB constant float32[1024, 512] "
        "(from `nitro_big_const.TABLE`): it is copied into the program at every compile and kept alive with "
        "it. Pass it as data (a batch field of a split) or as a `Device` field, so compiled code receives "
        "it as an input."
    )


def test_a_transposed_or_device_copy_of_a_global_is_still_traced_to_it():
    table = np.arange(2 * 1024 * 256, dtype=np.float32).reshape(1024, 512)
    _module("nitro_const_src", TABLE=table, DATA={"x": jnp.asarray(table)})
    closure = types.SimpleNamespace(values=(types.SimpleNamespace(module="nitro_const_src", name="TABLE",
                                                                  qualified="nitro_const_src.TABLE"),
                                            types.SimpleNamespace(module="nitro_const_src", name="DATA",
                                                                  qualified="nitro_const_src.DATA")))
    try:
        jaxpr = __import__("jax").jit(lambda x: x @ table.T).trace(np.ones((2, 512), np.float32)).jaxpr
        assert _compile.large_constants(jaxpr, closure) == ((2 << 20, (512, 1024), "float32", "`nitro_const_src.TABLE`"),)
        device = sys.modules["nitro_const_src"].DATA["x"]
        jaxpr = __import__("jax").jit(lambda x: x + device).trace(np.ones((1024, 512), np.float32)).jaxpr
        assert _compile.large_constants(jaxpr, closure) == ((2 << 20, (1024, 512), "float32", "`nitro_const_src.DATA['x']`"),)
        # a constant of unknown origin is still said, without a name; a small one is not
        jaxpr = __import__("jax").jit(lambda x: x + np.full((1024, 512), 3.0, np.float32)).trace(np.ones((1024, 512), np.float32)).jaxpr
        assert _compile.large_constants(jaxpr, closure) == ((2 << 20, (1024, 512), "float32", None),)
        jaxpr = __import__("jax").jit(lambda x: x + np.ones(8, np.float32)).trace(np.ones(8, np.float32)).jaxpr
        assert _compile.large_constants(jaxpr, closure) == ()
    finally:
        sys.modules.pop("nitro_const_src", None)


@dataclasses.dataclass
class Tiny:
    hidden: GraphConst[int] = 4

    def init(self, rng):
        return {"w": jnp.zeros((3, self.hidden))}

    def forward(self, params, *, x):
        return x @ params["w"]

    def loss(self, outputs, *, y):
        return jnp.mean((outputs.sum(-1) - y) ** 2)


def test_a_handle_without_large_constants_says_nothing_about_them(capsys):
    data = {"train": {"x": np.ones((8, 3), np.float32), "y": np.zeros(8, np.float32)}}
    Nitro(Tiny(), data=data, batch_size=4, progress=False).train()
    out = capsys.readouterr().out
    assert "bakes in" not in out
    assert all(e.constants == () and e.operations > 0 for e in nitro_ipy._compiler._cache.live_entries())


def test_a_slow_compile_says_how_many_operations_its_program_has():
    fast = Entry(_key(), None, 0.1, 0.2, operations=1234)
    slow = Entry(_key(), None, 0.5, _report.SLOW_COMPILE_S, operations=12345)
    assert _report.message("compile", entry=fast).text == (
        "nitro_ipy: compiled predict [] in 0.30 s (trace 0.10 s, XLA 0.20 s)")
    assert _report.message("compile", entry=slow).text == (
        "nitro_ipy: compiled predict [] in 2.50 s (trace 0.50 s, XLA 2.00 s, 12,345 operations)")


@dataclasses.dataclass
class WithTable:
    table: GraphConst[object] = None

    def init(self, rng):
        return {"w": jnp.ones((3,))}

    def forward(self, params, *, x):
        return x @ self.table.T + params["w"].sum()


def test_a_large_graphconst_array_is_named_by_its_field(capsys):
    table = np.ones((512, 1024), np.float32)  # a NumPy array: the trace copies it, found by content
    Nitro(WithTable(table), batch_size=4, progress=False).predict({"x": np.ones((4, 1024), np.float32)})
    out = capsys.readouterr().out
    assert "bakes in a 2.0 MiB constant float32[1024, 512] (from GraphConst field `table`)" in out, out


def test_no_automatic_garbage_collection_interrupts_a_trace_and_its_setting_comes_back():
    """A full collection of a notebook's heap takes 100-140 ms and, left automatic, lands inside about
    every other large trace. Tracing and lowering run with it paused (any thread), then it is as before."""
    import gc
    import threading

    seen = []

    def loss(x):
        seen.append(gc.isenabled())
        return jnp.sum(x ** 2)

    key = Key("probe", "t", (), ("x",), "", ())
    assert gc.isenabled()
    _compile._build(key, loss, (np.ones(3, np.float32),), (), None, None, None, None)
    assert seen == [False] and gc.isenabled()
    # overlapping pauses in two threads: on again only when the last one ends
    inner_done, outer_may_end = threading.Event(), threading.Event()

    def other():
        with _compile.gc_paused():
            inner_done.set()
            outer_may_end.wait(10)

    t = threading.Thread(target=other)
    with _compile.gc_paused():
        t.start()
        assert inner_done.wait(10)
    assert not gc.isenabled()  # the other thread still traces
    outer_may_end.set()
    t.join(10)
    assert gc.isenabled()
    # a process that turned it off keeps it off
    gc.disable()
    try:
        _compile._build(key, loss, (np.ones(4, np.float32),), (), None, None, None, None)
        assert not gc.isenabled()
    finally:
        gc.enable()
