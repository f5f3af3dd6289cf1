"""`attend(..., sinks=)` (contract §15): each q head's logit joins every softmax of that
head, with no value, on every attention path, against a float64 reference written here
from the oracle's masks: the sink is one more column of the scores whose value row is
zero.

Routing (contract §8, `kvnumba.data.routing`): segments of at most 4 queries take the
decode path, longer ones the prefill path; float16 storage at head_dim 16 runs the fast
decode kernel and the tensor-core prefill kernel, head_dim 12 the generic kernel on
both. A decode segment whose keys span several chunks is split and merged by a combine
(the fast path's or the generic one's); the tests shrink the chunk so that a short
history splits. The sinks are drawn around the scores' own size, one of them far above
every score (the fold must rescale the row's state, not overflow) and one `-inf` (no
sink: that head's rows must equal attention without sinks).
"""
import functools

import numpy as np
import pytest
import torch

import kvnumba as kv
from kvnumba.device import cuda
from kvnumba.errors import ShapeError, StepProtocolError
from kvnumba.kernels import decode
from oracle import visible

H, HQ = 2, 8
WINDOW = 5
PATHS = {"fast kernels": 16, "generic kernel": 12}       # head_dim -> which kernels serve
#: absolute errors against float64: float32 softmax over exact 16-bit inputs, float16
#: outputs; the tensor-core prefill sums probabilities rounded to 16 bits
OUT_TOL = {"decode": 2e-3, "prefill": {16: 6e-3, 12: 2e-3}}
LSE_TOL = {"decode": 1e-4, "prefill": {16: 2e-3, 12: 1e-4}}


def decode_tolerances(head_dim, rows):
    """`(out_tol, lse_tol)` of a decode step: the tensor cores' (prefill's) where its
    `rows` (group times the longest decode segment) take them (`decode.grouped`), else
    decode's."""
    if decode.grouped(rows, head_dim, np.float16):
        return OUT_TOL["prefill"][head_dim], LSE_TOL["prefill"][head_dim]
    return OUT_TOL["decode"], LSE_TOL["decode"]


def head_sinks(seed: int) -> np.ndarray:
    """float32 `[HQ]`: logits about the size of the scores, one far above them (head 1),
    and no sink on head 2 (`-inf`)."""
    sinks = np.random.default_rng(seed).normal(0.0, 1.5, HQ).astype(np.float32)
    sinks[1] = 9.0
    sinks[2] = -np.inf
    return sinks


