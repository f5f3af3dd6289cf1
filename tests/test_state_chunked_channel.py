"""The delta rule's chunked prefill with a gate per key channel (Kimi's KDA,
`kernels.state.chunked_channel`) through the harness of `statelayers`: outputs, states,
bases and marks against the float64 `stateref.delta_rule_ref` over each sequence's whole
history (to `CHUNKED_TOLERANCE`); the logs and marks against the per-token kernel's, bit
for bit, and the replays they give; decays strong enough to overflow a factored
`exp(G_t) exp(-G_s)`; bfloat16 states; which heads and plans the kernel takes."""
import numpy as np
import pytest

from kvnumba.kernels.state import chunked, chunked_channel
from statelayers import COLS, DeltaLayer, chunked_runs_after_replays, \
    matches_the_per_token_kernel, quantize

CHUNKED = dict(heads=1, dk=16, chunk=16, most=24, per_channel=True)


@pytest.fixture
def built(monkeypatch):
    """The shapes the per-channel chunked kernel is built for, in order (a fresh build
    each call, so each layer's use shows)."""
    shapes = []
    monkeypatch.setattr(chunked_channel, "kernel",
                        lambda *shape: shapes.append(shape) or chunked_channel._kernels(*shape))
    return shapes


def test_per_channel_chunked_prefills_match_the_reference(built):
    """Prefills of 21 (a chunk and 5) and 17 tokens (two spans: 9 and 8) on the chunked
    kernel beside one of 3 on the per-token kernel, padding; then a rewind into the
    chunked positions taking 18 new tokens (a replay, then a chunk and 2) beside a
    decode."""
    layer = DeltaLayer(np.random.default_rng(1), dv=16, has_beta=True, l2norm=True,
                       in_name="bfloat16", out_name="bfloat16", **CHUNKED)
    layer.step([(0, 0, 21), (2, 0, 3), (3, 0, 9), (3, 9, 8)], n_pad=2)
    layer.step([(0, 12, 18), (3, 17, 1)], n_pad=1)
    assert built == [(16, 16)] * 2


def test_per_channel_chunked_prefill_over_value_blocks_without_beta(built):
    """Three blocks of 16 value columns (block 0 alone writes the keys', gates' and
    betas' log rows), decay only, q and k as given: a prefill of 17 tokens in two spans
    beside one of 2."""
    layer = DeltaLayer(np.random.default_rng(2), dv=48, has_beta=False, l2norm=False,
                       in_name="float16", out_name="float32", **CHUNKED)
    layer.step([(3, 0, 9), (1, 0, 2), (3, 9, 8)], n_pad=1)
    assert built == [(16, 48)]


def test_per_channel_chunked_prefill_writes_what_the_per_token_kernel_writes(built):
    """A layer whose prefill took the chunked kernel and one that took the per-token
    kernel, the same inputs: the same logs and marks, states near, rewinds and clones bit for
    bit (`matches_the_per_token_kernel`)."""
    chunked_layer, plain = (DeltaLayer(np.random.default_rng(21), dv=16, has_beta=True,
                                       l2norm=True, **{**CHUNKED, "chunk": chunk})
                            for chunk in (16, 0))
    matches_the_per_token_kernel(chunked_layer, plain)
    assert built == [(16, 16)]


def test_per_channel_chunked_runs_after_a_replay_and_a_base_advance(built):
    """Chunked runs whose blocks first replay: the base advancing to a floor below p0,
    from the live state on; to p0 itself; a rewind to the base."""
    layer = DeltaLayer(np.random.default_rng(22), dv=16, has_beta=True, l2norm=True,
                       **{**CHUNKED, "most": 20})
    chunked_runs_after_replays(layer)
    assert len(built) == 5


class StrongDecays(DeltaLayer):
    """A layer whose gates decay half of each head's key channels by `exp(-5)` to
    `exp(-20)` a token and the other half weakly, so a chunk's cumulative decay reaches
    `exp(-300)`: far past float32's range as `exp(G_t) exp(-G_s)`."""

    def inputs(self, width):
        held = super().inputs(width)
        g = -self.rng.uniform(0.01, 0.3, (width, self.heads, self.dk))
        g[..., ::2] = -self.rng.uniform(5.0, 20.0, (width, self.heads, self.dk // 2))
        held["g"] = quantize(g, self.in_name)
        return held


def test_per_channel_chunked_prefill_under_strong_decays(built):
    """Strong and weak channels (`StrongDecays`): every output and state finite and
    within the tolerance of the float64 reference, through a prefill of two chunks and
    a decode."""
    layer = StrongDecays(np.random.default_rng(23), dv=16, has_beta=True, l2norm=True,
                         **CHUNKED)
    got = layer.step([(0, 0, 32), (1, 0, 2)])
    assert np.all(np.isfinite(got)) and np.all(np.isfinite(layer.state.copy_to_host()[0]))
    layer.step([(0, 32, 1)])
    assert built == [(16, 16)]


def test_per_channel_chunked_prefill_over_bfloat16_states(built):
    """States and bases kept as bfloat16 bits: a chunked prefill beside a per-token one,
    decode, a rewind replayed from the rounded base, to bfloat16's tolerance."""
    layer = DeltaLayer(np.random.default_rng(24), dv=16, has_beta=True, l2norm=True,
                       state_name="bfloat16", **CHUNKED)
    assert layer.state.dtype == np.uint16
    layer.step([(0, 0, 18), (1, 0, 3)], n_pad=1)
    floors = np.zeros(COLS, np.int32)
    floors[0] = 18
    layer.step([(0, 18, 2), (1, 3, 1)], floors=floors)
    layer.step([(0, 19, 1), (1, 2, 2)], floors=floors)          # rewinds of both
    assert built == [(16, 16)]


def test_which_heads_and_plans_take_the_per_channel_chunked_kernel():
    """Keys and values multiples of 16, keys at most 128, plans whose chunked runs have at
    least a chunk (16) of new tokens; a d128 block within the static shared memory."""
    assert chunked_channel.fits(128, 128, 32) and chunked_channel.fits(16, 48, 16)
    for dk, dv, chunk in ((24, 16, 32), (16, 8, 32), (144, 16, 32), (16, 16, 8)):
        assert not chunked_channel.fits(dk, dv, chunk), (dk, dv, chunk)
    assert chunked_channel.shared_bytes(128, 128) <= chunked.SHARED_LIMIT
