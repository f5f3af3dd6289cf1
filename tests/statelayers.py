"""The harness of tests/test_state_kernels.py: one state layer's device storage for
`COLS` columns (the last the scratch column) driven step by step, and per column the
inputs of every position it holds (its history), checked against the float64 references
of `stateref` over each whole history.

A step of spans `(col, pos_start, n)` truncates each sequence's history at its first
span's start (a rewind when that is below its live position) and appends the new
tokens; the kernels' outputs, states, bases and marks must then match the references.
Storage starts as NaN, so a read of anything not written (a conv tap before position 0,
a base at position 0, a padding token's inputs) shows.
"""
import numpy as np

from kvnumba.arith.positions import SEQ_INFO_FIELDS
from kvnumba.arith.state_runs import state_runs
from kvnumba.device import cuda
from kvnumba.kernels.state import conv, delta_rule, recurrence, ssd
from oracle import bf16_values, round_nearest_even
from stateref import conv_ref, delta_rule_ref, ssd_ref

COLS = 6                      # 5 sequence columns and the scratch column
SCRATCH = COLS - 1
KERNEL_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
#: tolerance of an output or state, relative to the largest reference value, by dtype
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}
#: the least tolerance of a layer whose prefills take the chunked kernel (float16
#: operands of its products, float32 sums: about 7e-4 seen at dk 32, 37 tokens)
CHUNKED_TOLERANCE = 2e-3


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


def close(got, ref, name, what, least=0.0):
    err = np.max(np.abs(got - ref)) if ref.size else 0.0
    bound = max(TOLERANCE[name], least) * max(1.0, float(np.max(np.abs(ref))) if ref.size
                                              else 1.0)
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


class DeltaLayer:
    """One delta rule layer's storage, histories and base positions; `steps` as
    `ConvLayer`'s (`recurrence.prepare`); with `chunk`, runs of at least `chunk` new
    tokens take the chunked kernel with chunks of that many, and its outputs and states
    are checked to `CHUNKED_TOLERANCE` (a base, replayed from the log, still to
    float32's); `state_name` the states' dtype (bfloat16: checked to its tolerance)."""

    def __init__(self, rng, heads, dk, dv, most, has_beta, per_channel, l2norm,
                 in_name="float32", out_name="float32", steps=None, strided=False, chunk=0,
                 state_name="float32"):
        self.rng, self.most, self.has_beta, self.per_channel = rng, most, has_beta, per_channel
        self.chunk, self.state_name = chunk, state_name
        self.steps, self.strided = steps, strided
        self.l2norm, self.in_name, self.out_name = l2norm, in_name, out_name
        self.heads, self.dk, self.dv, self.scale = heads, dk, dv, dk ** -0.5
        self.out_dim = dv
        self.storage(heads, dk, dv)

    def storage(self, heads, dk, dv):
        """NaN storage of `recurrent=(heads, dk, dv)` as `state_storage` allocates it."""
        log_rows = 3 * self.most
        nan = lambda *shape: cuda.to_device(np.full(shape, np.nan, np.float32))  # noqa: E731
        self.state, self.base = (cuda.to_device(nan_array((COLS, heads, dk, dv),
                                                          self.state_name)) for _ in range(2))
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
        runs, order, n_chunked = state_runs(seq_info, floors, self.chunk)
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
        out = cuda.to_device(nan_array((width, self.heads, self.out_dim), self.out_name))
        dev = {n: None if a is None else strided(a[0]) if self.strided else cuda.to_device(a[0])
               for n, a in held.items()}
        tables = tuple(cuda.to_device(a) for a in (runs, order, seq_info))
        if self.steps is None:
            plan = recurrence.prepare(*tables, len(runs), self.most, n_tokens=n_tokens,
                                      n_chunked=n_chunked, chunk=self.chunk)
        else:
            key = (tuple(spans), n_pad, tuple(floors), self.chunk)
            if key not in self.steps:
                self.steps[key] = recurrence.prepare(*tables, len(runs), self.most,
                                                     n_tokens=n_tokens, n_chunked=n_chunked,
                                                     chunk=self.chunk)
            plan = self.steps[key]
        self.launch(plan, dev, out)
        got = decode(out.copy_to_host(), self.out_name)
        for col in {c for c, _, _ in spans}:       # the base moves as the rule says
            start = min(s for c, s, _ in spans if c == col)
            if start == 0:
                self.bp[col] = 0
            elif floors[col] - self.bp[col] > self.most:
                self.bp[col] = floors[col]
        self.check(got, spans, token_of, n_tokens)
        return got

    def launch(self, plan, dev, out):
        delta_rule.apply(plan, *self.arrays(), dev["q"], dev["k"], dev["v"], dev["g"],
                         dev["beta"], out, self.scale, self.l2norm)

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

    def least(self):
        """The least tolerance of this layer's outputs and states (`close`)."""
        return max(CHUNKED_TOLERANCE if self.chunk else 0.0, TOLERANCE[self.state_name])

    def check(self, got, spans, token_of, n_tokens):
        assert np.all(got[n_tokens:] == 0), "padding rows are zeroed"
        state, base = (decode(array.copy_to_host(), self.state_name)
                       for array in (self.state, self.base))
        marks = self.marks.copy_to_host()
        for col in {c for c, _, _ in spans}:
            ref_out, ref_state = self.reference(col)
            mine = [(p, t) for (c, p), t in token_of.items() if c == col]
            least = self.least()
            close(got[[t for _, t in mine]], ref_out[[p for p, _ in mine]], self.out_name,
                  f"out of column {col}", least)
            close(state[col], ref_state, "float32", f"state of column {col}", least)
            assert tuple(marks[col]) == (len(self.history[col]), self.bp[col])
            if self.bp[col] > 0:
                close(base[col], self.reference(col, self.bp[col])[1], self.state_name,
                      f"base of column {col}")


