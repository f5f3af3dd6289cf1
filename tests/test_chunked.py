"""Chunked layers (`kv.chunked(size)`, contract §15): the query at position p sees the
keys `[C * (p // C), p]`, stored as a ring of `min(capacity, C + max_write - 1)` rows.

Each test checks the cache against references written here and in tests/oracle.py,
never against kvnumba:
- attention on every path (fast decode and tensor-core prefill at head_dim 16, the
  generic kernel at head_dim 12), with rings wrapping, draft blocks, several spans of
  one sequence in a step, and rewinds across a chunk boundary, against float64
  attention over each sequence's own history with the explicit chunk mask;
- the split-K combine of a long chunk, on the fast and the generic decode paths;
- floors as hand-worked vectors and as the oracle's search, refusals naming the layer
  and leaving everything as it was;
- the prefix index: a hit at every page boundary L restores `[C * (L // C), L)`, its
  floor is `C * (L // C)`, and the sequence attends as the oracle says.
"""
import functools

import numpy as np
import pytest

import kvnumba as kv
from kvnumba.arith.prefix_keys import page_keys
from kvnumba.kernels import decode
from oracle import dense_attention, floor, ring_rows

H, HQ = 2, 4
PATHS = {"fast kernels": 16, "generic kernel": 12}      # head_dim -> which kernels serve
#: absolute errors against float64 (float16 storage and outputs; the tensor-core prefill
#: sums probabilities rounded to 16 bits)
TOL = {"decode": 2e-3, "prefill": {16: 6e-3, 12: 2e-3}}


class Run:
    """A cache of `layers` and, per sequence and layer, the K/V history it should hold
    (rewritten where a rewind lets new tokens replace old ones)."""

    def __init__(self, layers, head_dim, *, capacity, max_write, max_step, n_seqs=2,
                 dtype="float16", seed=0):
        self.specs = layers
        self.cache = kv.BatchedSequenceCache(kv.CacheConfig(
            layers=layers, n_kv_heads=H, head_dim=head_dim, capacity=capacity,
            max_seqs=n_seqs, max_write=max_write, max_step=max_step, dtype=dtype,
            page_size=8))
        self.dtype = np.dtype(np.float16 if dtype == "float16" else np.float32)
        self.rng = np.random.default_rng(seed)
        self.head_dim = head_dim
        self.k = [[np.zeros((0, H, head_dim)) for _ in layers] for _ in range(n_seqs)]
        self.v = [[np.zeros((0, H, head_dim)) for _ in layers] for _ in range(n_seqs)]
        for _ in range(n_seqs):
            self.cache.seq_new()

    def step(self, seqs, *, blocks=(), attend=True, tol=None):
        """One step of token list `seqs` (each token its sequence, in order): fresh random
        q/k/v, every layer written and (`attend`) attended and checked against
        `dense_attention` with the layer's own mask over the sequence's history."""
        cache, n = self.cache, len(seqs)
        start = {s: cache.pos(s) for s in set(seqs)}
        positions, seen = [], {s: 0 for s in start}
        for s in seqs:
            positions.append(start[s] + seen[s])
            seen[s] += 1
        cache.declare_step(list(seqs), blocks=list(blocks))
        cache.prepare_step()
        d = self.head_dim
        for layer, spec in enumerate(self.specs):
            q, k, v = [(2 * self.rng.standard_normal((n, heads, d))).astype(self.dtype)
                       for heads in (HQ, H, H)]
            for s in start:                    # the new rows replace what a rewind left
                mine = [i for i, t in enumerate(seqs) if t == s]
                keep = start[s]
                self.k[s][layer] = np.concatenate([self.k[s][layer][:keep], k[mine]])
                self.v[s][layer] = np.concatenate([self.v[s][layer][:keep], v[mine]])
            if not attend:
                cache.write(layer, k, v)
                continue
            out = cache.update_and_attend(layer, q, k, v).astype(np.float64)
            for s in start:
                mine = [i for i, t in enumerate(seqs) if t == s]
                want = dense_attention(q[mine], self.k[s][layer], self.v[s][layer], start[s],
                                       spec.window, s in blocks, 1 / np.sqrt(d),
                                       chunk=spec.chunk)
                np.testing.assert_allclose(out[mine], want, rtol=0, atol=tol,
                                           err_msg=f"seq {s} layer {layer} ({spec})")
        cache.commit_step()

    def rewind(self, seq, position):
        self.cache.rewind(seq, position)


