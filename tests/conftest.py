import os
import warnings

# The program store is off in tests (and in the kernels and child processes they start, which inherit
# this): no test writes to the real per-user cache, and no test loads what another one compiled. The
# store's own tests turn it on in a temporary directory (`tests/test_store.py`).
os.environ["NITRO_IPY_CACHE_DIR"] = ""

import pytest

import nitro_ipy


@pytest.fixture(autouse=True)
def _fresh_cache():
    """Every test starts from an empty compile cache and fails on any of our own warnings."""
    nitro_ipy.cache_reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", nitro_ipy.NitroWarning)
        yield
    nitro_ipy.cache_reset()
