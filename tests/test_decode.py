"""Decode attention (kvnumba.kernels.decode): its planner, and its kernels against an
independent float64 reference.

Storage, histories and the flat `tables` array are built by hand here, so nothing of
the kernels' indexing is reused: storage rows a segment must not read hold NaN, and
rows of `out` that no served segment owns hold a sentinel that must survive. Each
case's column storage reaches the kernel as slot storage through a page table in
shuffled order (`paging.paged`), whose unreferenced pages hold NaN too. The
reference (`oracle.dense_attention`) works from dense per-sequence histories and
explicit boolean masks.
"""
import numpy as np
import pytest

from kvnumba import device
from kvnumba.device import cuda
from kvnumba.kernels import decode as dec
from kvnumba.kernels.generic import DECODE_MAX_Q_LEN
from kvnumba.kernels.decode.trip import RESCALE_SLACK
from kvnumba.kernels.launch.calling import aligned
from kvnumba.kernels.masks import key_range
from kvnumba.kernels.workspace import AttentionWorkspace
from kvnumba.arith.positions import (SEQ, FLAG_BLOCK, FLAGS, POS_START, Q_LEN, Q_START,
                                    SEQ_INFO_FIELDS)
from oracle import (FP8, bf16_values, dense_attention, fp8_stored, round_nearest_even,
                    seen_positions, visible_mask)
from paging import page_bits, paged

SENTINEL = -3.5          # exactly representable in float16, bfloat16 and float32


def stored(values, dtype):
    """`(storage array, float64 values it holds)` of float values in storage `dtype` (a
    NumPy dtype, or an fp8 name of `oracle.FP8`)."""
    if dtype in FP8:
        return fp8_stored(values, dtype)
    held = np.asarray(values).astype(dtype)
    return held, held.astype(np.float64)


def sentinel(dtype):
    """SENTINEL in an output dtype (uint16: as bfloat16 bits)."""
    return round_nearest_even(SENTINEL, "bf16") if np.dtype(dtype) == np.uint16 else SENTINEL


def as_float64(array):
    """float64 values of a kernel-level array: uint16 holds bfloat16 bit patterns."""
    return bf16_values(array) if array.dtype == np.uint16 else array.astype(np.float64)
PAGE_SIZE = 16           # the kernel tests' page size where they do not choose one


# ---------------------------------------------------------------- the reference

def reference(case):
    """float64 attention of every served segment's queries: {token: [n_q_heads, head_dim]}."""
    want = {}
    for seg in case.served:
        q_start, q_len, pos_start, block = case.segments[seg]
        got = dense_attention(as_float64(case.q[q_start:q_start + q_len]), case.hist_k[seg],
                              case.hist_v[seg], pos_start, case.window, block, case.scale,
                              case.softcap if case.softcap > 0 else None)
        for i in range(q_len):
            want[q_start + i] = got[i]
    return want


# ---------------------------------------------------------------- hand-built inputs

class Case:
    pass


