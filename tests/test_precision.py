"""What each attention path rounds, bounded (docs/semantics.md, "What each path rounds").

The same queries of one sequence, over the same history, go through the decode path (a
span of 4 tokens: 8 rows of a group of 2, on CUDA cores or on tensor cores, each forced
through `decode.shape.CUDA_CORE_ROWS`) and the tensor-core prefill path (a span of 5:
its first 4 rows are the same queries at the same positions, seeing the same keys).
With float32 q and out, decode on CUDA cores rounds nothing: it matches the float64
reference on the stored (rounded) K/V to float32 accuracy. Prefill and decode on tensor
cores round q and the probabilities to the storage's 16-bit type (unit roundoff `u`), so
each output element is within `(exp(2 u S) - 1 + 2 u / (1 - u) * exp(2 u S)) * max|v|`
of it, where `S = scale * max_j sum_i |q_i k_ji|` over the keys the row sees.
"""
import numpy as np
import pytest

import kvnumba as kv
from kvnumba import reference
from kvnumba.kernels.decode import shape as decode_shape

H, HQ, D = 1, 2, 16
HISTORY = 6
#: the unit roundoff of the mma type: the storage's 16-bit type, or for 8-bit float
#: storage (widened exactly) the query's, float16 for these float32 queries
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float8_e4m3": 2.0 ** -11,
                 "float8_e5m2": 2.0 ** -11}
FLOAT32_SLACK = 1e-5


def through_both_paths(dtype, monkeypatch, tensor_cores):
    """`(decode rows, prefill rows, q, keys, values)`: the 4 shared rows of both paths,
    and what they attend over (K/V as stored, float64); decode on tensor cores or on
    CUDA cores."""
    most = 0 if tensor_cores else 10**6
    monkeypatch.setattr(decode_shape, "CUDA_CORE_ROWS", {2: most, 1: most})
    config = kv.CacheConfig(layers=[kv.flat()], n_kv_heads=H, head_dim=D, capacity=16,
                            max_seqs=1, max_write=8, max_step=8, dtype=dtype, initial_pages=16)
    cache = kv.BatchedSequenceCache(config)
    assert all(cache._routing.prefill_fast), "the 5-token span must take the tensor-core path"
    seq = cache.seq_new()
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((HISTORY + 5, heads, D)).astype(np.float32)
               for heads in (HQ, H, H))
    cache.declare_step([seq] * HISTORY)
    cache.prepare_step()
    cache.write(0, k[:HISTORY], v[:HISTORY])
    cache.commit_step()
    rows = []
    for span in (4, 5):
        cache.declare_step([seq] * span)
        cache.prepare_step()
        new = slice(HISTORY, HISTORY + span)
        rows.append(cache.update_and_attend(0, q[new], k[new], v[new])[:4].astype(np.float64))
        if span == 4:
            cache.abort_step()
        else:
            cache.commit_step()     # its keys become readable by `sequence_kv`
    _, keys, values = cache.sequence_kv(seq, 0)
    return rows[0], rows[1], q[HISTORY:HISTORY + 4], keys.astype(np.float64), \
        values.astype(np.float64)


@pytest.mark.parametrize("dtype", list(UNIT_ROUNDOFF))
def test_decode_and_tensor_core_prefill_differ_by_at_most_the_stated_bound(dtype,
                                                                          monkeypatch):
    decode, prefill, q, keys, values = through_both_paths(dtype, monkeypatch, False)
    rounded = through_both_paths(dtype, monkeypatch, True)[0]
    positions = np.arange(HISTORY, HISTORY + 4)
    exact = reference.attention(q, keys, values, positions)
    np.testing.assert_allclose(decode, exact, rtol=0, atol=FLOAT32_SLACK)

    u, scale = UNIT_ROUNDOFF[dtype], 1 / np.sqrt(D)
    group = HQ // H
    for row, p in enumerate(positions):
        for head in range(HQ):
            seen = slice(0, p + 1)
            kh, vh = keys[seen, head // group], values[seen, head // group]
            score_reach = scale * (np.abs(q[row, head]) @ np.abs(kh).T).max()
            grow = np.exp(2 * u * score_reach)
            bound = (grow - 1 + 2 * u / (1 - u) * grow) * np.abs(vh).max() + FLOAT32_SLACK
            for path, got in (("prefill", prefill), ("decode on tensor cores", rounded)):
                err = np.abs(got[row, head] - decode[row, head]).max()
                assert err <= bound, (path, row, head, err, bound)
    # the bound is not vacuous: the tensor cores do round (decode on CUDA cores does not)
    assert np.abs(prefill - exact).max() > 10 * FLOAT32_SLACK
    assert np.abs(rounded - exact).max() > 10 * FLOAT32_SLACK
