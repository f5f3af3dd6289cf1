"""`BatchedSequenceCache`: many sequences in shared page pools, behind the BatchControl
face (contract §7) and the data path of a prepared step (§8).

The face composes the parts and holds none of their logic: the slot table and step
machine (`slots`), the pools (`pool`: host accounting and device storage), the step
declarer (`declare`), the open step (`step.OpenStep`), the step's upload (`upload`),
the attention routing (`routing`) and the data path (`attend`). Host planning (declare,
prepare, commit, validated a whole batch at a time) stays apart from device work
(uploads and launches, all on the cache's stream).
"""
from __future__ import annotations

import math

import numpy as np

from ..args import as_int
from ..config import CacheConfig
from ..data.attend import DataPath
from ..data.routing import Routing, upload_entries
from ..data.state_path import StatePath
from ..data.upload import Upload
from ..device import (allocating, announce, check_storage_capability, cuda, device_id,
                      on_its_device, placed_on)
from ..errors import CacheFullError, ConfigError
from ..host.declarer import StepDeclarer
from ..host.slots import SlotState, SlotTable, state_refusal
from ..host.step import StepPlan
from ..refusals import floor_refusal, position_refusal
from ..statemachines import CLONE_SOURCE_STATES
from .pool import Pool
from .prefix_verbs import PrefixVerbs
from .queries import CacheParts, CacheQueries
from .stepping import StepProtocol

_CLONE_SOURCES = tuple(SlotState[s.upper()] for s in CLONE_SOURCE_STATES)
#: int32 entries a clone's upload starts with (its table patches and row runs); grown
#: on demand
CLONE_UPLOAD = 4096


