"""The tensor-core prefill kernel (kvnumba.kernels.prefill) against float64 attention.

Storage, histories and the flat step table are built by hand here; storage is NaN
wherever no query of a segment may look, and so is every row of `out` the kernel must
not write. The kernel reads the storage paged (`paging.paged`: pages in shuffled order,
NaN in pages no column references and past a column's last row), at page size 16
unless a test says otherwise. The reference (`oracle.dense_attention`) works from dense
histories and explicit masks. On the simulator the tiles are tiny (16 rows x 16 keys)
and the key counts small: every warp-wide instruction costs about a millisecond there.
"""
import numpy as np
import pytest

from kvnumba import device
from kvnumba.device import cuda
from kvnumba.kernels import prefill
from kvnumba.kernels.prefill import shape as prefill_shape
from kvnumba.kernels.launch.calling import aligned
from kvnumba.arith.positions import (SEQ, FLAG_BLOCK, FLAGS, POS_START, Q_LEN, Q_START,
                                    SEQ_INFO_FIELDS)
from oracle import (FP8, bf16_values, dense_attention, fp8_stored, round_nearest_even,
                    seen_positions)
from paging import page_bits, paged

SMALL = (16, 16)                # (block_rows, block_keys): one warp, one k16 step of keys
TWO_WARPS = (32, 16, 16)        # ... and rows per warp: two warps of 16 rows
WIDE_WARP = (32, 16, 32)        # one warp of 32 rows (two m16 halves)
TWO_WIDE_WARPS = (64, 32, 32)
only_gpu = pytest.mark.skipif(device.SIMULATOR, reason="full-size shapes need a GPU")


