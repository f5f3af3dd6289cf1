"""State layers through the cache (contract §17) against a float64 oracle.

A `Model` keeps, per live sequence, every input it wrote at each position (the conv
inputs and the recurrence's q, k, v, g, beta), as the contract's semantics define a
sequence: rewinds truncate it, clones copy its first `upto` positions. After each step
the cache's outputs for every real token must equal the oracle's (tests/stateref.py,
written from the definitions and run from position 0 over the whole history), padding
rows must be zero, and refused calls must change nothing that a later step could see.
"""
import numpy as np
import pytest

import kvnumba as kv
from stateref import conv_ref, delta_rule_ref

C, K = 6, 4                    # conv channels and width
H, DK, DV = 2, 4, 8            # recurrent heads and dims
MAX_SEQS, MAX_WRITE, CAPACITY = 3, 4, 40


def config(dtype="float32", attention=True, **kw):
    """A state layer, then (with `attention`) a flat layer."""
    layers = [kv.state(conv=(C, K), recurrent=(H, DK, DV))] + ([kv.flat()] if attention else [])
    return kv.CacheConfig(layers=layers, n_kv_heads=1, head_dim=8, capacity=CAPACITY,
                          max_seqs=MAX_SEQS, max_write=MAX_WRITE, max_step=16, dtype=dtype,
                          page_size=8, **kw)


class Model:
    """The contract's sequences: per sequence its inputs by position."""

    def __init__(self, seed=0, per_channel=False, beta=True):
        self.rng = np.random.default_rng(seed)
        self.seqs = {}
        self.weight = self.rng.standard_normal((C, K)).astype(np.float32)
        self.bias = self.rng.standard_normal(C).astype(np.float32)
        self.per_channel, self.beta = per_channel, beta

    def inputs(self, n):
        r = self.rng
        g_shape = (n, H, DK) if self.per_channel else (n, H)
        return dict(x=r.standard_normal((n, C)).astype(np.float32),
                    q=r.standard_normal((n, H, DK)).astype(np.float32),
                    k=r.standard_normal((n, H, DK)).astype(np.float32),
                    v=r.standard_normal((n, H, DV)).astype(np.float32),
                    g=(-r.uniform(0.01, 0.5, g_shape)).astype(np.float32),
                    beta=r.uniform(0.1, 0.9, (n, H)).astype(np.float32))

    def expected(self, seq, rows):
        """Oracle outputs of `seq` at the last `rows` positions of its history."""
        hist = self.seqs[seq]
        y = conv_ref(hist["x"], self.weight, self.bias, silu=True)
        o, _ = delta_rule_ref(hist["q"], hist["k"], hist["v"], hist["g"],
                              hist["beta"] if self.beta else None, DK ** -0.5, True, None)
        return y[-rows:], o[-rows:]


def run_step(cache, model, seq_ids, width=None, *, commit=True, check=True, tol=1e-5):
    """Declare, prepare, run both state ops and the flat layer (if any), check, commit."""
    seq_ids = np.asarray(seq_ids)
    n = len(seq_ids)
    cache.declare_step(seq_ids)
    cache.prepare_step(width)
    w = n if width is None else width
    inp = model.inputs(w)
    y = cache.conv(0, inp["x"], model.weight, model.bias, activation="silu")
    o = cache.delta_rule(0, inp["q"], inp["k"], inp["v"], inp["g"],
                         inp["beta"] if model.beta else None, qk_l2norm=True)
    if cache.config.n_layers > 1:
        kvs = np.zeros((w, 1, 8), np.float32)
        cache.write(1, kvs, kvs)
    assert not np.any(y[n:]) and not np.any(o[n:])
    for seq in np.unique(seq_ids):
        mine = np.flatnonzero(seq_ids == seq)
        hist = model.seqs[seq]
        for name, arr in inp.items():
            hist[name] = np.concatenate([hist[name], arr[mine]])
        if check:
            want_y, want_o = model.expected(seq, len(mine))
            np.testing.assert_allclose(y[mine], want_y, rtol=tol, atol=tol)
            np.testing.assert_allclose(o[mine], want_o, rtol=tol, atol=tol)
    if commit:
        cache.commit_step()
    return y, o


def new_seq(cache, model):
    seq = cache.seq_new()
    model.seqs[seq] = {name: arr[:0] for name, arr in model.inputs(0).items()}
    return seq


def rewind(cache, model, seq, position):
    cache.rewind(seq, position)
    model.seqs[seq] = {name: arr[:position] for name, arr in model.seqs[seq].items()}


