"""The state layers' kernels (`kernels.state.conv`, `kernels.state.delta_rule`) and their
work plan (`arith.state_runs`) called directly, step after step, against the float64
references of `stateref` run over each sequence's whole history.

A `Layer` holds one state layer's device storage for `COLS` columns (the last the
scratch column) and, per column, the inputs of every position it holds (its history):
a step of spans `(col, pos_start, n)` truncates each sequence's history at the span's
start (a rewind when that is below its live position) and appends the new tokens, and
the kernels' outputs, states, bases and marks must match the references of the
histories. Storage starts as NaN, so a read of anything not written (a conv tap before
position 0, a base at position 0, a padding token's inputs) shows.

The kernels also compile for a GPU and launch through the lean path: one test runs this
file's `compile_mode` test in `KVNUMBA_DEVICE=compile` mode (test_launch.py's way).
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
from kvnumba.kernels.state import conv, delta_rule
from oracle import bf16_values, round_nearest_even
from stateref import conv_ref, delta_rule_ref

COLS = 6                      # 5 sequence columns and the scratch column
SCRATCH = COLS - 1
KERNEL_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
#: tolerance of an output or state, relative to the largest reference value, by dtype
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


def quantize(values, name):
    """`(array in the kernels' dtype, its float64 values)` of float64 `values`."""
    values = np.asarray(values, np.float64)
    if name == "bfloat16":
        bits = round_nearest_even(values.astype(np.float32), "bf16")
        return bits, bf16_values(bits)
    held = values.astype(KERNEL_DTYPES[name])
    return held, held.astype(np.float64)


def decode(array, name):
    """float64 values of an array in the kernels' dtype `name`."""
    return bf16_values(array) if name == "bfloat16" else np.asarray(array, np.float64)


def nan_array(shape, name):
    """An array of `shape` in the kernels' dtype `name`, all NaN."""
    if name == "bfloat16":
        return np.full(shape, 0x7FC0, np.uint16)
    return np.full(shape, np.nan, KERNEL_DTYPES[name])


def close(got, ref, name, what):
    err = np.max(np.abs(got - ref)) if ref.size else 0.0
    bound = TOLERANCE[name] * max(1.0, float(np.max(np.abs(ref))) if ref.size else 1.0)
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def strided(host):
    """A device view of `host`'s values whose last axis is strided: the even entries of
    an array twice as wide (as a slice of a fused projection is)."""
    wide = np.zeros((*host.shape[:-1], 2 * host.shape[-1]), host.dtype)
    wide[..., ::2] = host
    return cuda.to_device(wide)[..., ::2]


def step_tables(spans, n_pad):
    """`(seq_info, tokens, n_tokens, width, token_of)` of a step of `spans` `(col,
    pos_start, n)` in token order and `n_pad` padding tokens (scratch column, position
    0); `token_of[(col, position)]` the token index."""
    rows, cols, positions = [], [], []
    for col, start, n in spans:
        rows.append((len(cols), n, col, start, 0))
        cols += [col] * n
        positions += range(start, start + n)
    n_tokens = len(cols)
    token_of = {(c, p): t for t, (c, p) in enumerate(zip(cols, positions))}
    cols += [SCRATCH] * n_pad
    positions += [0] * n_pad
    seq_info = np.array(rows, np.int32).reshape(-1, SEQ_INFO_FIELDS)
    return seq_info, np.array(cols + positions, np.int32), n_tokens, len(cols), token_of


def truncated(history, spans):
    """Each span's sequence's history cut at its first span's start."""
    seen = set()
    for col, start, _ in spans:
        if col not in seen:
            seen.add(col)
            del history[col][start:]


# ---------------------------------------------------------------- convolution

