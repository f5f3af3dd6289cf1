"""`attend(..., lse=)`: each row's natural-log log-sum-exp of its final scores, on every
attention path, against a float64 reference written here from the masks of the oracle.

Routing (contract §8, `kvnumba.data.routing`): segments of at most 4 queries take the decode
path, longer ones the prefill path; float16 storage at head_dim 16 runs the fast decode
kernel and the tensor-core prefill kernel, head_dim 12 the generic kernel on both. A
decode segment whose keys span several chunks is split and merged by the combine; the
tests shrink the chunk (`decode.KEY_TILE` keys) so that a short history splits.
"""
import functools

import numpy as np
import pytest
import torch

import kvnumba as kv
from kvnumba import reference
from kvnumba.device import cuda
from kvnumba.errors import ShapeError, StepProtocolError
from kvnumba.kernels import decode
from oracle import visible

H, HQ = 1, 2
WINDOW = 4
PATHS = {"fast kernels": 16, "generic kernel": 12}       # head_dim -> which kernels serve
#: absolute error of lse: float32 softmax over exact 16-bit inputs; the tensor-core
#: prefill sums probabilities rounded to 16 bits
TOLERANCE = {"decode": 1e-4, "prefill": {16: 2e-3, 12: 1e-4}}


def decode_tolerance(head_dim, rows):
    """The decode step's: the tensor cores' (prefill's) where its `rows` (group times
    the longest decode segment) take them (`decode.grouped`), else decode's."""
    if decode.grouped(rows, head_dim, np.float16):
        return TOLERANCE["prefill"][head_dim]
    return TOLERANCE["decode"]