def make_case(rng, segments, *, n_kv_heads=1, group=1, head_dim=16, window=0, ring_rows=0,
              dtype=np.float16, q_dtype=None, out_dtype=None, softcap=0.0, qk_scale=1.0,
              key_growth=0.0, others=((2, 0), (1, 3))):
    """segments: (q_len, pos_start[, block]) served by decode. `others`: (q_len, pos_start)
    segments of the same step that other paths serve. The segment table mixes both in a
    shuffled order, tokens are laid out in that order behind one foreign token, and one
    padding token closes the step. `key_growth`: key p is scaled by 1 + key_growth * p."""
    c = Case()
    c.n_kv_heads, c.window, c.ring_rows, c.softcap = n_kv_heads, window, ring_rows, softcap
    c.scale = qk_scale / np.sqrt(head_dim)
    specs = [tuple(s) + (False,) * (3 - len(s)) for s in segments]
    specs += [(n, p, False) for n, p in others]
    order = rng.permutation(len(specs))          # table index -> spec
    c.served = sorted(int(np.flatnonzero(order == k)[0]) for k in range(len(segments)))
    n_seg = len(specs)
    cols = rng.permutation(n_seg + 1)[:n_seg]    # one column is no one's
    kv_lens = [p + n for n, p, _ in specs]
    rows = ring_rows if ring_rows else max(kv_lens) + 2
    storage = FP8[dtype][0] if dtype in FP8 else dtype
    poison = 0x7F if dtype in FP8 else np.nan        # NaN bits in either fp8 format
    k_store = np.full((rows, n_seg + 1, n_kv_heads, head_dim), poison, storage)
    v_store = np.full_like(k_store, poison)
    c.info = np.zeros((n_seg, SEQ_INFO_FIELDS), np.int32)
    c.segments, c.hist_k, c.hist_v = [], [], []
    q_start = 1                                  # token 0 belongs to another path
    for seg, k in enumerate(order):
        q_len, pos_start, block = specs[k]
        kv_len = pos_start + q_len
        growth = 1.0 + key_growth * np.arange(kv_len)[:, None, None]
        hk, hk64 = stored(rng.standard_normal((kv_len, n_kv_heads, head_dim)) * growth, dtype)
        hv, hv64 = stored(rng.standard_normal((kv_len, n_kv_heads, head_dim)), dtype)
        if seg in c.served:                      # storage holds exactly what is visible
            seen = seen_positions(q_len, pos_start, block, window)
            where = seen % ring_rows if ring_rows else seen
            assert len(set(where)) == len(seen), "test bug: ring too small for the window"
            k_store[where, cols[seg]] = hk[seen]
            v_store[where, cols[seg]] = hv[seen]
        c.hist_k.append(hk64)
        c.hist_v.append(hv64)
        c.segments.append((q_start, q_len, pos_start, bool(block)))
        c.info[seg, [Q_START, Q_LEN, SEQ, POS_START]] = q_start, q_len, cols[seg], pos_start
        c.info[seg, FLAGS] = FLAG_BLOCK if block else 0
        q_start += q_len
    width = q_start + 1
    q = rng.standard_normal((width, n_kv_heads * group, head_dim))
    c.owned = sorted(c.segments[s][0] + i for s in c.served for i in range(c.segments[s][1]))
    q[np.setdiff1d(np.arange(width), c.owned)] = np.nan     # never read by this path
    bf16 = np.dtype(q_dtype or dtype) == np.uint16           # bfloat16 bit patterns
    c.q = round_nearest_even(q, "bf16") if bf16 else q.astype(q_dtype or dtype)
    c.k_store, c.v_store = k_store, v_store
    c.out_dtype = out_dtype or q_dtype or dtype
    return c


def pack_tables(rng, case, plan):
    """The step's flat int32 `tables`: segment, work and combine tables behind and
    between unrelated words, as a caller packs them; returns (tables, offsets)."""
    parts, offsets = [], {}
    for name, table in (("seq_info_off", case.info), ("work_off", plan.work),
                        ("combine_off", plan.combine)):
        parts.append(rng.integers(-99, 99, rng.integers(1, 5)).astype(np.int32))
        offsets[name] = sum(p.size for p in parts)
        parts.append(np.ascontiguousarray(table, np.int32).reshape(-1))
    return np.concatenate(parts), offsets


def paged_storage(case, page_size=PAGE_SIZE, seed=0):
    """`(k slots, v slots, pages, page_bits)` of the case's storage on the device, in
    pages of `page_size` handed out in shuffled order (`paging.paged`)."""
    (k_slots, v_slots), pages = paged([case.k_store, case.v_store], page_size, seed=seed)
    return (cuda.to_device(k_slots), cuda.to_device(v_slots), cuda.to_device(pages),
            page_bits(page_size))


def run(case, *, chunk=dec.KEY_TILE, workspace=None, seed=0, q=None, page_size=PAGE_SIZE,
        tensor_cores=False, out_offset=0):
    """plan + run on the device (out holds SENTINEL first) on the case's storage in pages
    of `page_size`; returns (out on the host, plan). `q`: the device array to pass as q
    (default: a copy of `case.q`). `tensor_cores`: the CUDA-core kernel (False, these
    tests' own), the tensor-core one (True) or the rule's choice (None). `out_offset`:
    out starts that many elements into a larger buffer (1: not 16-byte aligned)."""
    rng = np.random.default_rng(seed)
    plan = dec.chunk_tables(case.info, case.served, mask_code=case.window, chunk=chunk)
    tables, offsets = pack_tables(rng, case, plan)
    size = int(np.prod(case.q.shape))
    out = cuda.to_device(np.full(size + out_offset, sentinel(case.out_dtype), case.out_dtype))
    out = out[out_offset:].reshape(case.q.shape)
    q = cuda.to_device(case.q) if q is None else q
    k_slots, v_slots, pages, bits = paged_storage(case, page_size, seed)
    dec.run(q, k_slots, v_slots, cuda.to_device(tables), pages=pages, page_bits=bits,
            **offsets, n_items=plan.n_items, n_combine=plan.n_combine, n_parts=plan.n_parts,
            max_q_len=plan.max_q_len, min_q_len=plan.min_q_len, out=out,
            workspace=workspace or AttentionWorkspace(),
            ring_rows=case.ring_rows, mask_code=case.window, scale=case.scale,
            softcap=case.softcap, tensor_cores=tensor_cores)
    cuda.synchronize()
    return out.copy_to_host(), plan


