"""The exception and warning hierarchy: every error nitro_ipy raises derives from `NitroError`."""


class NitroError(Exception):
    """Base class of every error nitro_ipy raises."""


class NitroTypeError(NitroError, TypeError):
    """A value of the wrong kind: a bad experiment class, marker, field value or hook."""


class GraphConstHashError(NitroTypeError):
    """A `GraphConst` value that does not fingerprint by content (it would hash by identity)."""


class HostFieldAccessError(NitroError, AttributeError):
    """Traced code read a `Host` field, which compiled code never sees."""


class NitroValueError(NitroError, ValueError):
    """A value of the right kind but wrong content: data shapes, batch fields, schedules."""


class NonFiniteLossError(NitroError, FloatingPointError):
    """The training loss became NaN or infinite."""


class HookInputError(NitroTypeError, ValueError):
    """A hook failed on the batch it was given (wrong shapes or kinds), re-explained in the user's words
    (`_experiment._inputs`). Both a `TypeError` and a `ValueError`, as the errors it explains were.
    `frames`: the user's frames of the original traceback, which IPython shows instead of the whole."""

    def __init__(self, text: str, frames=()):
        super().__init__(text)
        self.frames = list(frames)

    def _render_traceback_(self):
        import traceback

        head = ["Traceback (the hook's own frames):"] if self.frames else []
        shown = "".join(traceback.format_list(self.frames)).rstrip("\n").splitlines() if self.frames else []
        return head + shown + [f"{type(self).__name__}: {self}"]


class NitroWarning(UserWarning):
    """Base class of every warning nitro_ipy emits."""


class HandleBusyError(NitroError, RuntimeError):
    """An entry point was called on a handle that is training in the background."""


def library_hint(err: BaseException) -> str | None:
    """What to do about an error a library raised inside a hook's trace, where nitro_ipy knows the usual
    cause (said as a note under the library's own message), or None."""
    kind, text = type(err), str(err)
    if kind.__name__ == "TraceContextError" and kind.__module__.startswith("flax") and "Cannot mutate" in text:
        return ("nitro_ipy: `forward` updates an NNX module under `jax.grad`; rebuild the module inside the "
                "hook with `nnx.merge(graphdef, params, state, copy=True)` (docs/models.md, Flax NNX).")
    return None
