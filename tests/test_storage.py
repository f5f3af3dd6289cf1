"""Storage and the write/copy kernels: page pools, the scratch page, ring wrap, growth, dtypes,
edges."""
import numpy as np
import pytest

import kvnumba as kv
from kvnumba.data import storage as storage_module

H, D = 2, 4


def make(layers=None, *, max_seqs=3, max_write=4, max_step=8, capacity=32, initial_pages=4,
         dtype="float32", page_size=8):
    cfg = kv.CacheConfig(layers=layers or [kv.flat(), kv.ring(window=3)], n_kv_heads=H,
                         head_dim=D, capacity=capacity, max_seqs=max_seqs, max_write=max_write,
                         max_step=max_step, dtype=dtype, initial_pages=initial_pages,
                         page_size=page_size)
    return kv.BatchedSequenceCache(cfg)


def step(cache, ids, rng, width=None, dtype=np.float32):
    """One full step writing random K/V to every layer; returns {layer: (k, v)}."""
    cache.declare_step(ids)
    plan = cache.prepare_step(width)
    written = {}
    for layer in range(cache.config.n_layers):
        k = rng.standard_normal((plan.width, H, D)).astype(dtype)
        v = rng.standard_normal((plan.width, H, D)).astype(dtype)
        cache.write(layer, k, v)
        written[layer] = (k, v)
    cache.commit_step()
    return written


def storage(cache):
    """Host copies of every layer's K and V, as raw bits (uninitialised rows may hold NaN)."""
    return [tuple(bits(a.copy_to_host()) for a in cache.layer_data(i))
            for i in range(cache.config.n_layers)]


