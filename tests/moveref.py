"""NumPy references of the write and row-copy kernels' results, and the random storage
and tables they run over (tests/test_move_kernels.py, tests/test_move_shapes.py).

Storage starts as random bit patterns (NaNs included), so a byte a kernel must not
touch is checked as exactly that, and references compare raw bits. The write's column
storage `[rows, n_seqs, n_kv_heads, head_dim]` is moved into slots through a shuffled
page table (`paging.paged`) as a cache holds it.
"""
import numpy as np

from kvnumba.device import cuda
from kvnumba.kernels.moves import write as write_kernels
from paging import page_bits, paged


def random_bits(rng, shape, dtype):
    """An array of `dtype` holding uniformly random bytes."""
    raw = rng.integers(0, 256, int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def same_bits(got, want):
    return got.view(np.uint8).tobytes() == want.view(np.uint8).tobytes()


def write_tables(rng, width, rows, n_seqs, ring_rows, n_padding):
    """`(seqs, positions)`: every token a distinct (row, sequence) place, one of them in
    the last row, except `n_padding` tokens of a negative sequence; on a ring each
    position is its row plus a random number of whole turns (the last row's token two:
    it wraps)."""
    real = width - n_padding
    last = (rows - 1) * n_seqs + rng.integers(n_seqs)
    others = rng.permutation(np.setdiff1d(np.arange(rows * n_seqs), [last]))[:real - 1]
    places = np.concatenate([[last], others])
    assert places.size == real, "test bug: fewer places than tokens"
    order = rng.permutation(width)[:real]
    seqs = rng.integers(-5, 0, width)                            # padding: any negative
    positions = rng.integers(0, rows, width)                     # padding: anything
    seqs[order], positions[order] = places % n_seqs, places // n_seqs
    if ring_rows:
        turns = rng.integers(0, 4, width)
        turns[order[0]] = 2
        positions = positions + ring_rows * turns
    return seqs, positions


def reference_write(store, values, seqs, positions, ring_rows):
    """Column storage `store` after token t's values land in row `positions[t] (%
    ring_rows)` of sequence `seqs[t]`, for every token of a sequence."""
    want = store.copy()
    for t, (seq, p) in enumerate(zip(seqs, positions)):
        if seq >= 0:
            want[p % ring_rows if ring_rows else p, seq] = values[t]
    return want


def device_tables(seqs, positions):
    return cuda.to_device(np.concatenate([seqs, positions]).astype(np.int32))


def check_write(rng, store_dtype, convert, k, v, rows, ring_rows, page_size, n_padding=3):
    """Write `k`, `v` into random-bit paged storage of `rows` rows a sequence and enough
    sequences; its slots must then hold exactly the reference's bits, paged alike
    (`convert`: input -> storage values)."""
    width, n_heads, head_dim = k.shape
    n_seqs = max(3, -(-width // rows) + 1)
    seqs, positions = write_tables(rng, width, rows, n_seqs, ring_rows, n_padding)
    columns = [random_bits(rng, (rows, n_seqs, n_heads, head_dim), store_dtype)
               for _ in range(2)]
    seed = int(rng.integers(1 << 30))
    (k_slots, v_slots), pages = paged(columns, page_size, seed=seed)
    k_dev, v_dev = cuda.to_device(k_slots), cuda.to_device(v_slots)
    write_kernels.write_kv(k_dev, v_dev, cuda.to_device(k), cuda.to_device(v),
                           device_tables(seqs, positions), ring_rows, cuda.to_device(pages),
                           page_bits(page_size))
    (want_k, want_v), _ = paged([reference_write(c, convert(x), seqs, positions, ring_rows)
                                 for c, x in zip(columns, (k, v))], page_size, seed=seed)
    assert same_bits(k_dev.copy_to_host(), want_k), "k"
    assert same_bits(v_dev.copy_to_host(), want_v), "v"


def tables_holding(rng, entries, off):
    """int32 tables holding `entries` (flattened) from entry `off`, random entries around
    them."""
    tables = rng.integers(-1000, 1000, off + entries.size + 5).astype(np.int32)
    tables[off:off + entries.size] = entries.reshape(-1)
    return tables


def reference_copy(group, runs):
    """`group` with each run's rows copied, in every layer, K and V (runs independent)."""
    n_layers, _, n_pages, page_size = group.shape[:4]
    want = group.copy()
    slots = want.reshape(n_layers, 2, n_pages * page_size, -1)
    source = group.reshape(slots.shape)
    for src, dst, rows in runs.tolist():
        slots[:, :, dst:dst + rows] = source[:, :, src:src + rows]
    return want


def partial_runs(rng, n_pages, page_size, n_runs):
    """`n_runs` row runs `[n, 3]` over pages of `page_size` rows: lengths 1, a whole
    page and random ones in between, at random rows of random pages (a run's source and
    destination may share a page; sources may overlap one another), destination rows
    distinct and none a source row of another run."""
    sources = np.zeros(n_pages * page_size, bool)
    destinations = np.zeros(n_pages * page_size, bool)
    runs = []
    lengths = [1, page_size, 1] + rng.integers(1, page_size + 1, n_runs).tolist()
    for _ in range(100_000):
        if len(runs) == n_runs:
            return np.array(runs, np.int32)
        rows = lengths[len(runs)]
        src = rng.integers(n_pages) * page_size + rng.integers(page_size - rows + 1)
        dst = rng.integers(n_pages) * page_size + rng.integers(page_size - rows + 1)
        if (sources[dst:dst + rows].any() or destinations[dst:dst + rows].any()
                or destinations[src:src + rows].any()
                or max(src, dst) < min(src, dst) + rows):
            continue
        sources[src:src + rows] = True
        destinations[dst:dst + rows] = True
        runs.append((src, dst, rows))
    raise AssertionError(f"no room for {n_runs} runs in {n_pages} pages")
