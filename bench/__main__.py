"""Run kvnumba's benchmarks: the control plane, the data path's host time, the kernels,
and a JSON record.

    python -m bench [--quick | --smoke] [--results DIR]      (or: kvnumba-bench ...)

The control-plane bench runs anywhere; the host-time bench too (without a GPU, in
`KVNUMBA_DEVICE=compile` mode with the launches recorded); the kernel bench needs a
CUDA GPU (`--smoke` runs its cases at toy sizes, on the simulator too), and so does the
Hugging Face engine against `model.generate()` (PyTorch with CUDA). Every figure
goes to `DIR/<date>-<device>.json` (default `./bench-results`, under the current
directory).
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import sys
from importlib import metadata
from pathlib import Path

import kvnumba.device as kv_device

from . import control, engine, host, kernels, memory

RESULTS = Path("bench-results")   # relative: under the directory it runs from
PACKAGES = ("numpy", "numba", "numba-cuda", "transitions", "torch", "transformers")


def versions() -> dict:
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def record_path(date: str, device: str, folder: Path = RESULTS) -> Path:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", device).strip("-") or "unknown"
    return folder / f"{date}-{slug}.json"


def main(argv=None) -> int:
    # run as a module, argv[0] is this file's path; as `kvnumba-bench`, argparse's own
    prog = "python -m bench" if sys.argv[0].endswith("__main__.py") else None
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    kernels.add_size_arguments(parser)
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help=f"folder for the JSON record (default ./{RESULTS})")
    args = parser.parse_args(argv)

    now = datetime.datetime.now().astimezone()
    device = kernels.device_name()
    mode = " [quick]" if args.quick else " [smoke]" if args.smoke else ""
    where = f"the {device}" if device == kv_device.KIND else f"{device} ({kv_device.KIND})"
    kv_device.announce()           # the simulator notice, before any table starts
    print(f"kvnumba benchmarks on {where}, {now:%Y-%m-%d %H:%M %Z}{mode}\n", flush=True)

    print("\n".join(control.header_lines(kv_device.SIMULATOR)), flush=True)
    print(control.HEADER, flush=True)
    control_result = control.run(quick=args.quick or args.smoke, verbose=True)
    print(control.report(control_result).splitlines()[-1], flush=True)
    print()

    host_result = host.run_anywhere(quick=args.quick or args.smoke)
    print(host.report(host_result), flush=True)
    print()

    memory_result = memory.run(quick=args.quick or args.smoke)
    print(memory.report(memory_result), flush=True)
    print()

    kernel_result = kernels.run(kernels.sizes_for(args))
    print(kernels.report(kernel_result), flush=True)
    print()

    engine_result = engine.run(quick=args.quick or args.smoke)
    print(engine.report(engine_result), flush=True)

    record = dict(date=now.isoformat(timespec="seconds"), device=device,
                  device_kind=kv_device.KIND, platform=platform.platform(),
                  argv=sys.argv[1:], quick=args.quick, smoke=args.smoke, versions=versions(),
                  control=control_result, host=host_result, memory=memory_result,
                  kernels=kernel_result,
                  engine=engine_result)
    args.results.mkdir(parents=True, exist_ok=True)
    path = record_path(now.date().isoformat(), device, args.results)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
