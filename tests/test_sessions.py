"""SessionTable (contract §10) over a BatchedSequenceCache and over a SequenceBatchControl."""
import numpy as np
import pytest

import kvnumba as kv
from snapshot import assert_unchanged, snapshot as full_snapshot

H, D = 1, 4  # kv heads, head_dim: tiny for the simulator


def batched(max_seqs=3, **kw):
    cfg = dict(layers=[kv.flat(), kv.ring(window=4)], n_kv_heads=H, head_dim=D, capacity=32,
               max_seqs=max_seqs, max_write=8, max_step=16, dtype="float32", initial_pages=8)
    cfg.update(kw)
    return kv.BatchedSequenceCache(kv.CacheConfig(**cfg))


def single(**kw):
    cfg = dict(layers=[kv.flat(), kv.ring(window=4)], n_kv_heads=H, head_dim=D, capacity=32,
               max_seqs=1, max_write=8, max_step=16, dtype="float32", initial_pages=8)
    cfg.update(kw)
    return kv.SequenceBatchControl(kv.SequenceCache(kv.CacheConfig(**cfg)))


def run_step(control, seq_ids, rng=None, width=None):
    """declare / prepare / write every layer / commit; returns the K written per layer."""
    rng = rng or np.random.default_rng(0)
    control.declare_step(seq_ids)
    plan = control.prepare_step(width)
    written = []
    for layer in range(control.config.n_layers):
        k = rng.standard_normal((plan.width, H, D)).astype(np.float32)
        v = rng.standard_normal((plan.width, H, D)).astype(np.float32)
        control.write(layer, k, v)
        written.append((k, v))
    control.commit_step()
    return written


def advance(control, seq_ids):
    """A step that writes no layer: positions only (control-plane tests need no kernels)."""
    control.declare_step(seq_ids)
    control.prepare_step()
    control.commit_step()


def snapshot(control):
    return [(control.state(s), control.pos(s), control.high_water(s))
            for s in range(control.max_seqs)], control.step_state


# ---------------------------------------------------------------- packing rules
def test_inputs_pack_in_order_with_positions_and_logits():
    c = batched()
    t = kv.SessionTable(c, max_sessions=3, max_session_tokens=20)
    s1, s2, s3 = t.open(), t.open(), t.open()
    assert (s1, s2, s3) == (1, 2, 3) and t.sessions == (1, 2, 3)
    run_step(c, [t.seq(s1)] * 3)
    assert t.pos(s1) == 3
    p = t.pack([(s1, 3, [10, 11]), (s2, 0, [20, 21, 22]), (s3, 0, [30])])
    assert p.tokens.tolist() == [10, 11, 20, 21, 22, 30]
    assert p.positions.tolist() == [3, 4, 0, 1, 2, 0]
    q1, q2, q3 = t.seq(s1), t.seq(s2), t.seq(s3)
    assert p.seq_ids.tolist() == [q1, q1, q2, q2, q2, q3]
    assert p.logit_indices.tolist() == [1, 4, 5]
    plan = c.declare_step(p.seq_ids)
    assert plan.logit_indices.tolist() == [1, 4, 5]
    plan = c.prepare_step()
    assert plan.positions.tolist() == p.positions.tolist()


def test_abutting_chunks_of_one_prompt_form_one_run():
    c = batched()
    t = kv.SessionTable(c, max_sessions=3, max_session_tokens=20)
    s1, s2 = t.open(), t.open()
    p = t.pack([(s1, 0, [1, 2]), (s1, 2, [3, 4, 5]), (s2, 0, [7])])
    assert p.positions.tolist() == [0, 1, 2, 3, 4, 0]
    # the earlier chunk samples nothing; each session samples its own last row
    assert p.logit_indices.tolist() == [-1, 4, 5]
    plan = c.declare_step(p.seq_ids)
    assert [(s.seq, s.q_start, s.q_len) for s in plan.segments] == \
        [(t.seq(s1), 0, 5), (t.seq(s2), 5, 1)]


