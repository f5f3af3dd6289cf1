"""`kvnumba.kernels.intrinsics.ptx` in small kernels, against NumPy references.

Fragment layouts are re-derived in this file from the PTX ISA (`mma.m16n8k16` and
`ldmatrix` fragment tables) and rounding (IEEE round-to-nearest-even) in
`oracle.round_nearest_even`, not taken from the implementation. On the simulator the
kernels check `ptxsim`; on a GPU the same tests check the real instructions. Only the
tests of the simulator's own checks (alignment, lanes that do not join a warp call) skip
on a GPU.
"""
import time

import numpy as np
import pytest

from kvnumba import device
from kvnumba.device import cuda
from kvnumba.kernels.intrinsics import ptx, tensorcore
from oracle import FORMATS, round_nearest_even

RNG_SEED = 20240607
only_simulator = pytest.mark.skipif(not device.SIMULATOR,
                                    reason="tests the simulator's own checks")


def run(kernel, grid, block, *args):
    """Launch with the array arguments on the device; returns them as they are afterwards."""
    on_device = [cuda.to_device(a) if isinstance(a, np.ndarray) else a for a in args]
    kernel[grid, block](*on_device)
    return [d.copy_to_host() for a, d in zip(args, on_device) if isinstance(a, np.ndarray)]


def lane_parts(lane):
    """(groupID, threadID_in_group) of the PTX fragment tables."""
    return lane // 4, lane % 4


def pack(lo, hi):
    return np.uint32(int(lo) | int(hi) << 16)


# --- 16-byte loads and stores ------------------------------------------------------------

@cuda.jit
def copy16(src, dst, starts, words, read_only):
    i = cuda.grid(1)
    if i < starts.size:
        at = starts[i]
        if read_only:
            u0, u1, u2, u3 = ptx.ld_nc_v4(src, at)
        else:
            u0, u1, u2, u3 = ptx.ld_v4(src, at)
        words[i, 0] = u0
        words[i, 1] = u1
        words[i, 2] = u2
        words[i, 3] = u3
        ptx.st_v4(dst, at, u0, u1, u2, u3)


@pytest.mark.parametrize("read_only", [True, False])
@pytest.mark.parametrize("dtype,shape", [(np.float16, (128,)), (np.float32, (64,)),
                                         (np.uint16, (8, 16)), (np.float16, (4, 8, 8))])
def test_ld_st_v4_move_16_bytes_at_aligned_elements(dtype, shape, read_only):
    rng = np.random.default_rng(RNG_SEED)
    itemsize = np.dtype(dtype).itemsize
    size = int(np.prod(shape))
    per = 16 // itemsize                      # elements in 16 bytes
    src = rng.integers(0, 256, size * itemsize, dtype=np.uint8).view(dtype).reshape(shape)
    chunks = np.sort(rng.choice(size // per, 5, replace=False))
    chunks[0], chunks[-1] = 0, size // per - 1  # the first and the last 16 bytes
    starts = (chunks * per).astype(np.int64)
    dst = np.zeros_like(src)
    words = np.zeros((starts.size, 4), np.uint32)
    dst, words = run(copy16, 1, 32, src, dst, starts, words, read_only)[1::2]

    want = np.zeros_like(src).reshape(-1)
    flat = src.reshape(-1)
    for s in starts:
        want[s:s + per] = flat[s:s + per]
    np.testing.assert_array_equal(dst.reshape(-1).view(np.uint8), want.view(np.uint8))
    as_words = flat.view(np.uint32)           # u0 = the lowest 4 bytes, little-endian
    for i, s in enumerate(starts):
        first = s * itemsize // 4
        np.testing.assert_array_equal(words[i], as_words[first:first + 4])


# --- conversions -------------------------------------------------------------------------

def f32_from_bits(bits):
    return np.asarray(bits, np.uint32).view(np.float32)


def rounding_cases(fmt, rng):
    """float32 inputs: specials, ties and near-ties, subnormals, random bit patterns."""
    decode, inf_bits = FORMATS[fmt][:2]
    finite = rng.integers(0, inf_bits - 1, 400)
    lower, upper = decode(finite), decode(finite + 1)
    ties = ((lower + upper) / 2).astype(np.float32)   # exact: one more bit than the format
    near = np.concatenate([np.nextafter(ties, np.float32(-np.inf)),
                           np.nextafter(ties, np.float32(np.inf))])
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1.0, -1.0,
                         65504.0, 65520.0, np.nextafter(np.float32(65520), np.float32(0)),
                         2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -25, 2.0 ** -26, 6.1e-5, 1e-8,
                         1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8,
                         3.4e38, -3.4e38], np.float32)
    edges = f32_from_bits([0x00000001, 0x80000001, 0x007FFFFF, 0x00800000, 0x7F7F7FFF,
                           0x7F7F8000, 0x7F7FFFFF, 0xFF7F8000, 0x7FC00001, 0xFFBFFFFF])
    patterns = f32_from_bits(rng.integers(0, 2 ** 32, 400, dtype=np.uint64))
    values = np.concatenate([specials, edges, ties, near, patterns,
                             rng.standard_normal(200).astype(np.float32)])
    negated = np.negative(values)
    return np.concatenate([values, negated]).astype(np.float32)


