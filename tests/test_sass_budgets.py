"""The checked-in budgets (`bench/sass/budgets.json`) fail on deliberately regressed
kernels: each kind of budget, on a variant of a kernel it bounds made one step worse
(spilled, more registers, serialised loads, longer, less HMMA), compiled, assembled and
disassembled as `python -m kvnumba.bench.sass` builds the real ones. The real kernels meet the
same budgets in `python -m kvnumba.bench.sass --check` (CI runs it after the tests).

A variant is the kernel's own code with a name it calls bound to something worse: a
device function (`ptx.exp2_approx` with one more multiply, `ptx.shfl_xor` taken twice,
`ptx.mul_wide_u32` as a 64 x 64-bit product, the write's slot lookup through 64-bit
indices, the copy's row run read at 64-bit indices), a compile-time constant (vectors a
lane moves per trip, parts the combine loads per trip, the delta rule's rows a lane) or
the launch bounds. Each is a few instructions
worse than the real kernel; the budgets' margins are smaller than that. Factories are called afresh
(`__wrapped__`, past their cache) and module kernels cloned with the name rebound, so
nothing compiled before is reused.

It needs `KVNUMBA_DEVICE=compile` (numba-cuda's libNVVM) and ptxas and nvdisasm (`pip
install -e '.[sass]'`): under the simulator (the suite's default) one test runs this
file again in compile mode, and skips, saying which, when a tool is missing. Each kind of
budget fails on one kernel in the default run; the same regression on the kernel's other
specialisations and kernels of the same kind (a decode of one row, with a softcap, over
float8; the softcapped prefill; the SSD scan's state past its registers, beside the delta
rule's; the per-channel and the SSD's chunked prefills on the CUDA cores, beside the
delta rule's) runs under `HYPOTHESIS_PROFILE=thorough`.
"""
import importlib
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import kvnumba.device as kv_device
from kvnumba.bench.sass import report as sass, budget as sassbudget, figures as sassfigures

COMPILE = kv_device.KIND == "compile"
compile_mode = pytest.mark.skipif(not COMPILE, reason="KVNUMBA_DEVICE=compile only (run by "
                                                      "test_the_regressed_kernels_fail)")
THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
BUDGETS = sassbudget.load(sass.DEFAULT_BUDGETS)
SPECS = {item.label: item for item in sass.SPECIALISATIONS}


def missing_tools() -> str | None:
    """Why the variants cannot be built here, or None."""
    if sass.libnvvm() is None:
        return f"numba-cuda finds no libNVVM ({sass.COMPILER_HINT})"
    try:
        sass.find_tool("ptxas"), sass.find_tool("nvdisasm")
    except sass.ToolMissing as e:
        return str(e)
    return None


@pytest.mark.skipif(COMPILE or kv_device.KIND == "gpu",
                    reason="runs the compile-mode tests from the simulator")
def test_the_regressed_kernels_fail():
    why = missing_tools()
    if why:
        pytest.skip(f"the regressed kernels are not built: {why}")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["KVNUMBA_DEVICE"] = "compile"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p",
                           "no:cacheprovider", "-rs", __file__], env=env, capture_output=True,
                          text=True, timeout=900, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "compile only" not in proc.stdout, proc.stdout[-2000:]   # all of them ran


# ---------------------------------------------------------------------------- compile mode

@pytest.fixture(scope="module")
def tools():
    return sass.find_tool("ptxas"), sass.find_tool("nvdisasm")


@pytest.fixture
def figures_of(tools, tmp_path):
    """`(function, bounds, label) -> figure values`: a kernel's Python function built
    under launch `bounds` at the signature of the report's kernel `label`, measured as
    its kind."""
    def measure(function, bounds, label: str) -> dict:
        item = SPECS[label]
        ptxas, text = sass.build(function, item.signature, bounds, tools,
                                 tmp_path / sass.file_stem(item.spec, item.signature))
        module, name, _ = sass._split_spec(item.spec)
        return sassfigures.kernel_figures(f"{module}:{name}", ptxas, text, bounds,
                                          sass.factory_arguments(item.spec)).values
    return measure


def exceeded(label: str, values: dict) -> dict:
    """The budgets of `label` (its own and every kernel's) that `values` exceeds:
    figure -> (value, limit)."""
    budgets = {sassbudget.EVERY: BUDGETS[sassbudget.EVERY], label: BUDGETS.get(label, {})}
    return {v.figure_name: (v.figure, v.limit)
            for v in sassbudget.verdicts(budgets, {label: values}) if not v.holds}


