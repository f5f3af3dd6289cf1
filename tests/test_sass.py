"""`python -m kvnumba.bench.sass`: SASS parsing, control flow and paths, data flow (slices and
round trips to memory), budgets, specialisations and tool finding. The SASS snippets
are written in nvdisasm's format, as it prints the kvnumba kernels and a probe of `//`
and `%` on int64 (the kinds' figures: test_sass_figures.py; the budgets against
regressed kernels: test_sass_budgets.py)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvnumba.bench.sass import report as sass, budget as sassbudget, figures as sassfigures
from kvnumba.bench.sass.flow import Flow
from kvnumba.bench.sass.loops import is_wide_load
from kvnumba.bench.sass.model import (Instruction, address_slice, all_instructions,
                                      backward_slice, is_div64_call, is_float64, parse,
                                      round_trips)
from sasstext import TOKEN_LOOP, code, listing, sass_text

ROOT = Path(__file__).resolve().parents[1]

PTXAS_V = """\
ptxas info    : 8 bytes gmem
ptxas info    : Compiling entry function '_ZN6kernelE' for 'sm_90a'
ptxas info    : Function properties for _ZN6kernelE
    48 bytes stack frame, 24 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 33792 bytes smem, 400 bytes cmem[0]
ptxas info    : Compile time = 28.019 ms
"""


COUNTED = sass_text("""\
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*00d0*/                   LDGSTS.E.BYPASS.128 [R23], desc[UR4][R20.64] ;
        /*00f0*/                   LDG.E.128.CONSTANT R12, desc[UR4][R20.64] ;
        /*0100*/              @!P0 LDG.E.128 R8, desc[UR4][R2.64] ;
        /*0110*/                   LDG.E.64 R2, desc[UR4][R20.64] ;
        /*0150*/                   LDSM.16.M88.4 R4, [R23] ;
        /*0160*/               @P1 LDSM.16.MT88.4 R8, [R23] ;
        /*0180*/                   SHFL.BFLY PT, R19, R14, 0x2, 0x1f ;
        /*01e0*/                   SHFL.IDX PT, R16, R22, 0x3, 0x1f ;
        /*0210*/                   HMMA.16816.F32 R16, R4, R8, R16 ;
        /*0240*/                   HMMA.16816.F32.BF16 R4, R4, R10, R16 ;
        /*0250*/                   STL [R1], R4 ;
        /*0260*/                   LDL R4, [R1] ;
        /*0270*/                   DFMA R4, R4, R6, R8 ;
        /*0280*/                   DEPBAR.LE SB0, 0x0 ;
        /*0290*/                   CALL.REL.NOINC `($__internal_0_$__cuda_sm20_div_s64) ;
        /*02f0*/                   STG.E.128 desc[UR4][R14.64], R8 ;
        /*0300*/                   STG.E desc[UR4][R16.64], R4 ;
        /*0310*/                   EXIT ;
$__internal_0_$__cuda_sm20_div_s64:
        /*0320*/                   I2F.U64.RP R18, R28 ;
        /*0330*/                   RET.REL.NODEC R10 `(_ZN6kernelE) ;