@cuda.jit
def narrow(pairs, f16_words, bf16_words):
    for i in range(cuda.grid(1), pairs.shape[0], cuda.gridsize(1)):
        f16_words[i] = ptx.f32x2_to_f16x2(pairs[i, 0], pairs[i, 1])
        bf16_words[i] = ptx.f32x2_to_bf16x2(pairs[i, 0], pairs[i, 1])


def test_f32_pairs_round_to_nearest_even_with_lo_in_the_low_half():
    rng = np.random.default_rng(RNG_SEED)
    values = rounding_cases("f16", rng)
    values = np.concatenate([values, rounding_cases("bf16", rng)])
    pairs = np.stack([values, np.roll(values, 7)], axis=1)   # every value as lo and as hi
    n = pairs.shape[0]
    f16_words, bf16_words = run(narrow, 2, 64, pairs, np.zeros(n, np.uint32),
                                np.zeros(n, np.uint32))[1:]
    for fmt, words, nan_exponent in (("f16", f16_words, 0x7C00), ("bf16", bf16_words, 0x7F80)):
        for half, shift in ((0, 0), (1, 16)):
            got = ((words >> shift) & 0xFFFF).astype(np.uint16)
            x = pairs[:, half]
            nan = np.isnan(x)
            want = round_nearest_even(x, fmt)
            bad = np.flatnonzero((got != want) & ~nan)
            assert bad.size == 0, (fmt, half, [(x[i], hex(got[i]), hex(want[i]))
                                               for i in bad[:5]])
            # NaN in, NaN out (payload unspecified): exponent all ones, mantissa not 0
            assert ((got[nan] & 0x7FFF) > nan_exponent).all(), (fmt, half)


@cuda.jit
def widen(words, f16_pairs, bf16_pairs):
    for i in range(cuda.grid(1), words.size, cuda.gridsize(1)):
        lo, hi = ptx.f16x2_to_f32(words[i])
        f16_pairs[i, 0] = lo
        f16_pairs[i, 1] = hi
        lo, hi = ptx.bf16x2_to_f32(words[i])
        bf16_pairs[i, 0] = lo
        bf16_pairs[i, 1] = hi


