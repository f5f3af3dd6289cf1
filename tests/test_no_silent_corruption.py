"""Regressions: the ways a caller could once corrupt the cache without an error.

1. the caller's id buffer was kept (aliased) by `declare_step`;
2. `update_and_attend` wrote before it checked the attend half;
3. the cache trusted the `StepPlan` it handed out;
4. `SessionTable.pack` rewound before the declare that refused the step;
5. `attend` read a layer the step had not written;
6. bools (and floats) passed as ids;
7. non-finite `scale` / `softcap`.
And the messages of refusals that used to say too little.
"""
import numpy as np
import pytest

import kvnumba as kv
from snapshot import assert_unchanged, fill, run_step, snapshot

H, HQ, D = 1, 2, 4


def make(max_seqs=3, **kw):
    base = dict(layers=[kv.flat(), kv.ring(window=3)], n_kv_heads=H, head_dim=D, capacity=16,
                max_seqs=max_seqs, max_write=4, max_step=8, dtype="float32", initial_pages=4)
    base.update(kw)
    return kv.BatchedSequenceCache(kv.CacheConfig(**base))


def test_1_the_cache_copies_the_callers_id_buffer():
    rng = np.random.default_rng(0)
    c = make()
    seqs = [c.seq_new() for _ in range(3)]
    run_step(c, [0, 0, 1], rng)                         # pos 2, 1, 0
    ids = np.array(seqs, dtype=np.int64)           # a serving loop's reused buffer
    plan = c.declare_step(ids)
    ids[:] = 2                                     # the loop refills it for the next step
    c.prepare_step()
    ids[:] = [1, 0, 0]
    k = fill(rng, (3, H, D))
    for layer in range(2):
        c.write(layer, k, k)
    c.commit_step()
    assert plan.seq_cols.tolist() == [0, 1, 2] and plan.positions.tolist() == [2, 1, 0]
    assert [c.pos(s) for s in seqs] == [3, 2, 1]
    for token, seq in enumerate(seqs):             # token t landed in column t, at its position
        positions, got_k, _ = c.sequence_kv(seq, 0)
        assert got_k[-1].tobytes() == k[token].tobytes() and positions[-1] == c.pos(seq) - 1


@pytest.mark.parametrize("bad", [
    dict(q=np.zeros((5, HQ, D), np.float32)), dict(q=[[[0.0] * D] * HQ] * 4),
    dict(q=np.zeros((4, HQ, D), np.float64)), dict(out=np.zeros((4, HQ, D), np.int32)),
    dict(out="out"), dict(scale=float("nan")), dict(scale="0.5"), dict(softcap=float("inf")),
    dict(softcap=0), dict(layer=2), dict(extra=1),
])
def test_2_update_and_attend_checks_both_halves_before_writing(bad):
    rng = np.random.default_rng(1)
    c = make()
    s = c.seq_new()
    for _ in range(3):                             # the ring layer (R = 6) has wrapped
        run_step(c, [s] * 3, rng)
    c.declare_step([s] * 4)
    c.prepare_step()
    args = dict(layer=1, q=fill(rng, (4, HQ, D)), k=fill(rng, (4, H, D)),
                v=fill(rng, (4, H, D)))
    args.update(bad)
    layer, q, k, v = (args.pop(name) for name in ("layer", "q", "k", "v"))
    before = snapshot(c)
    with pytest.raises(kv.KVCacheError):
        c.update_and_attend(layer, q, k, v, **args)
    assert_unchanged(before, snapshot(c))


def test_2_q_heads_that_are_not_a_gqa_group_are_refused_before_writing():
    c = make(n_kv_heads=2)
    c.seq_new()
    c.declare_step([0] * 4)
    c.prepare_step()
    kv_rows = np.ones((4, 2, D), np.float32)
    before = snapshot(c)
    with pytest.raises(kv.ShapeError, match="multiple of layer 0's n_kv_heads=2"):
        c.update_and_attend(0, np.zeros((4, 3, D), np.float32), kv_rows, kv_rows)
    assert_unchanged(before, snapshot(c))


def test_3_the_step_plan_is_read_only_and_never_trusted():
    rng = np.random.default_rng(2)
    c = make()
    a, b = c.seq_new(), c.seq_new()
    run_step(c, [a] * 3 + [b] * 2, rng)
    plan = c.declare_step([a, b])
    c.prepare_step()
    before = snapshot(c)
    with pytest.raises(AttributeError, match="read-only"):
        plan.width = 8
    with pytest.raises(AttributeError, match="read-only"):
        plan.n_tokens = 8
    for array in (plan.seq_cols, plan.positions, plan.seq_info, plan.logit_indices):
        with pytest.raises(ValueError):
            array.setflags(write=True)
        with pytest.raises(ValueError):
            array[0] = 1
    # a wider k/v (what a widened plan would have let through) is refused
    with pytest.raises(kv.ShapeError, match=r"expected shape \(2, 1, 4\)"):
        c.write(0, fill(rng, (8, H, D)), fill(rng, (8, H, D)))
    assert_unchanged(before, snapshot(c))
    assert plan.width == 2 and c.plan.width == 2