def test_payload_rows_concatenate_along_axis_0():
    c = batched()
    t = kv.SessionTable(c, max_sessions=2, max_session_tokens=20)
    s1, s2 = t.open(), t.open()
    a, b = np.ones((2, 3), np.float32), np.full((1, 3), 2, np.float32)
    p = t.pack([(s1, 0, a), (s2, 0, b)])
    assert p.tokens.shape == (3, 3) and p.tokens[2].tolist() == [2, 2, 2]
    with pytest.raises(kv.ShapeError):
        t.pack([(s1, 0, a), (s2, 0, np.ones((1, 4)))])


def test_first_input_before_cursor_rewinds_after_the_batch_passes():
    c = batched()
    t = kv.SessionTable(c, max_sessions=2, max_session_tokens=20)
    s1, s2 = t.open(), t.open()
    run_step(c, [t.seq(s1)] * 5 + [t.seq(s2)] * 3)
    p = t.pack([(s1, 2, [9, 9]), (s2, 3, [8])])
    assert t.pos(s1) == 2 and c.state(t.seq(s1)) == kv.SlotState.REWOUND
    assert t.pos(s2) == 3 and c.state(t.seq(s2)) == kv.SlotState.COMMITTED
    assert p.positions.tolist() == [2, 3, 3]


def test_refused_batch_rewinds_nothing():
    c = batched()
    t = kv.SessionTable(c, max_sessions=2, max_session_tokens=20)
    s1, s2 = t.open(), t.open()
    run_step(c, [t.seq(s1)] * 5 + [t.seq(s2)] * 3)
    before = snapshot(c)
    with pytest.raises(kv.SessionError, match=rf"session {s2}.*gap"):
        t.pack([(s1, 2, [9, 9]), (s2, 4, [8])])  # rewinds s1, gaps s2
    assert snapshot(c) == before and t.pos(s1) == 5 and t.pos(s2) == 3


@pytest.mark.parametrize("inputs, pattern", [
    # session a's cursor is 1, session b's is 0
    (lambda a, b: [(a, 1, [1, 2, 3]), (a, 3, [4])], "overlapping"),
    (lambda a, b: [(a, 1, [1]), (a, 3, [4])], "gap"),
    (lambda a, b: [(a, 2, [1])], "gap"),
    (lambda a, b: [(a, 0, [1]), (b, 1, [2])], "gap"),  # a's queued rewind must not run
    (lambda a, b: [(a, 1, [1]), (b, 0, [2]), (a, 1, [3])], "overlapping"),
    (lambda a, b: [(a, 1, [1]), (b, 0, [2]), (a, 3, [3])], "gap"),
    (lambda a, b: [(a, 1, [1], 1)], "produce_output must be True or False"),
    (lambda a, b: [(a, 1, [1], True, 0)], "must be"),
    (lambda a, b: [(a, 1, [1]), (99, 0, [2])], "unknown session 99"),
    (lambda a, b: [(a, 1, [])], "no tokens"),
    (lambda a, b: [(a, -1, [1])], "before position 0"),
    (lambda a, b: [], "no inputs"),
])
def test_pack_refusals_change_nothing(inputs, pattern):
    c = batched()
    t = kv.SessionTable(c, max_sessions=2, max_session_tokens=10)
    a, b = t.open(), t.open()
    run_step(c, [t.seq(a)] * 2)
    t.pack([(a, 1, [5])])  # a is now REWOUND at 1: refusals must keep it there
    before = snapshot(c)
    with pytest.raises(kv.SessionError, match=pattern):
        t.pack(inputs(a, b))
    assert snapshot(c) == before and t.pos(a) == 1


@pytest.mark.parametrize("inputs", [
    lambda a: [(a, 1, list(range(10)))],
    lambda a: [(a, 1, list(range(6))), (a, 7, list(range(4)))],
])
def test_pack_past_max_session_tokens_is_a_capacity_error(inputs):
    c = batched()
    t = kv.SessionTable(c, max_sessions=2, max_session_tokens=10)
    a = t.open()
    run_step(c, [t.seq(a)])
    before = snapshot(c)
    with pytest.raises(kv.CapacityError, match=r"position 11, past max_session_tokens 10"):
        t.pack(inputs(a))
    assert snapshot(c) == before and t.pos(a) == 1


def test_closed_session_is_unknown():
    c = batched()
    t = kv.SessionTable(c, max_sessions=2, max_session_tokens=10)
    s = t.open()
    t.close(s)
    for verb in (lambda: t.pack([(s, 0, [1])]), lambda: t.pos(s), lambda: t.seq(s),
                 lambda: t.clone(s)):
        with pytest.raises(kv.SessionError, match=f"session {s}"):
            verb()


