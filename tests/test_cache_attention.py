"""Attention through the cache against the float64 oracle, over storage poisoned with NaN.

Rows a sequence does not hold (never written, a freed column's leftovers, fresh
rows from growth) are NaN here: a correct kernel never reads them.
"""
import numpy as np
import pytest

import kvnumba as kv
from oracle import dense_attention

H, HQ, D = 1, 4, 8


class Histories:
    """Dense per-sequence K/V per layer, fed by the same random steps as the cache."""

    def __init__(self, cache, dtype, rng):
        self.cache, self.dtype, self.rng = cache, dtype, rng
        self.hist = {}

    def step(self, runs, *, blocks=(), width=None, softcap=None, scale=None):
        c = self.cache
        ids = [s for s, n in runs for _ in range(n)]
        c.declare_step(ids, blocks=blocks)
        plan = c.prepare_step(width)
        for layer, spec in enumerate(c.config.layers):
            k = self.rng.standard_normal((plan.width, H, D)).astype(self.dtype)
            v = self.rng.standard_normal((plan.width, H, D)).astype(self.dtype)
            q = self.rng.standard_normal((plan.width, HQ, D)).astype(self.dtype)
            out = c.update_and_attend(layer, q, k, v, softcap=softcap, scale=scale)
            assert out.dtype == self.dtype and np.isfinite(out).all()
            for g in plan.segments:
                h = self.hist.setdefault((g.seq, layer), {})
                for i in range(g.q_len):
                    h[g.pos_start + i] = (k[g.q_start + i], v[g.q_start + i])
                end = g.pos_start + g.q_len
                keys = np.zeros((end, H, D))
                vals = np.zeros((end, H, D))
                lo = 0 if spec.window is None else max(0, g.pos_start - spec.window + 1)
                for p in range(lo, end):
                    keys[p], vals[p] = h[p]
                want = dense_attention(q[g.q_start:g.q_start + g.q_len].astype(np.float64),
                                       keys, vals, g.pos_start, spec.window or 0, g.block,
                                       scale or 1 / np.sqrt(D), softcap)
                got = out[g.q_start:g.q_start + g.q_len].astype(np.float64)
                err = np.linalg.norm(got - want) / np.linalg.norm(want)
                assert err < (1e-4 if self.dtype == np.float32 else 2e-3), (g, layer, err)
            np.testing.assert_array_equal(out[plan.n_tokens:], 0)
        c.commit_step()

    def forget(self, seq):
        for key in [k for k in self.hist if k[0] == seq]:
            del self.hist[key]

    def clone(self, src, dst, keep):
        for (s, layer), h in list(self.hist.items()):
            if s == src:
                self.hist[(dst, layer)] = {p: kv_ for p, kv_ in h.items() if p < keep}


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_serving_trace_over_poisoned_storage(nan_storage, dtype):
    cfg = kv.CacheConfig(layers=[kv.flat(), kv.ring(window=3)], n_kv_heads=H, head_dim=D,
                         capacity=32, max_seqs=3, max_write=6, max_step=10,
                         dtype=np.dtype(dtype).name, initial_pages=2)
    c = kv.BatchedSequenceCache(cfg)
    h = Histories(c, dtype, np.random.default_rng(0))
    a, b = c.seq_new(), c.seq_new()
    h.step([(a, 6), (b, 2)], width=10)           # prefill chunks, padding, growth 2 -> 6
    h.step([(a, 1), (b, 1)])                     # decode
    h.step([(b, 5), (a, 1)], width=8)            # growth again, mixed order
    c.seq_rm(a)
    h.forget(a)
    a2 = c.seq_new()                             # reuses column 0: old bytes must not leak
    assert a2 == a
    h.step([(a2, 2), (b, 1)])
    d = c.seq_clone(b, upto=7)
    h.clone(b, d, 7)
    h.step([(d, 3), (b, 3)], blocks=[d])         # a draft block on the clone
    c.rewind(b, 8)
    h.step([(b, 2), (d, 1), (a2, 1)], softcap=1.5, scale=0.2)


def test_gqa_group_reads_its_own_kv_head():
    """Two kv heads with different values: query heads 0-1 read head 0, heads 2-3 head 1."""
    cfg = kv.CacheConfig(layers=[kv.flat()], n_kv_heads=2, head_dim=2, capacity=4, max_seqs=1,
                         max_write=2, max_step=2, dtype="float32", initial_pages=4)
    c = kv.BatchedSequenceCache(cfg)
    s = c.seq_new()
    c.declare_step([s, s])
    c.prepare_step()
    k = np.zeros((2, 2, 2), np.float32)          # equal scores: uniform weights
    v = np.array([[[1, 1], [10, 10]], [[3, 3], [30, 30]]], np.float32)
    out = c.update_and_attend(0, np.ones((2, 4, 2), np.float32), k, v)
    np.testing.assert_allclose(out[0], [[1, 1], [1, 1], [10, 10], [10, 10]])
    np.testing.assert_allclose(out[1], [[2, 2], [2, 2], [20, 20], [20, 20]])


def test_attend_refusals_launch_nothing():
    cfg = kv.CacheConfig(layers=[kv.flat()], n_kv_heads=2, head_dim=2, capacity=4, max_seqs=1,
                         max_write=2, max_step=2, dtype="float32", initial_pages=4)
    c = kv.BatchedSequenceCache(cfg)
    s = c.seq_new()
    c.declare_step([s])
    c.prepare_step()
    for q in (np.zeros((1, 3, 2), np.float32), np.zeros((1, 2), np.float32),
              np.zeros((2, 2, 2), np.float32), np.zeros((1, 2, 2), np.int32)):
        with pytest.raises(kv.ShapeError):
            c.attend(0, q)
    out = np.full((1, 2, 2), 7.0, np.float32)
    with pytest.raises(kv.ShapeError):
        c.attend(0, np.zeros((1, 2, 2), np.float32), out=out[:, :1])
    with pytest.raises(kv.ConfigError):
        c.attend(0, np.zeros((1, 2, 2), np.float32), out=out, softcap=0.0)
    np.testing.assert_array_equal(out, 7.0)
    assert c.step_state == kv.StepState.PREPARED
