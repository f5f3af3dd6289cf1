"""`ptx`'s device functions for Numba's CUDA simulator: same names, same semantics.

Registers are NumPy scalars of the GPU types (`uint32`, `float32`), so kernel
arithmetic on them wraps and rounds as on the device. Memory functions work on the
bytes behind the simulator's arrays and raise where a GPU would fault (misaligned
16-byte access, out of bounds). Warp functions meet through `simwarp.exchange`.

`mma_*` rounding: A and B are widened exactly, A @ B + C is computed in float64
(every product exact) and rounded once to float32, so D is at least as accurate
as the hardware's float32 accumulation, which may differ from it in the last bits.
"""
from __future__ import annotations

import struct

import numpy as np
from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray, FakeWithinKernelCUDAArray

from ..launch.constants import FP8_FORMATS
from . import simpace  # noqa: F401  (the simulator's block loop gives way as it polls)
from .fp8sim import narrow, stored, widen
from .simwarp import WarpError, exchange

_WORD = struct.Struct("<I")
_F16X2 = struct.Struct("<2e")
_MASK32 = 0xFFFFFFFF
#: f32 bits -> bf16 bits, round to nearest even: add half an ulp (less one) plus the
#: kept lowest bit, then truncate
_BF16_HALF = 0x7FFF


# --- memory ------------------------------------------------------------------------------

def _unwrap(array) -> np.ndarray:
    """The NumPy array behind a simulator array (global, shared or local)."""
    if isinstance(array, FakeWithinKernelCUDAArray):
        array = array._item
    if isinstance(array, FakeCUDAArray):
        array = array._ary
    return array


def _numpy(array) -> np.ndarray:
    """`_unwrap`, for 16-byte access: C-contiguous."""
    array = _unwrap(array)
    if not array.flags.c_contiguous:
        raise ValueError("16-byte access needs a C-contiguous array")
    return array


def _span(array, index, size) -> np.ndarray:
    """The `size` bytes at flat element `index`: a writable view, checked as a GPU would
    fault (out of bounds, not aligned to `size`)."""
    array = _numpy(array)
    raw = array.reshape(-1).view(np.uint8)
    start = int(index) * array.itemsize
    if start < 0 or start + size > raw.size:
        raise IndexError(f"{size} bytes at element {index} are outside the array "
                         f"({raw.size} bytes)")
    if (raw.ctypes.data + start) % size:
        raise ValueError(f"element {index}: address not {size}-byte aligned")
    return raw[start:start + size]


def _span16(array, index) -> np.ndarray:
    """The 16 bytes at flat element `index` (`_span`)."""
    return _span(array, index, 16)


def ld_v4(array, index):
    """`(u0, u1, u2, u3)` uint32: the 16 bytes at flat element `index`."""
    return tuple(_span16(array, index).view(np.uint32))


ld_nc_v4 = ld_v4  # the read-only path is a caching choice: same bytes


def ld_nc_v2(array, index):
    """`(u0, u1)` uint32: the 8 bytes at flat element `index` (8-byte aligned)."""
    return tuple(_span(array, index, 8).view(np.uint32))


def st_shared_v4(shared_array, index, u0, u1, u2, u3):
    """Store `u0..u3` as the 16 bytes at flat element `index` of a shared array."""
    st_v4(shared_array, index, u0, u1, u2, u3)


def st_v4(array, index, u0, u1, u2, u3):
    """Store `u0..u3` (`u0` lowest) as the 16 bytes at flat element `index`."""
    words = [int(u) & _MASK32 for u in (u0, u1, u2, u3)]
    _span16(array, index)[:] = np.array(words, np.uint32).view(np.uint8)


def _store_f32s(array, index, values):
    """`values` as consecutive elements of `array` from flat element `index`, each as
    `from_f32` makes it, in one aligned store."""
    elements = np.array([from_f32(x, array) for x in values])
    span = _span(array, index, elements.nbytes)
    span[:] = elements.astype(_unwrap(array).dtype).view(np.uint8)


def st_f32x2(array, index, x0, x1):
    """Two float32 values as elements `index, index + 1` of a float32 / float16 /
    bfloat16 array, in one store aligned to their bytes."""
    _store_f32s(array, index, (x0, x1))


def st_f32x4(array, index, x0, x1, x2, x3):
    """As `st_f32x2`, four values."""
    _store_f32s(array, index, (x0, x1, x2, x3))


def ld_shared_v2(shared_array, index):
    """`(u0, u1)` uint32: the 8 bytes at flat element `index` of a shared array (8-byte
    aligned)."""
    return tuple(_span(shared_array, index, 8).view(np.uint32))


def prmt(a, b, selector):
    """uint32: byte i is byte `(selector >> 4 i) & 7` of `b:a` (`a`'s lowest first)."""
    pool = (int(a) & _MASK32) | (int(b) & _MASK32) << 32
    word = 0
    for i in range(4):
        word |= (pool >> 8 * ((int(selector) >> 4 * i) & 7) & 0xFF) << 8 * i
    return np.uint32(word)


