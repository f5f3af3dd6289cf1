"""Mixed steps through the cache: decode and prefill segments on their own paths.

For each storage/head_dim combination (both fast paths; the fast decode path with the
generic prefill path; the generic kernel for both), a step mixing decode segments,
a speculative draft block and prefill chunks is checked against the float64
reference built from the test's own histories, and every segment's output is
compared bit for bit with the same segment run alone in an identical cache.
"""
import numpy as np
import pytest

import kvnumba as kv
from kvnumba.data import routing as paths_module
from kvnumba.kernels import decode, prefill
from oracle import dense_attention

H, HQ = 1, 2
WINDOWS = (None, 5)
CAPACITY, MAX_WRITE, MAX_STEP = 48, 12, 24
CONFIGS = {                   # (storage dtype, head_dim): which paths serve it
    "fast decode, fast prefill": ("float16", 16),
    "fast decode, generic prefill": ("float32", 16),
    "generic decode and prefill": ("float16", 12),
}


def make(dtype, head_dim, max_seqs=4):
    config = kv.CacheConfig(layers=[kv.flat() if w is None else kv.ring(window=w)
                                    for w in WINDOWS], n_kv_heads=H, head_dim=head_dim,
                            capacity=CAPACITY, max_seqs=max_seqs, max_write=MAX_WRITE,
                            max_step=MAX_STEP, dtype=dtype, initial_pages=8)
    return kv.BatchedSequenceCache(config)


class Sequence:
    """One sequence's q, k, v per layer for all its positions (history and the step's)."""

    def __init__(self, rng, n, head_dim, dtype):
        def draw(heads):
            return [rng.standard_normal((n, heads, head_dim)).astype(dtype) for _ in WINDOWS]
        self.q, self.k, self.v = draw(HQ), draw(H), draw(H)


def fill(cache, seqs, history):
    """Write each sequence's first `history[s]` positions, one sequence per step."""
    for s, n in history.items():
        for start in range(0, n, MAX_WRITE):
            count = min(MAX_WRITE, n - start)
            cache.declare_step([s] * count)
            cache.prepare_step()
            for layer in range(len(WINDOWS)):
                rows = slice(start, start + count)
                cache.write(layer, seqs[s].k[layer][rows], seqs[s].v[layer][rows])
            cache.commit_step()


def step(cache, seqs, spans, history, blocks=(), width=None):
    """Run one step of `spans` [(seq, n_tokens)], in order; returns outputs per layer."""
    ids, rows = [], []
    cursor = dict(history)
    for s, n in spans:
        ids += [s] * n
        rows += [(s, cursor[s] + i) for i in range(n)]
        cursor[s] += n
    cache.declare_step(ids, blocks=blocks)
    plan = cache.prepare_step(width)
    outs = []
    for layer in range(len(WINDOWS)):
        def gather(field, heads):
            out = np.zeros((plan.width, heads) + getattr(seqs[0], field)[0].shape[2:],
                           getattr(seqs[0], field)[0].dtype)
            out[:len(rows)] = [getattr(seqs[s], field)[layer][p] for s, p in rows]
            return out
        got = cache.update_and_attend(layer, gather("q", HQ), gather("k", H), gather("v", H))
        assert not got[len(rows):].any(), "padding rows must be zero"
        outs.append(got[:len(rows)])
    cache.commit_step()
    return outs, rows


SPANS = [(0, 1), (1, 7), (2, 3), (3, 1)]          # decode, prefill chunk, draft block, decode
HISTORY = {0: 20, 1: 9, 2: 14, 3: 2}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_mixed_step_matches_the_reference_and_each_segment_alone(name):
    dtype, head_dim = CONFIGS[name]
    rng = np.random.default_rng(1)
    seqs = [Sequence(rng, HISTORY[s] + 8, head_dim, dtype) for s in range(4)]
    mixed = make(dtype, head_dim)
    for _ in range(4):
        mixed.seq_new()
    fill(mixed, seqs, HISTORY)
    outs, rows = step(mixed, seqs, SPANS, HISTORY, blocks=[2], width=MAX_STEP)
    scale = 1 / np.sqrt(head_dim)
    tol = 2e-3 if dtype == "float16" else 1e-4
    for seq, n in SPANS:
        mine = [t for t, (s, _) in enumerate(rows) if s == seq]
        for layer, window in enumerate(WINDOWS):
            end = HISTORY[seq] + n
            want = dense_attention(seqs[seq].q[layer][HISTORY[seq]:end],
                                   seqs[seq].k[layer][:end], seqs[seq].v[layer][:end],
                                   HISTORY[seq], window, seq == 2, scale)
            got = outs[layer][mine].astype(np.float64)
            err = np.linalg.norm(got - want) / np.linalg.norm(want)
            assert err < tol, (name, seq, layer, err)
        alone = make(dtype, head_dim)                  # the same segment, nothing beside it
        for _ in range(4):
            alone.seq_new()
        fill(alone, seqs, {seq: HISTORY[seq]})
        alone_outs, _ = step(alone, seqs, [(seq, n)], HISTORY,
                             blocks=[seq] if seq == 2 else ())
        for layer in range(len(WINDOWS)):
            assert alone_outs[layer].tobytes() == outs[layer][mine].tobytes(), (name, seq)