""")


def test_ptxas_figures_are_read_from_its_verbose_output():
    assert sass.parse_ptxas(PTXAS_V) == {"registers": 168, "spill_stores": 24,
                                         "spill_loads": 16, "stack": 48, "shared": 33792}


def test_every_kernel_gets_counts_by_kind_and_the_cap_of_its_launch_bounds():
    figures = sassfigures.common_figures(sass.parse_ptxas(PTXAS_V), parse(COUNTED), (128, 3))
    assert figures.values == {
        "registers": 168, "register_cap": 168, "spill_bytes": 40, "stack_bytes": 48,
        "shared_bytes": 33792, "LDG.E.128": 2, "STG.E.128": 1, "LDGSTS": 1, "LDSM": 2,
        "HMMA": 2, "SHFL": 2, "local_accesses": 2, "float64": 1, "div64_calls": 1}


@pytest.mark.parametrize("bounds, cap", [(None, 255), ((128, 3), 168), ((256, 1), 255),
                                         (128, 255), ((256, 2), 128), ((96, 5), 136)])
def test_register_cap_is_the_register_file_over_the_resident_threads(bounds, cap):
    assert sassfigures.register_cap(bounds) == cap


def test_functions_and_labels_are_split_where_nvdisasm_starts_them():
    kernel, division = parse(COUNTED)
    assert (kernel.name, len(kernel.instructions)) == ("_ZN6kernelE", 19)
    assert (division.name, len(division.instructions)) == ("$__internal_0_$__cuda_sm20_div_s64", 2)
    assert len(all_instructions([kernel, division])) == 21


@pytest.mark.parametrize("opcode, operands, writes, reads", [
    ("IMAD.WIDE", "R4, R3, 0x100, R12", {"R4", "R5"}, {"R3", "R12", "R13"}),
    ("IADD3", "R7, P2, R7, UR4, RZ", {"R7", "P2"}, {"R7", "UR4"}),
    ("IADD3.X", "R9, R10, UR21, RZ, P1, !PT", {"R9"}, {"R10", "UR21", "P1"}),
    ("ISETP.GE.AND.EX", "P0, PT, R9, RZ, PT, P0", {"P0"}, {"R9", "P0"}),
    ("SHFL.BFLY", "PT, R19, R14.reuse, 0x2, 0x1f", {"R19"}, {"R14"}),
    ("LDG.E.128.CONSTANT", "R8, desc[UR12][R22.64+0x10]", {"R8", "R9", "R10", "R11"},
     {"UR12", "R22", "R23"}),
    ("STG.E.128", "desc[UR12][R18.64], R8", set(), {"UR12", "R18", "R19", "R8", "R9", "R10",
                                                    "R11"}),
    ("HMMA.16816.F32", "R16, R4, R8, R16", {"R16", "R17", "R18", "R19"},
     {"R4", "R5", "R6", "R7", "R8", "R9", "R16", "R17", "R18", "R19"}),
    ("LDSM.16.MT88.4", "R8, [R23+0x1100]", {"R8", "R9", "R10", "R11"}, {"R23"}),
    ("S2R", "R0, SR_TID.X", {"R0"}, set()),
    ("R2P", "PR, R83, 0xc", {f"P{i}" for i in range(7)}, {"R83"}),
])
def test_registers_read_and_written(opcode, operands, writes, reads):
    ins = Instruction(0, opcode, operands, "P3")
    assert (set(ins.writes), set(ins.reads)) == (writes, reads)   # the guard is not a read


# --- control flow ---------------------------------------------------------------------------

LOOP_WITH_COLD_PATHS = sass_text("""\
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   MOV R2, RZ ;
.L_x_0:
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0030*/                   IADD3 R2, R2, 0x10, RZ ;
        /*0040*/                   BRA.DIV UR5, `(.L_x_2) ;
        /*0050*/                   SHFL.BFLY PT, R8, R4, 0x1, 0x1f ;
.L_x_3:
        /*0060*/                   ISETP.GE.AND P0, PT, R2, R0, PT ;
        /*0070*/               @P0 BRA `(.L_x_4) ;
.L_x_5:
        /*0080*/              @!P1 BRA `(.L_x_0) ;
        /*0090*/                   EXIT ;
.L_x_4:
        /*00a0*/                   FADD R8, R8, 1 ;
        /*00b0*/                   BRA `(.L_x_5) ;
.L_x_2:
        /*00c0*/                   WARPSYNC.ALL ;
        /*00d0*/                   SHFL.BFLY PT, R8, R4, 0x1, 0x1f ;
        /*00e0*/                   BRA `(.L_x_3) ;
.L_x_6:
        /*00f0*/                   BRA `(.L_x_6);
        /*0100*/                   NOP;
""")


def test_a_loop_is_a_branch_back_to_a_block_that_dominates_it():
    """The back edge 0x80 -> 0x20 makes the loop; the out-of-line block 0xa0 belongs to
    it, and its branch back to 0x80 makes no loop of its own (0x80 does not dominate
    it). The divergent-warp copy of the shuffle (BRA.DIV) is counted nowhere; the
    end-of-code self-branch and padding are not executed."""
    flow = Flow(parse(LOOP_WITH_COLD_PATHS)[0])
    (loop,) = flow.loops
    assert loop.header == 0x20
    assert [ins.address for ins in loop.instructions] == [0x20, 0x30, 0x40, 0x50, 0x60, 0x70,
                                                         0x80, 0xa0, 0xb0]
    assert [ins.address for ins in flow.fallback] == [0xc0, 0xd0, 0xe0]
    assert [ins.address for ins in flow.executed] == list(range(0, 0xc0, 0x10))
    assert loop.count(lambda ins: ins.base == "SHFL") == 1


NESTED = sass_text("""\
        /*0000*/                   MOV R2, RZ ;