#: per path, the chunked layers (the simulator runs the fast kernels slowly: one layer)
PATH_LAYERS = {"fast kernels": (6,), "generic kernel": (6, 9)}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_chunked_attention_on_every_path_with_wraps_blocks_spans_and_rewinds(path):
    """Chunks of 6 (M 5: 10 rows), and of 9 (13 rows) on the generic path: steps written
    across chunk boundaries wrap the rings; a decode step holds a draft block and a
    sequence of two spans; a rewind goes back across a chunk boundary, a prefill step's
    new tokens replace the old ones, and a decode step reads them."""
    head_dim = PATHS[path]
    chunks = PATH_LAYERS[path]
    run = Run([kv.chunked(c) for c in chunks], head_dim, capacity=40, max_write=5,
              max_step=10)
    for _ in range(3):                       # 15 positions each: the rings wrapped
        run.step([0] * 5 + [1] * 5, attend=False)
    assert run.cache.high_water(0) == 15 > ring_rows(max(chunks), 5, 40)
    run.step([0, 0, 1, 1, 1, 0], blocks=[1], tol=TOL["decode"])      # spans 2 + 1; a block
    assert (run.cache.pos(0), run.cache.pos(1)) == (18, 18)
    # a rewind from chunk [18, 24) back into [12, 18) (to the floor: the oracle's search)
    assert run.cache.floor(0) == floor(18, [], 5, 40, chunks) == 12
    run.rewind(0, 12)
    run.step([0] * 5 + [1] * 5, tol=TOL["prefill"][head_dim])        # 12..16 rewritten
    run.step([0, 1], tol=TOL["decode"])
    assert (run.cache.pos(0), run.cache.pos(1)) == (18, 24)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_long_chunk_split_into_decode_chunks_is_combined(path, monkeypatch):
    """A chunk of 160 keys read by a decode query 150 positions into it: the fast path
    cuts it into key chunks of 64 and combines them, the generic path splits K; beside it
    a sequence whose query is the first of a chunk (it sees itself only)."""
    monkeypatch.setattr(decode, "chunks_into",
                        functools.partial(decode.chunks_into, chunk=decode.KEY_TILE))
    monkeypatch.setattr(decode, "CHUNK_KEYS", decode.KEY_TILE)       # the generic split-K
    run = Run([kv.chunked(160)], PATHS[path], capacity=320, max_write=64, max_step=72)
    for _ in range(4):
        run.step([0] * 64, attend=False)
    run.step([0] * 54 + [1] * 16, attend=False)                       # 0 at 310, 1 at 16
    for _ in range(9):
        run.step([1] * 16, attend=False)
    assert (run.cache.pos(0), run.cache.pos(1)) == (310, 160)
    run.cache.declare_step([0, 1])
    run.cache.prepare_step()
    routes = run.cache._steps.step.routes
    run.cache.abort_step()
    if routes.decode_chunks:                                          # fast: one split
        assert routes.decode_chunks[-160].n_combine == 1
        assert routes.decode_chunks[-160].n_parts > 1
    run.step([0, 1], tol=TOL["decode"])


def floor_cache(layers, max_write=3, capacity=64):
    return kv.BatchedSequenceCache(kv.CacheConfig(
        layers=layers, n_kv_heads=1, head_dim=2, capacity=capacity, max_seqs=2,
        max_write=max_write, max_step=max_write * 2, dtype="float32", page_size=8))


def write_to(cache, seq, upto, n):
    while cache.pos(seq) < upto:
        cache.declare_step([seq] * min(n, upto - cache.pos(seq)))
        cache.prepare_step()
        cache.commit_step()


@pytest.mark.parametrize("layers,upto,want,layer", [
    # chunks of 4, M 3: R 6 holds [hw - 6, hw); resuming at L needs [4 (L // 4), L)
    ([kv.flat(), kv.chunked(4)], 6, 0, 1),           # never wrapped
    ([kv.flat(), kv.chunked(4)], 7, 4, 1),           # holds [1, 7): 4 is the first start
    ([kv.flat(), kv.chunked(4)], 21, 16, 1),         # holds [15, 21)
    ([kv.flat(), kv.chunked(4)], 20, 16, 1),         # holds [14, 20)
    ([kv.flat(), kv.chunked(4)], 18, 12, 1),         # holds [12, 18): 12 itself
    # a sliding window wrapped binds (hw - M is never below a chunk's floor)
    ([kv.chunked(4), kv.ring(window=4)], 21, 18, 1),
    # a window not yet wrapped (R 12) leaves the chunked layer's floor
    ([kv.ring(window=10), kv.flat(), kv.chunked(4)], 10, 4, 2),
])
def test_floor_vectors(layers, upto, want, layer):
    cache = floor_cache(layers)
    s = cache.seq_new()
    write_to(cache, s, upto, 3)
    windows = [spec.window for spec in layers]
    chunks = [spec.chunk for spec in layers if spec.chunk]
    assert cache.floor(s) == want == floor(upto, windows, 3, 64, chunks)
    if want:
        d = cache.seq_clone(s, upto=want)                # at the floor: allowed
        assert (cache.pos(d), cache.floor(d)) == (want, want)
        cache.seq_rm(d)
        with pytest.raises(kv.RingFloorError) as err:
            cache.rewind(s, want - 1)
        message = str(err.value)
        assert f"layer {layer}" in message and str(want - 1) in message and str(want) in message
        assert (cache.pos(s), cache.state(s)) == (upto, kv.SlotState.COMMITTED)
    cache.rewind(s, want)
    assert (cache.pos(s), cache.state(s)) == (want, kv.SlotState.REWOUND)


