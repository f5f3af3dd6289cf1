"""The figures `python -m kvnumba.bench.sass` reports for one compiled kernel, from its
`ptxas -v` lines and its SASS (`bench.sass.model`, `bench.sass.flow`).

Every kernel: registers and the cap its launch bounds give, spills, stack (local
memory), static shared memory, counts of the instructions that matter to the fast
kernels (`sassloops.COUNTED`), float64 instructions and 64-bit integer division call
sites. A kernel of a known kind adds the figures its budgets are about (`KINDS`,
keyed by `module:function`):

* decode: SASS instructions per key per kv head on a 4097-key segment, per-chunk work
  included, the main loop's rarely taken blocks once per chunk
  (`sassattention.decode_figures`);
* prefill: HMMA share of the unmasked and of the masked key-tile loop, and
  instructions per cp.async in the address computation of the main loop's LDGSTS
  (`sassattention.prefill_figures`);
* combine: round trips to global memory a thread waits on for 129 parts, from the
  SASS (`sassattention.combine_figures`);
* write / copy: instructions per 16-byte vector of a run, everything a lane runs for
  it included, at two token row sizes (`sassmove`);
* delta rule, ssd: warp instructions a (sequence, head) issues for a decode token and
  the step's estimated fraction of an H100's HBM bandwidth; the delta rule's chunked
  prefill's share of floating-point work on HMMA and estimated TFLOP/s on an H100
  (`sassstate`).
"""
from __future__ import annotations

from functools import partial

from . import attention as sassattention, model, move as sassmove, state as sassstate
from .estimate import MAX_REGISTERS, REGISTER_FILE, REGISTER_GRANULE
from .flow import Flow
from .loops import COUNTED, Figures



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


#: `module:function` (a kernel, or the factory that makes it) -> its kind's figures
KINDS = {
    "kvnumba.kernels.decode.kernel:decode_kernel": sassattention.decode_figures,
    "kvnumba.kernels.prefill.kernel:prefill_kernel": sassattention.prefill_figures,
    "kvnumba.kernels.decode.combine:_combine_kernel": sassattention.combine_figures,
    "kvnumba.kernels.moves.write:_write_vectors": sassmove.write_figures,
    "kvnumba.kernels.moves.page_copy:_copy_vectors": sassmove.copy_figures,
    "kvnumba.kernels.moves.write_fp8:narrow_kernel": sassmove.narrow_figures,
    "kvnumba.kernels.state.delta_rule:_kernel": sassstate.delta_rule_figures,
    "kvnumba.kernels.state.ssd:_kernel": sassstate.ssd_figures,
    "kvnumba.kernels.state.delta_rule:chunked_kernel":
        partial(sassstate.chunked_figures, op="kvnumba.kernels.state.delta_rule"),
    "kvnumba.kernels.state.ssd:chunked_kernel":
        partial(sassstate.chunked_figures, op="kvnumba.kernels.state.ssd"),
    "kvnumba.kernels.state.chunked_channel:kernel": sassstate.chunked_channel_figures,
}


def kernel_figures(name: str, ptxas: dict, sass: str, bounds, arguments: dict) -> Figures:
    """All figures of kernel `name` (`module:function`, without factory arguments):
    the common ones, and its kind's (`KINDS`) from the factory's `arguments` and the
    kernel's registers a thread (`registers`)."""
    functions = model.parse(sass)
    figures = common_figures(ptxas, functions, bounds)
    kind = KINDS.get(name)
    if kind is not None:
        extra = kind(Flow(functions[0]), {**arguments, "registers": ptxas["registers"],
                                           "shared": ptxas["shared"]})
        figures.values.update(extra.values)
        figures.notes += extra.notes
    return figures
