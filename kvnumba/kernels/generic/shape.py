"""The generic kernel's tile shapes and launch geometry (`launch_shape`, host side): the
head-dim buckets, the decode and prefill tiles of each, the V slices of the widest, and
the split-K chunking of the decode path (the package doc tells the kernel they shape).
"""
from __future__ import annotations

from ..launch.calling import ceil_div

#: max(head_dim, v_head_dim) is padded up to one of these; each gets its own compiled
#: tile shapes
HEAD_DIM_BUCKETS = (16, 32, 64, 128, 256, 512, 576)
#: padded head_dim -> tile shapes (block_rows, block_keys, key_lanes, threads):
#: key_lanes threads run along keys and threads // key_lanes along rows. Shared
#: memory, (block_rows + block_keys) * (dpad + 1) + block_rows * (block_keys + 1)
#: floats, stays under the 48 KiB static limit, and a thread's output elements, block_rows
#: * dpad / threads, stay at most 32 (`MAX_OWN`: more are kept in local memory). Tiny
#: head dims use 2 warps, and so does 512: one tile of 4 rows and 16 keys (8 rows on 4
#: warps would take 16-key tiles, 12,448 floats, over the limit; 8 rows on 2 warps, 64
#: output elements a thread).
#: Decode offers one shape per row count (group * max_q_len rows are packed in a
#: tile): the host takes the smallest that holds them all, else the largest, so
#: threads are not left idle on a 1-row decode.
DECODE_TILES = {
    16: ((4, 32, 16, 64), (16, 32, 4, 64)),
    32: ((4, 64, 32, 128), (8, 64, 16, 128), (16, 64, 8, 128)),
    64: ((4, 64, 32, 128), (8, 64, 16, 128), (16, 64, 8, 128)),
    128: ((4, 64, 32, 128), (8, 64, 16, 128), (16, 64, 8, 128)),
    256: ((4, 32, 32, 128), (8, 32, 16, 128)),
    512: ((4, 16, 16, 64),),
    576: ((4, 16, 16, 64),),
}
PREFILL_TILES = {16: (32, 32, 8, 64), 32: (64, 64, 16, 128), 64: (64, 32, 16, 128),
                 128: (32, 32, 16, 128), 256: (16, 16, 16, 128), 512: (4, 16, 16, 64),
                 576: (4, 16, 16, 64)}
#: padded head_dim -> the V dims one block accumulates, where a block cannot hold a row's
#: whole output (a latent layer's 576-wide rows, V their first 512: four blocks of 128
#: each compute the scores and accumulate their own slice); else all of them
V_SLICES = {576: 128}
#: the most (row, dim) output elements one thread accumulates (kept in registers)
MAX_OWN = 32
#: segments no longer than this (all of them) take the split-K decode path
DECODE_MAX_Q_LEN = 4
#: the decode path aims for this many blocks (about 2 per SM on an H100/H200), but
#: never cuts a key range into chunks shorter than DECODE_MIN_CHUNK keys or into
#: more than MAX_SPLITS pieces
TARGET_BLOCKS = 264
DECODE_MIN_CHUNK = 256
MAX_SPLITS = 64
#: threads per block of the combine kernel
COMBINE_THREADS = 128
#: most (token, query head) rows a q may have: the kernels divide row indices (and
#: block indices, positions, keys) as 32-bit integers (`masks.div32`)
MAX_QUERY_ROWS = 2**31 - 1


def head_dim_bucket(head_dim: int) -> int:
    """The padded head_dim whose tile shapes serve `head_dim` (1..576): the kernel takes
    the bucket of `max(head_dim, v_head_dim)`."""
    for dpad in HEAD_DIM_BUCKETS:
        if head_dim <= dpad:
            return dpad
    raise ValueError(f"head_dim={head_dim}: attention supports at most {HEAD_DIM_BUCKETS[-1]}")


def launch_shape(*, n_segments, max_q_len, max_kv_len, n_q_heads, n_kv_heads, head_dim,
                 mask_code, path=None, kv_chunk=None, v_head_dim=None):
    """Host-side launch geometry: a dict with path, tiles, grid and split-K chunking.

    `path`: None (auto: "decode" when `max_q_len <= DECODE_MAX_Q_LEN`), "decode" or
    "prefill". `kv_chunk`: force the split-K chunk length (keys), any path. `v_head_dim`:
    V's width (None: head_dim); the tiles are those of `max(head_dim, v_head_dim)`'s bucket.
    """
    if path is None:
        path = "decode" if max_q_len <= DECODE_MAX_Q_LEN else "prefill"
    if path not in ("decode", "prefill"):
        raise ValueError(f"path={path!r}: must be None, 'decode' or 'prefill'")
    group = n_q_heads // n_kv_heads
    dpad = head_dim_bucket(max(head_dim, head_dim if v_head_dim is None else v_head_dim))
    if path == "decode":
        rows = group * max_q_len
        tiles = next((t for t in DECODE_TILES[dpad] if t[0] >= rows), DECODE_TILES[dpad][-1])
    else:
        tiles = PREFILL_TILES[dpad]
    block_rows, block_keys, key_lanes, threads = tiles
    n_row_tiles = ceil_div(group * max_q_len, block_rows)
    # longest key range of one row tile: the whole history, or what a window of W leaves
    # (a chunk of C reads back at most C - 1 positions, as a window of C)
    span = max_kv_len if mask_code == 0 else min(max_kv_len, abs(mask_code) + max_q_len - 1)
    span = max(span, 1)
    if kv_chunk is not None:
        chunk = int(kv_chunk)
    elif path == "decode":
        want = min(MAX_SPLITS, max(1, ceil_div(TARGET_BLOCKS,
                                                n_segments * n_row_tiles * n_kv_heads)))
        chunk = ceil_div(max(DECODE_MIN_CHUNK, ceil_div(span, want)), block_keys) * block_keys
    else:
        chunk = span
    n_splits = ceil_div(span, chunk)
    return dict(path=path, group=group, dpad=dpad, block_rows=block_rows,
                block_keys=block_keys, key_lanes=key_lanes, n_row_tiles=n_row_tiles,
                n_splits=n_splits, chunk=chunk,
                v_slice=V_SLICES.get(dpad),
                grid=(n_segments * n_row_tiles * n_splits,
                      n_kv_heads * ceil_div(v_head_dim or head_dim, V_SLICES.get(dpad, dpad))),
                threads=threads)