def check(case, got):
    """Served rows match the reference; every other row of `out` is untouched."""
    others = np.setdiff1d(np.arange(len(got)), case.owned)
    assert (got[others] == sentinel(got.dtype)).all(), "a row no served segment owns was written"
    want = reference(case)
    tokens = sorted(want)
    got_rows = as_float64(got[tokens])
    want_rows = np.array([want[t] for t in tokens])
    assert np.isfinite(got_rows).all(), "NaN/Inf in a served row"
    dtypes = (case.q.dtype, case.k_store.dtype, np.dtype(case.out_dtype))
    tol = 1e-2 if np.uint16 in dtypes else 2e-3 if np.float16 in dtypes else 1e-4
    err = np.linalg.norm(got_rows - want_rows) / np.linalg.norm(want_rows)
    assert err < tol, f"relative L2 error {err:.2e} >= {tol:.0e}"


def decode_segments(*kv_lens):
    """One query per segment, at position kv_len - 1."""
    return [(1, n - 1) for n in kv_lens]


# ---------------------------------------------------------------- what the path serves

def test_supports_whole_16_byte_rows_of_model_head_dims():
    for head_dim in (16, 64, 128, 256):
        assert dec.supports(head_dim, np.float16)
    for head_dim in (64, 128, 256):
        assert dec.supports(head_dim, np.float32)
    assert dec.supports(48, np.float16) and dec.supports(48, np.float32)   # idle lanes
    assert not dec.supports(100, np.float16)          # 200-byte rows
    assert not dec.supports(4, np.float32) and not dec.supports(20, np.float32)
    assert not dec.supports(512, np.float16)          # past the largest head_dim
    assert not dec.supports(128, np.float64)          # no widening rule


# ---------------------------------------------------------------- the planner

def union_of(info, seg, window):
    """[lo, hi) of the keys any query of segment `seg` sees, from the masks."""
    seen = seen_positions(int(info[seg, Q_LEN]), int(info[seg, POS_START]),
                          bool(info[seg, FLAGS] & FLAG_BLOCK), window)
    return int(seen[0]), int(seen[-1]) + 1


def table_of(rows):
    """A host segment table of (q_len, pos_start, block) rows, tokens back to back."""
    info = np.zeros((len(rows), SEQ_INFO_FIELDS), np.int32)
    info[:, Q_LEN] = [r[0] for r in rows]
    info[:, Q_START] = np.cumsum(info[:, Q_LEN]) - info[:, Q_LEN]
    info[:, POS_START] = [r[1] for r in rows]
    info[:, SEQ] = np.arange(len(rows))
    info[:, FLAGS] = [FLAG_BLOCK if len(r) > 2 and r[2] else 0 for r in rows]
    return info


def expected_chunks(keys, chunk):
    """How many chunks a segment of `keys` keys gets: whole chunks, the remainder merged
    into the last one unless it is at least half a chunk, and never none."""
    whole, rest = divmod(keys, chunk)
    return max(1, whole + (2 * rest >= chunk))


