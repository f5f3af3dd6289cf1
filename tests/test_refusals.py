"""Refusals are typed, name the numbers, and change nothing; strict mode drives `transitions`."""
import numpy as np
import pytest

import kvnumba as kv
from kvnumba.host.slots import SlotState
from snapshot import assert_unchanged, snapshot


def make(**kw):
    base = dict(layers=[kv.flat(), kv.ring(window=4)], n_kv_heads=1, head_dim=2, capacity=16,
                max_seqs=3, max_write=4, max_step=6, dtype="float32", initial_pages=4)
    base.update(kw)
    return kv.BatchedSequenceCache(kv.CacheConfig(**base))


def run(c, ids):
    c.declare_step(ids)
    c.prepare_step()
    c.commit_step()


def facts(c):
    return ([(c.state(s), c.pos(s), c.high_water(s)) for s in range(c.max_seqs)], c.step_state)


def refused(c, cls, fn, *match):
    before = facts(c)
    with pytest.raises(cls) as err:
        fn()
    for text in match:
        assert text in str(err.value), (text, str(err.value))
    assert facts(c) == before
    return err.value


def test_slot_state_error_names_sequence_state_event_and_allowed_states():
    c = make()
    s = c.seq_new()
    err = refused(c, kv.SlotStateError, lambda: c.rewind(s, 0), "sequence 0", "CLAIMED",
                  "'rewind'", "COMMITTED, REWOUND")
    assert not isinstance(err, kv.UnknownSequenceError)


def test_free_ids_are_unknown_and_in_the_wrong_state():
    c = make()
    for fn in (lambda: c.seq_rm(1), lambda: c.rewind(1, 0), lambda: c.declare_step([1]),
               lambda: c.seq_clone(1)):
        err = refused(c, kv.UnknownSequenceError, fn, "1", "FREE")
        assert isinstance(err, kv.SlotStateError)


@pytest.mark.parametrize("seq", [-1, 3, 100])
def test_out_of_range_ids(seq):
    c = make()
    refused(c, kv.UnknownSequenceError, lambda: c.pos(seq), str(seq), "[0, 3)")
    refused(c, kv.UnknownSequenceError, lambda: c.declare_step([seq]), str(seq))
    refused(c, kv.UnknownSequenceError, lambda: c.seq_rm(seq), str(seq))


def test_cache_full_names_the_count():
    c = make()
    for _ in range(3):
        c.seq_new()
    refused(c, kv.CacheFullError, c.seq_new, "3")
    run(c, [0])
    refused(c, kv.CacheFullError, lambda: c.seq_clone(0), "3")


def test_owner_run_error_names_the_block_owner_and_its_runs():
    c = make()
    a, b = c.seq_new(), c.seq_new()
    refused(c, kv.OwnerRunError, lambda: c.declare_step([a, b, b, a], blocks=[a]),
            "block owner 0", "(0, 1)", "(3, 4)")
    refused(c, kv.OwnerRunError, lambda: c.declare_step([b, b], blocks=[a]),
            "sequence 0, which has no run")
    c.declare_step([a, b, b, a], blocks=[b])      # spans are fine; only a block is one run
    assert [(g.seq, g.q_len, g.block) for g in c.plan.segments] == \
        [(a, 1, False), (b, 2, True), (a, 1, False)]


def test_declare_refusal_order_names_the_first_broken_rule():
    c = make(max_step=6, capacity=8)
    a, b = c.seq_new(), c.seq_new()
    run(c, [a] * 4)
    run(c, [a] * 3)
    # a is a block owner in two runs AND writes too much AND passes capacity
    refused(c, kv.OwnerRunError, lambda: c.declare_step([a] * 5 + [b] + [a], blocks=[a]))
    # spans count together: 3 + 2 tokens of a pass max_write 4, then capacity
    refused(c, kv.CapacityError, lambda: c.declare_step([a] * 3 + [b] + [a] * 2),
            "sequence 0 writes 5 tokens", "max_write 4")
    refused(c, kv.CapacityError, lambda: c.declare_step([a] * 5), "5 tokens", "max_write 4")
    refused(c, kv.CapacityError, lambda: c.declare_step([a, b, a]), "pos 7 + 2", "capacity 8")


def test_more_tokens_than_max_step():
    c = make(max_step=6)
    seqs = [c.seq_new() for _ in range(3)]
    run(c, seqs)
    refused(c, kv.CapacityError, lambda: c.declare_step([0] * 3 + [1] * 3 + [2]),
            "7 tokens", "max_step 6")


