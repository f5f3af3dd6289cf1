"""Layers of several shapes and shared layers in one cache (contract §15): per-layer
`n_kv_heads`, `head_dim` and `v_head_dim` (head dims to 512), and `kv.shared(producer)`,
which attends over its producer's K/V and stores nothing.

Each test checks the cache against references written here and in tests/oracle.py,
never against kvnumba:
- attention of every layer against float64 attention over its own (a shared layer: its
  producer's) history with the explicit mask, on the fast paths (head dims 16 and 32, K
  and V of one width) and the generic kernel (V narrower and wider than K, head dims 12
  and 512), with rings wrapping, a draft block, two spans of one sequence in a step, a
  rewind, a fork that copies its shared page and split-K at head dim 512;
- bytes as hand-worked sums of each storing layer's heads and widths;
- the prefix index: a hit restores every layer's rows byte for byte;
- refusals that name the layer and leave the step as it was.
"""
import functools

import numpy as np
import pytest

import kvnumba as kv
from kvnumba.arith.prefix_keys import page_keys
from oracle import dense_attention

HQ = 4
#: absolute errors against float64: float16 storage and outputs (the tensor cores, on
#: prefill spans and on decode segments of more than 4 rows, sum probabilities rounded to
#: 16 bits)
TOL = {"decode": 6e-3, "prefill": 6e-3}


class Run:
    """A cache of `layers` (one `kv.LayerSpec` each) and, per sequence and storing layer,
    the K/V history it should hold (rewritten where a rewind lets new tokens replace old
    ones, copied on a fork)."""

    def __init__(self, layers, *, capacity, max_write, max_step, n_seqs=2, live=None,
                 dtype="float16", seed=0, hq=HQ, **config):
        self.config = kv.CacheConfig(layers=layers, n_kv_heads=2, head_dim=16,
                                     capacity=capacity, max_seqs=n_seqs, max_write=max_write,
                                     max_step=max_step, dtype=dtype, page_size=8, **config)
        self.cache = kv.BatchedSequenceCache(self.config)
        self.dtype = np.dtype(np.float16 if dtype == "float16" else np.float32)
        self.rng = np.random.default_rng(seed)
        self.hq = hq
        self.k, self.v = {}, {}
        for _ in range(n_seqs if live is None else live):
            self.new()

    def new(self, seq=None):
        seq = self.cache.seq_new() if seq is None else seq
        for layer, (heads, d, dv, _) in enumerate(self.config.layer_shapes):
            self.k[seq, layer] = np.zeros((0, heads, d))
            self.v[seq, layer] = np.zeros((0, heads, dv))
        return seq

    def step(self, seqs, *, blocks=(), attend=True, tol=None):
        """One step of token list `seqs` (each token its sequence, in order): fresh random
        q/k/v, every storing layer written, every layer (`attend`) attended, a shared
        layer with `attend` alone, and checked against `dense_attention` with its
        producer's mask over its producer's history."""
        cache, config, n = self.cache, self.config, len(seqs)
        start = {s: cache.pos(s) for s in set(seqs)}
        cache.declare_step(list(seqs), blocks=list(blocks))
        cache.prepare_step()
        for layer, (heads, d, dv, _) in enumerate(config.layer_shapes):
            source = config.source(layer)
            spec = config.layers[source]
            q = (2 * self.rng.standard_normal((n, self.hq, d))).astype(self.dtype)
            if spec is config.layers[layer]:       # a storing layer: its own K/V
                k = (2 * self.rng.standard_normal((n, heads, d))).astype(self.dtype)
                v = (2 * self.rng.standard_normal((n, heads, dv))).astype(self.dtype)
                for s in start:
                    mine = [i for i, t in enumerate(seqs) if t == s]
                    self.k[s, layer] = np.concatenate([self.k[s, layer][:start[s]], k[mine]])
                    self.v[s, layer] = np.concatenate([self.v[s, layer][:start[s]], v[mine]])
                if not attend:
                    cache.write(layer, k, v)
                    continue
                out = cache.update_and_attend(layer, q, k, v)
            elif not attend:
                continue
            else:
                out = cache.attend(layer, q)
            assert out.shape == (n, self.hq, dv)
            for s in start:
                mine = [i for i, t in enumerate(seqs) if t == s]
                want = dense_attention(q[mine], self.k[s, source], self.v[s, source],
                                       start[s], spec.window, s in blocks, 1 / np.sqrt(d),
                                       chunk=spec.chunk)
                np.testing.assert_allclose(out[mine].astype(np.float64), want, rtol=0,
                                           atol=tol, err_msg=f"seq {s} layer {layer}")
        cache.commit_step()

    def fork(self, seq):
        clone = self.cache.seq_clone(seq)
        for layer in range(self.config.n_layers):
            self.k[clone, layer] = self.k[seq, layer].copy()
            self.v[clone, layer] = self.v[seq, layer].copy()
        return clone

    def rewind(self, seq, position):
        self.cache.rewind(seq, position)


