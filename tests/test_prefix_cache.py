"""The prefix index at the cache level (contract §14): a sequence started from a match
attends bitwise-equal to one that wrote the same K/V itself, on flat, ring and mixed
layers at several page sizes; extra keys keep lists apart; cached pages are
reclaimable, evicted least recently used and deepest first; refusals change nothing.

K and V are a function of (token, position, layer) only, so two sequences holding the
same tokens hold the same bytes wherever they came from.
"""
import os

import numpy as np
import pytest

import kvnumba as kv
from kvnumba.arith.prefix_keys import page_keys

H, HQ, D = 1, 2, 8
pytestmark = pytest.mark.usefixtures("nan_storage")


def kv_rows(tokens, positions, layer):
    """K and V `[n, H, D]` float32 of tokens at positions on a layer: a pure function."""
    seeds = np.asarray(tokens, np.int64) * 1_000_003 + np.asarray(positions) * 131 + layer
    k = np.stack([np.random.default_rng(int(s)).standard_normal((H, D)) for s in seeds])
    v = np.stack([np.random.default_rng(int(s) + 7).standard_normal((H, D)) for s in seeds])
    return k.astype(np.float32), v.astype(np.float32)


def feed(cache, seq, tokens, start, chunk):
    """Write `tokens` into `seq` from position `start`, `chunk` at a time (no attention
    read back); returns nothing."""
    for at in range(0, len(tokens), chunk):
        part = tokens[at:at + chunk]
        cache.declare_step([seq] * len(part))
        cache.prepare_step()
        positions = np.arange(start + at, start + at + len(part))
        for layer in range(cache.config.n_layers):
            k, v = kv_rows(part, positions, layer)
            cache.write(layer, k, v)
        cache.commit_step()


def register(cache, seq, tokens, extra=b""):
    return cache.prefix_register(seq, page_keys(np.asarray(tokens, np.int64),
                                                cache.config.page_size, extra))


def feed_registering(cache, seq, tokens, chunk, extra=b""):
    """`feed` from position 0, registering after each commit (while the rings still hold
    each page's rows); returns the last registration's count."""
    for at in range(0, len(tokens), chunk):
        feed(cache, seq, tokens[at:at + chunk], at, chunk)
        indexed = register(cache, seq, tokens[:at + chunk], extra)
    return indexed


def attend_side_by_side(cache, seqs, tokens, start, chunk):
    """Feed the same `tokens` from `start` to each of `seqs` in joint steps of `chunk`
    tokens a sequence, every token attending; the outputs per sequence, `[len(seqs),
    n_layers, len(tokens), HQ, D]`."""
    rng = np.random.default_rng(5)
    outs = []
    for at in range(0, len(tokens), chunk):
        part = tokens[at:at + chunk]
        n = len(part)
        cache.declare_step([s for s in seqs for _ in range(n)])
        cache.prepare_step()
        q = np.tile(rng.standard_normal((n, HQ, D)).astype(np.float32), (len(seqs), 1, 1))
        positions = np.tile(np.arange(start + at, start + at + n), len(seqs))
        step = []
        for layer in range(cache.config.n_layers):
            k, v = kv_rows(part * len(seqs), positions, layer)
            step.append(cache.update_and_attend(layer, q, k, v).reshape(len(seqs), n, HQ, D))
        cache.commit_step()
        outs.append(np.stack(step, axis=1))
    return np.concatenate(outs, axis=2)


CONFIGS = {
    "flat": [kv.flat(), kv.flat()],
    "ring": [kv.ring(window=5), kv.ring(window=5)],
    "mixed": [kv.flat(), kv.ring(window=3), kv.ring(window=21)],
}


def config(layers, page_size, capacity, max_write, max_seqs=4, **kw):
    return kv.CacheConfig(layers=layers, n_kv_heads=H, head_dim=D, capacity=capacity,
                          max_seqs=max_seqs, max_write=max_write, max_step=2 * max_write,
                          dtype="float32", page_size=page_size, **kw)


THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
#: (layers, page_size, shared, chunk): the mixed layers at each page size, the flat and the
#: ring layers alone at pages of 8 (at every page size under the thorough profile)
MATCHES = [(layers, *sizes) for layers in sorted(CONFIGS)
           for sizes in [(8, 29, 6), (16, 40, 16), (256, 262, 128)]
           if THOROUGH or layers == "mixed" or sizes[0] == 8]