.L_x_0:
        /*0010*/                   MOV R3, RZ ;
.L_x_1:
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0030*/                   IADD3 R3, R3, 0x1, RZ ;
        /*0040*/                   ISETP.GE.AND P0, PT, R3, 0x4, PT ;
        /*0050*/              @!P0 BRA `(.L_x_1) ;
        /*0060*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0070*/                   ISETP.GE.AND P1, PT, R2, 0x4, PT ;
        /*0080*/              @!P1 BRA `(.L_x_0) ;
        /*0090*/                   EXIT ;
""")


def test_the_main_loop_is_the_innermost_of_the_loops_holding_the_marked_instructions():
    flow = Flow(parse(NESTED)[0])
    assert [(loop.header, len(loop.instructions)) for loop in flow.loops] == [(0x10, 8), (0x20, 4)]
    assert flow.main_loop(is_wide_load).header == 0x20
    assert flow.main_loop(lambda ins: ins.base == "HMMA") is None


#: `TOKEN_LOOP`, and a block after its exit that no path reaches
TOKEN_LISTING = listing(*TOKEN_LOOP, ".L_x_4:", "BRA `(.L_x_4)")


def test_a_path_through_a_loop_takes_every_other_loop_once_and_skips_what_it_may():
    """Entry 3, token header 3, ring test 2, (ring row 3,) 1 before the vector loop;
    after it the token latch 3 and EXIT 1: 13 instructions, 16 through the ring's row.
    The vector loop's own 7 are counted apart; the skip of a token (which bypasses the
    vector loop) and the early EXIT are no way through it."""
    flow = Flow(parse(TOKEN_LISTING)[0])
    outer, inner = flow.loops
    assert (outer.header, inner.header) == (0x30, 0xc0)
    assert len(inner.instructions) == 7
    assert flow.through(inner) == (13, 16)
    assert flow.through(outer) == (4, 4)          # entry to header 3, then the EXIT 1


def test_a_trips_hot_path_leaves_out_the_blocks_it_may_skip():
    """The token loop's trip: 3 + 2 + 1 + 7 + 3 = 16 on a flat layer, 3 + 2 + 3 + 1 + 7 + 3
    = 19 through the ring's row, and 3 + 3 = 6 for a skipped token (the shortest)."""
    flow = Flow(parse(TOKEN_LISTING)[0])
    outer, inner = flow.loops
    assert flow.hot_path(inner) == (7, 7)
    assert flow.hot_path(outer) == (6, 19)


# --- data flow ------------------------------------------------------------------------------

CP_ASYNC_LOOP = (
    "IADD3 R9, R9, 0x40, RZ",                    # 0 key counter, carried round the loop
    "FADD R20, R20, R21",                        # 1
    "VIMNMX R3, R9, R10, PT",                    # 2 row = min(key, last)
    "IMAD.WIDE R4, R3, 0x100, R12",              # 3 address = base + row * 256
    "HMMA.16816.F32 R24, R16, R18, R24",         # 4
    "@P0 IADD3 R4, P1, R4, 0x10, RZ",            # 5 under the LDGSTS's own guard
    "@P0 IADD3.X R5, RZ, R5, RZ, P1, !PT",       # 6
    "ISETP.GT.AND P2, PT, R9, R11, PT",          # 7 control, not address
    "@P0 LDGSTS.E.BYPASS.128 [R6+0x100], desc[UR4][R4.64]",   # 8
    "IADD3 R6, R6, 0x20, RZ",                    # 9 shared address, carried round the loop
    "FMUL R22, R20, R20",                        # 10
    "@P2 BRA `(.L_x_0)",                         # 11
)


def test_cp_async_address_slice_walks_back_once_round_the_loop():
    body = code(*CP_ASYNC_LOOP)
    assert address_slice(body, lambda ins: ins.base == "LDGSTS") == {0, 2, 3, 5, 6, 9}
    assert backward_slice(body, 8, {"R6"}, wrap=False) == set()


