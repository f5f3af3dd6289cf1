"""`declare_step`'s host planning: a step's token axis (one sequence id per token) cut
into spans, checked against every rule, and recorded as an `OpenStep` (contract §7).

Each maximal run of one id is a span, and one segment of the segment table the
attention kernels read. A sequence may have several spans (`[a, b, a]`): they take
consecutive positions in token order, so a later span starts where the sequence's
earlier spans end. Refusals, in the contract's order: an unknown or free id (the slot
table), a block owner in more or fewer than one span, a sequence writing more than
`max_write` tokens, a sequence passing `capacity`, more than `max_step` tokens, more
new flat pages than the pool can give. A refused declaration changes nothing.

A decode step (every token a span of its own sequence) takes a compiled pass of its
own (`arith.positions.decode_segments`), with no span arithmetic.
"""
from __future__ import annotations

import numpy as np

from ..args import as_ids
from ..config import CacheConfig
from .page_accounting import PageAccounting
from ..arith.positions import (SEQ, FLAG_BLOCK, FLAGS, POS_START, Q_LEN, Q_START, SEQ_INFO_FIELDS,
                        decode_segments, frozen, span_offsets)
from ..refusals import capacity_refusal, owner_refusal, step_refusal, write_refusal
from .slots import SlotTable
from .step import OpenStep

_max = np.maximum.reduce