def check_plan(plan, info, segments, window, chunk):
    """Coverage, slots, the chunk rule and the copied segment fields, from first
    principles."""
    work, combine = plan.work, plan.combine
    assert work.dtype == np.int32 and combine.dtype == np.int32
    assert work.shape[1] == dec.WORK_FIELDS and combine.shape[1] == dec.COMBINE_FIELDS
    assert plan.chunk == chunk
    keys = {}
    for seg in segments:
        lo, hi = union_of(info, seg, window)
        keys[seg] = hi - lo
        mine = work[work[:, dec.WORK_SEG] == seg]
        mine = mine[np.argsort(mine[:, dec.WORK_KEY_LO])]
        # the chunks tile [lo, hi) exactly: all but the last `chunk` keys, the last at
        # least half a chunk (unless it is the only one) and under one and a half
        assert mine[0, dec.WORK_KEY_LO] == lo and mine[-1, dec.WORK_KEY_HI] == hi
        np.testing.assert_array_equal(mine[1:, dec.WORK_KEY_LO], mine[:-1, dec.WORK_KEY_HI])
        lengths = mine[:, dec.WORK_KEY_HI] - mine[:, dec.WORK_KEY_LO]
        assert len(mine) == expected_chunks(hi - lo, chunk)
        assert (lengths[:-1] == chunk).all() and 0 < lengths[-1] < chunk + chunk // 2
        assert len(mine) == 1 or 2 * lengths[-1] >= chunk
        # the segment's fields the kernel's first loads need
        assert (mine[:, dec.WORK_SEQ] == info[seg, SEQ]).all()
        assert (mine[:, dec.WORK_Q_START] == info[seg, Q_START]).all()
        assert (mine[:, dec.WORK_Q_LEN] == info[seg, Q_LEN]).all()
        rows = combine[combine[:, dec.COMBINE_SEG] == seg]
        if len(mine) == 1:
            assert mine[0, dec.WORK_PART] == -1 and len(rows) == 0
        else:
            (row,) = rows
            assert row[dec.COMBINE_PARTS] == len(mine)
            np.testing.assert_array_equal(mine[:, dec.WORK_PART],
                                          row[dec.COMBINE_PART] + np.arange(len(mine)))
    assert len(work) == sum(expected_chunks(n, chunk) for n in keys.values())
    slots = work[work[:, dec.WORK_PART] >= 0, dec.WORK_PART]
    np.testing.assert_array_equal(np.sort(slots), np.arange(plan.n_parts))
    assert plan.max_q_len == max(int(info[s, Q_LEN]) for s in segments)
    return keys


def chunks_of(plan, seg):
    """Segment `seg`'s chunks: sorted (key_lo, key_hi) pairs."""
    mine = plan.work[plan.work[:, dec.WORK_SEG] == seg]
    return sorted(map(tuple, mine[:, [dec.WORK_KEY_LO, dec.WORK_KEY_HI]].tolist()))


def chunk_lengths(plan, seg):
    """Segment `seg`'s chunk lengths, in key order."""
    return [hi - lo for lo, hi in chunks_of(plan, seg)]


def test_plan_balances_a_skewed_batch():
    """64 sequences of 32 .. 32768 keys: the long ones are cut, no block walks them whole."""
    kv_lens = np.geomspace(32, 32768, 64).astype(int)
    info = table_of([(1, n - 1) for n in kv_lens])
    segments = np.arange(64)
    plan = dec.chunk_tables(info, segments, mask_code=0)
    check_plan(plan, info, segments, 0, dec.CHUNK_KEYS)
    lengths = plan.work[:, dec.WORK_KEY_HI] - plan.work[:, dec.WORK_KEY_LO]
    assert lengths.max() < dec.CHUNK_KEYS + dec.CHUNK_KEYS // 2
    assert (plan.work[:, dec.WORK_SEG] == 63).sum() == 32768 // dec.CHUNK_KEYS


def test_a_remainder_under_half_a_chunk_joins_the_last_chunk():
    """4096 keys of history and one query: 15 chunks of 256 keys and a last one of 257,
    not a 17th chunk of one key."""
    info = table_of([(1, 4096)])
    chunks = chunks_of(dec.chunk_tables(info, [0], mask_code=0), 0)
    assert chunks == [(256 * c, 256 * (c + 1)) for c in range(15)] + [(3840, 4097)]


@pytest.mark.parametrize("keys, lengths", [
    (1, [1]), (255, [255]), (256, [256]), (257, [257]), (383, [383]), (384, [256, 128]),
    (513, [256, 257]), (4096, [256] * 16), (4223, [256] * 15 + [383]),
    (4224, [256] * 16 + [128])])
def test_chunk_lengths_follow_the_segment_alone(keys, lengths):
    """Hand-computed cuts at the nominal 256-key chunk, alone and beside other segments."""
    info = table_of([(1, keys - 1), (1, 5000), (3, 40, True)])
    for segments in ([0], [2, 0, 1]):
        assert chunk_lengths(dec.chunk_tables(info, segments, mask_code=0), 0) == lengths
    assert dec.chunk_count(keys) == len(lengths)


@pytest.mark.parametrize("window", [0, 7, 300])
def test_plan_tiles_every_key_range_exactly(window):
    rng = np.random.default_rng(window)
    rows = [(int(rng.integers(1, DECODE_MAX_Q_LEN + 1)), int(rng.integers(0, 2000)),
             bool(rng.integers(0, 2))) for _ in range(40)]
    info = table_of(rows)
    segments = rng.permutation(40)[:30]
    for chunk in (dec.KEY_TILE, 2 * dec.KEY_TILE, dec.CHUNK_KEYS, 2048):
        check_plan(dec.chunk_tables(info, segments, mask_code=window, chunk=chunk), info, segments,
                   window, chunk)


