"""The wide write and page copy at the launch shapes their static budgets are taken at
(token rows of 2 KiB and 256 bytes: 32 and 4 lanes, one trip of 4 + 4 vectors a lane),
and the copy's stride over layers past the grid's height, against the NumPy
references of `moveref`."""
import numpy as np
import pytest

from kvnumba.device import cuda
from kvnumba.kernels.moves import page_copy as copy_kernels
from kvnumba.kernels.moves import write as write_kernels
from moveref import (check_write, partial_runs, random_bits, reference_copy, same_bits,
                     tables_holding)


@pytest.mark.parametrize("n_heads, ring_rows", [(8, 0), (8, 21), (1, 21)])
def test_write_of_2_kib_and_256_byte_token_rows(n_heads, ring_rows):
    """head_dim 128, float16: 128 vectors a row over 32 lanes, or 16 over 4; a flat layer
    and a ring that wraps, pages of 16."""
    assert write_kernels.vector_lanes(n_heads * 16)[0] == 4 * n_heads
    rng = np.random.default_rng(n_heads + ring_rows)
    k = random_bits(rng, (24, n_heads, 128), np.float16)
    v = random_bits(rng, (24, n_heads, 128), np.float16)
    check_write(rng, np.float16, lambda x: x, k, v, rows=21 if ring_rows else 30,
                ring_rows=ring_rows, page_size=16)


def test_copy_takes_the_layers_past_the_grids_height(monkeypatch):
    """A grid 2 layers high over 5 layers: blocks take layers y, y + 2, ... (runs of
    partial and whole pages)."""
    monkeypatch.setattr(copy_kernels, "MAX_GRID_Y", 2)
    rng = np.random.default_rng(5)
    n_runs, n_pages = 4, 9
    group = random_bits(rng, (5, 2, n_pages, 16, 2, 8), np.float16)
    runs = partial_runs(rng, n_pages, 16, n_runs)
    device = cuda.to_device(group)
    copy_kernels.copy_rows(device, cuda.to_device(tables_holding(rng, runs, 4)), 4, n_runs)
    assert same_bits(device.copy_to_host(), reference_copy(group, runs))