class StepDeclarer:
    """Declares the steps of one cache over its `slots` (a `SlotTable` of `n` sequence
    slots) and its flat pages (`accounting`, a `PageAccounting`)."""

    def __init__(self, config: CacheConfig, slots: SlotTable, accounting: PageAccounting):
        self.config, self.slots, self.accounting = config, slots, accounting
        self.n = slots.n
        # read-only ramps reused by every decode step (no per-step allocation); a step
        # whose every token is its own span of a distinct sequence has at most this many
        ramp = min(config.max_step, self.n)
        self._arange = frozen(np.arange(ramp, dtype=np.int64))
        self._ones = frozen(np.ones(ramp, dtype=np.int64))

    def block_ids(self, blocks):
        """`blocks` as a fresh int64 id array, or None for no blocks."""
        if blocks is None or (isinstance(blocks, (tuple, list)) and not blocks):
            return None
        ids = as_ids(blocks, self.n, "declare_step blocks")
        return ids if ids.size else None

    def declare(self, ids: np.ndarray, block_ids) -> OpenStep:
        """The step of `ids` (a non-empty int64 array of ids in range) with draft-block
        owners `block_ids` (None or int64 ids): checked, its slots moved to PREFILLING,
        recorded."""
        if ids.size <= self._arange.size:     # a decode step, unless a sequence repeats
            seq_info = np.empty((ids.size, SEQ_INFO_FIELDS), dtype=np.int32)
            furthest = decode_segments(ids, self.slots.pos, seq_info)
            if furthest >= 0:
                return self._declare_tokens(ids, block_ids, seq_info, furthest)
        return self._declare_spans(ids, block_ids)

    def _declare_tokens(self, ids, block_ids, seq_info, furthest: int) -> OpenStep:
        """A step whose every token is a span of its own sequence (a decode step;
        `decode_segments` made its segment table)."""
        n_tokens = ids.size
        ones = self._ones[:n_tokens]
        self.slots.require("declare", ids)
        if block_ids is not None:
            flags = self._block_flags(block_ids, ids, self._arange[:n_tokens], ones)
        max_kv_len = int(seq_info[furthest, POS_START]) + 1
        if max_kv_len > self.config.capacity:
            raise capacity_refusal(int(ids[furthest]), max_kv_len - 1, 1, self.config)
        needed = self._check_limits(n_tokens, ids, ones)
        if block_ids is not None:
            seq_info[:, FLAGS] = flags
        self.slots.declare(ids)
        # the logit rows are the tokens: a view of the read-only ramp. `OpenStep`'s fields
        # in order (n_tokens, seq_info, logit_indices, max_q_len, max_kv_len, spans, seqs,
        # totals, pages_needed), passed by position: a class called with keywords builds
        # a dict of them first, once a step
        return OpenStep(n_tokens, frozen(seq_info), self._arange[:n_tokens], 1, max_kv_len,
                        (ids, ones), ids, ones, needed)

    def _declare_spans(self, ids, block_ids) -> OpenStep:
        """Any step: its spans (maximal runs of one id) and their refusals."""
        n_tokens = ids.size
        boundary = ids[1:] != ids[:-1]
        span_starts = np.concatenate(([0], np.flatnonzero(boundary) + 1))
        span_seqs = ids[span_starts]
        span_lens = np.diff(np.append(span_starts, n_tokens))
        self.slots.require("declare", span_seqs)
        flags = self._block_flags(block_ids, span_seqs, span_starts, span_lens)
        pos_start = self.slots.pos.take(span_seqs)
        if _max(np.bincount(span_seqs, minlength=self.n)) == 1:    # one span per sequence
            seqs, totals = span_seqs, span_lens
        else:
            offsets, seqs, totals = span_offsets(span_seqs, span_lens)
            pos_start = pos_start + offsets
        max_kv_len = self._check_totals(seqs, totals)
        needed = self._check_limits(n_tokens, seqs, totals)
        seq_info = np.empty((span_seqs.size, SEQ_INFO_FIELDS), dtype=np.int32)
        seq_info[:, Q_START] = span_starts
        seq_info[:, Q_LEN] = span_lens
        seq_info[:, SEQ] = span_seqs
        seq_info[:, POS_START] = pos_start
        seq_info[:, FLAGS] = flags
        self.slots.declare(seqs)
        return OpenStep(n_tokens, frozen(seq_info), frozen(span_starts + span_lens - 1),
                        int(_max(span_lens)), max_kv_len, (span_seqs, span_lens), seqs, totals,
                        needed)    # by position, as in `_declare_tokens`

    def _check_totals(self, seqs, totals) -> int:
        """Refuse a sequence writing more than max_write tokens, or reaching past capacity;
        returns the furthest end."""
        if _max(totals) > self.config.max_write:
            i = int(np.argmax(totals))
            raise write_refusal(int(seqs[i]), int(totals[i]), self.config)
        ends = self.slots.pos[seqs] + totals
        furthest = int(_max(ends))
        if furthest > self.config.capacity:
            i = int(np.argmax(ends))
            raise capacity_refusal(int(seqs[i]), int(self.slots.pos[seqs[i]]), int(totals[i]),
                                   self.config)
        return furthest

    def _check_limits(self, n_tokens: int, seqs, totals) -> tuple:
        """Refuse more than `max_step` tokens, then new pages past a pool's `max_pages`;
        returns the new pages the step takes per page group."""
        if n_tokens > self.config.max_step:
            raise step_refusal(n_tokens, self.config)
        needed = self.accounting.step_demand(seqs, totals, self.slots.pos)
        if needed is not self.accounting.no_pages:
            self.accounting.check_step_room(needed, "declare_step")
        return needed

    def _block_flags(self, block_ids, span_seqs, span_starts, span_lens) -> np.ndarray | int:
        """FLAG_BLOCK for the spans `block_ids` names; each must name exactly one span."""
        if block_ids is None:
            return 0
        spans_per_seq = np.bincount(span_seqs, minlength=self.n)
        wrong = block_ids[spans_per_seq[block_ids] != 1]
        if wrong.size:
            seq = int(wrong[0])
            raise owner_refusal(seq, [(int(a), int(a + n)) for a, n, s in
                                      zip(span_starts, span_lens, span_seqs) if s == seq])
        marked = np.zeros(self.n, dtype=np.int32)
        marked[block_ids] = FLAG_BLOCK
        return marked[span_seqs]
