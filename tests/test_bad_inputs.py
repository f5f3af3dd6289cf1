"""Every public verb, fed arguments it must refuse, in every step state.

Hypothesis draws a face (`BatchedSequenceCache`, `SequenceCache`,
`SequenceBatchControl`, `SessionTable`), a step state (idle, declared, prepared,
prepared with a layer written), a verb and a bad argument: wrong types, bools,
NaN/inf, ragged, 0-d and 2-D arrays, out-of-range and wrapped integers, session ids
where sequence ids belong, read-only arrays, foreign array types; and a commit of
a step that wrote one layer of two. Each call must raise a `KVCacheError` (a shape
problem is also a `ValueError`) and leave every byte of state as it was
(`tests/snapshot.py`). Valid arguments in a state that forbids the verb are drawn
too: those must be refused just the same.

The faces are built once per (face, state) and reused: a refusal changes nothing,
so every example starts from the same state; a face whose state did change is
dropped after its failure is reported.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvnumba as kv
from snapshot import assert_unchanged, fill, run_step, snapshot

H, HQ, D = 2, 4, 4                 # kv heads, q heads (GQA 2), head_dim
SEQS, CAPACITY, MAX_WRITE, MAX_STEP = 4, 16, 4, 8
WIDTH = 6                          # the open step's padded width
STATES = ("idle", "declared", "prepared", "written")
EXAMPLES = 6 * settings.default.max_examples


def config(max_seqs=SEQS):
    return kv.CacheConfig(layers=[kv.flat(), kv.ring(window=3)], n_kv_heads=H, head_dim=D,
                          capacity=CAPACITY, max_seqs=max_seqs, max_write=MAX_WRITE,
                          max_step=MAX_STEP, dtype="float32", initial_pages=4)


def open_step(control, ids, state, rng):
    """Leave `control` with history and the step in `state`."""
    if state == "idle":
        return
    if state == "declared":
        control.declare_step(ids)
        return
    run_step(control, ids, rng, width=WIDTH, commit=False,
         write_layers=[0] if state == "written" else [])


def build_batched(state):
    rng = np.random.default_rng(1)
    c = kv.BatchedSequenceCache(config())
    s0, s1, _s2 = c.seq_new(), c.seq_new(), c.seq_new()   # s2 stays claimed, 3 free
    for ids in ([s0] * 4 + [s1] * 3, [s0] * 4, [s0]):         # s0: hw 9 > R 6, floor 5
        run_step(c, ids, rng)
    c.rewind(s1, 1)
    open_step(c, [0, 0, 1, 2], state, rng)
    return c


def build_single(state):
    rng = np.random.default_rng(2)
    c = kv.SequenceCache(config(max_seqs=1))
    for n in (4, 4, 1):
        c.declare_step(n)
        plan = c.prepare_step()
        for layer in range(2):
            c.write(layer, fill(rng, (plan.width, H, D)), fill(rng, (plan.width, H, D)))
        c.commit_step()
    if state == "declared":
        c.declare_step(2)
    elif state != "idle":
        c.declare_step(2)
        plan = c.prepare_step(WIDTH)
        if state == "written":
            c.write(0, fill(rng, (plan.width, H, D)), fill(rng, (plan.width, H, D)))
    return c


def build_control(state):
    rng = np.random.default_rng(3)
    c = kv.SequenceBatchControl(kv.SequenceCache(config(max_seqs=1)))
    c.seq_new()
    for ids in ([0] * 4, [0] * 4, [0]):
        run_step(c, ids, rng)
    open_step(c, [0, 0], state, rng)
    return c


def build_table(state):
    rng = np.random.default_rng(4)
    c = kv.BatchedSequenceCache(config())
    t = kv.SessionTable(c, max_sessions=SEQS, max_session_tokens=CAPACITY)
    a, b = t.open(), t.open()
    run_step(c, [t.seq(a)] * 4 + [t.seq(b)] * 2, rng)
    run_step(c, [t.seq(a)] * 4, rng)
    run_step(c, [t.seq(a)], rng)
    open_step(c, [t.seq(a), t.seq(b)], state, rng)
    return t


BUILD = {"batched": build_batched, "single": build_single, "control": build_control,
         "table": build_table}
_BUILT = {}


def face(kind, state):
    key = (kind, state)
    if key not in _BUILT:
        _BUILT[key] = BUILD[kind](state)
    return _BUILT[key]


# ---------------------------------------------------------------- bad values
class Foreign:
    """An array-like that is neither NumPy nor a device array."""

    def __init__(self, shape):
        self.shape = shape
        self.dtype = np.dtype(np.float32)
        self.__array_interface__ = np.zeros(shape, np.float32).__array_interface__


NOT_INT = st.sampled_from([True, False, np.bool_(True), 1.0, np.float64(0.0), 0.5,
                           float("nan"), float("inf"), "0", b"0", None, [0], (0,), {0},
                           np.array(0), np.array([0]), 1j, object()])
#: for arguments where None means "the default" (a width, a clone's upto)
NOT_INT_NOR_NONE = NOT_INT.filter(lambda x: x is not None)
HUGE = st.sampled_from([np.uint64(2**64 - 1), np.int64(-1), 2**63, -2**63 - 1, 2**100,
                        -2**100])


def bad_index(n):
    """Anything that is not an int in [0, n)."""
    return st.one_of(NOT_INT, HUGE, st.integers(max_value=-1), st.integers(min_value=n))


#: session ids (never sequence ids, even when their value is a valid column)
SESSION_IDS = st.builds(kv.SessionId, st.integers(0, SEQS - 1))


def bad_seq(n):
    """Anything that is not a sequence id in [0, n)."""
    return st.one_of(bad_index(n), SESSION_IDS)


BAD_REAL = st.sampled_from([float("nan"), float("inf"), -float("inf"), np.float32("nan"),
                            "1", [1.0], (1.0,), True, np.bool_(False), 1j, np.array([1.0]),
                            object()])
BAD_SOFTCAP = st.one_of(BAD_REAL, st.sampled_from([0, 0.0, -1.0, -np.inf, np.float64(-3)]))


def bad_array(shape, dtype=np.float32):
    """Arrays a data verb must refuse where it expects `shape` of float16/float32."""
    w, h, d = shape
    return st.sampled_from([
        None, 1.0, "x", np.zeros(shape, np.float64), np.zeros(shape, np.int32),
        np.zeros(shape, bool), np.zeros(shape, np.complex64), np.zeros(shape, object),
        np.zeros((w + 1, h, d), dtype), np.zeros((w, h + 1, d), dtype),
        np.zeros((w, h, d + 1), dtype), np.zeros((w, h * d), dtype),
        np.zeros((1,) + shape, dtype), np.zeros((), dtype), np.zeros(shape, dtype).tolist(),
        memoryview(np.zeros(shape, dtype).tobytes()), Foreign(shape),
    ])


def bad_q(width):
    return st.one_of(bad_array((width, HQ, D)),
                     st.sampled_from([np.zeros((width, 0, D), np.float32),
                                      np.zeros((width, 3, D), np.float32)]))


def bad_out(width):
    read_only = np.zeros((width, HQ, D), np.float32)
    read_only.setflags(write=False)
    not_none = bad_array((width, HQ, D)).filter(lambda x: x is not None)  # None: a new out
    return st.one_of(not_none, st.just(read_only))


def bad_seq_ids(n):
    elem = st.one_of(NOT_INT, HUGE, st.integers(max_value=-1), st.integers(min_value=n),
                     SESSION_IDS)
    ok = st.lists(st.integers(0, n - 1), max_size=3)
    with_bad = st.builds(lambda a, x, b: a + [x] + b, ok, elem, ok)
    sids = st.lists(SESSION_IDS, min_size=1, max_size=3)
    return st.one_of(with_bad, sids.map(tuple), sids.map(lambda x: np.array(x, dtype=object)),
                     st.sampled_from([
        [], np.zeros(0, np.int64), 5, "012", None, {0: 1}, {0, 1}, [[0], [0, 1]], [[0]],
        np.zeros((2, 2), np.int64), np.array(0), np.array([0.0]), np.array([True]),
        np.array([0], dtype=object), np.array(["0"]), np.array([2**64 - 1], np.uint64),
        np.array([-1]), np.array([n], np.int32),
    ]))


BAD_BLOCKS = st.sampled_from([1, "0", [None], ["0"], {0}, [2**70], [0.5], [True],
                              [[0]], np.array([0.5]), [SEQS], [-1], [3], object(),
                              [kv.SessionId(0)], np.array([kv.SessionId(0)], dtype=object)])


#: rewind positions outside every face's [floor, pos] (pos 9 at most, floor 5 at least)
BAD_POSITION = st.one_of(NOT_INT, HUGE, st.integers(max_value=4), st.integers(min_value=10))


#: clone prefixes outside [1, pos] (pos 9 at most)
BAD_UPTO = st.one_of(NOT_INT_NOR_NONE, HUGE, st.integers(max_value=0), st.integers(min_value=10))


def bad_width(c, state):
    """Widths `prepare_step` must refuse: while declared, not an int, huge, fewer than the
    step's tokens or more than max_step; in any other state even the default."""
    if state != "declared":
        return st.just(None)
    return st.one_of(NOT_INT_NOR_NONE, HUGE, st.integers(max_value=c.plan.n_tokens - 1),
                     st.integers(min_value=MAX_STEP + 1))


