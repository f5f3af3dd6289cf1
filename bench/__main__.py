"""Run kvnumba's benchmarks: the control plane, the data path's host time, memory, prefix
reuse, the kernels, the Hugging Face engine, the OpenAI-compatible server, and a JSON
record.

    python -m kvnumba.bench [--quick | --smoke] [--results DIR]      (or: kvnumba-bench ...)

What runs where: the control-plane, memory and prefix-reuse benches run anywhere; the
host-time bench too (without a GPU, in `KVNUMBA_DEVICE=compile` mode with the launches
recorded, which compiles the kernels: it needs NVRTC and libNVVM, `pip install
-e '.[sass]'`); the kernel bench needs a CUDA GPU (`--smoke` runs its cases at toy
sizes, on the simulator too), with PyTorch (`kvnumba[torch]`) for its SDPA /
FlashAttention peers; the Hugging Face engine against `model.generate()` needs PyTorch
with CUDA and transformers (`kvnumba[hf]`); the server under load (`bench.serve`) needs
`kvnumba[serve]` and runs anywhere (on the simulator at toy sizes only). A section whose libraries are not installed
is skipped with one line naming them and the extra that installs them. Every figure goes to
`DIR/<date>-<device>.json` (default `./bench-results`, under the current directory).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import re
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import kvnumba.device as kv_device

from . import control, engine, host, memory, prefix, serve
from .kernels import run as kernels
from .kernels.sizes import add_size_arguments, device_name, sizes_for
from .prerequisites import MissingTool, missing_packages

RESULTS = Path("bench-results")   # relative: under the directory it runs from
PACKAGES = ("numpy", "numba", "numba-cuda", "transitions", "torch", "transformers")


def versions() -> dict:
    """The versions of Python and of the packages the figures depend on (None: absent)."""
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def record_path(date: str, device: str, folder: Path = RESULTS) -> Path:
    """Where the record of a run on `date` on `device` goes."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", device).strip("-") or "unknown"
    return folder / f"{date}-{slug}.json"


@dataclasses.dataclass(frozen=True)
class Section:
    """One benchmark: its key in the JSON record, `run` (parsed arguments -> figures;
    raises `MissingTool` where what it needs is not installed) and `report` (figures ->
    text)."""

    key: str
    run: Callable[[argparse.Namespace], dict]
    report: Callable[[dict], str]


def _quick(args) -> bool:
    return args.quick or args.smoke


def _run_engine(args) -> dict:
    missing = missing_packages("engine vs model.generate()", ("torch", "transformers"), "hf",
                               "PyTorch and transformers")
    if missing is not None:
        raise missing
    return engine.run(quick=_quick(args))


SECTIONS = (
    Section("control", lambda args: control.run_anywhere(quick=_quick(args)), control.report),
    Section("host", lambda args: host.run_anywhere(quick=_quick(args)), host.report),
    Section("memory", lambda args: memory.run(quick=_quick(args)), memory.report),
    Section("prefix", lambda args: prefix.run(quick=_quick(args)), prefix.report),
    Section("kernels", lambda args: kernels.run(sizes_for(args)), kernels.report),
    Section("engine", _run_engine, engine.report),
    Section("serve", lambda args: serve.run(quick=_quick(args)), serve.report),
)


def run_sections(args, sections) -> tuple[dict, dict]:
    """Run and report each section in turn: `(figures, skipped)`, figures by key (None for
    a section skipped) and, for each skipped one, what was missing and which extra brings
    it. Only `MissingTool` skips a section; any other error ends the run."""
    figures, skipped = {}, {}
    for i, section in enumerate(sections):
        if i:
            print()
        try:
            result = section.run(args)
        except MissingTool as missing:
            print(missing, flush=True)
            figures[section.key] = None
            skipped[section.key] = missing.record()
            continue
        print(section.report(result), flush=True)
        figures[section.key] = result
    return figures, skipped


def main(argv=None) -> int:
    """`python -m kvnumba.bench`: every section of `SECTIONS`, then the JSON record."""
    # run as a module, argv[0] is this file's path; as `kvnumba-bench`, argparse's own
    prog = "python -m kvnumba.bench" if sys.argv[0].endswith("__main__.py") else None
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_size_arguments(parser)
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help=f"folder for the JSON record (default ./{RESULTS})")
    args = parser.parse_args(argv)

    now = datetime.datetime.now().astimezone()
    device = device_name()
    mode = " [quick]" if args.quick else " [smoke]" if args.smoke else ""
    where = f"the {device}" if device == kv_device.KIND else f"{device} ({kv_device.KIND})"
    kv_device.announce()           # the simulator notice, before any table starts
    print(f"kvnumba benchmarks on {where}, {now:%Y-%m-%d %H:%M %Z}{mode}\n", flush=True)

    figures, skipped = run_sections(args, SECTIONS)

    record = dict(date=now.isoformat(timespec="seconds"), device=device,
                  device_kind=kv_device.KIND, platform=platform.platform(),
                  argv=sys.argv[1:], quick=args.quick, smoke=args.smoke, versions=versions(),
                  **figures, skipped=skipped)
    args.results.mkdir(parents=True, exist_ok=True)
    path = record_path(now.date().isoformat(), device, args.results)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
