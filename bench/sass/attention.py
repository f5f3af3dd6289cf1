"""The figures of the attention kernels' SASS (`bench.sass.figures` dispatches to them):
decode's instructions per key, prefill's HMMA shares and `cp.async` addressing, and
the combine's round trips to global memory."""
from __future__ import annotations

import math
import sys

import numpy as np

from . import estimate, model
from .flow import Flow
from .loops import COUNTED, Figures, fallback_note, is_wide_load, main_loop, other_loops

#: the decode model's segment: 4096 keys of history and one query (4097 keys)
DECODE_HISTORY = 4096
#: the combine model's segment: the 129 chunks of a 32K-key segment
COMBINE_PARTS = 129


def decode_chunks() -> list[int]:
    """The keys of each chunk of a one-query segment of DECODE_HISTORY + 1 keys, cut as
    `decode.chunk_tables` cuts it."""
    from kvnumba.arith import positions as fields
    from kvnumba.kernels import decode
    planning = sys.modules[decode.chunk_tables.__module__]     # the work table's field constants

    seq_info = np.zeros((1, fields.SEQ_INFO_FIELDS), np.int32)
    seq_info[0, [fields.Q_START, fields.Q_LEN, fields.SEQ, fields.POS_START, fields.FLAGS]] = \
        (0, 1, 0, DECODE_HISTORY, 0)
    work = decode.chunk_tables(seq_info, [0], mask_code=0).work
    return [int(n) for n in work[:, planning.WORK_KEY_HI] - work[:, planning.WORK_KEY_LO]]


def decode_figures(flow: Flow, arguments: dict) -> Figures:
    """Instructions per key per kv head on a one-segment step of DECODE_HISTORY + 1
    keys, the chunks as `decode.chunk_tables` cuts them. Each chunk is one block of `WARPS`
    warps per kv head; a warp runs the main loop's hot path B once per block trip of
    `WARPS * UNROLL * key_slots` keys (the shortest path from the loop's header back
    to it: the rarely taken blocks inside the loop, such as the accumulators' rescale
    when a row's reference max moves, are left out of it) and, once per chunk, the
    fixed work F (every executed instruction outside the main loop) and the loop's
    rarely taken blocks R: sum over chunks of WARPS * (F + R + B * ceil(len / keys
    per trip)), over the keys."""
    from kvnumba.kernels.decode import shape as decode_shape

    itemsize = np.dtype(arguments["storage"]).itemsize
    geometry = decode_shape.Geometry.of(arguments["head_dim"], itemsize)
    keys_per_trip = decode_shape.WARPS * decode_shape.UNROLL * geometry.key_slots
    # K/V loads of 16 bytes (LDG.E.128), or of 8 for 8-bit floats (LDG.E.64)
    width = f".{8 * geometry.load}"
    loads = f"LDG.E{width}"

    def is_kv_load(ins):
        return ins.base == "LDG" and width in ins.opcode

    loop = main_loop(flow, is_kv_load, f"the K/V loads ({loads})")
    hot = flow.hot_path(loop).shortest
    rare = len(loop.instructions) - hot
    fixed = len(flow.executed) - len(loop.instructions)
    lengths = decode_chunks()
    warp_instructions = sum(decode_shape.WARPS * (fixed + rare + hot * math.ceil(n / keys_per_trip))
                            for n in lengths)
    keys = sum(lengths)
    notes = [f"main loop at {loop.header:#x}: B = {hot} instructions on the hot path of a "
             f"{keys_per_trip}-key block trip ({hot / keys_per_trip:.1f} per key), "
             f"{loop.count(is_kv_load)} {loads}; R = {rare} in rarely taken blocks; "
             f"fixed work F = {fixed} per warp per chunk",
             f"{keys} keys in {len(lengths)} chunks ({', '.join(map(str, sorted(set(lengths))))} "
             f"keys) of {decode_shape.WARPS} warps: {warp_instructions} warp instructions",
             *other_loops(flow, [loop], is_kv_load, loads,
                          ", their bodies counted once in F"),
             *fallback_note(flow)]
    return Figures({"instructions_per_key": warp_instructions / keys}, notes)