def test_floors_follow_the_oracle_at_every_high_water():
    """Every high-water to 40 for chunks of 3, 5, 8 and 13 at M 1..4: the cache's floor is
    the oracle's search, and a rewind to it then a step attends (no refusal)."""
    for chunk in (3, 5, 8, 13):
        for max_write in (1, 2, 4):
            cache = floor_cache([kv.chunked(chunk)], max_write=max_write, capacity=48)
            s = cache.seq_new()
            for hw in range(1, 41):
                write_to(cache, s, hw, 1)
                assert cache.floor(s) == floor(hw, [], max_write, 48, [chunk]), \
                    (chunk, max_write, hw)


def kv_rows(tokens, positions, layer, d):
    """K and V `[n, H, d]` float32 of tokens at positions on a layer: a pure function."""
    seeds = np.asarray(tokens, np.int64) * 1_000_003 + np.asarray(positions) * 131 + layer
    k = np.stack([np.random.default_rng(int(s)).standard_normal((H, d)) for s in seeds])
    v = np.stack([np.random.default_rng(int(s) + 7).standard_normal((H, d)) for s in seeds])
    return k.astype(np.float32), v.astype(np.float32)


def test_a_prefix_hit_at_every_page_boundary_restores_the_chunk_it_reads():
    """Chunks of 12 and of 5 (M 4: rings of 15 and 8 rows) beside a flat layer, pages of
    8: a 48-token sequence registered after each step; a hit at each page boundary L
    holds `[C (L // C), L)` of each chunked layer (what it holds, the writer's bytes), has floor
    `max C (L // C)`, refuses a rewind below it, and its next tokens attend as the
    oracle says over the writer's history."""
    d, page, m = 8, 8, 4
    layers = [kv.flat(), kv.chunked(12), kv.chunked(5)]
    cache = kv.BatchedSequenceCache(kv.CacheConfig(
        layers=layers, n_kv_heads=H, head_dim=d, capacity=64, max_seqs=2, max_write=m,
        max_step=m, dtype="float32", page_size=page))
    tokens = np.random.default_rng(3).integers(0, 1000, 48)
    keys = page_keys(tokens, page)
    a = cache.seq_new()
    for at in range(0, 48, m):
        cache.declare_step([a] * m)
        cache.prepare_step()
        for layer in range(3):
            cache.write(layer, *kv_rows(tokens[at:at + m], np.arange(at, at + m), layer, d))
        cache.commit_step()
        cache.prefix_register(a, keys[:(at + m) // page])
    assert cache.prefix_match(keys) == 6
    rng = np.random.default_rng(4)
    for pages in range(1, 6):
        hit = pages * page
        b = cache.seq_from_prefix(keys[:pages])
        assert cache.pos(b) == hit
        assert cache.floor(b) == max(12 * (hit // 12), 5 * (hit // 5))
        for layer, spec in enumerate(layers[1:], 1):
            positions, k, v = cache.sequence_kv(b, layer)
            start = spec.chunk * (hit // spec.chunk)
            assert positions[0] <= start and positions[-1] == hit - 1
            want_k, want_v = kv_rows(tokens[positions], positions, layer, d)
            np.testing.assert_array_equal(k, want_k)
            np.testing.assert_array_equal(v, want_v)
        with pytest.raises(kv.RingFloorError):
            cache.rewind(b, cache.floor(b) - 1)
        assert cache.pos(b) == hit
        cache.declare_step([b] * 3)
        cache.prepare_step()
        q = rng.standard_normal((3, HQ, d)).astype(np.float32)
        for layer, spec in enumerate(layers):
            k, v = kv_rows(tokens[hit:hit + 3], np.arange(hit, hit + 3), layer, d)
            out = cache.update_and_attend(layer, q, k, v)
            keys_k, keys_v = (np.concatenate([kv_rows(tokens[:hit], np.arange(hit), layer,
                                                      d)[i], x]) for i, x in ((0, k), (1, v)))
            want = dense_attention(q, keys_k, keys_v, hit, None, False, 1 / np.sqrt(d),
                                   chunk=spec.chunk)
            np.testing.assert_allclose(out, want, rtol=0, atol=1e-5,
                                       err_msg=f"hit {hit} layer {layer}")
        cache.abort_step()
        cache.seq_rm(b)


def test_chunked_specs_are_checked_and_named():
    assert kv.chunked(8) == kv.LayerSpec(chunk=8) and kv.chunked(8).kind.mask_code == -8
    assert kv.chunked(8).is_ring and kv.ring(window=8).kind.mask_code == 8
    assert kv.flat().kind.mask_code == 0
    for bad in (0, -1, 2.5, True, "8", 2**31):
        with pytest.raises(kv.ConfigError, match="chunk"):
            kv.chunked(bad)
    with pytest.raises(kv.ConfigError, match="chunk"):
        kv.chunked(None)
    with pytest.raises(kv.ConfigError, match="not both"):
        kv.LayerSpec(window=4, chunk=4)
    config = kv.CacheConfig(layers=[kv.chunked(100), kv.ring(window=100), kv.flat()],
                            capacity=4096, max_write=28)
    assert config.ring_rows().tolist() == [127, 127, 0]
    assert [k.name for k in config.page_groups] == ["flat layers", "ring layers of 127 rows"]
