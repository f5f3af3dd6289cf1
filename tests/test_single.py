"""SequenceCache and SequenceBatchControl (contract §10)."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvnumba as kv

H, D, NQ = 1, 4, 2  # kv heads, head_dim, query heads: tiny for the simulator
W, M = 3, 4         # ring window, max_write


def config(max_seqs=1, **kw):
    cfg = dict(layers=[kv.flat(), kv.ring(window=W)], n_kv_heads=H, head_dim=D, capacity=24,
               max_seqs=max_seqs, max_write=M, max_step=8, dtype="float32", initial_pages=4, page_size=8)
    cfg.update(kw)
    return kv.CacheConfig(**cfg)


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def cache_snapshot(c):
    return c.state, c.pos, c.high_water, c.floor, c.step_state


# ---------------------------------------------------------------- SequenceCache
def test_requires_max_seqs_1():
    with pytest.raises(kv.ConfigError, match="max_seqs=2"):
        kv.SequenceCache(config(max_seqs=2))


def test_fresh_cache_faces():
    c = kv.SequenceCache(config())
    assert (c.pos, c.floor, c.high_water, c.capacity) == (0, 0, 0, 24)
    assert c.state == kv.SlotState.CLAIMED and c.step_state == kv.StepState.IDLE
    assert c.config.max_seqs == 1
    for layer in range(2):
        k, v = c.layer_data(layer)
        # initial_pages (the ring's capped at its bound: a ring of 1 page + 1), page_size
        assert k.shape == v.shape == ((4, 2)[layer], 8, H, D)


@pytest.mark.parametrize("dtype, itemsize", [("float32", 4), ("float16", 2)])
def test_nbytes_has_no_scratch_page(dtype, itemsize):
    cfg = config(layers=[kv.flat(), kv.ring(window=W), kv.flat()], n_kv_heads=2, head_dim=8,
                 dtype=dtype, initial_pages=3, page_size=8)
    c = kv.SequenceCache(cfg)
    page = 8 * 2 * 8 * itemsize * 2                 # positions x heads x dim x bytes, K and V
    # 3 pages in each flat layer; the ring's pool capped at its bound: a ring of 1 page + 1
    assert c.nbytes == (3 + 2 + 3) * page
    # held: the ring's ceil((W + M - 1) / 8) = 1 page; no scratch page, no flat page yet
    assert c.nbytes_held == 1 * page
    c.declare_step(M)
    c.prepare_step()
    for layer in range(3):
        x = np.zeros((M, 2, 8), np.dtype(dtype))
        c.write(layer, x, x)
    c.commit_step()
    assert c.nbytes_held == (1 + 2) * page          # + one flat page in each flat layer


def ref_attention(keys, values, q, positions, window, scale):
    """Each query at position p sees keys j with max(0, p - W + 1) <= j <= p."""
    out = np.zeros_like(q, dtype=np.float64)
    group = q.shape[1] // keys.shape[1]
    for i, p in enumerate(positions):
        lo = 0 if window is None else max(0, p - window + 1)
        for h in range(q.shape[1]):
            kk, vv = keys[lo:p + 1, h // group], values[lo:p + 1, h // group]
            s = kk.astype(np.float64) @ q[i, h] * scale
            w = np.exp(s - s.max())
            out[i, h] = (w / w.sum()) @ vv
    return out


def test_steps_with_padding_write_only_real_tokens_and_attend_causally():
    c = kv.SequenceCache(config())
    rng = np.random.default_rng(0)
    hist_k = {layer: np.zeros((24, H, D), np.float32) for layer in range(2)}
    hist_v = {layer: np.zeros((24, H, D), np.float32) for layer in range(2)}
    for n, width in [(4, 7), (1, 3), (3, 3), (2, 8)]:
        start = c.pos
        plan = c.declare_step(n)
        assert plan.n_tokens == n and plan.width is None
        plan = c.prepare_step(width)
        assert plan.seq_cols.tolist() == [0] * n + [-1] * (width - n)
        assert plan.positions.tolist() == list(range(start, start + n)) + [0] * (width - n)
        for layer, window in ((0, None), (1, W)):
            q, k, v = rand(rng, width, NQ, D), rand(rng, width, H, D), rand(rng, width, H, D)
            out = c.update_and_attend(layer, q, k, v)
            hist_k[layer][start:start + n], hist_v[layer][start:start + n] = k[:n], v[:n]
            want = ref_attention(hist_k[layer], hist_v[layer], q[:n],
                                 range(start, start + n), window, 1 / math.sqrt(D))
            np.testing.assert_allclose(out[:n], want, atol=1e-5)
            assert not out[n:].any()  # padding rows are zero
        c.commit_step()
        assert c.pos == start + n and c.high_water == start + n
    # padding (position 0, column -1) never overwrote position 0
    pos, k, v = c.sequence_kv(0)
    assert pos.tolist() == list(range(10))
    assert k.tobytes() == hist_k[0][:10].tobytes() and v.tobytes() == hist_v[0][:10].tobytes()
    R = W + M - 1
    pos, k, _ = c.sequence_kv(1)
    assert pos.tolist() == list(range(10 - R, 10))
    assert k.tobytes() == hist_k[1][10 - R:10].tobytes()


def test_rewind_clear_abort_and_refusals_change_nothing():
    c = kv.SequenceCache(config())
    before = cache_snapshot(c)
    with pytest.raises(kv.SlotStateError, match="CLAIMED"):
        c.rewind(0)  # nothing to rewind into yet
    with pytest.raises(kv.ShapeError):
        c.declare_step(0)
    with pytest.raises(kv.CapacityError, match="max_write 4"):
        c.declare_step(M + 1)
    with pytest.raises(kv.StepProtocolError):
        c.commit_step()
    assert cache_snapshot(c) == before

    for _ in range(3):
        c.declare_step(M)
        c.prepare_step()
        c.commit_step()
    assert (c.pos, c.high_water, c.floor) == (12, 12, 12 - M)  # ring R = 6 wrapped
    before = cache_snapshot(c)
    with pytest.raises(kv.RingFloorError, match=f"floor {12 - M}"):
        c.rewind(12 - M - 1)
    with pytest.raises(kv.PositionError, match="13"):
        c.rewind(13)
    assert cache_snapshot(c) == before
    c.rewind(9)
    assert (c.pos, c.high_water, c.state) == (9, 12, kv.SlotState.REWOUND)

    c.declare_step(2, block=True)
    assert c.plan.segments[0].block and c.state == kv.SlotState.PREFILLING
    before = cache_snapshot(c)
    for verb in (lambda: c.rewind(8), c.clear, lambda: c.declare_step(1)):
        with pytest.raises(kv.StepProtocolError):
            verb()
    assert cache_snapshot(c) == before
    c.abort_step()  # declared, not prepared: nothing moves
    assert (c.pos, c.high_water, c.state) == (9, 12, kv.SlotState.REWOUND)
    with pytest.raises(kv.CapacityError, match="capacity 24"):
        for _ in range(5):
            c.declare_step(M)
            c.prepare_step()
            c.commit_step()
    assert c.pos == 21 and c.step_state == kv.StepState.IDLE

    c.clear()
    assert (c.pos, c.high_water, c.floor, c.state) == (0, 0, 0, kv.SlotState.CLAIMED)
    assert c.sequence_kv(0)[0].size == 0


# ---------------------------------------------------------------- SequenceBatchControl
def test_control_frees_an_empty_cache_and_claims_on_seq_new():
    cache = kv.SequenceCache(config())
    ctl = kv.SequenceBatchControl(cache)
    assert ctl.max_seqs == 1 and ctl.state(0) == kv.SlotState.FREE
    assert ctl.seq_new() == 0 and ctl.state(0) == kv.SlotState.CLAIMED
    with pytest.raises(kv.CacheFullError, match="1 sequence"):
        ctl.seq_new()
    ctl.declare_step([0, 0, 0])
    ctl.prepare_step(5)
    for layer in range(2):
        ctl.write(layer, np.ones((5, H, D), np.float32), np.ones((5, H, D), np.float32))
    ctl.commit_step()
    assert (ctl.pos(0), ctl.high_water(0), cache.pos) == (3, 3, 3)
    with pytest.raises(kv.UnknownSequenceError):
        ctl.pos(1)
    with pytest.raises(kv.UnknownSequenceError):
        ctl.declare_step([1])
    assert ctl.step_state == kv.StepState.IDLE
    before = (ctl.state(0), ctl.pos(0), ctl.high_water(0))
    with pytest.raises(kv.CloneRefusedError, match="max_seqs 1"):
        ctl.seq_clone(0, 2)
    assert (ctl.state(0), ctl.pos(0), ctl.high_water(0)) == before
    ctl.rewind(0, 1)
    assert cache.pos == 1 and ctl.state(0) == kv.SlotState.REWOUND
    ctl.seq_rm(0)
    assert (ctl.state(0), ctl.pos(0), ctl.high_water(0)) == (kv.SlotState.FREE, 0, 0)
    with pytest.raises(kv.FreeSequenceError):
        ctl.rewind(0, 0)
    with pytest.raises(kv.FreeSequenceError):
        cache.declare_step(1)
    assert ctl.seq_new() == 0 and cache.pos == 0


def test_control_adopts_a_live_sequence():
    cache = kv.SequenceCache(config())
    cache.declare_step(2)
    cache.prepare_step()
    cache.commit_step()
    ctl = kv.SequenceBatchControl(cache)
    assert ctl.state(0) == kv.SlotState.COMMITTED and ctl.pos(0) == 2
    with pytest.raises(kv.CacheFullError):
        ctl.seq_new()
    assert ctl.pos(0) == 2


# ---------------------------------------------------------------- the same steps, two caches
@st.composite
def programs(draw):
    ops = []
    for _ in range(draw(st.integers(2, 5))):
        ops.append(dict(rewind=draw(st.none() | st.floats(0, 1)), n=draw(st.integers(1, M)),
                        pad=draw(st.integers(0, 3)), layer=draw(st.integers(0, 1)),
                        abort=draw(st.booleans()) and draw(st.booleans()),
                        seed=draw(st.integers(0, 2**16))))
    return ops


@settings(max_examples=8 if settings.default.max_examples > 25 else 5)
@given(programs())
def test_single_control_matches_one_sequence_of_a_batched_cache(program):
    one = kv.SequenceBatchControl(kv.SequenceCache(config()))
    many = kv.BatchedSequenceCache(config(max_seqs=3))
    assert one.seq_new() == 0
    assert [many.seq_new() for _ in range(3)] == [0, 1, 2]
    # the neighbours hold data and then stay idle; ours is column 1
    many.declare_step([0, 0, 2])
    many.prepare_step(4)
    for layer in range(2):
        many.write(layer, np.full((4, H, D), 7, np.float32), np.full((4, H, D), 7, np.float32))
    many.commit_step()
    pairs = ((one, 0), (many, 1))
    for op in program:
        if op["rewind"] is not None and one.state(0) in (kv.SlotState.COMMITTED,
                                                          kv.SlotState.REWOUND):
            lo, hi = one.floor(0), one.pos(0)
            target = lo + int(round(op["rewind"] * (hi - lo)))
            for ctl, seq in pairs:
                ctl.rewind(seq, target)
        n = min(op["n"], 24 - one.pos(0))
        if n == 0:
            continue
        width = min(n + op["pad"], 8)
        rng = np.random.default_rng(op["seed"])
        q = [rand(rng, width, NQ, D) for _ in range(2)]
        kvs = [(rand(rng, width, H, D), rand(rng, width, H, D)) for _ in range(2)]
        outs = []
        for ctl, seq in pairs:
            ctl.declare_step([seq] * n)
            ctl.prepare_step(width)
            for layer in range(2):
                ctl.write(layer, *kvs[layer])
            outs.append(ctl.attend(op["layer"], q[op["layer"]]))
            ctl.abort_step() if op["abort"] else ctl.commit_step()
        np.testing.assert_allclose(outs[0], outs[1], rtol=0, atol=1e-6)
        assert not outs[0][n:].any()
        assert [(c.state(s), c.pos(s), c.high_water(s), c.floor(s)) for c, s in pairs][0] == \
            [(c.state(s), c.pos(s), c.high_water(s), c.floor(s)) for c, s in pairs][1]
        for layer in range(2):
            a, b = one.sequence_kv(0, layer), many.sequence_kv(1, layer)
            assert all(np.array_equal(x, y) for x, y in zip(a, b))
    # the idle neighbours were never touched
    assert [(many.pos(s), many.high_water(s)) for s in (0, 2)] == [(2, 2), (1, 1)]
    assert (many.sequence_kv(0, 0)[1] == 7).all()
