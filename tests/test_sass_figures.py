"""The kinds' figures of `python -m kvnumba.bench.sass` (`bench.sass.attention`, `bench.sass.move`)
on hand-written SASS, against hand-computed values."""
import pytest

from kvnumba.bench.sass import attention as sassattention, move as sassmove
from kvnumba.bench.sass.flow import Flow
from kvnumba.bench.sass.model import parse
from sasstext import TOKEN_LOOP, listing


def flow_of(*lines: str) -> Flow:
    return Flow(parse(listing(*lines))[0])


# --- decode ---------------------------------------------------------------------------------

#: a key loop (0x20..0xa0, 9 instructions) whose rescale (0x60..0x80) is skipped
#: unless a score passes the reference max; 4 instructions outside it
DECODE_LIKE = (
    "S2R R0, SR_TID.X", "MOV R2, RZ",
    ".L_x_0:",
    "LDG.E.128.CONSTANT R4, desc[UR4][R2.64]", "FFMA R8, R4, R5, R8",
    "FSETP.GT.AND P1, PT, R8, R9, PT", "@!P1 BRA `(.L_x_1)",
    "FMUL R10, R10, R11", "FMUL R12, R12, R11", "FMUL R13, R13, R11",
    ".L_x_1:",
    "ISETP.LT.AND P0, PT, R2, R0, PT", "@P0 BRA `(.L_x_0)",
    "STG.E desc[UR4][R2.64], R8", "EXIT",
    ".L_x_2:",
    "BRA `(.L_x_2)")


def test_decode_counts_the_hot_path_per_trip_and_the_rescale_once_per_chunk():
    """4097 keys cut as 15 chunks of 256 and one of 257; 4 warps of 32-key trips (head_dim
    128, float16: 16 lanes a key, 2 keys a warp step, 4 a lane): per warp and chunk, F = 4
    and the rescale R = 3 once, B = 6 a trip (8 trips, 9 for 257 keys)."""
    assert sorted(sassattention.decode_chunks()) == [256] * 15 + [257]
    figures = sassattention.decode_figures(flow_of(*DECODE_LIKE),
                                           {"head_dim": 128, "storage": "float16"})
    expected = (15 * 4 * (4 + 3 + 6 * 8) + 4 * (4 + 3 + 6 * 9)) / 4097
    assert figures.values == {"instructions_per_key": pytest.approx(expected)}
    assert "B = 6 instructions on the hot path of a 32-key block trip" in figures.notes[0]
    assert "R = 3 in rarely taken blocks" in figures.notes[0]


def test_decode_of_float32_storage_takes_16_keys_a_trip():
    """head_dim 128, float32: 32 lanes a key, 1 key a warp step: trips of 16 keys (16, 17
    of them a chunk)."""
    figures = sassattention.decode_figures(flow_of(*DECODE_LIKE),
                                           {"head_dim": 128, "storage": "float32"})
    expected = (15 * 4 * (4 + 3 + 6 * 16) + 4 * (4 + 3 + 6 * 17)) / 4097
    assert figures.values["instructions_per_key"] == pytest.approx(expected)


# --- prefill --------------------------------------------------------------------------------

#: a masked tile loop (0x00..0xf0: 16 instructions, 1 HMMA) before the unmasked one
#: (0x110..0x1c0: 12 instructions, 1 HMMA, an LDGSTS whose address takes 6 of them)
PREFILL_LIKE = (
    ".L_x_9:",
    "HMMA.16816.F32 R24, R16, R18, R24",
    *(line for k in range(4) for line in (f"FSETP.GT.AND P4, PT, R{24 + k}, R30, PT",
                                          f"FSEL R{24 + k}, R{24 + k}, -INF, P4")),
    "FMNMX R31, R24, R31, !PT", "FMNMX R31, R25, R31, !PT", "FADD R20, R20, R24",
    "FADD R20, R20, R25", "IADD3 R9, R9, 0x40, RZ", "ISETP.GT.AND P2, PT, R9, R11, PT",
    "@P2 BRA `(.L_x_9)",
    "MOV R6, RZ",
    ".L_x_0:",
    "IADD3 R9, R9, 0x40, RZ", "FADD R20, R20, R21", "VIMNMX R3, R9, R10, PT",
    "IMAD.WIDE R4, R3, 0x100, R12", "HMMA.16816.F32 R24, R16, R18, R24",
    "@P0 IADD3 R4, P1, R4, 0x10, RZ", "@P0 IADD3.X R5, RZ, R5, RZ, P1, !PT",
    "ISETP.GT.AND P2, PT, R9, R11, PT", "@P0 LDGSTS.E.BYPASS.128 [R6+0x100], desc[UR4][R4.64]",
    "IADD3 R6, R6, 0x20, RZ", "FMUL R22, R20, R20", "@P2 BRA `(.L_x_0)",
    "EXIT")


def test_prefill_hmma_share_of_both_tile_loops_and_cp_async_addressing():
    """The main loop is the leaner of the two holding one HMMA each: 1 of 12; the masked
    loop 1 of 16; the LDGSTS address slice once round the main loop: the key counter, the
    row, its address, the two guarded adds and the shared address (6)."""
    figures = sassattention.prefill_figures(flow_of(*PREFILL_LIKE), {})
    assert figures.values == {"hmma_percent": pytest.approx(100 / 12),
                              "masked_hmma_percent": pytest.approx(100 / 16),
                              "instructions_per_cp_async": 6.0}


def test_prefill_without_a_masked_loop_is_an_error():
    with pytest.raises(ValueError, match="masked"):
        sassattention.prefill_figures(flow_of(*PREFILL_LIKE[PREFILL_LIKE.index("MOV R6, RZ"):]),
                                      {})


# --- combine --------------------------------------------------------------------------------

