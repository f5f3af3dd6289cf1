"""Latent layers (contract §16): `kv.latent(rank, rope_dim)` stores one row of `rank +
rope_dim` values per position on one kv head; absorbed queries `[T, H, rank + rope_dim]`
attend over the rows as keys and over their first `rank` values as values, the output
`[T, H, rank]`.

Checked against float64 attention written here from the oracle's masks (keys: the rows
as stored; values: their first `rank` values), through prefills, a decode step with a
draft block, a fork that copies its straddling page, a rewind and a prefix hit; bytes
per token by hand; refusals that name the layer and change nothing; fp8 storage with
its one scale against the rows rounded by ml_dtypes.
"""
import numpy as np
import pytest

import kvnumba as kv
from kvnumba.arith.prefix_keys import page_keys
from oracle import dense_attention
from snapshot import assert_unchanged, snapshot

RANK, ROPE = 24, 8
HQ = 4


def rows_of(tokens, positions, width):
    """A position's latent row: a function of (token, position) alone (what a model
    writes), float32 `[n, 1, width]`."""
    return np.stack([np.random.default_rng([int(t), int(p)]).standard_normal((1, width))
                     for t, p in zip(tokens, positions)]).astype(np.float32)


class Run:
    """A cache of one latent layer and one flat layer of its own shape, and each
    sequence's stored rows, checked step by step."""

    def __init__(self, *, rank=RANK, rope=ROPE, dtype="float32", capacity=48, n_seqs=3,
                 **config):
        self.width, self.rank = rank + rope, rank
        self.config = kv.CacheConfig(layers=[kv.latent(rank, rope), kv.flat()], n_kv_heads=1,
                                     head_dim=8, capacity=capacity, max_seqs=n_seqs,
                                     max_write=8, max_step=12, dtype=dtype, page_size=8,
                                     **config)
        self.cache = kv.BatchedSequenceCache(self.config)
        self.rows = {}
        self.rng = np.random.default_rng(0)

    def new(self):
        seq = self.cache.seq_new()
        self.rows[seq] = np.zeros((0, 1, self.width))
        return seq

    def step(self, seqs, *, blocks=(), tol=1e-5):
        cache, n = self.cache, len(seqs)
        start = {s: cache.pos(s) for s in set(seqs)}
        plan = cache.declare_step(list(seqs), blocks=list(blocks))
        cache.prepare_step()
        tokens = self.rng.integers(0, 1000, n)
        rows = rows_of(tokens, plan.positions[:n], self.width)
        for s in start:
            mine = [i for i, t in enumerate(seqs) if t == s]
            self.rows[s] = np.concatenate([self.rows[s][:start[s]], rows[mine]])
        q = self.rng.standard_normal((n, HQ, self.width)).astype(np.float32)
        out = cache.update_and_attend(0, q, rows, None)
        assert out.shape == (n, HQ, self.rank)
        cache.write(1, np.zeros((n, 1, 8), np.float32), np.zeros((n, 1, 8), np.float32))
        for s in start:
            mine = [i for i, t in enumerate(seqs) if t == s]
            history = self.rows[s].astype(np.float64)
            want = dense_attention(q[mine], history, history[..., :self.rank], start[s],
                                   None, s in blocks, 1 / np.sqrt(self.width))
            np.testing.assert_allclose(out[mine].astype(np.float64), want, rtol=0, atol=tol,
                                       err_msg=f"seq {s}")
        cache.commit_step()

    def fork(self, seq):
        clone = self.cache.seq_clone(seq)
        self.rows[clone] = self.rows[seq].copy()
        return clone


def test_a_latent_layer_attends_over_its_rows_as_the_oracle_says():
    """Two prefills, a decode step with a two-token span and a draft block, a rewind
    whose new rows replace the old ones, and a fork that copies the page its next row
    writes into: each output against float64 attention over the sequence's rows."""
    run = Run()
    a, b = run.new(), run.new()
    run.step([a] * 6 + [b] * 5)
    run.step([a] * 5 + [b] * 4)
    run.step([a, a, b, b, b], blocks=[b])
    run.cache.rewind(a, 9)
    run.step([a] * 3)
    c = run.fork(b)
    assert run.cache.pos(c) == 12                        # page 1's 5th row: copied
    run.step([c, b, a])
    positions, k, v = run.cache.sequence_kv(c, 0)
    np.testing.assert_array_equal(positions, np.arange(13))
    np.testing.assert_array_equal(k, run.rows[c].astype(np.float32))
    np.testing.assert_array_equal(v, run.rows[c][..., :RANK].astype(np.float32))


def test_deepseek_v3s_latent_576_values_wide():
    """rank 512 + 64 rope values (DeepSeek-V3's): a prefill and a decode step."""
    run = Run(rank=512, rope=64, capacity=16, n_seqs=1)
    a = run.new()
    run.step([a] * 5, tol=2e-5)
    run.step([a], tol=2e-5)