def test_rewind_below_floor_is_refused():
    # ring W=4, M=8: R = 11; after 16 positions the floor is 16 - 8 = 8
    c = batched()
    t = kv.SessionTable(c, max_sessions=2, max_session_tokens=30)
    s = t.open()
    run_step(c, [t.seq(s)] * 8)
    run_step(c, [t.seq(s)] * 8)
    assert c.floor(t.seq(s)) == 8
    before = snapshot(c)
    with pytest.raises(kv.RingFloorError, match=rf"session {s}.*7.*floor 8"):
        t.pack([(s, 7, [1])])
    assert snapshot(c) == before
    p = t.pack([(s, 8, [1])])
    assert t.pos(s) == 8 and p.positions.tolist() == [8]


def test_session_ids_monotonic_never_reused_and_close_is_idempotent():
    c = batched()
    t = kv.SessionTable(c, max_sessions=3, max_session_tokens=10)
    assert [t.open(), t.open()] == [1, 2]
    seq1 = t.seq(1)
    t.close(1)
    assert c.state(seq1) == kv.SlotState.FREE
    t.close(1)
    t.close(42)  # unknown: nothing
    s3 = t.open()
    assert s3 == 3 and t.seq(s3) == seq1  # the column is reused, the id is not
    t.close(2), t.close(3)
    assert t.open() == 4 and t.sessions == (4,)


def test_open_at_max_sessions_and_when_control_full():
    c = batched(max_seqs=3)
    t = kv.SessionTable(c, max_sessions=2, max_session_tokens=10)
    t.open(), t.open()
    before = snapshot(c)
    with pytest.raises(kv.SessionError, match="max_sessions=2"):
        t.open()
    assert snapshot(c) == before and t.sessions == (1, 2)

    c = batched(max_seqs=3)
    t = kv.SessionTable(c, max_sessions=3, max_session_tokens=10)
    assert [t.open() for _ in range(2)] == [1, 2]
    c.seq_new()  # a sequence the table does not own fills the control
    before = snapshot(c)
    with pytest.raises(kv.SessionError, match="no free sequence"):
        t.open()
    assert snapshot(c) == before and t.sessions == (1, 2)
    t.close(2)
    assert t.open() == 3  # the refused open consumed no id


def test_clone_shares_the_prefix_and_nothing_after():
    c = batched()
    t = kv.SessionTable(c, max_sessions=3, max_session_tokens=20)
    s = t.open()
    rng = np.random.default_rng(1)
    written = run_step(c, [t.seq(s)] * 5, rng)
    dup = t.clone(s, upto=3)
    assert dup == 2 and t.pos(dup) == 3 and c.state(t.seq(dup)) == kv.SlotState.COMMITTED
    for layer, (k, v) in enumerate(written):
        pos_c, k_c, v_c = c.sequence_kv(t.seq(dup), layer)
        assert pos_c.tolist() == [0, 1, 2]
        assert k_c.tobytes() == k[:3].tobytes() and v_c.tobytes() == v[:3].tobytes()
    src_kv = [c.sequence_kv(t.seq(s), layer) for layer in range(2)]
    # the clone writes its own continuation; the source does not see it
    p = t.pack([(dup, 3, [1, 2])])
    run_step(c, p.seq_ids, np.random.default_rng(2))
    for layer in range(2):
        now = c.sequence_kv(t.seq(s), layer)
        assert all(np.array_equal(x, y) for x, y in zip(now, src_kv[layer]))
    full = t.clone(s)
    assert t.pos(full) == 5


def test_clone_refusals():
    c = batched()
    t = kv.SessionTable(c, max_sessions=2, max_session_tokens=4)
    s = t.open()
    with pytest.raises(kv.SessionError, match=rf"session {s}.*upto=0"):
        t.clone(s)  # empty: nothing to clone
    run_step(c, [t.seq(s)] * 6)  # written past the table's limit directly through the control
    before = snapshot(c)
    with pytest.raises(kv.SessionError, match=r"upto=7 outside \(0, 6\]"):
        t.clone(s, upto=7)
    with pytest.raises(kv.SessionError, match=r"upto=0 outside"):
        t.clone(s, upto=0)
    with pytest.raises(kv.CapacityError, match="upto=5 exceeds max_session_tokens 4"):
        t.clone(s, upto=5)
    assert snapshot(c) == before
    t.open()
    before = snapshot(c)
    with pytest.raises(kv.SessionError, match="max_sessions=2"):
        t.clone(s, upto=2)
    assert snapshot(c) == before and t.sessions == (1, 2)