#: the tables: a row, then two fields it names (2 waits); a loop of one part's load and
#: its use (1 wait a trip); the store after it
COMBINE_LIKE = (
    "LDG.E R2, desc[UR4][R10.64]", "IMAD.WIDE R4, R2, 0x4, R12",
    "LDG.E R6, desc[UR4][R4.64]", "LDG.E R7, desc[UR4][R4.64+0x4]", "IADD3 R8, R6, R7, RZ",
    ".L_x_0:",
    "LDG.E.128 R12, desc[UR4][R8.64]", "FADD R20, R20, R12", "IADD3 R8, R8, 0x10, RZ",
    "ISETP.LT.AND P0, PT, R8, R9, PT", "@P0 BRA `(.L_x_0)",
    "STG.E desc[UR4][R10.64], R20", "EXIT")


def test_combine_round_trips_walk_the_tables_then_each_trip():
    """129 parts over 8 part groups, one part a trip: 17 trips, 2 + 17 round trips; with
    the part's loads hoisted before the trip's uses (4 parts a trip), 2 + 5."""
    from kvnumba.kernels.decode import combine
    assert combine.PART_GROUPS == 8
    figures = sassattention.combine_figures(flow_of(*COMBINE_LIKE), {})
    assert figures.values == {"round_trips": 19}
    hoisted = COMBINE_LIKE[:6] + tuple(f"LDG.E.128 R{12 + 4 * k}, desc[UR4][R8.64+{16 * k:#x}]"
                                       for k in range(4)) + \
        ("FADD R20, R12, R16", "FADD R21, R20, R24", "FADD R22, R21, R28") + COMBINE_LIKE[8:]
    assert sassattention.combine_figures(flow_of(*hoisted), {}).values == {"round_trips": 7}


# --- write and copy -------------------------------------------------------------------------

MOVE_LIKE = TOKEN_LOOP      # a token loop around a vector loop (B = 7)


def test_write_counts_a_lanes_whole_run_per_vector_of_a_token():
    """A 2 KiB row is 128 vectors: 32 lanes (at least 128 / 4), each 4 trips of this loop's
    one vector a row: 32 * (13 + 7 * 4) / 256 flat, 32 * (16 + 28) / 256 on a ring; a
    256-byte row, 16 vectors: 4 lanes, 4 trips each, the same."""
    from kvnumba.kernels.moves import write
    assert write.vector_lanes(128) == (32, 8) and write.vector_lanes(16) == (4, 64)
    figures = sassmove.write_figures(flow_of(*MOVE_LIKE), {})
    assert figures.values == {"instructions_per_vector_2kb_flat": 41 / 8,
                              "instructions_per_vector_2kb_ring": 44 / 8,
                              "instructions_per_vector_256b_flat": 41 / 8,
                              "instructions_per_vector_256b_ring": 44 / 8}


def test_copy_counts_a_lanes_whole_run_per_vector_of_a_whole_page_run():
    """Pages of 16 token rows: 2 KiB rows, 2048 vectors a page: 256 lanes, 8 trips each:
    256 * (16 + 7 * 8) / 4096; 256-byte rows, 256 vectors: 64 lanes, 4 trips:
    64 * (16 + 28) / 512 (the longest way through)."""
    from kvnumba.kernels.moves import write
    from kvnumba.arith.pages import DEFAULT_PAGE_SIZE
    assert DEFAULT_PAGE_SIZE == 16
    assert write.vector_lanes(2048) == (256, 1) and write.vector_lanes(256) == (64, 4)
    figures = sassmove.copy_figures(flow_of(*MOVE_LIKE), {})
    assert figures.values == {"instructions_per_vector_2kb": 72 / 16,
                              "instructions_per_vector_256b": 44 / 8}


# --- state layers ---------------------------------------------------------------------------

def test_a_delta_rule_decode_token_moves_its_state_twice_and_its_rows():
    """d128, a gate a head: the float32 state read and written (2 x 64 KiB); q, k, v, the
    gate, beta and out in bfloat16; the log row's k, v, gate and beta in float32."""
    from kvnumba.bench.sass import state as sassstate
    assert sassstate.delta_rule_bytes(128, 128, False) == \
        2 * 128 * 128 * 4 + 2 * (128 + 128 + 128 + 1 + 1 + 128) + 4 * (128 + 128 + 1 + 1)
    assert sassstate.delta_rule_bytes(128, 128, True) - \
        sassstate.delta_rule_bytes(128, 128, False) == (2 + 4) * 127


def test_loads_stay_in_flight_until_a_wait():
    """A 4-byte and a 16-byte load outstanding together (20 bytes), settled by the first
    use; then a 2-byte load alone."""
    from kvnumba.bench.sass import model
    from sasstext import code
    run = code("LDG.E R2, desc[UR4][R4.64]", "LDG.E.128 R8, desc[UR4][R6.64]",
               "FADD R3, R2, R2", "LDG.E.U16 R12, desc[UR4][R4.64]", "FADD R13, R12, R12")
    assert model.most_in_flight(run) == 20
    assert model.most_in_flight(run[2:]) == 2


def test_an_ssd_decode_token_moves_its_state_twice_and_its_rows():
    """head_dim 64, d_state 128: the float32 state read and written (2 x 32 KiB); x, dt
    and out in bfloat16, B and C (128 each) shared by 16 heads; A, D, dt_bias in
    float32; the log row's d x, B and d A in float32."""
    from kvnumba.bench.sass import state as sassstate
    assert sassstate.ssd_bytes(128, 64) == \
        2 * 64 * 128 * 4 + 2 * (64 + 1 + 2 * 128 / 16 + 64) + 4 * 3 + 4 * (64 + 128 + 1)
    assert sassstate.ssd_bytes(128, 64) == 66610
