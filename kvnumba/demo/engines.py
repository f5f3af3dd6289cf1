"""The two engines the scenario drives, with one face (`open`, `clone`, `close`, `step`):
the model served through the cache (`CacheEngine`), and the same model with no cache
(`ReferenceEngine`, `kvnumba.reference`).

A step's `inputs` are `(sid, start, tokens)` as `SessionTable.pack` takes them
(`tokens`: ints, or an int array `[n]`); `blocks` names the sessions whose inputs
are draft blocks; `width` pads the step to a static width (None: no padding).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

import kvnumba as kv
from kvnumba.reference import DemoModel


@dataclass
class StepOutput:
    """What an engine's step produced, over the step's `n` real tokens in packed order.

    logits:        `[n, vocab]` float64.
    attn:          per layer, the attention output `[n, n_q_heads, head_dim]` float64.
    logit_indices: `[n_inputs]` int64, each input's sampling row or -1 (`PackedStep`).
    positions:     `[n]` int64, each token's position (the plan's, for the cache).
    width, n_segments: the prepared step's width and span count (cache only).
    pad_zero:      the padding rows of every attention output were zero (cache only).
    control_ms:    the step's host control: pack + declare + prepare + commit (cache only).
    kernels_s:     seconds in `update_and_attend` over all layers (cache only).
    """

    logits: np.ndarray
    attn: list
    logit_indices: np.ndarray
    positions: np.ndarray
    width: int = 0
    n_segments: int = 0
    pad_zero: bool = True
    control_ms: float = 0.0
    kernels_s: float = 0.0


class CacheEngine:
    """The model served through `SessionTable` + `BatchedSequenceCache`, a step at a time
    through `kvnumba.run_inputs`."""

    def __init__(self, model: DemoModel, config: kv.CacheConfig):
        self.model = model
        self.cache = kv.BatchedSequenceCache(config)
        self.table = kv.SessionTable(self.cache, max_sessions=config.max_seqs,
                                     max_session_tokens=config.capacity)

    def open(self) -> int:
        """A new empty session; returns its id."""
        return self.table.open()

    def clone(self, sid: int, upto: int) -> int:
        """A new session holding `sid`'s first `upto` positions; returns its id."""
        return self.table.clone(sid, upto)

    def close(self, sid: int) -> None:
        """Free the session and its sequence slot."""
        self.table.close(sid)

    def step(self, inputs, blocks=(), width=None) -> StepOutput:
        """Run one step; its control time is the step's wall time less the model's."""
        started = time.perf_counter()
        out, forward_s = kv.run_inputs(self.table, inputs, self._forward, blocks=blocks,
                                       width=width)
        out.control_ms = 1e3 * (time.perf_counter() - started - forward_s)
        return out

    def _forward(self, packed: kv.PackedStep, plan: kv.StepPlan) -> tuple:
        """The model over a prepared step: each layer's q, k, v padded to `plan.width` rows
        and attended through the cache. Returns the `StepOutput` and the seconds it took."""
        started = time.perf_counter()
        model, cache = self.model, self.cache
        n, width = packed.n_tokens, plan.width
        x = model.embed(packed.tokens)
        attns, pad_zero, kernels_s = [], True, 0.0
        for layer in range(model.n_layers):
            q, k, v = (_padded(a, width) for a in model.qkv(layer, x, packed.positions))
            t = time.perf_counter()
            out = cache.update_and_attend(layer, q, k, v)
            kernels_s += time.perf_counter() - t
            pad_zero &= not np.any(out[n:])
            attn = out[:n].astype(np.float64)
            attns.append(attn)
            x = model.after_attention(layer, x, attn)
        output = StepOutput(model.logits(x), attns, np.asarray(packed.logit_indices),
                            np.array(plan.positions[:n]), width, plan.n_segments, pad_zero,
                            kernels_s=kernels_s)
        return output, time.perf_counter() - started


def _padded(a: np.ndarray, width: int) -> np.ndarray:
    """`a` `[n, heads, head_dim]` as float32 `[width, heads, head_dim]`, zero rows after `n`."""
    out = np.zeros((width,) + a.shape[1:], dtype=np.float32)
    out[:a.shape[0]] = a
    return out


class ReferenceEngine:
    """The same model with no cache: each session is its token history, run whole each step."""

    def __init__(self, model: DemoModel):
        self.model = model
        self.history: dict[int, list] = {}
        self.blocks: dict[int, list] = {}   # sid -> (b0, b1) spans fed as draft blocks
        self._next = 1

    def open(self) -> int:
        """A new empty session; ids count from 1, as `SessionTable`'s."""
        sid, self._next = self._next, self._next + 1
        self.history[sid], self.blocks[sid] = [], []
        return sid

    def clone(self, sid: int, upto: int) -> int:
        """A new session holding `sid`'s first `upto` tokens (and its blocks below them)."""
        new = self.open()
        self.history[new] = self.history[sid][:upto]
        self.blocks[new] = self._spans_below(sid, upto)
        return new

    def close(self, sid: int) -> None:
        """Forget the session."""
        self.history.pop(sid, None)
        self.blocks.pop(sid, None)

    def _spans_below(self, sid: int, end: int) -> list:
        spans = self.blocks[sid]
        if any(b0 < end < b1 for b0, b1 in spans):
            raise NotImplementedError("the reference does not cut a draft block in two")
        return [(b0, b1) for b0, b1 in spans if b1 <= end]

    def step(self, inputs, blocks=(), width=None) -> StepOutput:
        """Write the inputs into each session's history (an early start drops the rest),
        then run every touched session's whole history through `DemoModel.forward`.
        `width` is ignored: the reference has no padding."""
        rows = []          # (sid, start, n) per input, in packed order
        for sid, start, tokens in inputs:
            tokens = [int(t) for t in np.asarray(tokens).ravel()]
            self.blocks[sid] = self._spans_below(sid, start)
            self.history[sid] = self.history[sid][:start] + tokens
            rows.append((sid, start, len(tokens)))
        spans = {}
        for sid in dict.fromkeys(s for s, _, _ in rows):
            runs = [(st, st + n) for s, st, n in rows if s == sid]
            if sid in blocks:
                self.blocks[sid] = self.blocks[sid] + [(runs[0][0], runs[-1][1])]
            spans[sid] = self.model.forward(self.history[sid], self.blocks[sid])
        attns = [np.concatenate([spans[s][0][layer][st:st + n] for s, st, n in rows])
                 for layer in range(self.model.n_layers)]
        logits = np.concatenate([spans[s][1][st:st + n] for s, st, n in rows])
        offsets = np.cumsum([0] + [n for _, _, n in rows])
        last = [i + 1 == len(rows) or rows[i + 1][0] != rows[i][0] for i in range(len(rows))]
        logit_indices = np.array([offsets[i + 1] - 1 if last[i] else -1
                                  for i in range(len(rows))], dtype=np.int64)
        positions = np.concatenate([np.arange(st, st + n) for _, st, n in rows])
        return StepOutput(logits, attns, logit_indices, positions)