def test_clone_below_floor_is_ring_floor_error_naming_session():
    c = batched()
    t = kv.SessionTable(c, max_sessions=3, max_session_tokens=30)
    s = t.open()
    run_step(c, [t.seq(s)] * 8)
    run_step(c, [t.seq(s)] * 8)
    with pytest.raises(kv.RingFloorError, match=rf"session {s}"):
        t.clone(s, upto=7)
    assert t.sessions == (s,)


def test_invalid_table_limits():
    with pytest.raises(kv.ConfigError, match="max_sessions"):
        kv.SessionTable(batched(), max_sessions=0, max_session_tokens=4)


# ---------------------------------------------------------------- the prefix face
def test_the_prefix_face_is_read_once_from_the_control():
    from kvnumba.protocol import BatchControl, PrefixControl, members_lacking
    many, one = batched(), single()
    assert isinstance(many, PrefixControl) and not isinstance(one, PrefixControl)
    assert isinstance(one, BatchControl) and members_lacking(one, BatchControl) == []
    assert members_lacking(one, PrefixControl) == ["prefix_counts", "prefix_match",
                                                   "seq_from_prefix", "prefix_register",
                                                   "prefix_forget"]
    assert kv.SessionTable(many, max_sessions=3, max_session_tokens=20).indexed
    t = kv.SessionTable(one, max_sessions=1, max_session_tokens=20)
    assert not t.indexed
    s = t.open(prefix=list(range(12)))       # no index: the session starts empty
    assert t.pos(s) == 0 and t.register(s, list(range(12))) == 0
    assert t.forget(list(range(12))) == 0
    assert t.prefix_stats == kv.PrefixStats(12, 0, 0)


def test_a_control_lacking_batch_verbs_is_named_in_the_refusal():
    class Half:
        config = max_seqs = step_state = plan = None

        def seq_new(self):
            return 0

    with pytest.raises(kv.ConfigError, match=r"it lacks seq_rm, seq_clone, rewind"):
        kv.SessionTable(Half(), max_sessions=1, max_session_tokens=4)


# ---------------------------------------------------------------- over SequenceBatchControl
def test_single_control_serves_one_session_at_a_time():
    c = single()
    with pytest.raises(kv.ConfigError, match=r"max_sessions=4 .* max_seqs is 1"):
        kv.SessionTable(c, max_sessions=4, max_session_tokens=30)
    t = kv.SessionTable(c, max_sessions=1, max_session_tokens=30)
    s = t.open()
    assert s == 1 and t.seq(s) == 0
    with pytest.raises(kv.SessionError, match="max_sessions=1"):
        t.open()
    assert t.sessions == (1,)


def test_single_control_abutting_chunks_and_rewind_into_history():
    c = single()
    t = kv.SessionTable(c, max_sessions=1, max_session_tokens=30)
    s = t.open()
    p = t.pack([(s, 0, [1, 2, 3]), (s, 3, [4, 5])])
    assert p.logit_indices.tolist() == [-1, 4] and p.positions.tolist() == [0, 1, 2, 3, 4]
    written = run_step(c, p.seq_ids, np.random.default_rng(3))
    assert t.pos(s) == 5 and c.state(0) == kv.SlotState.COMMITTED
    p = t.pack([(s, 2, [7])])  # back into committed history
    assert t.pos(s) == 2 and c.state(0) == kv.SlotState.REWOUND
    new = run_step(c, p.seq_ids, np.random.default_rng(4))
    assert t.pos(s) == 3
    pos, k, _ = c.sequence_kv(0, 0)
    assert pos.tolist() == [0, 1, 2]
    assert k[:2].tobytes() == written[0][0][:2].tobytes()
    assert k[2].tobytes() == new[0][0][0].tobytes()