def want_lse(q, keys, pos_start, window, block, scale, softcap=None):
    """float64 `[n, hq]`: log(sum_j exp(s_j)) over the keys each query row sees."""
    q, keys = np.asarray(q, np.float64), np.asarray(keys, np.float64)
    n, hq, _ = q.shape
    group = hq // keys.shape[1]
    out = np.empty((n, hq))
    for i in range(n):
        seen = np.array([visible(pos_start + i, j, pos_start, n, window, block)
                         for j in range(len(keys))])
        for h in range(hq):
            s = scale * (keys[:, h // group] @ q[i, h])
            if softcap:
                s = softcap * np.tanh(s / softcap)
            s = s[seen]
            out[i, h] = s.max() + np.log(np.exp(s - s.max()).sum())
    return out


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
        self.seqs = [{name: [rng.standard_normal((n, heads, head_dim)).astype(np.float16)
                             for _ in windows] for name, heads in (("q", HQ), ("k", H), ("v", H))}
                     for n in lengths]
        for _ in lengths:
            self.cache.seq_new()
        self.pos = [0] * len(lengths)

    def rows(self, spans):
        """Each token's (sequence, position) for a step of `spans` [(seq, n_tokens)]."""
        return [(s, self.pos[s] + i) for s, n in spans for i in range(n)]

    def gather(self, rows, field, layer, width):
        first = self.seqs[0][field][layer]
        out = np.zeros((width,) + first.shape[1:], np.float16)
        out[:len(rows)] = [self.seqs[s][field][layer][p] for s, p in rows]
        return out

    def write_only(self, spans):
        """Write a step's K/V on every layer and commit, attending nowhere."""
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

    def check(self, spans, got, layer, *, blocks=(), softcap=None, tol):
        """lse rows of each span against the reference; padding rows -inf."""
        at = 0
        for s, n in spans:
            start = self.pos[s]
            seq = self.seqs[s]
            want = want_lse(seq["q"][layer][start:start + n], seq["k"][layer][:start + n],
                            start, self.windows[layer], s in blocks, self.scale, softcap)
            np.testing.assert_allclose(got[at:at + n], want, rtol=0, atol=tol,
                                       err_msg=f"seq {s} layer {layer} softcap {softcap}")
            at += n
        assert (got[at:] == -np.inf).all(), "padding rows must be -inf"


@pytest.mark.parametrize("path", sorted(PATHS))
def test_lse_on_the_prefill_and_decode_paths(path):
    """A padded prefill step (two chunks), then a padded decode step holding a decode
    token and a draft block: on a flat layer without a softcap (where lse leaves out as
    it is without it) and on a ring layer with one."""
    head_dim = PATHS[path]
    run = Run(head_dim, (None, WINDOW))
    cache = run.cache
    prefill = [(0, 6), (1, 5)]
    rows = run.rows(prefill)
    cache.declare_step([s for s, n in prefill for _ in range(n)])
    cache.prepare_step(12)
    for layer, softcap in ((0, None), (1, 2.0)):
        q = run.gather(rows, "q", layer, 12)
        lse = np.full((12, HQ), np.nan, np.float32)
        out = cache.update_and_attend(layer, q, run.gather(rows, "k", layer, 12),
                                      run.gather(rows, "v", layer, 12), softcap=softcap,
                                      lse=lse)
        run.check(prefill, lse, layer, softcap=softcap, tol=TOLERANCE["prefill"][head_dim])
        if layer == 0:
            assert cache.attend(layer, q).tobytes() == out.tobytes()
    run.commit(prefill)

    step = [(0, 1), (1, 3)]                   # a decode token, a draft block
    rows = run.rows(step)
    cache.declare_step([0, 1, 1, 1], blocks=[1])
    cache.prepare_step(5)
    for layer, softcap in ((0, None), (1, 2.0)):
        lse = np.full((5, HQ), np.nan, np.float32)
        cache.update_and_attend(layer, run.gather(rows, "q", layer, 5),
                                run.gather(rows, "k", layer, 5), run.gather(rows, "v", layer, 5),
                                softcap=softcap, lse=lse)
        run.check(step, lse, layer, blocks=[1], softcap=softcap,
                  tol=decode_tolerance(head_dim, HQ // H * 3))
    run.commit(step)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_lse_of_a_decode_segment_split_into_chunks(path, monkeypatch):
    """A long history split into several chunks (merged by the combine) beside a short
    one in a single chunk, in a padded decode step."""
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
    lse = np.full((3, HQ), np.nan, np.float32)
    run.cache.update_and_attend(0, run.gather(rows, "q", 0, 3), run.gather(rows, "k", 0, 3),
                                run.gather(rows, "v", 0, 3), lse=lse)
    run.check(step, lse, 0, tol=TOLERANCE["decode"])


def test_lse_of_every_kind_and_refusals_before_anything_runs():
    """A device array and a torch tensor receive lse as a NumPy array does; a wrong
    shape, dtype, kind or a read-only array is refused before the K/V write."""
    run = Run(16, (None,))
    cache = run.cache
    run.write_only([(0, 3)])
    step = [(0, 1)]
    rows = run.rows(step)
    cache.declare_step([0])
    cache.prepare_step()
    q, k, v = (run.gather(rows, field, 0, 1) for field in ("q", "k", "v"))
    read_only = np.zeros((1, HQ), np.float32)
    read_only.setflags(write=False)
    for bad in (np.zeros((1, HQ + 1), np.float32), np.zeros((2, HQ), np.float32),
                np.zeros((1, HQ), np.float16), np.zeros((1, HQ, 1), np.float32),
                [[0.0] * HQ], read_only):
        with pytest.raises(ShapeError, match="lse"):
            cache.update_and_attend(0, q, k, v, lse=bad)
    with pytest.raises(StepProtocolError):         # nothing was written
        cache.attend(0, q)
    host = np.full((1, HQ), np.nan, np.float32)
    cache.update_and_attend(0, q, k, v, lse=host)
    run.check(step, host, 0, tol=TOLERANCE["decode"])
    device = cuda.device_array((1, HQ), np.float32)
    cache.attend(0, q, lse=device)
    tensor = torch.full((1, HQ), float("nan"))
    cache.attend(0, torch.from_numpy(q), lse=tensor)
    assert device.copy_to_host().tobytes() == host.tobytes() == tensor.numpy().tobytes()
    with pytest.raises(ShapeError, match="lse"):
        cache.attend(0, q, lse=torch.zeros((1, HQ), dtype=torch.float64))


def test_the_reference_log_sum_exp_is_the_masked_scores_own():
    """`kvnumba.reference.log_sum_exp` against the oracle-built one: a draft block on a
    window, with a softcap."""
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((3, 4, 8)), rng.standard_normal((9, 2, 8))
    got = reference.log_sum_exp(q, k, np.arange(6, 9), window=3, blocks=[(6, 9)],
                                scale=0.5, softcap=2.0)
    np.testing.assert_allclose(got, want_lse(q, k, 6, 3, True, 0.5, 2.0), rtol=1e-12)
