"""Dependency closures: what a compiled program's trace ran and read, and whether any of it has moved.

The design notes are in `README.md` beside this file.
"""

from ._model import Closure as Closure
from ._persist import closure_from_records as closure_from_records
from ._persist import closure_records as closure_records
from ._persist import live_module_namespace as live_module_namespace
from ._recorder import Recorder as Recorder
from ._recorder import note_class_attr as note_class_attr
from ._recorder import note_field_read as note_field_read
from ._recorder import record as record
from ._recorder import record_hooks as record_hooks
from ._recorder import replay as replay
from ._records import CellDep as CellDep
from ._records import ClassAttrDep as ClassAttrDep
from ._records import FuncDep as FuncDep
from ._records import ValueDep as ValueDep

# benchmarks/bench_staleness.py times each kind of check on its own, telling the value checks apart by it.
from ._scan import check_value as check_value
from ._where import describe_edit as describe_edit

__all__ = [
    "CellDep",
    "ClassAttrDep",
    "Closure",
    "FuncDep",
    "Recorder",
    "ValueDep",
    "check_value",
    "closure_from_records",
    "describe_edit",
    "closure_records",
    "live_module_namespace",
    "note_class_attr",
    "note_field_read",
    "record",
    "record_hooks",
    "replay",
]