@pytest.mark.parametrize("guard, expected", [("@P0 ", {1}), ("@P3 ", {0, 1}), ("", {1})])
def test_a_write_under_another_guard_may_not_happen(guard, expected):
    body = code("MOV R4, 0x1", f"{guard}MOV R4, 0x2", "@P0 LDGSTS.E.BYPASS.128 [R4], "
                "desc[UR4][R8.64]")
    assert backward_slice(body, 2, {"R4"}, wrap=False) == expected


def test_a_guard_stops_naming_the_same_condition_once_its_definition_is_passed():
    body = code("MOV R4, 0x1", "@P0 MOV R4, 0x2", "ISETP.GT.AND P0, PT, R1, R2, PT",
                "@P0 MOV R4, 0x3", "@P0 LDGSTS.E.BYPASS.128 [R4], desc[UR4][R8.64]")
    assert backward_slice(body, 4, {"R4"}, wrap=False) == {3}
    body = code("MOV R4, 0x1", "@P0 MOV R4, 0x2", "ISETP.GT.AND P0, PT, R1, R2, PT",
                "@P1 MOV R4, 0x3", "@P0 LDGSTS.E.BYPASS.128 [R4], desc[UR4][R8.64]")
    assert backward_slice(body, 4, {"R4"}, wrap=False) == {0, 1, 3}


SERIAL = [line for k in range(8) for line in
          (f"LDG.E R{2 * k}, desc[UR4][R40.64+{4 * k:#x}]", f"FADD R30, R30, R{2 * k}")]
OVERLAPPED = [f"LDG.E R{2 * k}, desc[UR4][R40.64+{4 * k:#x}]" for k in range(8)] + \
    [f"FADD R30, R30, R{2 * k}" for k in range(8)]


@pytest.mark.parametrize("lines, waits", [
    (SERIAL, 8),                         # each load used before the next is issued
    (OVERLAPPED, 1),                     # all issued, then used: they travel together
    (SERIAL * 3, 24),                    # a loop's body walked once per trip
    (["LDG.E R2, desc[UR4][R10.64]",     # an address from a load: a wait to issue it
      "LDG.E R4, desc[UR4][R2.64]", "FADD R6, R4, R4"], 2),
    (["LDG.E R2, desc[UR4][R10.64]", "MOV R2, RZ", "FADD R3, R2, R2"], 0),
    (["LDG.E R2, desc[UR4][R10.64]", "@P0 MOV R2, RZ", "FADD R3, R2, R2"], 1),
    (["LDG.E.128 R4, desc[UR4][R10.64]", "FADD R3, R7, R7"], 1),   # any of its registers
    (["LDS R2, [R10]", "FADD R3, R2, R2", "FADD R4, R6, R6"], 0),  # shared: no round trip
])
def test_round_trips_are_waits_on_the_first_use_of_an_outstanding_load(lines, waits):
    assert round_trips(code(*lines)) == waits


# --- instruction classes --------------------------------------------------------------------

@pytest.mark.parametrize("line, float64, div64", [
    ("CALL.REL.NOINC `($__internal_1_$__cuda_sm20_div_s64)", False, True),
    ("CALL.REL.NOINC `($__internal_3_$__cuda_sm20_rem_s64)", False, True),
    ("CALL.REL.NOINC `($__internal_2_$__cuda_sm20_div_u64)", False, True),
    ("CALL.REL.NOINC `($__internal_4_$__cuda_sm20_rem_u64)", False, True),
    ("CALL.REL.NOINC `($__internal_2_$__cuda_sm3x_div_rn_noftz_f32_slowpath)", False, False),
    ("CALL.REL.NOINC `($__internal_0_$__cuda_sm20_div_rn_f64_full)", True, False),
    ("DADD R4, R4, R6", True, False),
    ("DMUL.RP R12, R2, R4", True, False),
    ("@!P2 DFMA R4, R4, R6, R8", True, False),
    ("DSETP.NAN.AND P0, PT, R2, R2, PT", True, False),
    ("F2F.F64.F32 R4, R3", True, False),
    ("F2F.F32.F64 R3, R4", True, False),
    ("I2F.F64.S64 R14, R14", True, False),
    ("F2I.S64.F64 R2, R4", True, False),
    ("MUFU.RCP64H R17, R11", True, False),
    ("I2F.U64.RP R14, R20", False, False),
    ("F2I.U64.TRUNC R16, R26", False, False),
    ("DEPBAR.LE SB0, 0x0", False, False),
    ("MUFU.EX2 R4, R4", False, False),
])
def test_float64_and_64_bit_division_are_recognised(line, float64, div64):
    (ins,) = code(line)
    assert (is_float64(ins), is_div64_call(ins)) == (float64, div64)


