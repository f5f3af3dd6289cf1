"""The state layers' kernels (`kernels.state.conv`, `kernels.state.delta_rule`,
`kernels.state.ssd`) and their work plan (`arith.state_runs`) called directly, step
after step, through the harness of `statelayers` (`ConvLayer`, `DeltaLayer`,
`SsdLayer`): each step's outputs, and the recurrences' states, bases and marks, against
the float64 references of `stateref` run over each sequence's whole history.
Prefills, decodes, two spans of a sequence in a step, padding, rewinds (replays from
the log), base advances, column copies, random schedules of all of these; float16,
bfloat16 and float32 inputs and outputs, strided inputs; the ssd with groups, D,
dt_bias, softplus or not and dt clamped.

The kernels also compile for a GPU and launch through the lean path: one test runs this
file's compile-mode test in `KVNUMBA_DEVICE=compile` mode (test_launch.py's way).
"""
import os
import subprocess
import sys

import numpy as np
import pytest

import kvnumba.device as kv_device
from kvnumba.arith.positions import SEQ_INFO_FIELDS
from kvnumba.arith.state_runs import state_runs
from kvnumba.device import cuda
from kvnumba.kernels.state import chunked, conv, delta_rule, recurrence, ssd
from statelayers import COLS, ConvLayer, DeltaLayer, SsdLayer, chunked_runs_after_replays, \
    chunked_steps, matches_the_per_token_kernel, share_a_steps_plan, step_tables


# ---------------------------------------------------------------- convolution

@pytest.mark.parametrize("store,x_name,out_name,has_bias,silu", [
    ("float32", "float32", "float32", True, True),
    ("float16", "float32", "float16", False, True),
    ("bfloat16", "bfloat16", "bfloat16", True, False),
    ("float32", "float16", "bfloat16", False, False),
])
def test_conv_over_prefill_decode_spans_and_rewinds(store, x_name, out_name, has_bias, silu):
    rng = np.random.default_rng(len(store) + len(x_name) * 3 + has_bias)
    taps, most = 4, 7                          # a sequence writes at most 7 tokens a step
    layer = ConvLayer(rng, taps - 1 + most, 12, taps, store, has_bias, silu)
    steps = [
        ([(0, 0, 5), (2, 0, 1), (3, 0, 7)], 2),          # prefills of different lengths
        ([(0, 5, 1), (3, 7, 1), (2, 1, 3), (0, 6, 2)], 3),  # decode, two spans of 0
        ([(3, 8, 1), (2, 4, 1), (0, 8, 1)], 0),          # decode
        ([(0, 6, 4), (3, 9, 2)], 1),                     # 0 rewinds to 6
        ([(3, 11, 2), (3, 13, 3), (1, 0, 2)], 4),        # two spans, a new sequence
    ]
    for spans, n_pad in steps:
        layer.step(spans, n_pad, x_name, out_name)


def test_conv_layers_of_a_step_share_its_prepared_launches():
    """Two layers of different channel counts, dtypes and activations call one step's
    `ConvStep` each step."""
    rng, steps = np.random.default_rng(8), {}
    layers = [ConvLayer(rng, 10, 12, 4, "float32", True, True, steps),
              ConvLayer(rng, 10, 40, 3, "bfloat16", False, False, steps)]
    for spans, n_pad in (([(0, 0, 5), (2, 0, 2)], 1), ([(2, 2, 1), (0, 5, 1)], 0),
                         ([(0, 4, 3), (2, 3, 1)], 2)):
        for layer in layers:
            layer.step(spans, n_pad, "float32", layer.store)
    assert len(steps) == 3


def test_conv_taps_wider_than_the_history_read_zero():
    """K = 6 taps, R = 8 rows, the inputs a strided view."""
    rng = np.random.default_rng(7)
    layer = ConvLayer(rng, 8, 5, 6, "float32", True, True)
    layer.step([(1, 0, 1), (4, 0, 3)], 1, "float32", "float32", strided_x=True)
    layer.step([(1, 1, 2), (4, 3, 1)], 0, "float32", "float32", strided_x=True)


# ---------------------------------------------------------------- delta rule

FAST = dict(heads=2, dk=8, dv=16)


