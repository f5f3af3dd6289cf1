"""The figures `python -m bench.sass` reports for one compiled kernel, from its
`ptxas -v` lines and its SASS (see `bench.sassmodel`).

Every kernel: registers and the cap its launch bounds give, spills, stack (local
memory), static shared memory, counts of the instructions that matter to the fast
kernels, float64 instructions and 64-bit integer division call sites. A kernel of
a known kind adds the figure its budget is about (`KINDS`, keyed by
`module:function`):

* decode: SASS instructions per key per kv head on a 4097-key segment, fixed
  per-chunk work included (`decode_figures`);
* prefill: HMMA share of the main loop, and instructions per cp.async in the
  address computation of the loop's LDGSTS (`prefill_figures`);
* write / copy: instructions per 16-byte vector of the grid-stride loop;
* combine: dependent global round trips for 129 parts, from the module's model and
  from the SASS (`combine_figures`).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import sassmodel as model
from .sassmodel import Flow, Instruction

#: report column -> predicate on a SASS instruction
COUNTED: dict[str, Callable[[Instruction], bool]] = {
    "LDG.E.128": lambda ins: ins.base == "LDG" and ".128" in ins.opcode,
    "STG.E.128": lambda ins: ins.base == "STG" and ".128" in ins.opcode,
    "LDGSTS": lambda ins: ins.base == "LDGSTS",
    "LDSM": lambda ins: ins.base == "LDSM",
    "HMMA": lambda ins: ins.base == "HMMA",
    "SHFL": lambda ins: ins.base == "SHFL",
    "local_accesses": lambda ins: ins.base in ("LDL", "STL"),
    "float64": model.is_float64,
    "div64_calls": model.is_div64_call,
}
#: registers of one SM's register file, the most one thread may hold, and the
#: allocation granule per thread
REGISTER_FILE = 65536
MAX_REGISTERS = 255
REGISTER_GRANULE = 8
#: the decode model's segment: 4096 keys of history and one query (4097 keys)
DECODE_HISTORY = 4096
#: the combine model's segment: the 129 chunks of a 32K-key segment
COMBINE_PARTS = 129

is_wide_load = COUNTED["LDG.E.128"]


@dataclass
class Figures:
    """What a kernel is measured as: `values` (figure name -> number, the names
    budgets use) and `notes` (how a model figure was made)."""

    values: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)


def register_cap(bounds) -> int:
    """Registers a thread may use under launch bounds (threads, min blocks per SM):
    the register file over threads * blocks, rounded down to the allocation granule,
    at most 255; 255 without bounds."""
    if not bounds:
        return MAX_REGISTERS
    threads, blocks = (bounds, 1) if isinstance(bounds, int) else (bounds[0], (*bounds, 1)[1])
    fit = REGISTER_FILE // (threads * blocks) // REGISTER_GRANULE * REGISTER_GRANULE
    return min(MAX_REGISTERS, fit)


def common_figures(ptxas: dict, functions: list, bounds) -> Figures:
    """The figures of every kernel: `ptxas -v`'s and the instruction counts of all its
    SASS (the kernel and the subroutines it calls)."""
    code = model.all_instructions(functions)
    values = {"registers": ptxas["registers"], "register_cap": register_cap(bounds),
              "spill_bytes": ptxas["spill_stores"] + ptxas["spill_loads"],
              "stack_bytes": ptxas["stack"], "shared_bytes": ptxas["shared"]}
    values.update({name: sum(1 for ins in code if matches(ins))
                   for name, matches in COUNTED.items()})
    return Figures(values)


def _main_loop(flow: Flow, marks, what: str) -> model.Loop:
    loop = flow.main_loop(marks)
    if loop is None:
        raise ValueError(f"no loop holds {what}: the kernel's main loop is not in its SASS")
    return loop


def _other_loops(flow: Flow, main: model.Loop, marks, what: str, counted: str = "") -> list[str]:
    """A note listing the loops besides `main`: header address, instructions, and how
    many of them `marks` (`what`)."""
    others = [loop for loop in flow.loops if loop is not main]
    if not others:
        return []
    listed = ", ".join(f"{loop.header:#x} ({len(loop.instructions)}, {loop.count(marks)})"
                       for loop in others)
    return [f"other loops (header, instructions, {what}){counted}: {listed}"]


def _fallback_note(flow: Flow) -> list[str]:
    """A note on the divergent-warp fallbacks left out of the figures."""
    if not flow.fallback:
        return []
    return [f"{len(flow.fallback)} instructions of divergent-warp fallbacks (BRA.DIV), "
            f"which a converged warp never runs, are left out"]


def decode_figures(flow: Flow, arguments: dict) -> Figures:
    """Instructions per key per kv head on a one-segment step of DECODE_HISTORY + 1
    keys, the chunks as `decode.plan` cuts them: each chunk is one block of `WARPS`
    warps per kv head, each warp running the fixed work F (every executed
    instruction outside the main loop, once) and B per block trip of
    `WARPS * UNROLL * key_slots` keys: sum over chunks of WARPS * (F + B *
    ceil(len / keys per trip)), over the keys."""
    from kvnumba import plan as fields
    from kvnumba.kernels import decode, decode_shape
    planning = sys.modules[decode.plan.__module__]     # the work table's field constants

    itemsize = np.dtype(arguments["storage"]).itemsize
    keys_per_trip = decode_shape.WARPS * decode_shape.UNROLL * \
        decode_shape.Geometry.of(arguments["head_dim"], itemsize).key_slots
    loop = _main_loop(flow, is_wide_load, "the K/V loads (LDG.E.128)")
    body = len(loop.instructions)
    fixed = len(flow.executed) - body
    seq_info = np.zeros((1, fields.SEQ_INFO_FIELDS), np.int32)
    seq_info[0, [fields.Q_START, fields.Q_LEN, fields.COL, fields.POS_START, fields.FLAGS]] = \
        (0, 1, 0, DECODE_HISTORY, 0)
    work = decode.plan(seq_info, [0], window=0).work
    lengths = work[:, planning.WORK_KEY_HI] - work[:, planning.WORK_KEY_LO]
    warp_instructions = sum(decode_shape.WARPS * (fixed + body * math.ceil(n / keys_per_trip))
                            for n in lengths)
    keys = int(lengths.sum())
    notes = [f"main loop at {loop.header:#x}: B = {body} instructions per {keys_per_trip}-key "
             f"block trip ({body / keys_per_trip:.1f} per key), {loop.count(is_wide_load)} "
             f"LDG.E.128; fixed work F = {fixed} per warp per chunk",
             f"{keys} keys in {len(lengths)} chunks ({', '.join(map(str, sorted(set(lengths))))} "
             f"keys) of {decode_shape.WARPS} warps: {warp_instructions} warp instructions",
             *_other_loops(flow, loop, is_wide_load, "LDG.E.128",
                           ", their bodies counted once in F"),
             *_fallback_note(flow)]
    return Figures({"instructions_per_key": warp_instructions / keys}, notes)


def prefill_figures(flow: Flow, arguments: dict) -> Figures:
    """HMMA as a percentage of the main loop (the loop holding the HMMAs: one key
    tile per trip), and the instructions of that loop in the address computation
    of its cp.async (LDGSTS) per LDGSTS."""
    is_hmma, is_copy = COUNTED["HMMA"], COUNTED["LDGSTS"]
    loop = _main_loop(flow, is_hmma, "the HMMAs")
    body = len(loop.instructions)
    copies = loop.count(is_copy)
    addressing = model.address_slice(loop.instructions, is_copy)
    values = {"hmma_percent": 100.0 * loop.count(is_hmma) / body,
              "instructions_per_cp_async": len(addressing) / copies if copies else 0.0}
    notes = [f"main loop at {loop.header:#x}: {body} instructions per key tile, "
             f"{loop.count(is_hmma)} HMMA, {loop.count(COUNTED['LDSM'])} LDSM, {copies} "
             f"LDGSTS whose addresses take {len(addressing)} of them",
             *_other_loops(flow, loop, is_hmma, "HMMA"), *_fallback_note(flow)]
    return Figures(values, notes)


def stride_figures(flow: Flow, arguments: dict) -> Figures:
    """Instructions per 16-byte vector: the instructions of the grid-stride loop
    over its LDG.E.128 (of the innermost loop holding them, when the loop over a
    token's vectors is nested in one over tokens)."""
    loop = _main_loop(flow, is_wide_load, "the 16-byte loads (LDG.E.128)")
    body, loads = len(loop.instructions), loop.count(is_wide_load)
    calls = loop.count(model.is_div64_call)
    notes = [f"vector loop at {loop.header:#x}: {body} instructions, {loads} LDG.E.128"
             + (f", {calls} calls of 64-bit division" if calls else ""),
             *_other_loops(flow, loop, is_wide_load, "LDG.E.128"), *_fallback_note(flow)]
    return Figures({"instructions_per_vector": body / loads}, notes)


def combine_figures(flow: Flow, arguments: dict) -> Figures:
    """Dependent global round trips a thread waits on for COMBINE_PARTS parts: the
    module's `round_trips`, and the same from the SASS: the chain of dependent
    loads before the accumulator loop (the tables), plus, per loop trip, the chain
    in the loop body, times the trips (`PART_GROUPS` threads over parts, each
    taking one part per LDG.E.128 of a trip)."""
    from kvnumba.kernels import combine

    loop = _main_loop(flow, is_wide_load, "the accumulator loads (LDG.E.128)")
    acc_loads = loop.count(is_wide_load)
    loads = loop.count(model.is_global_load)
    per_trip = model.load_depth(loop.instructions)
    tables = model.load_depth([ins for ins in flow.executed if ins.address < loop.header])
    trips = math.ceil(COMBINE_PARTS / (combine.PART_GROUPS * acc_loads))
    notes = [f"accumulator loop at {loop.header:#x}: {acc_loads} LDG.E.128 + "
             f"{loads - acc_loads} other LDG per trip (the module says "
             f"{combine.ACC_LOADS_PER_TRIP} + {combine.ML_LOADS_PER_TRIP}), {per_trip} "
             f"dependent round trip(s) per trip, {trips} trips for {COMBINE_PARTS} parts; "
             f"{tables} dependent round trip(s) before the loop",
             *_other_loops(flow, loop, is_wide_load, "LDG.E.128"), *_fallback_note(flow)]
    return Figures({"round_trips": combine.round_trips(COMBINE_PARTS),
                    "round_trips_sass": tables + trips * per_trip}, notes)


#: `module:function` (a kernel, or the factory that makes it) -> its model figures
KINDS = {
    "kvnumba.kernels.decode_kernel:decode_kernel": decode_figures,
    "kvnumba.kernels.prefill_kernel:prefill_kernel": prefill_figures,
    "kvnumba.kernels.write:_write_vectors": stride_figures,
    "kvnumba.kernels.copy:_copy_vectors": stride_figures,
    "kvnumba.kernels.combine:_combine_kernel": combine_figures,
}


def kernel_figures(name: str, ptxas: dict, sass: str, bounds, arguments: dict) -> Figures:
    """All figures of kernel `name` (`module:function`, without factory arguments):
    the common ones, and its kind's (`KINDS`) from the factory's `arguments`."""
    functions = model.parse(sass)
    figures = common_figures(ptxas, functions, bounds)
    kind = KINDS.get(name)
    if kind is not None:
        extra = kind(Flow(functions[0]), arguments)
        figures.values.update(extra.values)
        figures.notes += extra.notes
    return figures
