"""The figures of the state layers' kernels' SASS (`bench.sass.figures` dispatches to
them): the delta rule's and the ssd's decode step as a fraction of an H100's memory
bandwidth, and the chunked prefill's (the delta rule's, a gate a head or a key
channel's, and the ssd's) tensor-core share and estimated TFLOP/s on an H100
(`chunk_figures`, below).

A decode step gives each (sequence, head) one token: its block (`recurrence.block_threads`
threads, `lanes_per_column` lanes a column of the state) reads the head's float32 state
once, takes one trip of the position loop (the loop holding the block's barriers) and
writes the state once. The bytes that must move per (sequence, head), whatever the
kernel: the state read and written (`2 Dk Dv` float32), the token's inputs read and its
output written (`INPUT_BYTES` each: bfloat16; for the delta rule q, k, v, gate and beta;
for the ssd x and dt, its group's B and C shared by `HEADS_PER_GROUP` heads, and A, D and
dt_bias in float32), and the log row it writes (float32: the delta rule's k, v, the gate
and beta; the ssd's `d x`, B and `d A`). What a warp issues for it: the longest path from
the kernel's entry through that loop to its exit (`Flow.through`, every other loop taken
once: one token's strided loops over `Dk` take one trip where `Dk <= ` the block's
threads) plus the longest trip of the loop (`Flow.hot_path`: a new token and a base
advance on the same trip, which no step takes together), so an upper bound on the
instructions.

The estimate (`estimate.state_step`, an H100): the longer of the bytes at its copy rate
and the instructions at its issue rate, times the share of the memory's latency the
bytes in flight cover: a lane's most global-load bytes outstanding at once
(`model.most_in_flight` over the path's code in address order: the state's loads issued
before their first use), times the block's threads and the blocks an SM holds (by
registers and shared memory), against what `LATENCY_S` at the SM's share of the copy
rate needs. It leaves out the marks launch (a thread per sequence) and the plan's
reads (a few words a block): an upper bound, not a measurement.
"""
from __future__ import annotations

from . import estimate, model
from .flow import Flow
from .loops import COUNTED, Figures, fallback_note, main_loop, other_loops

#: bytes of each of the token's inputs and of its output (bfloat16)
INPUT_BYTES = 2
#: bytes of each value of the log row and of the state (float32)
STATE_BYTES = 4
#: heads sharing an ssd group's B and C (Nemotron-H 8B: 128 heads, 8 groups)
HEADS_PER_GROUP = 16
WARP = 32
#: the chunked prefill the estimate takes: sequences of this many tokens each, on
#: `estimate.STATE_HEADS` heads (Qwen3-Next's 32 value heads of 128 x 128)
PREFILL_SEQUENCES, PREFILL_TOKENS = 8, 4096
#: float32 operations a warp instruction does: an HMMA m16n8k16 (16 x 8 x 16
#: multiply-adds), a lane's fused multiply-add, add or multiply
HMMA_FLOPS = 2 * 16 * 8 * 16
LANE_FLOPS = {"FFMA": 2 * WARP, "FADD": WARP, "FMUL": WARP, "HFMA2": 4 * WARP,
              "HADD2": 2 * WARP, "HMUL2": 2 * WARP}


def is_barrier(ins) -> bool:
    return ins.base == "BAR"


def delta_rule_bytes(dk: int, dv: int, per_channel: bool) -> int:
    """Bytes a decode token of one head must move (module doc)."""
    gate = dk if per_channel else 1
    return (2 * dk * dv * STATE_BYTES                            # the state, read and written
            + INPUT_BYTES * (2 * dk + dv + gate + 1 + dv)        # q, k, v, gate, beta; out
            + STATE_BYTES * (dk + dv + gate + 1))                # the log row


