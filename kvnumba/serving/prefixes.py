"""The prefix-index side of a session table (contract §14): a session opened from the
indexed prefix of its prompt, its committed pages offered to the index as it grows, the
page keys kept per session (`SessionPrefixes`), and what the index has served
(`PrefixStats`). Where the control is no `PrefixControl` every session starts empty and
nothing is indexed."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..arith.prefix_keys import KeyChain, extra_bytes, token_ids
from ..protocol import BatchControl


class PrefixStats(NamedTuple):
    """The prefix index seen from a session table (`SessionTable.prefix_stats`): prompt
    `tokens_looked_up` by `open(prefix=...)`, `tokens_hit` (served from the index), and
    the control's `pages_evicted`; `hit_rate` is hit over looked up."""

    tokens_looked_up: int
    tokens_hit: int
    pages_evicted: int

    @property
    def hit_rate(self) -> float:
        return self.tokens_hit / self.tokens_looked_up if self.tokens_looked_up else 0.0


class SessionPrefixes:
    """Each open session's page keys and how far the index holds its pages.

    control:  the BatchControl the sessions' sequences live in.
    indexed:  whether it is a `PrefixControl` (checked once, by the session table).
    """

    def __init__(self, control: BatchControl, *, indexed: bool):
        self.control = control
        self.indexed = bool(indexed)
        self._chains: dict[int, KeyChain] = {}     # sid -> its page keys so far
        # sid -> (its leading pages indexed, its pages offered to the index)
        self._indexed: dict[int, tuple] = {}
        self.tokens_looked_up = self.tokens_hit = 0

    def claim(self, tokens: np.ndarray | None, extra: bytes) -> tuple:
        """`(seq, chain)`: a fresh sequence for a session opening with prompt `tokens`
        (None: no prompt) and the session's key chain under `extra`. The sequence holds
        the longest indexed prefix of all but the last token, in whole pages, where the
        control has an index. The control's refusals propagate, nothing changed."""
        chain = KeyChain(int(self.control.config.page_size), extra)
        if tokens is not None and self.indexed:
            keys = chain.keys(tokens[:max(0, tokens.size - 1)])
            return int(self.control.seq_from_prefix(keys)), chain
        return int(self.control.seq_new()), chain

    def opened(self, sid: int, seq: int, chain: KeyChain, tokens: np.ndarray | None) -> None:
        """Session `sid` opened on `seq` (`claim`'s) with prompt `tokens`: keep its chain
        and count its prompt's hit."""
        self._chains[int(sid)] = chain
        hit = int(self.control.pos(seq))
        self._indexed[int(sid)] = (hit // chain.page_size,) * 2
        if tokens is not None:
            self.tokens_looked_up += int(tokens.size)
            self.tokens_hit += hit

    def register(self, sid: int, seq: int, ids: np.ndarray) -> int:
        """Offer session `sid`'s (sequence `seq`'s) committed pages of token ids `ids`
        (from position 0) to the index; returns its leading pages indexed (0 without an
        index). Pages offered before and unchanged are not offered again."""
        if not self.indexed:
            return 0
        chain = self._chains[int(sid)]
        keys = chain.keys(ids[:min(ids.size, int(self.control.pos(seq)))])
        indexed, tried = self._indexed[int(sid)]
        indexed, tried = min(indexed, chain.fresh), min(tried, chain.fresh)
        if len(keys) > tried:             # pages not offered yet: one call for them all
            indexed, tried = int(self.control.prefix_register(seq, keys)), len(keys)
        self._indexed[int(sid)] = (indexed, tried)
        return indexed

    def forget(self, tokens, extra_key) -> int:
        """Drop the index entries of `tokens`' whole pages under `extra_key`; returns how
        many were indexed (0 without an index)."""
        chain = KeyChain(int(self.control.config.page_size), extra_bytes(extra_key))
        keys = chain.keys(token_ids(tokens, "forget tokens"))
        return int(self.control.prefix_forget(keys)) if self.indexed else 0

    def cloned(self, src: int, dst: int, keep: int) -> None:
        """Session `dst` cloned from `src`'s first `keep` positions: a copy of its chain,
        its indexed pages cut at `keep`."""
        chain = self._chains[int(src)].copy()
        self._chains[int(dst)] = chain
        self._indexed[int(dst)] = tuple(min(n, keep // chain.page_size)
                                        for n in self._indexed[int(src)])

    def closed(self, sid: int) -> None:
        """Session `sid` closed: forget its keys."""
        self._chains.pop(int(sid), None)
        self._indexed.pop(int(sid), None)

    @property
    def stats(self) -> PrefixStats:
        """Tokens looked up and hit by `claim`ed prompts, the control's pages evicted."""
        evicted = self.control.prefix_counts.pages_evicted if self.indexed else 0
        return PrefixStats(self.tokens_looked_up, self.tokens_hit, evicted)
