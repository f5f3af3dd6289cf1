"""Attention kernels (kvnumba.kernels.generic) against an independent float64 NumPy oracle.

The oracle works from dense per-sequence histories and explicit boolean masks;
storage and the segment table are built by hand here, so nothing of the kernel's
indexing is reused. Each case's storage is built as columns and handed to the kernel
paged (`paging.paged`: shuffled pages, NaN in pages no column references and past a
column's rows), so a slot looked up in the wrong page, or past the rows, shows up as NaN.
"""
import os

os.environ.setdefault("KVNUMBA_DEVICE", "simulator")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from kvnumba.device import cuda  # noqa: E402
from kvnumba.kernels import generic as att  # noqa: E402
from kvnumba.kernels.workspace import AttentionWorkspace  # noqa: E402
from kvnumba.arith.positions import (SEQ, FLAG_BLOCK, FLAGS, POS_START, Q_LEN, Q_START,  # noqa: E402
                                    SEQ_INFO_FIELDS)
from oracle import FP8, fp8_stored, visible_mask  # noqa: E402
from paging import page_bits, paged  # noqa: E402


# ---------------------------------------------------------------- the oracle

def reference(case):
    """float64 attention from the dense histories (padding rows zero)."""
    return reference_lse(case)[0]


def reference_lse(case, sinks=None):
    """float64 `(out [width, n_heads, v_head_dim], lse [width, n_heads])` from the dense
    histories (padding rows zero): out over V of its own width, lse the log-sum-exp of
    each row's scaled (capped) visible scores. `sinks`: None, or `[n_heads]` logits, each
    one more score column of its head with a zero value row (in lse too)."""
    q = case.q.astype(np.float64)
    width, n_heads, _ = q.shape
    group = n_heads // case.n_kv_heads
    out = np.zeros((width, n_heads, case.v_head_dim))
    lse = np.zeros((width, n_heads))
    for seg, (q_start, q_len, pos_start, block) in enumerate(case.segments):
        keys, values = case.hist_k[seg], case.hist_v[seg]      # [kv_len, kvh, d / dv] float64
        kv_len = pos_start + q_len
        for i in range(q_len):
            mask = visible_mask(pos_start + i, kv_len, pos_start, q_len, block, case.window)
            for h in range(n_heads):
                s = case.scale * (keys[:, h // group] @ q[q_start + i, h])
                if case.softcap > 0:
                    s = case.softcap * np.tanh(s / case.softcap)
                s = np.where(mask, s, -np.inf)
                sink = -np.inf if sinks is None else float(sinks[h])
                best = max(s.max(), sink)
                w = np.exp(s - best)
                total = w.sum() + np.exp(sink - best)
                out[q_start + i, h] = (w / total) @ values[:, h // group]
                lse[q_start + i, h] = best + np.log(total)
    return out, lse


# ---------------------------------------------------------------- hand-built inputs

class Case:
    pass


def as_stored(values, dtype):
    """`(storage array, float64 values)` of float `values` in storage `dtype` (a NumPy
    dtype, or an fp8 name of `oracle.FP8`)."""
    if dtype in FP8:
        return fp8_stored(values, dtype)
    held = np.asarray(values).astype(dtype)
    return held, held.astype(np.float64)


def make_case(rng, segments, *, n_kv_heads=2, group=2, head_dim=16, window=0, ring_rows=0,
              dtype=np.float32, q_dtype=None, out_dtype=None, pad=0, softcap=0.0,
              spare_cols=2, qk_scale=1.0, page_size=16, v_head_dim=None):
    """segments: list of (q_len, pos_start, block). Storage [rows, n_cols, kvh, d] by hand
    (V's `v_head_dim` wide, default head_dim), paged at `page_size` when launched
    (`device_storage`)."""
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    c = Case()
    c.v_head_dim = v_head_dim
    c.n_kv_heads, c.window, c.ring_rows, c.softcap = n_kv_heads, window, ring_rows, softcap
    c.page_size = page_size
    c.scale = qk_scale / np.sqrt(head_dim)
    q_dtype = q_dtype or dtype
    out_dtype = out_dtype or q_dtype
    n_seg = len(segments)
    n_cols = n_seg + spare_cols
    cols = rng.permutation(n_cols)[:n_seg]
    kv_lens = [p + n for n, p, _ in segments]
    rows = ring_rows if ring_rows else max(kv_lens) + 3
    # NaN-free garbage everywhere nothing is held (fp8: its bits, `oracle.fp8_stored`)
    k_store, _ = as_stored(rng.uniform(-6, 6, (rows, n_cols, n_kv_heads, head_dim)), dtype)
    v_store, _ = as_stored(rng.uniform(-6, 6, (rows, n_cols, n_kv_heads, v_head_dim)), dtype)
    c.hist_k, c.hist_v, c.segments = [], [], []
    q_start = 0
    info = rng.integers(-1000, 1000, (n_seg + 2, SEQ_INFO_FIELDS)).astype(np.int32)
    for seg, ((q_len, pos_start, block), col) in enumerate(zip(segments, cols)):
        kv_len = pos_start + q_len
        hk, hk64 = as_stored(rng.standard_normal((kv_len, n_kv_heads, head_dim)), dtype)
        hv, hv64 = as_stored(rng.standard_normal((kv_len, n_kv_heads, v_head_dim)), dtype)
        if ring_rows:
            need = min(kv_len, window + q_len - 1) if window else kv_len
            assert need <= ring_rows, "test bug: ring too small for the window"
            held = range(max(0, kv_len - ring_rows), kv_len)
        else:
            held = range(kv_len)
        for p in held:
            row = p % ring_rows if ring_rows else p
            k_store[row, col] = hk[p]
            v_store[row, col] = hv[p]
        c.hist_k.append(hk64)
        c.hist_v.append(hv64)
        c.segments.append((q_start, q_len, pos_start, bool(block)))
        info[seg, Q_START], info[seg, Q_LEN], info[seg, SEQ] = q_start, q_len, col
        info[seg, POS_START] = pos_start
        info[seg, FLAGS] = FLAG_BLOCK if block else 0
        q_start += q_len
    c.n_tokens = q_start
    c.width = q_start + pad
    c.q = rng.standard_normal((c.width, n_kv_heads * group, head_dim)).astype(q_dtype)
    c.q[c.n_tokens:] = np.nan      # padding queries are never read
    c.k_store, c.v_store, c.info = k_store, v_store, info
    c.out_dtype = out_dtype
    c.max_q_len = max(n for n, _, _ in segments)
    c.max_kv_len = max(kv_lens)
    c.page_seed = int(rng.integers(2**31))
    return c


def device_storage(case):
    """`(k slots, v slots, pages)` on the device, and the `attend` keywords naming the pages."""
    (k_slots, v_slots), pages = paged([case.k_store, case.v_store], case.page_size,
                                      seed=case.page_seed)
    arrays = [cuda.to_device(a) for a in (k_slots, v_slots, pages)]
    return arrays, dict(pages=arrays[2], page_bits=page_bits(case.page_size))


def tables_of(case, served=None):
    """The step's flat int32 tables: the segment table (with two garbage rows after it),
    then the indices of the served segments (all by default), and their offsets."""
    served = np.arange(len(case.segments)) if served is None else np.asarray(served)
    tables = np.concatenate([case.info.ravel(), served]).astype(np.int32)
    return tables, dict(seq_info_off=0, segments_off=case.info.size, n_segments=len(served))


def out_shape(case):
    """`[width, n_q_heads, v_head_dim]`: q's rows and heads, V's width."""
    return case.q.shape[:2] + (case.v_head_dim,)


def run(case, workspace=None, served=None, **kw):
    """Launch on the device (out poisoned with NaN first) and return the host result."""
    out = cuda.to_device(np.full(out_shape(case), np.nan, case.out_dtype))
    tables, offsets = tables_of(case, served)
    (k_slots, v_slots, _), paging = device_storage(case)
    att.attend(cuda.to_device(case.q), k_slots, v_slots, cuda.to_device(tables), out,
               **paging, **offsets,
               max_q_len=case.max_q_len, max_kv_len=case.max_kv_len,
               ring_rows=case.ring_rows, mask_code=case.window, scale=case.scale,
               softcap=case.softcap, workspace=workspace or AttentionWorkspace(), **kw)
    cuda.synchronize()
    return out.copy_to_host()


def check(case, got, tol=None):
    assert np.isfinite(got[:case.n_tokens]).all(), "NaN/Inf in out"
    assert np.isnan(got[case.n_tokens:]).all(), "padding rows are not the kernel's to write"
    want = reference(case)[:case.n_tokens]
    got = got[:case.n_tokens]
    if tol is None:
        low = np.float16 in (case.q.dtype, case.k_store.dtype, np.dtype(case.out_dtype))
        tol = 2e-3 if low else 1e-4
    err = np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want)
    assert err < tol, f"relative L2 error {err:.2e} >= {tol:.0e}"


def segs_of(*specs):
    """(q_len, pos_start) or (q_len, pos_start, block) -> segment specs."""
    return [tuple(s) + (False,) * (3 - len(s)) for s in specs]


def plan_path(case, **kw):
    return att.launch_shape(n_segments=len(case.segments), max_q_len=case.max_q_len,
                           max_kv_len=case.max_kv_len, n_q_heads=case.q.shape[1],
                           n_kv_heads=case.n_kv_heads, head_dim=case.q.shape[2],
                           v_head_dim=case.v_head_dim, mask_code=case.window, **kw)


DECODE = segs_of((1, 0), (1, 16), (1, 39))
PREFILL = segs_of((9, 0), (6, 14), (12, 25))
MIXED = segs_of((1, 30), (7, 0), (1, 0), (10, 21))


# ---------------------------------------------------------------- the mask convention

def test_window_convention_pinned():
    """W=3: the query at p=4 sees exactly keys 2, 3, 4 (FlashAttention window_size=(2, 0),
    Hugging Face sliding_window=3), in the oracle's mask and in the kernel's output."""
    expected = {0: {0}, 1: {0, 1}, 2: {0, 1, 2}, 3: {1, 2, 3}, 4: {2, 3, 4}}
    for p, keys in expected.items():
        assert set(np.flatnonzero(visible_mask(p, 5, 0, 5, False, 3))) == keys
    # block segment at pos_start 3, q_len 2, W=2: p=3 sees history 2 and the block {3, 4};
    # p=4 sees only the block (its window would start at 3)
    assert set(np.flatnonzero(visible_mask(3, 5, 3, 2, True, 2))) == {2, 3, 4}
    assert set(np.flatnonzero(visible_mask(4, 5, 3, 2, True, 2))) == {3, 4}

    # K = 0 gives uniform weights over the visible keys; V[j] = one-hot(j) reads them out
    rng = np.random.default_rng(1)
    for segments, window, want in [
        (segs_of((5, 0)), 3, expected),
        (segs_of((1, 4)), 3, {4: {2, 3, 4}}),
        (segs_of((2, 3, True)), 2, {3: {2, 3, 4}, 4: {3, 4}}),
    ]:
        for path in ("decode", "prefill"):
            case = make_case(rng, segments, n_kv_heads=1, group=1, head_dim=8, window=window)
            for h in case.hist_k:
                h[:] = 0.0
            for h in case.hist_v:
                h[:] = np.eye(len(h), 8)[:, None, :]
            case.k_store[:] = 0.0
            case.v_store[:] = 0.0
            (q_start, q_len, pos_start, _), = case.segments
            col = case.info[0, SEQ]
            for p in range(pos_start + q_len):
                case.v_store[p, col, 0] = np.eye(8)[p]
            got = run(case, path=path)
            for p, keys in want.items():
                row = got[q_start + p - pos_start, 0]
                ref = np.zeros(8)
                ref[sorted(keys)] = 1.0 / len(keys)
                np.testing.assert_allclose(row, ref, atol=1e-6, err_msg=f"p={p} {path}")
            check(case, got)


# ---------------------------------------------------------------- fixed scenarios

@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_decode_batch(group):
    rng = np.random.default_rng(group)
    case = make_case(rng, DECODE, n_kv_heads=2 if group <= 2 else 1, group=group)
    assert plan_path(case)["path"] == "decode"
    check(case, run(case))


@pytest.mark.parametrize("window, ring, page_size", [(0, False, 8), (12, False, 256),
                                                     (12, True, 16), (12, True, 256)])
def test_decode_split_k(window, ring, page_size):
    rng = np.random.default_rng(window)
    case = make_case(rng, DECODE, n_kv_heads=1, group=4, window=window,
                     ring_rows=window + 2 if ring else 0, page_size=page_size)
    plan = plan_path(case, kv_chunk=8)
    assert plan["path"] == "decode" and plan["n_splits"] > 1
    check(case, run(case, kv_chunk=8))


def test_prefill_chunks():
    rng = np.random.default_rng(3)
    case = make_case(rng, PREFILL, group=2)
    assert plan_path(case)["path"] == "prefill" and plan_path(case)["n_splits"] == 1
    check(case, run(case))


@pytest.mark.parametrize("path, kv_chunk, page_size", [
    ("decode", None, 16), ("decode", 12, 8), ("prefill", None, 8), ("prefill", 16, 256)])
def test_mixed_batch(path, kv_chunk, page_size):
    """Decode and prefill segments in one step, through either path (row tiles > 1 on decode)."""
    rng = np.random.default_rng(4)
    case = make_case(rng, MIXED, n_kv_heads=1, group=4, pad=2, page_size=page_size)
    check(case, run(case, path=path, kv_chunk=kv_chunk))


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_zero_rows_zeroes_exactly_the_padding(dtype):
    from kvnumba.kernels.padding import zero_rows
    rng = np.random.default_rng(5)
    host = rng.standard_normal((7, 3, 5)).astype(dtype)
    out = cuda.to_device(host)
    zero_rows(out, 4)
    zero_rows(out, 7)           # nothing to zero: no launch
    got = out.copy_to_host()
    assert got[:4].tobytes() == host[:4].tobytes() and not got[4:].any()


def test_q_with_more_rows_than_32_bit_indices_take_is_refused_before_any_launch():
    class Shaped:               # only a shape: the refusal comes before any device work
        def __init__(self, *shape):
            self.shape = shape
    q = Shaped(2**27, 16, 1)    # 2**31 (token, head) rows
    store = Shaped(16, 16, 1)
    with pytest.raises(ValueError, match=r"at most 2147483647 \(token, head\) rows"):
        att.attend(q, store, store, None, q, pages=Shaped(1, 1), page_bits=4, seq_info_off=0,
                   segments_off=0, n_segments=1, max_q_len=1, max_kv_len=1, ring_rows=0,
                   mask_code=0, scale=1.0, softcap=0.0, workspace=None)


@pytest.mark.parametrize("path", ["decode", "prefill"])
@pytest.mark.parametrize("window", [0, 3, 50])
def test_block_segments(path, window):
    """Draft blocks see their whole block whatever the window, plus the history it allows."""
    rng = np.random.default_rng(6 + window)
    segments = segs_of((4, 9, True), (1, 5), (6, 0, True), (3, 20))
    case = make_case(rng, segments, n_kv_heads=1, group=2, window=window)
    check(case, run(case, path=path, kv_chunk=6 if path == "decode" else None))


@pytest.mark.parametrize("window", [1, 5, 100])
def test_windows_flat(window):
    """Windows narrower than, and wider than, the history."""
    rng = np.random.default_rng(7)
    case = make_case(rng, segs_of((1, 33), (6, 20), (8, 0)), n_kv_heads=2, group=1,
                     window=window)
    check(case, run(case))


@pytest.mark.parametrize("path", ["decode", "prefill"])
@pytest.mark.parametrize("page_size", [8, 256])
def test_ring_wrap(path, page_size):
    """Histories several times longer than R: only the last R positions are held. R = 12
    at page size 8 wraps inside the second page, whose last 4 slots hold NaN."""
    rng = np.random.default_rng(8)
    window, max_write = 6, 7
    case = make_case(rng, segs_of((1, 40), (7, 29), (5, 3, True)), n_kv_heads=1, group=2,
                     window=window, ring_rows=window + max_write - 1, page_size=page_size)
    check(case, run(case, path=path, kv_chunk=4 if path == "decode" else None))


@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_softcap(path):
    rng = np.random.default_rng(9)
    case = make_case(rng, segs_of((2, 10), (6, 3)), n_kv_heads=1, group=2, softcap=2.0,
                     qk_scale=4.0)
    uncapped = Case()
    uncapped.__dict__.update(case.__dict__, softcap=0.0)
    assert np.abs(reference(case) - reference(uncapped)).max() > 1e-2   # the cap matters
    check(case, run(case, path=path))


@pytest.mark.parametrize("path", ["decode", "prefill"])
@pytest.mark.parametrize("store, qd, outd", [
    (np.float16, np.float16, np.float16), (np.float16, np.float32, np.float32),
    (np.float32, np.float16, np.float16), (np.float32, np.float32, np.float16),
    ("float8_e4m3", np.float32, np.float32), ("float8_e5m2", np.float16, np.float16)])
def test_dtypes(path, store, qd, outd):
    rng = np.random.default_rng(10)
    case = make_case(rng, segs_of((3, 12), (1, 5)), n_kv_heads=1, group=2, dtype=store,
                     q_dtype=qd, out_dtype=outd, pad=1, window=9)
    check(case, run(case, path=path))


@pytest.mark.parametrize("head_dim", [40, 256])
def test_larger_head_dims(head_dim):
    rng = np.random.default_rng(head_dim)
    case = make_case(rng, segs_of((1, 6), (5, 2)), n_kv_heads=1, group=2, head_dim=head_dim,
                     dtype=np.float16)
    for path in ("decode", "prefill"):
        check(case, run(case, path=path))


def test_workspace_reused_without_allocation(monkeypatch):
    """A warm workspace serves the next call with no device allocation at all."""
    rng = np.random.default_rng(11)
    case = make_case(rng, segs_of((1, 20), (1, 5)), n_kv_heads=1, group=2, pad=1)
    ws = AttentionWorkspace()
    check(case, run(case, workspace=ws, kv_chunk=8))
    part_acc, part_ml = ws.part_acc, ws.part_ml
    tables, offsets = tables_of(case)
    (k_slots, v_slots, _), paging = device_storage(case)
    args = [cuda.to_device(case.q), k_slots, v_slots, cuda.to_device(tables)]
    out = cuda.to_device(np.full(out_shape(case), np.nan, case.out_dtype))

    def refuse(*a, **k):
        raise AssertionError("device allocation in a warm call")
    monkeypatch.setattr(cuda, "device_array", refuse)
    monkeypatch.setattr(cuda, "to_device", refuse)
    for kv_chunk in (8, None):
        att.attend(*args, out, **paging, **offsets, max_q_len=1, max_kv_len=case.max_kv_len,
                   ring_rows=0, mask_code=0, scale=case.scale, softcap=0.0, workspace=ws,
                   kv_chunk=kv_chunk)
        monkeypatch.undo()
        check(case, out.copy_to_host())
        monkeypatch.setattr(cuda, "device_array", refuse)
        monkeypatch.setattr(cuda, "to_device", refuse)
    assert ws.part_acc is part_acc and ws.part_ml is part_ml


@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_only_the_served_segments_rows_are_written(path):
    """Another path serves the other segments: their rows stay exactly as they were."""
    rng = np.random.default_rng(12)
    case = make_case(rng, segs_of((2, 3), (1, 7), (3, 0), (1, 1)), n_kv_heads=1, group=2,
                     pad=1)
    got = run(case, served=[2, 0], path=path)
    want = reference(case)
    for seg, (q_start, q_len, _, _) in enumerate(case.segments):
        rows = slice(q_start, q_start + q_len)
        if seg in (0, 2):
            np.testing.assert_allclose(got[rows], want[rows], rtol=1e-4, atol=1e-5)
        else:
            assert np.isnan(got[rows]).all(), f"segment {seg} is not served"


def test_launch_shape_threshold_and_splits():
    kw = dict(n_q_heads=32, n_kv_heads=8, head_dim=128, mask_code=0)
    long_decode = att.launch_shape(n_segments=8, max_q_len=1, max_kv_len=32768, **kw)
    assert long_decode["path"] == "decode" and long_decode["n_splits"] > 1
    assert long_decode["chunk"] % long_decode["block_keys"] == 0
    assert long_decode["chunk"] >= att.DECODE_MIN_CHUNK
    assert long_decode["block_rows"] == 4            # 4 query heads per kv head
    short = att.launch_shape(n_segments=256, max_q_len=1, max_kv_len=200, **kw)
    assert short["n_splits"] == 1
    at = att.launch_shape(n_segments=1, max_q_len=att.DECODE_MAX_Q_LEN, max_kv_len=99, **kw)
    over = att.launch_shape(n_segments=1, max_q_len=att.DECODE_MAX_Q_LEN + 1, max_kv_len=99, **kw)
    assert at["path"] == "decode" and over["path"] == "prefill" and over["n_splits"] == 1
    windowed = att.launch_shape(n_segments=1, max_q_len=1, max_kv_len=1 << 20,
                               **dict(kw, mask_code=512))
    assert windowed["n_splits"] * windowed["chunk"] >= 512
    assert windowed["chunk"] * (windowed["n_splits"] - 1) < 512
    assert att.head_dim_bucket(257) == att.head_dim_bucket(512) == 512
    with pytest.raises(ValueError, match="at most 576"):
        att.head_dim_bucket(577)


# ---------------------------------------------------------------- property test

@st.composite
def batches(draw):
    n_seg = draw(st.integers(1, 3))
    segments = [(draw(st.integers(1, 9)), draw(st.integers(0, 30)), draw(st.booleans()))
                for _ in range(n_seg)]
    window = draw(st.sampled_from([0, 0, 1, 3, 8, 40]))
    max_q = max(s[0] for s in segments)
    ring_rows = (window + max_q - 1 + draw(st.integers(0, 3))
                 if window and draw(st.booleans()) else 0)
    dtype = draw(st.sampled_from([np.float32, np.float16]))
    return dict(
        segments=segments, window=window, ring_rows=ring_rows, dtype=dtype,
        q_dtype=draw(st.sampled_from([dtype, np.float32])),
        out_dtype=draw(st.sampled_from([np.float32, np.float16])),
        group=draw(st.sampled_from([1, 2, 4, 8])), n_kv_heads=draw(st.sampled_from([1, 2])),
        head_dim=draw(st.sampled_from([8, 16])), softcap=draw(st.sampled_from([0.0, 3.0])),
        pad=draw(st.integers(0, 2)), page_size=draw(st.sampled_from([8, 16, 256])),
        seed=draw(st.integers(0, 2**32 - 1)),
        path=draw(st.sampled_from([None, "decode", "prefill"])),
        kv_chunk=draw(st.sampled_from([None, None, 5, 16])))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_random_segment_tables(spec):
    spec = dict(spec)
    rng = np.random.default_rng(spec.pop("seed"))
    path, kv_chunk = spec.pop("path"), spec.pop("kv_chunk")
    case = make_case(rng, spec.pop("segments"), **spec)
    check(case, run(case, path=path, kv_chunk=kv_chunk))
