"""The step itself: which tokens of the running sequences it feeds within `max_step`
(`schedule`), the model run over them that verifies the drafts and chooses each sequence's
tokens, the forks of a request whose prompt is done, and the sequences it finishes."""
from __future__ import annotations

from dataclasses import replace

from .seating import MODEL


class Stepper:
    """Steps of the `roster`'s running sequences, seated by `seating`, within the model's
    cache `config`; `draft_len` draft tokens at most per decoding sequence (0: no draft);
    `counts` gains the drafts proposed and accepted."""

    def __init__(self, *, roster, seating, counts, config, draft_len: int):
        self.roster, self.seating, self.counts = roster, seating, counts
        self.config, self.draft_len = config, draft_len

    def schedule(self) -> list:
        """`(sequence, tokens to feed, draft tokens wanted)` for this step, within
        `max_step` tokens: decoding sequences first, then prompt chunks."""
        budget, schedule = self.config.max_step, []
        running = self.roster.running
        for seq in [s for s in running if s.fed >= s.n_prompt]:
            room = self.config.capacity - len(seq.tokens)
            k = min(self.draft_len, room, seq.max_new - len(seq.new) - 1)
            feed = seq.tokens[seq.fed:]
            if len(feed) + k > budget:
                continue
            budget -= len(feed) + k
            schedule.append((seq, feed, k))
        for seq in running:
            if seq.fed < seq.n_prompt and budget > 0:
                chunk = min(self.config.max_write, seq.n_prompt - seq.fed, budget)
                budget -= chunk
                schedule.append((seq, seq.tokens[seq.fed:seq.fed + chunk], 0))
        return schedule

    def verify(self, schedule: list, drafts: dict) -> None:
        """Run the model over the step: prompt chunks, decoding tokens and the drafts to
        verify (`drafts`: `speculative.propose`'s); choose each sequence's tokens."""
        inputs, rows, spans = [], [], []
        at = 0
        for seq, feed, _ in schedule:
            proposed = drafts.get(seq.rid, ([], None))[0]
            tokens = feed + proposed
            inputs.append((seq.seats[MODEL].sid, seq.fed, tokens))
            at += len(tokens)
            ends_prompt = seq.fed + len(feed) >= seq.n_prompt
            first = at - len(proposed) - 1
            picks = list(range(first, at)) if ends_prompt else []
            spans.append((len(rows), len(picks)))
            rows += picks
        logits = self.seating.models[MODEL].run(inputs, rows)
        for (seq, feed, _), (row, count) in zip(schedule, spans):
            seat = seq.seats[MODEL]
            seat.fed += len(feed)
            if not count:
                continue
            proposed, probs = drafts.get(seq.rid, ([], None))
            chosen = seq.sampling.accept(logits[row:row + count], proposed, probs,
                                         seq.generator)
            self.counts.proposed += len(proposed)
            self.counts.accepted += len(chosen) - 1
            if seq.n > 1:                          # prompt done: fork it
                self._fork(seq, logits[row:row + 1])
            seat.fed = len(seq.tokens) + len(chosen) - 1
            seq.tokens += chosen
            for other in seq.seats[MODEL + 1:]:    # the draft's: as far as the model's
                other.fed = min(other.fed, seat.fed)
            seq.finish_if_due()

    def _fork(self, seq, logits) -> None:
        """`seq.n - 1` copies of a sequence whose prompt is prefilled, each with its own
        generator and its own first token from the same logits."""
        import torch
        for _ in range(1, seq.n):
            generator = torch.Generator(device=self.seating.models[MODEL].device)
            generator.manual_seed(int(torch.randint(2**62, (), generator=seq.generator)))
            child = replace(seq, tokens=list(seq.tokens), seed=None, n=1, generator=generator,
                            seats=self.seating.forked(seq), done=False)
            child.tokens.append(int(seq.sampling.choose(logits, generator)[0]))
            child.seats[MODEL].fed = len(child.tokens) - 1
            child.finish_if_due()
            seq.group.append(child)
            self.roster.running.append(child)
        seq.n = 1

    def retire(self) -> list:
        """Close the sessions of finished sequences; `(rid, tokens)` of each request all
        of whose sequences are done (`n > 1`: the list of their token lists)."""
        finished, reported = [], set()
        running = self.roster.running
        for seq in [s for s in running if s.done]:
            running.remove(seq)
            self.seating.close(seq)
            group = seq.group
            if id(group) not in reported and all(s.done for s in group) and group[0].n == 1:
                reported.add(id(group))
                outs = [s.new for s in group]
                finished.append((seq.rid, outs if len(outs) > 1 else outs[0]))
        return finished