def ssd_bytes(d_state: int, head_dim: int) -> float:
    """Bytes an ssd decode token of one head must move (module doc)."""
    return (2 * d_state * head_dim * STATE_BYTES                 # the state, read and written
            + INPUT_BYTES * (head_dim + 1 + 2 * d_state / HEADS_PER_GROUP + head_dim)
            + STATE_BYTES * 3                                    # A, D, dt_bias
            + STATE_BYTES * (head_dim + d_state + 1))            # the log row


def delta_rule_figures(flow: Flow, arguments: dict) -> Figures:
    """The delta rule's decode step (`recurrence_figures`)."""
    dk, dv = arguments["dk"], arguments["dv"]
    return recurrence_figures(flow, arguments, dk, dv,
                              delta_rule_bytes(dk, dv, arguments["per_channel"]))


def ssd_figures(flow: Flow, arguments: dict) -> Figures:
    """The ssd's decode step (`recurrence_figures`): `Dk = d_state` rows, `Dv =
    head_dim` columns."""
    d_state, head_dim = arguments["d_state"], arguments["head_dim"]
    return recurrence_figures(flow, arguments, d_state, head_dim, ssd_bytes(d_state, head_dim))


def recurrence_figures(flow: Flow, arguments: dict, dk: int, dv: int, moved: float) -> Figures:
    """The decode step's estimated fraction of an H100's HBM bandwidth (module doc),
    `h100_hbm_percent`, and the warp instructions a (sequence, head) issues,
    `instructions_per_head`, for heads of `dk` rows and `dv` columns moving `moved`
    bytes."""
    from kvnumba.kernels.state import recurrence

    parts = recurrence.lanes_per_column(dk, dv)
    threads = recurrence.block_threads(dv, parts)
    loop = main_loop(flow, is_barrier, "the block's barriers (BAR)")
    span, trip = flow.through(loop), flow.hot_path(loop)
    per_warp = span.longest + trip.longest
    per_head = threads // WARP * per_warp
    step = estimate.state_step(moved, per_head)
    inside = set(map(id, loop.instructions))
    code = [ins for ins in flow.executed if id(ins) not in inside] + list(loop.instructions)
    lane_bytes = model.most_in_flight(sorted(code, key=lambda ins: ins.address))
    blocks = estimate.blocks_per_sm(max(1, arguments.get("shared", 1)),
                                    arguments.get("registers", estimate.MAX_REGISTERS), threads)
    cover = estimate.in_flight(lane_bytes * threads, blocks, estimate.H100_REACHED_BYTES_PER_S)
    notes = [f"position loop at {loop.header:#x}: a trip {trip.shortest} to {trip.longest} "
             f"instructions; the path through the rest {span.shortest} to {span.longest}: "
             f"{per_warp} a warp, {threads // WARP} warps ({parts} lanes a column): "
             f"{per_head} warp instructions a (sequence, head)",
             f"H100 estimate ({estimate.SEQUENCES} sequences x {estimate.STATE_HEADS} heads "
             f"of {dk} x {dv}, one token each, {moved:.0f} bytes a head): bytes "
             f"{1e6 * step.bytes_s:.0f} us, issue {1e6 * step.issue_s:.0f} us: "
             f"{100 * step.hbm_fraction:.1f}% of HBM bandwidth; {lane_bytes} bytes in flight "
             f"a lane, {blocks} block(s) an SM keep {cover:.1f}x the bytes in flight the "
             f"latency needs",
             *other_loops(flow, [loop], is_barrier, "BAR", ", each taken once"),
             *fallback_note(flow)]
    return Figures({"instructions_per_head": per_head,
                    "h100_hbm_percent": 100.0 * min(1.0, cover) * step.hbm_fraction}, notes)


def chunked_bytes(dk: int, dv: int, chunk: int, bv: int, per_channel: bool = False) -> float:
    """Bytes a chunked kernel moves a token of one head: q and k read by each of the
    head's `Dv / bv` blocks, v, the gate and beta read, the output written (bfloat16),
    the log row written (float32), and a share of the state's float32 columns (read
    twice and written once a chunk by each block). A gate per key channel is `Dk`
    values, read by each block and logged once."""
    blocks = dv // bv
    gate_read, gate_logged = (dk * blocks, dk) if per_channel else (1, 1)
    return (INPUT_BYTES * (2 * dk * blocks + dv + gate_read + 1 + dv)
            + STATE_BYTES * (dk + dv + gate_logged + 1) + 3 * dk * dv * STATE_BYTES / chunk)


