"""kvnumba: a batched-sequence KV cache for LLM serving, with Numba CUDA kernels.

Many sequences share one cache, each holding pages of every layer's page pool.
`BatchedSequenceCache` offers the BatchControl face (contract §7); every slot's
lifecycle is validated through the machines declared in `statemachines`. The code
cites the sections of the contract, docs/contract.md, as "contract §n".
"""
import importlib.abc as _abc
import importlib.util as _util
import sys as _sys
from pathlib import Path as _Path


class _CheckoutFolders(_abc.MetaPathFinder):
    """The checkout's top-level folders `statemachines/` and `bench/` as the packages
    `kvnumba.statemachines` and `kvnumba.bench`, as an install maps them (pyproject.toml's
    package-dir). Put in place only where nothing else finds them: kvnumba imported from
    a source checkout (the repository root on the path, shadowing any regular install).
    It maps those two names alone: the checkout root is no part of kvnumba."""

    def __init__(self, folders: dict):
        self.folders = folders

    def find_spec(self, fullname, path=None, target=None):
        folder = self.folders.get(fullname)
        if folder is None:
            return None
        return _util.spec_from_file_location(fullname, folder / "__init__.py",
                                             submodule_search_locations=[str(folder)])


def _mount_checkout_folders() -> None:
    checkout = _Path(__file__).resolve().parent.parent
    folders = {f"{__name__}.{name}": checkout / name for name in ("statemachines", "bench")}
    folders = {name: folder for name, folder in folders.items()
               if (folder / "__init__.py").is_file() and _util.find_spec(name) is None}
    if folders:
        _sys.meta_path.append(_CheckoutFolders(folders))


_mount_checkout_folders()

from . import device  # noqa: E402  (first of kvnumba's: chooses GPU or simulator before numba.cuda)
from .device import DeviceError, torch_stream
from .cache.batched import BatchedSequenceCache
from .config import CacheConfig, LayerShape, LayerSpec, chunked, flat, latent, ring, shared, state
from .serving.driver import run_inputs, run_step
from .errors import (CacheFullError, CapacityError, CloneRefusedError, ConfigError,
                     FreeSequenceError, KVCacheError, OwnerRunError, PositionError,
                     RankDivergenceError, RankFailureError, RingFloorError, SessionError, ShapeError,
                     SlotStateError, StepProtocolError, UnknownSequenceError)
from .host.page_accounting import PoolPages
from .arith.positions import Segment
from .protocol import BatchControl, IndexCounts, StepData
from .arith.prefix_keys import page_keys
from .cache.queries import PageDemand
from .scales import fp8_scales
from .serving.sessions import PackedStep, PrefixStats, SessionId, SessionTable
from .cache.sequence_control import SequenceBatchControl
from .cache.single import SequenceCache
from .host.slots import SlotState, StepState
from .host.step import StepPlan

__version__ = "0.1.0"

__all__ = [
    "BatchControl", "BatchedSequenceCache", "CacheConfig", "CacheFullError", "CapacityError",
    "CloneRefusedError", "ConfigError", "DeviceError", "FreeSequenceError", "IndexCounts",
    "KVCacheError", "LayerShape", "LayerSpec", "OwnerRunError", "PackedStep", "PageDemand", "PoolPages",
    "PositionError", "PrefixStats", "RankDivergenceError", "RankFailureError",
    "RingFloorError", "Segment", "SequenceBatchControl", "SequenceCache", "SessionError",
    "SessionId", "SessionTable", "ShapeError", "SlotState", "SlotStateError", "StepData",
    "StepPlan", "StepProtocolError", "StepState", "UnknownSequenceError", "chunked", "device",
    "flat",
    "fp8_scales", "latent", "page_keys", "ring", "run_inputs", "run_step", "shared", "state",
    "torch_stream",
]