#: two layers of one shape on the fast paths (float16, K and V 16 or 32 wide), shared
#: layers of each kind, and the generic kernel's: V narrower (8) and wider (20) than K
LAYERS = [kv.flat(n_kv_heads=2, head_dim=16), kv.ring(6, n_kv_heads=1, head_dim=32),
          kv.shared(1), kv.flat(head_dim=16, v_head_dim=8),
          kv.chunked(5, head_dim=12, v_head_dim=20), kv.shared(3)]


def test_layers_of_several_shapes_and_shared_layers_attend_as_the_oracle_says():
    """Window 6 (M 5: 10 rows), chunks of 5 (9 rows): three prefill steps wrap the rings;
    a decode step holds a draft block and two spans of one sequence; a rewind's new
    tokens replace the old ones; a fork copies the page its next token writes into and
    both sequences attend over their own histories."""
    run = Run(LAYERS, capacity=48, max_write=5, max_step=10, n_seqs=3, live=2)
    cache = run.cache
    assert [len(p.layers) for p in cache.pool_pages()] == [2, 1, 1]  # flat 0, 3; ring 1; 4
    for _ in range(3):
        run.step([0] * 5 + [1] * 5, attend=False)
    assert cache.high_water(0) == 15 > 10
    run.step([0, 0, 1, 1, 1, 0], blocks=[1], tol=TOL["decode"])      # spans 2 + 1; a block
    run.rewind(0, cache.floor(0))
    run.step([0] * 5 + [1] * 5, tol=TOL["prefill"])
    fork = run.fork(1)
    assert cache.pos(fork) == cache.pos(1) == 23                      # page 2's 7th row
    run.step([1, fork, 0], tol=TOL["decode"])
    run.step([fork, 1], tol=TOL["decode"])


def test_the_generic_kernel_serves_head_dim_512():
    """A flat layer of head dim 512 (one kv head, one query head) and its shared layer:
    a prefill and a decode step (float32 sums of 512 products: 5e-5 of float64's; V
    narrower than K at 512 and split-K at 512 are tests/test_generic_shapes.py's)."""
    layers = [kv.flat(n_kv_heads=1, head_dim=512), kv.shared(0)]
    run = Run(layers, capacity=16, max_write=3, max_step=3, n_seqs=1, dtype="float32", hq=1)
    run.step([0] * 3, tol=5e-5)
    run.step([0], tol=5e-5)
    assert run.cache.pos(0) == 4


def test_bytes_count_each_storing_layer_by_its_own_shape():
    """bytes_per_token, nbytes and the bytes held sum each storing layer's heads x (K
    width + V width) x itemsize; shared layers add nothing."""
    config = kv.CacheConfig(layers=LAYERS, n_kv_heads=2, head_dim=16, capacity=48,
                            max_seqs=2, max_write=5, max_step=10, dtype="float16",
                            page_size=8)
    per_layer = [2 * (16 + 16), 1 * (32 + 32), 0, 2 * (16 + 8), 2 * (12 + 20), 0]
    assert config.bytes_per_token == 2 * sum(per_layer) == 2 * 240
    assert [kind.position_bytes for kind in config.page_groups] == \
        [2 * (64 + 48), 2 * 64, 2 * 64]
    cache = kv.BatchedSequenceCache(config)
    allocated = [p.allocated for p in cache.pool_pages()]
    assert cache.nbytes == 8 * 2 * sum(n * b for n, b in zip(allocated, (112, 64, 64)))
    seq = cache.seq_new()
    cache.declare_step([seq] * 5)
    cache.prepare_step()
    for layer in cache.config.storing_layers:
        heads, d, dv, _ = config.layer_shapes[layer]
        cache.write(layer, np.zeros((5, heads, d), np.float16),
                    np.zeros((5, heads, dv), np.float16))
    cache.commit_step()
    # one flat page, the window's ring of 10 rows (2 pages), the chunks' of 9 (2 pages)
    assert cache.nbytes_held == 8 * 2 * (1 * 112 + 2 * 64 + 2 * 64)
    # a fixed pool of N bytes: N // (page_size x bytes_per_token) page ids per kind
    fixed = config.fixed_pool(100 * 8 * config.bytes_per_token)
    assert fixed.max_pages == fixed.initial_pages == 100
    assert kv.BatchedSequenceCache(fixed).nbytes == 100 * 8 * config.bytes_per_token


