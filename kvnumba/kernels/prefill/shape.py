"""The tensor-core prefill kernel's shapes: tiles per head_dim, the shared-memory and
staging layouts, and every compile-time number of one specialisation (`PrefillShape`),
shared by its kernel (`prefill_kernel`) and its device functions (`prefill.staging`,
`prefill.arithmetic`)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ...config import INT32_MAX, FAST_MAX_HEAD_DIM, MAX_HEAD_DIM, MAX_LATENT_DIM
from ..launch.constants import FP8_FORMATS
from ..launch.calling import ceil_div


#: (block_rows, block_keys) for padded head dims up to the key; shared memory (see
#: `shared_layout`) stays within the 48 KiB static limit. Per thread and m16 half of
#: its warp, registers hold dpad / 2 O floats, block_keys / 2 S floats, block_keys / 4
#: P words and, up to Q_REGISTERS_MAX_DIM, dpad / 4 Q words; above it Q stays in shared
#: memory (with Q in registers head_dim 256 needs all 255 registers on sm_90). Two
#: halves per warp fit up to WIDE_WARP_MAX_DIM (head_dim 128 would need O, Q and S of
#: 64 registers each per half).
TILES = {64: (64, 64), 128: (64, 64), 256: (48, 16)}
Q_REGISTERS_MAX_DIM = 128
WIDE_WARP_MAX_DIM = 64
Q_OUT_TYPES = ("float16", "float32", "uint16")   # uint16: bfloat16 bits
STORAGE_TYPES = ("float16", "bfloat16")
#: what K/V storage may hold, and its bytes per value: the 16-bit types are staged as
#: they are (cp.async), 8-bit floats (e4m3 bits as uint8, e5m2 as int8) converted to
#: the mma's 16-bit type on the way into shared memory
STORED_BYTES = {**dict.fromkeys(STORAGE_TYPES, 2),
                **{fmt: np.dtype(name).itemsize for name, fmt in FP8_FORMATS.items()}}
FLAT_RING = INT32_MAX     # the ring size a flat layer's rows are walked with: never wraps
CHUNK_VALUES = 8          # 16-bit values in a 16-byte cp.async chunk
LINE_CHUNKS = 8           # chunks in a 128-byte line
#: a pair of 16-bit ones in each storage type: the B operand of the row-sum mma
ONES = {"float16": 0x3C003C00, "bfloat16": 0x3F803F80}
#: The wide tile: K rows up to a latent layer's 576 values, V up to 512 and no wider
#: than K (its own storage, or the first values of K's rows). One warp of 16 rows, Q in
#: shared memory, one key buffer that holds K(j) and then V(j) (Q and one 16-key tile of
#: 576-wide rows take 37,376 bytes of the 48 KiB), and V in slices of at most
#: `V_SLICE` dims, a block per slice (each scores all of K): 128 float32 accumulators
#: a lane, as the 256-wide tile's.
WIDE_MAX_HEAD_DIM = MAX_LATENT_DIM
WIDE_MAX_V_DIM = MAX_HEAD_DIM
V_SLICE = 256
WIDE_TILE = (16, 16)
#: 8-bit float K/V staged as they are stored ("narrow" tiles, `narrow_staging`): 16
#: values a 16-byte cp.async chunk, rows of padded_head_dim bytes and 16 bytes of padding
#: (8 rows of an ldmatrix 16 bytes apart in banks), widened to the mma type from the
#: fragments ldmatrix gives (`prefill.arithmetic`)
NARROW_CHUNK_VALUES = 16


def padded_head_dim(head_dim: int) -> int:
    """head_dim rounded up to whole k16 fragments."""
    return ceil_div(head_dim, 16) * 16


def type_name(dtype) -> str:
    """A dtype's name; a name stays as it is ("bfloat16" needs no NumPy dtype)."""
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name


def supports(head_dim, storage_dtype) -> bool:
    """Can this path serve a layer? head_dim a multiple of 8 (16-byte chunks) up to 256,
    storage float16 or bfloat16 (a dtype, its name, or uint16: bfloat16 bits), or 8-bit
    floats (uint8: e4m3 bits, int8: e5m2). float32 storage is not served."""
    return (type_name(storage_dtype) in STORAGE_TYPES + ("uint16",) + tuple(FP8_FORMATS)
            and 8 <= head_dim <= FAST_MAX_HEAD_DIM and head_dim % 8 == 0)