def test_a_segments_chunks_do_not_depend_on_the_rest_of_the_step():
    info = table_of([(1, 5000), (2, 10), (4, 700, True), (1, 90000)])
    alone = dec.chunk_tables(info, [0], mask_code=0)
    together = dec.chunk_tables(info, [3, 1, 0, 2], mask_code=0)
    assert chunks_of(alone, 0) == chunks_of(together, 0)
    assert len(chunks_of(together, 1)) == 1 and together.chunk == alone.chunk


def test_plan_of_nothing_and_refusals():
    info = table_of([(1, 9), (5, 0)])
    empty = dec.chunk_tables(info, [], mask_code=0)
    assert empty.n_items == empty.n_combine == empty.n_parts == 0
    with pytest.raises(ValueError, match="queries"):
        dec.chunk_tables(info, [0, 1], mask_code=0)
    with pytest.raises(ValueError, match="power of two"):
        dec.chunk_tables(info, [0], mask_code=0, chunk=3 * dec.KEY_TILE)


@cuda.jit
def _device_key_ranges(args, out):
    k = cuda.grid(1)
    if k < args.shape[0]:
        lo, hi = key_range(args[k, 0], args[k, 1], args[k, 2], args[k, 3] != 0, args[k, 4])
        out[k, 0] = lo
        out[k, 1] = hi


def test_key_range_on_the_device_is_what_the_masks_see():
    grid = np.array([(i, n, p, b, w) for n in range(1, 5) for i in range(n)
                     for p in (0, 1, 3, 9, 40) for b in (0, 1) for w in (0, 1, 2, 5, 64)],
                    np.int64)
    got = np.zeros((len(grid), 2), np.int64)
    d_out = cuda.to_device(got)
    _device_key_ranges[-(-len(grid) // 128), 128](cuda.to_device(grid), d_out)
    got = d_out.copy_to_host()
    for (i, n, p, b, w), (lo, hi) in zip(grid, got):
        seen = np.flatnonzero(visible_mask(p + i, p + n, p, n, b, w))
        assert (lo, hi) == (seen[0], seen[-1] + 1)


# ---------------------------------------------------------------- the kernels

def test_skewed_lengths_from_one_key_to_many_chunks():
    """1 key .. 5 chunks of 64 in one step; lengths on and one key past tile edges (64,
    128 keys), one chunk under one and a half (95), and the shortest last chunk (96)."""
    rng = np.random.default_rng(1)
    case = make_case(rng, decode_segments(1, 2, 63, 64, 65, 95, 96, 128, 300), group=2)
    got, plan = run(case, chunk=dec.KEY_TILE)
    assert plan.n_combine == 3                   # 96, 128 and 300 keys are cut
    check(case, got)


@pytest.mark.parametrize("page_size", [8, 256])
def test_lengths_around_chunk_boundaries_on_a_flat_layer(page_size):
    """Segments of nominal - 1, nominal, nominal + 1, 1.5 x nominal and 2 x nominal + 1
    keys (nominal: 64): one chunk for the first three, then a last chunk of half a
    chunk, then one of a chunk and a key; read through pages of 8 (many per chunk) and
    256 (a whole history in one)."""
    rng = np.random.default_rng(30)
    cuts = {63: [63], 64: [64], 65: [65], 96: [64, 32], 129: [64, 65]}
    case = make_case(rng, decode_segments(*cuts), head_dim=32, others=((1, 0),))
    got, plan = run(case, chunk=dec.KEY_TILE, page_size=page_size)
    for seg in case.served:
        q_start, q_len, pos_start, _ = case.segments[seg]
        assert chunk_lengths(plan, seg) == cuts[pos_start + q_len]
    check(case, got)


@pytest.mark.parametrize("window, cuts", [
    (63, {1: [63], 2: [64], 3: [65], 4: [66]}),
    (95, {1: [95], 2: [64, 32], 3: [64, 33], 4: [64, 34]})])
def test_lengths_around_chunk_boundaries_on_a_ring(window, cuts):
    """A ring whose rows have wrapped several times: segments of 1..4 queries see window
    + q_len - 1 keys, around the nominal chunk (64) and one and a half of it, in chunks
    whose storage rows wrap."""
    rng = np.random.default_rng(window)
    ring_rows = window + DECODE_MAX_Q_LEN - 1
    segments = [(q_len, 3 * ring_rows + 17 * q_len, q_len % 2 == 0) for q_len in cuts]
    case = make_case(rng, segments, window=window, ring_rows=ring_rows, head_dim=32,
                     others=((1, 0),))
    got, plan = run(case, chunk=dec.KEY_TILE)
    for seg in case.served:
        assert chunk_lengths(plan, seg) == cuts[case.segments[seg][1]]
    check(case, got)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_gqa_groups(group):
    rng = np.random.default_rng(10 + group)
    case = make_case(rng, [(1, 100), (2, 20)], group=group, n_kv_heads=2 if group < 4 else 1)
    got, plan = run(case)
    assert plan.n_combine == 1
    check(case, got)


def test_queries_and_draft_blocks():
    """q_len 1..4, plain and bidirectional, split and not."""
    rng = np.random.default_rng(2)
    segments = [(1, 9), (2, 30, True), (3, 100), (4, 120, True), (4, 3), (2, 0, True)]
    case = make_case(rng, segments, group=2)
    got, plan = run(case)
    assert plan.n_combine == 2
    check(case, got)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, "float8_e4m3"])
