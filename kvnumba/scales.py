"""`fp8_scales`: per-layer K and V scales for 8-bit float storage, from sample K/V.

A scale maps a layer's largest sample magnitude onto the format's largest finite value
(`amax / 448` for e4m3, `amax / 57344` for e5m2), so the sample fits the format's range
with no saturation and the most precision its range allows; a layer whose samples are
all zero keeps 1.0. vLLM computes its scales the same way from a warm-up batch and then
freezes them, as a `CacheConfig` does.
"""
from __future__ import annotations

import numpy as np

from .args import describe, is_listlike
from .config import FP8_DTYPES, FP8_LARGEST
from .errors import ConfigError


#: the scales `fp8_scales` returns lie in [SCALE_MIN, SCALE_MAX]: a finite float32 with a
#: finite reciprocal, which folded into any attention scale in [2**-20, 2**20] stays in the
#: kernels' range (`args.KERNEL_REAL_MIN`, `KERNEL_REAL_MAX`)
SCALE_MIN, SCALE_MAX = 2.0 ** -40, 2.0 ** 40


def _amax(sample, what: str) -> float:
    """The largest magnitude of `sample` (a NumPy array, a PyTorch tensor of any real
    dtype, or a nested list of reals), refused (`ConfigError` naming it) when it is not
    real numbers or not finite."""
    if hasattr(sample, "detach"):               # torch: bfloat16 has no NumPy twin
        if sample.is_complex() or str(sample.dtype) == "torch.bool":
            raise ConfigError(f"fp8_scales: {what} is a {sample.dtype} tensor; give real K "
                              f"or V values")
        amax = float(sample.detach().float().abs().max().item()) if sample.numel() else 0.0
    else:
        if isinstance(sample, (str, bytes)) or sample is None or np.isscalar(sample):
            raise ConfigError(f"fp8_scales: {what} is {describe(sample)}; give an array of "
                              f"K or V values per layer")
        try:
            values = np.asarray(sample)
        except ValueError as exc:
            raise ConfigError(f"fp8_scales: {what} is not an array ({exc})") from None
        if values.dtype.kind not in "iuf":
            raise ConfigError(f"fp8_scales: {what} holds {values.dtype} values, not real "
                              f"numbers; give an array of K or V values per layer")
        values = values.astype(np.float64)
        amax = float(np.abs(values).max()) if values.size else 0.0
    if not np.isfinite(amax):
        raise ConfigError(f"fp8_scales: {what} holds a non-finite value (its amax is "
                          f"{amax}); scales come from finite samples")
    return amax


def _per_layer(samples, name: str) -> list:
    """`samples` (one array per layer) as a list, or `ConfigError` naming what it is."""
    if not is_listlike(samples):
        raise ConfigError(f"fp8_scales: {name}_samples={describe(samples)}; give a list "
                          f"with one array of {name} values per layer")
    return list(samples)


def fp8_scales(k_samples, v_samples, dtype: str = "float8_e4m3") -> tuple[tuple, tuple]:
    """`(k_scale, v_scale)`, one float per layer, for `CacheConfig(dtype=dtype,
    k_scale=..., v_scale=...)`: each layer's sample amax over `dtype`'s largest finite
    value (1.0 for all-zero samples), at least `SCALE_MIN` (a smaller amax is stored
    with that scale, in the format's subnormals or as 0). `k_samples`, `v_samples`: one
    array per layer (NumPy or PyTorch, any shape and real dtype: e.g. the K and V a
    model computed for a few representative prompts). `ConfigError`, naming the sample,
    for anything else, a non-finite value, or an amax past `SCALE_MAX` times the
    format's largest."""
    if dtype not in FP8_DTYPES:
        raise ConfigError(f"fp8_scales: dtype={describe(dtype)}: scales are for fp8 storage, "
                          f"one of {list(FP8_DTYPES)}")
    k_samples, v_samples = _per_layer(k_samples, "k"), _per_layer(v_samples, "v")
    if len(k_samples) != len(v_samples):
        raise ConfigError(f"fp8_scales: {len(k_samples)} K samples but {len(v_samples)} V "
                          f"samples: give one of each per layer")
    largest = FP8_LARGEST[dtype]
    scales = []
    for name, samples in (("K", k_samples), ("V", v_samples)):
        layer_scales = []
        for i, sample in enumerate(samples):
            what = f"the {name} sample of layer {i}"
            amax = _amax(sample, what)
            if amax / largest > SCALE_MAX:
                raise ConfigError(f"fp8_scales: {what} has amax {amax:g}, past what {dtype} "
                                  f"holds with a scale up to {SCALE_MAX:g} "
                                  f"({largest * SCALE_MAX:g}); scale the model's K/V down")
            layer_scales.append(max(float(np.float32(amax / largest)), SCALE_MIN)
                                if amax > 0 else 1.0)
        scales.append(tuple(layer_scales))
    return scales[0], scales[1]