def tensor_decode_figures(flow: Flow, arguments: dict) -> Figures:
    """Instructions per key per kv head of the tensor-core decode (`prefill_kernel(...,
    split=True)`) on the decode model's segment (one query, DECODE_HISTORY + 1 keys, its
    chunks as `decode.chunk_tables` cuts them), summed over what each warp of a chunk's
    block runs: the path through the kernel (`Flow.through` the unmasked loop, longest:
    the longest prologue and epilogue, every branch taken) without the masked loop, P;
    per whole key tile one trip of the unmasked loop (the loop holding the most HMMAs,
    the leaner of equals), counted whole, B (the rescale when a row's max moves
    included on every trip); per partial tile (a chunk's last keys short of a tile) one
    trip of the masked loop, M: sum over chunks of warps * (P + B * whole + M * partial),
    over the keys. The group's rows all see every key of a chunk, so no tile is partial
    but a chunk's last. Also the unmasked loop's HMMA share, as prefill's."""
    from kvnumba.kernels.prefill.shape import PrefillShape
    shape = PrefillShape.of(arguments["head_dim"], arguments["block_rows"],
                            arguments["block_keys"], arguments["storage"],
                            arguments.get("warp_rows"), arguments.get("stored"),
                            False if arguments.get("v_dim") else None, arguments.get("v_dim"))
    # the wide tile: each V slice's block walks every chunk; a latent layer's step is
    # DeepSeek-V3's (`estimate.LATENT_Q_HEADS` rows over one kv head, its rows alone read)
    latent = bool(arguments.get("v_in_k"))
    warps, tile = shape.br // shape.wr * shape.slices, shape.bk
    is_hmma = COUNTED["HMMA"]
    loop = main_loop(flow, is_hmma, "the HMMAs")
    masked = max((other for other in flow.loops if other is not loop and other.count(is_hmma)),
                 key=lambda other: other.count(is_hmma), default=None)
    if masked is None:
        raise ValueError("no second loop holds HMMAs: the masked tiles' loop is not in the SASS")
    trip, partial = len(loop.instructions), len(masked.instructions)
    path = flow.through(loop).longest - partial
    lengths = decode_chunks()
    warp_instructions = sum(warps * (path + trip * (n // tile) + partial * (n % tile > 0))
                            for n in lengths)
    keys = sum(lengths)
    per_key = warp_instructions / keys
    itemsize = shape.stored_bytes
    row_tiles = estimate.LATENT_Q_HEADS // shape.br if latent else 1
    kv_heads = estimate.LATENT_KV_HEADS if latent else estimate.KV_HEADS
    step = estimate.decode_step(per_key * row_tiles, warps * row_tiles * loop.count(is_hmma) / tile,
                                shape.head_dim, itemsize, planes=1 if latent else 2,
                                kv_heads=kv_heads)
    rows = row_tiles * shape.br
    tflops = estimate.tflops(step, 2 * rows * (shape.head_dim + (shape.v_dim or shape.head_dim)),
                             kv_heads)
    blocks = estimate.blocks_per_sm(2 * shape.smem, arguments.get("registers",
                                                                 estimate.MAX_REGISTERS),
                                    32 * (shape.br // shape.wr))
    cover = estimate.in_flight((1 if latent else 2) * tile * shape.head_dim * itemsize, blocks)
    notes = [f"unmasked loop at {loop.header:#x}: B = {trip} instructions a {tile}-key tile "
             f"({trip / tile:.1f} per key per warp), {loop.count(is_hmma)} HMMA; masked loop "
             f"at {masked.header:#x}: M = {partial}; the path through the rest P = {path} per "
             f"warp per chunk",
             f"{keys} keys in {len(lengths)} chunks of {warps} warp(s): {warp_instructions} "
             f"warp instructions",
             f"H200 estimate ({estimate.SEQUENCES} sequences x {estimate.KEYS} keys x "
             f"{kv_heads} kv heads x {rows} rows): bytes {1e6 * step.bytes_s:.0f} us, issue "
             f"{1e6 * step.issue_s:.0f} us, HMMA {1e6 * step.hmma_s:.0f} us: "
             f"{100 * step.hbm_fraction:.1f}% of HBM bandwidth, {tflops:.0f} TFLOP/s; "
             f"{blocks} blocks an SM (by shared memory and registers) keep {cover:.1f}x "
             f"the bytes in flight the latency needs",
             *other_loops(flow, [loop, masked], is_hmma, "HMMA"), *fallback_note(flow)]
    return Figures({"instructions_per_key": per_key,
                    "hmma_percent": 100.0 * loop.count(is_hmma) / trip,
                    "h200_hbm_percent": 100.0 * min(1.0, cover) * step.hbm_fraction,
                    "h200_tflops": min(1.0, cover) * tflops}, notes)


def prefill_figures(flow: Flow, arguments: dict) -> Figures:
    """HMMA as a percentage of the main loop (the loop holding the most HMMAs, the
    leaner of equals: one unmasked key tile per trip) and of the masked loop (the other
    loop holding HMMAs: the tiles some row sees in part, the diagonal's), and the
    instructions of the main loop in the address computation of its cp.async (LDGSTS)
    per LDGSTS. The kernel split over decode chunks is measured as decode is
    (`tensor_decode_figures`)."""
    if arguments.get("split"):
        return tensor_decode_figures(flow, arguments)
    is_hmma, is_copy = COUNTED["HMMA"], COUNTED["LDGSTS"]
    loop = main_loop(flow, is_hmma, "the HMMAs")
    masked = max((other for other in flow.loops if other is not loop and other.count(is_hmma)),
                 key=lambda other: other.count(is_hmma), default=None)
    if masked is None:
        raise ValueError("no second loop holds HMMAs: the masked tiles' loop is not in the SASS")
    copies = loop.count(is_copy)
    addressing = model.address_slice(loop.instructions, is_copy)
    values = {"hmma_percent": 100.0 * loop.count(is_hmma) / len(loop.instructions),
              "masked_hmma_percent": 100.0 * masked.count(is_hmma) / len(masked.instructions),
              "instructions_per_cp_async": len(addressing) / copies if copies else 0.0}
    notes = [f"main loop at {loop.header:#x}: {len(loop.instructions)} instructions per key "
             f"tile, {loop.count(is_hmma)} HMMA, {loop.count(COUNTED['LDSM'])} LDSM, {copies} "
             f"LDGSTS whose addresses take {len(addressing)} of them",
             f"masked loop at {masked.header:#x}: {len(masked.instructions)} instructions per "
             f"key tile, {masked.count(is_hmma)} HMMA",
             *other_loops(flow, [loop, masked], is_hmma, "HMMA"), *fallback_note(flow)]
    return Figures(values, notes)


def combine_figures(flow: Flow, arguments: dict) -> Figures:
    """Round trips to global memory a thread waits on for COMBINE_PARTS parts
    (`sassmodel.round_trips`: a wait wherever a load's result is first used while it
    is outstanding), over the code it runs in order: the executed instructions before
    the accumulator loop, the loop's body once per trip, the rest. Trips:
    ceil(COMBINE_PARTS / (`PART_GROUPS` * LDG.E.128 per trip)), `PART_GROUPS`
    threads over the parts, each taking one part per LDG.E.128 of a trip."""
    from kvnumba.kernels.decode import combine

    loop = main_loop(flow, is_wide_load, "the accumulator loads (LDG.E.128)")
    acc_loads = loop.count(is_wide_load)
    trips = math.ceil(COMBINE_PARTS / (combine.PART_GROUPS * acc_loads))
    inside = set(map(id, loop.instructions))
    before = [ins for ins in flow.executed if ins.address < loop.header]
    after = [ins for ins in flow.executed if ins.address > loop.header and id(ins) not in inside]
    run = [*before, *loop.instructions * trips, *after]
    waits = model.round_trips(run)
    notes = [f"accumulator loop at {loop.header:#x}: {acc_loads} LDG.E.128 + "
             f"{loop.count(model.is_global_load) - acc_loads} other LDG per trip, "
             f"{model.round_trips(loop.instructions)} round trip(s) per trip alone, {trips} "
             f"trips for {COMBINE_PARTS} parts; {model.round_trips(before)} round trip(s) "
             f"before the loop; {waits} in all",
             *other_loops(flow, [loop], is_wide_load, "LDG.E.128"), *fallback_note(flow)]
    return Figures({"round_trips": waits}, notes)