def test_bad_seq_ids_and_blocks():
    c = make()
    a = c.seq_new()
    refused(c, kv.ShapeError, lambda: c.declare_step([]), "non-empty")
    refused(c, kv.ShapeError, lambda: c.declare_step(np.array([[a]])))
    refused(c, kv.ShapeError, lambda: c.declare_step(np.array([0.0])))
    b = c.seq_new()
    refused(c, kv.OwnerRunError, lambda: c.declare_step([a], blocks=[b]), "sequence 1",
            "no run")


def test_step_protocol_out_of_order():
    c = make()
    a = c.seq_new()
    refused(c, kv.StepProtocolError, c.prepare_step, "IDLE", "DECLARED")
    refused(c, kv.StepProtocolError, c.commit_step, "IDLE")
    refused(c, kv.StepProtocolError, c.abort_step, "IDLE")
    c.declare_step([a])
    refused(c, kv.StepProtocolError, c.commit_step, "DECLARED", "PREPARED")
    refused(c, kv.StepProtocolError, lambda: c.declare_step([a]), "DECLARED")
    refused(c, kv.StepProtocolError, c.seq_new, "open")
    refused(c, kv.StepProtocolError, lambda: c.seq_rm(a), "open")
    refused(c, kv.StepProtocolError, lambda: c.write(0, np.zeros((1, 1, 2), np.float32),
                                                     np.zeros((1, 1, 2), np.float32)))
    refused(c, kv.CapacityError, lambda: c.prepare_step(7), "width 7", "max_step 6")
    refused(c, kv.CapacityError, lambda: c.prepare_step(0), "width 0")
    c.prepare_step()
    refused(c, kv.StepProtocolError, c.prepare_step, "PREPARED")
    c.commit_step()
    assert c.pos(a) == 1


def test_rewind_and_clone_bounds_name_the_numbers():
    c = make()
    a = c.seq_new()
    run(c, [a] * 3)
    refused(c, kv.PositionError, lambda: c.rewind(a, 4), "position 4", "[0, 3]")
    refused(c, kv.PositionError, lambda: c.seq_clone(a, 0), "upto=0", "[1, 3]")
    refused(c, kv.PositionError, lambda: c.seq_clone(a, 4), "upto=4")


def test_abort_restores_each_sequence_to_its_earlier_state():
    c = make()
    a, b, d = c.seq_new(), c.seq_new(), c.seq_new()
    run(c, [b, d])
    c.rewind(d, 0)
    c.declare_step([a, b, d])
    assert [c.state(s) for s in (a, b, d)] == [SlotState.PREFILLING] * 3
    c.abort_step()
    assert [c.state(s) for s in (a, b, d)] == [SlotState.CLAIMED, SlotState.COMMITTED,
                                                SlotState.REWOUND]
    assert [c.high_water(s) for s in (a, b, d)] == [0, 1, 1]  # not prepared: no rise
    c.declare_step([a, a, b])
    c.prepare_step()
    c.abort_step()
    assert [c.pos(s) for s in (a, b)] == [0, 1]
    assert [c.high_water(s) for s in (a, b)] == [2, 2]  # prepared: kernels may have written


def test_strict_mode_drives_the_transitions_models(monkeypatch):
    monkeypatch.setenv("KVNUMBA_STRICT", "1")
    c = make()
    a, b = c.seq_new(), c.seq_new()
    run(c, [a, a, b])
    c.rewind(a, 1)
    d = c.seq_clone(b)
    c.declare_step([a, d])
    c.abort_step()
    c.seq_rm(b)
    refused(c, kv.SlotStateError, lambda: c.rewind(b, 0))
    models = c._slots._models
    assert models is not None
    assert [m.state for m in models] == [c.state(s).name.lower() for s in range(3)]
    assert c._steps.machine._model.state == "idle"


# ---------------------------------------------------------------- half-written steps
def three_layers(single):
    """A cache of three layers (flat, ring, flat) and its step verbs' sequence ids."""
    cfg = kv.CacheConfig(layers=[kv.flat(), kv.ring(window=4), kv.flat()], n_kv_heads=1,
                         head_dim=2, capacity=16, max_seqs=1 if single else 2, max_write=4,
                         max_step=6, dtype="float32", initial_pages=4)
    if single:
        c = kv.SequenceCache(cfg)
        return c, lambda n: c.declare_step(n)
    c = kv.BatchedSequenceCache(cfg)
    a = c.seq_new()
    return c, lambda n: c.declare_step([a] * n)