def want(q, keys, values, pos_start, window, block, scale, sinks, softcap=None):
    """float64 `(out [n, hq, d], lse [n, hq])` of a segment's queries with `sinks`."""
    q, keys, values = (np.asarray(a, np.float64) for a in (q, keys, values))
    n, hq, d = q.shape
    group = hq // keys.shape[1]
    out, lse = np.empty((n, hq, d)), np.empty((n, hq))
    for i in range(n):
        seen = np.array([visible(pos_start + i, j, pos_start, n, window, block)
                         for j in range(len(keys))])
        for h in range(hq):
            s = scale * (keys[seen, h // group] @ q[i, h])
            if softcap:
                s = softcap * np.tanh(s / softcap)
            column = np.append(s, sinks[h])              # the sink: a key of value zero
            best = column.max()
            w = np.exp(column - best)
            lse[i, h] = best + np.log(w.sum())
            out[i, h] = (w[:-1] / w.sum()) @ values[seen, h // group]
    return out, lse


class Run:
    """A cache and each sequence's q, k, v per layer for all its positions."""

    def __init__(self, head_dim, windows, *, capacity=32, max_write=12, max_step=12,
                 lengths=(16, 16)):
        config = kv.CacheConfig(layers=[kv.ring(window=w) if w else kv.flat()
                                        for w in windows], n_kv_heads=H, head_dim=head_dim,
                                capacity=capacity, max_seqs=len(lengths), max_write=max_write,
                                max_step=max_step, dtype="float16", initial_pages=capacity)
        self.cache = kv.BatchedSequenceCache(config)
        self.windows = windows
        self.scale = 1 / np.sqrt(head_dim)
        rng = np.random.default_rng(head_dim)
        self.seqs = [{name: [(2 * rng.standard_normal((n, heads, head_dim))).astype(np.float16)
                             for _ in windows] for name, heads in (("q", HQ), ("k", H), ("v", H))}
                     for n in lengths]
        for _ in lengths:
            self.cache.seq_new()
        self.pos = [0] * len(lengths)

    def rows(self, spans):
        return [(s, self.pos[s] + i) for s, n in spans for i in range(n)]

    def gather(self, rows, field, layer, width):
        first = self.seqs[0][field][layer]
        out = np.zeros((width,) + first.shape[1:], np.float16)
        out[:len(rows)] = [self.seqs[s][field][layer][p] for s, p in rows]
        return out

    def write_only(self, spans):
        rows = self.rows(spans)
        self.cache.declare_step([s for s, n in spans for _ in range(n)])
        self.cache.prepare_step()
        for layer in range(len(self.windows)):
            self.cache.write(layer, self.gather(rows, "k", layer, len(rows)),
                             self.gather(rows, "v", layer, len(rows)))
        self.commit(spans)

    def commit(self, spans):
        self.cache.commit_step()
        for s, n in spans:
            self.pos[s] += n

    def check(self, spans, out, lse, layer, sinks, *, blocks=(), softcap=None, out_tol,
              lse_tol):
        """out and lse rows of each span against the reference; and the sinks matter: the
        same rows without them are farther off than the tolerance."""
        at, moved = 0, 0.0
        for s, n in spans:
            start, seq = self.pos[s], self.seqs[s]
            args = (seq["q"][layer][start:start + n], seq["k"][layer][:start + n],
                    seq["v"][layer][:start + n], start, self.windows[layer], s in blocks,
                    self.scale)
            want_out, want_lse = want(*args, sinks, softcap)
            plain_out, _ = want(*args, np.full(HQ, -np.inf), softcap)
            what = f"seq {s} layer {layer} softcap {softcap}"
            np.testing.assert_allclose(out[at:at + n].astype(np.float64), want_out, rtol=0,
                                       atol=out_tol, err_msg=what)
            np.testing.assert_allclose(lse[at:at + n], want_lse, rtol=0, atol=lse_tol,
                                       err_msg=what)
            moved = max(moved, float(np.abs(plain_out - want_out).max()))
            at += n
        assert moved > 20 * out_tol, f"the sinks moved the outputs by {moved} only"
        assert (out[at:] == 0).all() and (lse[at:] == -np.inf).all(), "padding rows"


@pytest.mark.parametrize("path", sorted(PATHS))
def test_sinks_on_the_prefill_and_decode_paths(path):
    """A padded prefill step (two segments), then a padded decode step holding a decode
    token and a draft block: a flat layer without a softcap and a ring layer with one."""
    head_dim = PATHS[path]
    run = Run(head_dim, (None, WINDOW))
    cache = run.cache
    prefill = [(0, 7), (1, 5)]
    rows = run.rows(prefill)
    cache.declare_step([s for s, n in prefill for _ in range(n)])
    cache.prepare_step(12)
    for layer, softcap in ((0, None), (1, 3.0)):
        sinks = head_sinks(layer)
        lse = np.full((12, HQ), np.nan, np.float32)
        out = cache.update_and_attend(layer, run.gather(rows, "q", layer, 12),
                                      run.gather(rows, "k", layer, 12),
                                      run.gather(rows, "v", layer, 12), softcap=softcap,
                                      lse=lse, sinks=sinks)
        run.check(prefill, out, lse, layer, sinks, softcap=softcap,
                  out_tol=OUT_TOL["prefill"][head_dim], lse_tol=LSE_TOL["prefill"][head_dim])
    run.commit(prefill)

    step = [(0, 1), (1, 3)]                   # a decode token, a draft block
    rows = run.rows(step)
    cache.declare_step([0, 1, 1, 1], blocks=[1])
    cache.prepare_step(5)
    for layer, softcap in ((0, None), (1, 3.0)):
        sinks = head_sinks(10 + layer)
        lse = np.full((5, HQ), np.nan, np.float32)
        out = cache.update_and_attend(layer, run.gather(rows, "q", layer, 5),
                                      run.gather(rows, "k", layer, 5),
                                      run.gather(rows, "v", layer, 5), softcap=softcap,
                                      lse=lse, sinks=sinks)
        out_tol, lse_tol = decode_tolerances(head_dim, HQ // H * 3)
        run.check(step, out, lse, layer, sinks, blocks=[1], softcap=softcap,
                  out_tol=out_tol, lse_tol=lse_tol)
    run.commit(step)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_sinks_of_a_decode_segment_split_into_chunks(path, monkeypatch):
    """A long history split into several chunks (the sink joins where the combine merges
    them, once) beside a short one in a single chunk, in a padded decode step."""
    monkeypatch.setattr(decode, "chunks_into",
                        functools.partial(decode.chunks_into, chunk=decode.KEY_TILE))
    monkeypatch.setattr(decode, "CHUNK_KEYS", decode.KEY_TILE)      # the generic split-K
    run = Run(PATHS[path], (None,), capacity=192, max_write=64, max_step=72,
              lengths=(3 * decode.KEY_TILE, 8))
    for _ in range(2):
        run.write_only([(0, 64)])
    run.write_only([(0, 63), (1, 3)])
    step = [(0, 1), (1, 1)]
    rows = run.rows(step)
    run.cache.declare_step([0, 1])
    run.cache.prepare_step(3)
    routes = run.cache._steps.step.routes
    if routes.decode_chunks:                 # fast: one segment split, one not
        assert routes.decode_chunks[0].n_combine == 1 and routes.decode_chunks[0].n_parts > 1
    else:                                   # generic: split-K over the longest history
        assert routes.decode_generic.max_kv_len > 2 * decode.CHUNK_KEYS
    sinks = head_sinks(3)
    lse = np.full((3, HQ), np.nan, np.float32)
    out = run.cache.update_and_attend(0, run.gather(rows, "q", 0, 3),
                                      run.gather(rows, "k", 0, 3), run.gather(rows, "v", 0, 3),
                                      lse=lse, sinks=sinks)
    run.check(step, out, lse, 0, sinks, out_tol=OUT_TOL["decode"], lse_tol=LSE_TOL["decode"])


def test_sinks_of_every_kind_and_refusals_before_anything_runs():
    """A device array and a torch tensor serve as sinks as a NumPy array does; a wrong
    shape, dtype or kind is refused before the K/V write; no sinks and all `-inf` sinks
    give the same bytes."""
    run = Run(16, (None,))
    cache = run.cache
    run.write_only([(0, 3)])
    rows = run.rows([(0, 1)])
    cache.declare_step([0])
    cache.prepare_step()
    q, k, v = (run.gather(rows, field, 0, 1) for field in ("q", "k", "v"))
    for bad in (np.zeros(HQ + 1, np.float32), np.zeros((1, HQ), np.float32),
                np.zeros(HQ, np.float16), np.zeros(HQ, np.float64), [0.0] * HQ):
        with pytest.raises(ShapeError, match="sinks"):
            cache.update_and_attend(0, q, k, v, sinks=bad)
    with pytest.raises(StepProtocolError):         # nothing was written
        cache.attend(0, q)
    sinks = head_sinks(7)
    host = cache.update_and_attend(0, q, k, v, sinks=sinks)
    device = cache.attend(0, cuda.to_device(q), sinks=cuda.to_device(sinks)).copy_to_host()
    tensor = cache.attend(0, torch.from_numpy(q), sinks=torch.from_numpy(sinks)).numpy()
    assert host.tobytes() == device.tobytes() == tensor.tobytes()
    none = np.full(HQ, -np.inf, np.float32)
    assert cache.attend(0, q, sinks=none).tobytes() == cache.attend(0, q).tobytes()
    assert cache.attend(0, q).tobytes() != host.tobytes()
