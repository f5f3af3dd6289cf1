"""kvnumba: a batched-sequence KV cache for LLM serving, with Numba CUDA kernels.

Many sequences share one cache, each holding pages of every layer's page pool.
`BatchedSequenceCache` offers the BatchControl face (contract §7); every slot's
lifecycle is validated through the machines declared in `statemachines`. The code
cites the sections of the contract, docs/contract.md, as "contract §n".
"""
from . import device  # first: chooses GPU or simulator before numba.cuda is imported
from .device import DeviceError, torch_stream
from .batched import BatchedSequenceCache
from .config import CacheConfig, LayerSpec, flat, ring
from .driver import run_inputs, run_step
from .errors import (CacheFullError, CapacityError, CloneRefusedError, ConfigError,
                     FreeSequenceError, KVCacheError, OwnerRunError, PositionError,
                     RingFloorError, SessionError, ShapeError, SlotStateError, StepProtocolError,
                     UnknownSequenceError)
from .page_accounting import PoolPages
from .plan import Segment
from .protocol import BatchControl, StepData
from .queries import PageDemand
from .sessions import PackedStep, SessionId, SessionTable
from .sequence_control import SequenceBatchControl
from .single import SequenceCache
from .slots import SlotState, StepState
from .step import StepPlan

__version__ = "0.1.0"

__all__ = [
    "BatchControl", "BatchedSequenceCache", "CacheConfig", "CacheFullError", "CapacityError",
    "CloneRefusedError", "ConfigError", "DeviceError", "FreeSequenceError", "KVCacheError",
    "LayerSpec", "OwnerRunError", "PackedStep", "PageDemand", "PoolPages", "PositionError",
    "RingFloorError", "Segment", "SequenceBatchControl", "SequenceCache", "SessionError",
    "SessionId", "SessionTable", "ShapeError", "SlotState", "SlotStateError", "StepData",
    "StepPlan", "StepProtocolError", "StepState", "UnknownSequenceError", "device", "flat",
    "ring", "run_inputs", "run_step", "torch_stream",
]
