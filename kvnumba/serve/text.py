"""A sequence's tokens as text, streamed (`TextStream`): each piece the text the tokens
so far add, held back while it may still become a stop string or ends in a broken
character, cut before the first stop string."""
from __future__ import annotations


class TextStream:
    """The text of one sequence's tokens, given as they come (`add`), decoded whole by
    `tokenizer` (special tokens left out) so the pieces join to `tokenizer.decode` of
    every token; `stop`: strings that end the text (left out of it)."""

    def __init__(self, tokenizer, stop: tuple = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.tokens: list = []
        self.sent = 0               # characters of the text given out so far
        self.stopped = False        # a stop string was found: the text is complete

    def add(self, tokens: list, last: bool = False) -> str:
        """The text `tokens` add to what was given out (`last`: no more tokens come, so
        nothing is held back)."""
        if self.stopped:
            return ""
        self.tokens += tokens
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = min((i for i in (text.find(s, max(self.sent - len(s) + 1, 0))
                               for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._give(text[:cut])
        if last:
            return self._give(text)
        safe = len(text)
        if text.endswith("\ufffd"):             # a character split over tokens
            safe -= 1
        for s in self.stop:                     # a stop string may be starting
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    safe = min(safe, len(text) - k)
                    break
        return self._give(text[:max(safe, self.sent)])

    def _give(self, text: str) -> str:
        piece = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return piece
