"""Launch a kernel without Numba's per-call type dispatch (and the grid arithmetic).

A `@cuda.jit` dispatcher types every argument on every launch (several µs per
array). `Specialised` asks Numba once per argument signature for a kernel
specialised to it (`Dispatcher.specialize`) and launches that afterwards; the
signature key (dtype, rank, contiguity of each array; the Python type of each
scalar) is cheap to compute and keeps a strided array from ever reaching a kernel
compiled for a contiguous one.
"""
from __future__ import annotations


#: the grid-stride kernels (write, clone copy): threads per block, 16-byte vectors, and
#: a cap on blocks that still fills a large GPU several times over
STRIDE_THREADS = 256
VECTOR_BYTES = 16
MAX_BLOCKS = 4096


def ceil_div(a: int, b: int) -> int:
    """`ceil(a / b)` for ints: grid sizes and tile counts."""
    return -(-a // b)


def stride_blocks(work: int) -> int:
    """Blocks of `STRIDE_THREADS` for a grid-stride loop over `work` items."""
    return min(MAX_BLOCKS, ceil_div(work, STRIDE_THREADS))


def _type_key(arg):
    dtype = getattr(arg, "dtype", None)
    if dtype is None or not hasattr(arg, "shape"):
        return type(arg)
    contiguous = arg.is_c_contiguous() if hasattr(arg, "is_c_contiguous") else \
        arg.flags.c_contiguous
    return dtype, len(arg.shape), contiguous


class Specialised:
    """`Specialised(kernel)(grid, block, stream, *args)`: `kernel[grid, block, stream](*args)`,
    with the type dispatch done once per argument signature."""

    def __init__(self, dispatcher):
        self.dispatcher = dispatcher
        self._kernels = {}

    def __call__(self, grid, block, stream, *args):
        key = tuple(map(_type_key, args))
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = self._kernels[key] = self.dispatcher.specialize(*args)
        kernel[grid, block, stream](*args)