def cp_async_16(shared_array, shared_index, global_array, global_index):
    """Copy the 16 bytes at once (the waits then have nothing left to wait for)."""
    _span16(shared_array, shared_index)[:] = _span16(global_array, global_index)


def cp_async_commit():
    """Nothing pending: copies complete when issued."""


def cp_async_wait(n):
    """Nothing pending: copies complete when issued."""


# --- 16-bit float pairs and bit casts ----------------------------------------------------

def f16x2_to_f32(u):
    """`(lo, hi)` float32: the float16 halves of `u`, exactly."""
    lo, hi = _F16X2.unpack(_WORD.pack(int(u) & _MASK32))
    return np.float32(lo), np.float32(hi)


def bf16x2_to_f32(u):
    """`(lo, hi)` float32: the bfloat16 halves of `u` (each the top half of a float32)."""
    u = int(u) & _MASK32
    return u32_as_f32((u & 0xFFFF) << 16), u32_as_f32(u & 0xFFFF0000)


def f32x2_to_f16x2(lo, hi):
    """uint32 of two float16 (`lo` low), each rounded to nearest even (NumPy's cast)."""
    with np.errstate(over="ignore"):  # overflow to inf is the specified result
        return np.array([lo, hi], np.float32).astype(np.float16).view(np.uint32)[0]


def f32x2_to_bf16x2(lo, hi):
    """uint32 of two bfloat16 (`lo` low), each rounded to nearest even; NaN stays NaN."""
    with np.errstate(over="ignore"):
        bits = np.array([lo, hi], np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + _BF16_HALF + ((bits >> 16) & 1)) >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    halves = np.where(nan, (bits >> 16) | 0x40, rounded)  # a NaN keeps its sign, made quiet
    return np.uint32(int(halves[0]) | int(halves[1]) << 16)


#: 8-bit float element types -> their formats
_FP8 = {np.dtype(name): fmt for name, fmt in FP8_FORMATS.items()}


def to_f32(x):
    """float32 of a float16 / float32 element, of a uint16 element as bfloat16 bits, or of
    a uint8 / int8 element as e4m3 / e5m2 bits."""
    if isinstance(x, np.uint16):
        return (np.uint32(x) << np.uint32(16)).view(np.float32)
    if isinstance(x, (np.uint8, np.int8)):
        return widen(x, _FP8[np.dtype(type(x))])
    return np.float32(x)


def from_f32(value, array):
    """`value` as an element of `array`: float16 / float32, bfloat16 bits in uint16, each
    rounded to nearest even (NaN stays NaN), or e4m3 / e5m2 bits in uint8 / int8, rounded
    and saturated (`fp8sim.narrow`)."""
    dtype = _unwrap(array).dtype
    if dtype == np.uint16:
        return np.uint16(f32x2_to_bf16x2(value, 0) & 0xFFFF)
    if dtype in _FP8:
        return np.array(narrow(value, _FP8[dtype]), np.uint8).view(dtype)[()]
    with np.errstate(over="ignore"):  # overflow to inf is the specified result
        return dtype.type(np.float32(value))


def to_storage(value, inv_scale, array):
    """`value` as K/V storage of `array`: for 8-bit floats `fp8sim.stored` (NaN when not
    finite, scaled, narrowed); otherwise `from_f32`."""
    dtype = _unwrap(array).dtype
    if dtype in _FP8:
        return np.array(stored(value, inv_scale, _FP8[dtype]), np.uint8).view(dtype)[()]
    return from_f32(value, array)


def u32_as_f32(u):
    """float32 with the bits of `u` (taken as uint32)."""
    return np.uint32(int(u) & _MASK32).view(np.float32)


def f32_as_u32(f):
    """uint32: the bits of `f` (taken as float32)."""
    return np.float32(f).view(np.uint32)


def exp2_approx(x):
    """float32 2**x, correctly rounded, subnormal arguments and results flushed to zero."""
    x = np.float32(x)
    if abs(x) < np.finfo(np.float32).tiny:
        x = np.float32(0.0)
    with np.errstate(over="ignore"):
        y = np.exp2(x)
    return y if y >= np.finfo(np.float32).tiny or np.isnan(y) else np.float32(0.0)


# --- warp shuffles -----------------------------------------------------------------------

def _shuffle(values):
    return values


def _from_lane(values, src, lane):
    if src >= len(values):
        raise WarpError(f"lane {lane} reads lane {src}, which this {len(values)}-lane "
                        f"warp does not have (undefined on a GPU)")
    return values[src]


def shfl_xor(value, lane_mask):
    """`value` of lane `cuda.laneid ^ lane_mask` (low 5 bits of the mask)."""
    values, lane = exchange(_shuffle, value)
    return _from_lane(values, lane ^ (int(lane_mask) & 31), lane)