def clone(function, **names):
    """`function` (a kernel's or device function's Python code) with `names` rebound."""
    return types.FunctionType(function.__code__, {**function.__globals__, **names},
                              function.__name__, function.__defaults__, function.__closure__)


def fresh(label: str) -> tuple:
    """`(Python function, launch bounds)` of `label`'s kernel, made afresh by its factory."""
    module, name, arguments = sass._split_spec(SPECS[label].spec)
    kernel = getattr(importlib.import_module(module), name).__wrapped__(*arguments).dispatcher
    return kernel.py_func, kernel.targetoptions.get("launch_bounds")


@pytest.fixture
def slower_exponential(monkeypatch):
    """`ptx.exp2_approx` with one more multiply."""
    from numba import float32

    from kvnumba.device import cuda
    from kvnumba.kernels.intrinsics import ptx
    exp2 = ptx.exp2_approx

    @cuda.jit(device=True, inline="always")
    def exp2_then_scale(x):
        return exp2(x) * float32(1.0000001)

    monkeypatch.setattr(ptx, "exp2_approx", exp2_then_scale)


@pytest.fixture
def wider_addresses(monkeypatch):
    """`ptx.mul_wide_u32` as a 64 x 64-bit product of its arguments widened."""
    from numba import uint64

    from kvnumba.device import cuda
    from kvnumba.kernels.intrinsics import ptx

    @cuda.jit(device=True, inline="always")
    def wide_product(a, b):
        return uint64(a) * uint64(b)

    monkeypatch.setattr(ptx, "mul_wide_u32", wide_product)


@compile_mode
def test_a_kernel_that_spills_fails_every_kernels_spill_budget(figures_of):
    """The write under launch bounds of 1024 threads, 2 blocks an SM: 32 registers for
    a kernel that needs 56, so ptxas spills."""
    from kvnumba.kernels.moves import write
    values = figures_of(write._write_vectors.py_func, (1024, 2), "write")
    assert values["register_cap"] == 32
    assert values["spill_bytes"] > 0 and "spill_bytes" in exceeded("write", values)


@compile_mode
def test_a_generic_tile_of_more_accumulators_fails_every_kernels_local_memory_budget(
        monkeypatch, figures_of):
    """The generic kernel at head dim 512 on 8 rows of 2 warps: 64 output elements a
    thread (`MAX_OWN` raised past 32), which ptxas keeps in local memory."""
    from kvnumba.kernels.generic import kernel as generic_kernel
    monkeypatch.setattr(generic_kernel, "MAX_OWN", 64)
    kernel = generic_kernel.attention_kernel.__wrapped__(512, 8, 8, 8, 64).dispatcher
    values = figures_of(kernel.py_func, None, "generic d512 float16")
    assert {"local_accesses", "stack_bytes"} <= set(exceeded("generic d512 float16", values))


@compile_mode
def test_more_registers_fail_the_register_budgets(figures_of):
    """The write moving 8 vectors of K and 8 of V a trip, all loaded before any is
    stored; the combine loading 16 parts a trip: fewer blocks an SM than the budgets
    keep."""
    from kvnumba.device import cuda
    from kvnumba.kernels import masks
    from kvnumba.kernels.decode import combine
    from kvnumba.kernels.moves import write
    device = cuda.jit(device=True, inline="always")
    moves = device(clone(write.move_vectors.py_func, TRIP_VECTORS=8,
                         _trip_at=masks.clamped_trip(8)))
    walk = masks.token_runs(device(clone(write._move_token.py_func, move_vectors=moves)))
    values = figures_of(clone(write._write_vectors.py_func, _vector_tokens=walk), None, "write")
    assert exceeded("write", values)["registers"][0] > BUDGETS["write"]["max_registers"]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(combine, "UNROLL", 16)
        patch.setattr(combine, "PARTS_PER_TRIP", combine.PART_GROUPS * 16)
        values = figures_of(*fresh("combine d128"), "combine d128")
    assert "registers" in exceeded("combine d128", values)


@compile_mode
def test_a_serialised_combine_fails_its_round_trip_budget(monkeypatch, figures_of):
    """One part a thread per loop trip (the compiler issues 4 parts' loads before their
    uses): 5 trips for 129 parts, not 3, each a round trip."""
    from kvnumba.kernels.decode import combine
    monkeypatch.setattr(combine, "UNROLL", 1)
    monkeypatch.setattr(combine, "PARTS_PER_TRIP", combine.PART_GROUPS)
    values = figures_of(*fresh("combine d128"), "combine d128")
    assert exceeded("combine d128", values)["round_trips"][0] >= \
        BUDGETS["combine d128"]["max_round_trips"] + 2