@pytest.mark.parametrize("per_channel, beta", [(False, True), (True, True), (False, False)])
def test_packed_prefill_decode_and_spans(per_channel, beta):
    cache, model = kv.BatchedSequenceCache(config()), Model(1, per_channel, beta)
    a, b, c = (new_seq(cache, model) for _ in range(3))
    run_step(cache, model, [a] * 3 + [b] * 4 + [c], width=10)       # packed, padded
    run_step(cache, model, [a, b, c])                                # decode
    run_step(cache, model, [b, b, a, b, c, c])                       # two spans of b
    for _ in range(3):
        run_step(cache, model, [c, a, b], width=4)


def test_rewind_clone_and_abort_continue_exactly():
    cache, model = kv.BatchedSequenceCache(config()), Model(2)
    a = new_seq(cache, model)
    for _ in range(4):
        run_step(cache, model, [a] * 3)                              # pos 12, hw 12
    rewind(cache, model, a, 9)                                       # floor 12 - 4 = 8
    run_step(cache, model, [a] * 2)
    b = cache.seq_clone(a, 10)                                       # below pos: replayed
    model.seqs[b] = {name: arr[:10] for name, arr in model.seqs[a].items()}
    run_step(cache, model, [b, b, a])
    cache.declare_step([a, a])                                       # aborted after running
    cache.prepare_step()
    inp = model.inputs(2)
    cache.conv(0, inp["x"], model.weight, model.bias, activation="silu")
    cache.delta_rule(0, inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], qk_l2norm=True)
    cache.abort_step()
    run_step(cache, model, [a, a, b])


def test_long_sequence_moves_its_base_and_rewinds_to_the_floor():
    cache, model = kv.BatchedSequenceCache(config()), Model(3)
    a = new_seq(cache, model)
    for _ in range(9):                                               # 36 positions, base moves
        run_step(cache, model, [a] * 4)
    floor = 36 - MAX_WRITE
    with pytest.raises(kv.RingFloorError, match="state layer 0"):
        cache.rewind(a, floor - 1)
    assert cache.pos(a) == 36
    rewind(cache, model, a, floor)
    run_step(cache, model, [a] * 2)


def test_refused_ops_change_nothing():
    cache, model = kv.BatchedSequenceCache(config()), Model(4)
    a = new_seq(cache, model)
    run_step(cache, model, [a] * 3)
    cache.declare_step([a, a])
    cache.prepare_step()
    inp = model.inputs(2)
    with pytest.raises(kv.ShapeError, match=r"x: expected shape \(2, 6\)"):
        cache.conv(0, inp["x"][:, :5], model.weight)
    with pytest.raises(kv.ShapeError, match="g: expected shape"):
        cache.delta_rule(0, inp["q"], inp["k"], inp["v"], inp["g"][:, :1], inp["beta"])
    with pytest.raises(kv.ShapeError, match="not a state layer"):
        cache.conv(1, inp["x"], model.weight)
    with pytest.raises(kv.ShapeError, match="is a state layer"):
        cache.write(0, np.zeros((2, 1, 8), np.float32), np.zeros((2, 1, 8), np.float32))
    cache.write(1, np.zeros((2, 1, 8), np.float32), np.zeros((2, 1, 8), np.float32))
    with pytest.raises(kv.StepProtocolError, match=r"conv\(0\), delta_rule/ssd\(0\)"):
        cache.commit_step()
    cache.abort_step()
    run_step(cache, model, [a, a])                                   # as if nothing happened
    cache.declare_step([a])
    cache.prepare_step()
    inp = model.inputs(1)
    cache.conv(0, inp["x"], model.weight)
    with pytest.raises(kv.StepProtocolError, match="already ran conv"):
        cache.conv(0, inp["x"], model.weight)
    cache.abort_step()


