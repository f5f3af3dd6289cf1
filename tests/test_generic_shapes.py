"""The generic kernel (kvnumba.kernels.generic) where V's width is not K's, and at head dims
up to 512 (K's, V's or both), against the float64 oracle of
tests/test_attention_kernel.py (`reference_lse`: out over V of its own width, lse with
the sink's logit), on hand-built paged storage.

Every case runs the decode path split into several chunks (`kv_chunk`, so the combine
merges partials laid out at V's width) and the prefill path; the 512 cases are few keys
on one kv head (the simulator runs a 512-wide tile slowly).
"""
import os

os.environ.setdefault("KVNUMBA_DEVICE", "simulator")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from kvnumba.device import cuda  # noqa: E402
from kvnumba.kernels import generic as att  # noqa: E402
from kvnumba.kernels.workspace import AttentionWorkspace  # noqa: E402
from test_attention_kernel import (check, device_storage, make_case, out_shape,  # noqa: E402
                                   plan_path, reference_lse, run, segs_of, tables_of)

#: a decode token far into its history, a draft block, a decode token near the start
DECODE = segs_of((1, 30), (3, 12, True), (1, 4))
#: two prefill chunks and a draft block
PREFILL = segs_of((7, 0), (6, 20), (3, 9, True))
#: (window, ring_rows): a flat layer without a window, and a ring of a window of 6
#: holding 7-token writes
LAYOUTS = {"flat": (0, 0), "ring": (6, 12)}
#: (path, kv_chunk): split-K decode (several chunks, the combine), the prefill path in one
#: piece, and the prefill tiles split too (the combine at their row tiles)
PATHS = [("decode", 4), ("prefill", None), ("prefill", 5)]
THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
#: static shared memory per block, in float32s
SHARED_LIMIT = 48 * 1024 // 4


def head_sinks(n_heads, seed):
    """float32 `[n_heads]` logits about the scores' size, one far above them (head 1)
    and no sink on head 2 (`-inf`)."""
    sinks = np.random.default_rng(seed).normal(0.0, 1.5, n_heads).astype(np.float32)
    sinks[1] = 9.0
    sinks[2] = -np.inf
    return sinks


def planned(case, path, kv_chunk):
    """The launch shape of `case` on `path`; a given chunk must split some row tile."""
    plan = plan_path(case, path=path, kv_chunk=kv_chunk)
    assert plan["path"] == path
    assert plan["dpad"] == att.head_dim_bucket(max(case.q.shape[2], case.v_head_dim))
    if kv_chunk is not None:
        assert plan["n_splits"] > 1, "the chunk must split: the combine is under test"
    return plan


# ---------------------------------------------------------------- tile tables

def test_tile_shapes_meet_the_kernels_asserts_and_fit_static_shared_memory():
    assert att.HEAD_DIM_BUCKETS[-1] == 576
    for dpad in att.HEAD_DIM_BUCKETS:
        for tiles in att.DECODE_TILES[dpad] + (att.PREFILL_TILES[dpad],):
            block_rows, block_keys, key_lanes, threads = tiles
            rows_lanes = threads // key_lanes
            assert key_lanes * rows_lanes == threads
            assert block_rows % rows_lanes == 0 and block_keys % key_lanes == 0
            v_width = att.V_SLICES.get(dpad, dpad)
            assert (block_rows * v_width) % threads == 0
            assert block_rows * v_width // threads <= att.MAX_OWN  # accumulators in registers
            floats = ((block_rows + block_keys) * (dpad + 1)
                      + block_rows * (block_keys + 1) + 4 * block_rows)   # + per-row state
            assert floats <= SHARED_LIMIT, f"{dpad} {tiles}: {floats} floats"
            att.attention_kernel(dpad, *tiles, att.V_SLICES.get(dpad))  # its own asserts
    for head_dim, v_head_dim, dpad in [(16, 8, 16), (8, 24, 32), (12, None, 16),
                                       (40, 300, 512), (512, 64, 512), (257, 1, 512)]:
        for path in ("decode", "prefill"):
            plan = att.launch_shape(n_segments=1, max_q_len=1, max_kv_len=9, n_q_heads=2,
                                    n_kv_heads=1, head_dim=head_dim, v_head_dim=v_head_dim,
                                    mask_code=0, path=path)
            assert plan["dpad"] == dpad
            tiles = (plan["block_rows"], plan["block_keys"], plan["key_lanes"],
                     plan["threads"])
            assert tiles in (att.DECODE_TILES[dpad] if path == "decode"
                             else (att.PREFILL_TILES[dpad],))
    with pytest.raises(ValueError, match="at most 576"):
        att.launch_shape(n_segments=1, max_q_len=1, max_kv_len=9, n_q_heads=2, n_kv_heads=1,
                         head_dim=64, v_head_dim=577, mask_code=0)


