"""The tensor cores' wide tile (kvnumba.kernels.prefill, `supports_wide`): layers whose K
rows pass 256 values (head dim 512; a latent layer's 576) or whose V is narrower than K
(192 / 128; a latent layer's V, the first 512 values of its rows), in decode (split over
the decode path's key chunks, merged by its combine) and prefill alike, over 16-bit and
8-bit float storage.

Each output is checked against float64 attention written here over the values the
storage holds (q in float16, as the kernel rounds it), with the explicit masks of
tests/oracle.py: latent layers of DeepSeek-V3's shape, 128 query heads over one
latent head, histories split into several chunks (on the decode path's own cases), drafts of one to four tokens, prefill spans, V
slices that overlap (a V of 320), rings wrapping, chunked layers, sinks, a softcap,
fp8 at a scale, bfloat16, and a scale that is not positive (the generic kernel's).

Tolerances: the tensor cores sum probabilities rounded to the 16-bit mma type
(float16: 2**-11 relative, bfloat16: 2**-8) against values of unit size.
"""
import numpy as np
import pytest

import kvnumba as kv
from kvnumba.kernels import prefill
from oracle import fp8_stored, visible_mask
from test_decode import check, make_case, run as run_decode

TOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float8_e4m3": 2e-3, "float8_e5m2": 2e-3}


