"""Cache configuration (contract §3): `CacheConfig`, and `flat()` / `ring()` layer specs.

Validation happens at construction; every refusal is a `ConfigError` naming the
field and the rule it broke.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import numpy as np

from .args import describe, is_int
from .errors import ConfigError
from .plan import layer_rows

#: storage dtypes, by name: the dtype of the device arrays (bfloat16: its bit patterns as
#: uint16, since Numba has no bfloat16 type)
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
#: the largest head_dim the attention kernels are built for
MAX_HEAD_DIM = 256
#: positions and token indices travel to the kernels as int32
INT32_MAX = 2**31 - 1
#: the attention kernels step from one storage row (every column's kv heads) to the next
#: in unsigned 32-bit byte strides, so a row must stay under 4 GiB
ROW_BYTES_LIMIT = 2**32


@dataclass(frozen=True)
class LayerSpec:
    """One layer's kind: flat (`window is None`) or a sliding-window ring of `window` positions.

    Build it with `flat()` or `ring(window=W)`; a `LayerSpec` built directly is
    checked the same way (`window` None or an int >= 1, else `ConfigError`).
    """

    window: int | None = None

    def __post_init__(self):
        if self.window is None:
            return
        if not is_int(self.window) or not 1 <= self.window <= INT32_MAX:
            raise ConfigError(f"LayerSpec(window={describe(self.window)}): window must be None "
                              f"(flat) or an integer in [1, {INT32_MAX}]")
        object.__setattr__(self, "window", int(self.window))

    @property
    def is_ring(self) -> bool:
        return self.window is not None


def flat() -> LayerSpec:
    """A flat layer: position `p` lives in row `p`; every past position stays visible."""
    return LayerSpec(None)


def ring(window: int) -> LayerSpec:
    """A sliding-window layer: a query at `p` sees keys `max(0, p - window + 1) <= j <= p`.

    This is Hugging Face's `sliding_window=window` and FlashAttention's
    `window_size=(window - 1, 0)`.
    """
    if window is None:
        raise ConfigError("ring(window=None): window must be an integer >= 1 (use flat() for "
                          "a layer without a window)")
    return LayerSpec(window)


def _require_int(name: str, value, lo: int, hi: int | None = None, rule: str = "") -> int:
    if not is_int(value):
        raise ConfigError(f"{name}={describe(value)}: must be an integer")
    if value < lo or (hi is not None and value > hi):
        bound = f"{lo} <= {name}" + (f" <= {hi}" if hi is not None else "")
        raise ConfigError(f"{name}={value}: requires {rule or bound}")
    return int(value)


@dataclass(frozen=True)
class CacheConfig:
    """Shape and limits of a cache.

    layers:       one `LayerSpec` per layer (`flat()` or `ring(window=W)`).
    n_kv_heads:   K/V heads per layer.
    head_dim:     elements per head, 1..256.
    capacity:     most positions one sequence may hold (a hard bound).
    max_seqs:     sequence columns handed out; column `max_seqs` is scratch.
    max_write:    most tokens one sequence writes in one step (`M`).
    max_step:     most tokens, padding included, in one step.
    dtype:        storage dtype, "float32", "float16" or "bfloat16" (bfloat16 needs the
                  ml_dtypes package for its host arrays: `kvnumba[bf16]`).
    initial_rows: rows a flat layer starts with (capped at capacity); grows by whole rows.
    """

    layers: list = field(default_factory=lambda: [flat()])
    n_kv_heads: int = 1
    head_dim: int = 64
    capacity: int = 4096
    max_seqs: int = 1
    max_write: int = 512
    max_step: int = 1024
    dtype: str = "float16"
    initial_rows: int = 256

    def __post_init__(self):
        if not isinstance(self.layers, (list, tuple)):
            raise ConfigError(f"layers={describe(self.layers)}: must be a list of LayerSpec, "
                              f"e.g. [flat(), ring(window=4096)]")
        layers = tuple(self.layers)
        if not layers:
            raise ConfigError("layers=[]: requires at least one layer")
        for i, spec in enumerate(layers):
            if not isinstance(spec, LayerSpec):
                raise ConfigError(f"layers[{i}]={describe(spec)}: must be flat() or "
                                  f"ring(window=...)")
        object.__setattr__(self, "layers", layers)
        _require_int("n_kv_heads", self.n_kv_heads, 1)
        _require_int("head_dim", self.head_dim, 1, MAX_HEAD_DIM)
        _require_int("capacity", self.capacity, 1, INT32_MAX,
                     rule=f"1 <= capacity <= {INT32_MAX} (positions are int32)")
        _require_int("max_seqs", self.max_seqs, 1, INT32_MAX - 1)
        _require_int("max_write", self.max_write, 1, self.capacity,
                     rule=f"1 <= max_write <= capacity ({self.capacity})")
        _require_int("max_step", self.max_step, self.max_write, INT32_MAX,
                     rule=f"max_step >= max_write ({self.max_write}) and max_step <= {INT32_MAX}")
        _require_int("initial_rows", self.initial_rows, 1)
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise ConfigError(f"dtype={describe(self.dtype)}: must be one of {sorted(DTYPES)}")
        row_bytes = ((self.max_seqs + 1) * self.n_kv_heads * self.head_dim
                     * self.storage_dtype.itemsize)
        if row_bytes >= ROW_BYTES_LIMIT:
            raise ConfigError(f"max_seqs={self.max_seqs}: a storage row holds max_seqs + 1 "
                              f"columns x {self.n_kv_heads} kv heads x head_dim "
                              f"{self.head_dim} x {self.storage_dtype.itemsize} bytes = "
                              f"{row_bytes} bytes, and rows must stay under 4 GiB "
                              f"({ROW_BYTES_LIMIT}): use fewer sequences per cache")
        if self.dtype == "bfloat16" and importlib.util.find_spec("ml_dtypes") is None:
            raise ConfigError("dtype='bfloat16': host arrays of bfloat16 need the ml_dtypes "
                              "package: pip install 'kvnumba[bf16]' (or ml_dtypes)")

    @property
    def storage_dtype(self) -> np.dtype:
        """The dtype of the storage's device arrays (bfloat16: uint16 bit patterns)."""
        return np.dtype(DTYPES[self.dtype])

    @property
    def np_dtype(self) -> np.dtype:
        """The storage dtype on the host (`sequence_kv`): bfloat16 as `ml_dtypes.bfloat16`."""
        if self.dtype != "bfloat16":
            return self.storage_dtype
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one position in one column over all layers, K and V."""
        return self.n_layers * 2 * self.n_kv_heads * self.head_dim * self.storage_dtype.itemsize

    def nbytes_at(self, rows: int, columns: int | None = None) -> int:
        """Storage bytes when flat layers hold `rows` rows (ring layers always hold their R).

        `columns`: storage columns, by default `max_seqs + 1` (a `BatchedSequenceCache`:
        the last is scratch); a `SequenceCache` has 1. Flat growth grows every column at
        once, so this is the cost of the longest sequence times every column.
        """
        columns = self.max_seqs + 1 if columns is None else columns
        per_row = columns * 2 * self.n_kv_heads * self.head_dim * self.storage_dtype.itemsize
        ring = layer_rows([s.window for s in self.layers], self.max_write, self.capacity)
        return per_row * int(np.where(ring > 0, ring, rows).sum())