class ConvLayer:
    """One conv layer's ring and histories; `steps`, a dict shared by layers stepping in
    lockstep, makes them share each step's prepared launches (`conv.prepare`), else
    each call takes `write_window` and `apply`."""

    def __init__(self, rng, rows, channels, taps, store, has_bias, silu, steps=None):
        self.rng, self.store, self.silu, self.steps = rng, store, silu, steps
        self.ring = cuda.to_device(nan_array((COLS, rows, channels), store))
        self.weight, self.weight_values = quantize(rng.standard_normal((channels, taps)) / 2,
                                                   "float32")
        self.bias = rng.standard_normal(channels).astype(np.float32) if has_bias else None
        self.history = {c: [] for c in range(COLS)}

    def step(self, spans, n_pad, x_name, out_name, strided_x=False):
        seq_info, tokens, n_tokens, width, token_of = step_tables(spans, n_pad)
        channels = self.ring.shape[2]
        x, x_values = quantize(self.rng.standard_normal((width, channels)), x_name)
        stored = quantize(x_values, self.store)[1]
        truncated(self.history, spans)
        for t in range(n_tokens):
            self.history[tokens[t]].append(stored[t])
        before = self.ring.copy_to_host()
        out = cuda.to_device(nan_array((width, channels), out_name))
        bias = None if self.bias is None else cuda.to_device(self.bias)
        d_x = strided(x) if strided_x else cuda.to_device(x)
        if self.steps is None:
            d_tokens = cuda.to_device(tokens)
            conv.write_window(self.ring, d_x, d_tokens, width)
            conv.apply(self.ring, cuda.to_device(self.weight), bias, out, d_tokens, width,
                       n_tokens, self.silu)
        else:
            key = (tuple(spans), n_pad)
            if key not in self.steps:
                self.steps[key] = conv.prepare(cuda.to_device(tokens), width, n_tokens)
            self.steps[key].write(self.ring, d_x)
            self.steps[key].apply(self.ring, cuda.to_device(self.weight), bias, out, self.silu)
        got = decode(out.copy_to_host(), out_name)
        assert np.all(got[n_tokens:] == 0), "padding rows are zeroed"
        for col in {c for c, _, _ in spans}:
            ref = conv_ref(np.array(self.history[col]), self.weight_values, self.bias,
                           self.silu)
            mine = [(p, t) for (c, p), t in token_of.items() if c == col]
            close(got[[t for _, t in mine]], ref[[p for p, _ in mine]], out_name, "conv out")
        ring = self.ring.copy_to_host()
        untouched = [c for c in range(COLS - 1) if c not in {s[0] for s in spans}]
        assert np.array_equal(ring[untouched].view(np.uint8), before[untouched].view(np.uint8))
        return got


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