def attention64(q, keys, values, mask, scale, softcap=None, sinks=None):
    """float64 attention: q [n, hq, d], keys [kv_len, hkv, d], values [kv_len, hkv, dv],
    mask [n, kv_len]; each head's sink (natural log) joins its rows' denominators."""
    n, hq, _ = q.shape
    group = hq // keys.shape[1]
    out = np.zeros((n, hq, values.shape[2]))
    for h in range(hq):
        s = scale * (q[:, h] @ keys[:, h // group].T)
        if softcap:
            s = softcap * np.tanh(s / softcap)
        s = np.where(mask, s, -np.inf)
        top = s.max(axis=1, keepdims=True)
        if sinks is not None:
            top = np.maximum(top, sinks[h])
        w = np.exp(s - top)
        total = w.sum(axis=1, keepdims=True)
        if sinks is not None:
            total += np.exp(sinks[h] - top)
        out[:, h] = (w / total) @ values[:, h // group]
    return out


class Wide:
    """A cache of one layer `spec` and each sequence's rows as its storage holds them
    (float64), checked step by step."""

    def __init__(self, spec, *, dtype="float16", hq=16, n_kv_heads=1, capacity=64,
                 max_write=8, max_step=16, n_seqs=1, scale=None, seed=0):
        self.config = kv.CacheConfig(layers=[spec], n_kv_heads=n_kv_heads, head_dim=16,
                                     capacity=capacity, max_seqs=n_seqs, max_write=max_write,
                                     max_step=max_step, dtype=dtype, page_size=16,
                                     **({} if scale is None else {"k_scale": scale,
                                                                  "v_scale": scale}))
        self.cache = kv.BatchedSequenceCache(self.config)
        self.spec, self.dtype, self.hq = spec, dtype, hq
        self.fp8_scale = scale or 1.0
        self.shape = self.config.layer_shapes[0]
        self.rng = np.random.default_rng(seed)
        self.k, self.v = {}, {}

    def new(self):
        seq = self.cache.seq_new()
        self.k[seq] = np.zeros((0, self.shape.n_kv_heads, self.shape.head_dim))
        self.v[seq] = np.zeros((0, self.shape.n_kv_heads, self.shape.v_head_dim))
        return seq

    def held(self, values):
        """(what to write, float64 values the storage holds)."""
        if self.dtype == "float16":
            values = values.astype(np.float16)
            return values, values.astype(np.float64)
        if self.dtype == "bfloat16":
            import ml_dtypes
            values = values.astype(ml_dtypes.bfloat16)
            return values, values.astype(np.float64)
        _, stored = fp8_stored(values / self.fp8_scale, self.dtype)
        return values.astype(np.float32), stored * self.fp8_scale

    def step(self, seqs, *, blocks=(), attend=True, tol=None, scale=None, softcap=None,
             sinks=None):
        cache, shape, n = self.cache, self.shape, len(seqs)
        start = {s: cache.pos(s) for s in set(seqs)}
        cache.declare_step(list(seqs), blocks=list(blocks))
        cache.prepare_step()
        k, k64 = self.held(self.rng.standard_normal((n, shape.n_kv_heads, shape.head_dim)))
        if shape.v_in_k:
            v, v64 = None, k64[..., :shape.v_head_dim]
        else:
            v, v64 = self.held(self.rng.standard_normal((n, shape.n_kv_heads,
                                                         shape.v_head_dim)))
        for s in start:
            mine = [i for i, t in enumerate(seqs) if t == s]
            self.k[s] = np.concatenate([self.k[s][:start[s]], k64[mine]])
            self.v[s] = np.concatenate([self.v[s][:start[s]], v64[mine]])
        if not attend:
            cache.write(0, k, v)
            cache.commit_step()
            return
        # q in the mma's type, as the kernel rounds it (bfloat16 storage: bfloat16)
        q, _ = self.held(self.rng.standard_normal((n, self.hq, shape.head_dim))) \
            if self.dtype == "bfloat16" else \
            (self.rng.standard_normal((n, self.hq, shape.head_dim)).astype(np.float16), None)
        kw = {"scale": scale, "softcap": softcap}
        if sinks is not None:
            kw["sinks"] = sinks.astype(np.float32)
        out = cache.update_and_attend(0, q, k, v, **kw)
        assert out.shape == (n, self.hq, shape.v_head_dim)
        scale = 1 / np.sqrt(shape.head_dim) if scale is None else scale
        for s in start:
            mine = [i for i, t in enumerate(seqs) if t == s]
            mask = np.stack([visible_mask(start[s] + i, len(self.k[s]), start[s], len(mine),
                                          s in blocks, self.spec.window, self.spec.chunk)
                             for i in range(len(mine))])
            want = attention64(q[mine].astype(np.float64), self.k[s], self.v[s], mask, scale,
                               softcap, sinks)
            np.testing.assert_allclose(out[mine].astype(np.float64), want, rtol=0,
                                       atol=tol or TOL[self.dtype], err_msg=f"seq {s}")
        cache.commit_step()


def test_what_the_wide_tile_serves():
    """K to 576 and V to 512, no wider than K, multiples of 8, over 16-bit and 8-bit float
    storage; V in slices of 256 (a V of 320: two, the second moved back inside K's
    rows); float32 storage and V wider than K are not served."""
    assert prefill.supports_wide(576, 512, np.float16) and prefill.supports_wide(512, 512, "bfloat16")
    assert prefill.supports_wide(192, 128, np.uint8) and prefill.supports_wide(576, 512, np.int8)
    assert not prefill.supports_wide(576, 512, np.float32)
    assert not prefill.supports_wide(128, 192, np.float16)      # V wider than K
    assert not prefill.supports_wide(584, 512, np.float16)      # K past 576
    assert not prefill.supports_wide(576, 520, np.float16)      # V past 512
    assert not prefill.supports_wide(200, 132, np.float16)      # not multiples of 8
    assert [prefill.is_wide(*shape) for shape in ((128, 128), (256, 256), (512, 512),
                                                  (192, 128), (576, 512))] == \
        [False, False, True, True, True]
    assert prefill.v_slice(576, 512) == (256, 2) and prefill.v_slice(352, 320) == (256, 2)
    assert prefill.v_slice(192, 128) == (128, 1)


def test_deepseek_v3s_latent_rows_decode_draft_and_prefill():
    """rank 512 + 64 rope values, 8 query heads: a decode token over a 10-position
    history, then a draft of three (24 rows: two row tiles) beside a second sequence's
    prefill of five."""
    run = Wide(kv.latent(512, 64), hq=8, capacity=24, max_write=10, max_step=10, n_seqs=2)
    a, b = run.new(), run.new()
    run.step([a] * 10, attend=False)
    run.step([a])
    run.step([a] * 3 + [b] * 5, blocks=[a])


def test_128_query_heads_over_one_latent_head():
    """128 heads as the rows of one kv head (DeepSeek-V3's count; rows of 120 + 8
    values): 8 row tiles of 16, a decode token and a two-token draft."""
    run = Wide(kv.latent(120, 8), hq=128, capacity=24, max_write=12, max_step=12)
    a = run.new()
    run.step([a] * 12, attend=False)
    run.step([a])
    run.step([a] * 2, blocks=[a])


def test_head_dim_512_split_over_chunks_merges_at_width_512():
    """The decode path itself (tests/test_decode.py's cases: NaN in every row no segment
    may read, a sentinel in every output row none owns): a window of 100 over a
    121-position history on a ring of 104 rows that wraps, in chunks of 64, merged by
    the combine at width 512 (4 part groups a block), beside a draft block of two."""
    case = make_case(np.random.default_rng(512), [(1, 120), (2, 30, True)], group=1,
                     head_dim=512, window=100, ring_rows=104, others=((5, 0),))
    got, plan = run_decode(case, chunk=64, tensor_cores=None)
    assert plan.n_combine == 1
    check(case, got)
    with pytest.raises(ValueError, match=r"K of 512 and V of 512 are served on tensor cores "
                                         r"alone"):
        run_decode(case, chunk=64, tensor_cores=False)


@pytest.mark.parametrize("q_len", [1, 2, 3, 4])
def test_drafts_of_one_to_four_tokens_with_overlapping_v_slices(q_len):
    """A latent layer of rank 320 + 32 (V in two slices of 256, the second from dim 96:
    each writes its own dims), 4 heads: drafts of every decode length, causal and as a
    block."""
    run = Wide(kv.latent(320, 32), hq=4, capacity=48, max_write=12, max_step=12)
    a = run.new()
    run.step([a] * 12, attend=False)
    run.step([a] * q_len)
    run.step([a] * q_len, blocks=[a])


def test_head_dim_512_on_flat_and_ring_layers():
    """K and V of 512 in their own storage (V staged slice by slice into K's buffer): two
    kv heads of two query heads each over a prefill and a decode token; a ring of
    window 12 that wraps, under a draft of three."""
    run = Wide(kv.flat(head_dim=512, n_kv_heads=2), hq=4, capacity=16, max_write=6,
               max_step=6)
    a = run.new()
    run.step([a] * 6)
    run.step([a])
    run = Wide(kv.ring(12, head_dim=512), hq=2, capacity=48, max_write=8, max_step=8)
    a = run.new()
    for _ in range(3):
        run.step([a] * 8, attend=False)
    run.step([a] * 3, blocks=[a])


def test_v_narrower_than_k_on_chunked_layers_with_sinks_and_a_softcap():
    """K of 192 and V of 128 (one slice) on a chunked layer of 24 (a decode row whose
    chunk starts inside its tile), 2 kv heads of 4 query heads; each head's sink and a
    softcap of 5."""
    run = Wide(kv.chunked(24, head_dim=192, v_head_dim=128, n_kv_heads=2), hq=8,
               capacity=96, max_write=10, max_step=10)
    a = run.new()
    sinks = np.linspace(-1.0, 2.0, 8)
    for _ in range(5):
        run.step([a] * 10, attend=False)
    run.step([a] * 10, sinks=sinks, softcap=5.0)
    run.step([a], sinks=sinks, softcap=5.0)
    run.step([a] * 3, sinks=sinks)


@pytest.mark.parametrize("dtype, rank, rope", [("float8_e4m3", 512, 64),
                                              ("float8_e5m2", 120, 8)])
def test_fp8_latent_rows_at_a_scale(dtype, rank, rope):
    """Latent rows stored as 8-bit floats at scale 0.5, widened to float16 as they are
    staged: a prefill and a decode step against the rows as ml_dtypes rounds them."""
    pytest.importorskip("ml_dtypes")
    run = Wide(kv.latent(rank, rope), dtype=dtype, hq=4, capacity=16, scale=0.5)
    a = run.new()
    run.step([a] * 5)
    run.step([a])


def test_bfloat16_rows():
    """bfloat16 storage and queries: the mma in bfloat16."""
    pytest.importorskip("ml_dtypes")
    run = Wide(kv.latent(512, 64), dtype="bfloat16", hq=4, capacity=16)
    a = run.new()
    run.step([a] * 5)
    run.step([a])


def test_a_scale_that_is_not_positive_takes_the_generic_kernel():
    """The tensor cores' softmax needs a positive scale: a negative one is served by the
    generic kernel (float32 sums), decode and prefill."""
    run = Wide(kv.flat(head_dim=192, v_head_dim=128), hq=2, capacity=16)
    a = run.new()
    run.step([a] * 5, scale=-0.05)
    run.step([a], scale=-0.05)
