"""`python -m kvnumba demo`: a small decoder serving several sessions through the cache,
checked step by step against the same model run on each session alone, with no cache.

The model (`reference.DemoModel`) has random weights: token embedding, layers with
GQA attention and rotary positions (at least one flat layer and one sliding-window
ring layer by default), a ReLU MLP, residuals and an output head; it samples
greedily. The sessions live in one `BatchedSequenceCache` (float32 storage, so the
greedy tokens are stable) behind a `SessionTable`, and the run goes through:

1. chunked prefill: prompts of different lengths, one fed as two abutting chunks in
   one step, a longer one over two steps while the others already decode;
2. batched decode (some steps padded to a static width);
3. a speculative draft of several tokens of which only a prefix is right: the whole
   draft is written, the verified prefix kept, and the next step's input starts
   before the session's cursor, so `SessionTable.pack` rewinds the rest away;
4. a fork (`SessionTable.clone` one position back) that continues with another token;
5. a draft block (`declare_step(..., blocks=[seq])`, bidirectional within itself)
   whose proposals are then verified causally, and rewound like any draft;
6. more decode steps; then every session is closed.

Every step, every layer's attention output and every logit row are compared with
`DemoModel.forward` (dense float64 attention over the session's whole token history,
no cache; `kvnumba.reference`), and every sampled token with the reference's argmax.
Independently, the whole scenario is replayed on the reference alone, and each
session's generated tokens must be the same. Any difference is a mismatch: the
command prints it and exits 1.

`run(...)` returns a `DemoResult` (tests call it in-process); `main(argv)` is the CLI.
`run(tamper=fn, tamper_step=k)` calls `fn(cache, table)` once, right after step `k`
commits, so a test can corrupt the cache's bytes and watch the demo catch it.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from . import device
from .batched import BatchedSequenceCache
from .config import CacheConfig, flat, ring
from .reference import DemoModel
from .sessions import SessionTable

#: tolerances of the per-step comparison, by storage dtype: (atol, rtol) for attention
#: outputs; logits get 10x. Near-ties (top-2 reference logits within TIE) are not
#: counted as token mismatches by the per-step check (the replay still compares tokens).
#: bfloat16's are 8x float16's: its unit roundoff is 2**-8 against 2**-11.
TOLERANCE = {"float32": (1e-4, 1e-4), "float16": (2e-2, 2e-2),
             "bfloat16": (1.6e-1, 1.6e-1)}
TIE = 1e-3


# ---------------------------------------------------------------------------- results
@dataclass
class StepReport:
    """One step of the cached run and its comparison with the reference."""

    index: int
    kind: str
    n_tokens: int
    width: int
    n_segments: int
    control_ms: float       # pack + declare + prepare + commit (host)
    kernels_s: float        # update_and_attend over all layers (incl. simulated copies)
    check_ms: float         # the cache-free reference of the step's sessions
    max_err: float          # largest |cache - reference| over attention outputs
    problems: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class SessionReport:
    sid: int
    origin: str             # "prompt", or "fork of session S at P"
    prompt_len: int
    generated: list         # tokens the cached run sampled
    reference: list         # tokens the cache-free replay sampled
    steps_ok: bool          # every step that touched the session matched the reference

    @property
    def match(self) -> bool:
        return self.steps_ok and self.generated == self.reference


@dataclass
class DemoResult:
    ok: bool
    sessions: list
    steps: list
    mismatches: list        # one line per difference found
    features: dict          # what the run exercised, feature -> description
    wall_s: float
    completed: bool         # False when --fail-fast stopped the run early


# ---------------------------------------------------------------------------- engines
@dataclass
class StepOutput:
    logits: np.ndarray      # [n_tokens, vocab], in packed token order
    attn: list              # per layer [n_tokens, n_q_heads, head_dim]
    logit_indices: np.ndarray
    width: int = 0
    n_segments: int = 0
    positions: np.ndarray | None = None
    pad_zero: bool = True
    control_ms: float = 0.0
    kernels_s: float = 0.0


class CacheEngine:
    """The model served through `SessionTable` + `BatchedSequenceCache`."""

    def __init__(self, model: DemoModel, config: CacheConfig):
        self.model = model
        self.cache = BatchedSequenceCache(config)
        self.table = SessionTable(self.cache, max_sessions=config.max_seqs,
                                  max_session_tokens=config.capacity)

    def open(self) -> int:
        return self.table.open()

    def clone(self, sid: int, upto: int) -> int:
        return self.table.clone(sid, upto)

    def close(self, sid: int) -> None:
        self.table.close(sid)

    def step(self, inputs, blocks=(), width=None) -> StepOutput:
        model, cache = self.model, self.cache
        t0 = time.perf_counter()
        packed = self.table.pack(inputs)
        plan = cache.declare_step(packed.seq_ids, blocks=[self.table.seq(s) for s in blocks])
        plan = cache.prepare_step(width)
        t1 = time.perf_counter()
        n, w = packed.n_tokens, plan.width
        x = model.embed(packed.tokens)
        attns, pad_zero, kernels = [], True, 0.0
        for layer in range(model.n_layers):
            q, k, v = model.qkv(layer, x, packed.positions)
            q32, k32, v32 = (_padded(a, w) for a in (q, k, v))
            t = time.perf_counter()
            out = cache.update_and_attend(layer, q32, k32, v32)
            kernels += time.perf_counter() - t
            pad_zero &= not np.any(out[n:])
            attn = out[:n].astype(np.float64)
            attns.append(attn)
            x = model.after_attention(layer, x, attn)
        logits = model.logits(x)
        t2 = time.perf_counter()
        cache.commit_step()
        control_ms = 1e3 * (t1 - t0 + time.perf_counter() - t2)
        return StepOutput(logits, attns, np.asarray(packed.logit_indices), w, plan.n_segments,
                          np.asarray(plan.positions[:n]), pad_zero, control_ms, kernels)


def _padded(a: np.ndarray, width: int) -> np.ndarray:
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
        sid, self._next = self._next, self._next + 1
        self.history[sid], self.blocks[sid] = [], []
        return sid

    def clone(self, sid: int, upto: int) -> int:
        new = self.open()
        self.history[new] = self.history[sid][:upto]
        self.blocks[new] = self._spans_below(sid, upto)
        return new

    def close(self, sid: int) -> None:
        self.history.pop(sid, None)
        self.blocks.pop(sid, None)

    def _spans_below(self, sid: int, end: int) -> list:
        spans = self.blocks[sid]
        if any(b0 < end < b1 for b0, b1 in spans):
            raise NotImplementedError("the reference does not cut a draft block in two")
        return [(b0, b1) for b0, b1 in spans if b1 <= end]

    def step(self, inputs, blocks=(), width=None) -> StepOutput:
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
        return StepOutput(logits, attns, logit_indices, positions=positions)


class CheckedEngine:
    """Drives the cache engine and the reference engine in lockstep, comparing every step."""

    def __init__(self, cached: CacheEngine, reference: ReferenceEngine, dtype: str,
                 out=None, tamper=None, tamper_step=None, fail_fast=False, total_steps=None):
        self.cached, self.reference = cached, reference
        self.atol, self.rtol = TOLERANCE[dtype]
        self.out = out
        self.tamper, self.tamper_step = tamper, tamper_step
        self.fail_fast = fail_fast
        self.total_steps = total_steps
        self.reports: list[StepReport] = []
        self.bad_sessions: set = set()
        self.kind = ""

    def open(self) -> int:
        sid = self.cached.open()
        assert self.reference.open() == sid
        return sid

    def clone(self, sid: int, upto: int) -> int:
        new = self.cached.clone(sid, upto)
        assert self.reference.clone(sid, upto) == new
        return new

    def close(self, sid: int) -> None:
        self.cached.close(sid)
        self.reference.close(sid)

    def step(self, inputs, blocks=(), width=None) -> StepOutput:
        index = len(self.reports) + 1
        got = self.cached.step(inputs, blocks, width)
        t = time.perf_counter()
        want = self.reference.step(inputs, blocks)
        problems, max_err = self._compare(index, inputs, got, want)
        report = StepReport(index, self.kind, len(got.logits), got.width, got.n_segments,
                            got.control_ms, got.kernels_s, 1e3 * (time.perf_counter() - t),
                            max_err, problems)
        self.reports.append(report)
        if self.out is not None:
            print(_step_line(report, self.total_steps), file=self.out, flush=True)
            for line in problems[:8]:
                print(f"      MISMATCH {line}", file=self.out, flush=True)
        if self.tamper is not None and index == self.tamper_step:
            self.tamper(self.cached.cache, self.cached.table)
            if self.out is not None:
                print(f"      (tamper hook ran after step {index})", file=self.out, flush=True)
        if problems and self.fail_fast:
            raise _Stop(index)
        return got

    def _compare(self, index, inputs, got: StepOutput, want: StepOutput):
        problems, max_err = [], 0.0
        spans, offset = [], 0
        for sid, start, tokens in inputs:
            n = len(tokens)
            spans.append((sid, start, offset, offset + n))
            offset += n

        def bad(sid, text):
            problems.append(f"step {index}: session {sid}: {text}")
            self.bad_sessions.add(sid)

        if not np.array_equal(got.logit_indices, want.logit_indices):
            bad("*", f"logit_indices {got.logit_indices.tolist()} != expected "
                     f"{want.logit_indices.tolist()}")
        if not np.array_equal(got.positions, want.positions):
            bad("*", f"the plan's positions {got.positions.tolist()} != the inputs' "
                     f"{want.positions.tolist()}")
        if not got.pad_zero:
            bad("*", "padding rows of the attention output are not zero")
        for sid, start, a, b in spans:
            for layer, (x, y) in enumerate(zip(got.attn, want.attn)):
                err = float(np.max(np.abs(x[a:b] - y[a:b]))) if b > a else 0.0
                if not np.isfinite(err):
                    err = math.inf
                max_err = max(max_err, err)
                if not np.allclose(x[a:b], y[a:b], atol=self.atol, rtol=self.rtol):
                    bad(sid, f"layer {layer} attention at positions {start}..{start + b - a - 1} "
                             f"differs from the reference by {err:.3g}")
            if not np.allclose(got.logits[a:b], want.logits[a:b], atol=10 * self.atol,
                               rtol=10 * self.rtol):
                err = float(np.max(np.abs(got.logits[a:b] - want.logits[a:b])))
                bad(sid, f"logits at positions {start}..{start + b - a - 1} differ from the "
                         f"reference by {err:.3g}")
            ref_top2 = np.sort(want.logits[a:b], axis=1)[:, -2:]
            clear = ref_top2[:, 1] - ref_top2[:, 0] > TIE
            mine, theirs = got.logits[a:b].argmax(axis=1), want.logits[a:b].argmax(axis=1)
            for i in np.flatnonzero(clear & (mine != theirs)):
                bad(sid, f"greedy token after position {start + i}: cache {int(mine[i])}, "
                         f"reference {int(theirs[i])}")
        return problems, max_err


class _Stop(Exception):
    def __init__(self, index):
        super().__init__(f"stopped after step {index} (--fail-fast)")
        self.index = index


# ---------------------------------------------------------------------------- the scenario
@dataclass
class Options:
    seed: int = 0
    sessions: int = 3
    layers: tuple = (None, 6)       # None = flat, W = ring(window=W)
    decode_steps: int = 3
    draft: int = 4                  # speculative draft length
    accept: int = 2                 # how many draft tokens are right by construction
    block: int = 4                  # draft block length (the block step's run)
    max_write: int = 8
    vocab: int = 64
    d_model: int = 32
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    dtype: str = "float32"

    def validate(self):
        checks = [
            (self.sessions >= 1, "--sessions must be >= 1"),
            (self.decode_steps >= 0, "--decode-steps must be >= 0"),
            (1 <= self.draft and self.draft + 1 <= self.max_write,
             "--draft N needs 1 <= N and N + 1 <= --max-write"),
            (0 <= self.accept <= self.draft, "--accept must be in [0, --draft]"),
            (2 <= self.block <= self.max_write, "--block must be in [2, --max-write]"),
            (self.max_write >= 2, "--max-write must be >= 2"),
            (self.vocab >= 4, "--vocab must be >= 4"),
            (self.kv_heads >= 1 and self.q_heads % self.kv_heads == 0,
             "--q-heads must be a multiple of --kv-heads"),
            (self.head_dim >= 2 and self.head_dim % 2 == 0, "--head-dim must be even"),
            (self.dtype in TOLERANCE, f"--dtype must be one of {sorted(TOLERANCE)}"),
            (len(self.layers) >= 1, "--layers needs at least one layer"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def mask_token(self) -> int:
        """The token the draft block's placeholder positions carry (never sampled as a prompt)."""
        return self.vocab - 1


