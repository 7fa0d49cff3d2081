"""Process-wide memos, in one registry: each is bounded (or keyed weakly), and `cache_reset()` clears
every one, so no memo outlives the escape hatch holding user objects."""

_registry: list = []


class Memo(dict):
    """A dict memo bounded at `maxsize` entries (the oldest goes first), registered for `clear_all`.

    Reads are plain `dict.get`, so a memo costs nothing on the hot path; only an insertion past the
    bound pays for the eviction."""

    __slots__ = ("name", "maxsize")

    def __init__(self, name: str, maxsize: int = 4096):
        super().__init__()
        self.name, self.maxsize = name, maxsize
        _registry.append(self)

    def __setitem__(self, key, value):
        if len(self) >= self.maxsize and key not in self:
            del self[next(iter(self))]
        super().__setitem__(key, value)


def register(clear) -> None:
    """Register `clear()` for a memo that is not a `Memo` (a `functools.cache`, an index object)."""
    _registry.append(clear)


def memos() -> list:
    """Every registered memo (a `Memo`, or the clear function registered for another kind)."""
    return list(_registry)


def clear_all() -> None:
    for memo in _registry:
        memo.clear() if isinstance(memo, Memo) else memo()
