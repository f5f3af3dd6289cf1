"""The serving script: chunked prefill, batched decode, a partly rejected speculative
draft, a fork, a draft block verified causally, more decode, then every session closed.

The same script drives the checked cached run and the cache-free replay: every
decision (acceptance, proposals) follows from the logits the engine returns.
"""
from __future__ import annotations

import numpy as np

from kvnumba.reference import DemoModel

from .options import Options, padded_width, prompts_for

#: steps the script runs after the prefill, besides the plain decode steps: one decode,
#: the draft's verify and rewinding decode, the fork's decode, and the draft block's
#: block, verify and rewinding decode
SCRIPTED_STEPS = 7


def planned_steps(opts: Options) -> int:
    """How many steps the scenario runs: the longest prompt's prefill steps, the scripted
    ones and the plain decode steps."""
    prefill = max(-(-len(p) // opts.max_write) for p in prompts_for(opts))
    return prefill + SCRIPTED_STEPS + opts.decode_steps


class Scenario:
    """The script over one engine (`open`, `clone`, `close`, `step`, see `engines`).

    After `run()`: `generated[sid]` the tokens each session sampled, `origin[sid]` and
    `prompt_len[sid]` where it came from, `features` what the run exercised
    (feature -> description), `max_pos` the most positions any session reached.
    """

    def __init__(self, engine, model: DemoModel, opts: Options, prompts: list):
        self.engine, self.model, self.opts, self.prompts = engine, model, opts, prompts
        self.history: dict[int, list] = {}     # committed tokens as the script sees them
        self.pending: dict[int, int] = {}      # sampled, not yet fed
        self.generated: dict[int, list] = {}
        self.origin: dict[int, str] = {}
        self.prompt_len: dict[int, int] = {}
        self.features: dict[str, str] = {}
        self.rng = np.random.default_rng(opts.seed + 2)
        self.live: list = []
        self.padded_steps = 0
        self.n_steps = 0
        self.max_pos = 0

    # ---- steps
    def _step(self, kind, feeds, blocks=(), pad=False) -> list:
        """Run one step of `feeds` `(sid, start, tokens)`; returns each feed's logit rows
        `[len(tokens), vocab]`. `kind` labels the step where the engine keeps reports."""
        if hasattr(self.engine, "kind"):
            self.engine.kind = kind
        width = padded_width(sum(len(t) for _, _, t in feeds)) if pad else None
        out = self.engine.step(feeds, blocks, width)
        self.n_steps += 1
        self.padded_steps += pad
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

    def _decode_all(self, kind="decode", pad=False, extra=(), blocks=()) -> list:
        """A step where every live session without an `extra` feed decodes one token;
        returns the `extra` feeds' logit rows."""
        special = {f[0] for f in extra}
        feeds = [self._decode_feed(s) for s in self.live if s not in special] + list(extra)
        rows = self._step(kind, feeds, blocks, pad)
        for (sid, _, _), r in zip(feeds, rows):
            if sid not in special:
                self._sample(sid, r[-1])
        return rows[len(feeds) - len(extra):]

    def _verify(self, kind, sid, draft) -> int:
        """Feed `sid`'s pending token and its `draft` in one (padded) step, accept the
        longest draft prefix the target's greedy tokens agree with, then decode once: that
        step's input starts before the cursor, so `pack` rewinds the rejected tail away.
        Returns how many draft tokens were accepted."""
        start = len(self.history[sid])
        rows = self._decode_all(kind, pad=True,
                                extra=[(sid, start, [self.pending[sid]] + draft)])[0]
        accepted = 0
        while accepted < len(draft) and int(np.argmax(rows[accepted])) == draft[accepted]:
            accepted += 1
        self.history[sid] = self.history[sid][:start + 1 + accepted]
        self.generated[sid].extend(draft[:accepted])
        self._sample(sid, rows[accepted])
        self._decode_all("decode (rewinds)")
        return accepted

    # ---- the script
    def run(self) -> Scenario:
        """Run the whole script, every session closed at the end."""
        sids = []
        for prompt in self.prompts:
            sid = self.engine.open()
            sids.append(sid)
            self.history[sid], self.generated[sid] = [], []
            self.origin[sid], self.prompt_len[sid] = "prompt", len(prompt)
        self.live = list(sids)
        self._prefill(sids)
        self._decode_all()
        self._speculate(sids[0])
        self._fork(sids[1 % len(sids)])
        self._draft_block(sids[2 % len(sids)])
        for i in range(self.opts.decode_steps):
            self._decode_all(pad=i % 2 == 1)
        self.features["padding"] = (f"{self.padded_steps} of {self.n_steps} steps padded to "
                                    f"a static width")
        for sid in list(self.live):
            self.engine.close(sid)
        return self

    def _prefill(self, sids):
        """Chunks of `max_write` tokens, mixed with decode once a prompt is in; the first
        step feeds the first session's chunk as two abutting inputs and is padded."""
        m = self.opts.max_write
        prompt_of = dict(zip(sids, self.prompts))
        fed = {sid: 0 for sid in sids}
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

    def _speculate(self, sid):
        """A speculative draft whose first `accept` tokens are right, verified and rewound."""
        draft = self._draft(sid, self.opts.draft, self.opts.accept)
        accepted = self._verify("draft verify", sid, draft)
        self.features["speculative draft"] = (
            f"session {sid}: drafted {len(draft)}, accepted {accepted}, rewound "
            f"{len(draft) - accepted} (pack with start < cursor)")

    def _draft(self, sid, n, right) -> list:
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

    def _fork(self, src):
        """Clone `src` one position back and continue the clone with another token."""
        upto = len(self.history[src]) - 1
        fork = self.engine.clone(src, upto)
        self.history[fork] = self.history[src][:upto]
        self.generated[fork] = []
        self.origin[fork] = f"fork of {src} at {upto}"
        self.prompt_len[fork] = upto
        self.pending[fork] = (self.history[src][upto] + 1) % (self.opts.vocab - 1)
        self.live.append(fork)
        self._decode_all("decode (fork)", pad=True)
        self.features["fork"] = (f"session {fork} = clone of session {src} up to position "
                                 f"{upto}, continued with token {self.history[fork][upto]} "
                                 f"instead of {self.history[src][upto]}")

    def _draft_block(self, sid):
        """A bidirectional draft block of `block` tokens (the pending one, then mask
        tokens); its proposals are dropped, then verified causally like any draft."""
        start = len(self.history[sid])
        block = [self.pending[sid]] + [self.opts.mask_token] * (self.opts.block - 1)
        rows = self._decode_all("draft block", extra=[(sid, start, block)], blocks=[sid])[0]
        proposals = [int(np.argmax(r)) for r in rows[:-1]]
        self.history[sid] = self.history[sid][:start]      # the block is a draft: dropped
        accepted = self._verify("block verify", sid, proposals)
        self.features["draft block"] = (
            f"session {sid}: a {self.opts.block}-token bidirectional block proposed "
            f"{proposals}; {accepted} accepted on causal verification")
