"""The cache under threads: a key is compiled once however many threads need it (single flight), the
counters stay consistent, and two handles training at once give the sequential results."""

import threading

import jax
import numpy as np
import pytest

import nitro_ipy
from nitro_ipy import Nitro
from nitro_ipy._compiler import _cache, _compile


from test_cache import Reg, _split  # the cache tests' experiment: a tiny regression

DATA = {"train": _split(128), "valid": _split(40, 1)}


def _run(seed, out, barrier=None):
    n = Nitro(Reg(), data=DATA, batch_size=32, max_epochs=2, seed=seed, progress=False)
    if barrier is not None:
        barrier.wait()
    out[seed] = (n.train(), jax.device_get(n.params))


def test_two_handles_training_in_two_threads_compile_each_program_once(capsys):
    sequential = {}
    for seed in (0, 1):
        _run(seed, sequential)
    nitro_ipy.cache_reset()
    capsys.readouterr()

    threaded, barrier = {}, threading.Barrier(2)
    threads = [threading.Thread(target=_run, args=(seed, threaded, barrier)) for seed in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = nitro_ipy.cache_stats()
    assert stats.misses == stats.entries == 3  # grad, opt, eval: each compiled by one thread only
    # 2 handles x 2 epochs x 4 steps x 2 programs, plus 2 x 2 validations x 2 batches, minus the 3 misses
    assert stats.hits == 2 * 2 * 4 * 2 + 2 * 2 * 2 - 3
    compiled = [line for line in capsys.readouterr().out.splitlines() if line.startswith("nitro_ipy: compiled")]
    assert len(compiled) == 3
    for seed in (0, 1):
        assert threaded[seed][0] == sequential[seed][0]
        for a, b in zip(jax.tree.leaves(threaded[seed][1]), jax.tree.leaves(sequential[seed][1])):
            np.testing.assert_array_equal(a, b)


def _key(name="k"):
    return _cache.Key(name, "owner", (), _cache.arg_signature((np.zeros(3, np.float32),)), "gc", ())


def test_a_thread_that_needs_a_key_being_compiled_waits_for_it_and_counts_a_hit():
    started, go = threading.Event(), threading.Event()

    def slow(x):
        started.set()
        go.wait(5)
        return x * 2

    results = {}
    first = threading.Thread(target=lambda: results.setdefault("a", _compile.compile_program(_key(), slow, (np.ones(3, np.float32),))))
    first.start()
    assert started.wait(5)
    second = threading.Thread(target=lambda: results.setdefault("b", _compile.compile_program(_key(), slow, (np.ones(3, np.float32),))))
    second.start()
    second.join(0.2)
    assert second.is_alive()  # waiting for the first thread's compile, not compiling its own
    go.set()
    first.join(5)
    second.join(5)
    assert results["a"] is results["b"]
    assert nitro_ipy.cache_stats() == (1, 1, 1)


def test_a_compile_that_raises_releases_its_key_and_the_waiter_sees_the_same_error():
    started, go = threading.Event(), threading.Event()

    def broken(x):
        started.set()
        go.wait(5)
        raise ValueError("bad hook")

    errors = []

    def compile_():
        try:
            _compile.compile_program(_key(), broken, (np.ones(3, np.float32),))
        except ValueError as err:
            errors.append(str(err))

    threads = [threading.Thread(target=compile_) for _ in range(2)]
    threads[0].start()
    assert started.wait(5)
    threads[1].start()
    go.set()
    for t in threads:
        t.join(5)
    assert errors == ["bad hook", "bad hook"]
    assert nitro_ipy.cache_stats() == (0, 0, 0)
    with pytest.raises(ValueError):  # nothing left claimed: the next attempt compiles (and fails) again
        go.set()
        _compile.compile_program(_key(), broken, (np.ones(3, np.float32),))