@pytest.mark.parametrize("has_beta,per_channel,l2norm,in_name,out_name", [
    (True, False, True, "float32", "float32"),
    (True, True, False, "float32", "float32"),
    (False, False, False, "float16", "float32"),
    (True, True, True, "bfloat16", "bfloat16"),
    (True, False, True, "float16", "float16"),
    (True, True, True, "float32", "strided"),     # inputs as strided views
])
def test_delta_rule_over_prefill_decode_and_spans(has_beta, per_channel, l2norm, in_name,
                                                  out_name):
    rng = np.random.default_rng(has_beta + 2 * per_channel + 4 * l2norm + len(in_name))
    strided_inputs = out_name == "strided"
    out_name = "float32" if strided_inputs else out_name
    layer = DeltaLayer(rng, most=6, has_beta=has_beta, per_channel=per_channel,
                       l2norm=l2norm, in_name=in_name, out_name=out_name,
                       strided=strided_inputs, **FAST)
    layer.step([(0, 0, 5), (2, 0, 1), (3, 0, 6)], n_pad=2)       # prefills
    layer.step([(0, 5, 1), (3, 6, 1), (2, 1, 3), (0, 6, 2)], n_pad=1)  # decode, 2 spans
    layer.step([(3, 7, 1), (2, 4, 1), (0, 8, 1)])                # decode


def test_delta_rule_rewind_replays_the_log_bit_for_bit():
    """Positions 0..9, then a step from 7: the state and outputs equal those of a layer
    that only ever had tokens 0..6 and then the new ones, bit for bit."""
    layer = DeltaLayer(np.random.default_rng(3), most=10, has_beta=True, per_channel=True,
                       l2norm=True, **FAST)
    layer.step([(1, 0, 4)])
    layer.step([(1, 4, 6)])                              # live 10, base 0
    got = layer.step([(1, 7, 3), (4, 0, 2)], n_pad=1)    # rewinds to 7: replays 0..6
    direct = DeltaLayer(np.random.default_rng(4), most=10, has_beta=True, per_channel=True,
                        l2norm=True, **FAST)
    direct.step([(1, 0, 7)], given=layer.given(1, 0, 7))
    again = direct.step([(1, 7, 3)], given=layer.given(1, 7, 10))
    assert np.array_equal(got[:3], again[:3])
    assert np.array_equal(layer.state.copy_to_host()[1], direct.state.copy_to_host()[1])


@pytest.mark.parametrize("per_channel,has_beta", [(False, True), (True, False)])
def test_delta_rule_base_advances_and_rewinds_to_it(per_channel, has_beta):
    layer = DeltaLayer(np.random.default_rng(5), most=4, has_beta=has_beta,
                       per_channel=per_channel, l2norm=True, **FAST)
    floors = np.zeros(COLS, np.int32)
    layer.step([(2, 0, 4), (0, 0, 3)])
    layer.step([(2, 4, 4), (0, 3, 1)])                   # 2: live 8
    floors[2] = 6                                        # 6 - 0 > 4: the base advances
    layer.step([(2, 8, 2), (0, 4, 1)], floors=floors)    # to 6, on from the live state
    assert layer.bp[2] == 6
    floors[2] = 8                                        # 8 - 6 <= 4: it stays
    layer.step([(2, 10, 3)], floors=floors)
    assert layer.bp[2] == 6
    floors[2] = 6
    layer.step([(2, 6, 2)], n_pad=2, floors=floors)      # a rewind to the base (p0 == bp)
    floors[2] = 8
    layer.step([(2, 8, 1), (2, 9, 1)], floors=floors)    # two spans
    layer.step([(2, 10, 1)], floors=floors)              # live 11
    floors[2] = 11                                       # advances to p0: live state on
    layer.step([(2, 11, 2)], floors=floors)
    assert layer.bp[2] == 11
    layer.step([(2, 11, 2)], floors=floors)              # a rewind to the base at p0
    layer.step([(2, 13, 4)], floors=floors)              # live 17
    floors[2] = 16                                       # advances and rewinds at once
    layer.step([(2, 16, 2), (0, 5, 2)], n_pad=1, floors=floors)
    assert layer.bp[2] == 16


