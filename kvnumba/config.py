"""Cache configuration (DESIGN §3): `CacheConfig`, and `flat()` / `ring()` layer specs.

Validation happens at construction; every refusal is a `ConfigError` naming the
field and the rule it broke.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import ConfigError

#: storage dtypes the kernels support, by name
DTYPES = {"float32": np.float32, "float16": np.float16}
#: the largest head_dim the attention kernels are built for
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class LayerSpec:
    """One layer's kind: flat (`window is None`) or a sliding-window ring of `window` positions."""

    window: int | None = None

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
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ConfigError(f"ring(window={window!r}): window must be an integer >= 1")
    return LayerSpec(int(window))


def _require_int(name: str, value, lo: int, hi: int | None = None, rule: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{name}={value!r}: must be an integer")
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
    dtype:        storage dtype, "float32" or "float16".
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
        layers = tuple(self.layers)
        if not layers:
            raise ConfigError("layers=[]: requires at least one layer")
        for i, spec in enumerate(layers):
            if not isinstance(spec, LayerSpec):
                raise ConfigError(f"layers[{i}]={spec!r}: must be flat() or ring(window=...)")
        object.__setattr__(self, "layers", layers)
        _require_int("n_kv_heads", self.n_kv_heads, 1)
        _require_int("head_dim", self.head_dim, 1, MAX_HEAD_DIM)
        _require_int("capacity", self.capacity, 1)
        _require_int("max_seqs", self.max_seqs, 1)
        _require_int("max_write", self.max_write, 1, self.capacity,
                     rule=f"1 <= max_write <= capacity ({self.capacity})")
        _require_int("max_step", self.max_step, self.max_write,
                     rule=f"max_step >= max_write ({self.max_write})")
        _require_int("initial_rows", self.initial_rows, 1)
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}: must be one of {sorted(DTYPES)}")

    @property
    def np_dtype(self):
        """The storage dtype as a NumPy dtype."""
        return np.dtype(DTYPES[self.dtype])

    @property
    def n_layers(self) -> int:
        return len(self.layers)
