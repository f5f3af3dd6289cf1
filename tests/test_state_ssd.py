"""Mamba2's SSD on state layers through the cache (`cache.ssd`, contract §17) against the
float64 oracle `stateref.ssd_ref`, run from position 0 over each sequence's whole
history: packed prefills, padding, two spans of a sequence, rewinds, clones and aborted
steps (replayed from the base and the log), prefix snapshots, groups of B and C, a D
per head, dt_bias, dt_limit clamping, with and without softplus; refused calls
(shapes, a layer's other op) change no state, position or byte.
"""
import numpy as np
import pytest

import kvnumba as kv
from stateref import ssd_ref

H, P, N, G = 4, 4, 8, 2              # heads, head_dim, d_state, groups
DH, DK, DV = 2, 4, 8                 # the delta rule layer's heads and dims
MAX_SEQS, MAX_WRITE, CAPACITY = 3, 4, 40


def config(**kw):
    """Layer 0 an ssd layer, layer 1 a delta rule layer, layer 2 attention."""
    return kv.CacheConfig(layers=[kv.state(recurrent=(H, P, N)),
                                  kv.state(recurrent=(DH, DK, DV)), kv.flat()],
                          n_kv_heads=1, head_dim=8, capacity=CAPACITY, max_seqs=MAX_SEQS,
                          max_write=MAX_WRITE, max_step=16, page_size=8, **kw)


class Model:
    """The contract's sequences: per sequence its ssd inputs by position, and the layer's
    constants (`A`, `D`, `dt_bias`, softplus, `dt_limit`)."""

    def __init__(self, seed=0, D=True, dt_bias=True, softplus=True, limit=(0.0, np.inf)):
        r = self.rng = np.random.default_rng(seed)
        self.seqs = {}
        self.A = -r.uniform(0.5, 2.0, H).astype(np.float32)
        self.D = r.standard_normal(H).astype(np.float32) if D else None
        self.dt_bias = r.uniform(-1.0, 0.5, H).astype(np.float32) if dt_bias else None
        self.softplus, self.limit = softplus, limit

    def inputs(self, n):
        r = self.rng
        return dict(x=r.standard_normal((n, H, P)).astype(np.float32),
                    dt=r.uniform(-3.0, 1.5, (n, H)).astype(np.float32),
                    B=(r.standard_normal((n, G, N)) / np.sqrt(N)).astype(np.float32),
                    C=r.standard_normal((n, G, N)).astype(np.float32))

    def ssd(self, cache, inp):
        return cache.ssd(0, inp["x"], inp["dt"], self.A, inp["B"], inp["C"], D=self.D,
                         dt_bias=self.dt_bias, dt_softplus=self.softplus,
                         dt_limit=self.limit)

    def expected(self, seq, rows):
        hist = self.seqs[seq]
        y, _ = ssd_ref(hist["x"], hist["dt"], self.A, hist["B"], hist["C"], self.D,
                       self.dt_bias, self.softplus, self.limit)
        return y[-rows:]


def delta_inputs(n, rng):
    return (rng.standard_normal((n, DH, DK)).astype(np.float32),
            rng.standard_normal((n, DH, DK)).astype(np.float32),
            rng.standard_normal((n, DH, DV)).astype(np.float32),
            -rng.uniform(0.1, 0.5, (n, DH)).astype(np.float32), None)


def run_step(cache, model, seq_ids, width=None, *, commit=True, tol=1e-5):
    """Declare, prepare, run ssd, the delta rule layer and the flat layer, check the
    ssd outputs, commit."""
    seq_ids = np.asarray(seq_ids)
    n = len(seq_ids)
    cache.declare_step(seq_ids)
    cache.prepare_step(width)
    w = n if width is None else width
    inp = model.inputs(w)
    y = model.ssd(cache, inp)
    cache.delta_rule(1, *delta_inputs(w, model.rng))
    kvs = np.zeros((w, 1, 8), np.float32)
    cache.write(2, kvs, kvs)
    assert y.shape == (w, H, P) and not np.any(y[n:])
    for seq in np.unique(seq_ids):
        mine = np.flatnonzero(seq_ids == seq)
        hist = model.seqs[seq]
        for name, arr in inp.items():
            hist[name] = np.concatenate([hist[name], arr[mine]])
        np.testing.assert_allclose(y[mine], model.expected(seq, len(mine)), rtol=tol,
                                   atol=tol)
    if commit:
        cache.commit_step()
    return y