def shfl_idx(value, src_lane):
    """`value` of lane `src_lane % 32`."""
    values, lane = exchange(_shuffle, value)
    return _from_lane(values, int(src_lane) & 31, lane)


# --- ldmatrix ----------------------------------------------------------------------------

def _registers(rows, trans) -> np.ndarray:
    """(4, 32) uint32: register i of each lane from the 32 rows the lanes supplied.

    Rows 8i..8i+7 form matrix M_i; lane l gets M_i[l // 4, 2(l % 4) : +2] (or of
    M_i transposed), which is word l of M_i's 8x8 halves read row-major.
    """
    matrices = np.stack(rows).view(np.uint16).reshape(4, 8, 8)
    if trans:
        matrices = matrices.transpose(0, 2, 1)
    return np.ascontiguousarray(matrices).view(np.uint32).reshape(4, 32)


def _ldmatrix_x4(rows):
    return _registers(rows, trans=False)


def _ldmatrix_x4_trans(rows):
    return _registers(rows, trans=True)


def _ldmatrix(op, shared_array, index):
    if shared_array.dtype.itemsize != 2:
        raise TypeError(f"ldmatrix needs 16-bit elements, got {shared_array.dtype}")
    registers, lane = exchange(op, _span16(shared_array, index))
    return tuple(registers[:, lane])


def ldmatrix_x4(shared_array, index):
    """`(r0, r1, r2, r3)` uint32: this lane's fragments of four 8x8 matrices (see `ptx`)."""
    return _ldmatrix(_ldmatrix_x4, shared_array, index)


def ldmatrix_x4_trans(shared_array, index):
    """As `ldmatrix_x4`, each matrix transposed."""
    return _ldmatrix(_ldmatrix_x4_trans, shared_array, index)


# --- mma.m16n8k16 ------------------------------------------------------------------------
# Where each lane's registers sit in A, B and C/D (`ptx`'s table), as index arrays.

_G = np.arange(32)[:, None] // 4      # groupID
_T = np.arange(32)[:, None] % 4       # threadID_in_group
_PAIR = np.arange(2)
# (lane, register, half), broadcast against each other when indexing
A_ROWS = (_G + np.array([0, 8, 0, 8]))[:, :, None]
A_COLS = (2 * _T + np.array([0, 0, 8, 8]))[:, :, None] + _PAIR
B_ROWS = (2 * _T + np.array([0, 8]))[:, :, None] + _PAIR
B_COLS = _G[:, :, None]
# (lane, register)
C_ROWS = _G + np.array([0, 0, 8, 8])
C_COLS = 2 * _T + np.array([0, 1, 0, 1])


def _f16_values(halves):
    return halves.view(np.float16).astype(np.float64)


def _bf16_values(halves):
    return (halves.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _product(lanes, widen) -> np.ndarray:
    """(32, 4) float32: each lane's d registers of A @ B + C from all lanes' registers."""
    regs = np.array(lanes, np.float64)                   # uint32 and float32 are exact here
    halves = regs[:, :6].astype(np.uint32).view(np.uint16).reshape(32, 6, 2)
    a, b, c = np.empty((16, 16)), np.empty((16, 8)), np.empty((16, 8))
    a[A_ROWS, A_COLS] = widen(halves[:, :4])
    b[B_ROWS, B_COLS] = widen(halves[:, 4:])
    c[C_ROWS, C_COLS] = regs[:, 6:]
    return (a @ b + c).astype(np.float32)[C_ROWS, C_COLS]


def _mma_f16_f32(lanes):
    return _product(lanes, _f16_values)


def _mma_bf16_f32(lanes):
    return _product(lanes, _bf16_values)


def mma_f16_f32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """`(d0, d1, d2, d3)` float32 of D = A @ B + C, float16 A and B (see `ptx`)."""
    d, lane = exchange(_mma_f16_f32, (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3))
    return tuple(d[lane])


def mma_bf16_f32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """As `mma_f16_f32` with bfloat16 A and B."""
    d, lane = exchange(_mma_bf16_f32, (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3))
    return tuple(d[lane])


def cp_async_16_zfill(shared_array, shared_index, global_array, global_index, zero):
    """Copy the 16 bytes at once, or write 16 zero bytes without reading global memory."""
    if zero:
        _span16(shared_array, shared_index)[:] = 0
    else:
        cp_async_16(shared_array, shared_index, global_array, global_index)


def bytes_from(array, index):
    """The bytes of `array` from flat element `index` on: a one-dimensional uint8 view."""
    return _numpy(array).reshape(-1)[int(index):].view(np.uint8)


def elements_from(array, index):
    """The elements of `array` from flat element `index` on: a one-dimensional view."""
    return _numpy(array).reshape(-1)[int(index):]


def mul_wide_u32(a, b):
    """uint64: the product of `a` and `b` taken as unsigned 32-bit integers."""
    return np.uint64(int(a) & _MASK32) * np.uint64(int(b) & _MASK32)
