"""The draft model's proposals for a step (speculative decoding): its first run prefills
the step's prompt chunks and catches each decoding sequence up to its last token, then
one run per draft token, each drawn as the sequence samples."""
from __future__ import annotations

from .seating import DRAFT

#: draft tokens proposed per step unless told otherwise (`Engine`'s `draft_len`, the
#: command lines' `--draft-len`)
DRAFT_LEN = 4


def propose(draft, schedule: list) -> dict:
    """Run `draft` (the served draft model) for the step's `schedule` (`(sequence, tokens to
    feed, draft tokens wanted)`): `{rid: (drafts, their draft probabilities or None)}` of
    each sequence that wants drafts, its draft seat fed the tokens it was run over."""
    import torch
    wanted = {s.rid: k for s, _, k in schedule if k}
    proposals = {rid: ([], []) for rid in wanted}
    inputs, rows, order, at = [], [], [], 0
    for seq, feed, k in schedule:
        seat = seq.seats[DRAFT]
        tokens = feed if seq.fed < seq.n_prompt else seq.tokens[seat.fed:]
        if seq.fed < seq.n_prompt or k:
            inputs.append((seat.sid, seat.fed, tokens))
            seat.fed += len(tokens)
            at += len(tokens)
        if k:
            rows.append(at - 1)
            order.append(seq)
    while inputs:
        logits = draft.run(inputs, rows)
        inputs, rows, still = [], [], []
        for i, seq in enumerate(order):
            drafts, probs = proposals[seq.rid]
            if seq.sampling.greedy:
                token = int(logits[i].argmax())
            else:
                p = seq.sampling.probabilities(logits[i:i + 1])
                token = int(torch.multinomial(p, 1, generator=seq.generator)[0, 0])
                probs.append(p[0])
            drafts.append(token)
            if len(drafts) < wanted[seq.rid]:      # feed it for the next one
                seat = seq.seats[DRAFT]
                inputs.append((seat.sid, seat.fed, [token]))
                seat.fed += 1
                rows.append(len(rows))
                still.append(seq)
        order = still
    return {rid: (drafts, torch.stack(probs) if probs else None)
            for rid, (drafts, probs) in proposals.items()}