@pytest.mark.parametrize("floor,p0", [(6, 11), (4, 10)])
def test_delta_rule_a_step_writes_log_rows_it_replayed(floor, p0):
    """`Rl = 3 M = 12`, live 12, base 0: a step from 11 advancing the base to 6 replays
    positions 0..10 (storing the base at 6), then writes 11..14 (rows 11, 0, 1, 2); one
    from 10 replays 0..9, then writes 10..13 (rows 10, 11, 0, 1). A block replays its
    rows before it writes any."""
    layer = DeltaLayer(np.random.default_rng(floor), most=4, has_beta=True,
                       per_channel=False, l2norm=True, **FAST)
    for start in range(0, 12, 4):
        layer.step([(1, start, 4)])
    floors = np.zeros(COLS, np.int32)
    floors[1] = floor
    layer.step([(1, p0, 4)], floors=floors)
    assert layer.bp[1] == (floor if floor > 4 else 0)
    layer.step([(1, p0 + 4, 1)], floors=floors)


def test_delta_rule_layers_of_a_step_share_its_prepared_launches():
    """Two layers of different head shapes, gates and beta rules call one step's
    `recurrence.prepare` plan each step, through prefill, decode, a base advance and a
    rewind."""
    steps = {}
    layers = [DeltaLayer(np.random.default_rng(9), heads=2, dk=8, dv=16, most=4,
                         has_beta=True, per_channel=False, l2norm=True, steps=steps),
              DeltaLayer(np.random.default_rng(10), heads=1, dk=24, dv=8, most=4,
                         has_beta=False, per_channel=True, l2norm=False, steps=steps)]
    share_a_steps_plan(layers, steps)


def test_delta_rule_a_copied_column_goes_on_as_its_source():
    layer = DeltaLayer(np.random.default_rng(6), most=4, has_beta=True, per_channel=True,
                       l2norm=False, **FAST)
    floors = np.zeros(COLS, np.int32)
    layer.step([(0, 0, 4)])
    layer.step([(0, 4, 4)])
    floors[0] = 6
    layer.step([(0, 8, 1)], floors=floors)               # base at 6
    layer.copy_column(0, 3)
    floors[3] = 6
    layer.step([(0, 9, 2), (3, 9, 1)], floors=floors)    # each goes on its own way
    layer.step([(3, 7, 3), (0, 11, 1)], floors=floors)   # the copy rewinds past its fork


@pytest.mark.parametrize("heads,dk,dv,in_name", [
    (1, 128, 128, "float32"),        # the widest a simulated block takes quickly
    (2, 72, 24, "bfloat16"),         # more keys than threads, few values
])
def test_delta_rule_head_shapes(heads, dk, dv, in_name):
    layer = DeltaLayer(np.random.default_rng(dk), heads=heads, dk=dk, dv=dv, most=2,
                       has_beta=True, per_channel=dk < 64, l2norm=True, in_name=in_name,
                       out_name=in_name)
    layer.step([(0, 0, 2)], n_pad=1)
    layer.step([(0, 2, 1), (1, 0, 1)])


def test_delta_rule_refuses_shapes_it_cannot_take():
    layer = DeltaLayer(np.random.default_rng(0), most=2, has_beta=True, per_channel=True,
                       l2norm=True, **FAST)
    step = recurrence.prepare(*(cuda.to_device(a) for a in (
        np.zeros((1, 4), np.int32), np.zeros(1, np.int32),
        np.zeros((1, SEQ_INFO_FIELDS), np.int32))), 1, 2)
    f32 = lambda *shape: cuda.to_device(np.zeros(shape, np.float32))  # noqa: E731
    with pytest.raises(ValueError, match="per-channel gate of 1 entries a head for Dk 8"):
        delta_rule.apply(step, *layer.arrays(), f32(1, 2, 8), f32(1, 2, 8), f32(1, 2, 16),
                         f32(1, 2, 1), None, f32(1, 2, 16), 1.0, True)
    with pytest.raises(ValueError, match="Dk 300 > 256"):
        delta_rule.dk_cap(300)


def test_state_runs_group_spans_by_sequence_in_first_appearance_order():
    seq_info = np.array([[0, 3, 2, 0, 0], [3, 1, 4, 7, 0], [4, 2, 2, 3, 0],
                         [6, 1, 0, 9, 0], [7, 1, 4, 8, 0]], np.int32)
    runs, order, n_chunked = state_runs(seq_info, np.arange(5) * 10)
    assert runs.tolist() == [[2, 20, 0, 2], [4, 40, 2, 4], [0, 0, 4, 5]]
    assert order.tolist() == [0, 2, 1, 4, 3]
    assert runs.dtype == order.dtype == np.int32 and n_chunked == 0
    empty_runs, empty_order, _ = state_runs(np.zeros((0, SEQ_INFO_FIELDS), np.int32), [])
    assert empty_runs.shape == (0, 4) and empty_order.shape == (0,)


