"""The write, row-copy, page-table patch and padding kernels called directly, against
NumPy references of what the arrays must hold afterwards.

Storage is paged as a cache holds it: the write cases build column storage `[rows,
n_seqs, n_kv_heads, head_dim]` (row `r` of sequence `s`), move it into slots through
a shuffled page table (`paging.paged`: no sequence's pages adjacent or in order, spare
pages and the slots past a sequence's last row hold junk) and compare the kernel's
slots with the reference written into the columns and paged the same way. Page sizes
8, 16 and 256; rows that end inside a page.

Launch shapes: a block has `lanes` threads along a run (a token; for the copy, as many
as a page of one plane takes, whatever rows a run holds) and `rows` runs side by side,
each lane moving `write.TRIP_VECTORS` (4) vectors of K and as many of V a trip, those
past the run clamped to its last one. The cases pick runs of 1, 3, 5, 8, 16, 24, 256,
576 and 1536 vectors (a lane's vectors past the run, several trips per run), copies of
runs of 1 row to a whole page (lanes left idle past a short run), and element-wise runs
longer than a block. The grid is capped at two blocks (`MAX_BLOCKS`), so every block row
also takes several runs: the grid-stride stepping of tokens, of (plane, row run) items and of
patches is exercised with counts that are no multiple of the block's rows.

Storage starts as random bit patterns (NaNs included), so a byte a kernel must not
touch is checked as exactly that, and references compare raw bits.
"""
import numpy as np
import pytest

from kvnumba.device import cuda
from kvnumba.kernels.moves import page_copy as copy_kernels
from kvnumba.kernels.launch import calling as launch
from kvnumba.kernels.moves import write as write_kernels
from kvnumba.kernels.padding import zero_rows
from kvnumba.kernels.moves.page_table import patch_pages
from moveref import (check_write, device_tables, partial_runs, random_bits, reference_copy,
                     reference_write, same_bits, tables_holding, write_tables)
from oracle import round_nearest_even
from paging import page_bits, paged

BF16 = np.uint16          # bfloat16 storage holds its bit patterns as uint16


@pytest.fixture(autouse=True)
def two_blocks(monkeypatch):
    """A grid of at most two blocks: every block row loops over several runs."""
    monkeypatch.setattr(write_kernels, "MAX_BLOCKS", 2)
    monkeypatch.setattr(launch, "MAX_BLOCKS", 2)


# ---------------------------------------------------------------- write

@pytest.mark.parametrize("dtype,n_heads,head_dim,width,rows,ring_rows,page_size", [
    (np.float16, 1, 8, 300, 150, 0, 8),   # 1 vector a token: 1 lane; 19 pages, the last partial
    (BF16, 3, 8, 150, 20, 20, 16),        # 3 vectors: 1 lane, its 4th vector past it
    (np.float16, 5, 8, 90, 13, 13, 8),    # 5 vectors: 2 lanes, 3 of their 8 past it
    (np.float32, 1, 64, 40, 300, 0, 256),  # 16 vectors: 4 lanes; 2 pages of 256
    (np.float32, 9, 256, 5, 3, 3, 16),    # 576 vectors: 256 lanes, 448 past it
])
def test_write_vectors_land_in_their_slots_and_nowhere_else(dtype, n_heads, head_dim, width,
                                                            rows, ring_rows, page_size):
    rng = np.random.default_rng(n_heads * head_dim + width)
    k = random_bits(rng, (width, n_heads, head_dim), dtype)
    v = random_bits(rng, (width, n_heads, head_dim), dtype)
    check_write(rng, dtype, lambda x: x, k, v, rows, ring_rows, page_size)


def to_bf16(x):
    return round_nearest_even(np.asarray(x, np.float32), "bf16")


@pytest.mark.parametrize("store_dtype,convert", [(np.float16, lambda x: x.astype(np.float16)),
                                                 (BF16, to_bf16)])
