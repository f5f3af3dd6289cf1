"""The floor vectors of contract §5, one test each, through the public cache."""
import pytest

import kvnumba as kv


def cache(window, max_write, max_seqs=3):
    cfg = kv.CacheConfig(layers=[kv.flat(), kv.ring(window=window)], n_kv_heads=1, head_dim=2,
                         capacity=64, max_seqs=max_seqs, max_write=max_write,
                         max_step=max_write * max_seqs, dtype="float32", initial_pages=8)
    return kv.BatchedSequenceCache(cfg)


def write_to(c, seq, upto, chunk):
    while c.pos(seq) < upto:
        n = min(chunk, upto - c.pos(seq))
        c.declare_step([seq] * n)
        c.prepare_step()
        c.commit_step()


def test_ring_rows_is_window_plus_max_write_minus_one():
    c = cache(4, 3)
    assert [p.kind for p in c.pool_pages()] == ["flat layers", "ring layers of 6 rows"]
    s = c.seq_new()
    write_to(c, s, 10, 3)
    assert c.sequence_kv(s, 1)[0].tolist() == list(range(4, 10))   # [hw - R, pos)


def test_w4_m3_written_to_21_rewind_to_18_allowed():
    c = cache(4, 3)
    s = c.seq_new()
    write_to(c, s, 21, 3)
    assert c.floor(s) == 18
    c.rewind(s, 18)
    assert c.pos(s) == 18 and c.state(s) == kv.SlotState.REWOUND


def test_w4_m3_written_to_21_rewind_to_17_refused():
    c = cache(4, 3)
    s = c.seq_new()
    write_to(c, s, 21, 3)
    with pytest.raises(kv.RingFloorError) as err:
        c.rewind(s, 17)
    assert "17" in str(err.value) and "18" in str(err.value) and "layer 1" in str(err.value)
    assert isinstance(err.value, kv.PositionError)
    assert c.pos(s) == 21 and c.state(s) == kv.SlotState.COMMITTED


def test_w4_m1_written_to_10_clone_upto_9_allowed():
    c = cache(4, 1)
    s = c.seq_new()
    write_to(c, s, 10, 1)
    d = c.seq_clone(s, upto=9)
    assert (c.pos(d), c.high_water(d), c.state(d)) == (9, 10, kv.SlotState.COMMITTED)


def test_w4_m1_written_to_10_clone_upto_6_refused():
    c = cache(4, 1)
    s = c.seq_new()
    write_to(c, s, 10, 1)
    with pytest.raises(kv.RingFloorError):
        c.seq_clone(s, upto=6)
    assert [c.state(i) for i in range(3)] == [kv.SlotState.COMMITTED, kv.SlotState.FREE,
                                              kv.SlotState.FREE]


def test_w4_m1_clone_of_clone_keeps_the_donors_high_water():
    c = cache(4, 1)
    s = c.seq_new()
    write_to(c, s, 10, 1)
    d = c.seq_clone(s, upto=9)
    assert c.floor(d) == 9
    with pytest.raises(kv.RingFloorError):
        c.seq_clone(d, upto=8)


def test_w4_m3_written_to_6_never_wrapped_rewind_to_0():
    c = cache(4, 3)
    s = c.seq_new()
    write_to(c, s, 6, 3)
    assert c.floor(s) == 0
    c.rewind(s, 0)
    assert c.pos(s) == 0


def test_flat_only_cache_has_floor_zero():
    cfg = kv.CacheConfig(layers=[kv.flat()], n_kv_heads=1, head_dim=2, capacity=32, max_seqs=1,
                         max_write=4, max_step=4, dtype="float32", initial_pages=4)
    c = kv.BatchedSequenceCache(cfg)
    s = c.seq_new()
    write_to(c, s, 30, 4)
    assert c.floor(s) == 0
    c.rewind(s, 0)


def test_floor_is_the_max_over_ring_layers():
    cfg = kv.CacheConfig(layers=[kv.ring(window=8), kv.ring(window=3)], n_kv_heads=1,
                         head_dim=2, capacity=64, max_seqs=1, max_write=2, max_step=2,
                         dtype="float32")
    c = kv.BatchedSequenceCache(cfg)
    s = c.seq_new()
    write_to(c, s, 20, 2)
    # R = 9 and 4: both wrapped, floor = hw - M on each, the same 18
    assert c.floor(s) == 18
    assert [p.kind for p in c.pool_pages()] == ["ring layers of 4 rows", "ring layers of 9 rows"]


def test_floor_refusals_name_the_layer_from_rewind_and_seq_clone():
    c = cache(4, 3)                      # ring layer 1: W 4, R 6
    s = c.seq_new()
    write_to(c, s, 21, 3)                # floor 18
    names = "is below the floor 18 of sequence 0: ring layer 1 (window 4, 6 rows) holds only " \
            "positions [15, 21)"
    calls = {"rewind": lambda: c.rewind(s, 17),
             "seq_clone": lambda: c.seq_clone(s, upto=17)}
    for verb, call in calls.items():
        with pytest.raises(kv.RingFloorError) as err:
            call()
        assert str(err.value).startswith(f"{verb}: target position 17 {names}")
    assert (c.pos(s), c.state(s), c.state(1)) == (21, kv.SlotState.COMMITTED, kv.SlotState.FREE)


def test_pack_floor_refusal_names_the_layer():
    c = cache(4, 3)
    t = kv.SessionTable(c, max_sessions=3, max_session_tokens=64)
    sid = t.open()
    write_to(c, t.seq(sid), 21, 3)
    with pytest.raises(kv.RingFloorError) as err:
        t.pack([(sid, 17, [1])])
    assert f"session {sid}" in str(err.value) and "a rewind from its cursor 21" in str(err.value)
    assert "target position 17 is below the floor 18 of sequence 0: ring layer 1 (window 4, " \
           "6 rows)" in str(err.value)
    assert (t.pos(sid), c.state(t.seq(sid))) == (21, kv.SlotState.COMMITTED)