@pytest.mark.parametrize("single", [False, True], ids=["batched", "single"])
def test_a_half_written_step_is_refused_naming_the_unwritten_layers(single):
    c, declare = three_layers(single)
    declare(2)
    c.prepare_step()
    c.commit_step()                      # no layer written: positions only
    declare(2)
    c.prepare_step(3)
    c.write(1, np.ones((3, 1, 2), np.float32), np.ones((3, 1, 2), np.float32))
    before = snapshot(c)
    with pytest.raises(kv.StepProtocolError) as err:
        c.commit_step()
    assert "wrote layers [1] but not [0, 2]" in str(err.value)
    assert "abort_step()" in str(err.value)
    assert_unchanged(before, snapshot(c))
    c.abort_step()                       # still open: the step is discarded
    pos = c.pos if single else c.pos(0)
    hw = c.high_water if single else c.high_water(0)
    assert (c.step_state, pos, hw) == (kv.StepState.IDLE, 2, 4)


# ---------------------------------------------------------------- limits
def test_every_limit_is_a_capacity_error_from_every_face():
    c = make()                           # capacity 16, max_write 4, max_step 6
    t = kv.SessionTable(c, max_sessions=3, max_session_tokens=10)
    a, b, d = t.open(), t.open(), t.open()
    sa, sb = t.seq(a), t.seq(b)
    for n in (4, 4, 4, 2):               # a reaches 14, past the table's own limit
        run(c, [sa] * n)
    refused(c, kv.CapacityError, lambda: c.declare_step([sb] * 5), "writes 5 tokens",
            "more than max_write 4", "split it into chunks of at most max_write=4 tokens")
    refused(c, kv.CapacityError, lambda: c.declare_step([sa] * 3), "pos 14 + 3 tokens",
            "capacity 16")
    refused(c, kv.CapacityError, lambda: c.declare_step([sa] * 2 + [sb] * 4 + [t.seq(d)]),
            "7 tokens exceed max_step 6")
    refused(c, kv.CapacityError, lambda: t.pack([(b, 0, [1] * 5)]), "writes 5 tokens",
            "split it into chunks of at most max_write=4 tokens")
    refused(c, kv.CapacityError, lambda: t.pack([(b, 0, [1] * 3), (b, 3, [1] * 2)]),
            "writes 5 tokens")
    refused(c, kv.CapacityError, lambda: t.pack([(a, 14, [1])]), "position 15",
            "max_session_tokens 10")
    refused(c, kv.CapacityError, lambda: t.clone(a, upto=11), "upto=11",
            "max_session_tokens 10")
    c.declare_step([sb] * 2)
    refused(c, kv.CapacityError, lambda: c.prepare_step(7), "width 7", "max_step 6")
    c.abort_step()
    single = kv.SequenceCache(kv.CacheConfig(layers=[kv.flat()], n_kv_heads=1, head_dim=2,
                                             capacity=16, max_seqs=1, max_write=4, max_step=6,
                                             dtype="float32", initial_pages=4))
    before = snapshot(single)
    with pytest.raises(kv.CapacityError, match="max_write 4; split it into chunks of at most "
                                               "max_write=4 tokens"):
        single.declare_step(5)
    assert_unchanged(before, snapshot(single))


def test_rows_of_a_padded_step_name_its_width():
    c = make()
    a = c.seq_new()
    c.declare_step([a] * 2)
    c.prepare_step(5)
    two, five = np.zeros((2, 1, 2), np.float32), np.zeros((5, 1, 2), np.float32)
    hint = "prepared with prepare_step(width=5) for 2 tokens: pass 5 rows"
    refused(c, kv.ShapeError, lambda: c.write(0, two, two), hint)
    refused(c, kv.ShapeError, lambda: c.write(0, five, two), "v: expected shape", hint)
    refused(c, kv.ShapeError, lambda: c.attend(0, two), "q: expected shape", hint)
    refused(c, kv.ShapeError, lambda: c.update_and_attend(0, five, five, two), hint)
    err = refused(c, kv.ShapeError, lambda: c.write(0, np.zeros((3, 1, 2), np.float32), five))
    assert "prepare_step(width=" not in str(err)   # 3 rows: not the step's token count