def test_bytes_count_the_rows_alone():
    """A latent layer stores rank + rope_dim values a position (V is part of them); the
    flat layer beside it K and V."""
    config = Run().config
    assert config.layer_shapes[0] == kv.LayerShape(1, RANK + ROPE, RANK, True)
    assert config.bytes_per_token == 4 * (RANK + ROPE) + 4 * 2 * 8
    deepseek = kv.CacheConfig(layers=[kv.latent(512, 64)] * 61, n_kv_heads=1, head_dim=64,
                              dtype="bfloat16")
    assert deepseek.bytes_per_token == 61 * 1152          # DeepSeek-V3: 1,152 B a layer


def test_a_prefix_hit_restores_the_rows():
    """A 16-token sequence registered page by page; a hit at 8 holds its rows byte for
    byte, and the next tokens attend over them as over the writer's."""
    run = Run()
    tokens = np.arange(100, 116)
    keys = page_keys(tokens, 8)
    a = run.new()
    run.step([a] * 8)
    run.step([a] * 8)
    run.cache.prefix_register(a, keys)
    b = run.cache.seq_from_prefix(keys[:1])
    run.rows[b] = run.rows[a][:8].copy()
    assert run.cache.pos(b) == 8
    _, k, _ = run.cache.sequence_kv(b, 0)
    np.testing.assert_array_equal(k, run.rows[a][:8].astype(np.float32))
    run.step([b] * 3)


def test_refusals_name_the_layer_and_change_nothing():
    """A V given to a latent layer, rows of another width, a v_scale of its own: typed
    errors naming them; the step still prepared and committable."""
    run = Run(n_seqs=1)
    cache = run.cache
    a = run.new()
    cache.declare_step([a, a])
    cache.prepare_step()
    before = snapshot(cache)
    rows = np.zeros((2, 1, RANK + ROPE), np.float32)
    with pytest.raises(kv.ShapeError, match=r"write: layer 0 is latent: its rows \[width, 1, "
                                            r"32\] come as k and its V is their first "
                                            r"values; pass v=None"):
        cache.write(0, rows, rows[..., :RANK])
    with pytest.raises(kv.ShapeError, match=r"k: expected shape \(2, 1, 32\)"):
        cache.write(0, rows[..., :RANK], None)
    with pytest.raises(kv.ShapeError, match=r"q: expected shape \(2, 4, 32\) on layer 0"):
        cache.attend(0, np.zeros((2, HQ, RANK), np.float32))
    assert_unchanged(before, snapshot(cache))
    cache.write(0, rows, None)
    cache.write(1, np.zeros((2, 1, 8), np.float32), np.zeros((2, 1, 8), np.float32))
    cache.commit_step()
    assert cache.pos(a) == 2
    with pytest.raises(kv.ConfigError, match=r"v_scale\[0\]=2.0: layer 0 is latent"):
        kv.CacheConfig(layers=[kv.latent(8, 8)], head_dim=16, dtype="float8_e4m3",
                       k_scale=1.0, v_scale=2.0)
    with pytest.raises(kv.ConfigError, match=r"latent\(rank=512, rope_dim=128\): a latent "
                                             r"row holds 2 to 576 values"):
        kv.latent(512, 128)


@pytest.mark.parametrize("dtype", ["float8_e4m3", "float8_e5m2"])
def test_fp8_rows_with_their_one_scale(dtype):
    """Rows stored as 8-bit floats at one scale: attention over the rows as ml_dtypes
    rounds them (scaled, saturated), V their first values at the same scale. The tensor
    cores serve it (q, out and the summed probabilities in float16: 2e-3 of float64)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    held = {"float8_e4m3": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}
    scale = 0.5
    config = kv.CacheConfig(layers=[kv.latent(RANK, ROPE)], n_kv_heads=1, head_dim=8,
                            capacity=16, max_seqs=1, max_write=8, max_step=8, dtype=dtype,
                            k_scale=scale, v_scale=scale, page_size=8)
    cache = kv.BatchedSequenceCache(config)
    a = cache.seq_new()
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((6, 1, RANK + ROPE)).astype(np.float32)
    q = rng.standard_normal((6, HQ, RANK + ROPE)).astype(np.float16)
    cache.declare_step([a] * 6)
    cache.prepare_step()
    out = cache.update_and_attend(0, q, rows, None)
    cache.commit_step()
    largest = float(ml_dtypes.finfo(held[dtype]).max)
    stored = np.clip(rows / scale, -largest, largest).astype(held[dtype]).astype(np.float64)
    keys = stored * scale
    want = dense_attention(q, keys, keys[..., :RANK], 0, None, False,
                           1 / np.sqrt(RANK + ROPE))
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=0, atol=2e-3)