@compile_mode
def test_a_longer_write_fails_every_per_vector_budget(figures_of):
    """The token's slot through `masks.page_slot(pages, seq, masks.storage_row(position,
    ring_rows), page_bits)`: 64-bit row and table indices, 2 instructions more per token
    a lane (a quarter instruction per vector)."""
    from kvnumba.device import cuda
    from kvnumba.kernels import masks
    from kvnumba.kernels.moves import write

    @cuda.jit(device=True, inline="always")
    def slot_in_64_bits(pages, seq, position, ring, shift, in_page):
        return masks.page_slot(pages, seq, masks.storage_row(position, ring), shift)

    walk = clone(masks.token_runs, token_slot=slot_in_64_bits)(write._move_token)
    values = figures_of(clone(write._write_vectors.py_func, _vector_tokens=walk), None, "write")
    assert set(exceeded("write", values)) == {
        f"instructions_per_vector_{row}_{layer}" for row in ("2kb", "256b")
        for layer in ("flat", "ring")}


@compile_mode
def test_a_longer_copy_fails_every_per_vector_budget(figures_of):
    """The row run read at a table index made in 64 bits, each of its three entries at
    an index of its own: 7 instructions more per run a lane."""
    from numba import uint32

    from kvnumba.device import cuda
    from kvnumba.kernels.moves import page_copy as copy

    @cuda.jit(device=True)
    def run_in_64_bits(tables, runs_off, run):
        at = uint32(runs_off + 3 * run)
        return tables[at], tables[at + uint32(1)], tables[at + uint32(2)]

    values = figures_of(clone(copy._copy_vectors.py_func, _run=run_in_64_bits), None, "copy")
    assert set(exceeded("copy", values)) == {"instructions_per_vector_2kb",
                                             "instructions_per_vector_256b"}


@compile_mode
@pytest.mark.parametrize("label", ["decode d128 float16",
                                   "decode tensor cores d128 float16 16 rows"] + (
                                  ["decode d128 float16 1 row", "decode d128 float16 softcap",
                                   "decode tensor cores d128 float8_e4m3 16 rows"]
                                  if THOROUGH else []))
def test_a_longer_decode_fails_its_instructions_per_key(label, slower_exponential,
                                                        figures_of):
    """One more multiply per exponential: each key's probability and the rescale factor,
    5 a lane per 32-key trip (0.6 to 0.7 instructions more per key); on tensor cores 34 a
    64-key tile (0.5 more per key). Still at the byte limit on an H200 (the estimate's
    budget holds)."""
    assert set(exceeded(label, figures_of(*fresh(label), label))) == {"instructions_per_key"}


@compile_mode
def test_a_longer_latent_decode_fails_its_budgets(slower_exponential, figures_of):
    """The wide tile over a latent layer's rows, one more multiply per exponential (8 a
    lane a 16-key tile in each of two V slices): more instructions per key and a smaller
    HMMA share of the loop."""
    label = "decode tensor cores latent d576 float16"
    assert set(exceeded(label, figures_of(*fresh(label), label))) == {
        "instructions_per_key", "hmma_percent"}


@compile_mode
@pytest.mark.parametrize("label", ["prefill d128 float16"] +
                         (["prefill d128 float16 softcap"] if THOROUGH else []))
def test_a_less_hmma_prefill_fails_its_hmma_and_cp_async_budgets(label, slower_exponential,
                                                                  wider_addresses, figures_of):
    """One more multiply per exponential (32 a lane a key tile) lowers the HMMA share of
    both tile loops; a 64-bit product per staged key row lengthens its cp.async address."""
    assert set(exceeded(label, figures_of(*fresh(label), label))) == {
        "hmma_percent", "masked_hmma_percent", "instructions_per_cp_async"}


@compile_mode
@pytest.mark.parametrize("label", ["delta rule d128 bfloat16"] +
                         (["ssd 64x128 bfloat16"] if THOROUGH else []))
def test_a_state_of_a_column_a_lane_is_kept_in_local_memory(label, monkeypatch, figures_of):
    """The delta rule's d128 step (and the SSD scan's) with `ROWS` raised to 128: one lane
    a column, its 128 rows (`d_state` for the SSD scan, 64 lanes a block) past what the
    registers hold beside the rest, so ptxas spills them (the layout before columns were
    split over lanes)."""
    from kvnumba.kernels.state import recurrence
    monkeypatch.setattr(recurrence, "ROWS", 128)
    assert set(exceeded(label, figures_of(*fresh(label), label))) == {
        "spill_bytes", "stack_bytes", "local_accesses"}


