"""The kernels `python -m kvnumba.bench.sass` builds (`SPECIALISATIONS`): each a label,
a `module:function` or `module:factory(ARGS)` and its Numba signature, as
docs/benchmarks.md reports them and bench/sass/budgets.json bounds them; and the probe
kernel that runs every inline-PTX intrinsic as the attention kernels use them."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvnumba.device import cuda
from kvnumba.kernels.intrinsics import ptx, tensorcore

TILE = 16 * 16                  # one 16x16 float16 tile: 32 lanes x 16 bytes


@cuda.jit
def intrinsics_probe(keys, values, out, scratch):
    """Every `ptx` and `tensorcore` function as the attention kernels use them, in one
    warp: stage a 16x16 float16 K tile with cp.async, load mma fragments with ldmatrix,
    multiply (f16 and bf16), reduce over the lanes of a row with shuffles, stream 16-byte
    chunks of V through registers (f16 and bf16 unpacked, scaled, repacked), permute bytes
    of a lane's own shared words and store rounded float32 pairs and quads."""
    lane = cuda.laneid
    tile = cuda.shared.array(TILE, np.float16)
    tensorcore.cp_async_16(tile, lane * 8, keys, lane * 8)
    tensorcore.cp_async_commit()
    tensorcore.cp_async_wait(0)
    cuda.syncthreads()
    frag = (lane % 16) * 16 + (lane // 16) * 8
    a0, a1, a2, a3 = tensorcore.ldmatrix_x4(tile, frag)
    b0, b1, b2, b3 = tensorcore.ldmatrix_x4_trans(tile, frag)
    d0, d1, d2, d3 = tensorcore.mma_f16_f32(a0, a1, a2, a3, b0, b1, 0.0, 0.0, 0.0, 0.0)
    p = ptx.f32x2_to_bf16x2(d0, d1)
    q = ptx.f32x2_to_bf16x2(d2, d3)
    e0, e1, e2, e3 = tensorcore.mma_bf16_f32(p, q, p, q, b2, b3, d0, d1, d2, d3)
    row_max = max(e0, e1)                             # a row of D lives in 4 lanes
    row_max = max(row_max, ptx.shfl_xor(row_max, 1))
    row_max = max(row_max, ptx.shfl_xor(row_max, 2))
    scale = ptx.shfl_idx(row_max, 0) + max(e2, e3)
    u0, u1, u2, u3 = ptx.ld_nc_v4(values, lane * 8)
    lo, hi = ptx.f16x2_to_f32(u0)
    blo, bhi = ptx.bf16x2_to_f32(u1)
    w0, w1, w2, w3 = ptx.ld_v4(scratch, lane * 4)
    sign = ptx.shfl_xor(w0, 16) & 0x80000000
    flipped = ptx.u32_as_f32(ptx.f32_as_u32(scale) ^ sign)
    ptx.st_v4(out, lane * 8, ptx.f32x2_to_f16x2(lo * flipped, hi * flipped),
              ptx.f32x2_to_bf16x2(blo * scale, bhi * scale), u2 ^ w2, u3 ^ w3)
    ptx.st_v4(scratch, lane * 4, w1, w0, w3, w2)
    s0, s1 = tensorcore.ld_shared_v2(tile, lane * 4)
    ptx.st_v4(scratch, 128 + lane * 4, ptx.prmt(s0, s1, 0x3120), s1, w0, w1)
    ptx.st_f32x2(out, 256 + lane * 2, e0, e1)
    ptx.st_f32x4(out, 320 + lane * 4, lo, hi, blo, bhi)


PROBE_SIGNATURE = "void(float16[::1], float16[::1], float16[::1], uint32[::1])"


@dataclass(frozen=True)
class Specialisation:
    """A kernel of the report: its label, `module:function` or `module:factory(ARGS)`,
    and Numba signature."""

    label: str
    spec: str
    signature: str


def _decode_signature(t: str, q: str | None = None) -> str:
    """Storage of `t`, q and out of `q` (default `t`)."""
    q = q or t
    return (f"void({q}[:, :, ::1], {t}[:, :, ::1], {t}[:, :, ::1], int32[::1], "
            f"int32[:, ::1], {q}[:, :, ::1], float32[:, ::1], float32[::1], float32[::1], "
            f"float32[::1], "
            f"{', '.join(['int64'] * 8)}, float32, float32, int64)")


def _prefill_signature(t: str, q: str | None = None) -> str:
    """Storage of `t`, q and out of `q` (default `t`)."""
    q = q or t
    return (f"void({q}[:, :, ::1], {t}[:, :, ::1], {t}[:, :, ::1], int32[:, ::1], int64, "
            f"int32[::1], {q}[:, :, ::1], float32[:, ::1], float32[::1], "
            f"{', '.join(['int64'] * 6)}, "
            f"float32, float32, float32[::1], float32[::1], int64, int64)")


def _generic_signature(t: str) -> str:
    """The generic kernel over storage of `t`, q and out of `t`."""
    return (f"void({t}[:, :, ::1], {t}[:, :, ::1], {t}[:, :, ::1], int32[:, ::1], int64, "
            f"int32[::1], int64, int64, {t}[:, :, ::1], float32[:, ::1], float32[::1], "
            f"float32[::1], float32[::1], {', '.join(['int64'] * 6)}, float32, float32)")


def _narrow_signature(t: str) -> str:
    """The write of `t` input into e4m3 storage (uint8 bits)."""
    return (f"void(uint8[:, :, ::1], uint8[:, :, ::1], {t}[:, :, ::1], {t}[:, :, ::1], "
            f"int32[::1], int64, int64, int32[:, ::1], int64, float32, float32)")


def _recurrence_signature(inputs: str, out: str, *, advance_after: bool = True) -> str:
    """A recurrence's step kernel (`kernels.state.recurrence`) over float32 state and
    log, the op's seven `inputs` and its `out`; without `advance_after`, a chunked
    kernel's (its arguments but that last one)."""
    state = "float32[:, :, :, ::1]"
    return (f"void({state}, {state}, {state}, {state}, {state}, float32[:, :, ::1], "
            f"int32[:, ::1], {inputs}, {out}, int32[:, ::1], int32[::1], int32[:, ::1], "
            f"int64, float32, float32, boolean, boolean{', int64' if advance_after else ''})")


def _delta_rule_inputs(t: str, *, per_channel: bool) -> str:
    """The delta rule's q, k, v, gate (`[width, H]`, or a channel's: `per_channel`) and
    beta of `t`, then the two unused inputs (`no_output()`)."""
    gate = f"{t}[:, :, ::1]" if per_channel else f"{t}[:, ::1]"
    return (f"{t}[:, :, ::1], {t}[:, :, ::1], {t}[:, :, ::1], {gate}, {t}[:, ::1], "
            f"float32[:, ::1], float32[:, ::1]")


def _delta_rule_signature(t: str, *, per_channel: bool) -> str:
    """The delta rule's step kernel, inputs and output of `t`, beta given."""
    return _recurrence_signature(_delta_rule_inputs(t, per_channel=per_channel),
                                 f"{t}[:, :, ::1]")


def _chunked_signature(t: str, *, per_channel: bool = False) -> str:
    """The delta rule's chunked kernel, inputs and output of `t`, a gate a head (or a
    channel's: `per_channel`), beta given."""
    return _recurrence_signature(_delta_rule_inputs(t, per_channel=per_channel),
                                 f"{t}[:, :, ::1]", advance_after=False)


def _ssd_signature(t: str, *, advance_after: bool = True) -> str:
    """The ssd's step kernel (without `advance_after`: its chunked kernel): x, dt, B, C
    and the output of `t`; A, D and dt_bias float32 (as Mamba2 models keep them)."""
    return _recurrence_signature(f"{t}[:, :, ::1], {t}[:, ::1], float32[::1], "
                                 f"{t}[:, :, ::1], {t}[:, :, ::1], float32[::1], "
                                 f"float32[::1]", f"{t}[:, :, ::1]",
                                 advance_after=advance_after)


_DECODE = "kvnumba.kernels.decode.kernel:decode_kernel"
_DELTA_RULE = "kvnumba.kernels.state.delta_rule:_kernel"
_SSD = "kvnumba.kernels.state.ssd:_kernel"
_CHUNKED = "kvnumba.kernels.state.delta_rule:chunked_kernel"
_SSD_CHUNKED = "kvnumba.kernels.state.ssd:chunked_kernel"
_CHUNKED_CHANNEL = "kvnumba.kernels.state.chunked_channel:kernel"
_PREFILL = "kvnumba.kernels.prefill.kernel:prefill_kernel"
_GENERIC = "kvnumba.kernels.generic.kernel:attention_kernel"


def _tensor_cores(head_dim: int, block_keys: int, storage: str, stored: str | None = None,
                  *, split: bool = True, v_dim: int | None = None,
                  v_in_k: bool = False) -> str:
    """The prefill kernel over 16 rows a block, no softcap, Q staged by cp.async: split
    over the decode path's chunks (`split`), 8-bit floats converted to `storage`
    (`stored`), the wide tile for V of `v_dim` (in K's rows where `v_in_k`)."""
    wide = f", {v_dim}, {v_in_k}" if v_dim else ""
    held = repr(stored) if stored else None
    return (f"{_PREFILL}({head_dim}, 16, {block_keys}, '{storage}', False, True, None, "
            f"{held}, False, {split}{wide})")
#: what --report and --check build: the kernels docs/benchmarks.md reports, at the
#: specialisations it lists (bfloat16 storage is held as uint16 bits)
SPECIALISATIONS = (
    Specialisation("probe", "kvnumba.bench.sass.specs:intrinsics_probe", PROBE_SIGNATURE),
    Specialisation("write", "kvnumba.kernels.moves.write:_write_vectors",
                   "void(float16[:, :, ::1], float16[:, :, ::1], float16[:, :, ::1], "
                   "float16[:, :, ::1], int32[::1], int64, int64, int32[:, ::1], int64)"),
    # into 8-bit float storage: float16 input at scale 1 (narrowed in float16 pairs), and
    # bfloat16 input scaled (widened to float32)
    Specialisation("write float8_e4m3 from float16",
                   "kvnumba.kernels.moves.write_fp8:narrow_kernel('float16', 'e4m3', False)",
                   _narrow_signature("float16")),
    Specialisation("write float8_e4m3 from bfloat16 scaled",
                   "kvnumba.kernels.moves.write_fp8:narrow_kernel('uint16', 'e4m3', True)",
                   _narrow_signature("uint16")),
    Specialisation("copy", "kvnumba.kernels.moves.page_copy:_copy_vectors",
                   "void(float16[:, :, :, :, :, ::1], int32[::1], int64, int64)"),
    Specialisation("decode d128 float16", f"{_DECODE}(128, 'float16', 4, False)",
                   _decode_signature("float16")),
    Specialisation("decode d128 float16 2 rows", f"{_DECODE}(128, 'float16', 2, False)",
                   _decode_signature("float16")),
    Specialisation("decode d128 float16 1 row", f"{_DECODE}(128, 'float16', 1, False)",
                   _decode_signature("float16")),
    Specialisation("decode d128 bfloat16", f"{_DECODE}(128, 'uint16', 4, False)",
                   _decode_signature("uint16")),
    # 8-bit float storage (e4m3 bits as uint8, e5m2 as int8) under float16 queries: 8-byte
    # loads, so a d128 key row takes 16 lanes and a block 4 rows, as 16-bit storage
    Specialisation("decode d128 float8_e4m3", f"{_DECODE}(128, 'uint8', 4, False, 'float16')",
                   _decode_signature("uint8", "float16")),
    Specialisation("decode d128 float8_e5m2", f"{_DECODE}(128, 'int8', 4, False, 'float16')",
                   _decode_signature("int8", "float16")),
    Specialisation("decode d128 float8_e4m3 2 rows",
                   f"{_DECODE}(128, 'uint8', 2, False, 'float16')",
                   _decode_signature("uint8", "float16")),
    Specialisation("decode d128 float8_e4m3 1 row",
                   f"{_DECODE}(128, 'uint8', 1, False, 'float16')",
                   _decode_signature("uint8", "float16")),
    Specialisation("decode d128 float32", f"{_DECODE}(128, 'float32', 4, False)",
                   _decode_signature("float32")),
    Specialisation("decode d128 float16 softcap", f"{_DECODE}(128, 'float16', 4, True)",
                   _decode_signature("float16")),
    Specialisation("decode d256 float16", f"{_DECODE}(256, 'float16', 4, False)",
                   _decode_signature("float16")),
    Specialisation("decode d256 bfloat16 softcap 2 rows", f"{_DECODE}(256, 'uint16', 2, True)",
                   _decode_signature("uint16")),
    # sinks: the decode and prefill kernels that fold a sink into each row
    Specialisation("decode d128 float16 sinks", f"{_DECODE}(128, 'float16', 4, False, None, "
                   f"True, True)", _decode_signature("float16")),
    # chunked layers: the variant whose rows find their chunk's start (one division a row)
    Specialisation("decode d128 float16 chunks", f"{_DECODE}(128, 'float16', 4, False, None, "
                   f"True, False, True)", _decode_signature("float16")),
    Specialisation("combine d128", "kvnumba.kernels.decode.combine:_combine_kernel(128)",
                   "void(int32[::1], float32[::1], float32[::1], float16[:, :, ::1], "
                   "float32[:, ::1], float32[::1], int64, int64, int64)"),
    Specialisation("prefill d64 float16", f"{_PREFILL}(64, 64, 64, 'float16', False)",
                   _prefill_signature("float16")),
    Specialisation("prefill d128 float16", f"{_PREFILL}(128, 64, 64, 'float16', False)",
                   _prefill_signature("float16")),
    Specialisation("prefill d128 bfloat16", f"{_PREFILL}(128, 64, 64, 'bfloat16', False)",
                   _prefill_signature("uint16")),
    # 8-bit float storage staged into float16 / bfloat16 tiles (e4m3 bits as uint8, e5m2
    # as int8), queries of the mma type
    Specialisation("prefill d128 float8_e4m3",
                   f"{_PREFILL}(128, 64, 64, 'float16', False, True, None, 'e4m3')",
                   _prefill_signature("uint8", "float16")),
    Specialisation("prefill d128 float8_e5m2 bfloat16 q",
                   f"{_PREFILL}(128, 64, 64, 'bfloat16', False, True, None, 'e5m2')",
                   _prefill_signature("int8", "uint16")),
    Specialisation("prefill d128 float16 softcap", f"{_PREFILL}(128, 64, 64, 'float16', True)",
                   _prefill_signature("float16")),
    Specialisation("prefill d128 float16 sinks",
                   f"{_PREFILL}(128, 64, 64, 'float16', False, True, None, None, True)",
                   _prefill_signature("float16")),
    Specialisation("prefill d256 float16", f"{_PREFILL}(256, 48, 16, 'float16', False)",
                   _prefill_signature("float16")),
    Specialisation("prefill d256 bfloat16 softcap",
                   f"{_PREFILL}(256, 48, 16, 'bfloat16', True)", _prefill_signature("uint16")),
    # decode on tensor cores: the prefill kernel split over decode chunks, its rows a
    # group's query heads (`decode.grouped`; 16 rows: groups up to 16 of one token)
    Specialisation("decode tensor cores d128 float16 16 rows",
                   _tensor_cores(128, 64, "float16"), _prefill_signature("float16")),
    Specialisation("decode tensor cores d128 bfloat16 16 rows",
                   _tensor_cores(128, 64, "bfloat16"), _prefill_signature("uint16")),
    Specialisation("decode tensor cores d128 float8_e4m3 16 rows",
                   _tensor_cores(128, 64, "float16", "e4m3"),
                   _prefill_signature("uint8", "float16")),
    Specialisation("decode tensor cores d128 float8_e5m2 16 rows",
                   _tensor_cores(128, 64, "float16", "e5m2"),
                   _prefill_signature("int8", "float16")),
    # the wide tile (K past 256, or V narrower than K): a latent layer's decode, rows of
    # 576 values and V their first 512 in two slices (DeepSeek-V3's 128 heads: 8 row
    # tiles of 16), and head dim 512 with V in its own storage
    Specialisation("decode tensor cores latent d576 float16",
                   _tensor_cores(576, 16, "float16", v_dim=512, v_in_k=True),
                   _prefill_signature("float16")),
    Specialisation("decode tensor cores latent d576 float8_e4m3",
                   _tensor_cores(576, 16, "float16", "e4m3", v_dim=512, v_in_k=True),
                   _prefill_signature("uint8", "float16")),
    Specialisation("decode tensor cores d512 float16",
                   _tensor_cores(512, 16, "float16", v_dim=512, v_in_k=False),
                   _prefill_signature("float16")),
    Specialisation("prefill latent d576 float16",
                   _tensor_cores(576, 16, "float16", split=False, v_dim=512, v_in_k=True),
                   _prefill_signature("float16")),
    # the generic CUDA-core kernel at the head dims the fast paths do not take (past 256,
    # or V of another width than K): d256's decode and prefill tiles, and d512's one tile
    # (`kernels.generic.DECODE_TILES`, `PREFILL_TILES`)
    Specialisation("generic d256 float16 decode", f"{_GENERIC}(256, 4, 32, 32, 128)",
                   _generic_signature("float16")),
    Specialisation("generic d256 float16 prefill", f"{_GENERIC}(256, 16, 16, 16, 128)",
                   _generic_signature("float16")),
    Specialisation("generic d512 float16", f"{_GENERIC}(512, 4, 16, 16, 64)",
                   _generic_signature("float16")),
    # a latent layer's rows (576 values, V the first 512, in slices of 128 a block)
    Specialisation("generic d576 float16 latent", f"{_GENERIC}(576, 4, 16, 16, 64, 128)",
                   _generic_signature("float16")),
    # state layers: the gated delta rule's step over d128 heads (Qwen3-Next's), a gate a
    # head, bfloat16 inputs and output (held as uint16 bits)
    Specialisation("delta rule d128 bfloat16", f"{_DELTA_RULE}(128, 128, False)",
                   _delta_rule_signature("uint16", per_channel=False)),
    # its chunked prefill (chunks of `chunked.CHUNK` tokens, products on the tensor cores)
    Specialisation("delta rule chunked d128 bfloat16", f"{_CHUNKED}(128, 128, 32)",
                   _chunked_signature("uint16")),
    # with a gate per key channel (Kimi's KDA: chunks of `chunked_channel.CHUNK` tokens,
    # A and P on the CUDA cores, the state-side products on the tensor cores)
    Specialisation("delta rule chunked per-channel d128 bfloat16",
                   f"{_CHUNKED_CHANNEL}(128, 128)",
                   _chunked_signature("uint16", per_channel=True)),
    # Mamba2's SSD over Nemotron-H's and Granite 4's heads (head_dim 64, d_state 128),
    # bfloat16 x, dt, B, C and output
    Specialisation("ssd 64x128 bfloat16", f"{_SSD}(128, 64)", _ssd_signature("uint16")),
    # its chunked scan (the chunked kernel of the decay-only recurrence, state transposed)
    Specialisation("ssd chunked 64x128 bfloat16", f"{_SSD_CHUNKED}(128, 64, 32)",
                   _ssd_signature("uint16", advance_after=False)),
)