class DeltaLayer:
    """One delta rule layer's storage, histories and base positions; `steps` as
    `ConvLayer`'s (`delta_rule.prepare`, else `delta_rule.run`)."""

    def __init__(self, rng, heads, dk, dv, most, has_beta, per_channel, l2norm,
                 in_name="float32", out_name="float32", steps=None, strided=False):
        self.rng, self.most, self.has_beta, self.per_channel = rng, most, has_beta, per_channel
        self.steps, self.strided = steps, strided
        self.l2norm, self.in_name, self.out_name = l2norm, in_name, out_name
        self.heads, self.dk, self.dv, self.scale = heads, dk, dv, dk ** -0.5
        log_rows = 3 * most
        nan = lambda *shape: cuda.to_device(np.full(shape, np.nan, np.float32))  # noqa: E731
        self.state, self.base = nan(COLS, heads, dk, dv), nan(COLS, heads, dk, dv)
        self.log_k, self.log_v = nan(COLS, log_rows, heads, dk), nan(COLS, log_rows, heads, dv)
        self.log_g, self.log_b = nan(COLS, log_rows, heads, dk), nan(COLS, log_rows, heads)
        self.marks = cuda.to_device(np.zeros((COLS, 2), np.int32))
        self.history = {c: [] for c in range(COLS)}
        self.bp = np.zeros(COLS, np.int64)

    def arrays(self):
        return (self.state, self.base, self.log_k, self.log_v, self.log_g, self.log_b,
                self.marks)

    def inputs(self, width):
        """A step's inputs, float64 values and as the kernels take them."""
        rng, h, dk, dv = self.rng, self.heads, self.dk, self.dv
        q = rng.standard_normal((width, h, dk))
        k = rng.standard_normal((width, h, dk))
        if not self.l2norm:        # a stable recurrence: unit keys, small queries
            k /= np.linalg.norm(k, axis=-1, keepdims=True)
            q /= np.sqrt(dk)
        g = -rng.uniform(0.02, 0.6, (width, h, dk) if self.per_channel else (width, h))
        beta = rng.uniform(0.1, 0.95, (width, h)) if self.has_beta else None
        v = rng.standard_normal((width, h, dv))
        held = {}
        for name, a in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
            held[name] = None if a is None else quantize(a, self.in_name)
        return held

    def step(self, spans, n_pad=0, floors=None, given=None):
        """Run a step (inputs random, or the float64 values `given` by name); returns the
        float64 outputs `[width, H, Dv]`."""
        seq_info, _, n_tokens, width, token_of = step_tables(spans, n_pad)
        floors = np.zeros(COLS, np.int32) if floors is None else np.asarray(floors, np.int32)
        runs, order = state_runs(seq_info, floors)
        held = self.inputs(width)
        if given is not None:
            held = {n: None if a is None else quantize(np.concatenate(
                [a, held[n][1][len(a):]]), self.in_name) for n, a in given.items()}
        for name in held:                     # padding tokens' inputs: NaN, never read
            if held[name] is not None:
                held[name][0][n_tokens:] = nan_array(held[name][0][n_tokens:].shape,
                                                     self.in_name)
        truncated(self.history, spans)
        for (col, _), t in sorted(token_of.items(), key=lambda kv: kv[1]):
            self.history[col].append({n: None if a is None else a[1][t]
                                      for n, a in held.items()})
        out = cuda.to_device(nan_array((width, self.heads, self.dv), self.out_name))
        dev = {n: None if a is None else strided(a[0]) if self.strided else cuda.to_device(a[0])
               for n, a in held.items()}
        inputs = (dev["q"], dev["k"], dev["v"], dev["g"], dev["beta"], out)
        if self.steps is None:
            delta_rule.run(*self.arrays(), *inputs, cuda.to_device(runs),
                           cuda.to_device(order), cuda.to_device(seq_info), len(runs),
                           self.scale, self.l2norm, self.most, n_tokens=n_tokens)
        else:
            key = (tuple(spans), n_pad, tuple(floors))
            if key not in self.steps:
                self.steps[key] = delta_rule.prepare(
                    cuda.to_device(runs), cuda.to_device(order), cuda.to_device(seq_info),
                    len(runs), self.most, n_tokens=n_tokens)
            self.steps[key](*self.arrays(), *inputs, self.scale, self.l2norm)
        got = decode(out.copy_to_host(), self.out_name)
        for col in {c for c, _, _ in spans}:       # the base moves as the rule says
            start = min(s for c, s, _ in spans if c == col)
            if start == 0:
                self.bp[col] = 0
            elif floors[col] - self.bp[col] > self.most:
                self.bp[col] = floors[col]
        self.check(got, spans, token_of, n_tokens)
        return got

    def given(self, col, lo, hi):
        """The float64 inputs of positions `[lo, hi)` of column `col`, by name."""
        entries = self.history[col][lo:hi]
        return {n: None if entries[0][n] is None else np.array([e[n] for e in entries])
                for n in entries[0]}

    def copy_column(self, src, dst):
        """Every array's column `src` copied to column `dst`, as a clone copies it."""
        for array in self.arrays():
            host = array.copy_to_host()
            host[dst] = host[src]
            array.copy_to_device(host)
        self.history[dst] = list(self.history[src])
        self.bp[dst] = self.bp[src]

    def reference(self, col, upto=None):
        history = self.history[col][:upto]
        stack = lambda n: np.array([e[n] for e in history])  # noqa: E731
        beta = stack("beta") if self.has_beta else None
        return delta_rule_ref(stack("q"), stack("k"), stack("v"), stack("g"), beta,
                              self.scale, self.l2norm)

    def check(self, got, spans, token_of, n_tokens):
        assert np.all(got[n_tokens:] == 0), "padding rows are zeroed"
        state, base = self.state.copy_to_host(), self.base.copy_to_host()
        marks = self.marks.copy_to_host()
        for col in {c for c, _, _ in spans}:
            ref_out, ref_state = self.reference(col)
            mine = [(p, t) for (c, p), t in token_of.items() if c == col]
            close(got[[t for _, t in mine]], ref_out[[p for p, _ in mine]], self.out_name,
                  f"out of column {col}")
            close(state[col], ref_state, "float32", f"state of column {col}")
            assert tuple(marks[col]) == (len(self.history[col]), self.bp[col])
            if self.bp[col] > 0:
                close(base[col], self.reference(col, self.bp[col])[1], "float32",
                      f"base of column {col}")


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
    `DeltaStep` each step, through prefill, decode, a base advance and a rewind."""
    steps = {}
    layers = [DeltaLayer(np.random.default_rng(9), heads=2, dk=8, dv=16, most=4,
                         has_beta=True, per_channel=False, l2norm=True, steps=steps),
              DeltaLayer(np.random.default_rng(10), heads=1, dk=24, dv=8, most=4,
                         has_beta=False, per_channel=True, l2norm=False, steps=steps)]
    floors = np.zeros(COLS, np.int32)
    schedule = [([(0, 0, 4), (3, 0, 2)], 1), ([(0, 4, 4), (3, 2, 1)], 0),
                ([(0, 8, 1), (3, 3, 1)], 2), ([(0, 7, 2)], 0)]
    for i, (spans, n_pad) in enumerate(schedule):
        floors[0] = 5 if i >= 2 else 0
        for layer in layers:
            layer.step(spans, n_pad, floors=floors)
    assert len(steps) == len(schedule)
    assert all(layer.bp[0] == 5 for layer in layers)


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
    step = delta_rule.prepare(*(cuda.to_device(a) for a in (
        np.zeros((1, 4), np.int32), np.zeros(1, np.int32),
        np.zeros((1, SEQ_INFO_FIELDS), np.int32))), 1, 2)
    f32 = lambda *shape: cuda.to_device(np.zeros(shape, np.float32))  # noqa: E731
    with pytest.raises(ValueError, match="per-channel gate of 1 entries a head for Dk 8"):
        step(*layer.arrays(), f32(1, 2, 8), f32(1, 2, 8), f32(1, 2, 16), f32(1, 2, 1), None,
             f32(1, 2, 16), 1.0, True)
    with pytest.raises(ValueError, match="Dk 300 > 256"):
        delta_rule.dk_cap(300)


def test_state_runs_group_spans_by_sequence_in_first_appearance_order():
    seq_info = np.array([[0, 3, 2, 0, 0], [3, 1, 4, 7, 0], [4, 2, 2, 3, 0],
                         [6, 1, 0, 9, 0], [7, 1, 4, 8, 0]], np.int32)
    runs, order = state_runs(seq_info, np.arange(5) * 10)
    assert runs.tolist() == [[2, 20, 0, 2], [4, 40, 2, 4], [0, 0, 4, 5]]
    assert order.tolist() == [0, 2, 1, 4, 3]
    assert runs.dtype == order.dtype == np.int32
    empty_runs, empty_order = state_runs(np.zeros((0, SEQ_INFO_FIELDS), np.int32), [])
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
    beta (float16 in, bfloat16 out) and per channel without (float32), its marks and
    padding launches; strided q and k."""
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
    names = [kernel.name for kernel, *_ in seen]
    assert names == ["_write_window", "_apply", "_apply"] + ["step_kernel", "_set_marks",
                                                             "_zero_rows"] * 2
    assert len(seen) == len(recorder.launches)
    for (kernel, _, _, stream, args), record in zip(seen, recorder.launches):
        assert record.raw == numba_parameters(kernel, args, stream), kernel.name
    assert recorder.launches[3].grid == (3, heads, 1)
    assert recorder.launches[3].block == (128, 1, 1)