# ---------------------------------------------------------------- V of its own width

@pytest.mark.parametrize("path, kv_chunk", PATHS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("head_dim, v_head_dim, dtype", [
    (16, 8, np.float32), (12, 24, np.float16)] + ([(32, 16, np.float32)] if THOROUGH else []))
def test_v_narrower_and_wider_than_k(head_dim, v_head_dim, dtype, layout, path, kv_chunk):
    """GQA groups of 2 over 2 kv heads, a padding row, a draft block, on a flat layer and
    a wrapped ring under a window: V narrower than K (in the 16 bucket; in the 32 bucket
    under the thorough profile) and wider (in the 32 bucket)."""
    window, ring_rows = LAYOUTS[layout]
    rng = np.random.default_rng(head_dim * 100 + v_head_dim)
    case = make_case(rng, DECODE if path == "decode" else PREFILL, n_kv_heads=2, group=2,
                     head_dim=head_dim, v_head_dim=v_head_dim, window=window,
                     ring_rows=ring_rows, dtype=dtype, pad=1, page_size=8)
    planned(case, path, kv_chunk)
    got = run(case, path=path, kv_chunk=kv_chunk)
    assert got.shape == out_shape(case)
    check(case, got)


@pytest.mark.parametrize("path, kv_chunk", [("decode", 4), ("decode", None),
                                            ("prefill", None)])
@pytest.mark.parametrize("head_dim, v_head_dim", [(16, 8), (12, 24)])
def test_lse_and_sinks_with_v_of_its_own_width(head_dim, v_head_dim, path, kv_chunk):
    """lse alone, then lse with sinks (joined after the last tile on one split, in the
    combine on several): out and lse against the oracle, and the sinks matter."""
    rng = np.random.default_rng(7 + head_dim + v_head_dim)
    case = make_case(rng, DECODE if path == "decode" else PREFILL, n_kv_heads=2, group=4,
                     head_dim=head_dim, v_head_dim=v_head_dim, window=6, ring_rows=12,
                     pad=1, page_size=8)
    plan = plan_path(case, path=path, kv_chunk=kv_chunk)
    assert (plan["n_splits"] > 1) == (kv_chunk is not None)
    n, n_heads = case.n_tokens, case.q.shape[1]
    sinks = head_sinks(n_heads, head_dim)
    for given in (None, sinks):
        lse = cuda.to_device(np.full(case.q.shape[:2], np.nan, np.float32))
        kw = {} if given is None else dict(sinks=cuda.to_device(given))
        got = run(case, path=path, kv_chunk=kv_chunk, lse=lse, **kw)
        want_out, want_lse = reference_lse(case, given)
        assert np.isnan(got[n:]).all()
        np.testing.assert_allclose(got[:n], want_out[:n], rtol=0, atol=2e-5)
        np.testing.assert_allclose(lse.copy_to_host()[:n], want_lse[:n], rtol=0, atol=1e-4)
    plain_out, plain_lse = reference_lse(case)
    assert np.abs(plain_out - want_out)[:n].max() > 1e-2    # the sinks moved the outputs
    assert np.abs(plain_lse - want_lse)[:n, 2].max() == 0   # but not head 2's (no sink)


def test_one_run_rebinds_for_another_v_width():
    """A prepared run called with V 24 wide, then 8 wide (its first 8 dims), then 24 again
    (q, K and the tables the same): each V's slot shape is its own launch signature, with
    its own tiles (buckets 32 and 16) and partials."""
    rng = np.random.default_rng(21)
    wide = make_case(rng, DECODE, n_kv_heads=1, group=2, head_dim=16, v_head_dim=24,
                     window=6, ring_rows=12, pad=1, page_size=8)
    narrow = make_case(np.random.default_rng(21), DECODE, n_kv_heads=1, group=2,
                       head_dim=16, v_head_dim=24, window=6, ring_rows=12, pad=1,
                       page_size=8)
    narrow.v_head_dim = 8
    narrow.v_store = narrow.v_store[..., :8].copy()
    narrow.hist_v = [h[..., :8] for h in narrow.hist_v]
    tables, offsets = tables_of(wide)
    prepared = att.prepare(cuda.to_device(tables), **offsets, max_q_len=wide.max_q_len,
                           max_kv_len=wide.max_kv_len, page_bits=3,
                           workspace=AttentionWorkspace(), path="decode", kv_chunk=4)
    q = cuda.to_device(wide.q)
    for case in (wide, narrow, wide):
        (k_slots, v_slots, pages), paging = device_storage(case)
        assert paging["page_bits"] == 3
        out = cuda.to_device(np.full(out_shape(case), np.nan, case.out_dtype))
        prepared(q, k_slots, v_slots, pages, out, att.no_output(), att.no_sinks(),
                 case.ring_rows, case.window, case.scale, case.softcap)
        check(case, out.copy_to_host())
    assert len(prepared._launches) == 2


# ---------------------------------------------------------------- head dims up to 512

@pytest.mark.parametrize("path, kv_chunk, group, block_rows", [
    ("decode", 4, 2, 4), ("decode", 4, 4, 4), ("prefill", None, 2, 4)])
@pytest.mark.parametrize("head_dim, v_head_dim", [(512, 512), (512, 256), (40, 300)])
def test_head_dims_up_to_512(head_dim, v_head_dim, path, kv_chunk, group, block_rows):
    """The 512 bucket, from K's width or from V's alone, on each of its tiles: a few keys
    on one kv head, float16 storage."""
    rng = np.random.default_rng(head_dim + v_head_dim + group)
    segments = segs_of((1, 6), (2, 3, True)) if path == "decode" else segs_of((5, 2))
    case = make_case(rng, segments, n_kv_heads=1, group=group, head_dim=head_dim,
                     v_head_dim=v_head_dim, dtype=np.float16, pad=1, page_size=8)
    plan = planned(case, path, kv_chunk)
    assert plan["dpad"] == 512 and plan["block_rows"] == block_rows
    check(case, run(case, path=path, kv_chunk=kv_chunk))


# ---------------------------------------------------------------- a latent layer's rows

@pytest.mark.parametrize("path, kv_chunk", [("decode", 4), ("prefill", None)])
def test_a_latent_row_is_k_and_its_first_values_are_v(path, kv_chunk):
    """Rows of 576 (a latent layer's: rank 512 + 64 rope values), K the whole row and V
    its first 512 read from the same store, against the oracle over those values: the
    576 bucket, its V in 4 slices of 128 (each block scores all of K), split-K decode
    merged by the combine."""
    rng = np.random.default_rng(576)
    segments = segs_of((1, 6), (2, 3, True)) if path == "decode" else segs_of((5, 2))
    case = make_case(rng, segments, n_kv_heads=1, group=4, head_dim=576, v_head_dim=512,
                     dtype=np.float16, pad=1, page_size=8)
    case.v_store = case.k_store[..., :512].copy()
    case.hist_v = [h[..., :512] for h in case.hist_k]
    plan = planned(case, path, kv_chunk)
    assert (plan["dpad"], plan["v_slice"], plan["grid"][1]) == (576, 128, 4)
    out = cuda.to_device(np.full(out_shape(case), np.nan, case.out_dtype))
    tables, offsets = tables_of(case)
    (k_slots, _, _), paging = device_storage(case)
    att.attend(cuda.to_device(case.q), k_slots, k_slots, cuda.to_device(tables), out,
               **paging, **offsets, max_q_len=case.max_q_len, max_kv_len=case.max_kv_len,
               ring_rows=case.ring_rows, mask_code=case.window, scale=case.scale,
               softcap=case.softcap, workspace=AttentionWorkspace(), path=path,
               kv_chunk=kv_chunk)
    check(case, out.copy_to_host())
