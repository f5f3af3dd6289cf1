"""Prompts run to completion through an `Engine` by `submit` / `step`, with a progress bar while
stderr is a terminal (the loop `python -m kvnumba generate` and its self-check share)."""
from __future__ import annotations

import sys
import time


class ProgressBar:
    """A one-line progress bar of tokens generated, redrawn in place with `\\r`.

    Drawn only on a terminal (`stream.isatty()`): piped or captured, it writes nothing,
    so logs get no `\\r` frames. `most` is the most tokens the requests may generate;
    eos can end them sooner, so `close` shows the count generated, not `most`."""

    WIDTH = 30

    def __init__(self, most: int, stream=None):
        self.most = max(most, 1)
        self.stream = sys.stderr if stream is None else stream
        self.shown = self.stream.isatty()
        self.started = time.perf_counter()
        self.last = 0           # length of the last frame, to blank what a shorter one leaves

    def _draw(self, filled: int, figure: str, done: int, end: str = "") -> None:
        rate = done / max(time.perf_counter() - self.started, 1e-9)
        frame = (f"[{'#' * filled}{' ' * (self.WIDTH - filled)}] {figure} tokens, "
                 f"{rate:.1f} tokens/s")
        print("\r" + frame.ljust(self.last), end=end, file=self.stream, flush=True)
        self.last = len(frame)

    def update(self, done: int) -> None:
        """Redraw at `done` tokens generated of `most`."""
        if self.shown:
            self._draw(self.WIDTH * min(done, self.most) // self.most, f"{done}/{self.most}",
                       done)

    def close(self, done: int) -> None:
        """The last frame: full, at the `done` tokens generated, and a newline."""
        if self.shown:
            self._draw(self.WIDTH, f"{done}", done, end="\n")


def serve(engine, prompts, *, n: int = 1, seed: int | None = None, stream=None,
          **options) -> tuple[list, float]:
    """Serve `prompts` (token id lists) by `submit` / `step` with a `ProgressBar` on
    `stream` (default stderr). `options` go to `submit` (`max_new_tokens`, `temperature`,
    `top_p`, `eos_token_id`); prompt `i` is seeded with `seed + i`, as `Engine.generate`
    seeds it. Returns (per prompt, its `n` sequences of new tokens; seconds)."""
    started = time.perf_counter()
    rids = [engine.submit(prompt, n=n, seed=None if seed is None else seed + i, **options)
            for i, prompt in enumerate(prompts)]
    bar = ProgressBar(len(prompts) * n * options["max_new_tokens"], stream)
    results, done = {}, 0
    while engine.busy:
        for rid, tokens in engine.step():
            results[rid] = tokens if n > 1 else [tokens]
            done += sum(map(len, results[rid]))
        bar.update(done)
    bar.close(done)
    return [results[rid] for rid in rids], time.perf_counter() - started
