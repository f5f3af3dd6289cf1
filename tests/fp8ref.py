"""The independent reference of 8-bit float K/V storage: ml_dtypes' formats
(`float8_e4m3fn`, `float8_e5m2`), which turn an out-of-range value into NaN where the
hardware's `satfinite` saturates, so `quantised` clips first."""
import ml_dtypes
import numpy as np

FORMATS = {"float8_e4m3": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}
LARGEST = {"float8_e4m3": 448.0, "float8_e5m2": 57344.0}


def quantised(x, dtype, scale=1.0):
    """`scale * stored` in float64 for float32 inputs `x` written with `scale`: times the
    float32 reciprocal, clipped to the format's range, rounded to nearest even; NaN where
    `x` is not finite (the contract's rule: a non-finite input stays non-finite)."""
    x = np.asarray(x, np.float32)
    with np.errstate(over="ignore"):
        scaled = x * np.float32(1 / np.float32(scale))
    largest = LARGEST[dtype]
    stored = np.clip(scaled, -largest, largest).astype(FORMATS[dtype])
    stored[~np.isfinite(x)] = np.nan
    return stored.astype(np.float64) * np.float32(scale)