@pytest.mark.parametrize("seed", [11, 12])
def test_delta_rule_random_schedules(seed):
    """Steps of up to three sequences of continuations, rewinds, restarts, floors that
    advance the base or not, one or two spans a sequence and padding, and column
    copies, each checked against the references. Floors are a ring's, about `hw - M`
    (`hw` the furthest position written, plus one), so every position a replay reads is
    in the log (`Rl = 3 M`), and a rewind goes back at most to the floor."""
    rng = np.random.default_rng(seed)
    most, log_rows = 4, 12
    layer = DeltaLayer(rng, most=most, has_beta=bool(seed % 2), per_channel=True,
                       l2norm=True, **FAST)
    live = np.zeros(COLS, np.int64)
    furthest = np.full(COLS, -1)                 # furthest position written since a restart
    floors = np.zeros(COLS, np.int32)
    for _ in range(10):
        if rng.random() < 0.15:
            src, dst = rng.choice(COLS - 1, 2, replace=False)
            layer.copy_column(src, dst)
            live[dst], furthest[dst], floors[dst] = live[src], furthest[src], floors[src]
        spans = []
        for col in rng.choice(COLS - 1, int(rng.integers(1, 4)), replace=False):
            col = int(col)
            p0, bp = live[col], layer.bp[col]
            if live[col] == 0 or rng.random() < 0.1:
                p0 = 0                                   # a restart
            else:                                        # a floor as a ring's, about hw - M
                floor = int(np.clip(furthest[col] + 1 - most - rng.integers(0, 2), bp, p0))
                if rng.random() < 0.4:
                    p0 = int(rng.integers(max(floor, 1), live[col] + 1))  # a rewind
                floors[col] = floor
                if floor - bp > most or p0 != live[col]:  # it replays from the base
                    assert bp + log_rows > furthest[col], "the schedule keeps the log"
            n = int(rng.integers(1, most + 1))
            cut = int(rng.integers(1, n + 1))
            spans += [(col, p0, cut)] + ([(col, p0 + cut, n - cut)] if n > cut else [])
            live[col] = p0 + n
            furthest[col] = p0 + n - 1 if p0 == 0 else max(furthest[col], p0 + n - 1)
        order = rng.permutation(len(spans))      # sequences interleave; spans keep order
        spans = sorted(spans, key=lambda sp: (order[[i for i, s in enumerate(spans)
                                                     if s[0] == sp[0]][0]], sp[1]))
        layer.step(spans, n_pad=int(rng.integers(0, 3)), floors=floors)


# ---------------------------------------------------------------- ssd (Mamba2)

@pytest.mark.parametrize("groups,has_d,has_bias,softplus,limit,in_name,out_name", [
    (2, True, True, True, (0.0, np.inf), "float32", "float32"),
    (1, False, False, True, (0.0, np.inf), "bfloat16", "bfloat16"),   # B, C shared
    (4, True, False, False, (0.05, 0.3), "float16", "float32"),       # dt clamped both ways
    (2, True, True, True, (0.2, 1.0), "float32", "strided"),           # strided inputs
])
def test_ssd_over_prefill_decode_spans_and_padding(groups, has_d, has_bias, softplus, limit,
                                                   in_name, out_name):
    """Outputs, states `[H, head_dim, d_state]`, bases and marks against `ssd_ref`:
    prefills, decodes, two spans of a sequence in a step, padding rows zero."""
    strided_inputs = out_name == "strided"
    layer = SsdLayer(np.random.default_rng(groups + 8 * has_d + len(in_name)), groups=groups,
                     has_d=has_d, has_bias=has_bias, softplus=softplus, limit=limit,
                     in_name=in_name, out_name="float32" if strided_inputs else out_name,
                     strided=strided_inputs, most=6)
    layer.step([(0, 0, 5), (2, 0, 1), (3, 0, 6)], n_pad=2)       # prefills
    layer.step([(0, 5, 1), (3, 6, 1), (2, 1, 3), (0, 6, 2)], n_pad=1)  # decode, 2 spans
    layer.step([(3, 7, 1), (2, 4, 1), (0, 8, 1)])                # decode