def supports_wide(head_dim, v_dim, storage_dtype) -> bool:
    """Can the wide tile serve a layer whose K rows are `head_dim` values and whose V
    `v_dim` (its own, or the first values of K's rows)? Storage as `supports`, both
    multiples of 8, K up to `WIDE_MAX_HEAD_DIM`, V up to `WIDE_MAX_V_DIM` and no wider
    than K."""
    return (supports(8, storage_dtype) and head_dim % 8 == 0 and v_dim % 8 == 0
            and 8 <= v_dim <= min(head_dim, WIDE_MAX_V_DIM) and head_dim <= WIDE_MAX_HEAD_DIM)


def v_slice(head_dim: int, v_dim: int) -> tuple[int, int]:
    """(width, slices) of the wide tile's V slices: `V_SLICE` dims (V padded to 16 when
    narrower), as many as cover `v_dim`. A slice starts at `slice * width`, moved back
    to end inside K's padded row (`slice_start`)."""
    width = min(V_SLICE, padded_head_dim(v_dim))
    assert width <= padded_head_dim(head_dim)
    return width, ceil_div(v_dim, width)


def stored_type(dtype) -> str:
    """What K/V storage of `dtype` holds: a 16-bit type (`storage_type`), or "e4m3" /
    "e5m2" for uint8 / int8 bits."""
    name = type_name(dtype)
    return FP8_FORMATS[name] if name in FP8_FORMATS else storage_type(name)


def shared_layout(head_dim: int, block_rows: int, block_keys: int,
                  in_registers: bool | None = None) -> tuple[int, int, int, int]:
    """(q_row, k_row, v_row, rows): where Q, K and V start in the one shared buffer of
    `rows` rows of padded_head_dim + 8 16-bit values. With Q in registers
    (`in_registers`; None: up to Q_REGISTERS_MAX_DIM) Q moves there before V(0) is
    loaded, so it is staged in V's rows (and past them when block_rows > block_keys);
    else Q keeps rows 0 .. block_rows, K and V follow."""
    if in_registers is None:
        in_registers = padded_head_dim(head_dim) <= Q_REGISTERS_MAX_DIM
    if in_registers:
        return block_keys, 0, block_keys, block_keys + max(block_rows, block_keys)
    return 0, block_rows, block_rows + block_keys, block_rows + 2 * block_keys


