"""A sequence's seats in the served models (the model's, then its draft's), each verb on
them written once over the models: opened at one position, forked, offered to the prefix
indexes, closed."""
from __future__ import annotations

from .requests import Seat

#: where each served model stands in `Seating.models`, and its seat in a sequence's `seats`
MODEL, DRAFT = 0, 1


class Seating:
    """The served models of an engine (`models`: the model's, then its draft's when there
    is one) and the verbs on a sequence's seats in them. With `prefix_cache`, seats open
    from the prefix indexes and offer them their completed pages of `page_size`."""

    def __init__(self, models: list, *, prefix_cache: bool, page_size: int):
        self.models = models
        self.prefix_cache = prefix_cache
        self.page_size = page_size

    def open(self, seq) -> None:
        """Seat `seq` in every served model at one position: with the prefix cache, the
        shortest of the caches' hits on its prompt (each cache's later pages are
        recomputed), so the draft is always fed the tokens the model is fed, at the same
        positions. A refusal closes what it opened."""
        models = self.models
        prompt = seq.tokens[:seq.n_prompt]
        hits = [served.indexed(prompt, seq.extra) if self.prefix_cache else 0
                for served in models]
        sids = []
        try:
            for served, hit in zip(models, hits):
                sids.append(self._open_at(served, seq, min(hits), hit))
            # a match is shortened where a ring pool cannot spare its rows: reopen the
            # longer sessions at the shortest until they agree (positions only fall)
            while len({served.table.pos(sid) for served, sid in zip(models, sids)}) > 1:
                upto = min(served.table.pos(sid) for served, sid in zip(models, sids))
                for i, served in enumerate(models):
                    if served.table.pos(sids[i]) > upto:
                        served.close(sids[i])
                        sids[i] = self._open_at(served, seq, upto, upto + 1)
        except BaseException:
            for served, sid in zip(models, sids):
                served.close(sid)
            raise
        at = models[MODEL].table.pos(sids[MODEL])
        seq.seats = [Seat(sid, fed=at, offered=at) for sid in sids]

    def _open_at(self, served, seq, upto: int, hit: int) -> int:
        """A session of `served`'s table for `seq` holding at most `upto` positions of its
        prompt from the prefix index, whose own hit on the prompt is `hit` (the whole
        prompt is looked up unless that is more; without the prefix cache: empty)."""
        if not self.prefix_cache:
            return served.open()
        end = upto + 1 if hit > upto else seq.n_prompt
        return served.open(seq.tokens[:end], seq.extra)

    def forked(self, seq) -> list:
        """Seats for a fork of `seq`: in each served model, a clone of its session, at its
        positions."""
        return [Seat(served.clone(seat.sid), fed=seat.fed, offered=seat.offered)
                for served, seat in zip(self.models, seq.seats)]

    def register(self, seqs) -> None:
        """Offer each of `seqs`' newly completed pages of committed positions to each
        served model's prefix index (the ring layers keep a page's rows only while their
        windows cover them: registered at once, step by step)."""
        size = self.page_size
        for seq in seqs:
            for served, seat in zip(self.models, seq.seats):
                if seat.fed // size > seat.offered // size:
                    served.register(seat.sid, seq.tokens[:seat.fed])
                    seat.offered = seat.fed

    def close(self, seq) -> None:
        """Close `seq`'s sessions (those it has opened)."""
        for served, seat in zip(self.models, seq.seats):
            served.close(seat.sid)
        seq.seats = []