def test_ssd_rewind_replays_the_log_bit_for_bit():
    """Positions 0..9, then a step from 7 (and a base advance to 4 on the way): the state
    and outputs equal those of a layer that had only tokens 0..6 and then the new ones,
    bit for bit."""
    layer = SsdLayer(np.random.default_rng(13), most=10)
    layer.step([(1, 0, 4)])
    layer.step([(1, 4, 6)])
    got = layer.step([(1, 7, 3), (4, 0, 2)], n_pad=1)    # rewinds to 7: replays 0..6
    direct = SsdLayer(np.random.default_rng(13), most=10)
    direct.step([(1, 0, 7)], given=layer.given(1, 0, 7))
    again = direct.step([(1, 7, 3)], given=layer.given(1, 7, 10))
    assert np.array_equal(got[:3], again[:3])
    assert np.array_equal(layer.state.copy_to_host()[1], direct.state.copy_to_host()[1])


def test_ssd_base_advances_rewinds_to_it_and_a_copied_column_goes_on():
    layer = SsdLayer(np.random.default_rng(14), heads=2, groups=1, most=4)
    floors = np.zeros(COLS, np.int32)
    layer.step([(2, 0, 4), (0, 0, 3)])
    layer.step([(2, 4, 4), (0, 3, 1)])                   # 2: live 8
    floors[2] = 6                                        # 6 - 0 > 4: the base advances
    layer.step([(2, 8, 2), (0, 4, 1)], floors=floors)
    assert layer.bp[2] == 6
    layer.step([(2, 6, 2)], n_pad=2, floors=floors)      # a rewind to the base
    layer.copy_column(2, 3)
    floors[3] = 6
    layer.step([(2, 8, 2), (3, 7, 3)], floors=floors)    # the copy rewinds past its fork


def test_ssd_and_delta_rule_layers_share_a_steps_plan():
    """An ssd layer and a delta rule layer call one step's `recurrence.prepare` plan each
    step, through prefill, decode, a base advance and a rewind."""
    steps = {}
    layers = [SsdLayer(np.random.default_rng(15), heads=2, groups=2, most=4, steps=steps),
              DeltaLayer(np.random.default_rng(16), most=4, has_beta=True, per_channel=False,
                         l2norm=True, steps=steps, **FAST)]
    share_a_steps_plan(layers, steps)


def test_ssd_refuses_groups_that_do_not_divide_its_heads():
    layer = SsdLayer(np.random.default_rng(0), heads=4, groups=2, most=2)
    step = recurrence.prepare(*(cuda.to_device(a) for a in (
        np.zeros((1, 4), np.int32), np.zeros(1, np.int32),
        np.zeros((1, SEQ_INFO_FIELDS), np.int32))), 1, 2)
    f32 = lambda *shape: cuda.to_device(np.zeros(shape, np.float32))  # noqa: E731
    with pytest.raises(ValueError, match="4 heads over 3 groups"):
        ssd.apply(step, *layer.arrays(), f32(1, 4, 8), f32(1, 4), f32(4), f32(1, 3, 16),
                  f32(1, 3, 16), None, None, f32(1, 4, 8), True, 0.0, np.inf)


def test_ssd_and_delta_rule_layers_share_a_plans_chunked_runs(monkeypatch):
    """A plan whose prefill of 17 tokens is a chunked run (the last one), shared by an
    ssd layer and a delta rule layer: each takes it on its own chunked kernel (the ssd's
    heads `[16, 16]`, the state transposed) and the decode beside it on its step kernel,
    against the reference; then decode and a rewind into the prefill."""
    built = []
    for op in (ssd, delta_rule):
        monkeypatch.setattr(op, "chunked_kernel", lambda *shape, op=op: built.append(
            (op, *shape)) or op._chunked_kernels(*shape))
    steps = {}
    layers = [SsdLayer(np.random.default_rng(23), head_dim=16, most=20, chunk=16,
                       steps=steps),
              DeltaLayer(np.random.default_rng(24), heads=1, dk=16, dv=16, most=20,
                         has_beta=True, per_channel=False, l2norm=True, chunk=16,
                         steps=steps)]
    spans = [(0, 0, 17), (1, 0, 2)]
    assert state_runs(step_tables(spans, 0)[0], np.zeros(COLS, np.int32), 16)[2] == 1
    for schedule in (spans, [(1, 2, 1), (0, 17, 1)], [(0, 9, 16)]):
        for layer in layers:
            layer.step(schedule)
    assert len(steps) == 3
    # the prefill and the rewind's 16 new tokens, each op's kernel
    assert built == [(ssd, 16, 16, 16), (delta_rule, 16, 16, 16)] * 2


