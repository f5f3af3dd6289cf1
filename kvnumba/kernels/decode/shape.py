"""The decode kernel's shape: how a key row maps onto a warp (`Geometry`), rows per
block (`block_rows`), and every compile-time number one specialisation is built from
(`KernelShape`), shared by its kernel (`decode_kernel`) and its per-trip device
functions (`decode.trip`)."""
from __future__ import annotations

from dataclasses import astuple, dataclass
from functools import lru_cache

import numpy as np

from ...config import FAST_MAX_HEAD_DIM
from ...device import SIMULATOR
from ..launch.constants import WARP
from ..intrinsics.words import WIDEN, load_bytes
from ..prefill.shape import supports as tensor_cores_serve

WARPS = 4
THREADS = WARPS * WARP
#: keys per lane per trip: UNROLL to 2 x UNROLL 16-byte loads of a lane in flight
UNROLL = 4
#: registers per lane for the big arrays, each row's query and accumulator slices
#: and the K and V words of a trip, and a cap on rows per block (scores and
#: probabilities grow with rows too)
REGISTER_BUDGET = 96
MAX_ROWS = 4
#: blocks of THREADS the kernel must fit per SM: ptxas keeps it to 168 registers
BLOCKS_PER_SM = 3
#: (the simulator takes no launch bounds)
LAUNCH_BOUNDS = {} if SIMULATOR else {"launch_bounds": (THREADS, BLOCKS_PER_SM)}


def supports(head_dim: int, storage_dtype) -> bool:
    """Whether this path serves K/V storage of `head_dim` and `storage_dtype`.

    It needs a storage dtype it can widen (float16, float32, bfloat16 as uint16 bits,
    8-bit floats as uint8 / int8 bits) and key rows that are whole loads; it is built
    for the head dims models use, multiples of 16 up to `FAST_MAX_HEAD_DIM` (those rows are
    whole loads at every dtype). Anything else takes the generic kernel.
    """
    dtype = np.dtype(storage_dtype)
    return dtype in WIDEN and head_dim % 16 == 0 and 16 <= head_dim <= FAST_MAX_HEAD_DIM