@pytest.mark.parametrize("layers,page_size,shared,chunk", MATCHES)
def test_a_sequence_started_from_a_match_attends_as_one_that_wrote_its_prefix(
        layers, page_size, shared, chunk):
    rng = np.random.default_rng(page_size)
    capacity = shared + 8
    cache = kv.BatchedSequenceCache(config(CONFIGS[layers], page_size, capacity, chunk))
    common = rng.integers(0, 1000, shared).tolist()
    first = common + rng.integers(0, 1000, 5).tolist()
    second = common + rng.integers(0, 1000, 4).tolist()
    a = cache.seq_new()
    feed_registering(cache, a, first, chunk)
    keys = page_keys(np.asarray(second[:-1], np.int64), page_size)
    matched = cache.prefix_match(keys)
    assert matched == shared // page_size          # the last whole page of the shared part
    b = cache.seq_from_prefix(keys)
    hit = matched * page_size
    assert cache.pos(b) == hit and cache.state(b) == kv.SlotState.COMMITTED
    assert cache.floor(b) <= hit
    c = cache.seq_new()                            # the same tokens, written itself
    feed(cache, c, second[:hit], 0, chunk)
    out = attend_side_by_side(cache, [b, c], second[hit:], hit, min(chunk, 8))
    np.testing.assert_array_equal(out[0], out[1])
    if layers != "ring":                           # flat pages shared, not copied
        flat_layer = 0
        np.testing.assert_array_equal(cache.page_table(b, flat_layer)[:matched],
                                      cache.page_table(a, flat_layer)[:matched])


def test_an_extra_key_keeps_two_identical_token_lists_apart():
    cache = kv.BatchedSequenceCache(config(CONFIGS["mixed"], 8, 64, 8))
    tokens = list(range(100, 125))
    a = cache.seq_new()
    assert feed_registering(cache, a, tokens, 8, b"tenant-a") == 3
    for extra, hits in ((b"tenant-a", 3), (b"tenant-b", 0), (b"", 0)):
        assert cache.prefix_match(page_keys(np.asarray(tokens), 8, extra)) == hits


def test_only_committed_whole_pages_are_indexed_and_a_late_ring_registration_stops():
    cache = kv.BatchedSequenceCache(config([kv.flat(), kv.ring(window=3)], 8, 64, 8))
    tokens = list(range(40))
    a = cache.seq_new()
    feed_registering(cache, a, tokens[:20], 8)
    keys = page_keys(np.asarray(tokens), 8)
    assert register(cache, a, tokens) == 2         # 20 positions: 2 whole pages
    b = cache.seq_new()
    feed(cache, b, [7] * 40, 0, 8)                 # written past its first pages' window
    assert cache.prefix_register(b, page_keys(np.full(40, 7), 8)) == 0
    assert cache.prefix_match(keys) == 2


def pools(cache):
    return [(p.in_use, p.free, p.cached) for p in cache.pool_pages()]


def test_cached_pages_are_available_and_evicted_least_recently_used_deepest_first():
    cache = kv.BatchedSequenceCache(config([kv.flat()], 8, 64, 8, max_seqs=2,
                                           initial_pages=9, max_pages=9))
    lists = [[t] * 24 for t in (1, 2)]              # 3 pages each
    for tokens in lists:
        s = cache.seq_new()
        feed_registering(cache, s, tokens, 8)
        cache.seq_rm(s)
    (in_use, free, cached), = pools(cache)
    assert (in_use, free, cached) == (1, 2, 6)      # the scratch page held
    assert cache.page_demand([0] * 8).free == 8
    keys = [page_keys(np.asarray(t), 8) for t in lists]
    touched = cache.seq_from_prefix(keys[0][:2])    # list 1's first two pages used again
    feed(cache, touched, [1] * 4, 16, 8)           # a fresh page: the free ones first
    s = cache.seq_new()
    feed(cache, s, [9] * 16, 0, 8)                  # 2 pages: the last free, 1 evicted:
    evicted = cache.prefix_counts.pages_evicted     # list 1's third page, used longest ago
    assert evicted == 1 and [cache.prefix_match(k) for k in keys] == [2, 3]
    feed(cache, s, [9] * 8, 16, 8)                  # list 2, used at once: deepest first
    assert [cache.prefix_match(k) for k in keys] == [2, 2]
    feed(cache, touched, [1] * 8, 20, 8)
    feed(cache, s, [9] * 8, 24, 8)
    assert [cache.prefix_match(k) for k in keys] == [2, 0]
    assert cache.prefix_counts.pages_evicted == 4 and pools(cache) == [(9, 0, 0)]
    before = (pools(cache), cache.prefix_counts, cache.pos(s))
    with pytest.raises(kv.CapacityError, match="0 available"):   # held pages stay
        cache.declare_step([s] * 8)
    assert cache.step_state == kv.StepState.IDLE
    assert (pools(cache), cache.prefix_counts, cache.pos(s)) == before


