"""Position, row and floor arithmetic, and the step plan (contract §4, §5, §7).

Pure functions over integers and NumPy arrays: nothing here touches a device,
a slot state or a cache object.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, uint64

# --- the segment table the attention kernel reads: seq_info[segment, field] (int32) ---
Q_START = 0      # first token of the segment on the step's token axis
Q_LEN = 1        # tokens in the segment
COL = 2          # the sequence (its slot: the row of its page tables)
POS_START = 3    # position of its first token (pos(seq) for a first span; later ones follow)
FLAGS = 4        # bit field, see FLAG_BLOCK
SEQ_INFO_FIELDS = 5
FLAG_BLOCK = 1   # the segment is a draft block: bidirectional within itself


@njit(cache=True)
def decode_segments(seqs, pos, seq_info):
    """Fill `seq_info` [len(seqs), SEQ_INFO_FIELDS] (int32), the segment table of a step
    whose token `i` is a segment of its own, of sequence `seqs[i]` (each in `[0,
    len(pos))`) at position `pos[seqs[i]]` (a decode step): Q_START `i`, Q_LEN 1, COL
    `seqs[i]`, POS_START its position, FLAGS 0. Returns the index of the first segment at
    the furthest position, or -1 when a sequence has two tokens (not a decode step: the
    table is then left unfinished). One compiled pass; the caller allocates the table
    (an array NumPy owns, which a read-only view of can never be made writeable again)."""
    seen = np.zeros(pos.size, np.bool_)
    furthest = 0
    for i in range(seqs.size):
        seq = seqs[i]
        if seen[seq]:
            return -1
        seen[seq] = True
        seq_info[i, Q_START] = i
        seq_info[i, Q_LEN] = 1
        seq_info[i, COL] = seq
        seq_info[i, POS_START] = pos[seq]
        seq_info[i, FLAGS] = 0
        if seq_info[i, POS_START] > seq_info[furthest, POS_START]:
            furthest = i
    return furthest


def ring_rows(window: int, max_write: int, capacity: int) -> int:
    """Rows of a ring layer: `R = min(capacity, W + M - 1)`.

    A step writes all its tokens before attending, and its earliest query still
    reads back to `p - W + 1`, so `W + M - 1` positions must be live at once.
    """
    return min(capacity, window + max_write - 1)


def layer_rows(windows, max_write: int, capacity: int) -> np.ndarray:
    """`R` per layer, 0 for a flat layer (row of `p` is `p`). `windows[i]` is None or W."""
    return np.array([0 if w is None else ring_rows(w, max_write, capacity) for w in windows],
                    dtype=np.int64)


def ring_floor(high_water, rows: int, max_write: int):
    """Lowest position a sequence can resume at on one ring layer of `rows` rows.

    The layer holds `[hw - R, hw)`. Resuming at `L` needs `[L - W + 1, L)`, so
    the floor is `hw - M` once `hw > R`, else 0. Works on scalars and arrays.
    """
    hw = np.asarray(high_water, dtype=np.int64)
    floor = np.where(hw > rows, hw - max_write, 0)
    return int(floor) if floor.ndim == 0 else floor


def grown_rows(rows: int, needed_row: int, capacity: int) -> int:
    """Flat-layer growth: `min(capacity, max(needed_row + 1, 2 * rows))`, or `rows` if enough."""
    if needed_row < rows:
        return rows
    return min(capacity, max(needed_row + 1, 2 * rows))


def span_offsets(run_seqs: np.ndarray, run_lens: np.ndarray):
    """Where each span of a step starts within its sequence's tokens, and each sequence's total.

    `run_seqs`, `run_lens`: the step's spans (maximal runs of one id) in token order.
    A sequence's spans take consecutive positions in token order, so span `i`
    starts `offsets[i]` positions after `pos(run_seqs[i])`. Returns
    `(offsets [n_spans], seqs [n_seqs] (ascending), totals [n_seqs])`; vectorised,
    no loop over spans.
    """
    order = np.argsort(run_seqs, kind="stable")      # spans grouped by sequence, token order kept
    seqs = run_seqs[order]
    lens = run_lens[order]
    first = np.empty(seqs.size, dtype=bool)
    first[0] = True
    np.not_equal(seqs[1:], seqs[:-1], out=first[1:])
    before = np.cumsum(lens) - lens                  # tokens of all earlier spans (this order)
    # `before` never decreases, so carrying each group's first value forward is a running max
    group_base = np.maximum.accumulate(np.where(first, before, 0))
    offsets = np.empty_like(before)
    offsets[order] = before - group_base
    starts = np.flatnonzero(first)
    return offsets, seqs[starts], np.add.reduceat(lens, starts)


def token_tables(run_seqs: np.ndarray, run_lens: np.ndarray, seq_info: np.ndarray,
                 n_tokens: int, width: int, pad_col: int) -> tuple:
    """`(seq_cols, positions)` [width] int32 of a step: each token's sequence and position,
    from its spans (`run_seqs`, `run_lens`, in token order) and its segment table; the
    `width - n_tokens` padding tokens take sequence `pad_col` and position 0. Read-only
    (views of one frozen buffer)."""
    tables = np.empty(2 * width, dtype=np.int32)
    stage_tables(tables, run_seqs, run_lens, seq_info, n_tokens, width, pad_col, False)
    frozen(tables)
    return tables[:width], tables[width:]


@njit(cache=True)
def stage_tables(out, run_seqs, run_lens, seq_info, n_tokens, width, pad_col, with_segments):
    """Write a step's token tables into the flat int32 buffer `out` (one compiled pass):
    each token's sequence at `[0, width)`, its position at `[width, 2 * width)` (see
    `token_tables`), then, `with_segments`, the segment table's rows; returns where they
    end. (The buffer is indexed unsigned: Numba adds no negative-index fix-up to it.)"""
    columns = uint64(0)
    positions = uint64(width)
    for run in range(run_seqs.size):
        seq = run_seqs[run]
        position = seq_info[run, POS_START]
        for _ in range(run_lens[run]):
            out[columns] = seq
            out[positions] = position
            columns += uint64(1)
            positions += uint64(1)
            position += 1
    for _ in range(n_tokens, width):
        out[columns] = pad_col
        out[positions] = 0
        columns += uint64(1)
        positions += uint64(1)
    end = uint64(2 * width)
    if with_segments:
        for segment in range(seq_info.shape[0]):
            for field in range(SEQ_INFO_FIELDS):
                out[end] = seq_info[segment, field]
                end += uint64(1)
    return end


def held_positions(pos: int, high_water: int, rows: int) -> tuple[int, int]:
    """`[start, stop)` of the positions a layer still holds for a sequence.

    Flat (rows 0): `[0, pos)`. Ring: `[max(0, hw - R), pos)`.
    """
    if rows == 0:
        return 0, pos
    return max(0, high_water - rows), pos


@dataclass(frozen=True)
class Segment:
    """One span of a step: tokens `[q_start, q_start + q_len)` of `seq`, at positions from
    `pos_start`."""

    seq: int
    q_start: int
    q_len: int
    pos_start: int
    block: bool


def frozen(array: np.ndarray) -> np.ndarray:
    """`array`, made read-only: the cache's record of a step is never written after it
    is built. (Callers never see it: a `StepPlan` hands out `sealed` copies.)"""
    array.setflags(write=False)
    return array


class StepTables:
    """The cache's own record of the open step. Never handed out: callers get a `StepPlan`.

    n_tokens, width (None until prepared), seq_info [n_segments, SEQ_INFO_FIELDS],
    logit_indices [n_segments], max_q_len, max_kv_len, runs (the spans' sequences and
    lengths, in token order), and once prepared pad_col (the padding tokens' sequence: the scratch row),
    the attention routes and seq_cols / positions [width]; every array read-only. The
    kernels read the token tables staged (`stage_tables`); the arrays are built from the
    runs when first read.
    """

    __slots__ = ("n_tokens", "width", "seq_info", "logit_indices", "max_q_len", "max_kv_len",
                 "runs", "pad_col", "routes", "_tokens")

    def __init__(self, n_tokens, seq_info, logit_indices, max_q_len, max_kv_len, runs):
        self.n_tokens = n_tokens
        self.width = None
        self.seq_info = seq_info
        self.logit_indices = logit_indices
        self.max_q_len = max_q_len
        self.max_kv_len = max_kv_len
        self.runs = runs
        self.pad_col = None
        self.routes = None      # once prepared: the attention paths (`paths.StepPaths`)
        self._tokens = None

    @property
    def seq_cols(self):
        tokens = self._token_tables()
        return None if tokens is None else tokens[0]

    @property
    def positions(self):
        tokens = self._token_tables()
        return None if tokens is None else tokens[1]

    def _token_tables(self):
        if self._tokens is None and self.width is not None:
            self._tokens = token_tables(*self.runs, self.seq_info, self.n_tokens, self.width,
                                        self.pad_col)
        return self._tokens

    @property
    def launch_key(self):
        if self.routes is None:
            return None
        return (self.width, self.n_tokens) + self.routes.launch_key()


def sealed(array: np.ndarray) -> np.ndarray:
    """A copy of `array` backed by immutable bytes: no route from it (its `.base`
    included) leads to `array` or to memory anything can write."""
    return np.frombuffer(array.tobytes(), dtype=array.dtype).reshape(array.shape)


def _read(field: str, doc: str):
    def get(self):
        copies = self._copies
        value = copies.get(field)
        if value is None:
            value = getattr(self._tables, field)
            if isinstance(value, np.ndarray):
                # sealed on first access, off the hot path: the serving loop's own tables
                # stay the cache's, and what a caller is handed is its own
                value = copies[field] = sealed(value)
        return value
    return property(get, doc=doc)


class StepPlan:
    """A read-only view of a declared (and, once prepared, staged) step.

    The cache keeps its own record and never reads this object back: setting an
    attribute raises `AttributeError`, and each array is a copy backed by immutable
    bytes (made when first read), so neither it nor its `.base` can be made writeable
    or leads to the cache's state. `prepare_step` fills `width`, `seq_cols` and
    `positions`, so the plan `declare_step` returned shows them too.
    """

    __slots__ = ("_tables", "_copies")

    def __init__(self, tables: StepTables):
        object.__setattr__(self, "_tables", tables)
        object.__setattr__(self, "_copies", {})

    def __setattr__(self, name, value):
        raise AttributeError(f"StepPlan is read-only: cannot set {name!r} (the cache keeps its "
                             f"own copy of the step)")

    __delattr__ = __setattr__

    n_tokens = _read("n_tokens", "Tokens the step declared (no padding).")
    width = _read("width", "The padded width once prepared, else None.")
    seq_info = _read("seq_info", "[n_segments, SEQ_INFO_FIELDS] int32 segment table "
                                 "(fields: the module constants Q_START .. FLAGS).")
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
        return tuple(Segment(int(r[COL]), int(r[Q_START]), int(r[Q_LEN]), int(r[POS_START]),
                             bool(r[FLAGS] & FLAG_BLOCK)) for r in self._tables.seq_info)

    @property
    def n_segments(self) -> int:
        return len(self._tables.seq_info)

    def __repr__(self):
        return (f"StepPlan(n_tokens={self.n_tokens}, width={self.width}, "
                f"n_segments={self.n_segments})")