def test_the_paths_each_config_takes():
    assert decode.supports(16, np.float16) and prefill.supports(16, np.float16)
    assert decode.supports(16, np.float32) and not prefill.supports(16, np.float32)
    assert not decode.supports(12, np.float16) and not prefill.supports(12, np.float16)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_an_attend_launches_at_most_one_path_per_group(name, monkeypatch):
    dtype, head_dim = CONFIGS[name]
    calls = []
    for run in (paths_module.decode.DecodeRun, paths_module.prefill.PrefillRun,
                paths_module.generic.GenericRun):      # what a layer's attend calls per path
        real = run.__call__

        def counted(self, *args, _real=real, _name=run.__name__, **kw):
            calls.append((_name, getattr(self, "path", None)))
            return _real(self, *args, **kw)
        monkeypatch.setattr(run, "__call__", counted)
    rng = np.random.default_rng(2)
    seqs = [Sequence(rng, 16, head_dim, dtype) for _ in range(3)]
    cache = make(dtype, head_dim, max_seqs=3)
    for _ in range(3):
        cache.seq_new()
    fill(cache, seqs, {0: 5, 1: 3, 2: 4})
    step(cache, seqs, [(0, 1), (1, 6), (2, 1)], {0: 5, 1: 3, 2: 4})
    per_layer = len(calls) // len(WINDOWS)
    assert len(calls) % len(WINDOWS) == 0 and per_layer == 2, calls
    fast_decode, fast_prefill = head_dim % 16 == 0, dtype == "float16" and head_dim % 16 == 0
    want = [("DecodeRun", None) if fast_decode else ("GenericRun", "decode"),
            ("PrefillRun", None) if fast_prefill else ("GenericRun", "prefill")]
    assert calls[:2] == want
    calls.clear()
    step(cache, seqs, [(0, 1), (2, 1)], {0: 6, 2: 5})   # a pure decode step: one path
    assert len(calls) == len(WINDOWS) and calls[0] == want[0]


@pytest.mark.parametrize("head_dim, fast", [(16, True), (12, False)])
def test_the_launch_key_changes_only_with_the_launches(head_dim, fast):
    """Decode steps keep one key until a sequence's history reaches another chunk count:
    1.5 chunks on the fast path (a remainder under half a chunk joins the last chunk),
    one chunk + 1 key on the generic path's split-K (hand-computed boundaries)."""
    from kvnumba.kernels.decode import CHUNK_KEYS
    chunk = CHUNK_KEYS
    boundary = chunk + chunk // 2 if fast else chunk + 1    # first key count of 2 chunks
    config = kv.CacheConfig(layers=[kv.flat(), kv.ring(window=4)], n_kv_heads=H,
                            head_dim=head_dim, capacity=2 * chunk, max_seqs=2,
                            max_write=2 * chunk, max_step=2 * chunk + 8, dtype="float16",
                            initial_pages=2 * chunk)          # no growth moves the storage
    cache = kv.BatchedSequenceCache(config)
    a, b = cache.seq_new(), cache.seq_new()
    cache.declare_step([a] * (boundary - 4) + [b] * 5)
    cache.prepare_step()
    assert cache.plan.launch_key is not None
    cache.commit_step()
    keys = []
    for _ in range(5):                 # a's query sees boundary - 3 .. boundary + 1 keys
        plan = cache.declare_step([a, b])
        assert plan.launch_key is None
        cache.prepare_step()
        keys.append(plan.launch_key)
        cache.commit_step()
    assert keys[0] == keys[1] == keys[2] != keys[3] == keys[4], keys
    cache.declare_step([a, b])
    assert cache.prepare_step(4).launch_key != keys[4]        # another width
    cache.abort_step()
