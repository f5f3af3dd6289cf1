"""Decode on tensor cores for grouped queries (kvnumba.kernels.decode, `tensor_cores`):
the prefill kernel split over the decode path's key chunks, a segment's rows (query heads
of one kv head times its tokens) in the mma's M dimension, its partials merged by the
decode combine; against the float64 oracle on hand-built paged storage
(tests/test_decode.py's cases: NaN where nothing may be read, a sentinel in the rows no
served segment owns), and the rule that routes a layer's decode rows. Rings after
several wraps at a group of 8 are tests/test_decode.py's `test_ring_layers_after_several_wraps`.

Tolerances are test_decode's (relative L2 error 2e-3 where a 16-bit type is involved):
the tensor cores round q and each tile's probabilities to the 16-bit mma type, well
inside it at these sizes.
"""
import numpy as np
import pytest

from kvnumba.kernels import decode as dec
from kvnumba.kernels.decode import shape as decode_shape
from oracle import FP8
from test_decode import make_case, run, check


# ---------------------------------------------------------------- the rule

def test_rows_past_what_cuda_cores_serve_at_the_byte_limit_take_the_tensor_cores():
    """16-bit storage: up to 4 rows (group times the longest decode segment) on CUDA
    cores, more on tensor cores; 8-bit floats (uint8: e4m3 bits, int8: e5m2) up to 2;
    float32 storage and head dims the tensor-core kernel does not take always on CUDA
    cores."""
    for dtype, most in ((np.float16, 4), (np.uint16, 4), (np.uint8, 2), (np.int8, 2)):
        assert [dec.grouped(rows, 128, dtype) for rows in (1, most, most + 1, 128)] == \
            [False, False, True, True]
    assert not dec.grouped(128, 128, np.float32)
    assert not dec.grouped(8, 512, np.float16) and not dec.grouped(8, 12, np.float16)
    assert decode_shape.CUDA_CORE_ROWS == {2: 4, 1: 2}


def test_the_rule_chooses_per_segment_and_a_forced_kernel_must_serve():
    """`tensor_cores=None` follows the rule segment by segment, each by its own rows
    (group 4: a 1-token segment's 4 rows on CUDA cores, a 2-token one's 8 on tensor
    cores), so each comes out bit for bit as with that kernel forced for the whole
    step; True over float32 storage is refused before any launch."""
    rng = np.random.default_rng(1)
    case = make_case(rng, [(1, 40), (2, 9)], group=4, n_kv_heads=1)
    ruled, _ = run(case, tensor_cores=None)
    check(case, ruled)
    for tensor_cores, q_len in ((False, 1), (True, 2)):
        forced, _ = run(case, tensor_cores=tensor_cores)
        (seg,) = [s for s in case.served if case.segments[s][1] == q_len]
        q_start = case.segments[seg][0]
        rows = slice(q_start, q_start + q_len)
        np.testing.assert_array_equal(ruled[rows], forced[rows])
        assert not np.array_equal(ruled[rows], run(case, tensor_cores=not tensor_cores)[0][rows])
    single = make_case(np.random.default_rng(2), [(1, 40)], group=2, dtype=np.float32)
    with pytest.raises(ValueError, match="tensor_cores=True"):
        run(single, tensor_cores=True)


# ---------------------------------------------------------------- groups and drafts

@pytest.mark.parametrize("group, n_kv_heads", [(1, 2), (4, 2), (8, 1), (16, 1)])
def test_groups(group, n_kv_heads):
    """A long history split into chunks (the combine) beside a short one in one chunk."""
    rng = np.random.default_rng(10 + group)
    case = make_case(rng, [(1, 150), (2, 20)], group=group, n_kv_heads=n_kv_heads)
    got, plan = run(case, tensor_cores=True)
    assert plan.n_combine == 1
    check(case, got)


def test_a_group_of_128_rows():
    """128 query heads over one kv head (the latent-attention shape's rows): one block of
    8 warps reads each K/V tile once for all of them."""
    rng = np.random.default_rng(128)
    case = make_case(rng, [(1, 100)], group=128, n_kv_heads=1, others=((1, 0),))
    got, plan = run(case, tensor_cores=True)
    assert plan.n_combine == 1
    check(case, got)


