"""The write, clone-copy and padding kernels called directly, against NumPy references of
what the arrays must hold afterwards.

Launch shapes: a block has `lanes` threads along a run (token or (plane, row)) and
`rows` runs side by side, each lane moving two vectors a trip. The cases pick runs
of 1, 3, 5, 16 and 576 vectors (lanes partly idle, a lane's second vector past the
run, several trips per run) and element-wise runs longer than a block. The grid is
capped at two blocks (`MAX_BLOCKS`), so every block row also takes several runs:
the grid-stride stepping of tokens and of (plane, row) pairs is exercised with row
counts that are no multiple of the block's rows.

Storage starts as random bit patterns (NaNs included), so a byte a kernel must not
touch is checked as exactly that, and references compare raw bits.
"""
import numpy as np
import pytest

from kvnumba.device import cuda
from kvnumba.kernels import copy as copy_kernels
from kvnumba.kernels import write as write_kernels
from kvnumba.kernels.padding import zero_rows
from oracle import round_nearest_even

BF16 = np.uint16          # bfloat16 storage holds its bit patterns as uint16


@pytest.fixture(autouse=True)
def two_blocks(monkeypatch):
    """A grid of at most two blocks: every block row loops over several runs."""
    monkeypatch.setattr(write_kernels, "MAX_BLOCKS", 2)


