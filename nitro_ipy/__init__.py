"""nitro_ipy: live-edit JAX training in Jupyter, compiled once and never silently stale.

`import nitro_ipy` never imports IPython or ipywidgets; `%load_ext nitro_ipy` wires the notebook side.
"""

from . import loggers as loggers  # the public `nitro_ipy.loggers` subpackage
from ._adopt import set_honest_jit as set_honest_jit
from ._base._errors import GraphConstHashError as GraphConstHashError
from ._base._errors import HandleBusyError as HandleBusyError
from ._base._errors import HookInputError as HookInputError
from ._base._errors import HostFieldAccessError as HostFieldAccessError
from ._base._errors import NitroError as NitroError
from ._base._errors import NitroTypeError as NitroTypeError
from ._base._errors import NitroValueError as NitroValueError
from ._base._errors import NitroWarning as NitroWarning
from ._base._errors import NonFiniteLossError as NonFiniteLossError
from ._base._fingerprint import Unfingerprintable as Unfingerprintable
from ._base._fingerprint import fingerprint as fingerprint
from ._base._world import world as world
from ._compiler._cache import CacheStats as CacheStats
from ._compiler._cache import cache_reset as cache_reset
from ._compiler._cache import cache_stats as cache_stats
from ._compiler._guards import CompileGuardError as CompileGuardError
from ._compiler._guards import assert_max_compiles as assert_max_compiles
from ._compiler._guards import no_compiles as no_compiles
from ._compiler._jit import jit as jit
from ._compiler._reuse import set_trace_reuse as set_trace_reuse
from ._compiler._store import cache_dir as cache_dir
from ._compiler._store import set_cache_dir as set_cache_dir
from ._experiment._fields import Device as Device
from ._experiment._fields import GraphConst as GraphConst
from ._experiment._fields import Host as Host
from ._experiment._fields import (
    assert_graphconst_hashable as assert_graphconst_hashable,
)
from ._experiment._fields import compile_view as compile_view
from ._experiment._fields import device_fields as device_fields
from ._experiment._fields import graphconst_field_hash as graphconst_field_hash
from ._experiment._fields import graphconst_fields as graphconst_fields
from ._experiment._fields import host_fields as host_fields
from ._experiment._hooks import metrics as metrics
from ._training._ahead import bump_world as bump_world
from ._training._ahead import set_compile_ahead as set_compile_ahead
from ._training._handle import Nitro as Nitro
from ._training._handle import evaluate as evaluate
from ._training._handle import predict as predict
from ._training._handle import train as train
from ._training._handle import validate as validate
from ._training._runs import History as History
from ._training._runs import Run as Run
from ._training._runs import TrainingInterrupted as TrainingInterrupted

__version__ = "0.1.0"

__all__ = [
    "CacheStats",
    "CompileGuardError",
    "Device",
    "GraphConst",
    "GraphConstHashError",
    "HandleBusyError",
    "History",
    "HookInputError",
    "Host",
    "HostFieldAccessError",
    "Nitro",
    "NitroError",
    "NitroTypeError",
    "NitroValueError",
    "NitroWarning",
    "NonFiniteLossError",
    "Run",
    "TrainingInterrupted",
    "Unfingerprintable",
    "assert_graphconst_hashable",
    "assert_max_compiles",
    "bump_world",
    "cache_dir",
    "cache_reset",
    "cache_stats",
    "compile_view",
    "device_fields",
    "evaluate",
    "fingerprint",
    "graphconst_field_hash",
    "graphconst_fields",
    "host_fields",
    "jit",
    "loggers",
    "metrics",
    "no_compiles",
    "predict",
    "set_cache_dir",
    "set_compile_ahead",
    "set_honest_jit",
    "set_trace_reuse",
    "train",
    "validate",
    "world",
]


def load_ipython_extension(ip):
    """`%load_ext nitro_ipy`: the cell callbacks, the magics, the file watcher and the rich messages."""
    from ._notebook._extension import load

    load(ip)


def unload_ipython_extension(ip):
    """`%unload_ext nitro_ipy`: removes every cell callback and the magics, and stops the file watcher."""
    from ._notebook._extension import unload

    unload(ip)