# --- budgets --------------------------------------------------------------------------------

FIGURES = {"decode": {"registers": 168, "spill_bytes": 0, "instructions_per_key": 80.5},
           "prefill": {"registers": 228, "spill_bytes": 16, "hmma_percent": 12.5}}
BUDGETS = {"every kernel": {"max_spill_bytes": 0, "max_registers": 255},
           "decode": {"max_registers": 160, "max_instructions_per_key": 75},
           "prefill": {"min_hmma_percent": 20}}


def test_budgets_name_each_figure_against_its_limit():
    """A kernel's own limit overrides the one under "every kernel"."""
    found = sassbudget.verdicts(BUDGETS, FIGURES)
    assert [str(v) for v in found if not v.holds] == [
        "decode: registers 168 > 160",
        "decode: instructions_per_key 80.5 > 75",
        "prefill: spill_bytes 16 > 0",
        "prefill: hmma_percent 12.5 < 20"]
    assert [str(v) for v in found if v.holds] == [
        "decode: spill_bytes 0 <= 0", "prefill: registers 228 <= 255"]


def test_check_prints_the_table_and_fails_naming_each_exceeded_budget(capsys):
    figures = {label: sassfigures.Figures(values) for label, values in FIGURES.items()}
    assert sass._check(BUDGETS, figures) == 1
    out = capsys.readouterr().out
    assert out.count("EXCEEDED") == 4 and "4 of 6 budgets exceeded:" in out
    assert "  decode: instructions_per_key 80.5 > 75\n" in out
    assert sass._check({"decode": {"max_instructions_per_key": 90}}, figures) == 0
    assert "all 1 budgets hold" in capsys.readouterr().out


@pytest.mark.parametrize("budgets, message", [
    ({"decode": {"max_registers_per_key": 1}}, "does not have"),
    ({"decode": {"limit_registers": 1}}, "expected max_<figure>"),
    ({"decode": {"register_headroom": 8}}, "expected max_<figure>"),
    ({"dekode": {"max_registers": 1}}, "does not build"),
])
def test_a_budget_on_something_the_report_lacks_is_refused(budgets, message):
    with pytest.raises(sassbudget.BudgetError, match=message):
        sassbudget.verdicts(budgets, FIGURES)


def test_budget_file_must_map_labels_to_numbers(tmp_path):
    path = tmp_path / "budgets.json"
    path.write_text('{"decode": {"max_registers": "160"}}')
    with pytest.raises(sassbudget.BudgetError, match="number"):
        sassbudget.load(path)
    path.write_text('{"decode": {"max_registers": 160}}')
    assert sassbudget.load(path) == {"decode": {"max_registers": 160}}