# ---------------------------------------------------------------- the calls
def good_arrays(width):
    rng = np.random.default_rng(5)
    return (fill(rng, (width, HQ, D)), fill(rng, (width, H, D)), fill(rng, (width, H, D)))


def data_call(data, c, state):
    """write / attend / update_and_attend with one bad argument (or none, when refused)."""
    width = WIDTH
    q, k, v = good_arrays(width)
    verb = data.draw(st.sampled_from(["write", "attend", "update_and_attend"]), label="verb")
    names = {"write": ("layer", "k", "v"),
             "attend": ("layer", "q", "out", "scale", "softcap"),
             "update_and_attend": ("layer", "q", "k", "v", "out", "scale", "softcap")}[verb]
    runs = {"write": ("prepared", "written"), "attend": ("written",),
            "update_and_attend": ("prepared", "written")}[verb]
    bad = data.draw(st.sampled_from(names + (() if state in runs else (None,))), label="bad")
    args = dict(layer=0, q=q, k=k, v=v, out=None, scale=None, softcap=None)
    pools = dict(layer=bad_index(2), q=bad_q(width), k=bad_array((width, H, D)),
                 v=bad_array((width, H, D)), out=bad_out(width), scale=BAD_REAL,
                 softcap=BAD_SOFTCAP)
    if bad is not None:
        args[bad] = data.draw(pools[bad], label=bad)
    if verb == "write":
        return lambda: c.write(args["layer"], args["k"], args["v"])
    kw = dict(out=args["out"], scale=args["scale"], softcap=args["softcap"])
    if verb == "attend":
        return lambda: c.attend(args["layer"], args["q"], **kw)
    return lambda: c.update_and_attend(args["layer"], args["q"], args["k"], args["v"], **kw)


