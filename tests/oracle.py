"""Independent references for the tests: nothing here imports kvnumba.

- `ring_rows`, `floor`: contract §4/§5 arithmetic, written out again.
- `visible_mask`: the keys one query sees, as a boolean mask (vectorised `visible`).
- `seen_positions`: every key position some query of a segment sees.
- `dense_attention`: float64 attention from dense per-sequence histories and explicit masks.
- `round_nearest_even`, `f16_values`, `bf16_values`: float32 -> float16/bfloat16 bits
  (IEEE round to nearest, ties to even) from each format's rounding grid, and back.
"""
import numpy as np


def ring_rows(window, max_write, capacity):
    return min(capacity, window + max_write - 1)


def floor(high_water, windows, max_write, capacity, chunks=()):
    """Max over ring layers of (hw - M if hw > R else 0), and over chunked layers (chunk
    C, R rows holding [hw - R, hw) once hw > R) of the lowest L from which every resume
    point up to hw finds its chunk's start `C * (L // C)` still held (found by search);
    0 without ring layers."""
    out = 0
    for w in windows:
        if w is None:
            continue
        if high_water > ring_rows(w, max_write, capacity):
            out = max(out, high_water - max_write)
    for c in chunks:
        oldest = high_water - ring_rows(c, max_write, capacity)
        if oldest > 0:
            lowest = next(p for p in range(high_water + 1)
                          if all(c * (q // c) >= oldest for q in range(p, high_water + 1)))
            out = max(out, lowest)
    return out


def chunk_start(p, chunk):
    """The first position of the chunk of `chunk` positions that holds p (contract §15)."""
    return p - p % chunk


def visible(p, key, pos_start, q_len, window, block, chunk=None):
    """Does the query at position p see the key at position `key`? (contract §2, §7, §15)"""
    lo = max(0, p - window + 1) if window else 0
    if chunk:
        lo = chunk_start(p, chunk)
    if block:
        in_block = pos_start <= key < pos_start + q_len
        return in_block or (lo <= key < pos_start)
    return lo <= key <= p


def visible_mask(p, kv_len, pos_start, q_len, block, window, chunk=None):
    """Boolean mask over key positions [0, kv_len) for the query at position p."""
    j = np.arange(kv_len)
    in_window = (j >= p - window + 1) if window else np.ones(kv_len, bool)
    if chunk:
        in_window = j >= chunk_start(p, chunk)
    if block:
        in_block = (j >= pos_start) & (j < pos_start + q_len)
        return in_block | ((j < pos_start) & in_window)
    return (j <= p) & in_window


def seen_positions(q_len, pos_start, block, window, chunk=None):
    """Every key position some query of the segment sees (sorted int array)."""
    kv_len = pos_start + q_len
    seen = np.zeros(kv_len, bool)
    for i in range(q_len):
        seen |= visible_mask(pos_start + i, kv_len, pos_start, q_len, block, window, chunk)
    return np.flatnonzero(seen)


def dense_attention(q, keys, values, pos_start, window, block, scale, softcap=None,
                    chunk=None):
    """q [n, hq, d]; keys [kv_len, hkv, d], values [kv_len, hkv, dv] (positions
    0..kv_len-1) -> [n, hq, dv] float64."""
    q = np.asarray(q, np.float64)
    keys = np.asarray(keys, np.float64)
    values = np.asarray(values, np.float64)
    n, hq, _ = q.shape
    group = hq // keys.shape[1]
    out = np.zeros((n, hq, values.shape[2]), np.float64)
    for i in range(n):
        p = pos_start + i
        mask = np.array([visible(p, j, pos_start, n, window, block, chunk)
                         for j in range(len(keys))])
        for h in range(hq):
            kv = h // group
            s = scale * (keys[:, kv, :] @ q[i, h])
            if softcap:
                s = softcap * np.tanh(s / softcap)
            s = np.where(mask, s, -np.inf)
            w = np.exp(s - s.max())
            w /= w.sum()
            out[i, h] = w @ values[:, kv, :]
    return out


# ---------------------------------------------------------------- 16-bit float formats

def f16_values(bits):
    """float64 values of uint16 float16 bit patterns (exact)."""
    return np.asarray(bits, np.uint16).view(np.float16).astype(np.float64)


def bf16_values(bits):
    """float64 values of uint16 bfloat16 bit patterns (exact): the top half of a float32."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32).astype(
        np.float64)


FORMATS = {  # name: (decode bits -> float64, bits of +inf, 2 ** (emax + 1), mantissa bits)
    "f16": (f16_values, 0x7C00, 2.0 ** 16, 10),
    "bf16": (bf16_values, 0x7F80, 2.0 ** 128, 7),
}


def round_nearest_even(x, fmt):
    """uint16 bits of float32 `x` in `fmt` ("f16" or "bf16"), rounded to nearest, ties
    to even (IEEE 754).

    The non-negative finite values of the format, in bit order, are its rounding
    grid; +inf sits where the next binade would start (2**(emax+1)), so values from
    halfway past the largest finite one round to inf (its bits are even). NaN becomes
    a quiet NaN of the same sign that keeps the top bits of the payload (for bfloat16:
    the top half of the float32, quiet bit set).
    """
    decode, inf_bits, top, mantissa = FORMATS[fmt]
    x = np.asarray(x, np.float32)
    bits = np.arange(inf_bits + 1, dtype=np.uint16)
    grid = decode(bits)
    grid[-1] = top
    with np.errstate(invalid="ignore"):   # widening a signalling NaN
        mag = np.abs(x.astype(np.float64))
    above = np.minimum(np.searchsorted(grid, mag), bits.size - 1)
    below = np.maximum(above - 1, 0)
    to_above = grid[above] - mag
    to_below = mag - grid[below]
    take_above = (to_above < to_below) | ((to_above == to_below) & (bits[above] % 2 == 0))
    out = np.where(take_above, bits[above], bits[below]).astype(np.uint32)
    out = np.where(mag >= top, inf_bits, out)
    f32 = x.view(np.uint32)
    out = np.where(np.signbit(x), out | 0x8000, out)
    quiet_nan = ((f32 >> 16) & 0x8000) | inf_bits | (1 << (mantissa - 1)) | (
        (f32 & 0x7FFFFF) >> (23 - mantissa))
    return np.where(np.isnan(x), quiet_nan, out).astype(np.uint16)


# ---------------------------------------------------------------- 8-bit float formats

#: fp8 storage dtype name -> (the bits' NumPy dtype, ml_dtypes' type, largest finite):
#: ml_dtypes is the independent quantiser (it makes an out-of-range value NaN where the
#: hardware saturates, so values are clipped first)
FP8 = {"float8_e4m3": (np.uint8, "float8_e4m3fn", 448.0),
       "float8_e5m2": (np.int8, "float8_e5m2", 57344.0)}


def fp8_stored(values, name):
    """`(bits, float64 values)`: float `values` as fp8 storage `name` holds them (clipped,
    rounded to nearest even; NaN stays NaN), and the values those bits are."""
    import ml_dtypes

    bits, fmt, largest = FP8[name]
    held = np.clip(np.asarray(values, np.float32), -largest, largest).astype(
        getattr(ml_dtypes, fmt))
    return held.view(np.uint8).view(bits), held.astype(np.float64)
