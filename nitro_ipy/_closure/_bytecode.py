"""The globals a code object reads, from its bytecode."""

from __future__ import annotations

import dis
import types
from typing import NamedTuple

from .._base._memo import Memo
from ._resolve import nested


class Reads(NamedTuple):
    names: tuple  # global names loaded (LOAD_GLOBAL / LOAD_NAME), nested code included
    attrs: tuple  # (global name, attribute) pairs: `mod.attr` where `mod` is a global
    self_attrs: tuple  # attributes read from the first argument (`self.attr`), this code only


# id(code) -> (code, Reads); the code is held so the id stays its own.
_reads_memo = Memo("globals read by code objects")
_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
_ATTR_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
# Loads of one local, and (3.13+) the superinstructions loading two, whose second is on top of the stack.
_LOCAL_LOADS = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW"})
_LOCAL_PAIR_LOADS = frozenset({"LOAD_FAST_LOAD_FAST", "LOAD_FAST_BORROW_LOAD_FAST_BORROW"})


def _loads_local(ins, name) -> bool:
    """`ins` leaves local `name` on top of the stack (so a following LOAD_ATTR reads `name.attr`)."""
    if ins.opname in _LOCAL_LOADS:
        return ins.argval == name
    return ins.opname in _LOCAL_PAIR_LOADS and isinstance(ins.argval, tuple) and ins.argval[-1] == name


def reads(code: types.CodeType) -> Reads:
    """Global names `code` (and the code nested in it) loads; memoized per code object."""
    hit = _reads_memo.get(id(code))
    if hit is not None and hit[0] is code:
        return hit[1]
    names, attrs, self_attrs = {}, {}, {}
    first = code.co_varnames[0] if code.co_argcount and code.co_varnames else None
    for c in (code, *nested(code)):
        previous = None
        on_self = False  # the previous instruction loaded `code`'s first argument (`self`)
        for ins in dis.get_instructions(c):
            if on_self and ins.opname in _ATTR_LOADS:
                self_attrs[ins.argval] = None
            on_self = c is code and first is not None and _loads_local(ins, first)
            if ins.opname in _GLOBAL_LOADS:
                names[ins.argval] = None
                previous = ins.argval
                continue
            if previous is not None and ins.opname in _ATTR_LOADS:
                attrs[(previous, ins.argval)] = None
            previous = None
    found = Reads(tuple(names), tuple(attrs), tuple(self_attrs))
    _reads_memo[id(code)] = (code, found)
    return found