def new_seq(cache, model):
    seq = cache.seq_new()
    model.seqs[seq] = {name: arr[:0] for name, arr in model.inputs(0).items()}
    return seq


def state_bytes(cache):
    """Every state layer's arrays as bytes, the layers' kept rules, and positions."""
    storage = cache._parts.states.storage
    arrays = [array.copy_to_host().tobytes() for layer in storage.layers if layer is not None
              for array in layer if array is not None]
    seqs = [(cache.pos(s), cache.high_water(s)) for s in range(MAX_SEQS)
            if cache.state(s) != kv.SlotState.FREE]
    return arrays, dict(storage.rules), seqs, cache.nbytes


@pytest.mark.parametrize("D, dt_bias, softplus, limit", [
    (True, True, True, (0.0, np.inf)),
    (False, False, True, (0.1, 1.2)),          # dt clamped from both sides
    (True, False, False, (0.0, 0.5)),          # no softplus: dt itself, clamped
])
def test_packed_prefill_decode_spans_and_padding(D, dt_bias, softplus, limit):
    cache, model = kv.BatchedSequenceCache(config()), Model(1, D, dt_bias, softplus, limit)
    a, b, c = (new_seq(cache, model) for _ in range(3))
    run_step(cache, model, [a] * 3 + [b] * 4 + [c], width=10)       # packed, padded
    run_step(cache, model, [a, b, c])                                # decode
    run_step(cache, model, [b, b, a, b, c, c])                       # two spans of b
    run_step(cache, model, [c, a, b], width=4)


def test_rewind_clone_and_abort_continue_exactly():
    cache, model = kv.BatchedSequenceCache(config()), Model(2)
    a = new_seq(cache, model)
    for _ in range(4):
        run_step(cache, model, [a] * 3)                              # pos 12, hw 12
    cache.rewind(a, 9)                                               # floor 12 - 4 = 8
    model.seqs[a] = {name: arr[:9] for name, arr in model.seqs[a].items()}
    run_step(cache, model, [a] * 2)
    b = cache.seq_clone(a, 10)                                       # below pos: replayed
    model.seqs[b] = {name: arr[:10] for name, arr in model.seqs[a].items()}
    run_step(cache, model, [b, b, a])
    cache.declare_step([a, a])                                       # aborted after running
    cache.prepare_step()
    model.ssd(cache, model.inputs(2))
    cache.abort_step()
    run_step(cache, model, [a, a, b])
    for _ in range(3):                                               # the base moves on
        run_step(cache, model, [a] * 4)
    with pytest.raises(kv.RingFloorError, match="state layer 0"):
        cache.rewind(a, cache.pos(a) - MAX_WRITE - 1)


