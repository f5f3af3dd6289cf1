"""Apply page-table changes on the device.

The page tables of every layer kind live in one int32 device buffer, allocated once:
it never moves, so each layer kind's table is a fixed view of it that the kernels are
given. What changes from one step to the next (the pages a sequence gains, a clone's
or a copy-on-write's new pages) is a few entries: the host stages them as (flat
index, value) patches in the step's tables, the one upload a step makes, and one
launch stores them, rather than uploading the tables or making a transfer per change.

Index ranges: flat indices into the buffer, values (page-aligned slot bases, below
`n_pages * page_size <= INT32_MAX`) and patch entries are below 2**31.
"""
from __future__ import annotations

from ...device import cuda
from ..launch.calling import PER_CALL, STRIDE_THREADS, Specialised, stride_blocks

from numba import uint32  # noqa: E402  (after kvnumba.device chose the target)


@cuda.jit
def _patch_pages(table, tables, patches_off, n_patches):
    """Thread `i` of the grid stores patches `i`, `i + grid size`, ...: `table[tables[
    patches_off + 2 * i]] = tables[patches_off + 2 * i + 1]`.

    The loop and the indices are uint32: Numba adds no negative-index fix-up to an
    unsigned index, and on int64 LLVM unrolls the loop behind a trip count worked out
    by a 64-bit division (`__cuda_sm20_div_u64`).
    """
    i = uint32(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x)
    n = uint32(n_patches)
    stride = uint32(cuda.gridDim.x * cuda.blockDim.x)
    while i < n:
        at = uint32(patches_off) + uint32(2) * i
        table[uint32(tables[at])] = tables[at + uint32(1)]
        i += stride


_patch = Specialised(_patch_pages)


def launch_shape(n_patches: int) -> tuple:
    """`(blocks, threads)` for `n_patches` patches: a step's are usually a few, a thread
    each (one warp runs them), not a full block (on the simulator every thread is a
    Python thread)."""
    return stride_blocks(n_patches), min(STRIDE_THREADS, n_patches)


def patch_pages(table, tables, patches_off: int, n_patches: int, stream=0) -> None:
    """`table[tables[patches_off + 2 * i]] = tables[patches_off + 2 * i + 1]` for `i <
    n_patches` (`table`, `tables`: int32 device arrays; the indices distinct, so the
    patches land in any order): one launch, none without patches."""
    if n_patches > 0:
        _patch(*launch_shape(n_patches), stream, table, tables, int(patches_off),
               int(n_patches))


class PagePatcher:
    """`patch_pages` into one device table `table` on one stream, its launch bound once
    per launch shape: a call (`patcher(tables, patches_off, n_patches)`, a step's)
    packs only the upload buffer and the two counts."""

    def __init__(self, table, stream=0):
        self.table, self.stream = table, stream
        self._launches = {}

    def __call__(self, tables, patches_off: int, n_patches: int) -> None:
        if n_patches <= 0:
            return
        shape = launch_shape(n_patches)
        launch = self._launches.get(shape)
        if launch is None:
            launch = self._launches[shape] = _patch.bind(*shape, self.stream, self.table,
                                                         PER_CALL, PER_CALL, PER_CALL)
        launch(tables, int(patches_off), int(n_patches))