def _trips(loop, loops, declared) -> int:
    """The trips of `loop` (one of `loops`) that a chunked kernel's `loop_trips` declares:
    a count, or `(opcode, n)`: `n` of that instruction in all, over those a trip of its
    own (outside the loops inside it) holds, as LLVM unrolled it."""
    if isinstance(declared, int):
        return declared
    opcode, n = declared
    inside = {id(ins) for other in loops if other.blocks < loop.blocks
              for ins in other.instructions}
    per_trip = sum(1 for ins in loop.instructions
                   if ins.base == opcode and id(ins) not in inside)
    if not per_trip:
        raise ValueError(f"the loop at {loop.header:#x} holds no {opcode}: the kernel's "
                         f"loops changed")
    return -(-n // per_trip)


def chunked_figures(flow: Flow, arguments: dict, op: str) -> Figures:
    """The chunked prefill's figures (`chunk_figures`), a gate a head (`chunked`), for
    the op of module `op` (its `CHUNK_ENTRY`)."""
    import importlib

    from kvnumba.kernels.state import chunked
    entry = importlib.import_module(op).CHUNK_ENTRY

    dk, dv, chunk = arguments["dk"], arguments["dv"], arguments["chunk"]
    return chunk_figures(flow, arguments, chunked, chunk,
                         chunked.loop_trips(dk, dv, chunk, entry), False)


def chunked_channel_figures(flow: Flow, arguments: dict) -> Figures:
    """The chunked prefill's figures (`chunk_figures`), the delta rule's gate per key
    channel (`chunked_channel`, its own chunk)."""
    from kvnumba.kernels.state import chunked_channel as kernels

    dk, dv = arguments["dk"], arguments["dv"]
    return chunk_figures(flow, arguments, kernels, kernels.CHUNK, kernels.loop_trips(dk, dv),
                         True)


def chunk_figures(flow: Flow, arguments: dict, kernels, chunk: int, declared: tuple,
                  per_channel: bool) -> Figures:
    """A chunked prefill's share of its floating-point work on the tensor cores,
    `hmma_flop_percent`, and its estimated rate on an H100, `h100_tflops`: the kernel of
    module `kernels` (its `value_block`, `WARPS`, `THREADS`) over chunks of `chunk`
    tokens, the trips of its loops inside a chunk `declared` (its `loop_trips`).

    A chunk is a trip of the loop holding the block's barriers; each loop inside it is
    weighted by its trips (`declared`, matched in address order). The share
    counts each instruction at its loop's trips: an HMMA `HMMA_FLOPS`, a CUDA-core float
    instruction `LANE_FLOPS`. The warp instructions of a chunk: its longest path with
    each inner loop's longest trip taken its trips (an upper bound, every warp as the
    busiest). The estimate: `PREFILL_SEQUENCES` sequences of `PREFILL_TOKENS` tokens on
    `estimate.STATE_HEADS` heads, the longest of the instructions at one a scheduler a
    clock, the HMMAs at `estimate.HMMA_CLOCKS` each and the bytes (`chunked_bytes`) at
    the H100's copy rate; its rate is the recurrence's work, `6 Dk Dv` floating-point
    operations a token and head (`S^T k`, the update, `S^T q`), over that time. Latency,
    barriers and the last wave are left out: an estimate, not a measurement. Loops other
    than those `declared` are each counted once, and the estimate is 0 (its budget
    fails, saying so)."""
    dk, dv = arguments["dk"], arguments["dv"]
    bv = kernels.value_block(dv)
    loop = main_loop(flow, is_barrier, "the block's barriers (BAR)")
    inner = sorted((other for other in flow.loops
                    if other is not loop and other.blocks < loop.blocks),
                   key=lambda other: other.header)
    known = len(inner) == len(declared)
    trips = ([_trips(other, inner, n) for other, n in zip(inner, declared)] if known
             else [1] * len(inner))
    weight = {id(ins): 1 for ins in loop.instructions}
    for other, n in zip(inner, trips):
        for ins in other.instructions:
            weight[id(ins)] *= n
    trips_of = {other.header: n for other, n in zip(inner, trips)}

    def issued(outer, n: int) -> int:
        """At most the instructions of `n` trips of `outer`: its longest trip, each loop
        directly inside it counted at its own trips in place of one."""
        children = [o for o in inner if o.blocks < outer.blocks and not any(
            o.blocks < c.blocks < outer.blocks for c in inner)]
        return n * (flow.hot_path(outer).longest + sum(
            issued(c, trips_of[c.header]) - flow.hot_path(c).longest for c in children))
    is_hmma = COUNTED["HMMA"]
    hmma = sum(weight[id(ins)] for ins in loop.instructions if is_hmma(ins))
    lane_flops = sum(weight[id(ins)] * LANE_FLOPS.get(ins.base, 0)
                     for ins in loop.instructions)
    tensor_flops = hmma * HMMA_FLOPS
    share = tensor_flops / max(1, tensor_flops + lane_flops)
    per_warp = issued(loop, 1)
    heads, tokens = estimate.STATE_HEADS, PREFILL_SEQUENCES * PREFILL_TOKENS
    chunks = PREFILL_SEQUENCES * heads * (dv // bv) * -(-PREFILL_TOKENS // chunk)
    issue_rate = estimate.SMS * estimate.SCHEDULERS * estimate.CLOCK_HZ
    issue_s = chunks * kernels.WARPS * per_warp / issue_rate
    hmma_s = chunks * hmma * estimate.HMMA_CLOCKS / issue_rate
    moved = tokens * heads * chunked_bytes(dk, dv, chunk, bv, per_channel)
    bytes_s = moved / estimate.H100_REACHED_BYTES_PER_S
    seconds = max(issue_s, hmma_s, bytes_s)
    work = 6.0 * dk * dv * tokens * heads
    rate = work / seconds / 1e12 if known else 0.0
    blocks = estimate.blocks_per_sm(max(1, arguments.get("shared", 1)),
                                    arguments.get("registers", estimate.MAX_REGISTERS),
                                    kernels.THREADS)
    notes = [f"chunk loop at {loop.header:#x}: {len(loop.instructions)} instructions, "
             f"{loop.count(is_hmma)} HMMA; inner loops (header, instructions, trips): "
             + ", ".join(f"{o.header:#x} ({len(o.instructions)}, {n})"
                         for o, n in zip(inner, trips)),
             f"a chunk of {chunk} tokens, {bv} value columns, a warp: at most {per_warp} "
             f"instructions, {hmma} HMMA; {100 * share:.1f}% of the floating-point work "
             f"on HMMA",
             f"H100 estimate ({PREFILL_SEQUENCES} sequences x {PREFILL_TOKENS} tokens x "
             f"{heads} heads of {dk} x {dv}, {blocks} block(s) an SM): issue "
             f"{1e3 * issue_s:.2f} ms, HMMA {1e3 * hmma_s:.2f} ms, bytes {1e3 * bytes_s:.2f} "
             f"ms: {work / seconds / 1e12:.1f} TFLOP/s of the recurrence's 6 Dk Dv a token",
             *fallback_note(flow)]
    if not known:
        notes.append(f"{len(inner)} loops inside the chunk loop, {len(declared)} in "
                     f"{kernels.__name__}.loop_trips: the kernel's loops changed, each "
                     f"counted once "
                     f"and no estimate (0 TFLOP/s) until loop_trips says their trips")
    return Figures({"hmma_flop_percent": 100.0 * share, "h100_tflops": rate}, notes)
