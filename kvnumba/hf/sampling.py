"""Choosing tokens from logits on the logits' device: greedy, temperature and top-p
sampling, and the acceptance rule of speculative decoding."""
from __future__ import annotations

from dataclasses import dataclass

from ..args import as_finite
from ..errors import ConfigError


@dataclass(frozen=True)
class Sampling:
    """How a request picks its tokens (`temperature=0`: greedy)."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self):
        temperature = as_finite(self.temperature, "temperature")
        if temperature < 0:
            raise ConfigError(f"temperature={temperature}: must be >= 0 (0 is greedy)")
        top_p = as_finite(self.top_p, "top_p")
        if not 0 < top_p <= 1:
            raise ConfigError(f"top_p={top_p}: must be in (0, 1]")
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probabilities(self, logits):
        """`[n, vocab]` float32 probabilities after temperature and top-p (the smallest
        set of most likely tokens whose mass reaches `top_p`, renormalised)."""
        import torch
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p < 1:
            ordered, order = probs.sort(dim=-1, descending=True)
            before = ordered.cumsum(dim=-1) - ordered      # mass of the more likely ones
            ordered[before >= self.top_p] = 0
            probs = torch.zeros_like(probs).scatter(-1, order, ordered)
            probs /= probs.sum(dim=-1, keepdim=True)
        return probs

    def choose(self, logits, generator):
        """One token per row of `logits [n, vocab]` (a tensor of `n` ids)."""
        import torch
        if self.greedy:
            return logits.argmax(dim=-1)
        return torch.multinomial(self.probabilities(logits), 1, generator=generator)[:, 0]

    def accept(self, target_logits, drafts, draft_probs, generator) -> list:
        """Speculative decoding's verdict on `drafts` (k ids) given the target's logits
        at the k + 1 rows that predict them and the token after: the accepted drafts,
        then one token of the target's own (the correction at the first rejection, or
        the bonus after the last draft). Greedy: a draft stands while it is the
        target's argmax, so the output is the target's greedy output. Sampling: draft
        `d` stands with probability `min(1, p(d) / q(d))`, a rejection samples from
        `max(0, p - q)` renormalised, which keeps the target's distribution."""
        import torch
        if self.greedy:
            best = target_logits.argmax(dim=-1).tolist()
            taken = []
            for draft, want in zip(drafts, best):
                if draft != want:
                    break
                taken.append(draft)
            return taken + [best[len(taken)]]
        p = self.probabilities(target_logits)
        taken = []
        for i, draft in enumerate(drafts):
            ratio = p[i, draft] / draft_probs[i, draft]
            if torch.rand((), generator=generator, device=p.device) < ratio:
                taken.append(draft)
                continue
            rest = (p[i] - draft_probs[i]).clamp_min(0)
            return taken + [int(torch.multinomial(rest / rest.sum(), 1, generator=generator))]
        return taken + [int(torch.multinomial(p[len(drafts)], 1, generator=generator))]

