"""The decode path's combine kernel (kvnumba.kernels.decode.combine) against a float64 reference.

Partials are made here from first principles: random base-2 scores and values of each
(query, q head) row over a segment's keys, cut into chunks as decode cuts a key range,
each chunk's (max, sum, unnormalised accumulator) computed in float64 and stored as
float32 in decode's layout (`[n_parts, max_q_len, n_q_heads, head_dim]` and `[..., 2]`),
some chunks seeing no key of some row (max -inf, sum 0, acc 0). The reference is the
float64 softmax-weighted sum over every key a row sees. Workspace words no segment
owns hold NaN (a read of one poisons a row), rows of `out` no combined segment owns
hold a sentinel that must survive, and the tables sit behind and between unrelated
words, as a caller packs them.
"""
import numpy as np
import pytest

from kvnumba.device import cuda
from kvnumba.kernels.decode import combine as comb
from kvnumba.kernels import decode as dec
from kvnumba.arith.positions import SEQ, POS_START, Q_LEN, Q_START, SEQ_INFO_FIELDS
from oracle import bf16_values

SENTINEL = -3.5                 # exact in float16, bfloat16 and float32
BF16_SENTINEL = 0xC060          # -3.5 as bfloat16 bits
KEYS_PER_CHUNK = 3
#: relative tolerance of each out dtype: its rounding plus float32 merging
TOLERANCE = {np.float32: 2e-5, np.float16: 2e-3, np.uint16: 8e-3}


class Segment:
    """One split segment: `q_len` queries, `n_parts` chunks, float32 partials
    `ml[part, i, head] = (max, sum)`, `acc[part, i, head, :]`, and the float64 result."""

    def __init__(self, rng, q_len, n_parts, n_heads, head_dim):
        self.q_len, self.n_parts = q_len, n_parts
        keys = n_parts * KEYS_PER_CHUNK
        # base-2 scores; whole chunks shifted by up to +-40 so that the maxes differ
        # widely and the running reference moves both ways
        shift = rng.uniform(-40, 40, n_parts).repeat(KEYS_PER_CHUNK)
        scores = rng.standard_normal((q_len, n_heads, keys)) * 3 + shift
        values = rng.standard_normal((keys, n_heads, head_dim))
        seen = rng.random((q_len, n_heads, keys)) < 0.7
        # chunks some rows do not see at all (not every chunk of a row)
        blind = rng.random((q_len, n_heads, n_parts)) < 0.25
        seen &= ~blind.repeat(KEYS_PER_CHUNK, axis=2)
        seen[..., rng.integers(keys)] = True        # every row sees some key
        scores = np.where(seen, scores, -np.inf)

        self.ml = np.zeros((n_parts, q_len, n_heads, 2), np.float32)
        self.acc = np.zeros((n_parts, q_len, n_heads, head_dim), np.float32)
        for c in range(n_parts):
            s = scores[..., c * KEYS_PER_CHUNK:(c + 1) * KEYS_PER_CHUNK]
            v = values[c * KEYS_PER_CHUNK:(c + 1) * KEYS_PER_CHUNK]
            m = s.max(axis=2)
            w = np.exp2(s - np.where(np.isfinite(m), m, 0)[..., None])
            self.ml[c, ..., 0] = m
            self.ml[c, ..., 1] = w.sum(axis=2)
            self.acc[c] = np.einsum("ihk,khd->ihd", w, v)
        assert n_parts < 3 or (self.ml[..., 0] == -np.inf).any(), "test bug: none blind"
        w = np.exp2(scores - scores.max(axis=2, keepdims=True))
        self.want = np.einsum("ihk,khd->ihd", w, values) / w.sum(axis=2)[..., None]


def launch(rng, segments, n_heads, head_dim, out_dtype, *, width=None):
    """Combine `segments` in one launch, laid out as a caller would; returns out (host)
    and, per segment, its token rows."""
    n = len(segments)
    max_q_len = max(s.q_len for s in segments)
    # the segment table: the combined segments among others, in a shuffled order,
    # tokens back to back behind one foreign token
    n_table = n + 2
    order = rng.permutation(n_table)              # table row of segments[k] = order[k]
    info = np.zeros((n_table, SEQ_INFO_FIELDS), np.int32)
    q_lens = [segments[k].q_len for k in range(n)] + [2, 1]
    rows_of = [None] * n_table
    for k in range(n_table):
        rows_of[order[k]] = k
    q_start = 1
    tokens = {}
    for row in range(n_table):
        k = rows_of[row]
        info[row, [Q_START, Q_LEN, SEQ, POS_START]] = q_start, q_lens[k], row, 1000
        if k < n:
            tokens[k] = np.arange(q_start, q_start + q_lens[k])
        q_start += q_lens[k]
    width = width or q_start + 1
    # partial slots: the segments' runs in a shuffled order with unused slots between
    n_parts = sum(s.n_parts for s in segments) + 2 * n + 1
    firsts, slot = {}, 1
    for k in rng.permutation(n):
        firsts[k] = slot
        slot += segments[k].n_parts + 2
    combine = np.array([(order[k], firsts[k], segments[k].n_parts) for k in range(n)],
                       np.int32)
    combine = combine[rng.permutation(n)]
    parts = [rng.integers(-99, 99, 3).astype(np.int32), info.reshape(-1),
             rng.integers(-99, 99, 2).astype(np.int32), combine.reshape(-1)]
    seq_info_off = parts[0].size
    combine_off = seq_info_off + info.size + parts[2].size
    tables = np.concatenate(parts)

    part_acc = np.full((n_parts, max_q_len, n_heads, head_dim), np.nan, np.float32)
    part_ml = np.full((n_parts, max_q_len, n_heads, 2), np.nan, np.float32)
    for k, s in enumerate(segments):
        part_acc[firsts[k]:firsts[k] + s.n_parts, :s.q_len] = s.acc
        part_ml[firsts[k]:firsts[k] + s.n_parts, :s.q_len] = s.ml
    fill = BF16_SENTINEL if out_dtype == np.uint16 else SENTINEL
    out = cuda.to_device(np.full((width, n_heads, head_dim), fill, out_dtype))
    comb.run(cuda.to_device(tables), cuda.to_device(part_acc.reshape(-1)),
             cuda.to_device(part_ml.reshape(-1)), out, seq_info_off=seq_info_off,
             combine_off=combine_off, n_combine=n, max_q_len=max_q_len)
    cuda.synchronize()
    return out.copy_to_host(), [tokens[k] for k in range(n)]


