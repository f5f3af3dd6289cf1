"""`python -m kvnumba demo [options]`: the command line over `run`."""
from __future__ import annotations

import argparse
import sys

from .options import Options, flag_fields
from .report import report_text
from .runner import run


def parser() -> argparse.ArgumentParser:
    """The demo's argument parser: one flag per `Options` flag field, then the run's own."""
    p = argparse.ArgumentParser(
        prog="python -m kvnumba demo",
        description="Serve several sessions of a small random-weight decoder through a "
                    "BatchedSequenceCache (chunked prefill, batched decode, a partly rejected "
                    "speculative draft, a fork, a bidirectional draft block), checking every "
                    "step and every token against the same model run without a cache. "
                    "Exits 1 on any mismatch.")
    for f in flag_fields():
        p.add_argument("--" + f.name.replace("_", "-"), default=f.default, **f.metadata["flag"])
    p.add_argument("--fail-fast", action="store_true", help="stop at the first mismatching step")
    p.add_argument("--quiet", action="store_true", help="print only the final report")
    return p


def main(argv=None, **hooks) -> int:
    """The CLI: 0 when every step and token matched the reference, 1 on any mismatch, 2 for
    bad arguments. `hooks` (`tamper`, `tamper_step`) are passed to `run` (tests use them)."""
    p = parser()
    args = p.parse_args(argv)
    options = {f.name: getattr(args, f.name) for f in flag_fields()}
    try:
        Options(**options).validate()
    except ValueError as exc:
        p.error(str(exc))
    if args.quiet:
        result = run(out=None, fail_fast=args.fail_fast, **hooks, **options)
        print(report_text(result), flush=True)
    else:
        result = run(out=sys.stdout, fail_fast=args.fail_fast, **hooks, **options)
    return 0 if result.ok else 1
