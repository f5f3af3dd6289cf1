"""A sequence named in several spans of one step (`[a, b, a]`).

Differential: the same tokens, declared as interleaved spans in one step or as each
sequence alone, give the same positions, committed state, stored bytes and
attention outputs (both also checked against the float64 reference built from the
test's own histories), on a flat and a ring layer, across a ring wrap inside the
step, with padding. Over 8-bit float storage, against the same reference over the
quantised K/V (tests/fp8ref.py's quantiser).
"""
import copy

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvnumba as kv
from fp8ref import quantised
from oracle import dense_attention

WINDOWS = (None, 3)                 # a flat layer and a ring layer: R = 3 + 6 - 1 = 8
H, HQ, D = 1, 2, 4
MAX_WRITE, MAX_STEP, CAPACITY = 6, 12, 32
SCALE = 1 / np.sqrt(D)
EXAMPLES = max(6, settings.default.max_examples // 4)


def make(dtype="float32", **scales):
    config = kv.CacheConfig(layers=[kv.flat() if w is None else kv.ring(window=w)
                                    for w in WINDOWS], n_kv_heads=H, head_dim=D,
                            capacity=CAPACITY, max_seqs=3, max_write=MAX_WRITE,
                            max_step=MAX_STEP, dtype=dtype, initial_pages=4, **scales)
    return kv.BatchedSequenceCache(config)


class Tokens:
    """q, k, v of a sequence's tokens on every layer: `[layer][n, heads, D]`."""

    def __init__(self, rng, n):
        self.q = [rng.standard_normal((n, HQ, D)).astype(np.float32) for _ in WINDOWS]
        self.k = [rng.standard_normal((n, H, D)).astype(np.float32) for _ in WINDOWS]
        self.v = [rng.standard_normal((n, H, D)).astype(np.float32) for _ in WINDOWS]


def run_step(cache, order, tokens, width=None):
    """One step whose token t is token `order[t][1]` of sequence `order[t][0]`.

    Returns each layer's output `[n, HQ, D]` (padding checked zero and dropped)."""
    ids = [s for s, _ in order]
    cache.declare_step(ids)
    plan = cache.prepare_step(width)
    n = len(order)
    outs = []
    for layer in range(len(WINDOWS)):
        def gather(field, heads):
            rows = np.zeros((plan.width, heads, D), np.float32)
            rows[:n] = [getattr(tokens[s], field)[layer][i] for s, i in order]
            return rows
        out = cache.update_and_attend(layer, gather("q", HQ), gather("k", H), gather("v", H))
        assert not out[n:].any(), "padding rows must be zero"
        outs.append(out[:n])
    cache.commit_step()
    return plan, outs


def reference(history, new, seq, layer, window):
    """float64 attention of `seq`'s new tokens over its history plus the new tokens."""
    keys = np.concatenate([history[seq].k[layer], new[seq].k[layer]])
    values = np.concatenate([history[seq].v[layer], new[seq].v[layer]])
    pos_start = len(history[seq].k[layer])
    return dense_attention(new[seq].q[layer], keys, values, pos_start, window, False, SCALE)


def with_history(rng, hist_lens, **storage):
    """A cache (`make(**storage)`) whose sequences hold `hist_lens` positions, and those
    positions' tokens."""
    cache = make(**storage)
    history = {}
    for seq, n in enumerate(hist_lens):
        assert cache.seq_new() == seq
        history[seq] = Tokens(rng, n)
        for start in range(0, n, MAX_WRITE):
            run_step(cache, [(seq, i) for i in range(start, min(n, start + MAX_WRITE))],
                     history)
    return cache, history


def spans_of(data, new_lens):
    """An interleaving of every sequence's new tokens in spans, each sequence's order kept."""
    pieces = []
    for seq, n in enumerate(new_lens):
        cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), max_size=2), label="cuts")) \
            if n > 1 else []
        bounds = [0] + cuts + [n]
        pieces.append([[(seq, i) for i in range(a, b)] for a, b in zip(bounds, bounds[1:])])
    order = data.draw(st.permutations([s for s, p in enumerate(pieces) for _ in p]),
                      label="interleaving")
    taken = [0] * len(pieces)
    tokens = []
    for seq in order:
        tokens += pieces[seq][taken[seq]]
        taken[seq] += 1
    return tokens