def test_4_pack_refuses_what_declare_would_before_any_rewind():
    rng = np.random.default_rng(3)
    c = make(max_step=6)
    t = kv.SessionTable(c, max_sessions=3, max_session_tokens=16)
    a, b = t.open(), t.open()
    for _ in range(3):
        run_step(c, [t.seq(a)] * 3 + [t.seq(b)] * 3, rng)   # both at 9; floor 9 - 4 = 5
    before = snapshot(t)
    cases = [
        ([(a, 6, [1] * 5)], "max_write 4"),                      # rewind to 6, then 5 tokens
        ([(a, 6, [1] * 3), (b, 7, [1] * 4)], "max_step 6"),      # two rewinds, 7 tokens
        ([(a, 7, [1] * 2), (b, 9, [1] * 3), (a, 9, [1] * 3)], "writes 5 tokens"),  # 2 spans
    ]
    for inputs, match in cases:
        with pytest.raises(kv.KVCacheError, match=match):
            t.pack(inputs)
        assert_unchanged(before, snapshot(t))
        assert t.pos(a) == 9 and t.pos(b) == 9
    c.declare_step([t.seq(a)])
    with pytest.raises(kv.StepProtocolError, match="step is open"):
        t.pack([(b, 5, [1])])                     # a rewind is never queued during a step
    assert t.pos(b) == 9


def test_5_attend_refuses_a_layer_the_step_has_not_written():
    rng = np.random.default_rng(4)
    c = make()
    s = c.seq_new()
    run_step(c, [s] * 3, rng)
    c.declare_step([s] * 2)
    c.prepare_step()
    q = fill(rng, (2, HQ, D))
    before = snapshot(c)
    for layer in (0, 1):
        with pytest.raises(kv.StepProtocolError, match=rf"write\({layer}, k, v\) or "
                                                         r"update_and_attend"):
            c.attend(layer, q)
    assert_unchanged(before, snapshot(c))
    c.write(0, fill(rng, (2, H, D)), fill(rng, (2, H, D)))
    assert np.isfinite(c.attend(0, q)).all()
    with pytest.raises(kv.StepProtocolError):
        c.attend(1, q)
    c.write(1, fill(rng, (2, H, D)), fill(rng, (2, H, D)))
    c.commit_step()
    c.declare_step([s])                            # a new step starts with nothing written
    c.prepare_step()
    with pytest.raises(kv.StepProtocolError):
        c.attend(0, q[:1])


def test_6_ids_are_ints_and_nothing_else():
    rng = np.random.default_rng(5)
    c = make()
    t = kv.SessionTable(c, max_sessions=3, max_session_tokens=16)
    first, second = t.open(), t.open()
    run_step(c, [t.seq(first)] * 2, rng)
    before = snapshot(t)
    for call in (lambda: t.pack([(True, 2, [1])]), lambda: t.pos(True), lambda: t.seq(True),
                 lambda: t.close(True), lambda: t.close([1]), lambda: t.clone(np.bool_(True)),
                 lambda: t.pack([(first, True, [1])]), lambda: t.pack([(1.0, 2, [1])])):
        with pytest.raises(kv.SessionError, match="int"):
            call()
    assert True not in t and first in t and t.sessions == (first, second)
    for call in (lambda: c.pos(True), lambda: c.declare_step([True]),
                 lambda: c.declare_step([0, 0], blocks=[True]),
                 lambda: c.declare_step([0, 0], blocks=[0.5]),
                 lambda: c.declare_step(np.array([0.0])), lambda: c.seq_rm(1.0),
                 lambda: c.rewind(0, True), lambda: c.layer_data(True)):
        with pytest.raises(kv.ShapeError):
            call()
    assert_unchanged(before, snapshot(t))


@pytest.mark.parametrize("kw", [dict(scale=float("nan")), dict(scale=float("inf")),
                                dict(scale=-float("inf")), dict(softcap=float("inf")),
                                dict(softcap=float("nan")), dict(scale=np.float32("inf"))])
def test_7_non_finite_scale_and_softcap_are_config_errors(kw):
    rng = np.random.default_rng(6)
    c = make()
    s = c.seq_new()
    run_step(c, [s] * 2, rng)
    c.declare_step([s])
    c.prepare_step()
    before = snapshot(c)
    with pytest.raises(kv.ConfigError, match="finite"):
        c.update_and_attend(0, fill(rng, (1, HQ, D)), fill(rng, (1, H, D)),
                            fill(rng, (1, H, D)), **kw)
    assert_unchanged(before, snapshot(c))


# ---------------------------------------------------------------- messages that help
def test_messages_name_what_was_passed_and_what_fixes_it():
    c = make()
    a = c.seq_new()

    def says(call, cls, *texts):
        with pytest.raises(cls) as err:
            call()
        for text in texts:
            assert text in str(err.value), (text, str(err.value))

    says(lambda: c.layer_data(True), kv.ShapeError, "True (bool)", "[0, 2)")
    says(lambda: c.pos(np.uint64(2**64 - 1)), kv.UnknownSequenceError,
         "18446744073709551615", "[0, 3)")
    says(lambda: c.declare_step(np.array([2**64 - 1], np.uint64)), kv.UnknownSequenceError,
         "18446744073709551615")
    says(lambda: c.seq_rm(2), kv.FreeSequenceError, "FREE", "seq_new()")
    c.declare_step([a])
    says(lambda: c.declare_step([a]), kv.StepProtocolError, "commit_step()", "abort_step()")
    says(c.commit_step, kv.StepProtocolError, "prepare_step()")
    c.prepare_step()
    says(lambda: c.write(0, [[[0.0] * D]], [[[0.0] * D]]), kv.ShapeError,
         "NumPy, PyTorch or device array", "got list")
    says(lambda: c.attend(0, np.zeros((1, 0, D), np.float32)), kv.ShapeError,
         "n_q_heads=0", "positive multiple")
