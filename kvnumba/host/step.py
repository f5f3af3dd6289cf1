"""The open step, as the cache keeps it (`OpenStep`), and its read-only view for callers
(`StepPlan`, contract §7).

One `OpenStep` holds everything a step is between `declare_step` and its commit or
abort: what was declared (the segment table, the spans, each sequence's tokens, the
flat pages it takes), and once prepared what was staged (the width, the token tables,
the upload, the attention routes, the write and padding launches) and which layers the
data path has written. Nothing else in the cache keeps per-step state.
"""
from __future__ import annotations

import numpy as np

from ..arith.positions import SEQ, FLAG_BLOCK, FLAGS, POS_START, Q_LEN, Q_START, Segment


class OpenStep:
    """A declared (and, once `prepare`d, staged) step.

    Declared: `n_tokens`; `seq_info [n_segments, SEQ_INFO_FIELDS]` (int32, read-only);
    `logit_indices [n_segments]` (int64, read-only); `max_q_len`, `max_kv_len`;
    `spans` (the spans' sequences and lengths, int64 arrays in token order); `seqs`,
    `totals` (its distinct sequences and the tokens each writes, int64); `pages_needed`
    (new flat pages it takes). Prepared: `width`, `pad_col` (the padding tokens'
    sequence), `tokens [2 * width]` (int32, read-only: `seq_cols` then `positions`, a
    copy of what was staged), `upload` (its `upload.Upload`), `routes` (the attention
    routes, `routing.StepRoutes`), `writes` (per layer its K/V write launches, None for a
    shared layer), `zero` (the padding rows' zeroing launch or None), `kv_shapes` (per
    layer the shapes of its K and V inputs, None for a shared layer, V's None for a
    latent layer: its rows come as K alone); `written
    [n_layers]` (bool): the layers the data path has written (a shared layer, which
    stores nothing, counts as written).
    """

    __slots__ = ("n_tokens", "seq_info", "logit_indices", "max_q_len", "max_kv_len", "spans",
                 "seqs", "totals", "pages_needed", "width", "pad_col", "tokens", "upload",
                 "routes", "writes", "zero", "kv_shapes", "written", "buffers", "ran",
                 "state_plan")

    def __init__(self, n_tokens: int, seq_info, logit_indices, max_q_len: int,
                 max_kv_len: int, spans: tuple, seqs, totals, pages_needed: tuple):
        self.n_tokens, self.seq_info, self.logit_indices = n_tokens, seq_info, logit_indices
        self.max_q_len, self.max_kv_len, self.spans = max_q_len, max_kv_len, spans
        self.seqs, self.totals, self.pages_needed = seqs, totals, pages_needed
        self.width = self.pad_col = self.tokens = self.upload = self.routes = None
        self.writes = self.zero = self.kv_shapes = self.written = self.buffers = None
        self.ran = self.state_plan = None

    def prepare(self, width: int, pad_col: int, tokens: np.ndarray, upload, routes,
                writes, zero, kv_shapes: list, written: np.ndarray, buffers: tuple) -> None:
        """What `prepare_step` staged (see the class doc), by position (once a step:
        keywords would build a dict per call); `written`: the layers counted as written
        before any write (the shared ones; copied); `buffers`: the objects whose
        `addresses()` say where the buffers the launches read are (storage,
        workspace)."""
        self.width, self.pad_col, self.tokens, self.upload = width, pad_col, tokens, upload
        self.routes, self.writes, self.zero, self.kv_shapes = routes, writes, zero, kv_shapes
        self.written = written.copy()
        self.buffers = buffers

    @property
    def prepared(self) -> bool:
        return self.width is not None

    @property
    def seq_cols(self):
        return None if self.tokens is None else self.tokens[:self.width]

    @property
    def positions(self):
        return None if self.tokens is None else self.tokens[self.width:]

    @property
    def launch_key(self):
        """What the prepared step's launches depend on (`StepPlan.launch_key`), or None."""
        if self.routes is None:
            return None
        addresses = sum((holder.addresses() for holder in self.buffers), ())
        return (self.width, self.n_tokens) + self.routes.launch_key() + (addresses,)


def sealed(array: np.ndarray) -> np.ndarray:
    """A copy of `array` backed by immutable bytes: no route from it (its `.base`
    included) leads to `array` or to memory anything can write."""
    return np.frombuffer(array.tobytes(), dtype=array.dtype).reshape(array.shape)


def _read(field: str, doc: str):
    def get(self):
        copies = self._copies
        value = copies.get(field)
        if value is None:
            value = getattr(self._step, field)
            if isinstance(value, np.ndarray):
                # sealed on first access, off the hot path: the serving loop's own tables
                # stay the cache's, and what a caller is handed is its own
                value = copies[field] = sealed(value)
        return value
    return property(get, doc=doc)


class StepPlan:
    """A read-only view of a declared (and, once prepared, staged) step.

    The cache keeps its own record (`OpenStep`) and never reads this object back:
    setting an attribute raises `AttributeError`, and each array is a copy backed by
    immutable bytes (made when first read), so neither it nor its `.base` can be made
    writeable or leads to the cache's state. `prepare_step` fills `width`, `seq_cols`
    and `positions`, so the plan `declare_step` returned shows them too.
    """

    __slots__ = ("_step", "_copies")

    def __init__(self, step: OpenStep):
        object.__setattr__(self, "_step", step)
        object.__setattr__(self, "_copies", {})

    def __setattr__(self, name, value):
        raise AttributeError(f"StepPlan is read-only: cannot set {name!r} (the cache keeps its "
                             f"own copy of the step)")

    __delattr__ = __setattr__

    n_tokens = _read("n_tokens", "Tokens the step declared (no padding).")
    width = _read("width", "The padded width once prepared, else None.")
    seq_info = _read("seq_info", "[n_segments, SEQ_INFO_FIELDS] int32 segment table "
                                 "(fields: the `kvnumba.arith.positions` constants Q_START .. FLAGS).")
    logit_indices = _read("logit_indices", "[n_segments] int64: each segment's last token.")
    max_q_len = _read("max_q_len", "The longest segment (tokens).")
    max_kv_len = _read("max_kv_len", "The furthest position + 1 any segment reaches.")
    seq_cols = _read("seq_cols", "[width] int32 sequence per token (padding -> the scratch "
                                 "marker max_seqs, or -1 without a scratch page); None until "
                                 "prepared.")
    positions = _read("positions", "[width] int32 position per token (padding -> 0); None "
                                   "until prepared.")
    launch_key = _read("launch_key", "A hashable summary of the prepared step's kernel "
                                     "launches (width, the decode and prefill groups, the "
                                     "decode chunk counts, where the buffers they use are); "
                                     "None until prepared. A CUDA graph captured from one "
                                     "step replays a later step correctly when the keys are "
                                     "equal.")

    @property
    def segments(self) -> tuple:
        """`Segment` records of the segment table (built on access, off the hot path)."""
        return tuple(Segment(int(r[SEQ]), int(r[Q_START]), int(r[Q_LEN]), int(r[POS_START]),
                             bool(r[FLAGS] & FLAG_BLOCK)) for r in self._step.seq_info)

    @property
    def n_segments(self) -> int:
        return len(self._step.seq_info)

    def __repr__(self):
        return (f"StepPlan(n_tokens={self.n_tokens}, width={self.width}, "
                f"n_segments={self.n_segments})")