@pytest.mark.parametrize("n_heads,head_dim,page_size", [(5, 3, 8), (7, 40, 256)])  # 15, 280
def test_write_elements_convert_into_their_slots_and_nowhere_else(store_dtype, convert,
                                                                  n_heads, head_dim, page_size):
    rng = np.random.default_rng(n_heads * head_dim)
    k = rng.standard_normal((12, n_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((12, n_heads, head_dim)).astype(np.float32)
    check_write(rng, store_dtype, convert, k, v, rows=11, ring_rows=11, page_size=page_size)


def test_write_of_a_strided_view_takes_every_element():
    rng = np.random.default_rng(3)
    width, n_heads, head_dim, rows, n_seqs, page_size = 9, 2, 8, 20, 3, 16
    wide_k = rng.standard_normal((width, n_heads, 2 * head_dim)).astype(np.float16)
    wide_v = rng.standard_normal((width, n_heads, 2 * head_dim)).astype(np.float16)
    seqs, positions = write_tables(rng, width, rows, n_seqs, 0, n_padding=2)
    columns = [random_bits(rng, (rows, n_seqs, n_heads, head_dim), np.float16)
               for _ in range(2)]
    (k_slots, v_slots), pages = paged(columns, page_size, seed=5)
    k_dev, v_dev = cuda.to_device(k_slots), cuda.to_device(v_slots)
    k_view, v_view = cuda.to_device(wide_k)[:, :, 1::2], cuda.to_device(wide_v)[:, :, 1::2]
    assert not k_view.is_c_contiguous()      # no 16-byte vectors: the element-wise path
    write_kernels.write_kv(k_dev, v_dev, k_view, v_view, device_tables(seqs, positions), 0,
                           cuda.to_device(pages), page_bits(page_size))
    (want_k, want_v), _ = paged([reference_write(c, x[:, :, 1::2], seqs, positions, 0)
                                 for c, x in zip(columns, (wide_k, wide_v))], page_size,
                                seed=5)
    assert same_bits(k_dev.copy_to_host(), want_k)
    assert same_bits(v_dev.copy_to_host(), want_v)


def test_one_prepared_write_serves_layers_of_both_kinds_through_their_own_pages():
    """A step's writes are prepared once and called per layer: a flat layer and a ring
    layer, each with its own page table and ring size, take the same tokens."""
    rng = np.random.default_rng(8)
    n_heads, head_dim, flat_rows, ring_rows, page_size = 2, 8, 40, 12, 8
    spans = [(30, 8), (0, 6), (10, 4)]        # per sequence: first position, tokens
    seqs = np.concatenate([np.full(n, s) for s, (_, n) in enumerate(spans)] + [[-1, -1]])
    positions = np.concatenate([np.arange(p, p + n) for p, n in spans] + [[0, 0]])
    order = rng.permutation(seqs.size)
    seqs, positions = seqs[order], positions[order]
    k = random_bits(rng, (seqs.size, n_heads, head_dim), np.float16)
    v = random_bits(rng, (seqs.size, n_heads, head_dim), np.float16)
    writes = write_kernels.prepare(device_tables(seqs, positions), seqs.size,
                                   n_heads * head_dim, np.float16, page_bits(page_size))
    for rows, ring, seed in ((flat_rows, 0, 1), (ring_rows, ring_rows, 2)):
        columns = [random_bits(rng, (rows, len(spans), n_heads, head_dim), np.float16)
                   for _ in range(2)]
        (k_slots, v_slots), pages = paged(columns, page_size, seed=seed)
        k_dev, v_dev = cuda.to_device(k_slots), cuda.to_device(v_slots)
        writes(k_dev, v_dev, cuda.to_device(k), cuda.to_device(v), ring, cuda.to_device(pages))
        (want_k, want_v), _ = paged([reference_write(c, x, seqs, positions, ring)
                                     for c, x in zip(columns, (k, v))], page_size, seed=seed)
        assert same_bits(k_dev.copy_to_host(), want_k), f"k, ring_rows {ring}"
        assert same_bits(v_dev.copy_to_host(), want_v), f"v, ring_rows {ring}"


# ---------------------------------------------------------------- row copy

def page_runs(pages, page_size):
    """Row runs `[n, 3]` (source slot, destination slot, rows) copying whole pages
    `pages[0, i]` to `pages[1, i]`."""
    runs = np.empty((pages.shape[1], 3), np.int32)
    runs[:, :2] = pages.T * page_size
    runs[:, 2] = page_size
    return runs


class LaunchPaths:
    """Which of the copy's kernels the launches took (`wide`, `elements`)."""

    def __init__(self, monkeypatch):
        self.taken = []
        for name, path in (("_vectors", "wide"), ("_elements", "elements")):
            real = getattr(copy_kernels, name)
            monkeypatch.setattr(copy_kernels, name, self.spy(real, path))

    def spy(self, real, path):
        def launch(*args):
            self.taken.append(path)
            return real(*args)
        return launch


@pytest.fixture
def launch_paths(monkeypatch):
    return LaunchPaths(monkeypatch)


@pytest.mark.parametrize("dtype,n_heads,head_dim,n_layers,page_size,n_pairs,path", [
    (np.float16, 1, 8, 3, 8, 5, "wide"),       # 8 vectors a page: 2 lanes; 30 (plane, run)
    (BF16, 2, 64, 2, 16, 3, "wide"),           # 256 vectors: 64 lanes, 4 runs a block
    (np.float16, 3, 8, 2, 8, 4, "wide"),       # 24 vectors: 8 lanes, 8 of their 32 past it
    (np.float32, 3, 8, 1, 256, 2, "wide"),     # 1536 vectors: 256 lanes, 2 trips a run
    (np.uint8, 3, 5, 2, 8, 3, "elements"),     # 120-byte pages: element-wise, 128 lanes
    (np.uint8, 1, 3, 1, 256, 2, "elements"),   # 768 elements a page: 3 trips a run
])
def test_copy_rows_copies_whole_pages_in_every_layer_k_and_v_and_nothing_else(
        dtype, n_heads, head_dim, n_layers, page_size, n_pairs, path, launch_paths):
    rng = np.random.default_rng(n_heads * head_dim + page_size + n_pairs)
    n_pages = 2 * n_pairs + 3
    group = random_bits(rng, (n_layers, 2, n_pages, page_size, n_heads, head_dim), dtype)
    pages = rng.permutation(n_pages)[:2 * n_pairs].reshape(2, n_pairs)   # all distinct
    runs = page_runs(pages, page_size)
    runs_off = 7
    device = cuda.to_device(group)
    copy_kernels.copy_rows(device, cuda.to_device(tables_holding(rng, runs, runs_off)),
                           runs_off, n_pairs)
    want = group.copy()
    want[:, :, pages[1]] = group[:, :, pages[0]]
    assert same_bits(device.copy_to_host(), want)
    assert launch_paths.taken == [path]


@pytest.mark.parametrize("dtype,n_heads,head_dim,n_layers,page_size,path", [
    (np.float16, 1, 8, 3, 8, "wide"),          # 1 vector a row, 8 a page: 2 lanes
    (np.float16, 2, 8, 2, 16, "wide"),         # 2 vectors a row, 32 a page: 8 lanes
    (BF16, 3, 64, 2, 16, "wide"),              # 24 vectors a row, 384 a page: 128 lanes
    (np.float32, 1, 4, 2, 256, "wide"),        # 1 vector a row, 256 a page: 64 lanes
    (np.float32, 3, 5, 2, 8, "elements"),      # 60-byte rows (480-byte pages: whole vectors)
    (np.uint8, 3, 5, 2, 8, "elements"),        # 15-byte rows
    (np.uint8, 1, 3, 1, 256, "elements"),      # 768 elements a page: runs past a block
])
def test_copy_rows_copies_runs_of_partial_pages_in_every_layer_and_nothing_else(
        dtype, n_heads, head_dim, n_layers, page_size, path, launch_paths):
    rng = np.random.default_rng(n_heads * head_dim * page_size + n_layers)
    n_pages, n_runs = 16, 9
    group = random_bits(rng, (n_layers, 2, n_pages, page_size, n_heads, head_dim), dtype)
    runs = partial_runs(rng, n_pages, page_size, n_runs)
    assert {1, page_size} <= set(runs[:, 2].tolist())
    runs_off = 5
    device = cuda.to_device(group)
    copy_kernels.copy_rows(device, cuda.to_device(tables_holding(rng, runs, runs_off)),
                           runs_off, n_runs)
    want = reference_copy(group, runs)
    assert not same_bits(want, group)
    assert same_bits(device.copy_to_host(), want)
    assert launch_paths.taken == [path]


def test_copy_of_no_runs_changes_nothing(launch_paths):
    rng = np.random.default_rng(4)
    group = random_bits(rng, (2, 2, 3, 8, 2, 8), np.float16)
    device = cuda.to_device(group)
    copy_kernels.copy_rows(device, cuda.to_device(np.array([0, 8, 8], np.int32)), 0, 0)
    assert same_bits(device.copy_to_host(), group)
    assert launch_paths.taken == []


# ---------------------------------------------------------------- page-table patches

@pytest.mark.parametrize("n_patches", [1, 600])     # one thread; 600 over 512 threads
def test_patch_pages_stores_each_value_at_its_index_and_nothing_else(n_patches):
    rng = np.random.default_rng(n_patches)
    table = rng.integers(-2**31, 2**31, 1000, dtype=np.int64).astype(np.int32)
    at = rng.permutation(table.size)[:n_patches]
    values = rng.integers(0, 2**31, n_patches).astype(np.int32)
    patches_off = 3
    device = cuda.to_device(table)
    patch_pages(device, cuda.to_device(tables_holding(rng, np.stack([at, values], 1),
                                                      patches_off)), patches_off, n_patches)
    want = table.copy()
    want[at] = values
    assert np.array_equal(device.copy_to_host(), want)


def test_no_patches_change_nothing():
    table = np.arange(10, dtype=np.int32)
    device = cuda.to_device(table)
    patch_pages(device, cuda.to_device(np.array([0, 5], np.int32)), 0, 0)
    assert np.array_equal(device.copy_to_host(), table)


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