def ring_cache(max_pages):
    """One ring layer (W 9, M 8: R 16, 2 pages a ring) in a fixed pool, and a sequence
    that wrote 24 positions and registered what the pool let it."""
    cache = kv.BatchedSequenceCache(config([kv.ring(window=9)], 8, 32, 8, max_seqs=2,
                                           initial_pages=max_pages, max_pages=max_pages))
    tokens = list(range(24))
    a = cache.seq_new()
    return cache, a, feed_registering(cache, a, tokens, 8), page_keys(np.asarray(tokens), 8)


def test_a_match_whose_ring_rows_the_new_rings_need_is_shortened():
    cache, a, registered, keys = ring_cache(6)      # scratch, a's ring, 3 free
    assert registered == 3 and pools(cache) == [(3, 0, 3)]
    b = cache.seq_from_prefix(keys)                 # its ring takes 2: one node left
    assert cache.pos(b) == 8 and cache.prefix_counts.pages_evicted == 2
    assert cache.prefix_match(keys) == 1


def test_a_match_that_cannot_have_its_rings_is_refused_and_changes_nothing():
    cache, a, registered, keys = ring_cache(4)      # room for one node
    assert registered == 1
    before = (pools(cache), cache.prefix_counts, [cache.state(s) for s in range(2)])
    with pytest.raises(kv.CapacityError):
        cache.seq_from_prefix(keys)
    assert (pools(cache), cache.prefix_counts, [cache.state(s) for s in range(2)]) == before


def test_forget_and_clear_give_the_pages_back():
    cache = kv.BatchedSequenceCache(config(CONFIGS["mixed"], 8, 64, 8))
    tokens = list(range(32))
    a = cache.seq_new()
    keys = page_keys(np.asarray(tokens), 8)
    assert feed_registering(cache, a, tokens, 8) == 4
    assert cache.prefix_forget(keys[3:]) == 1 and cache.prefix_match(keys) == 3
    cache.seq_rm(a)
    assert sum(p.cached for p in cache.pool_pages()) > 0
    assert cache.prefix_clear() == 3
    assert all(p.cached == 0 and p.in_use == 1 for p in cache.pool_pages())


@pytest.mark.parametrize("bad", ["abc", [b"short"], [123], None])
def test_malformed_keys_are_refused(bad):
    cache = kv.BatchedSequenceCache(config([kv.flat()], 8, 32, 8))
    with pytest.raises(kv.ShapeError):
        cache.prefix_match(bad)
    with pytest.raises(kv.ShapeError):
        cache.seq_from_prefix(bad)
    assert cache.state(0) == kv.SlotState.FREE


def test_sessions_look_up_tokens_register_as_they_go_and_count_hits():
    cache = kv.BatchedSequenceCache(config(CONFIGS["mixed"], 8, 64, 8))
    table = kv.SessionTable(cache, max_sessions=4, max_session_tokens=64)
    prompt = list(range(50, 74))                     # 3 whole pages
    first = table.open(prompt, extra_key="tenant")
    assert table.pos(first) == 0
    for at in range(0, 24, 8):
        packed = table.pack([(first, at, prompt[at:at + 8])])
        cache.declare_step(packed.seq_ids)
        cache.prepare_step()
        cache.commit_step()                          # control-plane steps: no K/V
        table.register(first, prompt)
    # the whole prompt is indexed, yet a session of it computes its last token itself
    again = table.open(prompt, extra_key="tenant")
    assert table.pos(again) == 16
    other = table.open(prompt, extra_key="another")
    assert table.pos(other) == 0
    longer = table.open(prompt + [9, 9], extra_key="tenant")
    assert table.pos(longer) == 24
    stats = table.prefix_stats
    assert (stats.tokens_looked_up, stats.tokens_hit) == (24 * 3 + 26, 16 + 24)
    assert stats.hit_rate == pytest.approx(40 / 98)
    table.close(again)
    assert table.forget(prompt, extra_key="tenant") == 3
    assert cache.prefix_match(page_keys(np.asarray(prompt), 8, b"tenant")) == 0