def test_bfloat16_window_within_tolerance():
    torch = pytest.importorskip("torch")
    cache, model = kv.BatchedSequenceCache(config("bfloat16")), Model(5)
    a, b = new_seq(cache, model), new_seq(cache, model)
    for ids in ([a] * 4 + [b] * 2, [a, b], [b, a]):
        n = len(ids)
        cache.declare_step(ids)
        cache.prepare_step()
        inp = {name: torch.from_numpy(arr).to(torch.bfloat16)
               for name, arr in model.inputs(n).items()}
        y = cache.conv(0, inp["x"], torch.from_numpy(model.weight), activation="silu")
        o = cache.delta_rule(0, inp["q"], inp["k"], inp["v"], inp["g"].float(),
                             inp["beta"].float(), qk_l2norm=True)
        cache.write(1, torch.zeros((n, 1, 8), dtype=torch.bfloat16),
                    torch.zeros((n, 1, 8), dtype=torch.bfloat16))
        cache.commit_step()
        ids = np.asarray(ids)
        for seq in (a, b):
            mine = np.flatnonzero(ids == seq)
            hist = model.seqs[seq]
            for name, arr in inp.items():
                hist[name] = np.concatenate([hist[name], arr[mine].float().numpy()])
            want_y = conv_ref(hist["x"], model.weight, None, silu=True)[-len(mine):]
            want_o, _ = delta_rule_ref(hist["q"], hist["k"], hist["v"], hist["g"],
                                       hist["beta"], DK ** -0.5, True, None)
            np.testing.assert_allclose(y[mine].float().numpy(), want_y, rtol=2e-2, atol=2e-2)
            np.testing.assert_allclose(o[mine].float().numpy(), want_o[-len(mine):],
                                       rtol=2e-2, atol=2e-2)


def test_bfloat16_states_halve_their_bytes_and_stay_within_tolerance():
    """`state_dtype="bfloat16"`: the live and base states and the snapshots in half the
    bytes (the log float32); prefills, decode, a rewind, a clone and a prefix snapshot's
    restore within bfloat16's tolerance of the float32 oracle."""
    full, half = config(), config(state_dtype="bfloat16", state_interval=8)
    assert full.bytes_per_sequence - half.bytes_per_sequence == 2 * H * DK * DV * 2
    assert full.snapshot_bytes - half.snapshot_bytes == H * DK * DV * 2
    cache, model, tol = kv.BatchedSequenceCache(half), Model(9), 2e-2
    assert (kv.BatchedSequenceCache(full).nbytes_state - cache.nbytes_state
            == (MAX_SEQS + 1) * 2 * H * DK * DV * 2)
    a, b = new_seq(cache, model), new_seq(cache, model)
    for ids in ([a] * 4 + [b] * 3, [a, b], [a] * 3 + [b], [a, a, b]):
        run_step(cache, model, ids, tol=tol)                     # a at 10, b at 5
    rewind(cache, model, a, 8)                                   # replayed from the base
    run_step(cache, model, [a, b], tol=tol)
    c = cache.seq_clone(a, 9)
    model.seqs[c] = {name: arr[:9] for name, arr in model.seqs[a].items()}
    run_step(cache, model, [c, c, a], tol=tol)
    cache.seq_rm(c)
    keys = kv.page_keys(list(range(16)), 8)
    assert cache.prefix_register(a, keys) == 1                   # a at 10: page 0 snapped
    d = cache.seq_from_prefix(keys)
    model.seqs[d] = {name: arr[:8] for name, arr in model.seqs[a].items()}
    run_step(cache, model, [d] * 3 + [b], tol=tol)


def test_bytes_per_sequence_counts_every_part():
    cfg = config()
    conv_rows = min(CAPACITY, K + MAX_WRITE - 1)
    log_rows = min(CAPACITY, 3 * MAX_WRITE)
    want = conv_rows * C * 4 + 2 * H * DK * DV * 4 + log_rows * H * (2 * DK + DV + 1) * 4
    assert cfg.bytes_per_sequence == want
    assert cfg.bytes_per_token == 2 * 8 * 4                          # the flat layer alone
    cache = kv.BatchedSequenceCache(cfg)
    assert cache.nbytes_state == (MAX_SEQS + 1) * want + (MAX_SEQS + 1) * 2 * 4


def test_state_spec_refusals():
    with pytest.raises(kv.ConfigError, match="conv=None, recurrent=None"):
        kv.state()
    with pytest.raises(kv.ConfigError, match="recurrent must be None or"):
        kv.state(recurrent=(2, 512, 8))
    with pytest.raises(kv.ConfigError, match="state_dtype"):
        kv.CacheConfig(layers=[kv.state(conv=(4, 4)), kv.flat()], state_dtype="float16")