class _StaleShared:
    """`numpy` for `kvnumba.device`, whose simulator shared arrays then start as all-ones
    bytes (NaN as float16 and bfloat16), as stale shared memory may on a GPU."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def empty(shape, dtype):
        array = np.empty(shape, dtype)
        array.view(np.uint8)[...] = 0xFF
        return array


@pytest.fixture
def stale_shared_memory(monkeypatch):
    if device.SIMULATOR:
        monkeypatch.setattr(device, "np", _StaleShared())


class Case:
    """Hand-built inputs of one launch and what it must produce."""


def make_case(rng, segments, *, served=None, n_kv_heads=2, group=2, head_dim=16, window=0,
              ring_rows=0, q_dtype=np.float16, out_dtype=np.float16, softcap=0.0,
              storage="float16", page_size=16):
    """segments: (q_len, pos_start, block) per segment of the step table; `served`: the
    indices the kernel is given (default all). Each segment has its own column; a gap
    token of NaN queries sits before each segment on the token axis. The storage is
    kept as columns (`c.columns`: K and V `[rows, n_cols, H, D]`) and as the kernel
    reads it: slots `c.k_store`, `c.v_store` in pages of `page_size` rows, `c.pages`."""
    c = Case()
    c.window, c.ring_rows, c.softcap, c.storage = window, ring_rows, softcap, storage
    c.scale = 1.0 / np.sqrt(head_dim)
    c.served = list(range(len(segments))) if served is None else list(served)
    n_q_heads = n_kv_heads * group
    n_cols = len(segments) + 1
    cols = rng.permutation(n_cols)[:len(segments)]
    rows = ring_rows or max(p + n for n, p, _ in segments) + 2
    shape = (rows, n_cols, n_kv_heads, head_dim)
    k_store = np.full(shape, np.nan, np.float32)
    v_store = np.full(shape, np.nan, np.float32)
    q_start, info, c.segments = 0, [], []
    for (q_len, pos_start, block), col in zip(segments, cols):
        kv_len = pos_start + q_len
        keys = rng.standard_normal((kv_len, n_kv_heads, head_dim)).astype(np.float32)
        values = rng.standard_normal((kv_len, n_kv_heads, head_dim)).astype(np.float32)
        if storage == "bfloat16":
            keys = bf16_values(round_nearest_even(keys, "bf16"))
            values = bf16_values(round_nearest_even(values, "bf16"))
        elif storage in FP8:                            # the values fp8 holds, exactly
            keys, values = fp8_stored(keys, storage)[1], fp8_stored(values, storage)[1]
        else:
            keys, values = keys.astype(np.float16), values.astype(np.float16)
        seen = seen_positions(q_len, pos_start, block, window)
        stored = seen % ring_rows if ring_rows else seen
        assert len(set(stored)) == len(stored), "test bug: ring too small"
        k_store[stored, col] = keys[seen]
        v_store[stored, col] = values[seen]
        q_start += 1                                    # a gap token nobody owns
        info.append((q_start, q_len, col, pos_start, FLAG_BLOCK if block else 0))
        c.segments.append((q_start, q_len, pos_start, block, keys, values))
        q_start += q_len
    width = q_start + 2
    q = np.full((width, n_q_heads, head_dim), np.nan, np.float32)
    for seg in c.segments:
        q[seg[0]:seg[0] + seg[1]] = rng.standard_normal((seg[1], n_q_heads, head_dim))
    if q_dtype == "bfloat16":                           # bit patterns, as the cache holds them
        c.q = round_nearest_even(q, "bf16")
        c.q_values = bf16_values(c.q)
    else:
        c.q = q.astype(q_dtype)
        c.q_values = c.q.astype(np.float64)
    if storage == "bfloat16":
        c.columns = round_nearest_even(k_store, "bf16"), round_nearest_even(v_store, "bf16")
    elif storage in FP8:                                # their bits; NaN where none is held
        c.columns = fp8_stored(k_store, storage)[0], fp8_stored(v_store, storage)[0]
    else:
        c.columns = k_store.astype(np.float16), v_store.astype(np.float16)
    (c.k_store, c.v_store), c.pages = paged(c.columns, page_size, seed=int(rng.integers(99)))
    c.page_bits = page_bits(page_size)
    # one flat table: junk, the segment table at seq_info_off, junk, the served list
    c.seq_info_off = 3
    c.segments_off = c.seq_info_off + len(segments) * SEQ_INFO_FIELDS + 2
    tables = rng.integers(-1000, 1000, c.segments_off + len(c.served) + 3).astype(np.int32)
    for s, fields in enumerate(info):
        base = c.seq_info_off + s * SEQ_INFO_FIELDS
        for field, value in zip((Q_START, Q_LEN, SEQ, POS_START, FLAGS), fields):
            tables[base + field] = value
    tables[c.segments_off:c.segments_off + len(c.served)] = c.served
    c.tables = tables
    c.out = np.full(c.q.shape, np.nan, out_dtype)
    c.max_q_len = max(segments[s][0] for s in c.served)
    return c


def run(c, tile=SMALL, served_order=None, q=None):
    """Launch on the device (`q`: a device array instead of c.q's copy); the host copy of
    `out` afterwards."""
    tables = c.tables.copy()
    if served_order is not None:
        tables[c.segments_off:c.segments_off + len(served_order)] = served_order
    out = cuda.to_device(c.out)
    q = cuda.to_device(c.q) if q is None else q
    prefill.run(q, cuda.to_device(c.k_store), cuda.to_device(c.v_store),
                cuda.to_device(tables), pages=cuda.to_device(c.pages),
                page_bits=c.page_bits, seq_info_off=c.seq_info_off,
                segments_off=c.segments_off, n_segments=len(c.served),
                max_q_len=c.max_q_len, out=out, ring_rows=c.ring_rows, mask_code=c.window,
                scale=c.scale, softcap=c.softcap, tile=tile)
    cuda.synchronize()
    return out.copy_to_host()


def reference(c):
    """float64 output rows of the served segments: {token: [n_q_heads, head_dim]}."""
    want = {}
    for s in c.served:
        q_start, q_len, pos_start, block, keys, values = c.segments[s]
        got = dense_attention(c.q_values[q_start:q_start + q_len], keys, values,
                              pos_start, c.window, block, c.scale, c.softcap or None)
        for i in range(q_len):
            want[q_start + i] = got[i]
    return want


def check(c, got, tol=2e-3):
    want = reference(c)
    tokens = sorted(want)
    untouched = np.ones(len(got), bool)
    untouched[tokens] = False
    assert np.array_equal(got[untouched].view(np.uint8), c.out[untouched].view(np.uint8)), \
        "rows outside the served segments were written"
    got_rows = got[tokens].astype(np.float64)
    want_rows = np.stack([want[t] for t in tokens])
    assert np.isfinite(got_rows).all(), "NaN/Inf in the served rows"
    err = np.linalg.norm(got_rows - want_rows) / np.linalg.norm(want_rows)
    assert err <= tol, f"relative L2 error {err:.2e} > {tol:.0e}"


# ---------------------------------------------------------------- supports / shapes

def test_supports_16_bit_storage_and_head_dims_in_16_byte_chunks():
    for head_dim in (8, 16, 24, 64, 80, 96, 128, 256):
        assert prefill.supports(head_dim, np.float16)
        assert prefill.supports(head_dim, "bfloat16")
    for head_dim in (4, 12, 60, 264, 512):
        assert not prefill.supports(head_dim, np.float16)
    assert not prefill.supports(128, np.float32)
    assert not prefill.supports(128, "float32")


def test_gpu_tiles_keep_q_k_and_v_apart_in_48_kib_of_shared_memory():
    for head_dim in (8, 24, 64, 80, 96, 128, 256):
        rows, keys = prefill_shape.tile_shape(head_dim)
        q_row, k_row, v_row, buffer_rows = prefill_shape.shared_layout(head_dim, rows, keys)
        q, k, v = (set(range(first, first + n)) for first, n in
                   ((q_row, rows), (k_row, keys), (v_row, keys)))
        assert not q & k and not k & v      # Q and the first K tile are staged together
        if head_dim > prefill_shape.Q_REGISTERS_MAX_DIM:
            assert not q & v                # Q stays in shared memory, read every tile
        assert max(q | k | v) < buffer_rows
        assert buffer_rows * (prefill_shape.padded_head_dim(head_dim) + 8) * 2 <= 48 * 1024
        assert rows % 16 == 0 and keys % 16 == 0
        assert rows % prefill_shape.default_warp_rows(head_dim, rows) == 0


@pytest.mark.parametrize("chunks,threads,rows", [(16, 128, 64), (8, 64, 64), (32, 96, 16),
                                                 (32, 96, 48), (10, 128, 64), (5, 64, 32),
                                                 (2, 32, 16), (1, 32, 16)])
def test_staging_copies_every_chunk_once_a_128_byte_line_per_row_at_a_time(chunks, threads,
                                                                           rows):
    """Thread tid copies chunks tid % lanes + c lanes of rows tid // lanes + p step (step =
    threads // lanes): together every chunk of every row exactly once, and the lanes of a
    row cover whole 128-byte lines (8 chunks) of it per instruction."""
    lanes, passes = prefill_shape.staging_layout(chunks, threads, rows)
    step = threads // lanes
    copied = [(tid // lanes + p * step, tid % lanes + c * lanes) for tid in range(step * lanes)
              for p in range(passes) for c in range(chunks // lanes)
              if tid // lanes + p * step < rows]
    assert sorted(copied) == [(r, c) for r in range(rows) for c in range(chunks)]
    assert lanes >= min(chunks, 8) and chunks % lanes == 0


def test_staging_of_head_dim_128_tiles_takes_8_copies_in_4_rows_per_thread():
    # 64 rows x 16 chunks over 128 threads: 8 lanes per row (128 bytes), 16 rows per pass
    assert prefill_shape.staging_layout(16, 128, 64) == (8, 4)


@pytest.mark.parametrize("head_dim,storage,q_dtype,message", [
    (12, np.float16, np.float16, "head_dim 12"),
    (16, np.float32, np.float16, "storage 'float32'"),
    (16, np.float16, np.int32, "q dtype int32"),
])
def test_run_refuses_what_it_cannot_serve_before_any_launch(head_dim, storage, q_dtype,
                                                            message):
    q = np.zeros((4, 2, head_dim), q_dtype)
    store = np.zeros((8, 1, head_dim), storage)
    with pytest.raises(ValueError, match=message):
        prefill.run(q, store, store, np.zeros(8, np.int32), pages=np.zeros((1, 1), np.int32),
                    page_bits=3, seq_info_off=0, segments_off=5, n_segments=1, max_q_len=4,
                    out=np.zeros((4, 2, head_dim), np.float16), ring_rows=0, mask_code=0,
                    scale=1.0, softcap=0.0)


@pytest.mark.parametrize("k_shape,v_shape", [((8, 1, 1, 16), (8, 1, 1, 16)),   # columns
                                             ((8, 1, 16), (16, 1, 16)),
                                             ((8, 1, 24), (8, 1, 24))])       # not head_dim
def test_run_refuses_storage_other_than_slots_of_its_head_dim_before_any_launch(k_shape,
                                                                                v_shape):
    q = np.zeros((4, 2, 16), np.float16)
    with pytest.raises(ValueError, match="is not slot storage"):
        prefill.run(q, np.zeros(k_shape, np.float16), np.zeros(v_shape, np.float16),
                    np.zeros(8, np.int32), pages=np.zeros((1, 1), np.int32), page_bits=3,
                    seq_info_off=0, segments_off=5, n_segments=1, max_q_len=4,
                    out=np.zeros((4, 2, 16), np.float16), ring_rows=0, mask_code=0, scale=1.0,
                    softcap=0.0)


# ---------------------------------------------------------------- scenarios

@pytest.mark.parametrize("page_size", [8, 256])    # a key tile over 2 pages; in 1
def test_causal_chunks_over_several_row_and_key_tiles(page_size):
    rng = np.random.default_rng(1)
    # 5 tokens from 0; a chunk after 19 tokens of history; 3 row tiles x 3 key tiles
    c = make_case(rng, [(5, 0, False), (6, 19, False), (23, 9, False)], page_size=page_size)
    check(c, run(c))


@pytest.mark.parametrize("window", [3, 21])
def test_sliding_window_smaller_and_larger_than_a_key_tile(window):
    rng = np.random.default_rng(window)
    c = make_case(rng, [(9, 0, False), (11, 30, False)], window=window)
    check(c, run(c))


@pytest.mark.parametrize("wrap_at,page_size", [(1, 8), (5, 16), (8, 8), (15, 256)])
def test_ring_wraps_inside_a_key_tile_at_any_offset(wrap_at, page_size, stale_shared_memory):
    """The block's first key (its first query's window start) sits `wrap_at` rows before
    the end of the ring, so the ring wraps that many keys into the first 16-key tile; the
    second row tile starts its keys elsewhere. Pages of 8 rows: the wrap falls on a page
    boundary, the tile's first key too when wrap_at is 8; of 256: one page, rows from
    the ring's 24 on junk."""
    rng = np.random.default_rng(20 + wrap_at)
    window, q_len = 16, 9
    ring = window + q_len - 1                       # 24 rows
    pos_start = 3 * ring - wrap_at + window - 1     # its first key: 3 ring - wrap_at
    c = make_case(rng, [(q_len, pos_start, False)], n_kv_heads=1, group=2, window=window,
                  ring_rows=ring, page_size=page_size)
    check(c, run(c))