def kv_rows(tokens, positions, layer, shape):
    """K and V of `tokens` at `positions` on `layer`: a function of the three only (what a
    model would write), float32 `[n, heads, d]` / `[n, heads, dv]`."""
    heads, d, dv, _ = shape
    seeds = [np.random.default_rng([int(t), int(p), layer]) for t, p in zip(tokens, positions)]
    k = np.stack([g.standard_normal((heads, d)) for g in seeds]) if seeds else \
        np.zeros((0, heads, d))
    v = np.stack([g.standard_normal((heads, dv)) for g in seeds]) if seeds else \
        np.zeros((0, heads, dv))
    return k.astype(np.float32), v.astype(np.float32)


def test_a_prefix_hit_restores_every_layer_of_its_own_shape():
    """A 24-token sequence registered page by page; a hit at 16 holds each storing
    layer's rows byte for byte (a shared layer reads its producer's), and its next
    tokens attend as the oracle says over the writer's history."""
    layers = [kv.flat(n_kv_heads=1, head_dim=8), kv.ring(9, head_dim=4, v_head_dim=12),
              kv.shared(0)]
    config = kv.CacheConfig(layers=layers, n_kv_heads=2, head_dim=8, capacity=32,
                            max_seqs=2, max_write=4, max_step=4, dtype="float32",
                            page_size=8)
    cache = kv.BatchedSequenceCache(config)
    tokens = np.random.default_rng(3).integers(0, 1000, 24)
    keys = page_keys(tokens, 8)
    a = cache.seq_new()
    for at in range(0, 24, 4):
        cache.declare_step([a] * 4)
        cache.prepare_step()
        for layer in config.storing_layers:
            cache.write(layer, *kv_rows(tokens[at:at + 4], np.arange(at, at + 4), layer,
                                        config.layer_shapes[layer]))
        cache.commit_step()
        cache.prefix_register(a, keys[:(at + 4) // 8])
    b = cache.seq_from_prefix(keys[:2])
    assert cache.pos(b) == 16
    for layer in range(3):
        source = config.source(layer)
        positions, k, v = cache.sequence_kv(b, layer)
        assert positions[-1] == 15 and positions[0] == (0 if source != 1 else 16 - (9 - 1))
        want_k, want_v = kv_rows(tokens[positions], positions, source,
                                 config.layer_shapes[source])
        np.testing.assert_array_equal(k, want_k)
        np.testing.assert_array_equal(v, want_v)
    cache.declare_step([b] * 3)
    cache.prepare_step()
    q = np.random.default_rng(4).standard_normal((3, HQ, 8)).astype(np.float32)
    for layer, spec in enumerate(layers):
        source = config.source(layer)
        shape = config.layer_shapes[source]
        new = kv_rows(tokens[16:19], np.arange(16, 19), source, shape)
        q_layer = q[..., :shape.head_dim]
        out = cache.update_and_attend(layer, q_layer, *new) if spec.stores else \
            cache.attend(layer, q_layer)
        old = kv_rows(tokens[:16], np.arange(16), source, shape)
        want = dense_attention(q_layer, np.concatenate([old[0], new[0]]),
                               np.concatenate([old[1], new[1]]), 16,
                               config.layers[source].window, False,
                               1 / np.sqrt(shape.head_dim))
        np.testing.assert_allclose(out, want, rtol=0, atol=1e-5, err_msg=f"layer {layer}")
    cache.abort_step()


def test_refusals_name_the_layer_and_change_nothing():
    """A write to a shared layer, an attend of a shared layer before its producer is
    written, K/V or q of another layer's shape: each a typed error naming the layer, the
    step still prepared and committable once its storing layers are written."""
    run = Run(LAYERS, capacity=48, max_write=5, max_step=10, n_seqs=1, dtype="float32")
    cache, config = run.cache, run.config
    cache.declare_step([0, 0])
    cache.prepare_step()
    k16, v16 = np.zeros((2, 2, 16), np.float32), np.zeros((2, 2, 16), np.float32)
    with pytest.raises(kv.ShapeError, match=r"write: layer 2 is shared with layer 1 and "
                                            r"stores nothing; write layer 1"):
        cache.write(2, np.zeros((2, 1, 32), np.float32), np.zeros((2, 1, 32), np.float32))
    with pytest.raises(kv.ShapeError, match=r"update_and_attend|layer 5 is shared"):
        cache.update_and_attend(5, np.zeros((2, HQ, 16), np.float32), k16, v16)
    with pytest.raises(kv.StepProtocolError, match=r"has not written layer 1's K/V, which "
                                                   r"shared layer 2 reads"):
        cache.attend(2, np.zeros((2, HQ, 32), np.float32))
    with pytest.raises(kv.ShapeError, match=r"v: expected shape \(2, 2, 8\)"):
        cache.write(3, k16, v16)                           # layer 3's V is 8 wide
    with pytest.raises(kv.ShapeError, match=r"q: n_q_heads=3 must be a positive multiple "
                                            r"of layer 0's n_kv_heads=2"):
        cache.attend(0, np.zeros((2, 3, 16), np.float32))
    with pytest.raises(kv.ShapeError, match=r"q: expected shape \(2, 4, 32\) on layer 2"):
        cache.attend(2, np.zeros((2, HQ, 16), np.float32))
    cache.write(0, k16, v16)
    cache.write(3, k16, np.zeros((2, 2, 8), np.float32))
    with pytest.raises(kv.ShapeError, match=r"out: expected shape \(2, 4, 8\)"):
        cache.attend(3, np.zeros((2, HQ, 16), np.float32),
                     out=np.zeros((2, HQ, 16), np.float32))
    with pytest.raises(kv.StepProtocolError, match=r"wrote layers \[0, 3\] but not \[1, 4\]"):
        cache.commit_step()
    assert cache.pos(0) == 0 and cache.high_water(0) == 0
    for layer in (1, 4):
        heads, d, dv, _ = config.layer_shapes[layer]
        cache.write(layer, np.zeros((2, heads, d), np.float32),
                    np.zeros((2, heads, dv), np.float32))
    cache.commit_step()                                    # shared layers need no write
    assert cache.pos(0) == 2


@pytest.mark.parametrize("layers, match", [
    ([kv.flat(), kv.shared(2)], r"layers\[1\]=shared\(2\): the producer must be another "
                                r"layer that stores K/V \(there are 2 layers\)"),
    ([kv.flat(), kv.shared(1)], r"a layer cannot share its own K/V"),
    ([kv.flat(), kv.shared(0), kv.shared(1)], r"layer 1 is itself shared with layer 0"),
])
def test_shared_layers_need_a_producer_that_stores(layers, match):
    with pytest.raises(kv.ConfigError, match=match):
        kv.CacheConfig(layers=layers)


@pytest.mark.parametrize("build, match", [
    (functools.partial(kv.flat, head_dim=513), r"head_dim=513\): head_dim must be None or an "
                                               r"integer in \[1, 512\]"),
    (functools.partial(kv.ring, 4, v_head_dim=0), r"v_head_dim=0\)"),
    (functools.partial(kv.chunked, 4, n_kv_heads=1.5), r"n_kv_heads=1.5\)"),
    (functools.partial(kv.LayerSpec, window=4, producer=0),
     r"a shared layer takes its producer's kind and shape; set them on layer 0"),
    (functools.partial(kv.shared, None), r"shared\(producer=None\)"),
])
def test_layer_shapes_are_checked_by_name(build, match):
    with pytest.raises(kv.ConfigError, match=match):
        build()