def test_rows_beyond_one_row_group(dtype):
    """group 4 x 3 queries = 12 rows, more than one block holds."""
    rng = np.random.default_rng(3)
    case = make_case(rng, [(3, 90), (1, 6)], group=4, dtype=dtype,
                     q_dtype=np.float16 if dtype in FP8 else None)
    assert dec.block_rows(12, 16, FP8[dtype][0] if dtype in FP8 else dtype) < 12
    check(case, run(case)[0])


@pytest.mark.parametrize("group, tensor_cores", [(2, False), (8, True)])
@pytest.mark.parametrize("window, max_write, positions", [
    (20, 4, [(1, 104), (4, 230), (2, 61, True)]),     # one chunk, rows wrapped many times
    (100, 4, [(1, 350), (3, 409, True)]),             # a window over two chunks
])
def test_ring_layers_after_several_wraps(window, max_write, positions, group, tensor_cores):
    """On CUDA cores (a group of 2) and on tensor cores (8: tests/test_decode_grouped.py)."""
    rng = np.random.default_rng(window)
    ring_rows = window + max_write - 1
    case = make_case(rng, positions, group=group, window=window, ring_rows=ring_rows)
    got, plan = run(case, tensor_cores=tensor_cores)
    assert max(p for _, p, *_ in positions) > 3 * ring_rows
    assert (plan.n_combine > 0) == (window > plan.chunk)
    check(case, got)


@pytest.mark.parametrize("page_size", [8, 16, 256])
def test_a_shuffled_page_table_on_a_ring_after_several_wraps(page_size):
    """A ring of 103 rows, no whole number of pages of 8 or 16 (and under one of 256),
    after its rows wrapped several times, read through a page table in shuffled order:
    a window over two chunks whose rows cross page boundaries and the ring's end."""
    rng = np.random.default_rng(50 + page_size)
    window, ring_rows = 100, 103
    positions = [(1, 5 * ring_rows + 17), (3, 3 * ring_rows + 50, True)]
    case = make_case(rng, positions, window=window, ring_rows=ring_rows, head_dim=32,
                     others=((1, 0),))
    for seg in case.served:                      # each segment's keys pass the ring's end
        q_start, q_len, pos_start, _ = case.segments[seg]
        assert (pos_start - window) // ring_rows < (pos_start + q_len - 1) // ring_rows
    got, plan = run(case, page_size=page_size)
    assert plan.n_combine == 2
    check(case, got)


@pytest.mark.parametrize("window", [1, 5, 70])
def test_windows_on_flat_layers(window):
    """Windows narrower than a chunk and than a block trip, and one over two chunks."""
    rng = np.random.default_rng(20 + window)
    case = make_case(rng, [(1, 140), (3, 60), (4, 90, True), (2, 0)], window=window)
    check(case, run(case)[0])


@pytest.mark.parametrize("head_dim, dtype", [(16, np.float32), (48, np.float16),
                                             (48, np.float32), (64, np.float16),
                                             (128, np.float16), (256, np.float16),
                                             (256, np.float32), (48, "float8_e4m3"),
                                             (128, "float8_e5m2"), (256, "float8_e4m3")])
def test_head_dims(head_dim, dtype):
    rng = np.random.default_rng(head_dim)
    case = make_case(rng, [(1, 8), (2, 3, True)], group=2, head_dim=head_dim, dtype=dtype,
                     q_dtype=np.float16 if dtype in FP8 else None, others=((1, 0),))
    check(case, run(case)[0])