@dataclass(frozen=True)
class Geometry:
    """How a key row of `head_dim` elements of `itemsize` bytes maps onto a warp.

    load: bytes per load (16; 8 for 8-bit floats, so that their rows spread over as many
    lanes, and hold as few values a lane, as 16-bit rows do: `words.load_bytes`);
    vec: elements per load; pieces: loads per key row; lanes: lanes per key
    (a power of two, idle lanes when `pieces` is not); per_lane: loads per lane
    per key; elements: key elements per lane; key_slots: keys a warp takes at once;
    max_rows: rows per block within REGISTER_BUDGET and MAX_ROWS (a power of two).
    """

    load: int
    vec: int
    pieces: int
    lanes: int
    per_lane: int
    elements: int
    key_slots: int
    max_rows: int

    @classmethod
    def of(cls, head_dim: int, itemsize: int) -> "Geometry":
        load = load_bytes(itemsize)
        vec = load // itemsize
        pieces = head_dim // vec
        lanes = min(WARP, 1 << (pieces - 1).bit_length())
        per_lane = -(-pieces // lanes)
        elements = vec * per_lane
        words = 2 * UNROLL * per_lane * (load // 4)   # K and V words of a trip
        rows = max(1, min(MAX_ROWS, (REGISTER_BUDGET - words) // (2 * elements)))
        return cls(load, vec, pieces, lanes, per_lane, elements, WARP // lanes,
                   1 << (rows.bit_length() - 1))

    @property
    def words(self) -> int:
        """32-bit words per load."""
        return self.load // 4


@lru_cache(maxsize=None)
def block_rows(rows: int, head_dim: int, storage_dtype) -> int:
    """Rows per block for `rows` rows per segment: the smallest power of two holding
    them, at most what fits the registers."""
    cap = Geometry.of(head_dim, np.dtype(storage_dtype).itemsize).max_rows
    return min(cap, 1 << (max(rows, 1) - 1).bit_length())


@dataclass(frozen=True)
class KernelShape(Geometry):
    """The compile-time numbers of one decode kernel: its key geometry (`Geometry`),
    `head_dim`, rows per block `rows`, and from them the shuffle rounds, held rows, trip
    sizes and the end-of-chunk merge layout (`decode_kernel`'s doc). Every name is read
    into a closure constant of the kernel and its functions."""

    head_dim: int
    rows: int

    @classmethod
    def of(cls, head_dim: int, itemsize: int, rows: int) -> "KernelShape":
        g = Geometry.of(head_dim, itemsize)
        assert rows <= g.max_rows
        return cls(*astuple(g), head_dim, rows)

    @property
    def lane_bits(self) -> int:
        return self.lanes.bit_length() - 1

    @property
    def vec_bits(self) -> int:
        return self.vec.bit_length() - 1

    @property
    def idle_pieces(self) -> bool:
        """Whether some lanes hold no piece of a key row."""
        return self.pieces % self.lanes != 0

    @property
    def levels(self) -> int:
        """Shuffle rounds over a key's lanes."""
        return self.lane_bits

    @property
    def splits(self) -> int:
        """Rounds that also split the rows."""
        return min(self.levels, self.rows.bit_length() - 1)

    @property
    def held(self) -> int:
        """Rows whose softmax a lane keeps."""
        return self.rows >> self.splits

    @property
    def copy_bits(self) -> int:
        """Low piece bits of the lanes holding the same rows."""
        return self.levels - self.splits

    @property
    def warp_keys(self) -> int:
        """Keys per warp per trip."""
        return UNROLL * self.key_slots

    @property
    def lookups(self) -> int:
        """Page-table lookups per lane per trip."""
        return max(1, UNROLL // self.lanes)

    @property
    def block_keys(self) -> int:
        """Keys per block per trip."""
        return WARPS * self.warp_keys

    @property
    def slots(self) -> int:
        """Softmax states merged at the end of a chunk: one per (warp, key slot)."""
        return WARPS * self.key_slots

    # The merge's shared layout: per slot, per row, word ((c * VEC + e) * LANES + sub)
    # holds element e of piece c * LANES + sub, so a warp's lanes store consecutive
    # words; a slot's block is padded so that the key slots of a warp start LANES
    # banks apart. Each merging thread sums PER_THREAD words of one row, ROW_THREADS
    # apart, so a warp's lanes read consecutive words too.
    @property
    def row_words(self) -> int:
        return self.elements * self.lanes

    @property
    def slot_words(self) -> int:
        return self.rows * self.row_words + (self.lanes if self.key_slots > 1 else 0)

    @property
    def per_thread(self) -> int:
        return max(1, self.rows * self.row_words // THREADS)

    @property
    def row_threads(self) -> int:
        """Merging threads per row."""
        return self.row_words // self.per_thread

    @property
    def dim_step(self) -> int:
        """With one piece per lane and whole rounds of LANES words between a thread's
        words, they are elements e, e + ROW_THREADS / LANES, ... of one piece: dims a
        constant step apart (0: work each one out)."""
        whole = self.per_lane == 1 and self.row_threads % self.lanes == 0
        return self.row_threads // self.lanes if whole else 0


#: the most rows (a layer's group times the step's longest decode segment) the CUDA-core
#: kernel takes, by bytes of a stored value: where its instructions per key stay under
#: what the byte rate allows (16-bit storage: 69.4 SASS instructions per key per kv
#: head at 4 rows against about 130 at d128; 8-bit floats: half the bytes, about 65
#: allowed, 53.7 at 2 rows but 73.4 at 4). More rows take the tensor cores
#: (`grouped`), whose cost per key hardly grows with the rows.
CUDA_CORE_ROWS = {2: 4, 1: 2}


def grouped(rows: int, head_dim: int, storage_dtype) -> bool:
    """Whether decode rows of a layer go to the tensor cores (`prefill_kernel(...,
    split=True)` over the same chunks and combine) rather than the CUDA-core kernel:
    more than `CUDA_CORE_ROWS` rows, over 16-bit or 8-bit float storage the tensor-core
    kernel serves (`prefill.supports`). float32 storage stays on CUDA cores (exact)."""
    itemsize = np.dtype(storage_dtype).itemsize
    return (itemsize in CUDA_CORE_ROWS and rows > CUDA_CORE_ROWS[itemsize]
            and tensor_cores_serve(head_dim, storage_dtype))