def test_ring_layer_after_wraps_with_a_wrap_inside_a_key_tile(stale_shared_memory):
    rng = np.random.default_rng(3)
    window, q_len = 8, 9
    ring = window + q_len - 1                       # 16 rows: positions 40.. wrap at 48
    c = make_case(rng, [(q_len, 40, False), (5, 23, False)], window=window, ring_rows=ring,
                  page_size=8)
    check(c, run(c))


def test_a_64_key_tile_crosses_pages_of_8_and_the_wrap_of_a_ring_after_several_wraps(
        stale_shared_memory):
    """One warp of 16 rows, tiles of 64 keys, a ring of 65 rows in pages of 8 (its ninth
    page holds one row, then junk) after five wraps: the first row tile's one key tile,
    positions 299 .. 362, reads rows 39 .. 64 and 0 .. 37, across 9 pages, two of them
    partly, and the wrap; the second row tile's 57 keys start elsewhere in it."""
    rng = np.random.default_rng(15)
    window, q_len, page_size = 57, 9, 8
    ring = window + q_len - 1                       # 65 rows
    pos_start = 5 * ring + 30
    first_key = pos_start - window + 1
    rows = np.arange(first_key, first_key + 64) % ring
    assert (np.diff(rows) < 0).sum() == 1 and len(set(rows // page_size)) == 9
    c = make_case(rng, [(q_len, pos_start, False)], n_kv_heads=1, group=2, window=window,
                  ring_rows=ring, page_size=page_size)
    check(c, run(c, tile=(16, 64)))


@pytest.mark.parametrize("window", [0, 4])
def test_draft_blocks_see_the_whole_block(window):
    rng = np.random.default_rng(4 + window)
    c = make_case(rng, [(7, 12, True), (6, 0, False), (5, 3, True)], window=window)
    check(c, run(c))


def test_softcap():
    rng = np.random.default_rng(5)
    c = make_case(rng, [(8, 10, False), (6, 0, True)], softcap=2.0)
    check(c, run(c))


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_gqa_groups(group, stale_shared_memory):
    rng = np.random.default_rng(10 + group)
    c = make_case(rng, [(5, 4, False), (3, 0, False)], n_kv_heads=1, group=group)
    check(c, run(c))


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256, 24])
def test_head_dims(head_dim):
    rng = np.random.default_rng(head_dim)
    c = make_case(rng, [(5, 3, False)], n_kv_heads=1, group=2, head_dim=head_dim)
    check(c, run(c))