def test_refused_calls_change_nothing():
    """Shapes checked whole before any launch; a layer that ran ssd refuses the delta
    rule and the other way round: states, logs, marks, kept rules, positions and bytes
    as they were, and the step then takes the layers' own calls."""
    cache, model = kv.BatchedSequenceCache(config()), Model(3)
    a = new_seq(cache, model)
    run_step(cache, model, [a] * 3)
    cache.declare_step([a, a])
    cache.prepare_step()
    before = state_bytes(cache)
    inp = model.inputs(2)
    x, dt, B, C = inp["x"], inp["dt"], inp["B"], inp["C"]
    refusals = [
        (dict(x=x[:, :, :3]), r"x: expected shape \(2, 4, 4\) on layer 0 \(recurrent 4 "
                              r"heads x 4 x 8\), got \(2, 4, 3\)"),
        (dict(dt=dt[:1]), r"dt: expected shape \(2, 4\)"),
        (dict(B=np.zeros((2, 3, N), np.float32), C=np.zeros((2, 3, N), np.float32)),
         r"B: expected shape \(2, 'groups', 8\) with groups dividing the 4 heads"),
        (dict(C=C[:, :1]), r"C: expected shape \(2, 2, 8\)"),
        (dict(A=model.A[:2]), r"A: expected shape \(4,\) \(one a head\)"),
        (dict(D=np.ones(3, np.float32)), r"D: expected shape \(4,\)"),
        (dict(dt_bias=np.ones((4, 1), np.float32)), r"dt_bias: expected shape \(4,\)"),
        (dict(dt_softplus=1), "dt_softplus=1: must be True or False"),
        (dict(dt_limit=(1.0, 0.5)), r"dt_limit=\(1.0, 0.5\) \(tuple\): expected a pair"),
        (dict(dt_limit=(0.0, np.nan)), "dt_limit"),
        (dict(dt_limit=0.5), "dt_limit"),
        (dict(x=x.astype(np.int32)), "x: dtype int32"),
    ]
    for change, message in refusals:
        args = dict(x=x, dt=dt, A=model.A, B=B, C=C, D=model.D, dt_bias=model.dt_bias)
        args.update(change)
        with pytest.raises(kv.ShapeError, match=message):
            cache.ssd(0, args.pop("x"), args.pop("dt"), args.pop("A"), args.pop("B"),
                      args.pop("C"), **args)
        assert state_bytes(cache) == before, change
    with pytest.raises(kv.ShapeError, match=r"layer 0 ran ssd \(Mamba2\) before; a layer "
                                            r"keeps one op"):
        cache.delta_rule(0, x, x, np.zeros((2, H, N), np.float32), dt, None)
    with pytest.raises(kv.ShapeError, match=r"layer 1 ran delta_rule with a per-head gate "
                                            r"without beta .* got ssd"):
        cache.ssd(1, x[:, :DH, :DK], dt[:, :DH], model.A[:DH], B, C)
    with pytest.raises(kv.ShapeError, match="not a state layer"):
        cache.ssd(2, x, dt, model.A, B, C)
    assert state_bytes(cache) == before
    cache.write(2, np.zeros((2, 1, 8), np.float32), np.zeros((2, 1, 8), np.float32))
    with pytest.raises(kv.StepProtocolError,
                       match=r"delta_rule/ssd\(0\), delta_rule/ssd\(1\)"):
        cache.commit_step()
    cache.abort_step()
    run_step(cache, model, [a, a])                                   # as if nothing happened
    cache.declare_step([a])
    cache.prepare_step()
    model.ssd(cache, model.inputs(1))
    with pytest.raises(kv.StepProtocolError, match="already ran ssd"):
        model.ssd(cache, model.inputs(1))
    cache.abort_step()
    with pytest.raises(kv.StepProtocolError, match="ssd: the step is IDLE"):
        model.ssd(cache, model.inputs(1))


def test_bfloat16_inputs_within_tolerance():
    torch = pytest.importorskip("torch")
    cache, model = kv.BatchedSequenceCache(config()), Model(5)
    a, b = new_seq(cache, model), new_seq(cache, model)
    for ids in ([a] * 4 + [b] * 2, [a, b], [b, a]):
        n = len(ids)
        cache.declare_step(ids)
        cache.prepare_step()
        inp = {name: torch.from_numpy(arr).to(torch.bfloat16)
               for name, arr in model.inputs(n).items()}
        y = cache.ssd(0, inp["x"], inp["dt"], torch.from_numpy(model.A), inp["B"], inp["C"],
                      D=torch.from_numpy(model.D), dt_bias=torch.from_numpy(model.dt_bias))
        assert y.dtype == torch.bfloat16 and tuple(y.shape) == (n, H, P)
        cache.delta_rule(1, *delta_inputs(n, model.rng))
        cache.write(2, torch.zeros((n, 1, 8)), torch.zeros((n, 1, 8)))
        cache.commit_step()
        ids = np.asarray(ids)
        for seq in (a, b):
            mine = np.flatnonzero(ids == seq)
            hist = model.seqs[seq]
            for name, arr in inp.items():
                hist[name] = np.concatenate([hist[name], arr[mine].float().numpy()])
            np.testing.assert_allclose(y[mine].float().numpy(),
                                       model.expected(seq, len(mine)), rtol=2e-2, atol=2e-2)


def test_prefix_snapshots_restore_an_ssd_state_exactly():
    """A snapshot rebuilds the ssd state (`[heads, head_dim, d_state]`) from the base and
    the log; the sequence it starts continues as the one that wrote those positions."""
    cache, model = kv.BatchedSequenceCache(config(state_interval=16)), Model(6)
    keys = kv.page_keys(list(range(40)), 8)
    a = new_seq(cache, model)
    for _ in range(4):
        run_step(cache, model, [a] * 4)
    assert cache.prefix_register(a, keys) == 2                     # pos 16, on the grid
    run_step(cache, model, [a] * 3)
    b = cache.seq_from_prefix(keys[:3])
    assert cache.pos(b) == 16
    model.seqs[b] = {name: arr[:16] for name, arr in model.seqs[a].items()}
    run_step(cache, model, [b] * 3 + [a] * 2)
    cache.rewind(b, 17)                                            # replayed from the base
    model.seqs[b] = {name: arr[:17] for name, arr in model.seqs[b].items()}
    run_step(cache, model, [a, b])