def test_softcap():
    rng = np.random.default_rng(4)
    case = make_case(rng, [(1, 100), (3, 12)], group=2, softcap=2.0, qk_scale=4.0)
    uncapped = Case()
    uncapped.__dict__.update(case.__dict__, softcap=0.0)
    want, free = reference(case), reference(uncapped)
    assert max(np.abs(want[t] - free[t]).max() for t in want) > 1e-2   # the cap matters
    got, plan = run(case)
    assert plan.n_combine == 1
    check(case, got)


@pytest.mark.parametrize("head_dim, position, chunk", [(16, 500, 1024), (128, 150, 64)])
def test_scores_that_keep_growing_rescale_each_row_on_its_own(head_dim, position, chunk):
    """Keys growing along the history push each row's max past its reference many
    times, at different keys for different rows, over several trips of one block."""
    rng = np.random.default_rng(head_dim)
    case = make_case(rng, [(2, position), (1, 3)], group=4, head_dim=head_dim, qk_scale=4.0,
                     key_growth=0.05, dtype=np.float32)
    (long,) = [seg for seg in case.served if case.segments[seg][2] == position]
    q_start, q_len, pos_start, _ = case.segments[long]
    for i in range(q_len):       # every row's max climbs far past the first keys' max
        visible = case.hist_k[long][:pos_start + i + 1, 0]
        scores = case.scale * visible @ case.q[q_start + i].T.astype(np.float64)
        climb = (scores.max(axis=0) - scores[:16].max(axis=0)) / np.log(2)
        assert (climb > 4 * RESCALE_SLACK).all()
    got, plan = run(case, chunk=chunk)
    assert plan.n_combine == (head_dim == 128)
    check(case, got)


@pytest.mark.parametrize("store, q_dtype, out_dtype", [
    (np.float16, np.float32, np.float32), (np.float32, np.float16, np.float16),
    (np.float32, np.float32, np.float16), (np.float32, np.float32, np.float32),
    ("float8_e4m3", np.float32, np.float16), ("float8_e5m2", np.float16, np.float32)])
def test_storage_query_and_output_dtypes(store, q_dtype, out_dtype):
    rng = np.random.default_rng(5)
    case = make_case(rng, [(2, 75), (1, 4)], group=2, dtype=store, q_dtype=q_dtype,
                     out_dtype=out_dtype)
    check(case, run(case)[0])


@pytest.mark.parametrize("store, q_dtype", [(np.float16, np.float16),
                                             (np.float32, np.float16)])
def test_a_query_not_16_byte_aligned_is_read_element_by_element(store, q_dtype):
    """q as a view one element into its buffer: the kernel takes the element-wise
    reads (16-byte loads there would fault) and gives the same attention."""
    rng = np.random.default_rng(11)
    case = make_case(rng, [(2, 75), (1, 4)], group=2, dtype=store, q_dtype=q_dtype)
    buffer = cuda.to_device(np.concatenate([np.zeros(1, q_dtype), case.q.reshape(-1)]))
    q = buffer[1:].reshape(case.q.shape)
    assert not aligned(q, dec.LOAD_BYTES)
    check(case, run(case, q=q)[0])


@pytest.mark.skipif(device.SIMULATOR, reason="model-sized shapes need a CUDA GPU (the "
                                              "simulator runs every thread in Python)")
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_model_shapes_on_a_gpu(dtype):
    """head_dim 128, 8 kv heads, 32 q heads; 24 sequences from 1 to 6000 keys, some
    drafting 4-token blocks, on a ring layer and a flat one."""
    rng = np.random.default_rng(9)
    lengths = np.geomspace(1, 6000, 24).astype(int)
    segments = [(4, n, True) if k % 5 == 0 else (1 + k % 3, n) for k, n in enumerate(lengths)]
    for window, ring_rows in ((0, 0), (1000, 1007)):
        case = make_case(rng, segments, n_kv_heads=8, group=4, head_dim=128, dtype=dtype,
                         window=window, ring_rows=ring_rows)
        got, plan = run(case, chunk=dec.CHUNK_KEYS)
        assert plan.n_combine > 0
        check(case, got)


