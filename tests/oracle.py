"""Independent references for the tests: nothing here imports kvnumba.

- `ring_rows`, `floor`: contract §4/§5 arithmetic, written out again.
- `visible_mask`: the keys one query sees, as a boolean mask (vectorised `visible`).
- `dense_attention`: float64 attention from dense per-sequence histories and explicit masks.
"""
import numpy as np


def ring_rows(window, max_write, capacity):
    return min(capacity, window + max_write - 1)


def floor(high_water, windows, max_write, capacity):
    """Max over ring layers of (hw - M if hw > R else 0); 0 without ring layers."""
    out = 0
    for w in windows:
        if w is None:
            continue
        if high_water > ring_rows(w, max_write, capacity):
            out = max(out, high_water - max_write)
    return out


def visible(p, key, pos_start, q_len, window, block):
    """Does the query at position p see the key at position `key`? (contract §2, §7)"""
    lo = max(0, p - window + 1) if window else 0
    if block:
        in_block = pos_start <= key < pos_start + q_len
        return in_block or (lo <= key < pos_start)
    return lo <= key <= p


def visible_mask(p, kv_len, pos_start, q_len, block, window):
    """Boolean mask over key positions [0, kv_len) for the query at position p."""
    j = np.arange(kv_len)
    in_window = (j >= p - window + 1) if window else np.ones(kv_len, bool)
    if block:
        in_block = (j >= pos_start) & (j < pos_start + q_len)
        return in_block | ((j < pos_start) & in_window)
    return (j <= p) & in_window


def dense_attention(q, keys, values, pos_start, window, block, scale, softcap=None):
    """q [n, hq, d]; keys/values [kv_len, hkv, d] (positions 0..kv_len-1) -> [n, hq, d] float64."""
    q = np.asarray(q, np.float64)
    keys = np.asarray(keys, np.float64)
    values = np.asarray(values, np.float64)
    n, hq, _ = q.shape
    group = hq // keys.shape[1]
    out = np.zeros(q.shape, np.float64)
    for i in range(n):
        p = pos_start + i
        mask = np.array([visible(p, j, pos_start, n, window, block) for j in range(len(keys))])
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
