"""`python -m kvnumba demo`: a small decoder serving several sessions through the cache,
checked step by step against the same model run on each session alone, with no cache.

The model (`reference.DemoModel`) has random weights: token embedding, layers with
GQA attention and rotary positions (at least one flat layer and one sliding-window
ring layer by default), a ReLU MLP, residuals and an output head; it samples
greedily. The sessions live in one `BatchedSequenceCache` (float32 storage, so the
greedy tokens are stable) behind a `SessionTable`; every step goes through the step
driver `kvnumba.run_inputs` (pack, declare, prepare, the model, commit). The run goes
through:

1. chunked prefill: prompts of different lengths, one fed as two abutting chunks in
   one step, a longer one over two steps while the others already decode;
2. batched decode (some steps padded to a static width);
3. a speculative draft of several tokens of which only a prefix is right: the whole
   draft is written, the verified prefix kept, and the next step's input starts
   before the session's cursor, so `SessionTable.pack` rewinds the rest away;
4. a fork (`SessionTable.clone` one position back) that continues with another token;
5. a draft block (`run_inputs(..., blocks=[sid])`, bidirectional within itself)
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

The modules: `options` (the options, the cache config and model they imply),
`engines` (the cached and the cache-free engine), `checker` (the lockstep comparison),
`scenario` (the script), `runner` (`run`: the checked run and the replay), `report`
(the reports and their text), `cli` (`main`).
"""
from __future__ import annotations

from .cli import main, parser
from .options import TOLERANCE, Options
from .report import DemoResult, SessionReport, StepReport, report_text
from .runner import run

__all__ = ["TOLERANCE", "DemoResult", "Options", "SessionReport", "StepReport", "main",
           "parser", "report_text", "run"]