@pytest.mark.parametrize("q_dtype,out_dtype", [(np.float32, np.float32),
                                               (np.float16, np.float32),
                                               (np.float32, np.float16)])
def test_q_and_out_types(q_dtype, out_dtype):
    rng = np.random.default_rng(7)
    c = make_case(rng, [(6, 5, False), (4, 0, True)], q_dtype=q_dtype, out_dtype=out_dtype)
    check(c, run(c))


@pytest.mark.parametrize("q_dtype", [np.float32, "bfloat16"])
def test_bfloat16_storage_as_bit_patterns(q_dtype):
    """q converted from float32, or bfloat16 bits like the storage (copied as they are)."""
    rng = np.random.default_rng(8)
    c = make_case(rng, [(7, 6, False), (5, 0, True)], storage="bfloat16", q_dtype=q_dtype,
                  out_dtype=np.float32, page_size=8)
    check(c, run(c), tol=1e-2)


@pytest.mark.parametrize("storage, q_dtype, out_dtype", [
    ("float8_e4m3", np.float16, np.float16), ("float8_e5m2", "bfloat16", np.float32),
    ("float8_e4m3", np.float32, np.float32)])
def test_fp8_storage_is_widened_to_the_query_type(storage, q_dtype, out_dtype):
    """8-bit float K/V tiles widened as they are staged: to float16 for float16 and
    float32 queries, to bfloat16 for bfloat16 ones; a ring that wraps inside a tile,
    against the float64 reference over the stored values."""
    rng = np.random.default_rng(9)
    c = make_case(rng, [(7, 6, False), (5, 0, True), (6, 20, False)], storage=storage,
                  q_dtype=q_dtype, out_dtype=out_dtype, ring_rows=22, window=9, page_size=8)
    check(c, run(c), tol=1e-2 if q_dtype == "bfloat16" else 2e-3)


