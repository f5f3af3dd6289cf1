"""Bad and edge inputs to every public function that takes a count, a scale, a token
list or a key: each is accepted as the number it names (a NumPy integer, a 0-d array) or
refused with a `KVCacheError` naming the value, and a refusal leaves the cache, its
table and its prefix index as they were."""
import math

import numpy as np
import pytest

import kvnumba as kv
from kvnumba.scales import SCALE_MAX, SCALE_MIN

#: values no count, scale, id or key is
WRONG = [-1, 2**64, 10**400, 8.5, True, None, "8", float("nan"), math.inf, np.array([8]),
         [8], b"\x00" * 32]
BASE = dict(layers=[kv.flat(), kv.ring(window=4)], n_kv_heads=1, head_dim=8, capacity=32,
            max_seqs=2, max_write=8, max_step=8, dtype="float32")
FP8 = dict(BASE, dtype="float8_e4m3")


def typed(call):
    """The `KVCacheError` `call()` raises, or a failure naming what it did instead."""
    try:
        call()
    except kv.KVCacheError as exc:
        return exc
    except Exception as exc:           # noqa: BLE001  (an untyped error is the failure)
        pytest.fail(f"untyped {type(exc).__name__}: {exc}")
    pytest.fail("accepted")


@pytest.mark.parametrize("field,value", [
    (field, value) for field in ("capacity", "max_seqs", "max_write", "max_step", "page_size",
                                 "initial_pages", "max_pages")
    for value in [0] + WRONG
    if not (value is None and field in ("initial_pages", "max_pages"))],   # their defaults
    ids=repr)
def test_a_config_count_that_is_no_count_is_refused_naming_it(field, value):
    exc = typed(lambda: kv.CacheConfig(**{**BASE, field: value}))
    assert isinstance(exc, kv.ConfigError) and field in str(exc)


@pytest.mark.parametrize("field", ["capacity", "max_seqs", "page_size"])
def test_numpy_integers_and_0d_arrays_are_the_counts_they_hold(field):
    value = {"capacity": 32, "max_seqs": 2, "page_size": 16}[field]
    for given in (np.int64(value), np.uint16(value)):
        config = kv.CacheConfig(**{**BASE, field: given})
        assert getattr(config, field) == value and type(getattr(config, field)) is int


@pytest.mark.parametrize("value", [0.0, -2.0, 10**400, -(10**400), 1e-45, float("nan"),
                                   math.inf, True, None, "2", [2.0, 2.0, 2.0],
                                   np.array([[2.0]])], ids=repr)
def test_a_scale_that_is_no_scale_is_refused_naming_it(value):
    exc = typed(lambda: kv.CacheConfig(**FP8, k_scale=value))
    assert isinstance(exc, kv.ConfigError) and "k_scale" in str(exc)


def test_a_0d_array_or_numpy_float_scale_is_its_number():
    for given in (np.array(2.0), np.float64(2.0), np.float32(2.0)):
        assert kv.CacheConfig(**FP8, k_scale=given).k_scale == (2.0, 2.0)


@pytest.mark.parametrize("page_size", [0, -8, 8.0, True, None, "8", np.array([8])], ids=repr)
def test_page_keys_refuses_a_page_size_that_is_no_count(page_size):
    exc = typed(lambda: kv.page_keys([1] * 16, page_size))
    assert isinstance(exc, kv.ConfigError) and "page_size" in str(exc)


def test_page_keys_takes_numpy_counts_and_a_huge_page_size_makes_no_key():
    want = kv.page_keys([1] * 16, 8)
    assert kv.page_keys([1] * 16, np.int32(8)) == want and len(want) == 2
    assert kv.page_keys([1] * 16, np.int64(8), parent=want[0], first=np.int64(1)) == want[1:]
    assert kv.page_keys([1] * 16, 2**70) == []
    for first in (-1, 1.0, True):
        assert isinstance(typed(lambda: kv.page_keys([1] * 16, 8, first=first)),
                          kv.ConfigError)
    for parent in (b"x", "root", None):
        assert isinstance(typed(lambda: kv.page_keys([1] * 16, 8, parent=parent)),
                          kv.ShapeError)


@pytest.mark.parametrize("samples", [1.0, "ab", None, np.array(1.0), [np.array(["a"])],
                                     [[1 + 2j]], [None], [np.array([np.nan])],
                                     [np.array([1e30])]], ids=repr)
def test_fp8_scales_refuses_what_is_no_sample_naming_it(samples):
    exc = typed(lambda: kv.fp8_scales(samples, [np.ones(2)]))
    assert isinstance(exc, kv.ConfigError) and ("k_samples" in str(exc) or "K sample" in
                                                str(exc))


@pytest.mark.parametrize("dtype,largest", [("float8_e4m3", 448.0), ("float8_e5m2", 57344.0)])
@pytest.mark.parametrize("amax", [1e-45, 1e-40, 5e-39, float(np.finfo(np.float32).tiny),
                                  1e-30, 1e-12, 1.0, 1e10])