def test_single_control_refuses_clones_changing_nothing():
    c = single()
    t = kv.SessionTable(c, max_sessions=1, max_session_tokens=30)
    s = t.open()
    run_step(c, [0] * 4)
    before = snapshot(c)
    # a table over one sequence has no room for a clone; the control itself refuses too
    with pytest.raises(kv.SessionError, match="max_sessions=1"):
        t.clone(s, upto=2)
    with pytest.raises(kv.CloneRefusedError, match="sequence 0"):
        c.seq_clone(t.seq(s), upto=2)
    assert snapshot(c) == before and t.sessions == (s,) and t.pos(s) == 4


def test_single_control_close_and_reopen_starts_empty():
    c = single()
    t = kv.SessionTable(c, max_sessions=1, max_session_tokens=30)
    s = t.open()
    run_step(c, [0] * 4)
    t.close(s)
    assert c.state(0) == kv.SlotState.FREE
    s2 = t.open()
    assert s2 == 2 and t.pos(s2) == 0 and c.high_water(0) == 0
    assert c.state(0) == kv.SlotState.CLAIMED
    assert c.sequence_kv(0, 0)[0].size == 0
    with pytest.raises(kv.SessionError, match="gap"):
        t.pack([(s2, 1, [1])])


# ---------------------------------------------------------------- session ids
def session_id_calls(control, sid):
    """Every BatchControl verb that takes a sequence id, given the session id `sid` there
    (alone, in a list, a tuple, an object array, or among block owners)."""
    return {
        "seq_rm": lambda: control.seq_rm(sid),
        "seq_clone": lambda: control.seq_clone(sid),
        "rewind": lambda: control.rewind(sid, 0),
        "pos": lambda: control.pos(sid),
        "floor": lambda: control.floor(sid),
        "high_water": lambda: control.high_water(sid),
        "state": lambda: control.state(sid),
        "declare_step": lambda: control.declare_step([0, sid]),
        "declare_step (tuple)": lambda: control.declare_step((sid,)),
        "declare_step (object array)": lambda: control.declare_step(np.array([sid], object)),
        "declare_step blocks": lambda: control.declare_step([0], blocks=[sid]),
        "sequence_kv": lambda: control.sequence_kv(sid, 0),
    }


@pytest.mark.parametrize("make", [batched, single])
def test_session_ids_are_refused_by_every_control_verb(make):
    c = make()
    t = kv.SessionTable(c, max_sessions=c.max_seqs, max_session_tokens=20)
    if c.max_seqs > 1:
        t.close(t.open())        # session 1 closed: session 2 holds sequence 0
    sid = t.open()
    assert isinstance(sid, kv.SessionId) and isinstance(sid, int) and not isinstance(sid, bool)
    seq = t.seq(sid)
    assert type(seq) is int and seq == 0 and int(sid) != seq
    advance(c, [seq] * 2)
    before = full_snapshot(t)
    for verb, call in session_id_calls(c, sid).items():
        with pytest.raises(kv.SessionError) as err:
            call()
        assert f"{sid} is a session id; pass its sequence id table.seq({sid}) = {seq}" in \
            str(err.value), (verb, str(err.value))
        assert_unchanged(before, full_snapshot(t))
    # the table takes its own ids and plain ints alike
    assert t.sessions == (sid,) and sid in t and int(sid) in t
    assert t.seq(int(sid)) == seq and t.pos(sid) == t.pos(int(sid)) == 2
    packed = t.pack([(int(sid), 2, [7])])
    assert packed.seq_ids.tolist() == [seq]
    t.close(sid)
    with pytest.raises(kv.SessionError, match=rf"{sid} is the id of a closed session"):
        c.pos(sid)


def test_session_ids_are_ints_the_table_hands_out_and_accepts():
    c = batched()
    t = kv.SessionTable(c, max_sessions=3, max_session_tokens=20)
    a = t.open()
    advance(c, [t.seq(a)] * 3)
    b = t.clone(a, upto=2)
    assert [type(s) for s in (a, b)] == [kv.SessionId] * 2 and (a, b) == (1, 2)
    assert t.sessions == (1, 2) and {a: "x"}[1] == "x"
    assert t.pos(2) == 2 and t.seq(2) == t.seq(b)
    t.close(2)
    assert t.sessions == (a,)