@pytest.mark.parametrize("group", [2, 8])
def test_drafts_of_one_to_four_tokens(group):
    """q_len 1..4, plain and bidirectional draft blocks, split and not: up to 32 rows."""
    rng = np.random.default_rng(20 + group)
    segments = [(1, 9), (2, 80, True), (3, 100), (4, 120, True), (4, 3), (2, 0, True)]
    case = make_case(rng, segments, group=group)
    got, plan = run(case, tensor_cores=True)
    assert plan.n_combine == 2
    check(case, got)


# ---------------------------------------------------------------- storage and shapes

@pytest.mark.parametrize("store, q_dtype, out_dtype", [
    (np.float16, np.float16, np.float16), (np.float16, np.float32, np.float32),
    ("float8_e4m3", np.float16, np.float16), ("float8_e4m3", np.float32, np.float16),
    ("float8_e5m2", np.float16, np.float32), ("float8_e4m3", np.uint16, np.uint16),
    ("float8_e5m2", np.uint16, np.float32)])
def test_storage_query_and_output_dtypes(store, q_dtype, out_dtype):
    """Up to 16 rows a segment: one warp a block, so 8-bit floats are staged as stored and
    widened from the fragments (to float16, or to bfloat16 for bfloat16 queries)."""
    rng = np.random.default_rng(5)
    case = make_case(rng, [(2, 75), (1, 4)], group=8, n_kv_heads=1, dtype=store,
                     q_dtype=q_dtype, out_dtype=out_dtype)
    check(case, run(case, tensor_cores=True)[0])


@pytest.mark.parametrize("out_dtype", [np.float16, np.float32])
def test_an_output_not_16_byte_aligned_is_written_a_value_at_a_time(out_dtype):
    """A one-chunk segment's rows go straight to `out`: where `out` is not 16-byte
    aligned each value is its own store (the simulator refuses a misaligned wide one)."""
    rng = np.random.default_rng(6)
    case = make_case(rng, [(1, 4), (2, 30)], group=8, n_kv_heads=1, out_dtype=out_dtype)
    check(case, run(case, tensor_cores=True, out_offset=1)[0])


@pytest.mark.parametrize("head_dim, dtype", [(32, np.float16), (64, np.float16),
                                             (128, "float8_e4m3"), (256, np.float16),
                                             (64, "float8_e5m2"), (96, "float8_e4m3"),
                                             (256, "float8_e4m3"), (80, "float8_e4m3")])
def test_head_dims(head_dim, dtype):
    rng = np.random.default_rng(head_dim)
    case = make_case(rng, [(1, 8), (2, 3, True)], group=8, n_kv_heads=1, head_dim=head_dim,
                     dtype=dtype, q_dtype=np.float16 if dtype in FP8 else None,
                     others=((1, 0),))
    check(case, run(case, tensor_cores=True)[0])


@pytest.mark.parametrize("window", [1, 5, 70])
def test_windows_on_flat_layers(window):
    """Windows narrower than a key tile, and one over two chunks: rows of a chunk that
    see none of its keys leave an empty partial."""
    rng = np.random.default_rng(20 + window)
    case = make_case(rng, [(1, 140), (3, 60), (4, 90, True), (2, 0)], group=4,
                     window=window)
    check(case, run(case, tensor_cores=True)[0])


def test_softcap():
    rng = np.random.default_rng(4)
    case = make_case(rng, [(1, 100), (3, 12)], group=8, n_kv_heads=1, softcap=2.0,
                     qk_scale=4.0)
    got, plan = run(case, tensor_cores=True)
    assert plan.n_combine == 1
    check(case, got)


def test_scores_that_keep_growing_rescale_each_row_on_its_own():
    """Keys growing along a history of several key tiles and chunks push each row's max
    up again and again."""
    rng = np.random.default_rng(7)
    case = make_case(rng, [(2, 300), (1, 3)], group=8, n_kv_heads=1, qk_scale=4.0,
                     key_growth=0.05)
    got, plan = run(case, tensor_cores=True)
    assert plan.n_combine == 1
    check(case, got)
