import warnings

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