def control_call(data, c, state, n_seqs):
    """A BatchControl verb (batched cache or SequenceBatchControl)."""
    verbs = ["pos", "high_water", "state", "floor", "seq_rm", "seq_clone", "clone_upto",
             "rewind", "rewind_position", "declare", "blocks", "prepare", "layer_data",
             "sequence_kv", "sequence_kv_layer", "seq_new", "commit", "data"]
    verb = data.draw(st.sampled_from(verbs), label="verb")
    bad_id = bad_seq(n_seqs)
    if verb == "data":
        return data_call(data, c, state)
    if verb == "commit" and state != "prepared":   # idle, declared, or one layer of two written
        return c.commit_step
    if verb in ("pos", "high_water", "state", "floor", "seq_rm", "seq_clone"):
        seq = data.draw(bad_id, label="seq")
        return lambda: getattr(c, verb)(seq)
    if verb == "clone_upto":
        upto = data.draw(BAD_UPTO, label="upto")
        return lambda: c.seq_clone(0, upto)
    if verb == "rewind":
        seq = data.draw(bad_id, label="seq")
        return lambda: c.rewind(seq, 0)
    if verb == "rewind_position":
        position = data.draw(BAD_POSITION, label="position")
        return lambda: c.rewind(0, position)
    if verb == "declare":
        ids = data.draw(st.one_of(bad_seq_ids(n_seqs), st.just([0])) if state != "idle"
                        else bad_seq_ids(n_seqs), label="seq_ids")
        return lambda: c.declare_step(ids)
    if verb == "blocks":
        blocks = data.draw(BAD_BLOCKS, label="blocks")
        return lambda: c.declare_step([0, 0], blocks=blocks)
    if verb == "prepare":
        width = data.draw(bad_width(c, state), label="width")
        return lambda: c.prepare_step(width)
    if verb == "layer_data":
        layer = data.draw(bad_index(2), label="layer")
        return lambda: c.layer_data(layer)
    if verb == "sequence_kv":
        seq = data.draw(bad_id, label="seq")
        return lambda: c.sequence_kv(seq, 0)
    if verb == "sequence_kv_layer":
        layer = data.draw(bad_index(2), label="layer")
        return lambda: c.sequence_kv(0, layer)
    # seq_new: refused while a step is open, and on a full SequenceBatchControl
    if state == "idle" and n_seqs > 1:
        return lambda: c.seq_rm(n_seqs - 1)   # column 3 is FREE
    return c.seq_new


