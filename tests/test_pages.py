"""Paged storage: pages taken and released with positions, forks that share their prefix,
copy-on-write, the pool's bound, FlashInfer's paged format (contract §4, §7)."""
import numpy as np
import pytest

import kvnumba as kv
from oracle import dense_attention
from snapshot import assert_unchanged, snapshot

H, D, NQ = 2, 16, 4
#: absolute error against float64 by storage dtype: float32 storage attends exactly on
#: CUDA cores; 16-bit storage may take the tensor cores (decode rows past 4, prefill
#: spans), which round q and the probabilities to its 16-bit type
ATOL = {"float32": 2e-4, "float16": 2e-3, "bfloat16": 1e-2}


def make(layers=None, *, page_size=8, max_seqs=4, capacity=64, max_write=8, max_step=16,
         dtype="float32", **kw):
    return kv.BatchedSequenceCache(kv.CacheConfig(
        layers=layers or [kv.flat()], n_kv_heads=H, head_dim=D, capacity=capacity,
        max_seqs=max_seqs, max_write=max_write, max_step=max_step, dtype=dtype,
        page_size=page_size, **kw))


class Model:
    """What each sequence holds, position by position, per layer (float64 NumPy)."""

    def __init__(self, cache):
        self.cache = cache
        self.k = {}
        self.v = {}

    def step(self, ids, rng, attend=True):
        """One step of `ids` writing random K/V into every layer, each layer's output
        checked against dense attention over the model's history."""
        c = self.cache
        plan = c.declare_step(ids)
        c.prepare_step()
        n_layers = c.config.n_layers
        for layer in range(n_layers):
            k = rng.standard_normal((len(ids), H, D)).astype(c.config.np_dtype)
            v = rng.standard_normal((len(ids), H, D)).astype(c.config.np_dtype)
            q = rng.standard_normal((len(ids), NQ, D)).astype(np.float32)
            for seg in plan.segments:
                keys = self.k.setdefault((seg.seq, layer), {})
                vals = self.v.setdefault((seg.seq, layer), {})
                for i in range(seg.q_len):
                    keys[seg.pos_start + i] = k[seg.q_start + i].astype(np.float64)
                    vals[seg.pos_start + i] = v[seg.q_start + i].astype(np.float64)
            if not attend:
                c.write(layer, k, v)
                continue
            out = c.update_and_attend(layer, q, k, v)
            window = c.config.layers[layer].window
            for seg in plan.segments:
                end = seg.pos_start + seg.q_len
                keys = np.stack([self.k[seg.seq, layer][p] for p in range(end)])
                vals = np.stack([self.v[seg.seq, layer][p] for p in range(end)])
                rows = slice(seg.q_start, seg.q_start + seg.q_len)
                want = dense_attention(q[rows], keys, vals, seg.pos_start, window,
                                       seg.block, 1 / np.sqrt(D))
                np.testing.assert_allclose(out[rows], want, rtol=2e-4,
                                           atol=ATOL[c.config.dtype])
        c.commit_step()

    def clone(self, src, upto=None):
        dst = self.cache.seq_clone(src, upto)
        keep = self.cache.pos(dst)
        for (seq, layer), keys in list(self.k.items()):
            if seq == src:
                self.k[dst, layer] = {p: x for p, x in keys.items() if p < keep}
                self.v[dst, layer] = {p: x for p, x in self.v[seq, layer].items() if p < keep}
        return dst

    def check_held(self):
        c = self.cache
        for (seq, layer), keys in self.k.items():
            if c.state(seq) == kv.SlotState.FREE:
                continue
            positions, k, v = c.sequence_kv(seq, layer)
            np.testing.assert_array_equal(k.astype(np.float64),
                                          np.stack([keys[p] for p in positions.tolist()]))
            np.testing.assert_array_equal(
                v.astype(np.float64), np.stack([self.v[seq, layer][p] for p in positions]))