def test_f16_and_bf16_pairs_widen_exactly_every_bit_pattern():
    low = np.arange(2 ** 15, dtype=np.uint32)            # every pattern once: +x low,
    words = low | (low + 2 ** 15) << 16                  # -x high
    n = words.size
    f16_pairs, bf16_pairs = run(widen, 4, 64, words, np.zeros((n, 2), np.float32),
                                np.zeros((n, 2), np.float32))[1:]
    halves = np.stack([words & 0xFFFF, words >> 16], axis=1).astype(np.uint16)
    want = halves.view(np.float16).astype(np.float32)    # NumPy widens float16 exactly
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(f16_pairs), nan)
    np.testing.assert_array_equal(f16_pairs.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
    # bf16 is the top half of a float32: the bits must be exactly these, NaN payloads too
    np.testing.assert_array_equal(bf16_pairs.view(np.uint32), halves.astype(np.uint32) << 16)


@cuda.jit
def bitcasts(words, floats, as_float, as_word):
    i = cuda.grid(1)
    if i < words.size:
        as_float[i] = ptx.u32_as_f32(words[i])
        as_word[i] = ptx.f32_as_u32(floats[i])


def test_bitcasts_keep_every_bit():
    rng = np.random.default_rng(RNG_SEED)
    words = rng.integers(0, 2 ** 32, 64, dtype=np.uint64).astype(np.uint32)
    words[:4] = [0x7FC00001, 0xFF800000, 0x80000000, 0x00000001]   # NaN, -inf, -0, subnormal
    floats = rng.standard_normal(64).astype(np.float32)
    as_float, as_word = run(bitcasts, 2, 32, words, floats, np.zeros(64, np.float32),
                            np.zeros(64, np.uint32))[2:]
    np.testing.assert_array_equal(as_float.view(np.uint32), words)
    np.testing.assert_array_equal(as_word, floats.view(np.uint32))


@cuda.jit
def exp2s(xs, ys):
    i = cuda.grid(1)
    if i < xs.size:
        ys[i] = ptx.exp2_approx(xs[i])


def test_exp2_approx_is_close_to_exp2_and_flushes_what_is_not_normal():
    rng = np.random.default_rng(RNG_SEED)
    xs = np.concatenate([rng.uniform(-130, 128, 48), [0.0, 1.0, -1.0, 0.5, -125.9, -126.5,
                                                      -200.0, 1e-40]]).astype(np.float32)
    specials = np.array([-np.inf, np.inf, np.nan], np.float32)
    xs = np.concatenate([xs, specials])
    (ys,) = run(exp2s, 1, 64, xs, np.full(xs.size, -1.0, np.float32))[1:]
    want = np.exp2(xs.astype(np.float64))
    normal = np.isfinite(want) & (want >= 2.0 ** -126) & (want < 2.0 ** 128)
    np.testing.assert_allclose(ys[normal], want[normal], rtol=2.0 ** -21)
    assert (ys[want < 2.0 ** -126] == 0).all()             # flushed, -inf included
    assert ys[-2] == np.inf and np.isnan(ys[-1])
    assert ys[np.flatnonzero(xs == 1e-40)[0]] == 1.0         # a subnormal argument is 0


# --- shuffles ----------------------------------------------------------------------------

XOR_MASKS = np.array([0, 1, 2, 4, 8, 16, 31, 13], np.int32)


@cuda.jit
def shuffle(values, masks, sources, xor_out, idx_out, lanes):
    tid = cuda.threadIdx.x + cuda.blockIdx.x * cuda.blockDim.x
    value = values[tid]
    for j in range(masks.size):
        xor_out[j, tid] = ptx.shfl_xor(value, masks[j])
    for j in range(sources.shape[0]):
        idx_out[j, tid] = ptx.shfl_idx(value, sources[j, tid])
    lanes[tid] = cuda.laneid


def shuffle_case(dtype, threads, blocks, masks, rng):
    n = threads * blocks
    if dtype == np.float32:
        values = rng.standard_normal(n).astype(np.float32)
    else:
        info = np.iinfo(dtype)
        values = rng.integers(info.min, info.max, n, endpoint=True, dtype=np.int64).astype(dtype)
    warp_size = np.array([min(32, threads - (t % threads) // 32 * 32) for t in range(n)])
    sources = np.stack([np.zeros(n), rng.integers(0, warp_size), rng.integers(0, warp_size)
                        + 32 * rng.integers(1, 4, n)]).astype(np.int32)  # src % 32 counts
    xor_out, idx_out, lanes = run(
        shuffle, blocks, threads, values, masks, sources,
        np.zeros((masks.size, n), dtype), np.zeros((sources.shape[0], n), dtype),
        np.zeros(n, np.int32))[3:]
    tid = np.arange(n)
    lane = (tid % threads) % 32
    base = tid - lane
    np.testing.assert_array_equal(lanes, lane)
    for j, m in enumerate(masks):
        np.testing.assert_array_equal(xor_out[j], values[base + (lane ^ m)], err_msg=f"xor {m}")
    for j in range(sources.shape[0]):
        np.testing.assert_array_equal(idx_out[j], values[base + sources[j] % 32])


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.uint32])
def test_shuffles_exchange_within_each_warp(dtype):
    shuffle_case(dtype, threads=64, blocks=2, masks=XOR_MASKS,
                 rng=np.random.default_rng(RNG_SEED))


def test_shuffles_in_a_partial_warp_read_its_existing_lanes():
    """48 threads: the second warp has 16 lanes; masks below 16 stay among them."""
    shuffle_case(np.float32, threads=48, blocks=1, masks=XOR_MASKS[XOR_MASKS < 16],
                 rng=np.random.default_rng(RNG_SEED))


# --- ldmatrix ----------------------------------------------------------------------------

TILE_ELEMENTS = 512


@cuda.jit
def load_matrices(tile_in, row_starts, registers, trans):
    lane = cuda.threadIdx.x
    tile = cuda.shared.array(TILE_ELEMENTS, np.uint16)
    for e in range(lane, tile_in.size, 32):
        tile[e] = tile_in[e]
    cuda.syncthreads()
    if trans:
        r = tensorcore.ldmatrix_x4_trans(tile, row_starts[lane])
    else:
        r = tensorcore.ldmatrix_x4(tile, row_starts[lane])
    registers[lane, 0] = r[0]
    registers[lane, 1] = r[1]
    registers[lane, 2] = r[2]
    registers[lane, 3] = r[3]


def ldmatrix_expected(tile, row_starts, trans):
    """The PTX ldmatrix table: lane l supplies row l % 8 of matrix l // 8; register i
    of lane l holds M_i[l // 4][2 (l % 4) + (0, 1)], or M_i[2 (l % 4) + (0, 1)][l // 4]
    with .trans, the first element in the low half."""
    want = np.zeros((32, 4), np.uint32)
    for i in range(4):
        m = np.array([tile[row_starts[8 * i + r]:row_starts[8 * i + r] + 8] for r in range(8)])
        for lane in range(32):
            g, t = lane_parts(lane)
            pair = m[2 * t:2 * t + 2, g] if trans else m[g, 2 * t:2 * t + 2]
            want[lane, i] = pack(*pair)
    return want


@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("layout", ["scattered rows", "padded 16x16"])
def test_ldmatrix_x4_gives_each_lane_its_fragment(layout, trans):
    rng = np.random.default_rng(RNG_SEED)
    tile = rng.integers(0, 2 ** 16, TILE_ELEMENTS, dtype=np.uint16)
    if layout == "scattered rows":   # any 16-byte aligned row address per lane
        row_starts = rng.permutation(TILE_ELEMENTS // 8)[:32] * 8
    else:                            # a 16x16 block at (3, 8) of a tile with 24-element rows
        lane = np.arange(32)
        row_starts = (3 + lane % 16) * 24 + 8 + (lane // 16) * 8
    row_starts = row_starts.astype(np.int32)
    (registers,) = run(load_matrices, 1, 32, tile, row_starts, np.zeros((32, 4), np.uint32),
                       trans)[2:]
    np.testing.assert_array_equal(registers, ldmatrix_expected(tile, row_starts, trans))


@cuda.jit
def reload_matrices(rounds, registers):
    """The same ldmatrix address once per round, the tile rewritten in between: each
    load must see the tile as it is then (not merged, not hoisted out of the loop)."""
    lane = cuda.threadIdx.x
    tile = cuda.shared.array(256, np.uint16)
    for k in range(rounds):
        for e in range(lane, 256, 32):
            tile[e] = k * 256 + e
        cuda.syncthreads()
        r = tensorcore.ldmatrix_x4(tile, lane * 8)
        registers[k, lane] = r[0]
        cuda.syncthreads()


def test_ldmatrix_reads_the_tile_as_it_is_at_each_call():
    rounds = 3
    (registers,) = run(reload_matrices, 1, 32, rounds, np.zeros((rounds, 32), np.uint32))
    for k in range(rounds):
        tile = (k * 256 + np.arange(256)).astype(np.uint16)
        want = ldmatrix_expected(tile, np.arange(32) * 8, trans=False)[:, 0]
        np.testing.assert_array_equal(registers[k], want)


# --- mma.m16n8k16 ------------------------------------------------------------------------
# The PTX tables, per lane (g, t = groupID, threadID_in_group), each register pair
# (row, col) of its first element, the second one column (A, C) or row (B) further.

def a_places(lane):
    g, t = lane_parts(lane)
    return [(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]


def b_places(lane):
    g, t = lane_parts(lane)
    return [(2 * t, g), (2 * t + 8, g)]


def c_places(lane):
    g, t = lane_parts(lane)
    return [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]


def a_registers(bits):
    return np.array([[pack(bits[r, c], bits[r, c + 1]) for r, c in a_places(lane)]
                     for lane in range(32)], np.uint32)


def b_registers(bits):
    return np.array([[pack(bits[r, c], bits[r + 1, c]) for r, c in b_places(lane)]
                     for lane in range(32)], np.uint32)


def c_registers(c):
    return np.array([[c[r, col] for r, col in c_places(lane)] for lane in range(32)],
                    np.float32)


def gather_d(registers):
    d = np.full((16, 8), np.nan, np.float32)
    for lane in range(32):
        for j, (r, c) in enumerate(c_places(lane)):
            d[r, c] = registers[lane, j]
    return d


@cuda.jit
def multiply(a, b, c, d, bf16):
    tid = cuda.threadIdx.x + cuda.blockIdx.x * cuda.blockDim.x   # each warp its own problem
    if bf16:
        d0, d1, d2, d3 = tensorcore.mma_bf16_f32(a[tid, 0], a[tid, 1], a[tid, 2], a[tid, 3],
                                          b[tid, 0], b[tid, 1],
                                          c[tid, 0], c[tid, 1], c[tid, 2], c[tid, 3])
    else:
        d0, d1, d2, d3 = tensorcore.mma_f16_f32(a[tid, 0], a[tid, 1], a[tid, 2], a[tid, 3],
                                         b[tid, 0], b[tid, 1],
                                         c[tid, 0], c[tid, 1], c[tid, 2], c[tid, 3])
    d[tid, 0] = d0
    d[tid, 1] = d1
    d[tid, 2] = d2
    d[tid, 3] = d3


def to_bits(x, fmt):
    """uint16 bits of float32 `x` in format `fmt` (rounded to nearest even)."""
    return round_nearest_even(np.asarray(x, np.float32), fmt)


@pytest.mark.parametrize("fmt", ["f16", "bf16"])
@pytest.mark.parametrize("data", ["small integers", "normal"])
def test_mma_m16n8k16_computes_a_b_plus_c_per_the_fragment_tables(fmt, data):
    rng = np.random.default_rng(RNG_SEED)
    problems = 4                                            # 2 blocks of 2 warps
    draw = ((lambda *s: rng.integers(-8, 9, s)) if data == "small integers"
            else (lambda *s: rng.standard_normal(s)))
    decode = FORMATS[fmt][0]
    a_bits = [to_bits(draw(16, 16), fmt) for _ in range(problems)]
    b_bits = [to_bits(draw(16, 8), fmt) for _ in range(problems)]
    cs = [(draw(16, 8) * 4).astype(np.float32) for _ in range(problems)]
    d = run(multiply, 2, 64, np.concatenate([a_registers(x) for x in a_bits]),
            np.concatenate([b_registers(x) for x in b_bits]),
            np.concatenate([c_registers(x) for x in cs]), np.zeros((32 * problems, 4),
                                                                     np.float32),
            fmt == "bf16")[3]
    for p in range(problems):
        a, b = decode(a_bits[p]), decode(b_bits[p])
        got = gather_d(d[32 * p:32 * (p + 1)])
        want = a @ b + cs[p]
        if data == "small integers":                        # exact in any float32 order
            np.testing.assert_array_equal(got, want)
        else:                                               # float32 accumulation
            bound = 2.0 ** -18 * (np.abs(a) @ np.abs(b) + np.abs(cs[p]))
            assert (np.abs(got - want) <= bound).all(), np.abs(got - want).max()


# --- cp.async + ldmatrix + mma: the prefill kernel's pattern -----------------------------

STRIDE = 24                     # padded row pitch: 48 bytes, rows stay 16-byte aligned
TILE = 16 * STRIDE
TILES = 4 * TILE                # a shared array's shape must be a constant, not an expression


@cuda.jit
def attention_tiles(qkvp, s_out, o_out):
    """One warp: S = Q @ K^T and O = P @ V for 16x16 float16 tiles Q, K, V, P
    (`qkvp[0..3]`), staged into padded shared tiles with cp.async."""
    lane = cuda.threadIdx.x
    tiles = cuda.shared.array(TILES, np.float16)
    for chunk in range(lane, 4 * 16 * 2, 32):          # 16-byte chunks: (tile, row, half)
        row = chunk // 2                                 # row of the 64 stacked rows
        col = (chunk % 2) * 8
        tensorcore.cp_async_16(tiles, row * STRIDE + col, qkvp, row * 16 + col)
    tensorcore.cp_async_commit()
    tensorcore.cp_async_wait(0)
    cuda.syncthreads()
    q, k, v, p = 0, TILE, 2 * TILE, 3 * TILE
    # A operands: lane l supplies row l % 16, columns 8 (l // 16) onwards
    a_row = (lane % 16) * STRIDE + (lane // 16) * 8
    qa = tensorcore.ldmatrix_x4(tiles, q + a_row)
    pa = tensorcore.ldmatrix_x4(tiles, p + a_row)
    # B = K^T from K's rows (non-trans): key l % 8 + 8 (l // 16), dims 8 (l // 8 % 2) on
    kb = tensorcore.ldmatrix_x4(tiles, k + (lane % 8 + 8 * (lane // 16)) * STRIDE
                         + (lane // 8 % 2) * 8)
    # B = V (trans): key l % 16, dims 8 (l // 16) on
    vb = tensorcore.ldmatrix_x4_trans(tiles, v + a_row)
    for n in range(2):                                  # keys (S) or dims (O) 8n .. 8n + 7
        s = tensorcore.mma_f16_f32(qa[0], qa[1], qa[2], qa[3], kb[2 * n], kb[2 * n + 1],
                            0.0, 0.0, 0.0, 0.0)
        o = tensorcore.mma_f16_f32(pa[0], pa[1], pa[2], pa[3], vb[2 * n], vb[2 * n + 1],
                            0.0, 0.0, 0.0, 0.0)
        for j in range(4):
            s_out[n, lane, j] = s[j]
            o_out[n, lane, j] = o[j]


def test_ldmatrix_fragments_feed_mma_as_the_prefill_kernel_uses_them():
    rng = np.random.default_rng(RNG_SEED)
    qkvp = rng.standard_normal((4, 16, 16)).astype(np.float16)
    s_regs, o_regs = run(attention_tiles, 1, 32, qkvp, np.zeros((2, 32, 4), np.float32),
                         np.zeros((2, 32, 4), np.float32))[1:]
    s = np.concatenate([gather_d(s_regs[n]) for n in range(2)], axis=1)
    o = np.concatenate([gather_d(o_regs[n]) for n in range(2)], axis=1)
    q, k, v, p = qkvp.astype(np.float64)
    for got, want, (x, y) in ((s, q @ k.T, (q, k.T)), (o, p @ v, (p, v))):
        bound = 2.0 ** -18 * (np.abs(x) @ np.abs(y))
        assert (np.abs(got - want) <= bound).all(), np.abs(got - want).max()


@cuda.jit
def async_round_trip(src, dst, first):
    """Two committed groups of 16-byte copies into shared memory, then back out."""
    tid = cuda.threadIdx.x
    staged = cuda.shared.array(256, np.float32)
    tensorcore.cp_async_16(staged, tid * 4, src, first + tid * 4)              # group 1
    tensorcore.cp_async_commit()
    tensorcore.cp_async_16(staged, 128 + tid * 4, src, first + 128 + tid * 4)  # group 2
    tensorcore.cp_async_commit()
    tensorcore.cp_async_wait(1)                                                # group 1 landed
    cuda.syncthreads()
    for e in range(tid, 128, 32):
        dst[e] = staged[e]
    tensorcore.cp_async_wait(0)                                                # all landed
    cuda.syncthreads()
    for e in range(128 + tid, 256, 32):
        dst[e] = staged[e]


def test_cp_async_copies_global_to_shared():
    rng = np.random.default_rng(RNG_SEED)
    src = rng.standard_normal(300).astype(np.float32)
    first = 12                                           # 48 bytes in: still 16-aligned
    (dst,) = run(async_round_trip, 1, 32, src, np.zeros(256, np.float32), first)[1:]
    np.testing.assert_array_equal(dst, src[first:first + 256])


# --- the simulator's own checks ----------------------------------------------------------

@only_simulator
def test_simulated_16_byte_access_refuses_a_misaligned_address():
    src = np.zeros(16, np.float32)
    starts = np.array([2], np.int64)                     # 8 bytes in
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        run(copy16, 1, 1, src, src.copy(), starts, np.zeros((1, 4), np.uint32), True)


@cuda.jit
def lane_leaves_early(values, out):
    tid = cuda.threadIdx.x
    if tid == 5:
        return
    out[tid] = ptx.shfl_xor(values[tid], 1)


@cuda.jit
def lanes_disagree(values, out):
    tid = cuda.threadIdx.x
    if tid < 16:
        out[tid] = ptx.shfl_xor(values[tid], 1)
    else:
        a = ptx.f32_as_u32(values[tid])
        r = tensorcore.mma_f16_f32(a, a, a, a, a, a, 0.0, 0.0, 0.0, 0.0)
        out[tid] = r[0]


@cuda.jit
def lane_waits_at_syncthreads(values, out):
    tid = cuda.threadIdx.x
    if tid == 3:
        cuda.syncthreads()
    else:
        out[tid] = ptx.shfl_xor(values[tid], 1)
        cuda.syncthreads()


@only_simulator
# a lane that reaches the warp call after the failed round has closed finds the lanes
# that raised (and exited) missing instead: which message wins is a race
@pytest.mark.parametrize("kernel,message", [(lane_leaves_early, r"lane \d+ exited"),
                                            (lanes_disagree,
                                             r"while other lanes called|lane \d+ exited"),
                                            (lane_waits_at_syncthreads,
                                             r"lane 3 waits at syncthreads|lane \d+ exited")])
def test_simulated_warp_reports_lanes_that_do_not_join_and_then_works(kernel, message):
    from kvnumba.kernels.intrinsics.simwarp import WarpError

    values = np.arange(32, dtype=np.float32)
    with pytest.raises(WarpError, match=message):
        run(kernel, 1, 32, values, np.zeros(32, np.float32))
    # nothing of the failed launch is left behind: the next one is correct
    shuffle_case(np.float32, threads=32, blocks=1, masks=XOR_MASKS,
                 rng=np.random.default_rng(RNG_SEED))


@cuda.jit
def shuffle_after_barrier(values, out):
    tid = cuda.threadIdx.x
    cuda.syncthreads()
    out[tid] = ptx.shfl_xor(values[tid], 1)


@only_simulator
def test_a_lane_the_simulator_is_slow_to_release_from_a_barrier_is_waited_for(monkeypatch):
    """The simulator releases a barrier's threads one by one; on a loaded machine the
    last can look blocked at it for seconds while the first already wait in a shuffle.
    That lane is on its way (its warp passed the barrier), not stuck: the launch must
    wait for it, however long past `STUCK_S`, and give the shuffle's values."""
    import threading
    from kvnumba.kernels.intrinsics import simwarp

    monkeypatch.setattr(simwarp, "STUCK_S", 0.05)
    set_event, delayed = threading.Event.set, []

    def slow_release(event):             # the manager stalls after releasing one thread
        if not delayed and threading.get_ident() == threading.main_thread().ident:
            delayed.append(event)
            set_event(event)
            time.sleep(0.5)
            return
        set_event(event)

    monkeypatch.setattr(threading.Event, "set", slow_release)
    values = np.arange(32, dtype=np.float32)
    _, out = run(shuffle_after_barrier, 1, 32, values, np.zeros(32, np.float32))
    assert delayed, "the barrier was not released through Event.set"
    np.testing.assert_array_equal(out, values[np.arange(32) ^ 1])


# ---------------------------------------------------------------- element <-> float32
@cuda.jit
def _elements_round_trip(src, widened, dst):
    i = cuda.grid(1)
    if i < src.size:
        value = ptx.to_f32(src[i])
        widened[i] = value
        dst[i] = ptx.from_f32(value * 3.0, dst)


@pytest.mark.parametrize("src_dtype,dst_dtype", [
    (np.float16, np.float16), (np.float32, np.float16), (np.float16, np.float32),
    (np.uint16, np.uint16), (np.float32, np.uint16), (np.uint16, np.float32)])
def test_elements_widen_exactly_and_narrow_to_nearest_even(src_dtype, dst_dtype):
    rng = np.random.default_rng(31)
    if src_dtype == np.uint16:      # bfloat16 bit patterns, normal numbers and a few edges
        src = np.concatenate([rng.integers(0x0080, 0x7F00, 200, dtype=np.uint16),
                              rng.integers(0x8080, 0xFF00, 200, dtype=np.uint16),
                              np.array([0, 0x8000, 0x7F80, 0xFF80], np.uint16)])
        exact = (src.astype(np.uint32) << 16).view(np.float32)
    else:
        src = (rng.standard_normal(404) * 10).astype(src_dtype)
        src[:4] = [0.0, -0.0, 1e-3, 65000.0]
        exact = src.astype(np.float32)
    widened = cuda.to_device(np.zeros(src.size, np.float32))
    dst = cuda.to_device(np.zeros(src.size, dst_dtype))
    run(_elements_round_trip, 4, 128, src, widened, dst)
    assert widened.copy_to_host().tobytes() == exact.tobytes()
    tripled = (exact * np.float32(3.0)).astype(np.float32)
    with np.errstate(over="ignore"):
        want = (round_nearest_even(tripled, "bf16") if dst_dtype == np.uint16
                else tripled.astype(dst_dtype))
    assert dst.copy_to_host().tobytes() == want.tobytes()


# ---------------------------------------------------------------- cp.async zero-fill, byte views
@cuda.jit
def zfill_round_trip(src, dst, zero_every):
    """Each lane stages 16 bytes of `src`, or zeros on every `zero_every`-th lane."""
    lane = cuda.laneid
    staged = cuda.shared.array(256, np.float16)
    tensorcore.cp_async_16_zfill(staged, lane * 8, src, lane * 8, lane % zero_every == 0)
    tensorcore.cp_async_commit()
    tensorcore.cp_async_wait(0)
    cuda.syncthreads()
    for e in range(lane, 256, 32):
        dst[e] = staged[e]


def test_cp_async_zfill_copies_or_writes_zeros():
    rng = np.random.default_rng(RNG_SEED)
    src = rng.standard_normal(256).astype(np.float16)
    (dst,) = run(zfill_round_trip, 1, 32, src, np.full(256, np.nan, np.float16), 3)[1:]
    want = src.reshape(32, 8).copy()
    want[::3] = 0.0                                     # lanes 0, 3, 6, ...
    assert dst.tobytes() == want.tobytes()


@cuda.jit
def bytes_round_trip(src, first, dst, size):
    """Each lane stages the 16 bytes at byte offset 16 lane of `src` from element `first`."""
    lane = cuda.laneid
    view = ptx.bytes_from(src, first)
    staged = cuda.shared.array(128, np.float32)
    tensorcore.cp_async_16(staged, lane * 4, view, lane * 16)
    tensorcore.cp_async_commit()
    tensorcore.cp_async_wait(0)
    cuda.syncthreads()
    for e in range(lane, 128, 32):
        dst[e] = staged[e]
    if lane == 0:
        size[0] = view.size


def test_bytes_from_views_an_array_from_an_element_on_in_bytes():
    rng = np.random.default_rng(RNG_SEED)
    src = rng.standard_normal((9, 16)).astype(np.float32)
    first = 12                                           # 48 bytes in: still 16-aligned
    dst, size = run(bytes_round_trip, 1, 32, src, first, np.zeros(128, np.float32),
                    np.zeros(1, np.int64))[1:]
    np.testing.assert_array_equal(dst, src.reshape(-1)[first:first + 128])
    assert size[0] == (src.size - first) * 4


@cuda.jit
def elements_round_trip(src, first, dst, size):
    """Each lane reads elements `lane` and `lane + 64` of `src` from element `first` on,
    and writes element `lane + 32` of the view into `src` itself (elements no lane
    reads)."""
    lane = cuda.laneid
    view = ptx.elements_from(src, first)
    dst[lane] = view[lane]
    dst[lane + 32] = view[lane + 64]
    view[lane + 32] = np.float32(lane)
    if lane == 0:
        size[0] = view.size


def test_elements_from_views_an_array_from_an_element_on():
    rng = np.random.default_rng(RNG_SEED)
    src = rng.standard_normal((9, 16)).astype(np.float32)
    want = src.reshape(-1).copy()
    first = 5
    src, dst, size = run(elements_round_trip, 1, 32, src, first,
                            np.zeros(64, np.float32), np.zeros(1, np.int64))
    np.testing.assert_array_equal(dst, np.concatenate([want[first:first + 32],
                                                       want[first + 64:first + 96]]))
    want[first + 32:first + 64] = np.arange(32)
    np.testing.assert_array_equal(src.reshape(-1), want)
    assert size[0] == src.size - first


@cuda.jit
def wide_products(a, b, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = ptx.mul_wide_u32(a[i], b[i])


def test_mul_wide_u32_keeps_every_bit_of_the_product():
    rng = np.random.default_rng(RNG_SEED)
    a = np.concatenate([rng.integers(0, 2**32, 60, dtype=np.uint64).astype(np.uint32),
                        np.array([0, 1, 0xFFFFFFFF, 0x80000000], np.uint32)])
    b = np.concatenate([rng.integers(0, 2**32, 60, dtype=np.uint64).astype(np.uint32),
                        np.array([0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 2], np.uint32)])
    (out,) = run(wide_products, 1, 64, a, b, np.zeros(64, np.uint64))[2:]
    assert [int(x) for x in out] == [int(x) * int(y) for x, y in zip(a, b)]


# ------------------------------------------------------- runs of float32 stored at once
@cuda.jit
def store_runs(values, pairs, quads):
    """Thread i stores values 4i .. 4i + 3 as two pairs and as one quad."""
    i = cuda.grid(1)
    if 4 * i < values.size:
        x = values[4 * i:4 * i + 4]
        ptx.st_f32x2(pairs, 4 * i, x[0], x[1])
        ptx.st_f32x2(pairs, 4 * i + 2, x[2], x[3])
        ptx.st_f32x4(quads, 4 * i, x[0], x[1], x[2], x[3])


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint16])
def test_float32_runs_store_as_elements_rounded_to_nearest_even(dtype):
    rng = np.random.default_rng(RNG_SEED)
    values = (rng.standard_normal(256) * 100).astype(np.float32)
    values[:8] = [0.0, -0.0, 1e-8, 70000.0, -70000.0, np.inf, 3.0e38, 1 + 2.0 ** -9]
    pairs, quads = run(store_runs, 2, 32, values, np.full(256, 7, dtype),
                       np.full(256, 7, dtype))[1:]
    with np.errstate(over="ignore"):
        want = (values.astype(np.float32) if dtype == np.float32 else
                round_nearest_even(values, "f16" if dtype == np.float16 else "bf16")
                .astype(np.uint16).view(dtype))
    assert pairs.tobytes() == want.tobytes()
    assert quads.tobytes() == want.tobytes()


@cuda.jit
def quad_at(out, index):
    ptx.st_f32x4(out, index, 1.0, 2.0, 3.0, 4.0)


@only_simulator
def test_simulated_runs_refuse_an_address_not_aligned_to_their_bytes():
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        run(quad_at, 1, 1, np.zeros(8, np.float32), 2)


# ------------------------------------------------------------------ byte permutes
@cuda.jit
def permuted(a, b, out):
    i = cuda.grid(1)
    if i < a.size:
        out[i, 0] = ptx.prmt(a[i], b[i], 0x3120)
        out[i, 1] = ptx.prmt(a[i], b[i], 0x1404)
        out[i, 2] = ptx.prmt(a[i], b[i], 0x7654)
        out[i, 3] = ptx.prmt(a[i], b[i], 0x0000)


def test_prmt_picks_each_byte_of_b_a_as_its_selector_says():
    rng = np.random.default_rng(RNG_SEED)
    a = rng.integers(0, 2**32, 64, dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 2**32, 64, dtype=np.uint64).astype(np.uint32)
    (out,) = run(permuted, 1, 64, a, b, np.zeros((64, 4), np.uint32))[2:]
    for i in range(64):
        pool = int(a[i]).to_bytes(4, "little") + int(b[i]).to_bytes(4, "little")
        for k, picks in enumerate([(0, 2, 1, 3), (4, 0, 4, 1), (4, 5, 6, 7), (0, 0, 0, 0)]):
            assert int(out[i, k]) == int.from_bytes(bytes(pool[p] for p in picks), "little")


# ------------------------------------------------------------ 8-byte shared loads
@cuda.jit
def shared_pairs(src, out):
    """Each lane stages 16 bytes, then loads the 8 bytes at element 4 (lane ^ 5)."""
    lane = cuda.laneid
    staged = cuda.shared.array(256, np.uint16)
    tensorcore.cp_async_16(staged, lane * 8, src, lane * 8)
    tensorcore.cp_async_commit()
    tensorcore.cp_async_wait(0)
    cuda.syncthreads()
    u0, u1 = tensorcore.ld_shared_v2(staged, 4 * (lane ^ 5))
    out[lane, 0] = u0
    out[lane, 1] = u1


def test_ld_shared_v2_gives_a_lane_its_own_8_bytes():
    rng = np.random.default_rng(RNG_SEED)
    src = rng.integers(0, 2**16, 256, dtype=np.uint32).astype(np.uint16)
    (out,) = run(shared_pairs, 1, 32, src, np.zeros((32, 2), np.uint32))[1:]
    words = src.view(np.uint32)
    for lane in range(32):
        assert list(out[lane]) == list(words[2 * (lane ^ 5):2 * (lane ^ 5) + 2])
