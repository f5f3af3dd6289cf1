"""`fp8_scales`: per-layer K and V scales for 8-bit float storage, from sample K/V.

A scale maps a layer's largest sample magnitude onto the format's largest finite value
(`amax / 448` for e4m3, `amax / 57344` for e5m2), so the sample fits the format's range
with no saturation and the most precision its range allows; a layer whose samples are
all zero keeps 1.0. vLLM computes its scales the same way from a warm-up batch and then
freezes them, as a `CacheConfig` does.
"""
from __future__ import annotations

import numpy as np

from .args import describe
from .config import FP8_DTYPES, FP8_LARGEST
from .errors import ConfigError


def _amax(sample, what: str) -> float:
    """The largest magnitude of `sample` (a NumPy array, a PyTorch tensor of any dtype,
    or anything NumPy takes), refused when not finite."""
    if hasattr(sample, "detach"):               # torch: bfloat16 has no NumPy twin
        amax = float(sample.detach().float().abs().max().item()) if sample.numel() else 0.0
    else:
        values = np.asarray(sample, dtype=np.float64)
        amax = float(np.abs(values).max()) if values.size else 0.0
    if not np.isfinite(amax):
        raise ConfigError(f"fp8_scales: {what} holds a non-finite value (its amax is "
                          f"{amax}); scales come from finite samples")
    return amax


def fp8_scales(k_samples, v_samples, dtype: str = "float8_e4m3") -> tuple[tuple, tuple]:
    """`(k_scale, v_scale)`, one float per layer, for `CacheConfig(dtype=dtype,
    k_scale=..., v_scale=...)`: each layer's sample amax over `dtype`'s largest finite
    value (1.0 for all-zero samples). `k_samples`, `v_samples`: one array per layer
    (NumPy or PyTorch, any shape and float dtype: e.g. the K and V a model computed for
    a few representative prompts)."""
    if dtype not in FP8_DTYPES:
        raise ConfigError(f"fp8_scales: dtype={describe(dtype)}: scales are for fp8 storage, "
                          f"one of {list(FP8_DTYPES)}")
    k_samples, v_samples = list(k_samples), list(v_samples)
    if len(k_samples) != len(v_samples):
        raise ConfigError(f"fp8_scales: {len(k_samples)} K samples but {len(v_samples)} V "
                          f"samples: give one of each per layer")
    largest = FP8_LARGEST[dtype]
    scales = []
    for name, samples in (("K", k_samples), ("V", v_samples)):
        amaxes = [_amax(sample, f"the {name} sample of layer {i}")
                  for i, sample in enumerate(samples)]
        scales.append(tuple(float(np.float32(a / largest)) if a > 0 else 1.0
                            for a in amaxes))
    return scales[0], scales[1]