def prompts_for(opts: Options) -> list:
    """Prompt token lists of different lengths: the first fits one step, the second (or
    only) is longer than max_write."""
    rng = np.random.default_rng(opts.seed + 1)
    m = opts.max_write
    lengths = rng.integers(3, 2 * m, size=opts.sessions)
    lengths[0] = min(int(lengths[0]), m)            # fits one step: fed as two abutting chunks
    lengths[1 % opts.sessions] = max(int(lengths[1 % opts.sessions]), m + 3)  # over two steps
    return [rng.integers(0, opts.vocab - 1, size=int(n)).tolist() for n in lengths]


class Scenario:
    """The serving script. The same code drives the cached run and the reference replay;
    every decision (acceptance, proposals) follows from the logits an engine returns."""

    def __init__(self, engine, model: DemoModel, opts: Options, prompts: list):
        self.engine, self.model, self.opts, self.prompts = engine, model, opts, prompts
        self.history: dict[int, list] = {}     # committed tokens as the script sees them
        self.pending: dict[int, int] = {}      # sampled, not yet fed
        self.generated: dict[int, list] = {}
        self.origin: dict[int, str] = {}
        self.prompt_len: dict[int, int] = {}
        self.features: dict[str, str] = {}
        self.rng = np.random.default_rng(opts.seed + 2)
        self.n_steps = 0
        self.widths: list = []
        self.max_step = max_step_for(opts)
        self.max_pos = 0

    # ---- helpers
    def _label(self, kind):
        if hasattr(self.engine, "kind"):
            self.engine.kind = kind

    def _step(self, kind, feeds, blocks=(), pad=False):
        """Run one step. feeds: (sid, start, tokens). Returns each feed's logit rows."""
        self._label(kind)
        n = sum(len(t) for _, _, t in feeds)
        width = min(self.max_step, -(-n // 8) * 8 + (8 if n % 8 == 0 else 0)) if pad else None
        out = self.engine.step(feeds, blocks, width)
        self.n_steps += 1
        self.widths.append((n, width or n))
        rows, offset = [], 0
        for sid, start, tokens in feeds:
            self.max_pos = max(self.max_pos, start + len(tokens))
            self.history[sid] = self.history[sid][:start] + list(tokens)
            rows.append(out.logits[offset:offset + len(tokens)])
            offset += len(tokens)
        return rows

    def _decode_feed(self, sid):
        return (sid, len(self.history[sid]), [self.pending[sid]])

    def _sample(self, sid, row):
        token = int(np.argmax(row))
        self.pending[sid] = token
        self.generated[sid].append(token)

    def _decode_all(self, kind="decode", pad=False, extra=(), blocks=()):
        """A step where every live session without an `extra` feed decodes one token."""
        special = {f[0] for f in extra}
        feeds = [self._decode_feed(s) for s in self.live if s not in special] + list(extra)
        rows = self._step(kind, feeds, blocks, pad)
        for (sid, _, _), r in zip(feeds, rows):
            if sid not in special:
                self._sample(sid, r[-1])
        return rows[len(feeds) - len(extra):]

    def _verify(self, sid, rows, draft):
        """Accept the longest draft prefix the target's greedy tokens agree with."""
        accepted = 0
        while accepted < len(draft) and int(np.argmax(rows[accepted])) == draft[accepted]:
            accepted += 1
        keep = len(self.history[sid]) - len(draft) + accepted   # drop the rejected tail
        self.history[sid] = self.history[sid][:keep]
        self.generated[sid].extend(draft[:accepted])
        self._sample(sid, rows[accepted])
        return accepted

    # ---- the script
    def run(self):
        opts, eng = self.opts, self.engine
        m = opts.max_write
        sids = []
        for prompt in self.prompts:
            sid = eng.open()
            sids.append(sid)
            self.history[sid], self.generated[sid] = [], []
            self.origin[sid], self.prompt_len[sid] = "prompt", len(prompt)
        self.live = list(sids)
        fed = {sid: 0 for sid in sids}

        # 1. chunked prefill (mixed with decode once a prompt is in)
        prompt_of = dict(zip(sids, self.prompts))
        first, chunked = True, []
        while any(fed[s] < len(prompt_of[s]) for s in sids):
            feeds, roles = [], []
            for sid in sids:
                prompt = prompt_of[sid]
                if fed[sid] >= len(prompt):
                    feeds.append(self._decode_feed(sid))
                    roles.append("decode")
                    continue
                chunk = prompt[fed[sid]:fed[sid] + m]
                if first and sid == sids[0] and len(chunk) >= 2:
                    h = len(chunk) // 2   # two abutting inputs of one session: one run
                    feeds += [(sid, fed[sid], chunk[:h]), (sid, fed[sid] + h, chunk[h:])]
                    roles += ["prefill", "prefill"]
                    chunked.append(f"session {sid}: {h}+{len(chunk) - h} tokens as two "
                                   f"abutting inputs of one step")
                else:
                    feeds.append((sid, fed[sid], chunk))
                    roles.append("prefill")
                if fed[sid] == 0 and len(prompt) > m:
                    chunked.append(f"session {sid}: {len(prompt)} tokens over "
                                   f"{-(-len(prompt) // m)} steps")
            kind = "+".join(sorted(set(roles), reverse=True))
            rows = self._step(kind, feeds, pad=first)
            for (sid, start, tokens), role, r in zip(feeds, roles, rows):
                if role == "decode":
                    self._sample(sid, r[-1])
                    continue
                fed[sid] = start + len(tokens)
                if fed[sid] == len(prompt_of[sid]):
                    self._sample(sid, r[-1])    # the prompt's last chunk samples
            first = False
        self.features["chunked prefill"] = "; ".join(chunked)

        # 2. batched decode
        self._decode_all()

        # 3. speculative draft on the first session, partly rejected
        spec = sids[0]
        draft = self._draft(spec, opts.draft, opts.accept)
        start = len(self.history[spec])
        rows = self._decode_all("draft verify", pad=True,
                                extra=[(spec, start, [self.pending[spec]] + draft)])
        accepted = self._verify(spec, rows[0], draft)
        self._decode_all("decode (rewinds)")
        self.features["speculative draft"] = (
            f"session {spec}: drafted {len(draft)}, accepted {accepted}, rewound "
            f"{len(draft) - accepted} (pack with start < cursor)")

        # 4. fork one position back, continuing with another token
        src = sids[1 % len(sids)]
        upto = len(self.history[src]) - 1
        fork = eng.clone(src, upto)
        self.history[fork] = self.history[src][:upto]
        self.generated[fork] = []
        self.origin[fork] = f"fork of {src} at {upto}"
        self.prompt_len[fork] = upto
        self.pending[fork] = (self.history[src][upto] + 1) % (opts.vocab - 1)
        self.live.append(fork)
        self._decode_all("decode (fork)", pad=True)
        self.features["fork"] = (f"session {fork} = clone of session {src} up to position "
                                 f"{upto}, continued with token {self.history[fork][upto]} "
                                 f"instead of {self.history[src][upto]}")

        # 5. a draft block (bidirectional), its proposals verified causally
        blk = sids[2 % len(sids)]
        start = len(self.history[blk])
        block_tokens = [self.pending[blk]] + [opts.mask_token] * (opts.block - 1)
        rows = self._decode_all("draft block", extra=[(blk, start, block_tokens)],
                                blocks=[blk])
        proposals = [int(np.argmax(r)) for r in rows[0][:-1]]
        self.history[blk] = self.history[blk][:start]      # the block is a draft: dropped
        rows = self._decode_all("block verify", pad=True,
                                extra=[(blk, start, [self.pending[blk]] + proposals)])
        accepted_b = self._verify(blk, rows[0], proposals)
        self._decode_all("decode (rewinds)")
        self.features["draft block"] = (
            f"session {blk}: a {opts.block}-token bidirectional block proposed {proposals}; "
            f"{accepted_b} accepted on causal verification")

        # 6. plain decode
        for i in range(opts.decode_steps):
            self._decode_all(pad=i % 2 == 1)
        padded = sum(1 for n, w in self.widths if w > n)
        self.features["padding"] = f"{padded} of {self.n_steps} steps padded to a static width"
        for sid in list(self.live):
            eng.close(sid)
        return self

    def _draft(self, sid, n, right):
        """A draft of `n` tokens whose first `right` are the target's greedy continuation
        (computed cache-free) and the next one is wrong, so verification rejects the tail."""
        tokens = self.history[sid] + [self.pending[sid]]
        draft = []
        for i in range(n):
            _, logits = self.model.forward(tokens)
            best = int(np.argmax(logits[-1]))
            if i < right:
                token = best
            elif i == right:
                token = (best + 1) % (self.opts.vocab - 1)
            else:
                token = int(self.rng.integers(0, self.opts.vocab - 1))
            draft.append(token)
            tokens = tokens + [token]
        return draft


def max_step_for(opts: Options) -> int:
    n = opts.sessions + 1
    return -(-(opts.max_write * n + 8) // 8) * 8


def cache_config(opts: Options) -> CacheConfig:
    layers = [flat() if w is None else ring(window=w) for w in opts.layers]
    return CacheConfig(layers=layers, n_kv_heads=opts.kv_heads, head_dim=opts.head_dim,
                       capacity=256, max_seqs=opts.sessions + 1, max_write=opts.max_write,
                       max_step=max_step_for(opts), dtype=opts.dtype, page_size=8,
                       initial_pages=2)


def build_model(opts: Options) -> DemoModel:
    return DemoModel.random(opts.seed, vocab=opts.vocab, d_model=opts.d_model,
                            n_q_heads=opts.q_heads, n_kv_heads=opts.kv_heads,
                            head_dim=opts.head_dim, windows=tuple(opts.layers))


def planned_steps(opts: Options) -> int:
    prompts = prompts_for(opts)
    prefill = max(-(-len(p) // opts.max_write) for p in prompts)
    return prefill + 7 + opts.decode_steps


# ---------------------------------------------------------------------------- run / main
def run(*, out=sys.stdout, tamper=None, tamper_step=None, fail_fast=False, **options) -> DemoResult:
    """Run the demo; `options` are `Options` fields. Prints progress to `out` (None: silent).

    `tamper(cache, table)` runs once, right after step `tamper_step` commits.
    """
    opts = Options(**options)
    opts.validate()
    started = time.perf_counter()
    with device.simulator_pace():
        return _run(opts, out, tamper, tamper_step, fail_fast, started)


def _run(opts, out, tamper, tamper_step, fail_fast, started) -> DemoResult:
    model = build_model(opts)
    config = cache_config(opts)
    prompts = prompts_for(opts)
    cached = CacheEngine(model, config)
    total = planned_steps(opts)
    checked = CheckedEngine(cached, ReferenceEngine(model), opts.dtype, out=out, tamper=tamper,
                            tamper_step=tamper_step, fail_fast=fail_fast, total_steps=total)
    if out is not None:
        print(_header(opts, config, prompts, cached.cache), file=out, flush=True)
        print(STEP_HEADER, file=out, flush=True)
    flat_layers = [i for i, w in enumerate(opts.layers) if w is None]
    pages_before = cached.cache.layer_data(flat_layers[0])[0].shape[0] if flat_layers else None
    scenario = Scenario(checked, model, opts, prompts)
    completed = True
    try:
        scenario.run()
    except _Stop as stop:
        completed = False
        if out is not None:
            print(f"  {stop}", file=out, flush=True)
    mismatches = [p for r in checked.reports for p in r.problems]

    # the independent replay: the same script on the reference alone
    replay = Scenario(ReferenceEngine(model), model, opts, prompts)
    replay_error = None
    try:
        replay.run()
    except Exception as exc:  # noqa: BLE001  (a replay that cannot follow is a mismatch too)
        replay_error = exc
        mismatches.append(f"the cache-free replay failed: {exc!r}")
    sessions = []
    for sid in scenario.generated:
        ref = replay.generated.get(sid, [])
        report = SessionReport(sid, scenario.origin[sid], scenario.prompt_len[sid],
                               scenario.generated[sid], ref,
                               sid not in checked.bad_sessions and "*" not in checked.bad_sessions)
        if completed and replay_error is None and report.generated != ref:
            mismatches.append(f"session {sid}: generated {report.generated} but the cache-free "
                              f"replay generated {ref}")
        sessions.append(report)
    features = dict(scenario.features)
    ring_layers = [(i, w) for i, w in enumerate(opts.layers) if w is not None]
    if ring_layers:
        rows = min(256, ring_layers[0][1] + opts.max_write - 1)
        features["ring wrap"] = (f"ring layer {ring_layers[0][0]} (W={ring_layers[0][1]}) holds "
                                 f"{rows} rows; sessions wrote up to position "
                                 f"{scenario.max_pos - 1}")
    if flat_layers:
        pages_after = cached.cache.layer_data(flat_layers[0])[0].shape[0]
        features["flat growth"] = (f"the flat layers' pool grew from {pages_before} to "
                                   f"{pages_after} pages of {config.page_size} positions; "
                                   f"forks shared their prefixes' pages")
    if completed:
        freed = all(int(cached.cache.state(s)) == 0 for s in range(config.max_seqs))
        features["close"] = "every session closed, every sequence slot free" if freed else \
            "sequence slots still in use after closing every session"
        if not freed:
            mismatches.append("sequence slots still in use after closing every session")
    ok = completed and not mismatches
    result = DemoResult(ok, sessions, checked.reports, mismatches, features,
                        time.perf_counter() - started, completed)
    if out is not None:
        print(report_text(result), file=out, flush=True)
    return result


STEP_HEADER = ("   step   kind                      tokens  width  segs  control ms  kernels s  "
               "check ms   max err  match")


def _step_line(r: StepReport, total) -> str:
    of = f"{r.index:>3}/{total}" if total else f"{r.index:>3}"
    return (f"  {of:<8}{r.kind:<26}{r.n_tokens:>6}  {r.width:>5}  {r.n_segments:>4}  "
            f"{r.control_ms:>10.2f}  {r.kernels_s:>9.2f}  {r.check_ms:>8.1f}  {r.max_err:>8.1e}  "
            f"{'yes' if r.ok else 'NO'}")


def _header(opts, config, prompts, cache) -> str:
    layers = ", ".join("flat" if w is None else f"ring(W={w})" for w in opts.layers)
    return (f"kvnumba demo on {'the CUDA simulator' if device.SIMULATOR else 'the GPU'}: "
            f"seed {opts.seed}, {opts.sessions} sessions + 1 fork, layers [{layers}], "
            f"{opts.q_heads} q heads / {opts.kv_heads} kv heads x {opts.head_dim}, vocab "
            f"{opts.vocab}, {opts.dtype} storage\n"
            f"cache: max_seqs {config.max_seqs}, max_write {config.max_write}, max_step "
            f"{config.max_step}, capacity {config.capacity}, {cache.nbytes} bytes at start; "
            f"prompt lengths {[len(p) for p in prompts]}\n"
            f"each step is checked against the model run per session with dense float64 "
            f"attention and no cache (kvnumba.reference)\n")


def _tokens(tokens, limit=14) -> str:
    text = " ".join(str(t) for t in tokens[:limit])
    return text + (f" ... (+{len(tokens) - limit})" if len(tokens) > limit else "")


def report_text(result: DemoResult) -> str:
    lines = ["", "  session  origin            prompt  generated tokens (cached run)"
                 "                     match"]
    for s in result.sessions:
        lines.append(f"  {s.sid:>7}  {s.origin:<16}  {s.prompt_len:>6}  "
                     f"{_tokens(s.generated):<48}  {'yes' if s.match else 'NO'}")
    lines.append("")
    for name, text in result.features.items():
        lines.append(f"  {name:<18} {text}")
    steps = result.steps
    if steps:
        kernels = sum(r.kernels_s for r in steps)
        control = sum(r.control_ms for r in steps)
        check = sum(r.check_ms for r in steps)
        lines.append(f"\n  {len(steps)} steps in {result.wall_s:.1f} s: kernels {kernels:.1f} s, "
                     f"control {control:.1f} ms, reference checks {check:.0f} ms")
    if result.ok:
        lines.append("  OK: every step and every generated token match the cache-free reference")
    else:
        lines.append(f"  FAILED: {len(result.mismatches)} mismatch(es)"
                     f"{'' if result.completed else ' (stopped early)'}")
        for m in result.mismatches[:20]:
            lines.append(f"    MISMATCH {m}")
    return "\n".join(lines)


def parse_layers(text: str) -> tuple:
    """`"flat,ring:6"` -> `(None, 6)`; `ring` alone means `ring:6`."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if part == "flat":
            out.append(None)
        elif part == "ring":
            out.append(6)
        elif part.startswith("ring:") and part[5:].isdigit() and int(part[5:]) >= 1:
            out.append(int(part[5:]))
        else:
            raise argparse.ArgumentTypeError(f"layer {part!r}: use flat or ring:W (W >= 1)")
    if not out:
        raise argparse.ArgumentTypeError("--layers needs at least one layer")
    return tuple(out)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvnumba demo",
        description="Serve several sessions of a small random-weight decoder through a "
                    "BatchedSequenceCache (chunked prefill, batched decode, a partly rejected "
                    "speculative draft, a fork, a bidirectional draft block), checking every "
                    "step and every token against the same model run without a cache. "
                    "Exits 1 on any mismatch.")
    d = Options()
    p.add_argument("--seed", type=int, default=d.seed, help="weights and prompts (default 0)")
    p.add_argument("--sessions", type=int, default=d.sessions,
                   help=f"sessions opened with a prompt; one fork is added (default {d.sessions})")
    p.add_argument("--layers", type=parse_layers, default=d.layers, metavar="SPEC",
                   help="comma-separated flat | ring:W (default flat,ring:6)")
    p.add_argument("--decode-steps", type=int, default=d.decode_steps,
                   help=f"plain decode steps at the end (default {d.decode_steps})")
    p.add_argument("--draft", type=int, default=d.draft,
                   help=f"speculative draft length (default {d.draft})")
    p.add_argument("--accept", type=int, default=d.accept,
                   help=f"draft tokens that are right by construction (default {d.accept})")
    p.add_argument("--block", type=int, default=d.block,
                   help=f"draft block length (default {d.block})")
    p.add_argument("--max-write", type=int, default=d.max_write,
                   help=f"the cache's max_write, also the prefill chunk (default {d.max_write})")
    p.add_argument("--vocab", type=int, default=d.vocab, help=f"default {d.vocab}")
    p.add_argument("--q-heads", type=int, default=d.q_heads, help=f"default {d.q_heads}")
    p.add_argument("--kv-heads", type=int, default=d.kv_heads, help=f"default {d.kv_heads}")
    p.add_argument("--head-dim", type=int, default=d.head_dim, help=f"default {d.head_dim}")
    p.add_argument("--dtype", choices=sorted(TOLERANCE), default=d.dtype,
                   help="storage dtype (default float32: greedy tokens stay stable)")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first mismatching step")
    p.add_argument("--quiet", action="store_true", help="print only the final report")
    return p


def main(argv=None, **hooks) -> int:
    """The CLI. `hooks` (`tamper`, `tamper_step`) are passed to `run` (tests use them)."""
    args = parser().parse_args(argv)
    options = dict(seed=args.seed, sessions=args.sessions, layers=args.layers,
                   decode_steps=args.decode_steps, draft=args.draft, accept=args.accept,
                   block=args.block, max_write=args.max_write, vocab=args.vocab,
                   q_heads=args.q_heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                   dtype=args.dtype)
    try:
        Options(**options).validate()
    except ValueError as exc:
        parser().error(str(exc))
    if args.quiet:
        result = run(out=None, fail_fast=args.fail_fast, **hooks, **options)
        print(report_text(result), flush=True)
    else:
        result = run(out=sys.stdout, fail_fast=args.fail_fast, **hooks, **options)
    return 0 if result.ok else 1
