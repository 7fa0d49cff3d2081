import os
import warnings

# The suite pins today's behaviour, compiling only on demand (`NITRO_IPY_AHEAD=0`, inherited by the
# kernels and subprocesses tests start): it is what turning compile ahead off must restore. Compile
# ahead itself, on by default for users, is tested in test_ahead.py, which turns it on.
os.environ["NITRO_IPY_AHEAD"] = "0"
# The program store is off in tests (and in the kernels and child processes they start, which inherit
# this): no test writes to the real per-user cache, and no test loads what another one compiled. The
# store's own tests turn it on in a temporary directory (`tests/test_store.py`).
os.environ["NITRO_IPY_CACHE_DIR"] = ""

import pytest

import nitro_ipy
from nitro_ipy import _ahead, _reuse


@pytest.fixture(autouse=True)
def _fresh_cache():
    """Every test starts from an empty compile cache and fails on any of our own warnings."""
    nitro_ipy.cache_reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", nitro_ipy.NitroWarning)
        yield
    nitro_ipy.cache_reset()
    _ahead.wait(60)  # a compile ahead still in flight never spills into the next test's counts
    _reuse.wait(60)  # nor a trace-reuse warming (it is idle work: it runs after the test's last step)