@pytest.mark.parametrize("groups,head_dim,has_d,has_bias,softplus,limit,in_name", [
    (2, 16, True, True, True, (0.0, np.inf), "float32"),
    (1, 32, False, False, False, (0.05, 0.3), "bfloat16"),    # B, C shared; dt clamped
])
def test_ssd_chunked_prefills_match_the_reference(groups, head_dim, has_d, has_bias,
                                                  softplus, limit, in_name):
    """The ssd's prefills on the chunked kernel, decode and a rewind (`chunked_steps`)."""
    layer = SsdLayer(np.random.default_rng(groups + head_dim), groups=groups,
                     head_dim=head_dim, has_d=has_d, has_bias=has_bias, softplus=softplus,
                     limit=limit, in_name=in_name, out_name=in_name, most=24, chunk=16)
    chunked_steps(layer)


def test_ssd_chunked_prefill_writes_what_the_per_token_kernel_writes():
    """An ssd layer whose prefill took the chunked kernel and one that took the per-token
    kernel, the same inputs: the same logs and marks, states near, rewinds and clones bit for
    bit (`matches_the_per_token_kernel`)."""
    chunked_layer, plain = (SsdLayer(np.random.default_rng(25), head_dim=16, most=24,
                                     chunk=chunk) for chunk in (16, 0))
    matches_the_per_token_kernel(chunked_layer, plain)


# ---------------------------------------------------------------- chunked prefill

CHUNKED = dict(heads=1, dk=16, chunk=16, most=24)


@pytest.mark.parametrize("dv,has_beta,l2norm,in_name,out_name", [
    (32, True, True, "float32", "float32"),
    (48, True, False, "bfloat16", "bfloat16"),    # three blocks of 16 value columns
    (16, False, True, "float16", "float32"),      # decay only
])
def test_delta_rule_chunked_prefills_match_the_reference(dv, has_beta, l2norm, in_name,
                                                          out_name):
    """The delta rule's prefills on the chunked kernel, decode and a rewind
    (`chunked_steps`)."""
    layer = DeltaLayer(np.random.default_rng(dv + has_beta), dv=dv, has_beta=has_beta,
                       per_channel=False, l2norm=l2norm, in_name=in_name,
                       out_name=out_name, **CHUNKED)
    chunked_steps(layer)


def test_delta_rule_chunked_prefill_writes_what_the_per_token_kernel_writes():
    """A layer whose prefill took the chunked kernel and one that took the per-token
    kernel, the same inputs: the same logs and marks, states near, rewinds and clones bit for
    bit (`matches_the_per_token_kernel`)."""
    chunked_layer, plain = (DeltaLayer(np.random.default_rng(21), dv=16, has_beta=True,
                                       per_channel=False, l2norm=True,
                                       **{**CHUNKED, "chunk": chunk}) for chunk in (16, 0))
    matches_the_per_token_kernel(chunked_layer, plain)


def test_delta_rule_chunked_runs_after_a_replay_and_a_base_advance():
    """Chunked runs whose blocks first replay: the base advancing to a floor below p0,
    from the live state on; to p0 itself, the live state kept; a rewind to the base. Keys
    of a width not a multiple of 16 stay on the per-token kernel with chunked runs
    planned, with either gate."""
    layer = DeltaLayer(np.random.default_rng(22), heads=1, dk=16, dv=16, most=20,
                       has_beta=True, per_channel=False, l2norm=True, chunk=16)
    chunked_runs_after_replays(layer)
    for dk, per_channel in ((24, False), (24, True)):
        other = DeltaLayer(np.random.default_rng(dk), heads=1, dk=dk, dv=16, most=20,
                           has_beta=True, per_channel=per_channel, l2norm=True, chunk=16)
        other.step([(1, 0, 17), (0, 0, 2)])


@pytest.mark.parametrize("op", ["delta_rule", "ssd"])
def test_bfloat16_states_through_chunked_and_per_token_steps_and_rewinds(op):
    """States and bases kept as bfloat16 bits: a chunked prefill beside a per-token one,
    decode, a rewind replayed from the rounded base, against the float64 reference to
    bfloat16's tolerance; the states hold bfloat16 values (their low 16 bits zero once
    decoded to float32)."""
    rng = np.random.default_rng(26)
    layer = (DeltaLayer(rng, heads=1, dk=16, dv=16, most=20, has_beta=True,
                        per_channel=False, l2norm=True, chunk=16, state_name="bfloat16")
             if op == "delta_rule" else
             SsdLayer(rng, head_dim=16, most=20, chunk=16, state_name="bfloat16"))
    assert layer.state.dtype == np.uint16
    layer.step([(0, 0, 18), (1, 0, 3)], n_pad=1)
    floors = np.zeros(COLS, np.int32)
    floors[0] = 18
    layer.step([(0, 18, 2), (1, 3, 1)], floors=floors)
    layer.step([(0, 19, 1), (1, 2, 2)], floors=floors)          # rewinds of both