class SsdLayer(DeltaLayer):
    """One ssd (Mamba2) layer's storage (`recurrent=(heads, head_dim, d_state)`: the state
    `[COLS, H, head_dim, d_state]`), histories and base positions, run by `ssd.apply`
    and checked against `stateref.ssd_ref`; `groups` of B and C, per-head `D` and
    `dt_bias` (or None), `softplus`, `limit` the clamp of dt; with `chunk`, runs of at
    least `chunk` new tokens take the chunked kernel where its heads fit it, checked as
    `DeltaLayer`'s."""

    def __init__(self, rng, heads=4, groups=2, head_dim=8, d_state=16, most=4, has_d=True,
                 has_bias=True, softplus=True, limit=(0.0, np.inf), in_name="float32",
                 out_name="float32", steps=None, strided=False, chunk=0, state_name="float32"):
        self.rng, self.most, self.steps, self.strided = rng, most, steps, strided
        self.chunk, self.state_name = chunk, state_name
        self.in_name, self.out_name = in_name, out_name
        self.heads, self.groups, self.head_dim, self.d_state = heads, groups, head_dim, d_state
        self.out_dim, self.softplus, self.limit = head_dim, softplus, limit
        self.A = -rng.uniform(0.5, 2.0, heads).astype(np.float32)
        self.D = rng.standard_normal(heads).astype(np.float32) if has_d else None
        self.dt_bias = rng.uniform(-1.0, 0.5, heads).astype(np.float32) if has_bias else None
        self.storage(heads, head_dim, d_state)

    def inputs(self, width):
        rng, h, g = self.rng, self.heads, self.groups
        values = {"x": rng.standard_normal((width, h, self.head_dim)),
                  "dt": rng.uniform(-3.0, 1.5, (width, h)) if self.softplus
                  else rng.uniform(0.01, 0.6, (width, h)),
                  "B": rng.standard_normal((width, g, self.d_state)) / np.sqrt(self.d_state),
                  "C": rng.standard_normal((width, g, self.d_state))}
        return {name: quantize(a, self.in_name) for name, a in values.items()}

    def launch(self, plan, dev, out):
        vector = lambda a: None if a is None else cuda.to_device(a)  # noqa: E731
        ssd.apply(plan, *self.arrays(), dev["x"], dev["dt"], cuda.to_device(self.A), dev["B"],
                  dev["C"], vector(self.D), vector(self.dt_bias), out, self.softplus,
                  *self.limit)

    def reference(self, col, upto=None):
        history = self.history[col][:upto]
        stack = lambda n: np.array([e[n] for e in history])  # noqa: E731
        return ssd_ref(stack("x"), stack("dt"), self.A, stack("B"), stack("C"), self.D,
                       self.dt_bias, self.softplus, self.limit)


