"""bfloat16 storage end to end: write, clone, sequence_kv and attention on every path.

Host bfloat16 arrays are `ml_dtypes.bfloat16`; the device holds the bit patterns as
uint16. Values written are checked bit for bit (a float32 input rounded to nearest
even, as `ml_dtypes` rounds), attention against the float64 reference to 1e-2.
"""
import numpy as np
import pytest

import kvnumba as kv
from oracle import dense_attention

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = ml_dtypes.bfloat16
H, HQ = 2, 4


def make(head_dim, layers=(None, 4), max_seqs=3):
    config = kv.CacheConfig(layers=[kv.flat() if w is None else kv.ring(window=w)
                                    for w in layers], n_kv_heads=H, head_dim=head_dim,
                            capacity=40, max_seqs=max_seqs, max_write=8, max_step=16,
                            dtype="bfloat16", initial_pages=8)
    return kv.BatchedSequenceCache(config)


def test_bfloat16_storage_is_uint16_bits_and_host_arrays_are_ml_dtypes():
    c = make(16)
    k, _ = c.layer_data(0)
    assert k.dtype == np.uint16 and c.config.np_dtype == np.dtype(BF16)
    assert c.config.bytes_per_token == 2 * 2 * H * 16 * 2
    s = c.seq_new()
    rng = np.random.default_rng(0)
    c.declare_step([s] * 3)
    c.prepare_step(4)
    exact_k = rng.standard_normal((4, H, 16)).astype(BF16)         # bfloat16 in: exact
    exact_v = rng.standard_normal((4, H, 16)).astype(BF16)
    wide_k = rng.standard_normal((4, H, 16)).astype(np.float32)    # float32 in: rounded
    wide_v = rng.standard_normal((4, H, 16)).astype(np.float32)
    c.write(0, exact_k, exact_v)
    c.write(1, wide_k, wide_v)
    c.commit_step()
    for layer, sent_k, sent_v in ((0, exact_k, exact_v),
                                  (1, wide_k.astype(BF16), wide_v.astype(BF16))):
        positions, got_k, got_v = c.sequence_kv(s, layer)
        assert got_k.dtype == got_v.dtype == np.dtype(BF16) and positions.tolist() == [0, 1, 2]
        assert got_k.tobytes() == sent_k[:3].tobytes()
        assert got_v.tobytes() == sent_v[:3].tobytes()
    clone = c.seq_clone(s, upto=2)
    positions, got_k, got_v = c.sequence_kv(clone, 0)
    assert positions.tolist() == [0, 1]
    assert got_k.tobytes() == exact_k[:2].tobytes() and got_v.tobytes() == exact_v[:2].tobytes()


def test_bfloat16_without_ml_dtypes_needs_it_only_for_numpy_host_arrays(monkeypatch):
    """A bfloat16 cache is built and served without ml_dtypes (device arrays, PyTorch
    tensors); a NumPy host copy of its storage (`sequence_kv`) is refused naming the
    extra that brings it."""
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ml_dtypes" else real(name, *a))
    c = kv.BatchedSequenceCache(kv.CacheConfig(dtype="bfloat16", head_dim=8))
    a = c.seq_new()
    with pytest.raises(kv.ConfigError, match=r"ml_dtypes.*pip install -e '\.\[bf16\]'"):
        c.sequence_kv(a, 0)


# head_dim 16: the fast decode and tensor-core prefill paths; 12: the generic kernel
@pytest.mark.parametrize("head_dim", [16, 12])
@pytest.mark.parametrize("q_dtype", [BF16, np.float32])
def test_attention_over_bfloat16_storage_matches_the_reference(head_dim, q_dtype):
    rng = np.random.default_rng(head_dim)
    c = make(head_dim)
    a, b, d = c.seq_new(), c.seq_new(), c.seq_new()
    windows = (None, 4)                     # ring R = 4 + 8 - 1 = 11: nothing is evicted
    hist = {(layer, s): ([], []) for layer in range(2) for s in (a, b, d)}   # (keys, values)
    steps = ([a] * 5 + [b] * 2 + [d] * 7, [a, b, b, b, b, b, b, d])   # prefill, then mixed
    for ids in steps:
        c.declare_step(ids)
        plan = c.prepare_step(len(ids) + 1)
        for layer, window in enumerate(windows):
            q = rng.standard_normal((plan.width, HQ, head_dim)).astype(q_dtype)
            k = rng.standard_normal((plan.width, H, head_dim)).astype(BF16)
            v = rng.standard_normal((plan.width, H, head_dim)).astype(BF16)
            for t, s in enumerate(ids):
                hist[layer, s][0].append(k[t])
                hist[layer, s][1].append(v[t])
            out = c.update_and_attend(layer, q, k, v)
            assert out.dtype == np.dtype(q_dtype) and not out[len(ids):].astype(np.float32).any()
            for seg in plan.segments:       # every sequence of both steps, on both layers
                end = seg.pos_start + seg.q_len
                keys = np.array(hist[layer, seg.seq][0][:end], np.float64)
                values = np.array(hist[layer, seg.seq][1][:end], np.float64)
                rows = slice(seg.q_start, seg.q_start + seg.q_len)
                want = dense_attention(q[rows].astype(np.float64), keys, values, seg.pos_start,
                                       window, False, 1 / np.sqrt(head_dim))
                got = out[rows].astype(np.float64)
                assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2, (layer, seg)
        c.commit_step()