def test_queries_not_16_byte_aligned_are_read_value_by_value():
    """q starting 8 bytes past a 16-byte boundary cannot be copied in 16-byte chunks."""
    rng = np.random.default_rng(14)
    c = make_case(rng, [(7, 6, False), (5, 0, True)])
    flat = np.concatenate([np.zeros(4, c.q.dtype), c.q.reshape(-1)])
    q = cuda.to_device(flat)[4:].reshape(c.q.shape)
    assert not aligned(q, 16)
    check(c, run(c, q=q))


@pytest.mark.parametrize("group,q_len,tile", [(3, 13, TWO_WARPS), (3, 7, WIDE_WARP),
                                              (5, 9, TWO_WIDE_WARPS)])
def test_a_tokens_q_heads_across_warps_and_halves_and_a_partial_row_tile(group, q_len, tile,
                                                                          stale_shared_memory):
    """Packed rows: a token's `group` rows straddle the 16-row boundaries of warps or of
    a warp's halves (group 3: rows 15..17 of token 5; group 5: rows 15..19 and 30..34),
    and the last row tile is partial (39 rows in tiles of 32, 21 of 32, 45 of 64): its
    missing rows are zeros, not stale shared memory."""
    rng = np.random.default_rng(30 + group)
    c = make_case(rng, [(q_len, 6, False)], n_kv_heads=1, group=group)
    check(c, run(c, tile=tile))