def step(cache, packed):
    """A control-plane step: positions committed, no K/V written."""
    cache.declare_step(packed.seq_ids)
    cache.prepare_step()
    cache.commit_step()


def test_a_session_rewound_and_rewritten_registers_its_new_pages():
    cache = kv.BatchedSequenceCache(config([kv.flat()], 8, 64, 8))
    table = kv.SessionTable(cache, max_sessions=2, max_session_tokens=64)
    sid = table.open()
    tokens = list(range(16))
    for at in (0, 8):
        step(cache, table.pack([(sid, at, tokens[at:at + 8])]))
        assert table.register(sid, tokens[:at + 8]) == at // 8 + 1
    new = tokens[:4] + [99] * 12                     # rewound to 4, a new tail
    step(cache, table.pack([(sid, 4, new[4:12])]))
    assert table.register(sid, new) == 1             # page 0 again, page 1 is new: 12 < 16
    step(cache, table.pack([(sid, 12, new[12:16])]))
    assert table.register(sid, new) == 2
    for tokens_, hits in ((tokens, 2), (new, 2)):    # the old pages kept (copy-on-write)
        assert cache.prefix_match(page_keys(np.asarray(tokens_), 8)) == hits


def test_every_registration_is_a_new_use_even_one_that_touches_no_indexed_page():
    """Two chains registered by calls that touch no indexed page: the older one (B, one
    page) is evicted before the newer, deeper one (A, two pages), as least recently
    used first says (deepest first breaks ties within one use only: were the two calls
    one use, A's second page would go)."""
    cache = kv.BatchedSequenceCache(config([kv.flat()], 8, 64, 8, max_seqs=2,
                                           initial_pages=5, max_pages=5))
    b, a = [5] * 8, [6] * 16
    for tokens in (b, a):                          # B first, then A: neither touches any
        s = cache.seq_new()
        feed(cache, s, tokens, 0, 8)
        assert register(cache, s, tokens) == len(tokens) // 8     # one call each
        cache.seq_rm(s)
    keys = [page_keys(np.asarray(t), 8) for t in (a, b)]
    assert pools(cache) == [(1, 1, 3)]
    s = cache.seq_new()
    feed(cache, s, [9] * 16, 0, 8)                 # the free page, then one evicted: B's
    assert [cache.prefix_match(k) for k in keys] == [2, 0]
    assert cache.prefix_counts.pages_evicted == 1


def test_eviction_follows_registration_and_match_order_exactly():
    """A, C, B registered one after another (each call touching no indexed page), then A
    matched: the evictions go C, then B (deepest first), then A, one page at a time (were
    the three registrations one use, B's second page, the deepest, would go first)."""
    cache = kv.BatchedSequenceCache(config([kv.flat()], 8, 64, 8, max_seqs=2,
                                           initial_pages=7, max_pages=7))
    lists = {"a": [6] * 16, "c": [7] * 8, "b": [5] * 16}
    for tokens in lists.values():
        s = cache.seq_new()
        feed(cache, s, tokens, 0, 8)
        assert register(cache, s, tokens) == len(tokens) // 8
        cache.seq_rm(s)
    keys = {name: page_keys(np.asarray(t), 8) for name, t in lists.items()}
    cache.seq_rm(cache.seq_from_prefix(keys["a"]))        # A used again, last
    assert pools(cache) == [(1, 1, 5)]
    s = cache.seq_new()
    seen = []
    for page in range(6):                                  # the free page, then 5 evicted
        feed(cache, s, [9] * 8, 8 * page, 8)
        seen.append(tuple(cache.prefix_match(keys[n]) for n in "abc"))
    assert seen == [(2, 2, 1), (2, 2, 0), (2, 1, 0), (2, 0, 0), (1, 0, 0), (0, 0, 0)]
    assert cache.prefix_counts.pages_evicted == 5
