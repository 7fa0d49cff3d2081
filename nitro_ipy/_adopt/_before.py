"""Functions jitted before the switch went on: JAX's own objects over the user's code, which no edit can
reach. The extension names them once, at load, so the user knows which cells to re-run."""

from __future__ import annotations

from ._switch import user_function


def jitted_before(namespace: dict) -> list[str]:
    """The names in `namespace` bound to a `jax.jit`, `equinox.filter_jit` or `flax.nnx.jit` function of
    the user's code whose inner jit is JAX's own (made before `set_honest_jit(True)`), in order."""
    names = []
    for name, value in list(namespace.items()):
        if name.startswith("_"):
            continue
        try:
            wrapped = _unchecked(value)
        except Exception:  # noqa: BLE001 - a user object whose attributes raise is nothing of ours
            wrapped = None
        if wrapped is not None and user_function(wrapped) is not None:
            names.append(name)
    return names


def _unchecked(value):
    """What `value` jits, when it is a jitted function whose inner jit is JAX's `PjitFunction`."""
    kind = type(value)
    module = kind.__module__ or ""
    if kind.__name__ == "PjitFunction":
        return value.__wrapped__
    if module.startswith("equinox") and kind.__name__ == "_JitWrapper":  # `eqx.filter_jit`
        inner = getattr(value, "_cached", None)
        return value.__wrapped__ if type(inner).__name__ == "PjitFunction" else None
    if module.startswith("flax") and hasattr(value, "jitted_fn") and hasattr(value, "fun"):  # `nnx.jit`
        return value.fun if type(value.jitted_fn).__name__ == "PjitFunction" else None
    return None