def bits(a):
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def slot_of(cache, seq, layer, row):
    """(page, slot in the page) of storage row `row` of `seq` on `layer`, from its table."""
    page_size = cache.config.page_size
    return int(cache.page_table(seq, layer)[row // page_size]), row % page_size


def test_layout_is_page_pools_with_a_scratch_page():
    c = make()
    k, v = c.layer_data(0)
    assert k.shape == (4, 8, H, D) and v.shape == k.shape  # initial_pages, page_size
    assert c.layer_data(1)[0].shape == (4, 8, H, D)
    assert c.nbytes == 2 * 4 * 8 * H * D * 4 * 2            # 2 layers x 4 pages, K and V
    a = c.seq_new()
    # the ring (R = 3 + 4 - 1 = 6) takes ceil(6 / 8) = 1 page with the sequence; page 0 of
    # every pool is the scratch page
    assert c.page_table(a, 0).size == 0 and c.page_table(a, 1).tolist() == [1]
    step(c, [a] * 4, np.random.default_rng(0))
    step(c, [a] * 4, np.random.default_rng(0))
    step(c, [a], np.random.default_rng(0))
    assert c.page_table(a, 0).tolist() == [1, 2]            # positions [0, 8), [8, 9)
    assert [p.in_use for p in c.pool_pages()] == [3, 2]


def test_padding_lands_only_in_the_scratch_page():
    rng = np.random.default_rng(1)
    c = make()
    a, b = c.seq_new(), c.seq_new()
    step(c, [a, a, b], rng)
    before = storage(c)
    written = step(c, [a, b], rng, width=8)
    after = storage(c)
    for layer, ((k0, v0), (k1, v1)) in enumerate(zip(before, after)):
        rows = {a: 2, b: 1}     # a writes position 2, b position 1 (ring R = 6: the same rows)
        want = {slot_of(c, s, layer, r) for s, r in rows.items()}
        for arr0, arr1, new in ((k0, k1, written[layer][0]), (v0, v1, written[layer][1])):
            changed = np.argwhere(np.any(arr0 != arr1, axis=(2, 3)))
            got = {(int(page), int(slot)) for page, slot in changed if page != 0}
            assert got == want, (layer, got)
            # the scratch page took the six padding tokens, all at its slot 0 (position 0);
            # which one lands last is a race (vector by vector), so each element is one of
            # the padding tokens' elements
            padding = np.stack([bits(new[i]) for i in range(2, 8)])
            assert (padding == arr1[0, 0]).any(axis=0).all()


def test_ring_wraps_at_the_last_row():
    rng = np.random.default_rng(2)
    c = make(layers=[kv.ring(window=2)], max_write=2, max_step=2)  # R = 3
    s = c.seq_new()
    history = []
    for _ in range(5):  # positions 0..9: every row written several times, wrap at R - 1
        k, v = step(c, [s, s], rng)[0]
        history += [k[0], k[1]]
    positions, k_held, _ = c.sequence_kv(s, 0)
    np.testing.assert_array_equal(positions, [7, 8, 9])
    np.testing.assert_array_equal(k_held, np.stack(history[7:10]))
    store = c.layer_data(0)[0].copy_to_host()
    for p in (7, 8, 9):
        np.testing.assert_array_equal(store[slot_of(c, s, 0, p % 3)], history[p])


def test_growth_over_several_doublings_keeps_every_position():
    rng = np.random.default_rng(3)
    c = make(layers=[kv.flat()], max_seqs=2, initial_pages=2, capacity=40, max_write=4)
    a, b = c.seq_new(), c.seq_new()
    hist = {a: [], b: []}
    pages_seen = []
    while c.pos(a) < 37:
        n = min(4, 37 - c.pos(a))
        k, _ = step(c, [a] * n + [b], rng)[0]
        hist[a] += list(k[:n])
        hist[b].append(k[n])
        pages_seen.append(c.layer_data(0)[0].shape[0])
    # a holds ceil(37 / 8) = 5 pages, b ceil(10 / 8) = 2, and the scratch page: 8, reached
    # by doubling from 2 (the first step already needs 3; the bound, 2 x 5 + 1 = 11, never
    # binds)
    assert sorted(set(pages_seen)) == [4, 8]
    assert c.pool_pages()[0].in_use == 8
    for s in (a, b):
        positions, k, _ = c.sequence_kv(s, 0)
        np.testing.assert_array_equal(k, np.stack(hist[s]))


def test_growth_is_exactly_the_contract_formula():
    c = make(layers=[kv.flat()], max_seqs=1, initial_pages=2, capacity=100, max_write=8,
             max_step=8)
    s = c.seq_new()
    step(c, [s] * 8, np.random.default_rng(0))       # page 1 (page 0 is scratch): full pool
    assert c.layer_data(0)[0].shape[0] == 2
    c.declare_step([s] * 8)
    c.prepare_step()   # a third page: min(max_pages 14, max(2 + 1, 2 x 2)) = 4
    assert c.layer_data(0)[0].shape[0] == 4
    c.commit_step()


def test_failed_growth_keeps_the_old_storage_and_the_step_declared(monkeypatch):
    from snapshot import assert_unchanged, snapshot
    rng = np.random.default_rng(4)
    c = make(layers=[kv.flat(), kv.ring(window=3)], max_seqs=1, initial_pages=2)
    s = c.seq_new()
    step(c, [s] * 4, rng)
    step(c, [s] * 4, rng)                           # the flat pool's 2 pages are in use
    c.declare_step([s, s])
    before = snapshot(c)
    arrays = [c.layer_data(i) for i in range(2)]

    def failing(self, kind, n_pages):
        raise MemoryError("simulated out of device memory")

    monkeypatch.setattr(storage_module.PageStorage, "_allocate", failing)
    with pytest.raises(kv.CapacityError, match="old pool is kept"):
        c.prepare_step()
    assert c.step_state == kv.StepState.DECLARED
    assert all(c.layer_data(i)[0] is arrays[i][0] for i in range(2))
    assert_unchanged(before, snapshot(c))
    monkeypatch.undo()
    c.prepare_step()  # the same step prepares once memory is back
    assert c.layer_data(0)[0].shape[0] == 4
    c.abort_step()


def test_float16_storage_round_trips():
    rng = np.random.default_rng(5)
    c = make(layers=[kv.flat()], max_seqs=1, dtype="float16")
    s = c.seq_new()
    k16, v16 = step(c, [s] * 3, rng, dtype=np.float16)[0]
    _, k, v = c.sequence_kv(s, 0)
    assert k.dtype == np.float16
    np.testing.assert_array_equal(k, k16)  # float16 in: exact
    np.testing.assert_array_equal(v, v16)
    k32, v32 = step(c, [s] * 3, rng, dtype=np.float32)[0]
    _, k, v = c.sequence_kv(s, 0)
    np.testing.assert_array_equal(k[3:], k32.astype(np.float16))  # float32 in: rounded
    np.testing.assert_allclose(k[3:].astype(np.float32), k32, rtol=1e-3, atol=1e-3)


def test_edges_last_row_last_column_full_width():
    rng = np.random.default_rng(6)
    c = make(layers=[kv.flat(), kv.ring(window=2)], max_seqs=3, max_write=4, max_step=12,
             capacity=8, initial_pages=8)  # flat rows == capacity, ring R = 5
    seqs = [c.seq_new() for _ in range(3)]
    step(c, [x for x in seqs for _ in range(4)], rng)  # width == max_step, last column 2
    written = step(c, [x for x in seqs for _ in range(4)], rng)  # positions 4..7: last row 7
    for s_i, s in enumerate(seqs):
        positions, k, _ = c.sequence_kv(s, 0)
        np.testing.assert_array_equal(positions, np.arange(8))
        np.testing.assert_array_equal(k[4:], written[0][0][4 * s_i:4 * s_i + 4])
        positions, k, _ = c.sequence_kv(s, 1)
        np.testing.assert_array_equal(positions, [3, 4, 5, 6, 7])
        np.testing.assert_array_equal(k[1:], written[1][0][4 * s_i:4 * s_i + 4])
    with pytest.raises(kv.CapacityError, match=r"pos 8 \+ 1 tokens exceeds capacity 8"):
        c.declare_step([seqs[0]])
    assert c.step_state == kv.StepState.IDLE and c.state(seqs[0]) == kv.SlotState.COMMITTED


def test_clone_copies_bytes_and_neither_side_sees_the_others_writes():
    rng = np.random.default_rng(7)
    c = make()
    a = c.seq_new()
    step(c, [a] * 4, rng)
    step(c, [a] * 3, rng)
    _, ka, _ = c.sequence_kv(a, 0)
    b = c.seq_clone(a, upto=5)
    _, kb, _ = c.sequence_kv(b, 0)
    np.testing.assert_array_equal(kb, ka[:5])
    pa, ka_ring, _ = c.sequence_kv(a, 1)   # R = 6, hw 7: a holds [1, 7)
    pb, kb_ring, _ = c.sequence_kv(b, 1)   # the clone keeps hw 7 and pos 5: [1, 5)
    np.testing.assert_array_equal(pa, np.arange(1, 7))
    np.testing.assert_array_equal(pb, np.arange(1, 5))
    np.testing.assert_array_equal(kb_ring, ka_ring[:4])
    wb = step(c, [b, b], rng)
    wa = step(c, [a], rng)
    _, ka2, _ = c.sequence_kv(a, 0)
    _, kb2, _ = c.sequence_kv(b, 0)
    np.testing.assert_array_equal(ka2[:7], ka)
    np.testing.assert_array_equal(ka2[7], wa[0][0][0])
    np.testing.assert_array_equal(kb2[:5], ka[:5])
    np.testing.assert_array_equal(kb2[5:], wb[0][0])


@pytest.mark.parametrize("bad", ["rank", "shape", "dtype", "layer", "idle"])
def test_write_refusals_launch_nothing(bad):
    rng = np.random.default_rng(8)
    c = make()
    s = c.seq_new()
    step(c, [s, s], rng)
    if bad != "idle":
        c.declare_step([s])
        c.prepare_step(2)
    before = storage(c)
    k = rng.standard_normal((2, H, D)).astype(np.float32)
    args = {"rank": (0, k[0], k[0]), "shape": (0, k[:1], k[:1]),
            "dtype": (0, k.astype(np.float64), k), "layer": (2, k, k), "idle": (0, k, k)}[bad]
    err = kv.StepProtocolError if bad == "idle" else kv.ShapeError
    with pytest.raises(err):
        c.write(*args)
    for (k0, v0), (k1, v1) in zip(before, storage(c)):
        np.testing.assert_array_equal(k0, k1)
        np.testing.assert_array_equal(v0, v1)
    assert c.pos(s) == 2


# ---------------------------------------------------------------- wide and element-wise paths
@pytest.mark.parametrize("storage_dtype,input_dtype,head_dim,strided", [
    ("float16", np.float16, 8, False),    # 16-byte vectors
    ("float32", np.float32, 4, False),    # 16-byte vectors
    ("float16", np.float16, 3, False),    # 6-byte runs: element-wise
    ("float16", np.float32, 8, False),    # a conversion: element-wise
    ("float32", np.float16, 4, False),
    ("float16", np.float16, 8, True),     # a strided device view: element-wise
])
def test_write_paths_store_exactly_the_input_converted(storage_dtype, input_dtype, head_dim,
                                                       strided):
    from kvnumba.device import cuda
    from kvnumba.kernels.launch.calling import VECTOR_BYTES, aligned
    from kvnumba.kernels.moves.write import whole_vectors

    def wide_ok(store, array):      # the write's test for its 16-byte vector path
        return (whole_vectors(array.shape[1] * array.shape[2], store.dtype)
                and array.dtype == store.dtype and array.is_c_contiguous()
                and aligned(array, VECTOR_BYTES))
    rng = np.random.default_rng(9)
    cfg = kv.CacheConfig(layers=[kv.flat(), kv.ring(window=2)], n_kv_heads=1,
                         head_dim=head_dim, capacity=16, max_seqs=2, max_write=4, max_step=8,
                         dtype=storage_dtype, initial_pages=4)
    c = kv.BatchedSequenceCache(cfg)
    a, b = c.seq_new(), c.seq_new()
    history = {(layer, s): ([], []) for layer in range(2) for s in (a, b)}   # (k rows, v rows)
    # a ends at pos 5, b at pos 6: the ring (R = 2 + 4 - 1 = 5) wraps for b (row 0 = pos 5)
    for ids in ([a, a, b], [b, a, b, b], [a, b, b, a]):
        c.declare_step(ids)
        plan = c.prepare_step(len(ids) + 1)                 # one padding token
        for layer in range(2):
            sent = []
            for _ in range(2):                              # distinct K and V inputs
                wide = rng.standard_normal((plan.width, 1, 2 * head_dim)).astype(input_dtype)
                host = wide[:, :, ::2] if strided else wide[:, :, :head_dim]
                dev = cuda.to_device(np.ascontiguousarray(wide))[:, :, ::2] if strided \
                    else cuda.to_device(np.ascontiguousarray(host))
                sent.append((host, dev))
            (k, k_dev), (v, v_dev) = sent
            store = c.layer_data(layer)[0]
            expect_wide = np.dtype(input_dtype) == store.dtype and \
                head_dim * store.dtype.itemsize % 16 == 0 and not strided
            assert wide_ok(store, k_dev) == expect_wide
            assert wide_ok(store, v_dev) == expect_wide
            c.write(layer, k_dev, v_dev)
            for t, s in enumerate(ids):
                history[layer, s][0].append(np.asarray(k[t]).astype(storage_dtype))
                history[layer, s][1].append(np.asarray(v[t]).astype(storage_dtype))
        c.commit_step()
    # flat: [0, pos); ring: [max(0, hw - 5), pos) -- a: hw 5 -> [0, 5); b: hw 6 -> [1, 6)
    expected = {(0, a): range(5), (0, b): range(6), (1, a): range(5), (1, b): range(1, 6)}
    for (layer, s), want_positions in expected.items():
        positions, k, v = c.sequence_kv(s, layer)
        assert positions.tolist() == list(want_positions), (layer, s)
        keep = list(want_positions)
        want_k = np.stack([history[layer, s][0][p] for p in keep])
        want_v = np.stack([history[layer, s][1][p] for p in keep])
        assert k.dtype == want_k.dtype and v.dtype == want_v.dtype
        assert k.tobytes() == want_k.tobytes(), (layer, s, "k")
        assert v.tobytes() == want_v.tobytes(), (layer, s, "v")


@pytest.mark.parametrize("dtype,head_dim", [("float16", 8), ("float16", 3), ("float32", 4)])
def test_clone_copies_every_kind_in_one_launch_each(dtype, head_dim, monkeypatch):
    from kvnumba.kernels.moves import page_copy as copy_module
    rng = np.random.default_rng(10)
    layers = [kv.flat(), kv.ring(window=3), kv.flat(), kv.ring(window=5), kv.ring(window=3)]
    cfg = kv.CacheConfig(layers=layers, n_kv_heads=2, head_dim=head_dim, capacity=32,
                         max_seqs=3, max_write=4, max_step=8, dtype=dtype, initial_pages=4)
    c = kv.BatchedSequenceCache(cfg)
    a = c.seq_new()
    sent = [[] for _ in layers]                             # K rows per layer, position order
    for n in (4, 4, 3):
        c.declare_step([a] * n)
        plan = c.prepare_step()
        for layer in range(len(layers)):
            k = rng.standard_normal((plan.width, 2, head_dim)).astype(dtype)
            c.write(layer, k, -k)
            sent[layer] += list(k[:n])
        c.commit_step()
    launches = []
    real = copy_module.copy_rows
    monkeypatch.setattr("kvnumba.data.storage.copy_rows",
                        lambda *args, **kw: launches.append(args[0].shape) or real(*args, **kw))
    b = c.seq_clone(a, upto=9)
    # ring R=8 alone; R=6 and flat pairs (the flat page straddling position 9 is copied)
    assert sorted(s[0] for s in launches) == [1, 2, 2]
    # a: pos 11, hw 11; the clone: pos 9, hw 11. Flat: [0, pos). Ring w=3: R = 3 + 4 - 1 = 6,
    # holds [11 - 6, pos); ring w=5: R = 8, holds [11 - 8, pos).
    held_a = [range(11), range(5, 11), range(11), range(3, 11), range(5, 11)]
    held_b = [range(9), range(5, 9), range(9), range(3, 9), range(5, 9)]
    for layer in range(len(layers)):
        pa, ka, va = c.sequence_kv(a, layer)
        pb, kb, vb = c.sequence_kv(b, layer)
        assert pa.tolist() == list(held_a[layer]), layer
        assert pb.tolist() == list(held_b[layer]), layer
        want_k = np.stack([sent[layer][p] for p in held_b[layer]])
        assert kb.tobytes() == want_k.tobytes(), layer
        assert vb.tobytes() == (-want_k).tobytes(), layer
        want_a = np.stack([sent[layer][p] for p in held_a[layer]])   # the source is untouched
        assert ka.tobytes() == want_a.tobytes() and va.tobytes() == (-want_a).tobytes(), layer