@settings(max_examples=EXAMPLES)
@given(data=st.data(),
       hist_lens=st.lists(st.integers(0, 9), min_size=2, max_size=3),
       pad=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_interleaved_spans_equal_each_sequence_alone(data, hist_lens, pad, seed):
    new_lens = data.draw(st.lists(st.integers(1, MAX_WRITE), min_size=len(hist_lens),
                                  max_size=len(hist_lens)).filter(lambda n: sum(n) <= MAX_STEP),
                         label="new_lens")
    rng = np.random.default_rng(seed)
    split, history = with_history(rng, hist_lens)
    alone, _ = with_history(np.random.default_rng(seed), hist_lens)
    new = {seq: Tokens(rng, n) for seq, n in enumerate(new_lens)}
    order = spans_of(data, new_lens)
    width = min(MAX_STEP, len(order) + pad)
    plan, split_outs = run_step(split, order, new, width)

    # the spans are the maximal runs of one id in `order`; each starts where the
    # sequence's earlier spans stopped, and its last token is its logit row
    ends = [t for t in range(len(order)) if t + 1 == len(order) or order[t + 1][0] != order[t][0]]
    starts = [0] + [t + 1 for t in ends[:-1]]
    cursor = {seq: n for seq, n in enumerate(hist_lens)}
    expect = []
    for a, b in zip(starts, ends):
        seq = order[a][0]
        expect.append((seq, a, b - a + 1, cursor[seq]))
        cursor[seq] += b - a + 1
    assert [(g.seq, g.q_start, g.q_len, g.pos_start) for g in plan.segments] == expect
    assert plan.positions[:len(order)].tolist() == [hist_lens[s] + i for s, i in order]
    assert plan.logit_indices.tolist() == ends

    for seq, n in enumerate(new_lens):
        _, alone_outs = run_step(alone, [(seq, i) for i in range(n)], new)
        rows = [t for t, (s, _) in enumerate(order) if s == seq]
        for layer, window in enumerate(WINDOWS):
            want = reference(history, new, seq, layer, window)
            np.testing.assert_allclose(split_outs[layer][rows], want, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(alone_outs[layer], want, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(split_outs[layer][rows], alone_outs[layer], rtol=1e-5,
                                       atol=1e-6)
    for seq in range(len(hist_lens)):
        assert split.pos(seq) == alone.pos(seq) == hist_lens[seq] + new_lens[seq]
        assert split.high_water(seq) == alone.high_water(seq)
        assert split.state(seq) == alone.state(seq) == kv.SlotState.COMMITTED
        for layer in range(len(WINDOWS)):
            got, want = split.sequence_kv(seq, layer), alone.sequence_kv(seq, layer)
            assert got[0].tolist() == want[0].tolist()
            assert got[1].tobytes() == want[1].tobytes() and got[2].tobytes() == want[2].tobytes()


def test_a_b_a_runs_and_matches_each_sequence_alone():
    rng = np.random.default_rng(7)
    split, history = with_history(rng, [5, 2])
    alone, _ = with_history(np.random.default_rng(7), [5, 2])
    new = {0: Tokens(rng, 4), 1: Tokens(rng, 2)}
    order = [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3)]   # [a, a, b, b, a, a]
    plan, outs = run_step(split, order, new)
    assert [(g.seq, g.q_start, g.q_len, g.pos_start) for g in plan.segments] == \
        [(0, 0, 2, 5), (1, 2, 2, 2), (0, 4, 2, 7)]
    assert plan.logit_indices.tolist() == [1, 3, 5]
    for seq, rows in ((0, [0, 1, 4, 5]), (1, [2, 3])):
        _, ref = run_step(alone, [(seq, i) for i in range(len(rows))], new)
        for layer in range(len(WINDOWS)):
            np.testing.assert_allclose(outs[layer][rows], ref[layer], rtol=1e-5, atol=1e-6)
    assert (split.pos(0), split.pos(1)) == (9, 4)


def stored_as(tokens, dtype, k_scale, v_scale):
    """`tokens` with K and V as an fp8 cache holds them (`scale * stored`, float64), q as
    given."""
    held = copy.copy(tokens)
    held.k = [quantised(k, dtype, scale) for k, scale in zip(tokens.k, k_scale)]
    held.v = [quantised(v, dtype, scale) for v, scale in zip(tokens.v, v_scale)]
    return held


@pytest.mark.parametrize("dtype", ["float8_e4m3", "float8_e5m2"])
def test_interleaved_spans_over_fp8_storage_match_the_quantised_reference(dtype):
    """[a x5, b, a, b, b] over fp8 storage with per-layer scales (a's ring wraps inside
    the step; a prefill span of 5 tokens, decode spans of 1 and 2), with padding: every span's output matches the float64 attention over the quantised
    K/V, and equals each sequence's tokens alone; the stored values times the scales are
    the quantised reference's, and the same bytes as alone."""
    scales = {"k_scale": [0.3, 1.0], "v_scale": [1.0, 0.01]}
    rng = np.random.default_rng(11)
    split, history = with_history(rng, [6, 2], dtype=dtype, **scales)
    alone, _ = with_history(np.random.default_rng(11), [6, 2], dtype=dtype, **scales)
    new = {0: Tokens(rng, 6), 1: Tokens(rng, 3)}
    order = [(0, i) for i in range(5)] + [(1, 0), (0, 5), (1, 1), (1, 2)]
    plan, outs = run_step(split, order, new, width=11)
    assert [(g.seq, g.q_start, g.q_len, g.pos_start) for g in plan.segments] == \
        [(0, 0, 5, 6), (1, 5, 1, 2), (0, 6, 1, 11), (1, 7, 2, 3)]
    held = {seq: stored_as(t, dtype, **scales) for seq, t in history.items()}
    held_new = {seq: stored_as(t, dtype, **scales) for seq, t in new.items()}
    for seq in new:
        _, alone_outs = run_step(alone, [(seq, i) for i in range(len(new[seq].k[0]))], new)
        rows = [t for t, (s, _) in enumerate(order) if s == seq]
        for layer, window in enumerate(WINDOWS):
            want = reference(held, held_new, seq, layer, window)
            # float32 arithmetic over K/V of the inputs' magnitude, as at float32 storage,
            # plus two float32 roundings (softmax scale times k_scale, output times v_scale)
            np.testing.assert_allclose(outs[layer][rows], want, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(alone_outs[layer], want, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(outs[layer][rows], alone_outs[layer], rtol=1e-5,
                                       atol=1e-6)
            positions, k, v = split.sequence_kv(seq, layer)
            if window is not None and seq == 0:     # a's ring wrapped: R = 8 of 12 rows
                assert positions.tolist() == list(range(4, 12))
            keys = np.concatenate([held[seq].k[layer], held_new[seq].k[layer]])
            values = np.concatenate([held[seq].v[layer], held_new[seq].v[layer]])
            k_scale = np.float32(scales["k_scale"][layer])
            v_scale = np.float32(scales["v_scale"][layer])
            np.testing.assert_array_equal(k.astype(np.float64) * k_scale, keys[positions])
            np.testing.assert_array_equal(v.astype(np.float64) * v_scale, values[positions])
            _, k_alone, v_alone = alone.sequence_kv(seq, layer)
            assert k.tobytes() == k_alone.tobytes() and v.tobytes() == v_alone.tobytes()


def test_prepared_abort_raises_high_water_to_the_end_of_the_last_span():
    cache = make()
    a, b = cache.seq_new(), cache.seq_new()
    cache.declare_step([a, a, b, a])
    cache.prepare_step()
    cache.abort_step()
    assert (cache.pos(a), cache.high_water(a)) == (0, 3)
    assert (cache.pos(b), cache.high_water(b)) == (0, 1)
    assert cache.state(a) == cache.state(b) == kv.SlotState.CLAIMED


def test_pack_lays_a_sessions_later_input_as_another_span():
    cache = make()
    t = kv.SessionTable(cache, max_sessions=3, max_session_tokens=CAPACITY)
    a, b = t.open(), t.open()
    run_step(cache, [(t.seq(a), i) for i in range(3)],
             {t.seq(a): Tokens(np.random.default_rng(0), 3)})
    # a's feedback token and its next prompt chunk, with b's prompt between them
    packed = t.pack([(a, 3, [7]), (b, 0, [1, 2]), (a, 4, [8, 9])])
    assert packed.seq_ids.tolist() == [t.seq(a), t.seq(b), t.seq(b), t.seq(a), t.seq(a)]
    assert packed.positions.tolist() == [3, 0, 1, 4, 5]
    assert packed.logit_indices.tolist() == [-1, 2, 4]       # a's earlier input samples nothing
    explicit = t.pack([(a, 3, [7], True), (b, 0, [1, 2], False), (a, 4, [8, 9])])
    assert explicit.logit_indices.tolist() == [0, -1, 4]
    plan = cache.declare_step(packed.seq_ids)
    assert [(g.seq, g.pos_start, g.q_len) for g in plan.segments] == \
        [(t.seq(a), 3, 1), (t.seq(b), 0, 2), (t.seq(a), 4, 2)]