def random_bits(rng, shape, dtype):
    """An array of `dtype` holding uniformly random bytes."""
    raw = rng.integers(0, 256, int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def same_bits(got, want):
    return got.view(np.uint8).tobytes() == want.view(np.uint8).tobytes()


def write_tables(rng, width, rows, n_cols, ring_rows, n_padding):
    """`(cols, positions)`: every token a distinct (row, col) slot, one of them in the last
    row, except `n_padding` tokens at column -1; on a ring each position is its row plus
    a random number of whole turns (the last row's token two: it wraps)."""
    real = width - n_padding
    last = (rows - 1) * n_cols + rng.integers(n_cols)
    others = rng.permutation(np.setdiff1d(np.arange(rows * n_cols), [last]))[:real - 1]
    slots = np.concatenate([[last], others])
    assert slots.size == real, "test bug: fewer slots than tokens"
    order = rng.permutation(width)[:real]
    cols = np.full(width, -1, np.int64)
    positions = rng.integers(0, rows, width)                     # padding: anything
    cols[order], positions[order] = slots % n_cols, slots // n_cols
    if ring_rows:
        turns = rng.integers(0, 4, width)
        turns[order[0]] = 2
        positions = positions + ring_rows * turns
    return cols, positions


def reference_write(store, values, cols, positions, ring_rows):
    """`store` after token t's values land in row `positions[t] (% ring_rows)`, column
    `cols[t]`, for every token with a column."""
    want = store.copy()
    for t, (col, p) in enumerate(zip(cols, positions)):
        if col >= 0:
            want[p % ring_rows if ring_rows else p, col] = values[t]
    return want


def check_write(rng, store_dtype, convert, k, v, rows, ring_rows, n_padding=3):
    """Write `k`, `v` into random-bit storage of `rows` rows and enough columns; storage
    must then hold exactly the reference's bits (`convert`: input -> storage values)."""
    width, n_heads, head_dim = k.shape
    n_cols = max(3, -(-width // rows) + 1)
    cols, positions = write_tables(rng, width, rows, n_cols, ring_rows, n_padding)
    tables = np.concatenate([cols, positions]).astype(np.int32)
    for_k, for_v = (random_bits(rng, (rows, n_cols, n_heads, head_dim), store_dtype)
                    for _ in range(2))
    k_dev, v_dev = cuda.to_device(for_k), cuda.to_device(for_v)
    write_kernels.write_kv(k_dev, v_dev, cuda.to_device(k), cuda.to_device(v),
                           cuda.to_device(tables), ring_rows)
    want_k = reference_write(for_k, convert(k), cols, positions, ring_rows)
    want_v = reference_write(for_v, convert(v), cols, positions, ring_rows)
    assert same_bits(k_dev.copy_to_host(), want_k), "k"
    assert same_bits(v_dev.copy_to_host(), want_v), "v"


# ---------------------------------------------------------------- write: 16-byte vectors

@pytest.mark.parametrize("dtype,n_heads,head_dim,width,ring_rows", [
    (np.float16, 1, 8, 300, 0),     # 1 vector a token: 1 lane, 256 tokens a block
    (BF16, 3, 8, 150, 7),           # 3 vectors: 2 lanes, the second one's 2nd vector past it
    (np.float16, 5, 8, 90, 5),      # 5 vectors: 4 lanes, 3 of them idle on the 2nd vector
    (np.float32, 1, 64, 40, 0),     # 16 vectors: 8 lanes, 32 tokens a block
    (np.float32, 9, 256, 5, 3),     # 576 vectors: 256 lanes, 2 trips a token
])
def test_write_vectors_land_in_their_slots_and_nowhere_else(dtype, n_heads, head_dim, width,
                                                            ring_rows):
    rng = np.random.default_rng(n_heads * head_dim + width)
    k = random_bits(rng, (width, n_heads, head_dim), dtype)
    v = random_bits(rng, (width, n_heads, head_dim), dtype)
    check_write(rng, dtype, lambda x: x, k, v, ring_rows or width // 2, ring_rows)


# ---------------------------------------------------------------- write: element-wise

def to_bf16(x):
    return round_nearest_even(np.asarray(x, np.float32), "bf16")


@pytest.mark.parametrize("store_dtype,convert", [(np.float16, lambda x: x.astype(np.float16)),
                                                 (BF16, to_bf16)])
@pytest.mark.parametrize("n_heads,head_dim", [(5, 3), (7, 40)])   # 15 and 280 elements a run
def test_write_elements_convert_into_their_slots_and_nowhere_else(store_dtype, convert,
                                                                  n_heads, head_dim):
    rng = np.random.default_rng(n_heads * head_dim)
    k = rng.standard_normal((12, n_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((12, n_heads, head_dim)).astype(np.float32)
    check_write(rng, store_dtype, convert, k, v, rows=5, ring_rows=5)


def test_write_of_a_strided_view_takes_every_element():
    rng = np.random.default_rng(3)
    width, n_heads, head_dim, rows, n_cols = 9, 2, 8, 4, 3
    wide_k = rng.standard_normal((width, n_heads, 2 * head_dim)).astype(np.float16)
    wide_v = rng.standard_normal((width, n_heads, 2 * head_dim)).astype(np.float16)
    cols, positions = write_tables(rng, width, rows, n_cols, 0, n_padding=2)
    k_store = random_bits(rng, (rows, n_cols, n_heads, head_dim), np.float16)
    v_store = random_bits(rng, (rows, n_cols, n_heads, head_dim), np.float16)
    k_dev, v_dev = cuda.to_device(k_store), cuda.to_device(v_store)
    k_view, v_view = cuda.to_device(wide_k)[:, :, 1::2], cuda.to_device(wide_v)[:, :, 1::2]
    assert not write_kernels.wide_ok(k_dev, k_view)
    write_kernels.write_kv(k_dev, v_dev, k_view, v_view,
                           cuda.to_device(np.concatenate([cols, positions]).astype(np.int32)), 0)
    assert same_bits(k_dev.copy_to_host(),
                     reference_write(k_store, wide_k[:, :, 1::2], cols, positions, 0))
    assert same_bits(v_dev.copy_to_host(),
                     reference_write(v_store, wide_v[:, :, 1::2], cols, positions, 0))


# ---------------------------------------------------------------- clone copy

@pytest.mark.parametrize("dtype,n_heads,head_dim,n_layers,n_rows", [
    (np.float16, 1, 8, 3, 300),      # 1 vector a run: 256 runs a block, 1800 runs
    (BF16, 2, 64, 2, 37),            # 16 vectors: 8 lanes, 32 runs a block; 37 rows
    (np.float16, 3, 8, 2, 23),       # 3 vectors: 2 lanes
    (np.float32, 9, 256, 1, 3),      # 576 vectors: 256 lanes, 2 trips a run
    (np.float16, 2, 3, 2, 45),       # 12-byte runs: element-wise, 8 lanes
    (np.float32, 7, 39, 1, 5),       # 273 elements a run: element-wise, 2 trips for some
])
def test_copy_column_copies_the_rows_and_nothing_else(dtype, n_heads, head_dim, n_layers,
                                                      n_rows):
    rng = np.random.default_rng(n_heads * head_dim + n_rows)
    rows, n_cols, src, dst = n_rows + 2, 4, 3, 1
    group = random_bits(rng, (n_layers, 2, rows, n_cols, n_heads, head_dim), dtype)
    device = cuda.to_device(group)
    copy_kernels.copy_column(device, src, dst, n_rows)
    want = group.copy()
    want[:, :, :n_rows, dst] = group[:, :, :n_rows, src]
    assert same_bits(device.copy_to_host(), want)


def test_copy_of_no_rows_changes_nothing():
    rng = np.random.default_rng(4)
    group = random_bits(rng, (2, 2, 3, 3, 2, 8), np.float16)
    device = cuda.to_device(group)
    copy_kernels.copy_column(device, 0, 1, 0)
    assert same_bits(device.copy_to_host(), group)


# ---------------------------------------------------------------- padding rows

@pytest.mark.parametrize("n_heads,head_dim", [(3, 200), (50, 3), (1, 128)])
def test_zero_rows_zeroes_every_element_of_the_padding_rows(n_heads, head_dim):
    rng = np.random.default_rng(n_heads)
    host = random_bits(rng, (5, n_heads, head_dim), np.float16)
    out = cuda.to_device(host)
    zero_rows(out, 2)
    got = out.copy_to_host()
    assert same_bits(got[:2], host[:2])
    assert not got[2:].view(np.uint16).any()