def values_of(out):
    return bf16_values(out) if out.dtype == np.uint16 else out.astype(np.float64)


def check(segments, out, tokens):
    """Each segment's rows match its reference; every other row keeps the sentinel."""
    got = values_of(out)
    owned = np.concatenate(tokens)
    others = np.setdiff1d(np.arange(len(out)), owned)
    assert (got[others] == SENTINEL).all(), "a row no combined segment owns was written"
    tol = TOLERANCE[out.dtype.type]
    for s, rows in zip(segments, tokens):
        assert np.isfinite(got[rows]).all(), f"{s.n_parts} parts: NaN/Inf in a row"
        err = np.abs(got[rows] - s.want).max() / np.abs(s.want).max()
        assert err < tol, f"{s.n_parts} parts: max error {err:.2e} >= {tol:.0e}"


# ---------------------------------------------------------------- the figures

def test_block_shape_covers_every_head_dim_the_decode_path_serves():
    """Every row width the decode kernels write: 16 to 256 (the CUDA-core kernel's) with
    8 part groups, and up to 512 (the wide tile's V) with 4 at 512: at most 512 threads."""
    for head_dim in range(16, 513, 16):
        assert comb.supports(head_dim)
        lanes = comb.lanes(head_dim)
        assert lanes & (lanes - 1) == 0 and lanes * 4 >= head_dim > lanes * 2
        groups = comb.PART_GROUPS if head_dim <= 256 else 4
        assert comb.threads(head_dim) == groups * lanes <= 512
    assert dec.supports(256, np.float16) and not dec.supports(272, np.float16)
    assert not comb.supports(8) and not comb.supports(40) and not comb.supports(528)


# ---------------------------------------------------------------- the merge

@pytest.mark.parametrize("out_dtype", [np.float16, np.float32, np.uint16])
def test_segments_of_1_2_17_and_129_parts_in_one_launch(out_dtype):
    rng = np.random.default_rng(1)
    n_heads, head_dim = 4, 16          # e.g. 2 kv heads of a GQA group of 2
    segments = [Segment(rng, q_len, n_parts, n_heads, head_dim)
                for q_len, n_parts in ((2, 1), (3, 2), (1, 17), (2, 129))]
    out, tokens = launch(rng, segments, n_heads, head_dim, out_dtype)
    check(segments, out, tokens)


@pytest.mark.parametrize("head_dim, out_dtype", [(64, np.float16), (128, np.float32),
                                                 (48, np.uint16)])
def test_wider_heads(head_dim, out_dtype):
    """head_dim 64 and 128 (256 threads a block), 48 (lanes past the row idle)."""
    rng = np.random.default_rng(head_dim)
    n_heads = 2
    segments = [Segment(rng, 2, 17, n_heads, head_dim), Segment(rng, 1, 2, n_heads, head_dim)]
    out, tokens = launch(rng, segments, n_heads, head_dim, out_dtype)
    check(segments, out, tokens)


def test_129_parts_at_head_dim_128():
    rng = np.random.default_rng(7)
    segments = [Segment(rng, 1, 129, 1, 128)]
    out, tokens = launch(rng, segments, 1, 128, np.float32)
    check(segments, out, tokens)


def test_a_segment_is_the_same_bits_alone_or_with_others():
    """Its output depends on its own partials only: not on the other segments, the
    slots it was given, max_q_len or where the tables lie."""
    rng = np.random.default_rng(3)
    n_heads, head_dim = 2, 16
    segments = [Segment(rng, q_len, n_parts, n_heads, head_dim)
                for q_len, n_parts in ((3, 129), (1, 17), (2, 2), (1, 70))]
    together, tokens = launch(rng, segments, n_heads, head_dim, np.float32)
    for k in (0, 1, 3):
        alone, (rows,) = launch(rng, [segments[k]], n_heads, head_dim, np.float32)
        np.testing.assert_array_equal(alone[rows].view(np.uint32),
                                      together[tokens[k]].view(np.uint32))


def test_no_combine_rows_launch_nothing():
    out = cuda.to_device(np.full((3, 1, 16), SENTINEL, np.float16))
    dummy = cuda.to_device(np.zeros(1, np.float32))
    comb.run(cuda.to_device(np.zeros(4, np.int32)), dummy, dummy, out, seq_info_off=0,
             combine_off=0, n_combine=0, max_q_len=1)
    assert (out.copy_to_host() == SENTINEL).all()
