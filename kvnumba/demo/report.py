"""The demo's reports (`StepReport` per step, `SessionReport` per session, `DemoResult`
of a run) and their text: the header, one line per step, and the final report."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import kvnumba as kv

if TYPE_CHECKING:   # names for the annotations only
    from .options import Options

#: generated tokens shown per session before the rest are counted
SHOWN_TOKENS = 14
#: mismatch lines the final report lists
REPORTED_MISMATCHES = 20

STEP_HEADER = ("   step   kind                      tokens  width  segs  control ms  kernels s  "
               "check ms   max err  match")


SESSION_HEADER = ("  session  origin            prompt  generated tokens (cached run)"
                  "                     match")


@dataclass
class StepReport:
    """One step of the cached run and its comparison with the reference."""

    index: int
    kind: str
    n_tokens: int
    width: int
    n_segments: int
    control_ms: float       # pack + declare + prepare + commit (host)
    kernels_s: float        # update_and_attend over all layers (incl. simulated copies)
    check_ms: float         # the cache-free reference of the step's sessions
    max_err: float          # largest |cache - reference| over attention outputs
    problems: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """The step matched the reference."""
        return not self.problems


@dataclass
class SessionReport:
    """One session of the run: where it came from and what each run generated."""

    sid: int
    origin: str             # "prompt", or "fork of S at P"
    prompt_len: int
    generated: list         # tokens the cached run sampled
    reference: list         # tokens the cache-free replay sampled
    steps_ok: bool          # every step that touched the session matched the reference

    @property
    def match(self) -> bool:
        """Every step matched and both runs generated the same tokens."""
        return self.steps_ok and self.generated == self.reference


@dataclass
class DemoResult:
    """What `run` returns: `ok` only when the run completed without a mismatch."""

    ok: bool
    sessions: list          # SessionReport per session, in opening order
    steps: list             # StepReport per step
    mismatches: list        # one line per difference found
    features: dict          # what the run exercised, feature -> description
    wall_s: float
    completed: bool         # False when --fail-fast stopped the run early


def step_line(r: StepReport, total: int | None) -> str:
    """One row under `STEP_HEADER`; `total`: the steps planned (None: not shown)."""
    of = f"{r.index:>3}/{total}" if total else f"{r.index:>3}"
    return (f"  {of:<8}{r.kind:<26}{r.n_tokens:>6}  {r.width:>5}  {r.n_segments:>4}  "
            f"{r.control_ms:>10.2f}  {r.kernels_s:>9.2f}  {r.check_ms:>8.1f}  {r.max_err:>8.1e}  "
            f"{'yes' if r.ok else 'NO'}")


def header(opts: Options, config: kv.CacheConfig, prompts: list,
           cache: kv.BatchedSequenceCache) -> str:
    """What runs: the model, the cache and the prompts' lengths."""
    layers = ", ".join("flat" if w is None else f"ring(W={w})" for w in opts.layers)
    return (f"kvnumba demo on {'the CUDA simulator' if kv.device.SIMULATOR else 'the GPU'}: "
            f"seed {opts.seed}, {opts.sessions} sessions + 1 fork, layers [{layers}], "
            f"{opts.q_heads} q heads / {opts.kv_heads} kv heads x {opts.head_dim}, vocab "
            f"{opts.vocab}, {opts.dtype} storage\n"
            f"cache: max_seqs {config.max_seqs}, max_write {config.max_write}, max_step "
            f"{config.max_step}, capacity {config.capacity}, {cache.nbytes} bytes at start; "
            f"prompt lengths {[len(p) for p in prompts]}\n"
            f"each step is checked against the model run per session with dense float64 "
            f"attention and no cache (kvnumba.reference)\n")


def _tokens(tokens: list, limit: int = SHOWN_TOKENS) -> str:
    text = " ".join(str(t) for t in tokens[:limit])
    return text + (f" ... (+{len(tokens) - limit})" if len(tokens) > limit else "")


def report_text(result: DemoResult) -> str:
    """The sessions and their tokens, the features exercised, the timings and the verdict."""
    lines = ["", SESSION_HEADER]
    for s in result.sessions:
        lines.append(f"  {s.sid:>7}  {s.origin:<16}  {s.prompt_len:>6}  "
                     f"{_tokens(s.generated):<48}  {'yes' if s.match else 'NO'}")
    lines.append("")
    for name, text in result.features.items():
        lines.append(f"  {name:<18} {text}")
    steps = result.steps
    if steps:
        kernels = sum(r.kernels_s for r in steps)
        control = sum(r.control_ms for r in steps)
        check = sum(r.check_ms for r in steps)
        lines.append(f"\n  {len(steps)} steps in {result.wall_s:.1f} s: kernels {kernels:.1f} s, "
                     f"control {control:.1f} ms, reference checks {check:.0f} ms")
    if result.ok:
        lines.append("  OK: every step and every generated token match the cache-free reference")
    else:
        lines.append(f"  FAILED: {len(result.mismatches)} mismatch(es)"
                     f"{'' if result.completed else ' (stopped early)'}")
        for m in result.mismatches[:REPORTED_MISMATCHES]:
            lines.append(f"    MISMATCH {m}")
    return "\n".join(lines)