def test_state_runs_put_runs_of_a_chunk_or_more_last():
    seq_info = np.array([[0, 3, 2, 0, 0], [3, 1, 4, 7, 0], [4, 2, 2, 3, 0],
                         [6, 1, 0, 9, 0], [7, 1, 4, 8, 0]], np.int32)
    runs, order, n_chunked = state_runs(seq_info, np.arange(5) * 10, chunk=2)
    assert n_chunked == 2                  # 2 (3 + 2 tokens) and 4 (1 + 1) after 0 (1)
    assert runs.tolist() == [[0, 0, 0, 1], [2, 20, 1, 3], [4, 40, 3, 5]]
    assert order.tolist() == [3, 0, 2, 1, 4]
    assert state_runs(seq_info, np.arange(5) * 10, chunk=6)[2] == 0


def test_a_plan_of_chunked_runs_without_a_chunk_is_refused():
    tables = (cuda.to_device(np.zeros((3, 4), np.int32)), cuda.to_device(np.zeros(3, np.int32)),
              cuda.to_device(np.zeros((3, SEQ_INFO_FIELDS), np.int32)))
    with pytest.raises(ValueError, match="2 chunked runs need a chunk of at least 1 token, "
                                         "not 0"):
        recurrence.prepare(*tables, 3, 4, n_chunked=2)


# ---------------------------------------------------------------- compiled for a GPU

COMPILE = kv_device.KIND == "compile"


@pytest.mark.skipif(COMPILE or kv_device.KIND == "gpu",
                    reason="runs the compile-mode test from the simulator")
def test_the_kernels_compile_and_launch_in_compile_mode():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["KVNUMBA_DEVICE"] = "compile"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-n0", "-rs", __file__, "-k", "packs_what_numbas_launch_would"],
                          env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.skipif(not COMPILE, reason="KVNUMBA_DEVICE=compile only (run by "
                                        "test_the_kernels_compile_and_launch_in_compile_mode)")