class BatchedSequenceCache(CacheQueries, PrefixVerbs):
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
    Every launch and copy goes to that device. An input or `out` on another device is
    refused (`ShapeError`) before any launch. `stream`: the CUDA stream every launch and
    copy goes on (Numba's default if None). `scratch_column=False` builds pools without
    the scratch page: padding tokens get sequence -1 and are written nowhere
    (`SequenceCache` is built this way).
    """

    def __init__(self, config: CacheConfig, device=None, stream=None, *,
                 scratch_column: bool = True):
        if not isinstance(config, CacheConfig):
            raise ConfigError(f"config: expected a CacheConfig, got {type(config).__name__}")
        self.device = device_id(device)
        check_storage_capability(config.dtype, self.device)
        announce()
        self.config = config
        with placed_on(self.device):
            self._build(config, stream, scratch_column)

    def _build(self, config: CacheConfig, stream, scratch_column: bool) -> None:
        """`__init__` on the cache's device: its stream, tables and storage."""
        self.stream = stream if stream is not None else cuda.default_stream()
        n = config.max_seqs
        with allocating(f"BatchedSequenceCache({n} sequences, capacity {config.capacity}, "
                        f"max_step {config.max_step})"):
            self._slots = SlotTable(n)
            self._pool = Pool(config, n + 1 if scratch_column else n, scratch_column,
                              self.stream)
            upload = Upload(upload_entries(config), self.stream)
            self._clone_upload = Upload(CLONE_UPLOAD, self.stream)
            storage, groups = self._pool.storage, self._pool.accounting.groups
            tables = {group.rows: storage.group_tables[i] for i, group in enumerate(groups)}
            rows = config.ring_rows().tolist()
            attending = [not kind.keeps_state for kind in config.kinds]
            masks = {code: (r, tables[r]) for code, r, a in
                     zip(config.mask_codes, rows, attending) if a}
            self._routing = Routing(config, self.stream, masks, self._pool.accounting.page_bits)
        self._steps = StepProtocol(
            config=config, slots=self._slots, pool=self._pool,
            declarer=StepDeclarer(config, self._slots, self._pool.accounting), upload=upload,
            routing=self._routing, pad_col=n if scratch_column else -1, stream=self.stream)
        geometry = [(r, code, tables[r]) if a else None
                    for r, code, a in zip(rows, config.mask_codes, attending)]
        data = DataPath(config, self.device, self.stream, storage, self._routing, geometry)
        states = StatePath(config, self.device, self.stream, self._pool.states)
        self._parts = CacheParts(config, self._slots, self._pool, data, self._steps, states)

    # ------------------------------------------------------------------ sequence verbs
    @on_its_device
    def seq_new(self) -> int:
        """Claim the lowest free slot: state CLAIMED, pos 0, high-water 0, and its ring
        pages (`CapacityError`, nothing claimed, when a ring pool cannot give them)."""
        self._steps.machine.require_idle("seq_new")
        seq = self._lowest_free("seq_new")
        next_state = self._slots.check_one("seq_new", seq)
        self._pool.claim(seq, "seq_new")
        self._slots.apply("seq_new", seq, next_state)
        self._slots.pos[seq] = self._slots.high_water[seq] = 0
        return seq

    def seq_rm(self, seq: int) -> None:
        """Free the sequence and its pages: state FREE, pos 0, high-water 0 (bytes are not
        zeroed; a page shared with a clone stays with the clone)."""
        self._steps.machine.require_idle("seq_rm")
        seq = self._id(seq, "seq_rm")
        next_state = self._slots.check_one("seq_rm", seq)
        self._pool.accounting.release(seq)
        self._slots.apply("seq_rm", seq, next_state)
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
        self._steps.machine.require_idle("seq_clone")
        src = self._id(src, "seq_clone")
        state = SlotState(int(self._slots.state[src]))
        if state not in _CLONE_SOURCES:
            raise state_refusal(src, state, "seq_clone from it",
                                [s.name for s in _CLONE_SOURCES])
        pos = int(self._slots.pos[src])
        keep = pos if upto is None else as_int(upto, "seq_clone upto")
        if not 1 <= keep <= pos:
            raise position_refusal(f"seq_clone: upto={keep}", src, 1, pos)
        self._check_floor(src, keep, "seq_clone")
        dst = self._lowest_free("seq_clone")
        next_state = self._slots.check_one("clone_into", dst)
        high_water = int(self._slots.high_water[src])
        self._pool.clone(src, dst, keep, self._clone_upload, "seq_clone")
        self._slots.apply("clone_into", dst, next_state)
        self._slots.pos[dst] = keep
        self._slots.high_water[dst] = high_water
        return dst

    def rewind(self, seq: int, position: int) -> None:
        """Move the sequence back to `position` (`floor <= position <= pos`); no bytes move.
        Its flat pages wholly at or past `position` are released."""
        self._steps.machine.require_idle("rewind")
        seq = self._id(seq, "rewind")
        next_state = self._slots.check_one("rewind", seq)
        position = as_int(position, "rewind position")
        pos = int(self._slots.pos[seq])
        if position > pos or position < 0:
            raise position_refusal(f"rewind: position {position}", seq, self._floor(seq), pos)
        self._check_floor(seq, position, "rewind")
        self._pool.accounting.rewind(seq, position)
        self._slots.apply("rewind", seq, next_state)
        self._slots.pos[seq] = position

    # ------------------------------------------------------------------ step protocol
    def declare_step(self, seq_ids, *, blocks=()) -> StepPlan:
        """Open a step: one sequence id per token, in token order (ints or an int array
        `[n_tokens]`).

        Each maximal run of one id is a span and one attention segment. A sequence
        may have several spans (`[a, b, a]`): they take consecutive positions in
        token order, and a later span's queries see the keys the earlier ones write
        in the same step. `blocks`: sequences whose tokens are a bidirectional draft
        block; a block owner must be exactly one span. Refusals, in order: an open
        step; an unknown or free id; a block owner in more or fewer than one span; a
        sequence writing more than `max_write` tokens (all its spans); `pos` + its
        tokens past `capacity`; more than `max_step` tokens; more new flat pages than
        the pool can give. The cache copies `seq_ids` (the caller may reuse its buffer
        at once) and returns a read-only `StepPlan`.
        """
        return self._steps.declare(seq_ids, blocks)

    @on_its_device
    def prepare_step(self, width: int | None = None) -> StepPlan:
        """Stage the declared step at `width` tokens (default: no padding).

        Takes the flat pages the step's positions need (growing the pool when allowed,
        transactionally: a failed growth is `CapacityError` with the step still
        declared), replaces each shared page the step writes into by a copy
        (copy-on-write), builds `seq_cols` / `positions` (padding -> the scratch row,
        position 0) and uploads them with the segment table, the attention plans and
        the page-table changes in one host-to-device copy, without a host sync; the
        table patches and the copies run on the device before any write.
        """
        return self._steps.prepare(width)

    def commit_step(self) -> None:
        """Advance every sequence of the step by all its spans' tokens; COMMITTED.

        A step that wrote some layers and not others is refused (`StepProtocolError`
        naming the unwritten layers; `abort_step` discards it); a step that wrote no
        layer commits positions only.
        """
        self._steps.commit()

    def abort_step(self) -> None:
        """Return every sequence of the step to its earlier state; nothing advances.

        After `prepare_step` the kernels may have written, so each sequence's
        high-water rises to the end of its last span, and the flat pages the step took
        past its positions are released.
        """
        self._steps.abort()

    def check_declarable(self, seqs: np.ndarray) -> None:
        """Raise what `declare_step` would raise first for sequences `seqs` (an int64 array
        of valid ids): an open step, then a free or busy sequence. Changes nothing."""
        self._steps.check_declarable(seqs)

    # ------------------------------------------------------------------ data path
    @on_its_device
    def write(self, layer: int, k, v) -> None:
        """Write the prepared step's K and V, each `[width, n_kv_heads, head_dim]` (float16,
        float32 or bfloat16: NumPy, PyTorch or device arrays; converted to the storage
        dtype in the kernel), into `layer`: token `i` to its sequence's page and slot for
        `positions[i]`."""
        self._parts.data.write(self._steps.prepared("write"), layer, k, v)

    @on_its_device
    def attend(self, layer: int, q, out=None, *, scale=None, softcap=None, lse=None,
               sinks=None):
        """Attention of the prepared step's queries over their own sequences' histories.

        q: `[width, n_q_heads, head_dim]`, `n_q_heads` a multiple of `n_kv_heads`;
        float16, float32 or bfloat16 (NumPy as `ml_dtypes.bfloat16`, or PyTorch).
        Returns `out` (`[width, n_q_heads, head_dim]`) if given, else a new array of q's
        type and dtype: a tensor on q's device for a PyTorch q, NumPy for NumPy, a
        device array for a device array. Padding rows are zero. The step must have
        written `layer` first (`write` or `update_and_attend`); `scale` (default
        `1/sqrt(head_dim)`) and `softcap` (None or > 0) must be finite.

        `lse`: None, or a float32 `[width, n_q_heads]` array of q's types (NumPy, PyTorch,
        device) that receives each row's natural-log log-sum-exp of its final scores
        (scaled, then soft-capped), `-inf` on padding rows: FlashAttention's convention,
        so that attentions over parts of a history can be merged.

        `sinks`: None, or a float32 `[n_q_heads]` array of q's types (a NumPy one is copied
        to the device each call): head `h`'s logit `sinks[h]` joins every softmax of that
        head as one more term of its denominator, `exp(sinks[h] - max)`, with no value
        (learned attention sinks, as gpt-oss's `s_aux`); `lse` includes it. A cost per
        row on every path, none per key; `-inf` is no sink.
        """
        return self._parts.data.attend(self._steps.prepared("attend"), layer, q, out, scale,
                                       softcap, lse, sinks)

    @on_its_device
    def update_and_attend(self, layer: int, q, k, v, **kw):
        """`write(layer, k, v)` then `attend(layer, q, **kw)` (`kw`: `out`, `scale`,
        `softcap`, `lse`, `sinks`): every argument of both halves is checked before anything is
        written."""
        return self._parts.data.update_and_attend(self._steps.prepared("write"), layer, q, k, v, kw)

    @on_its_device
    def conv(self, layer: int, x, weight, bias=None, *, activation=None):
        """The depthwise causal convolution of state layer `layer` (contract §17) over the
        prepared step: `x [width, channels]`, `weight [channels, conv_width]`, `bias
        [channels]` or None; `y_t = act(bias + sum_j weight[:, j] * x[p - conv_width + 1 +
        j])` over each sequence's own inputs (its window, then the step's tokens; zeros
        before position 0), `activation` None or "silu". Float32 arithmetic; the window
        keeps the inputs in the storage dtype. Returns `y [width, channels]` of x's
        family and dtype, padding rows zero. Runs once per layer per step."""
        return self._parts.states.conv(self._steps.prepared("conv"), layer, x, weight, bias,
                                       activation)

    @on_its_device
    def delta_rule(self, layer: int, q, k, v, g, beta, *, scale=None, qk_l2norm=False):
        """The gated delta rule of state layer `layer` (contract §17) over the prepared
        step: `q, k [width, heads, k_dim]`, `v [width, heads, v_dim]`, `g` a log-decay
        `[width, heads]` or `[width, heads, k_dim]`, `beta [width, heads]` or None (decay
        only: `S <- diag(exp(g)) S + k v^T`). Per token and head: with `qk_l2norm`, q and k
        become `x * rsqrt(sum(x**2) + 1e-6)`; `S <- diag(exp(g)) S`; `S <- S + beta * k (v -
        S^T k)^T`; `o = scale * S^T q` (default scale `k_dim ** -0.5`), every segment from
        its sequence's state, which it advances, in float32. Returns `o [width, heads,
        v_dim]` of q's family and dtype, padding rows zero. Runs once per layer per step."""
        return self._parts.states.delta_rule(self._steps.prepared("delta_rule"), layer, q, k,
                                             v, g, beta, scale, qk_l2norm)

    @on_its_device
    def ssd(self, layer: int, x, dt, A, B, C, *, D=None, dt_bias=None, dt_softplus=True,
            dt_limit=(0.0, math.inf)):
        """Mamba2's SSD of state layer `layer` (contract §17), declared `state(recurrent=
        (heads, head_dim, d_state))`, over the prepared step: `x [width, heads,
        head_dim]`, `dt [width, heads]`, `A [heads]`, `B, C [width, groups, d_state]`
        (groups dividing heads), `D [heads]` or None, `dt_bias [heads]` or None. Per token
        and head `h` (group `g = h // (heads // groups)`): `d = clamp(softplus(dt +
        dt_bias), *dt_limit)` (no softplus when `dt_softplus` is False); `S_h <- exp(d
        A_h) S_h + d x_h B_g^T`; `y_h = S_h C_g + D_h x_h`, the state `S_h [head_dim,
        d_state]`, every segment from its sequence's state, which it advances, in
        float32. Returns `y [width, heads, head_dim]` of x's family and dtype, padding
        rows zero. Runs once per layer per step; a layer that ran `delta_rule` refuses
        it, and the other way round."""
        return self._parts.states.ssd(self._steps.prepared("ssd"), layer, x, dt, A, B, C, D,
                                      dt_bias, dt_softplus, dt_limit)

    def _lowest_free(self, verb: str) -> int:
        free = np.flatnonzero(self._slots.state == SlotState.FREE)
        if not free.size:
            raise CacheFullError(f"{verb}: all {self.config.max_seqs} sequence slots are in use")
        return int(free[0])

    def _check_floor(self, seq: int, target: int, verb: str) -> None:
        if target < self._floor(seq):
            raise floor_refusal(verb, seq, target, int(self._slots.high_water[seq]),
                                self.config)