@compile_mode
def test_a_longer_delta_rule_fails_its_instructions_per_head(monkeypatch, figures_of):
    """Each butterfly shuffle taken twice, the second from the lane itself (a column's two
    sums and the two norms: 14 shuffles more a lane a token, 224 warp instructions a
    head). Still at the byte limit on an H100 (the estimate's budget holds)."""
    from kvnumba.device import cuda
    from kvnumba.kernels.intrinsics import ptx
    shuffle = ptx.shfl_xor

    @cuda.jit(device=True, inline="always")
    def shuffle_twice(value, mask):
        return shuffle(shuffle(value, mask), 0)

    monkeypatch.setattr(ptx, "shfl_xor", shuffle_twice)
    label = "delta rule d128 bfloat16"
    assert set(exceeded(label, figures_of(*fresh(label), label))) == {"instructions_per_head"}


@compile_mode
def test_an_ssd_of_a_64_bit_group_index_fails_its_budgets(monkeypatch, figures_of):
    """The head's group `h // (heads / groups)` divided in 64 bits (its operands the
    arrays' int64 extents): a division call and its instructions a token, past the
    instruction budget."""
    from numba import int64

    from kvnumba.kernels.state import ssd
    monkeypatch.setattr(ssd, "uint32", int64)
    label = "ssd 64x128 bfloat16"
    assert set(exceeded(label, figures_of(*fresh(label), label))) == {
        "div64_calls", "instructions_per_head"}


@compile_mode
@pytest.mark.parametrize("label", ["delta rule chunked d128 bfloat16"] + (
                                  ["delta rule chunked per-channel d128 bfloat16",
                                   "ssd chunked 64x128 bfloat16"] if THOROUGH else []))
def test_a_chunked_prefill_on_cuda_cores_fails_its_tensor_core_budgets(monkeypatch,
                                                                       figures_of, label):
    """The chunked prefill (the delta rule's, a gate a head or a key channel's, the
    ssd's) with its products on the CUDA cores: each `mma.m16n8k16` a lane's 16 shuffles
    of A and B words, their float16 halves widened and 64 FFMAs (what a kernel without
    `mma.sync` does): no HMMA left, and more instructions a chunk."""
    from numba import int32

    from kvnumba.device import cuda
    from kvnumba.kernels.intrinsics import ptx, tensorcore
    from kvnumba.kernels.state import chunked, chunked_channel, tiles

    @cuda.jit(device=True, inline="always")
    def mma_on_cuda_cores(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        lane = int32(cuda.laneid)
        g, t = lane // 4, lane % 4
        d0, d1, d2, d3 = c0, c1, c2, c3
        for q in range(4):                  # A's columns 2q, 2q + 1 and 2q + 8, 2q + 9
            lo, hi = ptx.f16x2_to_f32(ptx.shfl_idx(a0, 4 * g + q))       # row g
            lo8, hi8 = ptx.f16x2_to_f32(ptx.shfl_idx(a2, 4 * g + q))
            glo, ghi = ptx.f16x2_to_f32(ptx.shfl_idx(a1, 4 * g + q))     # row g + 8
            glo8, ghi8 = ptx.f16x2_to_f32(ptx.shfl_idx(a3, 4 * g + q))
            for n in range(2):              # columns 2t + n: lanes 4 (2t + n) + q
                src = 4 * (2 * t + n) + q
                blo, bhi = ptx.f16x2_to_f32(ptx.shfl_idx(b0, src))
                blo8, bhi8 = ptx.f16x2_to_f32(ptx.shfl_idx(b1, src))
                top = lo * blo + hi * bhi + lo8 * blo8 + hi8 * bhi8
                low = glo * blo + ghi * bhi + glo8 * blo8 + ghi8 * bhi8
                if n == 0:
                    d0, d2 = d0 + top, d2 + low
                else:
                    d1, d3 = d1 + top, d3 + low
        return d0, d1, d2, d3

    monkeypatch.setattr(tensorcore, "mma_f16_f32", mma_on_cuda_cores)
    monkeypatch.setattr(chunked, "product", tiles.product.__wrapped__)
    monkeypatch.setattr(chunked_channel, "product", tiles.product.__wrapped__)
    values = figures_of(*fresh(label), label)
    assert values["HMMA"] == 0
    assert {"hmma_flop_percent", "h100_tflops"} <= set(exceeded(label, values))
