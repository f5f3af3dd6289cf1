"""`python -m bench [--quick]`: the control-plane bench, the kernel bench (on a GPU),
and a JSON record of every figure in `bench/results/<date>-<device>.json`."""
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

from . import control, kernels

RESULTS = Path(__file__).resolve().parent / "results"
PACKAGES = ("numpy", "numba", "numba-cuda", "transitions", "torch")


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short run")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help=f"folder for the JSON record (default {RESULTS})")
    args = parser.parse_args(argv)

    now = datetime.datetime.now().astimezone()
    device = kernels.device_name()
    print(f"kvnumba benchmarks on {device} ({kv_device.KIND}), {now:%Y-%m-%d %H:%M %Z}"
          f"{' [quick]' if args.quick else ''}\n", flush=True)

    print("\n".join(control.header_lines(kv_device.SIMULATOR)), flush=True)
    print(control.HEADER, flush=True)
    control_result = control.run(quick=args.quick, verbose=True)
    print(control.report(control_result).splitlines()[-1], flush=True)
    print()

    if kernels.gpu_available():
        kernel_result = kernels.run(kernels.QUICK if args.quick else kernels.FULL)
        print(kernels.report(kernel_result), flush=True)
    else:
        kernel_result = dict(skipped=True, reason=kernels.SKIP_MESSAGE)
        print(kernels.SKIP_MESSAGE)

    record = dict(date=now.isoformat(timespec="seconds"), device=device,
                  device_kind=kv_device.KIND, platform=platform.platform(),
                  argv=sys.argv[1:], quick=args.quick, versions=versions(),
                  control=control_result, kernels=kernel_result)
    args.results.mkdir(parents=True, exist_ok=True)
    path = record_path(now.date().isoformat(), device, args.results)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