def test_every_scale_fp8_scales_returns_is_one_the_config_takes(dtype, largest, amax):
    """A tiny amax would give a subnormal (or 0.0) whose reciprocal overflows float32:
    the scale is at least SCALE_MIN; otherwise it is amax over the format's largest."""
    (k,), (v,) = kv.fp8_scales([np.array([amax, -amax / 2])], [np.array([amax])], dtype)
    assert k == v == max(float(np.float32(amax / largest)), SCALE_MIN)
    assert SCALE_MIN <= k <= SCALE_MAX
    config = kv.CacheConfig(**{**BASE, "dtype": dtype, "layers": [kv.flat()]}, k_scale=k,
                            v_scale=v)
    assert config.k_scale == (k,)


def snapshot(cache, table=None):
    """What a refusal must leave as it was."""
    seqs = range(cache.max_seqs)
    return ([(int(cache.state(s)), cache.pos(s), cache.high_water(s)) for s in seqs],
            cache.pool_pages(), tuple(cache.prefix_counts), cache.step_state,
            None if table is None else [(sid, table.pos(sid)) for sid in table.sessions])


KEYS = [np.array(8), "abc", b"x" * 32, [b"x"], [1.5], None, 8]


@pytest.fixture
def cache():
    cache = kv.BatchedSequenceCache(kv.CacheConfig(**BASE))
    seq = cache.seq_new()
    cache.declare_step([seq] * 8)
    cache.prepare_step()
    rng = np.random.default_rng(0)
    for layer in range(2):
        k, v = (rng.standard_normal((8, 1, 8)).astype(np.float32) for _ in "kv")
        cache.write(layer, k, v)
    cache.commit_step()
    cache.prefix_register(seq, kv.page_keys(list(range(8)), 16))
    return cache


@pytest.mark.parametrize("verb", ["prefix_match", "seq_from_prefix", "prefix_forget",
                                  "prefix_register"])
@pytest.mark.parametrize("keys", KEYS, ids=repr)
def test_a_key_list_that_is_no_key_list_is_refused_changing_nothing(cache, verb, keys):
    before = snapshot(cache)
    call = getattr(cache, verb)
    typed(lambda: call(0, keys) if verb == "prefix_register" else call(keys))
    assert snapshot(cache) == before


@pytest.mark.parametrize("verb,value", [
    (verb, value) for verb in ("seq_rm", "pos", "rewind", "seq_clone", "clone_source")
    for value in WRONG if not (value is None and verb == "seq_clone")],  # upto=None: all
    ids=repr)
def test_an_id_or_position_that_is_none_is_refused_changing_nothing(cache, verb, value):
    before = snapshot(cache)
    calls = {"seq_rm": lambda: cache.seq_rm(value), "pos": lambda: cache.pos(value),
             "rewind": lambda: cache.rewind(0, value),
             "seq_clone": lambda: cache.seq_clone(0, value),
             "clone_source": lambda: cache.seq_clone(value, 4)}
    typed(calls[verb])
    assert snapshot(cache) == before


@pytest.mark.parametrize("verb", ["open", "open_extra", "register", "forget", "clone", "pos",
                                  "pack_tokens", "pack_start", "close"])
@pytest.mark.parametrize("value", WRONG + [[1.5], [np.nan], "abc", [2**70], [-1], [True]],
                         ids=repr)
def test_session_verbs_refuse_what_is_no_count_token_list_or_key(verb, value):
    cache = kv.BatchedSequenceCache(kv.CacheConfig(**BASE))
    table = kv.SessionTable(cache, max_sessions=2, max_session_tokens=32)
    sid = table.open()
    table.pack([(sid, 0, [1, 2, 3])])
    cache.abort_step() if cache.step_state != kv.StepState.IDLE else None
    calls = {"open": lambda: table.open(value), "open_extra": lambda: table.open(
                 [1, 2], extra_key=value),
             "register": lambda: table.register(sid, value),
             "forget": lambda: table.forget(value), "clone": lambda: table.clone(sid, value),
             "pos": lambda: table.pos(value), "pack_tokens": lambda: table.pack(
                 [(sid, 0, value)]),
             "pack_start": lambda: table.pack([(sid, value, [1])]),
             "close": lambda: table.close(value)}
    before = snapshot(cache, table)
    try:
        calls[verb]()
    except kv.KVCacheError:
        assert snapshot(cache, table) == before
        return
    except Exception as exc:           # noqa: BLE001
        pytest.fail(f"untyped {type(exc).__name__}: {exc}")
    # accepted: only where the value is a valid one for the verb
    # pack's tokens are the caller's rows (token ids or embeddings), one per token
    rows = verb == "pack_tokens" and np.asarray(value).ndim >= 1
    assert (verb, repr(value)) in ACCEPTED or (verb == "close" and type(value) is int) or \
        rows, (verb, value)


#: the sweep's values some verbs take, by repr: an extra key (bytes or str; None: none), a
#: valid token list, no prefix, and closing a session id that is not open (nothing happens)
ACCEPTED = {("open_extra", repr(b"\x00" * 32)), ("open_extra", "'8'"), ("open_extra", "None"),
            ("open_extra", "'abc'"), ("open", "[8]"), ("open", "None"), ("register", "[8]"),
            ("forget", "[8]"), ("pack_tokens", "[8]"), ("open", "array([8])"),
            ("register", "array([8])"), ("forget", "array([8])"),
            ("pack_tokens", "array([8])")}