def test_checked_in_budgets_name_documented_kernels_and_bound_every_kind():
    """Every documented kernel but the probe has budgets of its own. Registers are
    budgeted where no launch bounds cap them below what keeps the kernel's occupancy
    (decode's bounds cap it at 168, and ptxas spills rather than pass a cap: a spill
    is what fails there), at the most registers that keep it: the writes (fp8's too)
    and copy 4 blocks of 256 threads an SM, the combine 3. Prefill (128 threads) keeps
    2 blocks at any count up to 255. The fp8 write from float16 keeps the issue's
    target of 20 instructions per 16-byte vector, fp8 decode at 2 rows of 60 per key."""
    from kvnumba.kernels.decode import combine
    from kvnumba.kernels.launch import calling as launch
    budgets = sassbudget.load(sass.DEFAULT_BUDGETS)
    labels = [item.label for item in sass.SPECIALISATIONS]
    assert len(set(labels)) == len(labels)
    assert set(budgets) - {sassbudget.EVERY} == set(labels) - {"probe"}
    assert budgets[sassbudget.EVERY]["max_spill_bytes"] == 0
    registers = {label: entry["max_registers"] for label, entry in budgets.items()
                 if "max_registers" in entry}
    writes = ("write", "write float8_e4m3 from float16", "write float8_e4m3 from bfloat16 scaled")
    four_blocks = sassfigures.register_cap((launch.STRIDE_THREADS, 4))
    assert registers == {**{label: four_blocks for label in writes}, "copy": four_blocks,
                         "combine d128": sassfigures.register_cap((combine.threads(128), 3))}
    assert registers == {**{label: 64 for label in writes}, "copy": 64, "combine d128": 80}
    assert budgets["write"]["max_instructions_per_vector_2kb_ring"] <= 20
    assert budgets["write float8_e4m3 from float16"]["max_instructions_per_vector_2kb_ring"] <= 20
    assert budgets["decode d128 float8_e4m3 2 rows"]["max_instructions_per_key"] <= 60
    assert budgets["copy"]["max_instructions_per_vector_2kb"] <= 20
    assert budgets["prefill d128 float16"]["min_masked_hmma_percent"] >= 15


# --- specialisations and tools --------------------------------------------------------------

def test_a_factory_kernel_is_named_by_its_literal_arguments():
    from kvnumba.kernels.decode import kernel as decode_kernel
    kernel = decode_kernel.decode_kernel(16, "float16", 1, False)
    got = sass.load_kernel("kvnumba.kernels.decode.kernel:decode_kernel(16, 'float16', 1, False)")
    assert got is kernel.dispatcher
    assert sass.factory_arguments("kvnumba.kernels.decode.kernel:decode_kernel(16, 'float16', "
                                  "1, False)")["head_dim"] == 16
    with pytest.raises(ValueError, match="MODULE:FACTORY"):
        sass.load_kernel("decode_kernel(16)")
    with pytest.raises(ValueError, match="MODULE:FACTORY"):
        sass.load_kernel("kvnumba.kernels.decode.kernel:decode_kernel(16, 'float16'")


def test_each_specialisation_keeps_its_own_files():
    stems = [sass.file_stem(item.spec, item.signature) for item in sass.SPECIALISATIONS]
    assert len(set(stems)) == len(stems)
    assert sass.file_stem("m:k", "void(int32)") != sass.file_stem("m:k", "void(int64)")
    decode = [item.spec for item in sass.SPECIALISATIONS].index(
        "kvnumba.kernels.decode.kernel:decode_kernel(128, 'float16', 4, False)")
    assert re.fullmatch(r"decode_kernel_128_float16_4_False-[0-9a-f]{8}", stems[decode])


def _fake_tool(folder: Path, name: str, release: str) -> str:
    path = folder / release / name
    path.parent.mkdir()
    path.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    path.chmod(0o755)
    return str(path)


def test_tool_of_libnvvms_release_is_preferred_over_an_earlier_candidate(tmp_path, monkeypatch):
    old, new = _fake_tool(tmp_path, "ptxas", "13.0"), _fake_tool(tmp_path, "ptxas", "13.5")
    monkeypatch.delenv("PTXAS", raising=False)
    monkeypatch.setattr(sass, "_candidates", lambda name: [old, new])
    monkeypatch.setattr(sass, "libnvvm_release", lambda: "13.5")
    assert sass.find_tool("ptxas") == new
    monkeypatch.setattr(sass, "libnvvm_release", lambda: "12.8")
    assert sass.find_tool("ptxas") == old          # none matches: the first found


def test_a_toolkit_file_has_the_release_of_its_version_json(tmp_path):
    library = tmp_path / "cuda" / "nvvm" / "lib64" / "libnvvm.so"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"")
    assert sass.cuda_release(library) is None
    (tmp_path / "cuda" / "version.json").write_text('{"cuda": {"version": "12.8.93"}}')
    assert sass.cuda_release(library) == "12.8"


def test_tool_named_explicitly_must_exist(tmp_path):
    with pytest.raises(sass.ToolMissing, match="--ptxas="):
        sass.find_tool("ptxas", str(tmp_path / "ptxas"))


