"""The command line the timed sections share: `python -m kvnumba.bench.<section> [--quick]
[--json PATH]` runs the section, prints its report and, with `--json`, writes its figures."""
from __future__ import annotations

import argparse
import json
import sys

import kvnumba.device as kv_device

from .prerequisites import MissingTool


def section_main(argv, prog: str, doc: str, run, report, quick_help: str) -> int:
    """Parse `argv`, announce the device, `report(run(quick=...))` to stdout, and write
    the figures as JSON where asked; returns the exit status (2, with one line on stderr
    naming the extra to install, where the section's tools are not installed)."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--json", type=str, default=None,
                        help="also write the figures to this file (JSON)")
    args = parser.parse_args(argv)
    kv_device.announce()
    try:
        result = run(quick=args.quick)
    except MissingTool as missing:          # a tool not installed: say which extra
        print(f"{prog}: {missing}", file=sys.stderr)
        return 2
    print(report(result), flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)
    return 0