def test_warm_workspace_allocates_nothing(monkeypatch):
    """After one call, the same and a smaller step run with no device allocation."""
    rng = np.random.default_rng(6)
    case = make_case(rng, [(1, 150), (2, 70)], group=2)
    workspace = AttentionWorkspace()
    check(case, run(case, workspace=workspace)[0])
    buffers = workspace.part_acc, workspace.part_ml
    plan = dec.chunk_tables(case.info, case.served[:1], mask_code=0, chunk=dec.KEY_TILE)
    tables, offsets = pack_tables(rng, case, plan)
    k_slots, v_slots, pages, bits = paged_storage(case)
    q, tables = cuda.to_device(case.q), cuda.to_device(tables)
    out = cuda.to_device(np.full(case.q.shape, SENTINEL, case.out_dtype))

    def refuse(*a, **k):
        raise AssertionError("device allocation in a warm call")
    monkeypatch.setattr(cuda, "device_array", refuse)
    monkeypatch.setattr(cuda, "to_device", refuse)
    dec.run(q, k_slots, v_slots, tables, pages=pages, page_bits=bits, **offsets,
            n_items=plan.n_items, n_combine=plan.n_combine, n_parts=plan.n_parts,
            max_q_len=plan.max_q_len, out=out, workspace=workspace, ring_rows=0, mask_code=0,
            scale=case.scale, softcap=0.0)
    monkeypatch.undo()
    assert workspace.part_acc is buffers[0] and workspace.part_ml is buffers[1]
    served = Case()
    served.__dict__.update(case.__dict__, served=case.served[:1])
    q_start, q_len = case.segments[case.served[0]][:2]
    served.owned = list(range(q_start, q_start + q_len))
    check(served, out.copy_to_host())


def test_nothing_to_serve_launches_nothing():
    rng = np.random.default_rng(7)
    case = make_case(rng, [(1, 4)])
    plan = dec.chunk_tables(case.info, [], mask_code=0)
    out = cuda.to_device(np.full(case.q.shape, SENTINEL, np.float16))
    k_slots, v_slots, pages, bits = paged_storage(case)
    dec.run(cuda.to_device(case.q), k_slots, v_slots, cuda.to_device(case.info.reshape(-1)),
            pages=pages, page_bits=bits, seq_info_off=0, work_off=0, n_items=0, combine_off=0,
            n_combine=0, n_parts=0, max_q_len=plan.max_q_len, out=out,
            workspace=AttentionWorkspace(), ring_rows=0, mask_code=0, scale=1.0, softcap=0.0)
    assert (out.copy_to_host() == SENTINEL).all()


def refused_run(q, k_store, v_store, pages, bits):
    """`dec.run` of one work item on host arrays, for storage refused before any launch."""
    dec.run(q, k_store, v_store, np.zeros(16, np.int32), pages=pages, page_bits=bits,
            seq_info_off=0, work_off=0, n_items=1, combine_off=0, n_combine=0, n_parts=0,
            max_q_len=1, out=q.copy(), workspace=None, ring_rows=0, mask_code=0, scale=1.0,
            softcap=0.0)


def test_storage_the_path_does_not_serve_is_refused():
    rng = np.random.default_rng(8)
    case = make_case(rng, [(1, 4)], head_dim=16, dtype=np.float32)
    (k_slots, v_slots), pages = paged([case.k_store, case.v_store], PAGE_SIZE)
    q = case.q[..., :12].copy()
    with pytest.raises(ValueError, match="supports"):          # head_dim 12: not served
        refused_run(q, k_slots[..., :12].copy(), v_slots[..., :12].copy(), pages,
                    page_bits(PAGE_SIZE))
    with pytest.raises(ValueError, match="supports"):          # K and V dtypes differ
        refused_run(case.q, k_slots, v_slots.astype(np.float16), pages, page_bits(PAGE_SIZE))


def test_storage_that_is_not_slot_storage_is_refused():
    """Column storage `[rows, n_cols, n_kv_heads, head_dim]` (the layout before pages), or
    slots of another head_dim than q's, is not slot storage `[n_slots, n_kv_heads,
    head_dim]`."""
    rng = np.random.default_rng(8)
    case = make_case(rng, [(1, 4)], head_dim=32, dtype=np.float32)
    (k_slots, v_slots), pages = paged([case.k_store, case.v_store], PAGE_SIZE)
    with pytest.raises(ValueError, match="slot storage"):
        refused_run(case.q, case.k_store, case.v_store, pages, page_bits(PAGE_SIZE))
    with pytest.raises(ValueError, match="slot storage"):
        refused_run(case.q[..., :16].copy(), k_slots, v_slots, pages, page_bits(PAGE_SIZE))


def test_a_page_table_is_needed_without_a_prepared_step():
    rng = np.random.default_rng(8)
    case = make_case(rng, [(1, 4)], head_dim=16, dtype=np.float32)
    (k_slots, v_slots), pages = paged([case.k_store, case.v_store], PAGE_SIZE)
    with pytest.raises(TypeError, match="pages"):
        refused_run(case.q, k_slots, v_slots, None, None)