def test_warps_of_a_tile_skip_and_mask_on_their_own():
    """Two warps of 16 rows, group 1: warp 1's rows start 16 tokens later, so with a
    window of 5 the warps share no key tile; the last row tile has an empty warp."""
    rng = np.random.default_rng(9)
    c = make_case(rng, [(40, 2, False), (10, 0, False)], n_kv_heads=1, group=1, window=5)
    check(c, run(c, tile=TWO_WARPS))


def test_served_segments_only_and_alone_equals_in_a_list():
    """Segments 1 and 3 of four are served (the others belong to other paths); the
    same segment served alone or with others, in any order, gives the same bits."""
    rng = np.random.default_rng(11)
    segments = [(1, 7, False), (9, 4, False), (2, 0, False), (6, 0, True)]
    c = make_case(rng, segments, served=[1, 3])
    both = run(c)
    check(c, both)
    swapped = run(c, served_order=[3, 1])
    assert np.array_equal(both.view(np.uint8), swapped.view(np.uint8))
    alone = make_case(np.random.default_rng(11), segments, served=[1])
    one = run(alone)
    rows = slice(alone.segments[1][0], alone.segments[1][0] + 9)
    assert np.array_equal(one[rows].view(np.uint8), both[rows].view(np.uint8))


@pytest.mark.parametrize("seed", range(6))
def test_random_steps_over_tile_shapes(seed):
    """Random segments (decode-sized to several tiles, chunks, blocks), windows with and
    without a ring, GQA groups, tile shapes of 1 to 3 warps of 16 or 32 rows and 16 or
    32 keys, and pages of 8, 16 or 256 rows."""
    rng = np.random.default_rng(100 + seed)
    window = int(rng.choice([0, 3, 9, 20]))
    segments = [(int(rng.integers(1, 25)), int(rng.integers(0, 40)), bool(rng.random() < 0.3))
                for _ in range(int(rng.integers(1, 4)))]
    max_q_len = max(n for n, _, _ in segments)
    ring = window + max_q_len - 1 if window and rng.random() < 0.6 else 0
    tile = [SMALL, TWO_WARPS, (16, 32), (48, 32), WIDE_WARP, TWO_WIDE_WARPS][seed]
    c = make_case(rng, segments, n_kv_heads=int(rng.integers(1, 3)),
                  group=int(rng.choice([1, 2, 4])), window=window, ring_rows=ring,
                  softcap=float(rng.choice([0.0, 3.0])), page_size=(8, 16, 256)[seed % 3])
    check(c, run(c, tile=tile))


def test_gpu_tile_shape_over_several_key_tiles(stale_shared_memory):
    """The GPU's own tiles for head_dim 64 (64 rows x 64 keys, 2 warps of 32 rows):
    windowed ring layer after wraps, a chunk far into its history, a draft block; pages
    of 8 rows, so a key tile spans 8 or 9 pages."""
    rng = np.random.default_rng(12)
    c = make_case(rng, [(40, 0, False), (30, 200, False), (16, 40, True)], n_kv_heads=1,
                  group=2, head_dim=64, window=70, ring_rows=70 + 40 - 1, page_size=8)
    check(c, run(c, tile=None))


@only_gpu
@pytest.mark.parametrize("head_dim,window,softcap", [(64, 0, 0.0), (128, 0, 0.0),
                                                     (128, 100, 0.0), (256, 0, 30.0)])
def test_long_segments_with_gpu_tiles(head_dim, window, softcap):
    rng = np.random.default_rng(13)
    segments = [(300, 0, False), (200, 500 if window else 150, False), (64, 40, True)]
    c = make_case(rng, segments, n_kv_heads=2, group=4, head_dim=head_dim, window=window,
                  ring_rows=window + 300 - 1 if window else 0, softcap=softcap)
    check(c, run(c, tile=None))