def single_call(data, c, state):
    verb = data.draw(st.sampled_from(["declare", "block", "rewind", "prepare", "layer_data",
                                      "sequence_kv", "data", "commit", "clear"]), label="verb")
    if verb == "data":
        return data_call(data, c, state)
    if verb == "commit" and state != "prepared":   # idle, declared, or one layer of two written
        return c.commit_step
    if verb == "declare":
        n = data.draw(st.one_of(NOT_INT, st.integers(max_value=0),
                                st.integers(min_value=MAX_WRITE + 1),
                                st.sampled_from([2**59, 2**63 - 1, np.uint64(2**64 - 1)])),
                      label="n_tokens")
        return lambda: c.declare_step(n)
    if verb == "block":
        block = data.draw(st.sampled_from([1, 0, "yes", None, [True], np.array(True)]),
                          label="block")
        return lambda: c.declare_step(2, block=block)
    if verb == "rewind":
        position = data.draw(BAD_POSITION, label="position")
        return lambda: c.rewind(position)
    if verb == "prepare":
        width = data.draw(bad_width(c, state), label="width")
        return lambda: c.prepare_step(width)
    if verb == "layer_data":
        layer = data.draw(bad_index(2), label="layer")
        return lambda: c.layer_data(layer)
    if verb == "sequence_kv":
        layer = data.draw(bad_index(2), label="layer")
        return lambda: c.sequence_kv(layer)
    if state == "idle":  # clear runs between steps only: in idle, refuse a rewind instead
        return lambda: c.rewind(c.pos + 1)
    return c.clear


def bad_pack_inputs(t, state):
    a, b = t.sessions
    valid = [(a, 9, [1]), (b, 2, [2])]
    if state != "idle":
        return st.just(valid)   # pack runs between steps only
    item = st.sampled_from([
        (a, 9), (a, 9, [1], True, 0), {"sid": a}, a, None, "x",
        (True, 0, [1]), (1.0, 0, [1]), ("1", 0, [1]), (99, 0, [1]), (a, True, [1]),
        (a, 9.0, [1]), (a, "9", [1]), (a, 9, []), (a, 9, 5), (a, 9, [[1], [1, 2]]),
        (a, 11, [1]), (a, 2, [1]), (a, -1, [1]), (b, 0, [1] * 5), (a, 9, [1] * 8),
        (b, 15, [1, 2]), (b, 2, [[1, 2]]),
    ])
    lists = st.builds(lambda x, y: [x, y], st.sampled_from(valid), item)
    return st.one_of(lists, st.sampled_from([None, 5, "ab", b"ab", (), [], {a: (9, [1])},
                                             {(a, 9, (1,))}, [valid[0], (a, 9, [2])]]))


def table_call(data, t, state):
    verb = data.draw(st.sampled_from(["pack", "close", "clone", "clone_upto", "pos", "seq"]),
                     label="verb")
    if verb == "pack":
        inputs = data.draw(bad_pack_inputs(t, state), label="inputs")
        return lambda: t.pack(inputs)
    if verb == "close":
        sid = data.draw(st.one_of(NOT_INT.filter(lambda x: not isinstance(x, int)),
                                  st.sampled_from([True, False, [1], (1,)])), label="sid")
        return lambda: t.close(sid)
    bad_sid = st.one_of(NOT_INT, HUGE, st.integers(max_value=0), st.integers(min_value=3))
    if verb == "clone_upto":
        upto = data.draw(BAD_UPTO, label="upto")
        return lambda: t.clone(t.sessions[0], upto)
    sid = data.draw(bad_sid, label="sid")
    return lambda: getattr(t, verb)(sid)


def call_for(data, kind, c, state):
    if kind == "batched":
        return control_call(data, c, state, SEQS)
    if kind == "control":
        return control_call(data, c, state, 1)
    if kind == "single":
        return single_call(data, c, state)
    return table_call(data, c, state)


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("kind", sorted(BUILD))
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_bad_inputs_are_refused_and_change_nothing(kind, state, data):
    c = face(kind, state)
    call = call_for(data, kind, c, state)
    before = snapshot(c)
    try:
        with pytest.raises(kv.KVCacheError) as err:
            call()
        if isinstance(err.value, kv.ShapeError):
            assert isinstance(err.value, ValueError)
        assert str(err.value), "a refusal must say why"
        assert_unchanged(before, snapshot(c))
    except BaseException:
        _BUILT.pop((kind, state), None)   # its state may have changed: rebuild next time
        raise