def staging_layout(chunks: int, threads: int, rows: int) -> tuple[int, int]:
    """(lanes, passes): how `threads` threads cp.async `rows` rows of `chunks` 16-byte
    chunks. `lanes` consecutive threads share a row, lane h copying its chunks h, h +
    lanes, ..., so that each warp instruction reads whole 128-byte lines (lanes >=
    min(chunks, 8)); threads // lanes rows per pass, `passes` passes. Of the divisors of
    `chunks` that qualify: the fewest copies per thread, then the fewest passes (each
    pass computes one storage address)."""
    options = []
    for lanes in range(min(chunks, LINE_CHUNKS), min(chunks, threads) + 1):
        if chunks % lanes == 0:
            passes = ceil_div(rows, threads // lanes)
            options.append((passes * (chunks // lanes), passes, lanes))
    _, passes, lanes = min(options)
    return lanes, passes


def default_warp_rows(head_dim: int, block_rows: int) -> int:
    """Query rows per warp: 32 (two m16 row blocks sharing each K and V fragment: half the
    ldmatrix per mma) up to WIDE_WARP_MAX_DIM, where O, S and Q of 32 rows fit in
    registers, and when block_rows allows; else 16."""
    wide = padded_head_dim(head_dim) <= WIDE_WARP_MAX_DIM and block_rows % 32 == 0
    return 32 if wide else 16


def narrow_staging(head_dim: int, threads: int, block_keys: int, stored: str,
                   wide: bool) -> bool:
    """Whether a block stages its 8-bit float K/V tiles as they are stored (by cp.async,
    a tile's bytes half a 16-bit one's) and widens the fragments it reads, instead of
    widening them on their way into shared memory: where one warp reads every fragment
    once, so that widening after ldmatrix costs what widening while staging does,
    without the synchronous loads. Standard tiles only, K rows in whole 32-value blocks
    (a V fragment load covers 32 dims) and key tiles of 32 (a K fragment load covers
    32 keys)."""
    return (STORED_BYTES[stored] == 1 and threads == 32 and not wide
            and head_dim % 32 == 0 and block_keys % 32 == 0)


@lru_cache(maxsize=None)
def tile_shape(head_dim: int) -> tuple[int, int]:
    """(block_rows, block_keys) the GPU uses for `head_dim`."""
    dpad = padded_head_dim(head_dim)
    return TILES[next(d for d in sorted(TILES) if dpad <= d)]


def grouped_tile(rows: int, head_dim: int) -> tuple[int, int]:
    """(block_rows, block_keys) of the split kernel over `rows` decode rows (a layer's
    group times the longest decode segment): the fewest m16 halves that hold the rows,
    up to 64 (128 where Q stays in registers: one block reads each K/V tile for 128
    rows), and the most keys a tile whose shared memory stays within 48 KiB."""
    dpad = padded_head_dim(head_dim)
    halves = ceil_div(rows, 16)
    if dpad <= Q_REGISTERS_MAX_DIM:
        block_rows = 16 * min(halves, 8)
        return block_rows, (64 if block_rows <= 64 else 32)
    block_rows = 16 * min(halves, 3)
    return block_rows, (32 if block_rows == 16 else 16)


def storage_type(dtype) -> str:
    """The 16-bit type K/V storage of `dtype` holds: "float16", or "bfloat16" (its bit
    patterns held as uint16, as everywhere in kvnumba; the name "bfloat16" too)."""
    name = type_name(dtype)
    name = "bfloat16" if name == "uint16" else name
    if name not in STORAGE_TYPES:
        raise ValueError(f"prefill: storage {name!r} not in {STORAGE_TYPES}")
    return name

@dataclass(frozen=True)
class PrefillShape:
    """The compile-time numbers of one prefill kernel (`of`): tile `br` x `bk` (rows,
    keys), `wr` rows per warp in `h` m16 halves, the padded head dim `dp` and shared
    pitch, the n8 / k16 tile counts, per-lane register arrays, the shared layout (Q, K,
    V bases, `smem` elements) and the cp.async staging of key and query rows
    (`staging_layout`), for the 16-bit mma type `storage`, over K/V storage holding
    `stored` (`STORED_BYTES`: the same type, or 8-bit floats converted to it). The wide
    tile (`v_dim` > 0) adds V's width, its slices' width `vs` and count, and the copies
    per thread of a V slice's rows (`v_copies`, all real when `v_exact`); its O tiles
    `dt` are a slice's."""

    head_dim: int
    storage: str
    br: int
    bk: int
    wr: int
    h: int
    dp: int
    pitch: int
    threads: int
    kt: int
    dk: int
    dt: int
    s_floats: int
    p_words: int
    o_floats: int
    lane_rows: int
    fragment: int
    q_all: int
    s_all: int
    p_all: int
    o_all: int
    chunks: int
    padded: bool
    q_in_registers: bool
    q_base: int
    k_base: int
    v_base: int
    smem: int
    key_lanes: int
    key_passes: int
    key_step: int
    key_copies: int
    keys_exact: bool
    q_lanes: int
    q_passes: int
    q_step: int
    q_copies: int
    q_exact: bool
    stored: str
    v_dim: int = 0
    vs: int = 0
    slices: int = 1
    v_copies: int = 0
    v_exact: bool = True
    narrow: bool = False
    kv_pitch: int = 0
    kv_values: int = CHUNK_VALUES

    @property
    def wide(self) -> bool:
        """The wide tile (`WIDE_TILE`'s doc): V sliced, one key buffer, Q in shared
        memory."""
        return self.v_dim > 0

    @property
    def o_blocks(self) -> tuple[int, int, int]:
        """(groups, step, width) of the dims a lane holds in each O row: `groups` runs of
        `width` consecutive dims, `step` dims apart, from 2t (`width` 2: the n8 tiles'
        column pairs) or 4t (`width` 4: a narrow tile's O, whose n8 tiles 2b and 2b + 1
        hold the even and odd dims of block b of 16, see `prefill.arithmetic`)."""
        return (self.dt // 2, 16, 4) if self.narrow else (self.dt, 8, 2)

    @property
    def stored_bytes(self) -> int:
        """Bytes of one stored K/V value."""
        return STORED_BYTES[self.stored]

    @classmethod
    def of(cls, head_dim: int, block_rows: int, block_keys: int, storage: str,
           warp_rows: int | None = None, stored: str | None = None,
           q_registers: bool | None = None, v_dim: int | None = None) -> "PrefillShape":
        br, bk = block_rows, block_keys
        if v_dim is not None:            # the wide tile: Q in shared memory, one warp
            q_registers, warp_rows = False, 16
        wr = warp_rows or default_warp_rows(head_dim, br)
        assert br % wr == 0 and wr in (16, 32) and bk % 16 == 0 and storage in STORAGE_TYPES
        h = wr // 16                    # m16 row blocks ("halves") of a warp
        dp = padded_head_dim(head_dim)
        pitch = dp + 8                  # 8 rows of an ldmatrix fall 16 bytes apart
        threads = 32 * (br // wr)
        vs, slices = v_slice(head_dim, v_dim) if v_dim is not None else (dp, 1)
        kt, dk, dt = bk // 8, dp // 16, vs // 8   # n8 tiles of S, k16 chunks of Q / K^T, n8 of O
        narrow = narrow_staging(head_dim, threads, bk, stored or storage, v_dim is not None)
        # K / V rows: 16-bit values (a 16-byte chunk holds 8) or, narrow, the stored bytes
        kv_values = NARROW_CHUNK_VALUES if narrow else CHUNK_VALUES
        kv_pitch = dp // 2 + 8 if narrow else pitch
        # per lane and half: Q words, S floats, P words, O floats
        q_words, s_floats, p_words, o_floats = 4 * dk, 4 * kt, 2 * kt, 4 * dt
        chunks = dp // CHUNK_VALUES     # chunks of a padded Q row; those from head_dim on: zeros
        in_registers = dp <= Q_REGISTERS_MAX_DIM if q_registers is None else q_registers
        q_row, k_row, v_row, rows = shared_layout(head_dim, br, bk, in_registers)
        q_base, k_base, v_base = q_row * pitch, k_row * pitch, v_row * pitch
        smem = rows * pitch
        if v_dim is not None:           # one key buffer, K(j) then V(j)
            q_base, k_base, v_base, smem = 0, br * pitch, br * pitch, (br + bk) * pitch
        if narrow:                      # K, V, then Q in rows of its own
            k_base, v_base, q_base = 0, bk * kv_pitch, 2 * bk * kv_pitch
            smem = q_base + br * pitch
        # staging (see staging_layout): thread tid copies chunks tid % lanes + c lanes of
        # rows tid // lanes + p step; the rest of the threads (step lanes < threads) idle
        key_lanes, key_passes = staging_layout(dp // kv_values, threads, bk)
        key_step = threads // key_lanes
        q_lanes, q_passes = staging_layout(chunks, threads, br)
        q_step = threads // q_lanes
        return cls(head_dim, storage, br, bk, wr, h, dp, pitch, threads, kt, dk, dt,
                   s_floats, p_words, o_floats, lane_rows=2 * h, fragment=4 * h,
                   q_all=h * q_words, s_all=h * s_floats, p_all=h * p_words,
                   o_all=h * o_floats, chunks=chunks, padded=dp > head_dim,
                   q_in_registers=in_registers, q_base=q_base, k_base=k_base,
                   v_base=v_base, smem=smem,
                   key_lanes=key_lanes, key_passes=key_passes, key_step=key_step,
                   key_copies=dp // kv_values // key_lanes,
                   keys_exact=key_step * key_lanes == threads and key_step * key_passes == bk,
                   q_lanes=q_lanes, q_passes=q_passes, q_step=q_step,
                   q_copies=chunks // q_lanes,
                   q_exact=q_step * q_lanes == threads and q_step * q_passes == br,
                   stored=stored or storage, v_dim=v_dim or 0, vs=vs, slices=slices,
                   v_copies=ceil_div(vs // CHUNK_VALUES, key_lanes),
                   v_exact=vs // CHUNK_VALUES % key_lanes == 0, narrow=narrow,
                   kv_pitch=kv_pitch, kv_values=kv_values)