def chunked_steps(layer):
    """Prefills of 21 (a chunk and 5) and 17 tokens (two spans: 9 and 8) on the chunked
    kernel (chunks of 16) beside one of 3 on the per-token kernel, padding; then decode,
    and a rewind into the chunked positions taking 18 new ones (a replay, then a chunk
    and 2): each step checked against the reference (`DeltaLayer.step`)."""
    layer.step([(0, 0, 21), (2, 0, 3), (3, 0, 9), (3, 9, 8)], n_pad=2)
    layer.step([(3, 17, 1), (0, 21, 1), (2, 3, 2)])
    layer.step([(0, 12, 18), (3, 18, 1)], n_pad=1)


def matches_the_per_token_kernel(chunked_layer, plain):
    """Column 1's prefill of 20 tokens on `chunked_layer` (chunks of 16) and, the same
    inputs, on `plain` (no chunks): their logs and marks equal bit for bit, their states
    within `CHUNKED_TOLERANCE` and not equal (another order of sums); then a rewind to 7
    replays the log, so both give the same outputs and states bit for bit, while a clone
    of the chunked column (to column 2) goes on as its source."""
    chunked_layer.step([(1, 0, 20)])
    plain.step([(1, 0, 20)], given=chunked_layer.given(1, 0, 20))
    for name in ("log_k", "log_v", "log_g", "log_b", "marks"):
        mine, theirs = (getattr(x, name).copy_to_host() for x in (chunked_layer, plain))
        assert np.array_equal(mine, theirs, equal_nan=True), name
    state, plain_state = chunked_layer.state.copy_to_host()[1], plain.state.copy_to_host()[1]
    assert not np.array_equal(state, plain_state)
    close(state, plain_state, "float32", "states", CHUNKED_TOLERANCE)
    chunked_layer.copy_column(1, 2)
    got = chunked_layer.step([(1, 7, 3), (2, 20, 1)])
    again = plain.step([(1, 7, 3)], given=chunked_layer.given(1, 7, 10))
    assert np.array_equal(got[:3], again[:3])
    assert np.array_equal(chunked_layer.state.copy_to_host()[1], plain.state.copy_to_host()[1])


def share_a_steps_plan(layers, steps):
    """`layers` (sharing the plan cache `steps`) each take every step of one schedule:
    prefill, decode, a base advance to 5 and a rewind; each step is planned once for all
    of them, and every layer's base moves to 5."""
    floors = np.zeros(COLS, np.int32)
    schedule = [([(0, 0, 4), (3, 0, 2)], 1), ([(0, 4, 4), (3, 2, 1)], 0),
                ([(0, 8, 1), (3, 3, 1)], 2), ([(0, 7, 2)], 0)]
    for i, (spans, n_pad) in enumerate(schedule):
        floors[0] = 5 if i >= 2 else 0
        for layer in layers:
            layer.step(spans, n_pad, floors=floors)
    assert len(steps) == len(schedule)
    assert all(layer.bp[0] == 5 for layer in layers)


def chunked_runs_after_replays(layer):
    """Chunked runs (chunks of 16, `most` 20) whose blocks first replay: the base
    advancing to a floor below p0, from the live state on; to p0 itself, the live state
    kept; a rewind to the base."""
    floors = np.zeros(COLS, np.int32)
    layer.step([(0, 0, 17), (4, 0, 3)])
    floors[0] = 17                                        # 17 - 0 <= M: the base stays
    layer.step([(0, 17, 18), (4, 3, 1)], floors=floors)
    floors[0] = 30                                        # to 30, then on from live 35
    layer.step([(0, 35, 16)], floors=floors)
    assert layer.bp[0] == 30
    floors[0] = 51                                        # to p0 = 51, the live state on
    layer.step([(0, 51, 16)], floors=floors)
    assert layer.bp[0] == 51
    layer.step([(0, 51, 17), (4, 4, 1)], floors=floors)   # a rewind to the base