# ---------------------------------------------------------------- configuration
BAD_FIELDS = st.sampled_from([
    ("layers", None), ("layers", kv.flat()), ("layers", "flat"), ("layers", [None]),
    ("layers", []), ("layers", {kv.flat()}), ("n_kv_heads", 0), ("n_kv_heads", True),
    ("n_kv_heads", 2.0), ("head_dim", 0), ("head_dim", 513), ("head_dim", "64"),
    ("capacity", 0), ("capacity", 2**31), ("capacity", np.uint64(2**64 - 1)),
    ("capacity", float("inf")), ("max_seqs", 0), ("max_seqs", 2**31), ("max_write", 0),
    ("max_write", 17), ("max_step", 3), ("max_step", 2**31), ("initial_pages", 0),
    ("initial_pages", "8"), ("max_pages", 0), ("max_pages", 2**31), ("page_size", 24),
    ("page_size", 4), ("page_size", 2.0), ("dtype", "int8"), ("dtype", "float64"), ("dtype", ["float16"]),
    ("dtype", np.float16), ("dtype", None), ("dtype", {"a": 1}),
])


@settings(max_examples=EXAMPLES)
@given(field=BAD_FIELDS)
def test_bad_config_fields_are_config_errors_naming_the_field(field):
    name, value = field
    base = dict(layers=[kv.flat()], n_kv_heads=1, head_dim=8, capacity=16, max_seqs=2,
                max_write=4, max_step=8)
    base[name] = value
    with pytest.raises(kv.ConfigError) as err:
        kv.CacheConfig(**base)
    assert name in str(err.value)


@pytest.mark.parametrize("window", [0, -3, 2.5, "4", True, np.float64(4), 2**31, [4]])
def test_layer_spec_built_directly_is_checked(window):
    with pytest.raises(kv.ConfigError, match="window"):
        kv.LayerSpec(window=window)
    with pytest.raises(kv.ConfigError, match="window"):
        kv.ring(window=window)


@pytest.mark.parametrize("fields", [
    dict(n_kv_heads=10**6, capacity=2**20, initial_pages=2**16),
    dict(layers=[kv.ring(window=2**30)], capacity=2**31 - 1, page_size=256),
    dict(max_seqs=2**20, head_dim=128, n_kv_heads=8, initial_pages=2**20),
    dict(capacity=2**24, page_size=256, initial_pages=2**16, n_kv_heads=1024),
])
def test_storage_the_machine_cannot_hold_is_a_capacity_error(fields):
    base = dict(layers=[kv.flat()], n_kv_heads=1, head_dim=64, capacity=16, max_seqs=2,
                max_write=4, max_step=8)
    base.update(fields)
    config = kv.CacheConfig(**base)
    with pytest.raises(kv.CapacityError, match="allocation failed"):
        kv.BatchedSequenceCache(config)


@pytest.mark.parametrize("control", [None, 5, "cache", object(), kv.flat()])
def test_session_table_needs_a_batch_control(control):
    with pytest.raises(kv.ConfigError, match="BatchControl"):
        kv.SessionTable(control, max_sessions=1, max_session_tokens=4)


@pytest.mark.parametrize("limits,match", [
    (dict(max_sessions=5, max_session_tokens=8), r"max_sessions=5 .* max_seqs is 4"),
    (dict(max_sessions=2, max_session_tokens=17), r"max_session_tokens=17 .* capacity is 16"),
    (dict(max_sessions=True, max_session_tokens=8), "max_sessions"),
    (dict(max_sessions=2, max_session_tokens=8.0), "max_session_tokens"),
])
def test_session_table_limits_the_control_cannot_hold(limits, match):
    with pytest.raises(kv.ConfigError, match=match):
        kv.SessionTable(kv.BatchedSequenceCache(config()), **limits)


@pytest.mark.parametrize("bad", [None, 1, "config", kv.flat()])
def test_caches_need_a_cache_config(bad):
    for cls in (kv.BatchedSequenceCache, kv.SequenceCache):
        with pytest.raises(kv.ConfigError, match="CacheConfig"):
            cls(bad)
    with pytest.raises(kv.ConfigError, match="SequenceCache"):
        kv.SequenceBatchControl(bad)