def test_prefix_snapshots_restore_the_states_exactly():
    """A registration snapshots its last page (and the `state_interval` grid); a match
    ends at the deepest snapshot, and the sequence it starts continues exactly as the
    one that wrote those positions, its floor at the match point."""
    cache, model = kv.BatchedSequenceCache(config(state_interval=16)), Model(6)
    keys = kv.page_keys(list(range(40)), 8)
    a = new_seq(cache, model)
    for _ in range(2):
        run_step(cache, model, [a] * 4)
    assert cache.prefix_register(a, keys) == 1                     # pos 8: page 0 snapped
    assert cache.prefix_match(keys) == 1
    run_step(cache, model, [a] * 4)
    assert cache.prefix_register(a, keys) == 1                     # pos 12: nothing new
    run_step(cache, model, [a] * 4)
    assert cache.prefix_register(a, keys) == 2                     # pos 16, on the grid
    assert cache.prefix_match(keys[:1]) == 0                       # page 0's snapshot let go
    assert cache.prefix_counts.nbytes_cached >= cache.config.snapshot_bytes
    b = cache.seq_from_prefix(keys[:3])
    assert cache.pos(b) == 16
    model.seqs[b] = {name: arr[:16] for name, arr in model.seqs[a].items()}
    run_step(cache, model, [b] * 3 + [a] * 2)
    with pytest.raises(kv.RingFloorError):
        cache.rewind(b, 15)
    rewind(cache, model, b, 17)                                    # replayed from the base
    run_step(cache, model, [a, b])
    cache.prefix_clear()
    assert cache.prefix_match(keys) == 0 and cache.prefix_counts.nbytes_cached == 0


