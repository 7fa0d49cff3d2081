"""The globals a code object reads, from its bytecode."""

from __future__ import annotations

import dis
import types
from typing import NamedTuple

from .._memo import Memo
from ._resolve import nested


class Reads(NamedTuple):
    names: tuple  # global names loaded (LOAD_GLOBAL / LOAD_NAME), nested code included
    attrs: tuple  # (global name, attribute) pairs: `mod.attr` where `mod` is a global


# id(code) -> (code, Reads); the code is held so the id stays its own.
_reads_memo = Memo("globals read by code objects")
_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
_ATTR_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})


def reads(code: types.CodeType) -> Reads:
    """Global names `code` (and the code nested in it) loads; memoized per code object."""
    hit = _reads_memo.get(id(code))
    if hit is not None and hit[0] is code:
        return hit[1]
    names, attrs = {}, {}
    for c in (code, *nested(code)):
        previous = None
        for ins in dis.get_instructions(c):
            if ins.opname in _GLOBAL_LOADS:
                names[ins.argval] = None
                previous = ins.argval
                continue
            if previous is not None and ins.opname in _ATTR_LOADS:
                attrs[(previous, ins.argval)] = None
            previous = None
    found = Reads(tuple(names), tuple(attrs))
    _reads_memo[id(code)] = (code, found)
    return found
