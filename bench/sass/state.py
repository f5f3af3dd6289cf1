"""The figures of the state layers' kernels' SASS (`bench.sass.figures` dispatches to
them): the delta rule's and the ssd's decode step as a fraction of an H100's memory
bandwidth.

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
from .loops import Figures, fallback_note, main_loop, other_loops

#: bytes of each of the token's inputs and of its output (bfloat16)
INPUT_BYTES = 2
#: bytes of each value of the log row and of the state (float32)
STATE_BYTES = 4
#: heads sharing an ssd group's B and C (Nemotron-H 8B: 128 heads, 8 groups)
HEADS_PER_GROUP = 16
WARP = 32


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
