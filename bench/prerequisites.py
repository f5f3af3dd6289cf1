"""What a benchmark section needs beyond kvnumba's own dependencies, looked up the way
the section itself would find it, and the extra of kvnumba that installs it.

A probe returns a `MissingTool` (an exception, raised by the section that cannot run)
or None. `python -m kvnumba.bench` prints a raised `MissingTool` as one line (the section, what
is missing, the `pip install` that brings it), notes it in the JSON record and goes
on; it catches nothing else, so any other failure of a section still ends the run.
"""
from __future__ import annotations

import importlib.util
import re


class MissingTool(Exception):
    """A section cannot run here: `missing` is not installed; `extra` installs it."""

    def __init__(self, section: str, missing: str, extra: str, brings: str):
        super().__init__(f"{section}: skipped, {missing}; pip install -e '.[{extra}]' "
                         f"installs {brings}")
        self.section = section
        self.missing = missing
        self.extra = extra

    def record(self) -> dict:
        """What the JSON record keeps of it."""
        return dict(missing=self.missing, extra=self.extra, message=str(self))


def missing_compiler(section: str) -> MissingTool | None:
    """NVRTC and libNVVM (and libdevice), looked up as numba-cuda looks them up when it
    compiles a kernel: None where it finds them, else the `sass` extra's `MissingTool`.
    Only their absence counts: any other error of the lookup is raised."""
    from cuda import pathfinder  # the library finder numba-cuda uses
    from numba.cuda.cuda_paths import get_cuda_paths

    try:
        get_cuda_paths()
    except pathfinder.DynamicLibNotFoundError as exc:
        named = re.search(r'Failure finding "([^"]+)"', str(exc))
        library = named.group(1) if named else str(exc).splitlines()[0]
        return MissingTool(section, f"the CUDA compiler libraries are not found ({library})",
                           "sass", "NVRTC and libNVVM")
    return None


def missing_packages(section: str, names, extra: str, brings: str) -> MissingTool | None:
    """None where every package of `names` is installed, else a `MissingTool` naming the
    first that is not (found without importing it)."""
    for name in names:
        if importlib.util.find_spec(name) is None:
            return MissingTool(section, f"{name} is not installed", extra, brings)
    return None
