"""Zero-change honesty: `jax.jit`, `equinox.filter_jit` and `flax.nnx.jit` applied to the user's own
functions become `nitro_ipy.jit`, with no change to the user's code (`set_honest_jit`, on with the
extension), and the functions jitted before it was on are found (`jitted_before`).

May import `_base`, `_closure` and `_compiler`. Imported by the package root and `_notebook`.
"""

from ._before import jitted_before as jitted_before
from ._switch import honest_jit_enabled as honest_jit_enabled
from ._switch import set_honest_jit as set_honest_jit
from ._switch import user_function as user_function

__all__ = ["honest_jit_enabled", "jitted_before", "set_honest_jit", "user_function"]
