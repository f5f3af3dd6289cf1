"""`BatchedSequenceCache`: many sequences in shared page pools, behind the BatchControl face.

Host planning (declare/prepare/commit, validated a whole batch at a time through
the compiled slot machine) is kept apart from device work (the write, copy and
attention kernels, all launched on the cache's stream).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from statemachines import CLONE_SOURCE_STATES

from .args import as_finite, as_id, as_ids, as_int, describe, is_int
from .config import CacheConfig
from .arrays import Result, check, check_out, device_view
from .device import allocating, announce, cuda, device_id, on_its_device, placed_on
from .errors import (CacheFullError, CapacityError, ConfigError, OwnerRunError, PositionError,
                     RingFloorError, ShapeError, StepProtocolError)
from .kernels import padding, write
from .kernels.launch import device_pointer, no_output
from .pages import flashinfer_tables
from .plan import (COL, FLAG_BLOCK, FLAGS, POS_START, Q_LEN, Q_START, SEQ_INFO_FIELDS, StepPlan,
                   StepTables, decode_segments, frozen, held_positions,
                   ring_floor, span_offsets, stage_tables)
from .paths import AttentionPaths, tables_size
from .pool import Pool
from .slots import SlotState, SlotTable, StepMachine, StepState, state_refusal
from .staging import Staging

_IO_DTYPES = ("float16", "float32", "bfloat16")
_ATTEND_KEYWORDS = frozenset({"out", "scale", "softcap", "lse"})
_LSE_DTYPES = ("float32",)
_NO_SOFTCAP = np.float32(0.0)
_max = np.maximum.reduce
_CLONE_SOURCES = tuple(SlotState[s.upper()] for s in CLONE_SOURCE_STATES)


#: int32 entries a clone's upload starts with (its table patches and page pairs); grown
#: on demand
CLONE_TABLES = 4096


class PageDemand(NamedTuple):
    """What a step would take from the flat layers' pool (`page_demand`): `needed` new
    pages (copy-on-write pages included) and `free`, the pages it can still give under
    `max_pages`; `declare_step` refuses the step when `needed > free`."""

    needed: int
    free: int


class BatchedSequenceCache:
    """A KV cache whose sequences share every layer's page pool, each through its page
    tables.

    Storage per layer: K and V pools `[n_pages, page_size, n_kv_heads, head_dim]`
    (`layer_data`). A sequence slot's flat-layer page table lists the pages of its
    positions in order (position `p`: slot `p % page_size` of its page `p //
    page_size`); its ring-layer tables the `ceil(R / page_size)` pages of each ring
    (position `p`: ring slot `p % R`). Flat pages are taken by `prepare_step` as
    positions need them and shared by `seq_clone` (copy-on-write); ring pages come with
    `seq_new`. Page 0 of every pool is scratch for padding tokens.

    `device`: the CUDA device holding the storage, an int id or a Numba device (None:
    the current one; the simulator has device 0 only; another id is `ConfigError`).
    Every launch and copy goes to that device (on a machine with several, each call
    that launches makes it current for its duration). An input or
    `out` on another device (a PyTorch tensor by its `.device`, e.g. a "meta" tensor,
    or an array naming its `device`) is refused (`ShapeError`) before any launch.

    `stream`: the CUDA stream every launch and copy goes on (Numba's default if None).

    `scratch_column=False` builds pools without the scratch page: padding tokens get
    sequence -1 and are written nowhere. `SequenceCache` is built this way, so its
    storage holds its one sequence and nothing else.
    """

    def __init__(self, config: CacheConfig, device=None, stream=None, *,
                 scratch_column: bool = True):
        if not isinstance(config, CacheConfig):
            raise ConfigError(f"config: expected a CacheConfig, got {type(config).__name__}")
        self.device = device_id(device)
        announce()
        self.config = config
        with placed_on(self.device):
            self._build(config, stream, scratch_column)

    def _build(self, config: CacheConfig, stream, scratch_column: bool) -> None:
        """`__init__` on the cache's device: its stream, tables and storage."""
        self.stream = stream if stream is not None else cuda.default_stream()
        n = config.max_seqs
        self._n = n
        self._pad_col = n if scratch_column else -1
        self._step = StepMachine()
        with allocating(f"BatchedSequenceCache({n} sequences, capacity {config.capacity}, "
                        f"max_step {config.max_step})"):
            self._slots = SlotTable(n)
            self._pool = Pool(config, n + 1 if scratch_column else n, scratch_column,
                              self.stream)
            self._staging = Staging(tables_size(config), self.stream)
            self._clone_staging = Staging(CLONE_TABLES, self.stream)
            self._paths = AttentionPaths(config, self.stream,
                                         {kind.rows: kind.pages for kind in self._pool.kinds},
                                         self._pool.page_bits)
            # read-only ramps reused by every decode step (no per-step allocation); a step
            # whose every token is its own run of a distinct sequence has at most this many
            ramp = min(config.max_step, n)
            self._arange = frozen(np.arange(ramp, dtype=np.int64))
            self._ones = frozen(np.ones(ramp, dtype=np.int64))
        self._tables: StepTables | None = None   # the open step, as the cache keeps it
        self._plan: StepPlan | None = None       # its read-only view, handed to callers
        self._seq_totals = None   # (its sequences, the tokens each writes) for commit / abort
        self._written = np.zeros(config.n_layers, dtype=bool)  # layers the step has written
        self._routes = None    # the prepared step's attention paths (`paths.StepPaths`)
        self._writes = None    # the K/V writes (`write.WriteRun`) of the last prepared step
        self._zero = None      # its padding rows' zeroing launch, or None without padding
        self._pages_needed = 0  # new flat pages the declared step takes
        # what a launch needs of each layer: (ring rows R or 0, window or 0, device table)
        self._layer_geometry = [(int(rows), spec.window or 0, kind.pages) for rows, spec, kind
                                in zip(self._pool.ring_rows, config.layers,
                                       self._pool.kind_of)]
        # the kernels take scale and softcap as float32: the defaults converted once
        self._default_scale = np.float32(1.0 / math.sqrt(config.head_dim))
        self._kv_shape = None   # the prepared step's K/V shape [width, n_kv_heads, head_dim]
        self._kv_run = config.n_kv_heads * config.head_dim   # elements of a token's K (or V)
        self._floor_rows = floor_binding(config)[0]   # R of the ring layer that sets floors

    # ------------------------------------------------------------------ queries
    @property
    def max_seqs(self) -> int:
        """Sequence slots handed out (ids `0 .. max_seqs - 1`)."""
        return self._n

    @property
    def step_state(self) -> StepState:
        return self._step.state

    @property
    def plan(self) -> StepPlan | None:
        """The open step's plan, or None between steps."""
        return self._plan

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage allocated over all layers (every pool's pages)."""
        return self._pool.nbytes

    @property
    def nbytes_held(self) -> int:
        """Bytes of the pages live sequences hold over all layers, a page shared by
        clones counted once (the scratch page not at all)."""
        return self._pool.nbytes_held

    @property
    def page_size(self) -> int:
        return self.config.page_size

    def layer_data(self, layer: int):
        """`(k, v)` page pools of `layer`, `[n_pages, page_size, n_kv_heads, head_dim]`
        device arrays (they move when the pool grows)."""
        layer = self._layer(layer, "layer_data")
        return self._pool.k[layer], self._pool.v[layer]

    def pool_pages(self) -> tuple:
        """One `PoolPages` per layer kind (flat layers first, then each ring size): its
        layers, pages in use, free (under `max_pages`), allocated and `max_pages`."""
        return tuple(kind.report() for kind in self._pool.kinds)

    def page_demand(self, seq_ids) -> PageDemand:
        """How many new flat pages `declare_step(seq_ids)` would take and how many the
        pool can give, without declaring (ids as `declare_step` takes them; ring pages
        come with `seq_new`, never with a step). Changes nothing."""
        ids = as_ids(seq_ids, self._n, "page_demand seq_ids")
        flat = self._pool.flat
        if flat is None or ids.size == 0:
            return PageDemand(0, 0 if flat is None else flat.available)
        counts = np.bincount(ids, minlength=self._n)
        seqs = np.flatnonzero(counts)
        return PageDemand(self._pool.step_demand(seqs, counts[seqs], self._slots.pos),
                          flat.available)

    def page_table(self, seq: int, layer: int) -> np.ndarray:
        """A host copy of the page ids `seq` holds on `layer`'s kind, in order (flat:
        position `p` in page `[p // page_size]`; ring: ring slot `s` in `[s //
        page_size]`)."""
        seq = self._id(seq, "page_table")
        kind = self._pool.kind_of[self._layer(layer, "page_table")]
        return kind.table[seq, :kind.held[seq]].copy()

    def paged_kv(self, seqs=None) -> tuple:
        """The flat layers' pages of sequences `seqs` in FlashInfer's paged-KV format:
        `(kv_indptr [n + 1], kv_indices, kv_last_page_len [n])`, int32 host arrays over
        any flat layer's pools (`layer_data`, NHD layout; all flat layers share page ids).

        `seqs` None: the prepared step's sequences, in the order of their first spans,
        each described through the positions the step writes (`pos` + its tokens);
        given (ids), between steps or in a step, each through the positions it holds now.
        """
        flat = self._pool.flat
        if flat is None:
            raise ConfigError("paged_kv: the cache has no flat layers (ring layers are "
                              "rings of pages, not FlashInfer's paged format)")
        pos = self._slots.pos
        if seqs is None:
            self._require_prepared("paged_kv")
            run_seqs = self._tables.runs[0]
            order = np.unique(run_seqs, return_index=True)[1]
            ids = run_seqs[np.sort(order)]
            written = np.zeros(self._n, np.int64)
            written[self._seq_totals[0]] = self._seq_totals[1]   # its sequences are distinct
            lengths = pos[ids] + written[ids]
        else:
            ids = as_ids(seqs, self._n, "paged_kv seqs")
            lengths = pos[ids]
        return flashinfer_tables(flat.table, ids, lengths.astype(np.int64), self.page_size)

    def pos(self, seq: int) -> int:
        """Positions the sequence holds (the next token takes this position)."""
        return int(self._slots.pos[self._id(seq, "pos")])

    def high_water(self, seq: int) -> int:
        """Most positions ever written into the sequence's storage since it was claimed."""
        return int(self._slots.high_water[self._id(seq, "high_water")])

    def state(self, seq: int) -> SlotState:
        return SlotState(int(self._slots.state[self._id(seq, "state")]))

    def floor(self, seq: int) -> int:
        """Lowest position the sequence can rewind or be cloned to (0 without ring layers)."""
        return self._floor(self._id(seq, "floor"))

    def _floor(self, seq: int) -> int:
        if not self._floor_rows:
            return 0
        return ring_floor(int(self._slots.high_water[seq]), self._floor_rows,
                          self.config.max_write)

    # ------------------------------------------------------------------ sequence verbs
    @on_its_device
    def seq_new(self) -> int:
        """Claim the lowest free slot: state CLAIMED, pos 0, high-water 0, and its ring
        pages (`CapacityError`, nothing claimed, when a ring pool cannot give them)."""
        self._step.require_idle("seq_new")
        seq = self._lowest_free("seq_new")
        nxt = self._slots.check_one("seq_new", seq)
        self._pool.claim_rings(seq, "seq_new")
        self._slots.apply("seq_new", seq, nxt)
        self._slots.pos[seq] = self._slots.high_water[seq] = 0
        return seq

    def seq_rm(self, seq: int) -> None:
        """Free the sequence and its pages: state FREE, pos 0, high-water 0 (bytes are not
        zeroed; a page shared with a clone stays with the clone)."""
        self._step.require_idle("seq_rm")
        seq = self._id(seq, "seq_rm")
        nxt = self._slots.check_one("seq_rm", seq)
        self._pool.release(seq)
        self._slots.apply("seq_rm", seq, nxt)
        self._slots.pos[seq] = self._slots.high_water[seq] = 0

    @on_its_device
    def seq_clone(self, src: int, upto: int | None = None) -> int:
        """A new sequence in the lowest free slot holding `src`'s first `upto` positions
        (default all).

        Flat layers share `src`'s pages wholly below `upto` and copy the one that
        straddles it; ring layers get pages of their own, copied. Neither sequence sees
        the other's later writes (a write into a shared page copies it first). The clone
        is COMMITTED with `pos = upto` and `src`'s high-water. Refused: `src` not
        COMMITTED/REWOUND, `upto` outside `[max(1, floor), pos]`, no free slot, a pool
        that cannot give the clone's new pages (`CapacityError`).
        """
        self._step.require_idle("seq_clone")
        src = self._id(src, "seq_clone")
        state = SlotState(int(self._slots.state[src]))
        if state not in _CLONE_SOURCES:
            raise state_refusal(src, state, "seq_clone from it",
                                [s.name for s in _CLONE_SOURCES])
        pos = int(self._slots.pos[src])
        keep = pos if upto is None else as_int(upto, "seq_clone upto")
        if not 1 <= keep <= pos:
            raise PositionError(f"seq_clone: upto={keep} outside [1, {pos}] for sequence {src}")
        self._check_floor(src, keep, "seq_clone")
        dst = self._lowest_free("seq_clone")
        nxt = self._slots.check_one("clone_into", dst)
        high_water = int(self._slots.high_water[src])
        self._pool.clone(src, dst, keep, self._clone_staging, "seq_clone")
        self._slots.apply("clone_into", dst, nxt)
        self._slots.pos[dst] = keep
        self._slots.high_water[dst] = high_water
        return dst

    def rewind(self, seq: int, position: int) -> None:
        """Move the sequence back to `position` (`floor <= position <= pos`); no bytes move.
        Its flat pages wholly at or past `position` are released."""
        self._step.require_idle("rewind")
        seq = self._id(seq, "rewind")
        nxt = self._slots.check_one("rewind", seq)
        position = as_int(position, "rewind position")
        pos = int(self._slots.pos[seq])
        if position > pos or position < 0:
            raise PositionError(f"rewind: position {position} outside [{self._floor(seq)}, {pos}] "
                                f"for sequence {seq}")
        self._check_floor(seq, position, "rewind")
        self._pool.rewind(seq, position)
        self._slots.apply("rewind", seq, nxt)
        self._slots.pos[seq] = position

    # ------------------------------------------------------------------ step protocol
    def declare_step(self, seq_ids, *, blocks=()) -> StepPlan:
        """Open a step: one sequence id per token, in token order.

        Each maximal run of one id is a span and one attention segment. A sequence
        may have several spans (`[a, b, a]`): they take consecutive positions in
        token order, and a later span's queries see the keys the earlier ones write
        in the same step. `blocks`: sequences whose tokens are a bidirectional draft
        block; a block owner must be exactly one span. Refusals, in order: an open
        step; an unknown or free id; a block owner in more or fewer than one span; a
        sequence writing more than `max_write` tokens (all its spans); `pos` + its
        tokens past `capacity`; more than `max_step` tokens. The cache copies
        `seq_ids` (the caller may reuse its buffer at once) and returns a read-only
        `StepPlan`.
        """
        nxt_step = self._step.check("declare", "declare_step")
        ids = as_ids(seq_ids, self._n, "declare_step seq_ids")
        if ids.size == 0:
            raise ShapeError("declare_step: seq_ids must be a non-empty 1-D sequence of ints "
                             "(one sequence id per token)")
        block_ids = self._block_ids(blocks)
        furthest = -1
        if ids.size <= self._arange.size:     # a decode step, unless a sequence repeats
            seq_info = np.empty((ids.size, SEQ_INFO_FIELDS), dtype=np.int32)
            furthest = decode_segments(ids, self._slots.pos, seq_info)
        if furthest >= 0:
            tables = self._declare_tokens(ids, block_ids, seq_info, furthest)
        else:
            tables = self._declare_spans(ids, block_ids)
        self._step.apply("declare", nxt_step)
        self._tables = tables
        self._plan = StepPlan(tables)
        return self._plan

    def _declare_tokens(self, ids, block_ids, seq_info, furthest: int) -> StepTables:
        """`declare_step` of a step whose every token is a span of its own sequence (a
        decode step; `decode_segments` made its segment table): its refusals, then the
        slots moved and the step's tables."""
        n_tokens = ids.size
        ones = self._ones[:n_tokens]
        self._slots.require("declare", ids)
        if block_ids is not None:
            flags = self._block_flags(block_ids, ids, self._arange[:n_tokens], ones)
        max_kv_len = int(seq_info[furthest, POS_START]) + 1
        if max_kv_len > self.config.capacity:
            self._refuse_capacity(ids, ones, furthest)
        self._check_step_tokens(n_tokens)
        self._check_pages(ids, ones)
        if block_ids is not None:
            seq_info[:, FLAGS] = flags
        self._slots.declare(ids)
        self._seq_totals = (ids, ones)
        # the logit rows are the tokens: a view of the read-only ramp
        return StepTables(n_tokens, frozen(seq_info), self._arange[:n_tokens], 1, max_kv_len,
                          (ids, ones))

    def _declare_spans(self, ids, block_ids) -> StepTables:
        """`declare_step` of any step: its spans (maximal runs of one id), their refusals,
        then the slots moved and the step's tables."""
        n_tokens = ids.size
        boundary = ids[1:] != ids[:-1]
        run_starts = np.concatenate(([0], np.flatnonzero(boundary) + 1))
        run_seqs = ids[run_starts]
        run_lens = np.diff(np.append(run_starts, n_tokens))
        self._slots.require("declare", run_seqs)
        flags = self._block_flags(block_ids, run_seqs, run_starts, run_lens)
        pos_start = self._slots.pos.take(run_seqs)
        if _max(np.bincount(run_seqs, minlength=self._n)) == 1:    # one span per sequence
            seqs, totals = run_seqs, run_lens
        else:
            offsets, seqs, totals = span_offsets(run_seqs, run_lens)
            pos_start = pos_start + offsets
        max_kv_len = self._check_totals(seqs, totals)
        self._check_step_tokens(n_tokens)
        self._check_pages(seqs, totals)
        seq_info = np.empty((run_seqs.size, SEQ_INFO_FIELDS), dtype=np.int32)
        seq_info[:, Q_START] = run_starts
        seq_info[:, Q_LEN] = run_lens
        seq_info[:, COL] = run_seqs
        seq_info[:, POS_START] = pos_start
        seq_info[:, FLAGS] = flags
        self._slots.declare(seqs)
        self._seq_totals = (seqs, totals)
        return StepTables(n_tokens, frozen(seq_info), frozen(run_starts + run_lens - 1),
                          int(_max(run_lens)), max_kv_len, (run_seqs, run_lens))

    @on_its_device
    def prepare_step(self, width: int | None = None) -> StepPlan:
        """Stage the declared step at `width` tokens (default: no padding).

        Takes the flat pages the step's positions need (growing the pool when allowed,
        transactionally: a failed growth is `CapacityError` with the step still
        declared), replaces each shared page the step writes into by a copy
        (copy-on-write), builds `seq_cols` / `positions` (padding -> the scratch row,
        position 0) and uploads them with the segment table and the page-table changes
        in one host-to-device copy, without a host sync; the table patches and the
        copies run on the device before any write.
        """
        nxt_step = self._step.check("prepare", "prepare_step")
        plan = self._tables
        width = plan.n_tokens if width is None else as_int(width, "prepare_step width")
        if not plan.n_tokens <= width <= self.config.max_step:
            raise CapacityError(f"prepare_step: width {width} outside [n_tokens "
                                f"{plan.n_tokens}, max_step {self.config.max_step}]")
        patches, copies = self._pool.claim_step(*self._seq_totals, self._slots.pos,
                                                self._pages_needed, "prepare_step")
        info, staging = plan.seq_info, self._staging
        # each token's column and position, then the segment table, then the paths' plans
        host = staging.begin(2 * width + info.size)
        at = stage_tables(host, *plan.runs, info, plan.n_tokens, width, self._pad_col, True)
        routes, end = self._paths.plan(info, plan.max_q_len, plan.max_kv_len, staging,
                                       info_at=2 * width, at=at)
        patches_at = end
        if patches is not None:
            end = staging.put(patches, end)
        copies_at = end
        if copies is not None:
            end = staging.put(copies, end)
        staging.send(end)
        tables, stream = staging.device, self.stream
        self._pool.run_step_tables(tables, patches_at, 0 if patches is None else len(patches),
                                   copies_at, 0 if copies is None else len(copies))
        routes.buffers = self._buffer_addresses
        plan.routes = self._routes = routes
        writes = self._writes      # the last step's, with its launches, if it fits this one
        if writes is None or writes.width != width or writes.tables is not tables:
            self._writes = write.prepare(tables, width, self._kv_run,
                                         self.config.storage_dtype, self._pool.page_bits,
                                         stream)
        self._zero = padding.prepare(width, plan.n_tokens, stream)
        plan.width, plan.pad_col = width, self._pad_col
        self._kv_shape = (width, self.config.n_kv_heads, self.config.head_dim)
        self._written.fill(False)
        self._step.apply("prepare", nxt_step)
        return self._plan

    def _buffer_addresses(self) -> tuple:
        """Where the buffers the launches use besides their inputs are: the storage
        groups, the step tables and the attention partials (0 while there are none)."""
        workspace = self._paths.workspace
        return tuple(0 if array is None else device_pointer(array) for array in
                     (*self._pool.groups(), self._pool.device_tables, self._staging.device,
                      workspace.part_acc, workspace.part_ml))

    def commit_step(self) -> None:
        """Advance every sequence of the step by all its spans' tokens; COMMITTED.

        A step that wrote some layers and not others is refused (`StepProtocolError`
        naming the unwritten layers; `abort_step` discards it); a step that wrote no
        layer commits positions only.
        """
        nxt_step = self._step.check("commit", "commit_step")
        written = self._written
        if 0 < np.count_nonzero(written) < written.size:
            unwritten = np.flatnonzero(~written).tolist()
            raise StepProtocolError(f"commit_step: the step wrote layers "
                                    f"{np.flatnonzero(written).tolist()} but not {unwritten}; "
                                    f"write every layer before commit_step(), or "
                                    f"abort_step() to discard the step")
        self._slots.advance("commit", *self._seq_totals)
        self._close(nxt_step, "commit")

    def abort_step(self) -> None:
        """Return every sequence of the step to its earlier state; nothing advances.

        After `prepare_step` the kernels may have written, so each sequence's
        high-water rises to the end of its last span, and the flat pages the step took
        past its positions are released.
        """
        nxt_step = self._step.check("abort", "abort_step")
        seqs, totals = self._seq_totals
        self._slots.apply("abort", seqs, self._slots.check("abort", seqs))
        if self._step.index == StepState.PREPARED:
            hw = self._slots.high_water
            hw[seqs] = np.maximum(hw[seqs], self._slots.pos[seqs] + totals)
            self._pool.abort(seqs, self._slots.pos)
        self._close(nxt_step, "abort")

    def check_declarable(self, seqs: np.ndarray) -> None:
        """Raise what `declare_step` would raise first for sequences `seqs` (an int64 array of
        valid ids): an open step, then a free or busy sequence. Changes nothing."""
        self._step.check("declare", "declare_step")
        self._slots.check("declare", seqs)

    def _close(self, nxt_step, event):
        self._step.apply(event, nxt_step)
        self._tables = self._plan = self._routes = self._zero = None
        self._seq_totals = None

    # ------------------------------------------------------------------ data path
    @on_its_device
    def write(self, layer: int, k, v) -> None:
        """Write the prepared step's K and V `[width, n_kv_heads, head_dim]` into `layer`."""
        self._launch_write(self._write_args(layer, k, v), k, v)

    @on_its_device
    def attend(self, layer: int, q, out=None, *, scale=None, softcap=None, lse=None):
        """Attention of the prepared step's queries over their own sequences' histories.

        q: `[width, n_q_heads, head_dim]`, `n_q_heads` a multiple of `n_kv_heads`;
        float16, float32 or bfloat16 (NumPy as `ml_dtypes.bfloat16`, or PyTorch).
        Returns `out` if given, else a new array of q's kind and dtype: a tensor on q's
        device for a PyTorch q, NumPy for NumPy, a device array for a device array.
        Padding rows are zero. The step must have
        written `layer` first (`write` or `update_and_attend`); `scale` (default
        `1/sqrt(head_dim)`) and `softcap` (None or > 0) must be finite.

        `lse`: None, or a float32 `[width, n_q_heads]` array of q's kinds (NumPy, PyTorch,
        device) that receives each row's natural-log log-sum-exp of its final scores
        (scaled, then soft-capped), `-inf` on padding rows: FlashAttention's convention,
        so that attentions over parts of a history can be merged.
        """
        args = self._attend_args(layer, q, out, scale, softcap, lse)
        if not self._written[args[0]]:
            raise StepProtocolError(f"attend: the prepared step has not written layer "
                                    f"{args[0]}'s K/V; call write({args[0]}, k, v) or "
                                    f"update_and_attend first")
        return self._launch_attend(*args)

    @on_its_device
    def update_and_attend(self, layer: int, q, k, v, **kw):
        """`write(layer, k, v)` then `attend(layer, q, **kw)`.

        Every argument of both halves is checked before anything is written.
        """
        if not _ATTEND_KEYWORDS.issuperset(kw):
            raise ShapeError(f"update_and_attend: unexpected keyword arguments "
                             f"{sorted(set(kw) - _ATTEND_KEYWORDS)} (allowed: out, scale, "
                             f"softcap, lse)")
        layer = self._write_args(layer, k, v)
        attend_args = self._attend_inputs(q, kw.get("out"), kw.get("scale"), kw.get("softcap"),
                                          kw.get("lse"))
        self._launch_write(layer, k, v)
        return self._launch_attend(layer, *attend_args)

    def _write_args(self, layer, k, v) -> int:
        """`layer` as an index, once the step is prepared and k and v fit it."""
        self._require_prepared("write")
        layer = self._layer(layer, "write")
        try:
            check("k", k, self._kv_shape, _IO_DTYPES, self.device)
            check("v", v, self._kv_shape, _IO_DTYPES, self.device)
        except ShapeError as exc:
            raise ShapeError(f"{exc}{self._width_hint(k, v)}") from None
        return layer

    def _launch_write(self, layer, k, v) -> None:
        pool, stream = self._pool, self.stream
        ring_rows, _, pages = self._layer_geometry[layer]
        self._writes(pool.k_slots[layer], pool.v_slots[layer], device_view(k, stream),
                     device_view(v, stream), ring_rows, pages)
        self._written[layer] = True

    def _attend_args(self, layer, q, out, scale, softcap, lse) -> tuple:
        self._require_prepared("attend")
        return (self._layer(layer, "attend"), *self._attend_inputs(q, out, scale, softcap, lse))

    def _attend_inputs(self, q, out, scale, softcap, lse) -> tuple:
        """`(q, out, scale, softcap, lse)` checked, the defaults filled in."""
        shape = self._check_q(q)
        if out is not None:
            check_out("out", out, shape, _IO_DTYPES, self.device)
        if lse is not None:
            check_out("lse", lse, shape[:2], _LSE_DTYPES)
        scale = self._default_scale if scale is None else as_finite(scale, "attend: scale")
        softcap = _NO_SOFTCAP if softcap is None else as_finite(softcap, "attend: softcap",
                                                                positive=True)
        return q, out, scale, softcap, lse

    def _launch_attend(self, layer, q, out, scale, softcap, lse):
        stream = self.stream
        result = Result(q, out, tuple(q.shape), stream)
        row_lse = None if lse is None else Result(q, lse, tuple(q.shape[:2]), stream)
        lse_device = no_output() if row_lse is None else row_lse.device
        if self._zero is not None:
            self._zero(result.device, lse_device)
        ring_rows, window, pages = self._layer_geometry[layer]
        self._paths.run(self._routes, device_view(q, stream), self._pool.k_slots[layer],
                        self._pool.v_slots[layer], self._staging.device, result.device,
                        lse_device, ring_rows=ring_rows, window=window, pages=pages,
                        scale=scale, softcap=softcap, stream=stream)
        if row_lse is not None:
            row_lse.value()          # a host `lse` is filled from the device
        return result.value()

    @on_its_device
    def sequence_kv(self, seq: int, layer: int):
        """`(positions, k, v)`: host copies of what `layer` still holds for `seq`, in order.

        Flat layers: positions `[0, pos)`; ring layers: `[max(0, hw - R), pos)`.
        """
        seq = self._id(seq, "sequence_kv")
        layer = self._layer(layer, "sequence_kv")
        ring = int(self._pool.ring_rows[layer])
        start, stop = held_positions(int(self._slots.pos[seq]),
                                     int(self._slots.high_water[seq]), ring)
        positions = np.arange(start, stop, dtype=np.int64)
        rows = positions % ring if ring else positions
        slots = self._pool.slots(layer, seq, rows)
        host = self.config.np_dtype
        k, v = (store.copy_to_host(stream=self.stream)[slots].view(host)
                for store in (self._pool.k_slots[layer], self._pool.v_slots[layer]))
        return positions, k, v

    # ------------------------------------------------------------------ checks
    def _id(self, seq, verb: str) -> int:
        return as_id(seq, self._n, verb)

    def _layer(self, layer, verb: str) -> int:
        n_layers = len(self._layer_geometry)
        if type(layer) is int and 0 <= layer < n_layers:    # the usual call: nothing to convert
            return layer
        if not is_int(layer):
            raise ShapeError(f"{verb}: layer must be an int index in [0, {n_layers}), got "
                             f"{describe(layer)}")
        if not 0 <= layer < n_layers:
            raise ShapeError(f"{verb}: layer {int(layer)} is outside [0, {n_layers})")
        return int(layer)

    def _check_q(self, q) -> tuple:
        """q's shape `[width, n_q_heads, head_dim]`, or `ShapeError` (kind and dtype first,
        then the rank, the heads and the shape)."""
        check("q", q, None, _IO_DTYPES, self.device)
        shape = tuple(q.shape)
        if len(shape) != 3:
            raise ShapeError(f"q: expected rank 3 [width, n_q_heads, head_dim], got shape "
                             f"{shape}")
        n_q_heads, n_kv_heads = shape[1], self.config.n_kv_heads
        if n_q_heads < 1 or n_q_heads % n_kv_heads:
            raise ShapeError(f"q: n_q_heads={n_q_heads} must be a positive multiple of "
                             f"n_kv_heads={n_kv_heads} (query head h reads kv head "
                             f"h // (n_q_heads // n_kv_heads))")
        want = (self._kv_shape[0], n_q_heads, self.config.head_dim)
        if shape != want:
            raise ShapeError(f"q: expected shape {want}, got {shape}{self._width_hint(q)}")
        return shape

    def _width_hint(self, *arrays) -> str:
        """Why an array with one row per token does not fit a padded step, or ''."""
        n_tokens, width = self._tables.n_tokens, self._kv_shape[0]
        if width == n_tokens or not any(getattr(a, "shape", (None,))[:1] == (n_tokens,)
                                        for a in arrays):
            return ""
        return (f"; the step was prepared with prepare_step(width={width}) for {n_tokens} "
                f"tokens: pass {width} rows (the last {width - n_tokens} are padding)")

    def _require_prepared(self, verb: str) -> None:
        if self._step.index != StepState.PREPARED:
            raise StepProtocolError(f"{verb}: the step is {self._step.state.name}; data moves "
                                    f"only inside a prepared step (declare_step, then "
                                    f"prepare_step)")

    def _lowest_free(self, verb: str) -> int:
        free = np.flatnonzero(self._slots.state == SlotState.FREE)
        if free.size == 0:
            raise CacheFullError(f"{verb}: all {self._n} sequence slots are in use")
        return int(free[0])

    def _check_floor(self, seq: int, target: int, verb: str) -> None:
        if target < self._floor(seq):
            raise floor_refusal(verb, seq, target, int(self._slots.high_water[seq]),
                                self.config)

    def _check_totals(self, seqs, totals) -> int:
        """Refuse a sequence writing more than max_write tokens, or reaching past capacity;
        returns the furthest end."""
        if _max(totals) > self.config.max_write:
            i = int(np.argmax(totals))
            raise CapacityError(f"declare_step: sequence {int(seqs[i])} writes "
                                f"{int(totals[i])} tokens, more than max_write "
                                f"{self.config.max_write}; {split_hint(self.config)}")
        ends = self._slots.pos[seqs] + totals
        furthest = int(_max(ends))
        if furthest > self.config.capacity:
            self._refuse_capacity(seqs, totals, int(np.argmax(ends)))
        return furthest

    def _refuse_capacity(self, seqs, totals, i: int):
        raise CapacityError(f"declare_step: sequence {int(seqs[i])} at pos "
                            f"{int(self._slots.pos[seqs[i]])} + {int(totals[i])} tokens "
                            f"exceeds capacity {self.config.capacity}")

    def _check_pages(self, seqs, totals) -> None:
        """Refuse a step whose new flat pages do not fit under `max_pages`; keeps the
        count for `prepare_step`."""
        needed = self._pool.step_demand(seqs, totals, self._slots.pos)
        if needed:
            self._pool.flat.require(needed, "declare_step")
        self._pages_needed = needed

    def _check_step_tokens(self, n_tokens: int) -> None:
        if n_tokens > self.config.max_step:
            raise CapacityError(f"declare_step: {n_tokens} tokens exceed max_step "
                                f"{self.config.max_step}")

    def _block_ids(self, blocks):
        """`blocks` as a fresh int64 id array, or None for no blocks."""
        if blocks is None or (isinstance(blocks, (tuple, list)) and not blocks):
            return None
        ids = as_ids(blocks, self._n, "declare_step blocks")
        return ids if ids.size else None

    def _block_flags(self, block_ids, run_seqs, run_starts, run_lens) -> np.ndarray | int:
        """FLAG_BLOCK for the spans `block_ids` names; each must name exactly one span."""
        if block_ids is None:
            return 0
        spans_per_seq = np.bincount(run_seqs, minlength=self._n)
        wrong = block_ids[spans_per_seq[block_ids] != 1]
        if wrong.size:
            seq = int(wrong[0])
            runs = [(int(a), int(a + n)) for a, n, q in zip(run_starts, run_lens, run_seqs)
                    if q == seq]
            if not runs:
                raise OwnerRunError(f"declare_step: blocks name sequence {seq}, which has no "
                                    f"run in this step; a draft block must be exactly one run")
            raise OwnerRunError(f"declare_step: block owner {seq} has {len(runs)} runs {runs} "
                                f"(token ranges); a draft block must be exactly one run")
        marked = np.zeros(self._n, dtype=np.int32)
        marked[block_ids] = FLAG_BLOCK
        return marked[run_seqs]


def floor_binding(config: CacheConfig) -> tuple[int, int]:
    """`(R, layer)` of the ring layer whose floor binds, or `(0, -1)` without ring layers.

    Every ring layer's floor is `hw - M` once `hw > R`: the one with the fewest rows
    wraps first, and its floor is the sequence's (contract §5).
    """
    rows = config.ring_rows()
    rings = [(int(r), i) for i, r in enumerate(rows) if r]
    return min(rings) if rings else (0, -1)


def floor_refusal(verb: str, seq: int, target: int, high_water: int,
                  config: CacheConfig) -> RingFloorError:
    """The `RingFloorError` of a rewind or clone of sequence `seq` to `target`, below its
    floor: names the target, the floor, and the ring layer that sets it (its window and
    rows, what it still holds)."""
    rows, layer = floor_binding(config)
    floor = ring_floor(high_water, rows, config.max_write)
    window = config.layers[layer].window
    return RingFloorError(f"{verb}: target position {target} is below the floor {floor} of "
                          f"sequence {seq}: ring layer {layer} (window {window}, {rows} rows) "
                          f"holds only positions [{high_water - rows}, {high_water}) at "
                          f"high-water {high_water}, and resuming at p needs "
                          f"[p - {window - 1}, p); go back no further than {floor}")


def split_hint(config: CacheConfig) -> str:
    """What to do with an input longer than `max_write`."""
    return (f"split it into chunks of at most max_write={config.max_write} tokens, one "
            f"step each")