def test_each_state_launch_packs_what_numbas_launch_would(monkeypatch):
    """Every launch of the wrappers, compiled for sm_90 by libNVVM, packs the parameters
    Numba's own launch would: conv with and without a bias, the delta rule per head with
    beta (float16 in, bfloat16 out) and per channel without (float32), the ssd (bfloat16)
    without and with D, their marks and padding launches; strided q and k; a chunked run
    (the replay, the chunked kernel of a gate a head, of a key channel's, and the ssd's
    chunked scan)."""
    from kvnumba.bench import host
    from test_launch import numba_parameters
    from kvnumba.kernels.launch import lean
    seen = []
    plain, bound = lean.LeanKernel.__call__, lean.LeanLaunch.__call__

    def spy(self, grid, block, stream, *args):
        seen.append((self, grid, block, stream, args))
        plain(self, grid, block, stream, *args)

    def spy_bound(self, *values):
        seen.append((self.kernel, self.grid, self.block, self.stream, self.arguments(values)))
        bound(self, *values)

    monkeypatch.setattr(lean.LeanKernel, "__call__", spy)
    monkeypatch.setattr(lean.LeanLaunch, "__call__", spy_bound)
    recorder = host.Recorder(keep_parameters=True)
    with host.fake_device(recorder):
        width, channels, heads, dk, dv = 6, 24, 2, 128, 128
        tokens = cuda.device_array(2 * width, np.int32)
        ring = cuda.device_array((COLS, 9, channels), np.uint16)
        conv.write_window(ring, cuda.device_array((width, channels), np.float16), tokens,
                          width)
        for bias in (None, cuda.device_array(channels, np.float32)):
            conv.apply(ring, cuda.device_array((channels, 4), np.float32), bias,
                       cuda.device_array((width, channels), np.float32), tokens, width, 4,
                       True)
        f32 = lambda *shape: cuda.device_array(shape, np.float32)  # noqa: E731
        arrays = (f32(COLS, heads, dk, dv), f32(COLS, heads, dk, dv), f32(COLS, 12, heads, dk),
                  f32(COLS, 12, heads, dv), f32(COLS, 12, heads, dk), f32(COLS, 12, heads),
                  cuda.device_array((COLS, 2), np.int32))
        tables = (cuda.device_array((3, 4), np.int32), cuda.device_array(4, np.int32),
                  cuda.device_array((4, SEQ_INFO_FIELDS), np.int32))
        for dtype, out_dtype, per_channel, has_beta in ((np.float16, np.uint16, False, True),
                                                        (np.float32, np.float32, True, False)):
            qk = cuda.device_array((width, heads, dk), dtype)
            if per_channel:                      # a strided view, as a fused projection's
                qk = cuda.device_array((width, heads, 2 * dk), dtype)[:, :, ::2]
            g = cuda.device_array((width, heads, dk) if per_channel else (width, heads), dtype)
            beta = cuda.device_array((width, heads), dtype) if has_beta else None
            delta_rule.run(*arrays, qk, qk, cuda.device_array((width, heads, dv), dtype), g,
                           beta, cuda.device_array((width, heads, dv), out_dtype), *tables, 3,
                           0.125, True, 4, n_tokens=5)
        head_dim, d_state, groups = 64, 128, 1           # ssd: x [.., 64], B, C [.., 128]
        ssd_arrays = (f32(COLS, heads, head_dim, d_state), f32(COLS, heads, head_dim, d_state),
                      f32(COLS, 12, heads, head_dim), f32(COLS, 12, heads, d_state),
                      *arrays[4:])
        bc = cuda.device_array((width, groups, d_state), np.uint16)
        ssd_inputs = (cuda.device_array((width, heads, head_dim), np.uint16),
                      cuda.device_array((width, heads), np.uint16), f32(heads), bc, bc)
        ssd_out = cuda.device_array((width, heads, head_dim), np.uint16)
        plan = recurrence.prepare(*tables, 3, 4, n_tokens=5)
        for D in (None, f32(heads)):
            ssd.apply(plan, *ssd_arrays, *ssd_inputs, D, None, ssd_out, True, 0.0, np.inf)
        small = (f32(COLS, heads, 32, 32), f32(COLS, heads, 32, 32), f32(COLS, 12, heads, 32),
                 f32(COLS, 12, heads, 32), f32(COLS, 12, heads, 32), f32(COLS, 12, heads),
                 arrays[-1])                     # the last run chunked (the plan's order)
        x = cuda.device_array((width, heads, 32), np.uint16)
        for gate in ((width, heads), (width, heads, 32)):
            delta_rule.run(*small, x, x, x, cuda.device_array(gate, np.uint16),
                           cuda.device_array((width, heads), np.uint16), x, *tables, 3, 0.125,
                           True, 4, n_chunked=1, chunk=16)
        chunked_plan = recurrence.prepare(*tables, 3, 4, n_chunked=1, chunk=16)
        ssd.apply(chunked_plan, *ssd_arrays, *ssd_inputs, None, None, ssd_out, True, 0.0,
                  np.inf)                        # the ssd's chunked scan
    names = [kernel.name for kernel, *_ in seen]
    assert names == ["_write_window", "_apply", "_apply"] + ["step_kernel", "_set_marks",
                                                             "_zero_rows"] * 4 + [
        "step_kernel", "step_kernel", "chunk_kernel", "_set_marks"] * 3
    assert len(seen) == len(recorder.launches)
    for (kernel, _, _, stream, args), record in zip(seen, recorder.launches):
        assert record.raw == numba_parameters(kernel, args, stream), kernel.name
    assert recorder.launches[3].grid == (3, heads, 1)
    assert recorder.launches[3].block == (512, 1, 1)    # 4 lanes a column of 128 rows
    assert recorder.launches[9].block == (256, 1, 1)    # 64 columns of 128 rows (ssd)
    for at in (-10, -6):                                 # 32 value columns a block
        assert recorder.launches[at].grid == (1, heads, 1)
        assert recorder.launches[at].block == (128, 1, 1)
    assert seen[-10][0] is not seen[-6][0]               # each gate's own kernel
    assert recorder.launches[-2].grid == (1, heads, 2)   # the ssd: 64 columns, 2 blocks
    assert recorder.launches[-2].block == (128, 1, 1)