@pytest.mark.parametrize("page_size", [8, 16, 256])
def test_flat_pages_follow_positions(page_size):
    c = make(page_size=page_size, capacity=600, max_write=8, max_step=8)
    a = c.seq_new()
    rng = np.random.default_rng(0)
    model = Model(c)
    for n in (3, 8, 8, 1):
        model.step([a] * n, rng, attend=False)
        assert c.page_table(a, 0).size == -(-c.pos(a) // page_size)
    model.check_held()
    c.rewind(a, 9)
    assert c.page_table(a, 0).size == -(-9 // page_size)
    c.rewind(a, 8)
    assert c.page_table(a, 0).size == -(-8 // page_size)
    model.step([a] * 2, rng)
    model.check_held()
    c.seq_rm(a)
    assert c.pool_pages()[0].in_use == 1          # the scratch page alone
    assert c.nbytes_held == 0


@pytest.mark.parametrize("page_size, dtype", [(8, "float32"), (16, "float16"),
                                             (8, "bfloat16")])
def test_a_fork_shares_whole_pages_and_copies_the_straddling_one(page_size, dtype):
    c = make(page_size=page_size, dtype=dtype, capacity=64)
    rng = np.random.default_rng(1)
    model = Model(c)
    a = c.seq_new()
    for _ in range(5):
        model.step([a] * 7, rng, attend=False)                 # pos 35
    in_use = c.pool_pages()[0].in_use
    b = model.clone(a, upto=27)
    table_a, table_b = c.page_table(a, 0), c.page_table(b, 0)
    shared = 27 // page_size
    np.testing.assert_array_equal(table_b[:shared], table_a[:shared])
    assert table_b.size == -(-27 // page_size)
    assert c.pool_pages()[0].in_use == in_use + (27 % page_size != 0)
    model.check_held()
    # each side writes on: neither sees the other's new positions
    model.step([a, a, b, b, b], rng)
    model.check_held()


@pytest.mark.parametrize("page_size", [8, 256])   # 16, the default: the rest of the suite
def test_rewinds_into_shared_pages_copy_on_write_on_both_sides(page_size):
    c = make(layers=[kv.flat(), kv.flat()], page_size=page_size, capacity=64, max_write=8)
    rng = np.random.default_rng(2)
    model = Model(c)
    a = c.seq_new()
    for _ in range(4):
        model.step([a] * 8, rng, attend=False)                 # pos 32
    b = model.clone(a)                            # shares a's whole pages, copies a partial one
    d = model.clone(b, upto=20)
    whole = 32 // page_size
    assert c.page_table(b, 0)[:whole].tolist() == c.page_table(a, 0)[:whole].tolist()
    shared_before = c.pool_pages()[0].in_use
    # every side rewinds into the shared prefix, then writes there
    c.rewind(a, 3)
    c.rewind(b, 5)
    c.rewind(d, 19)
    demand = c.page_demand([a, b, d])
    model.step([a, a, b, d, d, d], rng)             # attention over the copied pages
    assert c.pool_pages()[0].in_use <= shared_before + demand.needed
    model.check_held()
    # the pages they no longer share went back or were copied: each writes alone now
    model.step([b, a, d], rng, attend=False)
    model.check_held()
    for s in (a, b, d):
        c.seq_rm(s)
    assert c.pool_pages()[0].in_use == 1


def test_removing_the_source_keeps_the_forks_pages():
    c = make(page_size=8)
    rng = np.random.default_rng(3)
    model = Model(c)
    a = c.seq_new()
    model.step([a] * 8, rng, attend=False)
    model.step([a] * 8, rng, attend=False)
    b = model.clone(a)
    c.seq_rm(a)
    del model.k[a, 0], model.v[a, 0]
    model.check_held()
    model.step([b] * 3, rng)
    assert c.pool_pages()[0].in_use == 1 + 3                   # b's pages and the scratch


def test_eight_forks_of_a_long_prefix_add_at_most_a_page_each():
    c = make(page_size=16, max_seqs=9, capacity=4096, max_write=512, max_step=512,
             initial_pages=400)
    a = c.seq_new()
    for _ in range(7):                                         # 3584 positions
        c.declare_step([a] * 512)
        c.prepare_step()
        c.commit_step()
    c.declare_step([a] * 9)                                    # 3593: a straddling page
    c.prepare_step()
    c.commit_step()
    before = c.pool_pages()[0].in_use
    forks = [c.seq_clone(a) for _ in range(8)]
    assert c.pool_pages()[0].in_use - before == 8              # the straddling page each
    assert all(c.page_table(f, 0)[:-1].tolist() == c.page_table(a, 0)[:-1].tolist()
               for f in forks)


def test_a_step_past_max_pages_is_refused_naming_pages_and_nothing_changes():
    c = make(page_size=8, initial_pages=4, max_pages=4)
    rng = np.random.default_rng(4)
    model = Model(c)
    a, b = c.seq_new(), c.seq_new()
    model.step([a] * 8 + [b] * 8, rng, attend=False)          # 2 pages + scratch: 1 free
    assert c.page_demand([a, b]) == kv.PageDemand(needed=2, free=1)
    before = snapshot(c)
    with pytest.raises(kv.CapacityError, match=r"need 2 new pages of 8 positions, and their "
                                               r"pool has 1 available of max_pages 4"):
        c.declare_step([a, b])
    assert_unchanged(before, snapshot(c))
    model.step([a], rng)                                       # one page fits
    before = snapshot(c)
    with pytest.raises(kv.CapacityError, match="need 1 new pages"):
        c.seq_clone(b, upto=5)                                 # its straddling page
    assert_unchanged(before, snapshot(c))
    c.seq_rm(a)
    model.step([b], rng)                                       # a's pages came back
    assert c.layer_data(0)[0].shape[0] == 4                    # a fixed pool never moves
    model.check_held()


def test_ring_pages_come_with_the_sequence_and_a_full_ring_pool_refuses_seq_new():
    c = make(layers=[kv.flat(), kv.ring(window=4)], page_size=8, max_write=8, max_step=8,
             initial_pages=3, max_pages=3)                     # R = 11: 2 pages a sequence
    a = c.seq_new()
    assert c.page_table(a, 1).size == 2
    before = snapshot(c)
    with pytest.raises(kv.CapacityError, match=r"ring layers of 11 rows need 2 new pages"):
        c.seq_new()
    assert_unchanged(before, snapshot(c))
    c.seq_rm(a)
    assert c.seq_new() == a


@pytest.mark.parametrize("page_size", [8, 256])   # 16, the default: the rest of the suite
def test_mixed_layers_through_forks_and_rewinds(page_size):
    c = make(layers=[kv.flat(), kv.ring(window=5), kv.flat()], page_size=page_size,
             capacity=48, max_write=4, max_step=12, dtype="float16")
    rng = np.random.default_rng(5)
    model = Model(c)
    a = c.seq_new()
    for _ in range(5):
        model.step([a] * 4, rng, attend=False)                 # pos 20, hw 20
    b = model.clone(a, upto=18)                                # floor 16 (R = 8, M = 4)
    model.step([b, b, a, b], rng, attend=False)
    c.rewind(a, 17)
    model.step([a, a, a, b], rng)                              # attention through both
    model.check_held()


def test_flashinfer_tables_describe_exactly_each_sequences_positions():
    c = make(layers=[kv.flat(), kv.ring(window=3), kv.flat()], page_size=8, capacity=64)
    rng = np.random.default_rng(6)
    model = Model(c)
    a, b = c.seq_new(), c.seq_new()
    model.step([a] * 8 + [b] * 3, rng, attend=False)
    model.step([a] * 5 + [b], rng, attend=False)
    e = model.clone(a, upto=11)
    c.seq_new()                                                # an empty sequence
    seqs = [a, b, e, 3]
    indptr, indices, last = c.paged_kv(seqs)
    lengths = [13, 4, 11, 0]
    np.testing.assert_array_equal(np.diff(indptr), [-(-n // 8) for n in lengths])
    np.testing.assert_array_equal(last, [5, 4, 3, 0])
    for layer in (0, 2):
        pool_k, pool_v = (x.copy_to_host() for x in c.layer_data(layer))
        for i, (s, n) in enumerate(zip(seqs, lengths)):
            pages = indices[indptr[i]:indptr[i + 1]]
            k = pool_k[pages].reshape(-1, H, D)[:n]
            v = pool_v[pages].reshape(-1, H, D)[:n]
            np.testing.assert_array_equal(k, c.sequence_kv(s, layer)[1])
            np.testing.assert_array_equal(v, c.sequence_kv(s, layer)[2])
    # in a prepared step: the step's sequences, through the positions it writes
    c.declare_step([b, b, a])
    c.prepare_step()
    indptr, indices, last = c.paged_kv()
    np.testing.assert_array_equal(np.diff(indptr), [1, 2])    # b: 6 positions, a: 14
    np.testing.assert_array_equal(last, [6, 6])
    np.testing.assert_array_equal(indices[1:], c.page_table(a, 0))
    c.abort_step()


def test_held_bytes_count_shared_pages_once():
    c = make(page_size=8)
    page = c.config.page_bytes
    a = c.seq_new()
    c.declare_step([a] * 8)
    c.prepare_step()
    c.commit_step()
    c.declare_step([a] * 4)
    c.prepare_step()
    c.commit_step()
    assert c.nbytes_held == 2 * page
    c.seq_clone(a)                                             # shares 1, copies 1
    assert c.nbytes_held == 3 * page
    assert c.nbytes == c.pool_pages()[0].allocated * page
