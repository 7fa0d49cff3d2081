import gc
import os
import warnings

# The suite runs as users run: compile ahead at its default (on), in this process and in the kernels and
# subprocesses tests start. A `NITRO_IPY_AHEAD` set outside is not the suite's to keep: the off switch is
# tested where it is the subject (test_ahead.py), and counts are waited for (`_ahead.wait`) where
# background work may still be running.
os.environ.pop("NITRO_IPY_AHEAD", None)
# The program store is off in tests (and in the kernels and child processes they start, which inherit
# this): no test writes to the real per-user cache, and no test loads what another one compiled. The
# store's own tests turn it on in a temporary directory (`tests/test_store.py`).
os.environ["NITRO_IPY_CACHE_DIR"] = ""

import signal

import pytest

import nitro_ipy
from nitro_ipy._training import _ahead, _runs
from nitro_ipy._compiler import _reuse


# Tests press Ctrl-C with real SIGINTs and check the handler the handle puts back: they want what a
# terminal's or a kernel's Python has. A process a shell starts in the background without job control (a
# CI lane, `cmd &`) inherits SIGINT ignored, which Python then leaves alone.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# What does not depend on the Python minor version runs once per CI run, on its first Python:
# `tools/ci_tests.py` sets NITRO_IPY_CI_ONCE=0 on the others. What a browser shows and what an export
# renders (the kernel code they drive is tested on every Python by test_kernel, test_notebook and
# test_runs_kernel); meshes, processes and checkpoints (JAX, XLA and orbax, not the interpreter); the
# Jupyter server's save hook; Flax and Equinox models (the libraries' state, rng and trees; their class
# edits through compile ahead stay in test_ahead); the pages' code blocks and the digits notebook
# (whole-product runs of what the per-feature tests check on every Python). The recorder, fingerprints,
# closures, staleness, trace reuse, the program store and everything else run on each.
ONCE_PER_CI = ("test_browser.py", "test_export.py", "test_sharding.py", "test_checkpoint.py", "test_savehook.py",
               "test_models.py", "test_docs.py", "test_digits_notebook.py", "test_tracking.py")
# What depends on JAX's release but not on the interpreter's runs once per JAX release, on the first Python
# that gets it (`tools/ci_tests.py` sets NITRO_IPY_CI_JAX_ONCE=0 on the others: 3.13 gets 3.12's JAX, and
# records closures the same way). The data pipeline, parameter groups, guards, state patterns, steps per
# execution, configuration keys, the program store and its trust, the cache's keys and counts, the
# handle's API, sweeps, reports, real kernels, faults and full disks, JAX's own jit tests, the benchmarks'
# code paths: what they build on (the recorder, fingerprints, closures, staleness, trace reuse, compile
# ahead, threads, the extension's cell hooks, `nitro_ipy.jit`, the user-facing errors) runs on each.
ONCE_PER_JAX = ("test_data.py", "test_groups.py", "test_guard.py", "test_guards.py", "test_state_patterns.py",
                "test_steps.py", "test_config.py", "test_store.py", "test_store_trust.py", "test_cache.py",
                "test_handle.py", "test_sweep.py", "test_report.py", "test_kernel.py", "test_notebook.py",
                "test_restart_kernel.py", "test_runs_kernel.py", "test_faults.py", "test_disk_faults.py",
                "test_jit_api.py", "test_benchmarks.py")


def pytest_collection_modifyitems(config, items):
    skips = []
    if os.environ.get("NITRO_IPY_CI_ONCE") == "0":
        skips.append((ONCE_PER_CI, "independent of the Python version: run once per CI run, on its first Python"))
    if os.environ.get("NITRO_IPY_CI_JAX_ONCE") == "0":
        skips.append((ONCE_PER_JAX, "independent of the interpreter: run once per JAX release, on the first "
                                    "Python that gets it"))
    for names, reason in skips:
        for item in items:
            if item.path.name in names:
                item.add_marker(pytest.mark.skip(reason=reason))


def tol(rtol: float = 1e-5, atol: float = 1e-6) -> dict:
    """`rtol`/`atol` to compare float32 results at: exactly as given on the CPU. On a GPU (or TPU) a
    float32 matrix multiply runs at the backend's default precision (TF32 on NVIDIA: a 10-bit mantissa,
    about 1e-3 relative per product), so results that differ only in how they were batched or placed
    agree to about 1e-3 there: `1e-2` relative, `1e-3` absolute."""
    import jax

    if jax.default_backend() == "cpu":
        return {"rtol": rtol, "atol": atol}
    return {"rtol": max(rtol, 1e-2), "atol": max(atol, 1e-3)}


def rel(rel: float = 1e-5) -> float:
    """`pytest.approx`'s `rel` by backend (`tol`)."""
    return tol(rel)["rtol"]


# A test of XLA:CPU's own options (emitters, YNNPACK, optimization level): other backends do not take them.
cpu_only = pytest.mark.skipif("__import__('jax').default_backend() != 'cpu'",
                              reason="checks XLA:CPU compiler options, which other backends do not use")


@pytest.fixture(autouse=True)
def _fresh_cache():
    """Every test starts from an empty compile cache and fails on any of our own warnings."""
    nitro_ipy.cache_reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", nitro_ipy.NitroWarning)
        yield
    # A background run a test left training (it failed before its `run.stop()`) is stopped here: left
    # running, its step loop holds every later compile ahead and `_reuse.wait` back, and the suite hangs.
    _runs.stop_live_runs("the test ended")
    nitro_ipy.cache_reset()
    _ahead.wait(60)  # a compile ahead still in flight never spills into the next test's counts
    _reuse.wait(60)  # nor a trace-reuse warming (it is idle work: it runs after the test's last step)
    # Nor this test's handles: one left in a reference cycle holds its programs, which the next test's
    # drift scans would check (and list as poisoned) as a live handle's from before its `cache_reset()`.
    # Automatic collection is paused while any thread traces, which compile ahead makes frequent.
    gc.collect()