def test_snapshot_interval_default_covers_its_bytes_in_pages():
    cfg = config()
    per_page = cfg.page_size * cfg.bytes_per_token
    assert cfg.snapshot_bytes == H * DK * DV * 4 + (K - 1) * C * 4
    assert cfg.snapshot_interval == cfg.page_size * -(-cfg.snapshot_bytes // per_page)
    with pytest.raises(kv.ConfigError, match="multiple of page_size"):
        config(state_interval=12)


def test_a_layer_keeps_one_gate_and_rule_and_a_refused_call_changes_nothing():
    """A delta rule with another gate kind or rule than the layer's earlier steps is
    refused before anything runs: the step still takes the layer's own call, and the
    sequence continues as the oracle says."""
    cache, model = kv.BatchedSequenceCache(config()), Model(7)
    a = new_seq(cache, model)
    run_step(cache, model, [a] * 3)
    cache.declare_step([a, a])
    cache.prepare_step()
    inp = model.inputs(2)
    with pytest.raises(kv.ShapeError, match="keeps one op, one gate and one rule"):
        cache.delta_rule(0, inp["q"], inp["k"], inp["v"], inp["g"], None, qk_l2norm=True)
    per_channel = np.repeat(inp["g"][:, :, None], DK, axis=2)
    with pytest.raises(kv.ShapeError, match="keeps one op, one gate and one rule"):
        cache.delta_rule(0, inp["q"], inp["k"], inp["v"], per_channel, inp["beta"],
                         qk_l2norm=True)
    cache.abort_step()
    assert cache.pos(a) == 3
    run_step(cache, model, [a, a])


@pytest.mark.parametrize("per_channel", [False, True])
def test_a_prefill_of_a_chunk_or_more_takes_the_chunked_kernel(monkeypatch, per_channel):
    """Heads of 16 x 16, a gate a head (or a key channel's: Kimi's KDA): a prefill of 37
    tokens packed with one of 3 (the first on the chunked kernel of its gate, its
    products on the tensor cores, the second token by token) within 2e-3 of the oracle
    (relative to its largest output); a refused call changes nothing; decode, a rewind
    into the prefill and a clone of it continue as the oracle says."""
    from kvnumba.kernels.state import chunked_channel, delta_rule
    from kvnumba.kernels.state.chunked import CHUNK
    module, name, make = ((chunked_channel, "kernel", chunked_channel._kernels) if per_channel
                          else (delta_rule, "chunked_kernel", delta_rule._chunked_kernels))
    built = []
    monkeypatch.setattr(module, name, lambda *shape: built.append(shape) or make(*shape))
    h, d = 1, 16
    gate = (h, d) if per_channel else (h,)
    cache = kv.BatchedSequenceCache(kv.CacheConfig(
        layers=[kv.state(recurrent=(h, d, d)), kv.flat()], n_kv_heads=1, head_dim=8,
        capacity=96,
        max_seqs=3, max_write=40, max_step=48, page_size=8))
    rng, history = np.random.default_rng(8), {}

    def step(seqs, width=None, refuse=False):
        seqs = np.asarray(seqs)
        cache.declare_step(seqs)
        cache.prepare_step(width)
        w = len(seqs) if width is None else width
        inp = dict(q=rng.standard_normal((w, h, d)), k=rng.standard_normal((w, h, d)),
                   v=rng.standard_normal((w, h, d)), g=-rng.uniform(0.01, 0.5, (w, *gate)),
                   beta=rng.uniform(0.1, 0.9, (w, h)))
        inp = {name: a.astype(np.float32) for name, a in inp.items()}
        if refuse:
            with pytest.raises(kv.ShapeError, match="v: expected shape"):
                cache.delta_rule(0, inp["q"], inp["k"], inp["v"][:, :, :8], inp["g"],
                                 inp["beta"], qk_l2norm=True)
        o = cache.delta_rule(0, inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                             qk_l2norm=True)
        cache.write(1, np.zeros((w, 1, 8), np.float32), np.zeros((w, 1, 8), np.float32))
        cache.commit_step()
        assert not np.any(o[len(seqs):])
        for seq in np.unique(seqs):
            mine = np.flatnonzero(seqs == seq)
            for name, a in inp.items():
                history[seq][name] = np.concatenate([history[seq][name], a[mine]])
            want = delta_rule_ref(*(history[seq][n] for n in ("q", "k", "v", "g", "beta")),
                                  d ** -0.5, True)[0][-len(mine):]
            bound = 2e-3 * max(1.0, float(np.abs(want).max()))
            assert np.abs(o[mine] - want).max() <= bound, seq

    a, b = cache.seq_new(), cache.seq_new()
    for seq in (a, b):
        history[seq] = {n: np.zeros((0, h, d) if n in "qkv" else (0, *gate) if n == "g"
                                    else (0, h), np.float32)
                        for n in ("q", "k", "v", "g", "beta")}
    step([a] * 37 + [b] * 3, width=42, refuse=True)
    assert built == [(d, d) if per_channel else (d, d, CHUNK)]
    step([a, b])
    cache.rewind(a, 30)
    history[a] = {n: x[:30] for n, x in history[a].items()}
    c = cache.seq_clone(a, 30)
    history[c] = {n: x[:30] for n, x in history[a].items()}
    step([a, c, c, b])


def test_a_cache_of_state_layers_alone():
    """No layer stores K/V (a pure Mamba-2): no page pool, `bytes_per_token` 0, snapshots
    only where registrations end (no K/V to weigh them against); packed steps, a prefix
    hit, a fork and a rewind continue as the oracle says; `fixed_pool` is refused, and
    the index holds at most as many nodes as a flat pool would have pages (`max_nodes`),
    the least recently used dropped first."""
    cfg = config(attention=False)
    assert cfg.page_groups == () and cfg.bytes_per_token == 0
    assert cfg.bytes_per_sequence == config().bytes_per_sequence
    assert cfg.snapshot_interval == CAPACITY                         # 5 pages of 8
    with pytest.raises(kv.ConfigError, match=r"fixed_pool\(4096\): every layer is a "
                                             r"state layer.*no page pool"):
        cfg.fixed_pool(4096)
    cache, model = kv.BatchedSequenceCache(cfg), Model(8)
    a, b = new_seq(cache, model), new_seq(cache, model)
    run_step(cache, model, [a] * 3 + [b] * 3 + [a], width=10)
    run_step(cache, model, [b, a] * 4)                               # a at 8, b at 7
    keys = kv.page_keys(list(range(40)), 8)
    assert cache.prefix_register(a, keys) == 1 and cache.prefix_register(b, keys) == 0
    for _ in range(2):
        run_step(cache, model, [a] * 4)
    assert cache.prefix_register(a, keys) == 2                       # its new last page
    assert cache.prefix_match(keys[:1]) == 0                         # off the grid: let go
    cache.seq_rm(b)
    c = cache.seq_from_prefix(keys)
    assert cache.pos(c) == 16
    model.seqs[c] = {name: arr[:16] for name, arr in model.seqs[a].items()}
    d = cache.seq_clone(c)
    model.seqs[d] = {name: arr.copy() for name, arr in model.seqs[c].items()}
    run_step(cache, model, [c, c, d, a])
    rewind(cache, model, a, 15)
    run_step(cache, model, [a, d, c])
    index = cache._pool.index
    assert index.max_nodes == MAX_SEQS * 5 and len(index) == 2
    for first in range(7):                                           # 14 more pages offered
        other = kv.page_keys([100 + first] + list(range(39)), 8)
        cache.prefix_register(a, other)
        assert len(index) <= index.max_nodes
    assert cache.prefix_match(keys) == 0                             # the oldest dropped
    assert cache.prefix_match(kv.page_keys([106] + list(range(39)), 8)) == 2