# --- inputs the data path once took and answered wrongly ------------------------------
def small_prepared_cache(tokens=2):
    """A float32 cache with history, a step of `tokens` tokens prepared (head_dim 16)."""
    cache = kv.BatchedSequenceCache(kv.CacheConfig(
        layers=[kv.flat()], n_kv_heads=1, head_dim=16, capacity=16, max_seqs=2, max_write=4,
        max_step=4, dtype="float32", initial_pages=8))
    seq = cache.seq_new()
    run_step(cache, [seq] * 3, np.random.default_rng(5))
    cache.declare_step([seq] * tokens)
    cache.prepare_step()
    return cache


@pytest.mark.parametrize("where", ["q", "k", "v", "out"])
def test_a_tensor_on_the_meta_device_is_refused_before_any_launch(where):
    torch = pytest.importorskip("torch")
    cache = small_prepared_cache()
    args = {name: torch.zeros(2, 1, 16) for name in ("q", "k", "v", "out")}
    args[where] = torch.zeros(2, 1, 16, device="meta")
    before = snapshot(cache)
    with pytest.raises(kv.ShapeError, match=rf"{where}: the array is on the meta device, "
                                            r"the cache on cuda:0"):
        cache.update_and_attend(0, args["q"], args["k"], args["v"], out=args["out"])
    assert_unchanged(before, snapshot(cache))


@pytest.mark.parametrize("keyword, value", [
    ("scale", 1e300), ("scale", -1e39), ("scale", 1e-50), ("scale", -2.0 ** -61),
    ("softcap", 1e300), ("softcap", 1e-50), ("softcap", 3.4e38), ("softcap", 2.0 ** 61)])
def test_a_scale_or_softcap_outside_the_kernels_range_is_refused(keyword, value):
    """Once narrowed to float32 (and folded into the kernels' constants) these were inf
    (all-NaN outputs) or 0.0 (a softcap of 1e-50 silently meant none)."""
    cache = small_prepared_cache()
    q = np.ones((2, 1, 16), np.float32)
    before = snapshot(cache)
    with pytest.raises(kv.ConfigError, match=rf"{keyword}=.*\[2\*\*-60, 2\*\*60\]"):
        cache.update_and_attend(0, q, q, q, **{keyword: value})
    assert_unchanged(before, snapshot(cache))


@pytest.mark.parametrize("kw", [{"softcap": 2.0 ** 60}, {"softcap": 2.0 ** -60},
                                {"scale": 2.0 ** -60}, {"scale": -2.0 ** 60}])
def test_a_scale_or_softcap_at_the_range_limits_is_computed_as_defined(kw):
    """The extremes accepted are computed as the float64 reference computes them: the
    largest softcap caps nothing, the smallest makes every score 0 (a plain mean), as
    does the smallest scale; the most negative scale picks each row's lowest score."""
    from kvnumba import reference
    rng = np.random.default_rng(6)
    cache = small_prepared_cache()
    q, k, v = (rng.standard_normal((2, 1, 16)).astype(np.float32) for _ in range(3))
    keys, values = (np.concatenate([history, x]) for history, x in
                    zip(cache.sequence_kv(0, 0)[1:], (k, v)))
    out = cache.update_and_attend(0, q, k, v, **kw)
    want = reference.attention(q, keys, values, [3, 4], **kw)
    np.testing.assert_allclose(out, want, atol=1e-5)


def test_what_a_plan_hands_out_cannot_reach_the_cache():
    """Every array of a StepPlan, and its base, is read-only for good; writing through
    none of them changes the step the cache stages or a later step's logit rows."""
    cache = kv.BatchedSequenceCache(config())
    seqs = [cache.seq_new() for _ in range(3)]
    for ids in (seqs, [seqs[0]] * 2 + [seqs[1]]):        # a decode step, then spans
        plan = cache.declare_step(ids)
        declared = plan.seq_info.copy()
        exposed = [plan.seq_info, plan.logit_indices]
        cache.prepare_step(WIDTH)
        exposed += [plan.seq_cols, plan.positions]
        for array in exposed:
            for reached in (array, array.base):
                with pytest.raises(ValueError):
                    reached.setflags(write=True)
                with pytest.raises(ValueError):
                    reached.reshape(-1)[0] = 99
        staged = cache._steps.upload.device.copy_to_host()[2 * WIDTH:2 * WIDTH + declared.size]
        assert (staged == declared.ravel()).all() and (plan.seq_info == declared).all()
        cache.abort_step()
    later = cache.declare_step(seqs[:2])
    assert later.logit_indices.tolist() == [0, 1]
