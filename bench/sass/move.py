"""The figures of the data-moving kernels' SASS (`bench.sass.figures` dispatches to
them): instructions per 16-byte vector for the write of a token's K and V rows and
for the copy of a run of a whole page's K and V rows.

A run is what one block row moves at once: a token's K row and V row (write), a run of
K rows and the same V rows of one layer (copy; the figures take runs of a whole page,
the runs its lanes are sized for). Its `R` vectors per row (or page) are spread over
`lanes` lanes as the host launches them (`write.vector_lanes`), each lane moving
`T` vectors of each a trip of the vector loop (T: the loop's LDG.E.128 over 2) and
running, once per run, every instruction from the kernel's entry to its exit on its
way through that loop (P: a path with every other loop taken once, the vector loop's
trips counted apart), since a launch gives each lane one run (the grid holds every
run of a step up to `MAX_BLOCKS` blocks). So a run's lanes issue `lanes * (P + B *
ceil(R / (lanes * T)))` instructions between them for its `2 R` vectors, B the vector
loop's body:

    instructions per vector = lanes * (P + B * ceil(R / (lanes * T))) / (2 R)

P is taken on the shortest path (write: a flat layer, whose row is the position) and
on the longest (write: a ring layer, whose row takes a 32-bit modulo; copy: every
block on the way).
"""
from __future__ import annotations

import math

from .flow import Flow, Loop
from .loops import Figures, fallback_note, is_wide_load, main_loop, other_loops

VECTOR_BYTES = 16
#: token rows the figures are given for: (name, bytes): 8 kv heads x head_dim 128 and
#: 1 kv head x head_dim 128, float16
ROWS = (("2kb", 8 * 128 * 2), ("256b", 1 * 128 * 2))


def per_vector(flow: Flow, run_vectors: int) -> tuple[dict, list[str], Loop]:
    """`({"shortest": figure, "longest": figure}, notes, vector loop)` for runs of
    `run_vectors` vectors of K and as many of V, by the formula of the module doc."""
    from kvnumba.kernels.moves import write

    loop = main_loop(flow, is_wide_load, "the 16-byte loads (LDG.E.128)")
    body, loads = len(loop.instructions), loop.count(is_wide_load)
    per_row = loads // 2                          # vectors of K (or V) a lane moves a trip
    lanes, _ = write.vector_lanes(run_vectors)
    trips = math.ceil(run_vectors / (lanes * per_row))
    span = flow.through(loop)
    figures = {which: lanes * (path + body * trips) / (2 * run_vectors)
               for which, path in (("shortest", span.shortest), ("longest", span.longest))}
    notes = [f"runs of {run_vectors} vectors of K and as many of V: {lanes} lanes, {trips} "
             f"trip(s) of B = {body} instructions ({loads} LDG.E.128) each, P = "
             f"{span.shortest} to {span.longest} instructions on the way"]
    return figures, notes, loop


def write_figures(flow: Flow, arguments: dict) -> Figures:
    """Instructions per vector of a token's K and V rows of each size in ROWS, on a flat
    layer (P the shortest path) and on a ring (the longest)."""
    values, notes = {}, []
    for name, row_bytes in ROWS:
        figures, said, loop = per_vector(flow, row_bytes // VECTOR_BYTES)
        values[f"instructions_per_vector_{name}_flat"] = figures["shortest"]
        values[f"instructions_per_vector_{name}_ring"] = figures["longest"]
        notes += said
    notes += [*other_loops(flow, [loop], is_wide_load, "LDG.E.128"), *fallback_note(flow)]
    return Figures(values, notes)


def narrow_figures(flow: Flow, arguments: dict) -> Figures:
    """Instructions per 16-byte vector read of the write into 8-bit float storage
    (`write_fp8`), for token rows of each size in ROWS read as 16-bit input: a lane
    narrows one stored vector of K and one of V a trip (the loop's loads: 2 of 16 bytes
    each per stored vector), so a run of `R` input vectors per row is `R / 2` stored
    ones over `lanes` lanes as the host launches them (`write_fp8.lanes_for`), `T` of
    each a lane and trip; the formula of the module doc with `2 R` the input vectors of
    K and V."""
    from kvnumba.kernels.moves import write_fp8

    loop = main_loop(flow, is_wide_load, "the 16-byte loads (LDG.E.128)")
    body, loads = len(loop.instructions), loop.count(is_wide_load)
    span = flow.through(loop)
    values, notes = {}, []
    for name, row_bytes in ROWS:
        read = row_bytes // VECTOR_BYTES                   # input vectors of a row
        stored = row_bytes // 2 // write_fp8.VALUES        # its stored vectors
        source = arguments["source"]
        lanes, _ = write_fp8.lanes_for(stored, source)
        trips = math.ceil(stored / (lanes * write_fp8.trip_vectors(source)))
        for which, path in (("flat", span.shortest), ("ring", span.longest)):
            values[f"instructions_per_vector_{name}_{which}"] = \
                lanes * (path + body * trips) / (2 * read)
        notes.append(f"rows of {read} input vectors of K and as many of V ({stored} stored): "
                     f"{lanes} lanes, {trips} trip(s) of B = {body} instructions ({loads} "
                     f"LDG.E.128) each, P = {span.shortest} to {span.longest} on the way")
    notes += [*other_loops(flow, [loop], is_wide_load, "LDG.E.128"), *fallback_note(flow)]
    return Figures(values, notes)


def copy_figures(flow: Flow, arguments: dict) -> Figures:
    """Instructions per vector of a whole page's run of K and V rows, pages of the
    default page size holding token rows of each size in ROWS (P the longest path)."""
    from kvnumba.arith.pages import DEFAULT_PAGE_SIZE

    values, notes = {}, []
    for name, row_bytes in ROWS:
        figures, said, loop = per_vector(flow, DEFAULT_PAGE_SIZE * row_bytes // VECTOR_BYTES)
        values[f"instructions_per_vector_{name}"] = figures["longest"]
        notes += said
    notes += [*other_loops(flow, [loop], is_wide_load, "LDG.E.128"), *fallback_note(flow)]
    return Figures(values, notes)
