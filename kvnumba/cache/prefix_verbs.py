"""The prefix index verbs of a `BatchedSequenceCache` (contract §14): `prefix_match`,
`seq_from_prefix`, `prefix_register`, `prefix_forget`, `prefix_clear`, over the cache's
slots, pool (its `PrefixIndex`) and step machine."""
from __future__ import annotations

from ..arith.prefix_keys import as_keys
from ..device import on_its_device


class PrefixVerbs:
    """The prefix index verbs (module doc) of a cache that has `_slots`, `_pool`,
    `_steps`, `_clone_upload`, `config`, `seq_new`, `_id`, `_live` and `_lowest_free`."""

    def prefix_match(self, keys) -> int:
        """How many leading page keys of `keys` (`prefix_keys.page_keys`) the prefix index
        holds: the pages `seq_from_prefix(keys)` would share. Changes nothing. On a cache with
        state layers a match ends at the deepest page the index holds a state snapshot
        of (contract §17)."""
        return self._pool.index.match(as_keys(keys, "prefix_match keys"))

    @on_its_device
    def seq_from_prefix(self, keys) -> int:
        """Claim the lowest free slot holding the longest indexed prefix of `keys`: `m =
        prefix_match(keys)` pages. With `m = 0` it is `seq_new`. Otherwise the sequence
        shares the matched flat pages (copy-on-write, as a clone), each ring layer gets
        back the positions it reads before the match point `L = m * page_size`, and it is
        COMMITTED at `pos = L` with high-water `L + max_write` when there are ring layers
        (`CacheConfig.resumed_high_water`: its floor is `L`), else `L`. A match is shortened
        where the sequence's rings would need the match's own ring rows (`pos` says
        where it starts). Refused as `seq_new` (`CacheFullError`, `CapacityError`),
        nothing changed."""
        self._steps.machine.require_idle("seq_from_prefix")
        keys = as_keys(keys, "seq_from_prefix keys")
        keys = keys[:self._pool.index.match(keys)]
        if not keys:
            return self.seq_new()
        seq = self._lowest_free("seq_from_prefix")
        next_state = self._slots.check_one("clone_into", seq)
        shared = self._pool.start(seq, keys, self._clone_upload, "seq_from_prefix")
        if not shared:                 # shortened to nothing: a fresh sequence
            self._slots.apply("seq_new", seq, self._slots.check_one("seq_new", seq))
            self._slots.pos[seq] = self._slots.high_water[seq] = 0
            return seq
        self._slots.apply("clone_into", seq, next_state)
        self._slots.pos[seq] = pos = shared * self.config.page_size
        self._slots.high_water[seq] = self.config.resumed_high_water(pos)
        return seq

    @on_its_device
    def prefix_register(self, seq: int, keys) -> int:
        """Index sequence `seq`'s committed pages of positions under `keys` (`keys[i]`:
        the key of positions `[i P, (i + 1) P)`, `prefix_keys.page_keys` of the tokens it
        holds; at most `pos // page_size` of them are used). Pages already indexed are
        marked used; a new one shares its flat page with the index and copies the rows a
        later match needs out of each ring. A ring keeps those rows only while its
        window covers them: register after each `commit_step` (a page whose rows the
        ring has overwritten, and every page after it, stays out), and before a
        rewind. Ring pages for the index come from free or cached pages (the least
        recently used nodes are evicted, never this chain's); registration stops where
        none is left (a ring pool may grow for them, as for any verb: `CapacityError`,
        nothing changed, when that growth fails). On a cache with state layers it also
        snapshots the states at the last page it indexes and every `snapshot_interval`
        positions, where the sequence can still rebuild them (at or past its floor).
        Returns the leading keys a match now shares (`prefix_match`)."""
        self._steps.machine.require_idle("prefix_register")
        seq = self._live(self._id(seq, "prefix_register"), "prefix_register")
        keys = as_keys(keys, "prefix_register keys")
        pos = int(self._slots.pos[seq])
        keys = keys[:pos // self.config.page_size]
        first = self._pool.index.first_registrable(pos, int(self._slots.high_water[seq]))
        return self._pool.register(seq, keys, first, self._clone_upload, "prefix_register",
                                   pos, int(self._slots.high_water[seq]))

    def prefix_forget(self, keys) -> int:
        """Drop the index entries of `keys` (their pages go back to the sequences holding
        them, or free); returns how many were indexed."""
        self._steps.machine.require_idle("prefix_forget")
        return self._pool.index.forget(as_keys(keys, "prefix_forget keys"))

    def prefix_clear(self) -> int:
        """Drop every index entry; returns how many there were."""
        self._steps.machine.require_idle("prefix_clear")
        return self._pool.index.clear()

