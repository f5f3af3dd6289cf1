"""kvnumba: a batched-sequence KV cache for LLM serving, with Numba CUDA kernels.

Many sequences share one cache, each holding pages of every layer's page pool.
`BatchedSequenceCache` offers the BatchControl face (contract §7); every slot's
lifecycle is validated through the machines declared in `statemachines`. The code
cites the sections of the contract, docs/contract.md, as "contract §n".
"""
import os as _os

# `statemachines/` and `bench/` are installed inside kvnumba (pyproject's package-dir); in
# a source checkout they sit beside kvnumba/, where kvnumba.statemachines and kvnumba.bench
# are found through this package's path
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "statemachines")) and \
        _os.path.isfile(_os.path.join(_checkout, "statemachines", "__init__.py")):
    __path__.append(_checkout)

from . import device  # noqa: E402  (first: chooses GPU or simulator before numba.cuda)
from .device import DeviceError, torch_stream
from .batched import BatchedSequenceCache
from .config import CacheConfig, LayerSpec, flat, ring
from .driver import run_inputs, run_step
from .errors import (CacheFullError, CapacityError, CloneRefusedError, ConfigError,
                     FreeSequenceError, KVCacheError, OwnerRunError, PositionError,
                     RankDivergenceError, RingFloorError, SessionError, ShapeError,
                     SlotStateError, StepProtocolError, UnknownSequenceError)
from .page_accounting import PoolPages
from .plan import Segment
from .protocol import BatchControl, StepData
from .prefix_keys import page_keys
from .queries import IndexCounts, PageDemand
from .scales import fp8_scales
from .sessions import PackedStep, PrefixStats, SessionId, SessionTable
from .sequence_control import SequenceBatchControl
from .single import SequenceCache
from .slots import SlotState, StepState
from .step import StepPlan

__version__ = "0.1.0"

__all__ = [
    "BatchControl", "BatchedSequenceCache", "CacheConfig", "CacheFullError", "CapacityError",
    "CloneRefusedError", "ConfigError", "DeviceError", "FreeSequenceError", "IndexCounts",
    "KVCacheError", "LayerSpec", "OwnerRunError", "PackedStep", "PageDemand", "PoolPages",
    "PositionError", "PrefixStats", "RankDivergenceError",
    "RingFloorError", "Segment", "SequenceBatchControl", "SequenceCache", "SessionError",
    "SessionId", "SessionTable", "ShapeError", "SlotState", "SlotStateError", "StepData",
    "StepPlan", "StepProtocolError", "StepState", "UnknownSequenceError", "device", "flat",
    "fp8_scales", "page_keys", "ring", "run_inputs", "run_step", "torch_stream",
]