def test_tool_from_environment_variable(tmp_path, monkeypatch):
    tool = _fake_tool(tmp_path, "nvdisasm", "13.5")
    monkeypatch.setenv("NVDISASM", tool)
    assert sass.find_tool("nvdisasm") == tool


def test_missing_tool_says_how_to_install_it(monkeypatch):
    monkeypatch.delenv("PTXAS", raising=False)
    monkeypatch.setattr(sass, "_candidates", lambda name: [])
    with pytest.raises(sass.ToolMissing, match=r"pip install -e '\.\[sass\]'"):
        sass.find_tool("ptxas")


def test_command_line_reports_a_missing_tool_without_compiling(tmp_path):
    """Run as CI runs it, with no device asked for: without a GPU kvnumba falls back to
    the simulator when imported, and the command reruns itself in compile mode."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("KVNUMBA_DEVICE", "NUMBA_ENABLE_CUDASIM")}
    proc = subprocess.run([sys.executable, "-m", "kvnumba.bench.sass", "--ptxas",
                           str(tmp_path / "none")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--ptxas=" in proc.stderr and "not an executable" in proc.stderr


def test_command_line_refuses_the_simulator_asked_for():
    env = dict(os.environ, KVNUMBA_DEVICE="simulator")
    proc = subprocess.run([sys.executable, "-m", "kvnumba.bench.sass"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "cannot compile to PTX: unset it or use KVNUMBA_DEVICE=compile" in proc.stderr


def test_the_h200_decode_estimate_is_bound_by_bytes_issue_or_latency():
    """The estimate (bench/sass/estimate.py) by hand: 128 x 4096 x 8 key-heads of a d128
    float16 decode move 2 GiB (520 us at the 4.13 TB/s a copy reaches, 86% of 4.8
    TB/s); at 24 instructions a key they issue in 96 us (132 SMs x 4 x 1.98 GHz), so
    bytes bind. 8-bit floats halve the bytes (2x as fast while bytes bind); 150
    instructions a key take 608 us and bind instead."""
    from kvnumba.bench.sass import estimate
    key_heads = 128 * 4096 * 8
    fp16 = estimate.decode_step(24.0, 2.0, 128, 2)
    assert fp16.bytes_s == pytest.approx(key_heads * 512 / 4.13e12)
    assert fp16.issue_s == pytest.approx(key_heads * 24 / (132 * 4 * 1.98e9))
    assert fp16.hbm_fraction == pytest.approx(4.13 / 4.8)
    fp8 = estimate.decode_step(24.0, 2.0, 128, 1)
    assert fp16.seconds / fp8.seconds == pytest.approx(2.0)
    slow = estimate.decode_step(150.0, 2.0, 128, 2)
    assert slow.seconds == slow.issue_s
    assert slow.hbm_fraction == pytest.approx(4.13 / 4.8 * slow.bytes_s / slow.issue_s)
    assert slow.hbm_fraction < 0.85
    # bytes in flight: 6 blocks of 32 KiB cover the latency; one block of 4 KiB does not
    assert estimate.in_flight(32768, 6) > 1 > estimate.in_flight(4096, 1)


def test_the_blocks_an_sm_holds_are_bound_by_shared_memory_registers_or_the_limit():
    """By hand: 228 KiB of shared memory, 65,536 registers allocated 8 a thread at a
    time, at most 32 blocks. A one-warp block of 22,784 bytes fits 10 times by shared
    memory, but at 253 registers (256 allocated, 8,192 a warp) 8 times; 34,816 bytes
    fit 6 times; 201 registers are allocated as 208; 64 registers and no shared memory
    to speak of: 32."""
    from kvnumba.bench.sass import estimate
    assert estimate.blocks_per_sm(22784, 128, 32) == 10
    assert estimate.blocks_per_sm(22784, 253, 32) == 8
    assert estimate.blocks_per_sm(22784, 249, 32) == 8       # 256 allocated as well
    assert estimate.blocks_per_sm(2048, 200, 32) == 10       # 65,536 // (200 * 32)
    assert estimate.blocks_per_sm(2048, 201, 32) == 9        # 208 allocated
    assert estimate.blocks_per_sm(34816, 252, 32) == 6
    assert estimate.blocks_per_sm(16, 64, 32) == 32
    assert estimate.blocks_per_sm(1024, 64, 128) == 8        # 65,536 // (64 * 128)
