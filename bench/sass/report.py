"""Static sm_90 report of kvnumba's kernels, and budgets on it: compiled, assembled,
disassembled, never run (no GPU needed).

    python -m kvnumba.bench.sass [--report] [--check [BUDGET_FILE]] [--keep DIR]
                         [--ptxas PATH] [--nvdisasm PATH] [MODULE:FUNCTION SIGNATURE ...]

`--report` builds the kernels at the specialisations of `specs.SPECIALISATIONS` (the ones
docs/benchmarks.md lists); `--check` builds the
same and exits 1 when one of them exceeds a budget of BUDGET_FILE (default
`bench/sass/budgets.json`; format in `bench.sass.budget`). Further kernels may be
named as `module:function` with a Numba signature, e.g.
`kvnumba.kernels.moves.page_copy:_copy_vectors "void(float16[:, :, :, :, :, ::1], int32[::1],
int64, int64)"`, or as the kernel a factory makes for literal arguments,
`module:factory(ARGS)`, e.g. `kvnumba.kernels.decode.kernel:decode_kernel(128,
'float16', 4, False)`. `intrinsics_probe` below (every `kvnumba.kernels.intrinsics.ptx` and
`tensorcore` function) is always built.

Each kernel is compiled to PTX by numba-cuda in GPU mode (`KVNUMBA_DEVICE=compile`;
libNVVM needed), assembled by `ptxas -arch=sm_90a -v` and disassembled by `nvdisasm`.
The table gives per kernel its registers and the cap of its launch bounds, spills,
stack frame (local memory), static shared memory, counts of the SASS instructions
that matter to the fast kernels, float64 instructions, 64-bit division calls, and
its kind's own figure (`bench.sass.figures`). `--keep DIR` writes each
specialisation's .ptx, .cubin and .sass there, named after its spec and signature.

ptxas and nvdisasm: --ptxas / --nvdisasm, else $PTXAS / $NVDISASM, else the first
found, preferring the CUDA release of the libNVVM numba-cuda loads, of: the bin
folder of that libNVVM's toolkit or wheels, cuda-pathfinder's search, the NVIDIA
wheels in site-packages, PATH. `pip install -e '.[sass]'` installs matching ones.
Exit status: 0 report made (and budgets held), 1 a budget exceeded or a kernel
failed to build, 2 the tools or the budget file are unusable.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import importlib.metadata
import inspect
import json
import os
import re
import shutil
import site
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path


import kvnumba.device as kv_device
from kvnumba.device import cuda

from . import budget as sassbudget, figures as sassfigures
from .specs import SPECIALISATIONS, Specialisation

CC = (9, 0)
ARCH = "sm_90a"
DEFAULT_BUDGETS = Path(__file__).with_name("budgets.json")
COMPILER_HINT = ("numba-cuda compiles with libNVVM and NVRTC: `pip install -e '.[sass]'`, "
                 "`pip install numba-cuda[cu13]`, or a CUDA toolkit")
#: "factory(128, 'float16', 4)" -> "factory", "128, 'float16', 4"
FACTORY_CALL = re.compile(r"(\w+)\((.*)\)")
#: "ptxas: NVIDIA ... Cuda compilation tools, release 13.5, V13.5.37" -> "13.5"
RELEASE = re.compile(r"release (\d+\.\d+)")

# --- tools ----------------------------------------------------------------------------------

class ToolMissing(RuntimeError):
    """ptxas or nvdisasm could not be found."""


def libnvvm() -> Path | None:
    """The libNVVM numba-cuda loads, found as numba-cuda finds it; None if it finds none."""
    try:
        from numba.cuda.cuda_paths import get_cuda_paths
        found = get_cuda_paths()["nvvm"].info
    except Exception:  # noqa: BLE001  (any failure to find it: no libNVVM to match)
        return None
    return Path(found) if found and Path(found).is_file() else None


def cuda_release(path: Path) -> str | None:
    """The CUDA release ("13.5") of a file of an NVIDIA wheel (its distribution's
    version) or of a CUDA toolkit (its version.json); None if neither says."""
    resolved = path.resolve()
    for dist in importlib.metadata.distributions():
        if not (dist.metadata["Name"] or "").lower().startswith("nvidia"):
            continue
        try:
            relative = resolved.relative_to(Path(dist.locate_file("")).resolve()).as_posix()
        except ValueError:
            continue
        if any(str(f) == relative for f in dist.files or ()):
            return ".".join(dist.version.split(".")[:2])
    for parent in resolved.parents:
        if (parent / "version.json").is_file():
            version = json.loads((parent / "version.json").read_text())["cuda"]["version"]
            return ".".join(version.split(".")[:2])
    return None


def libnvvm_release() -> str | None:
    """The CUDA release of the libNVVM numba-cuda loads, if it can be told."""
    nvvm = libnvvm()
    return cuda_release(nvvm) if nvvm else None


@lru_cache(maxsize=None)
def tool_release(path: str) -> str | None:
    """The CUDA release a ptxas or nvdisasm reports (`--version`)."""
    done = subprocess.run([path, "--version"], capture_output=True, text=True)
    found = RELEASE.search(done.stdout)
    return found.group(1) if found else None


def _wheel_tools(name: str) -> list[Path]:
    """`name` in the NVIDIA pip wheels' bin folders (nvidia/<package>/bin)."""
    roots = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    return [p for r in roots if r and Path(r).is_dir()
            for p in sorted(Path(r).glob(f"nvidia/*/bin/{name}"))]


def _candidates(name: str) -> list[str]:
    """Executables called `name`, in order of preference: beside libNVVM (the bin
    folder of its wheel, nvidia/cu13/lib -> bin, or of its toolkit, nvvm/lib64 ->
    ../../bin), cuda-pathfinder's, the wheels', PATH's."""
    nvvm = libnvvm()
    found = [str(parent / "bin" / name) for parent in (nvvm.parents[:3] if nvvm else ())]
    try:
        from cuda.pathfinder import find_nvidia_binary_utility
        found.append(find_nvidia_binary_utility(name))
    except Exception:  # noqa: BLE001  (no cuda-pathfinder, or it failed: skip it)
        pass
    found += [str(p) for p in _wheel_tools(name)] + [shutil.which(name)]
    tools = [shutil.which(p) for p in found if p]
    return list(dict.fromkeys(t for t in tools if t))


def install_hint() -> str:
    """How to install ptxas and nvdisasm of libNVVM's release."""
    release = libnvvm_release()
    wheels = " ".join(f"'{w}=={release}.*'" if release else w
                      for w in ("nvidia-cuda-nvcc", "nvidia-cuda-nvdisasm"))
    return f"pip install -e '.[sass]', or pip install {wheels}"


def find_tool(name: str, explicit: str | None = None) -> str:
    """Path to CUDA tool `name`: `explicit`, else $NAME, else the first candidate
    (`_candidates`) of the CUDA release of numba-cuda's libNVVM, else the first."""
    env = os.environ.get(name.upper())
    for given, origin in ((explicit, f"--{name}"), (env, f"${name.upper()}")):
        if given:
            found = shutil.which(given)
            if found is None:
                raise ToolMissing(f"{origin}={given}: not an executable")
            return found
    candidates = _candidates(name)
    if not candidates:
        raise ToolMissing(f"{name} not found beside libNVVM, in an NVIDIA wheel nor on PATH: "
                          f"{install_hint()} (or a CUDA toolkit), or pass --{name} PATH or "
                          f"set ${name.upper()}")
    release = libnvvm_release()
    return next((t for t in candidates if tool_release(t) == release), candidates[0])


# --- building -------------------------------------------------------------------------------

def _split_spec(spec: str) -> tuple[str, str, tuple | None]:
    """(module, function, factory arguments or None) of `module:function` or
    `module:factory(ARGS)`."""
    module, sep, name = spec.partition(":")
    call = FACTORY_CALL.fullmatch(name)
    if not sep or not module or not name or ("(" in name and not call):
        raise ValueError(f"{spec!r}: expected MODULE:FUNCTION or MODULE:FACTORY(ARGS)")
    if call is None:
        return module, name, None
    return module, call[1], tuple(ast.literal_eval(f"[{call[2]}]"))


def load_kernel(spec: str):
    """The kernel `module:function`, or the kernel that a factory returns for literal
    arguments: `module:factory(128, 'float16', 4)`."""
    module, name, arguments = _split_spec(spec)
    kernel = getattr(importlib.import_module(module), name)
    if arguments is not None:
        kernel = kernel(*arguments)
    return getattr(kernel, "dispatcher", kernel)   # a `launch.Specialised`: its dispatcher


def factory_arguments(spec: str) -> dict:
    """A factory spec's arguments by parameter name ({} for a plain kernel)."""
    module, name, arguments = _split_spec(spec)
    if arguments is None:
        return {}
    factory = getattr(importlib.import_module(module), name)
    return dict(inspect.signature(factory).bind(*arguments).arguments)


def file_stem(spec: str, signature: str) -> str:
    """A file name for one specialisation: the function and its factory arguments,
    and a short hash of the signature."""
    name = re.sub(r"\W+", "_", spec.partition(":")[2]).strip("_")
    return f"{name}-{hashlib.sha1(signature.encode()).hexdigest()[:8]}"


def parse_ptxas(text: str) -> dict:
    """Registers, spills, stack and shared bytes from `ptxas -v` of one entry function."""
    def number(pattern):
        found = re.search(pattern, text)
        return int(found.group(1)) if found else 0

    return {"registers": number(r"Used (\d+) registers"),
            "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"),
            "stack": number(r"(\d+) bytes stack frame"),
            "shared": number(r"(\d+) bytes smem")}


def build(function, signature: str, bounds, tools: tuple[str, str],
          stem: Path) -> tuple[dict, str]:
    """Compile a kernel's Python `function` for sm_90 under launch `bounds` (threads, min
    blocks per SM, or None), assemble and disassemble it with `tools` (ptxas, nvdisasm)
    into `stem`.ptx / .cubin / .sass: (ptxas figures, SASS)."""
    ptxas, nvdisasm = tools
    text, _ = cuda.compile_ptx(function, signature, cc=CC, launch_bounds=bounds)
    source, cubin = stem.with_suffix(".ptx"), stem.with_suffix(".cubin")
    source.write_text(text)
    assembled = _tool([ptxas, f"-arch={ARCH}", "-v", "-o", str(cubin), str(source)])
    sass = _tool([nvdisasm, "-c", str(cubin)]).stdout
    stem.with_suffix(".sass").write_text(sass)
    return parse_ptxas(assembled.stdout + assembled.stderr), sass


def _tool(command: list) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        hint = ""
        if "Unsupported .version" in done.stderr:
            hint = (f"\n{command[0]} (release {tool_release(command[0])}) is older than the "
                    f"PTX numba-cuda's libNVVM writes: {install_hint()}, or pass --ptxas")
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n"
                           f"{done.stderr}{hint}")
    return done


def measure(item: Specialisation, tools: tuple[str, str], folder: Path) -> sassfigures.Figures:
    """Build one specialisation and compute its figures."""
    kernel = load_kernel(item.spec)
    bounds = kernel.targetoptions.get("launch_bounds")
    ptxas_figures, sass = build(kernel.py_func, item.signature, bounds, tools,
                                folder / file_stem(item.spec, item.signature))
    module, name, _ = _split_spec(item.spec)
    return sassfigures.kernel_figures(f"{module}:{name}", ptxas_figures, sass, bounds,
                                      factory_arguments(item.spec))


# --- command line ---------------------------------------------------------------------------

def _header(tools: tuple[str, str]) -> str:
    nvvm = libnvvm()
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"sm_90 static report ({ARCH}), {stamp}\n"
            f"  ptxas {tools[0]} (release {tool_release(tools[0])})\n"
            f"  nvdisasm {tools[1]} (release {tool_release(tools[1])})\n"
            f"  libNVVM {nvvm} (release {libnvvm_release()})")


def _selection(args) -> list[Specialisation]:
    chosen = list(SPECIALISATIONS) if args.report or args.check else [SPECIALISATIONS[0]]
    return chosen + [Specialisation(spec, spec, sig)
                     for spec, sig in zip(args.kernels[::2], args.kernels[1::2])]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernels", nargs="*", metavar="MODULE:FUNCTION SIGNATURE",
                        help="further kernels, each followed by its Numba signature")
    parser.add_argument("--report", action="store_true",
                        help="build the documented specialisations (SPECIALISATIONS)")
    parser.add_argument("--check", nargs="?", const=DEFAULT_BUDGETS, type=Path,
                        metavar="BUDGET_FILE", help="build them and check their budgets "
                        f"(default {DEFAULT_BUDGETS.name}); exit 1 if one is exceeded")
    parser.add_argument("--ptxas", help="ptxas executable")
    parser.add_argument("--nvdisasm", help="nvdisasm executable")
    parser.add_argument("--keep", type=Path, help="write the .ptx, .cubin, .sass files here")
    args = parser.parse_args(argv)
    if len(args.kernels) % 2:
        parser.error("kernels come as MODULE:FUNCTION SIGNATURE pairs")
    if kv_device.SIMULATOR:
        if not kv_device.FELL_BACK:
            parser.error("the simulator (KVNUMBA_DEVICE=simulator or NUMBA_ENABLE_CUDASIM=1) "
                         "cannot compile to PTX: unset it or use KVNUMBA_DEVICE=compile")
        return in_compile_mode(sys.argv[1:] if argv is None else argv)
    try:
        budgets = sassbudget.load(args.check) if args.check else None
        tools = find_tool("ptxas", args.ptxas), find_tool("nvdisasm", args.nvdisasm)
    except (ToolMissing, sassbudget.BudgetError) as e:
        print(f"kvnumba.bench.sass: {e}", file=sys.stderr)
        return 2
    figures: dict[str, sassfigures.Figures] = {}
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.keep or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        for item in _selection(args):
            try:
                figures[item.label] = measure(item, tools, folder)
            except Exception as e:  # a compiler, a library or a tool is missing or failed
                print(f"kvnumba.bench.sass: {item.label} ({item.spec}): {type(e).__name__}: "
                      f"{str(e).strip()}", file=sys.stderr)
                if re.search(r"nvvm|nvrtc", str(e), re.IGNORECASE):
                    print(f"kvnumba.bench.sass: {COMPILER_HINT}", file=sys.stderr)
                return 1
    print(_header(tools))
    print(sassbudget.figure_table({label: f.values for label, f in figures.items()}))
    for label, f in figures.items():
        for note in f.notes:
            print(f"{label}: {note}")
    return _check(budgets, figures) if budgets is not None else 0


def in_compile_mode(argv: list) -> int:
    """This command run again in a subprocess in `KVNUMBA_DEVICE=compile` mode: kvnumba
    chose the simulator when it was imported (no GPU here), and the choice is made once
    a process."""
    env = dict(os.environ, KVNUMBA_DEVICE="compile")
    env.pop("NUMBA_ENABLE_CUDASIM", None)       # set by kvnumba's choice in this process
    return subprocess.run([sys.executable, "-m", "kvnumba.bench.sass", *argv],
                          env=env).returncode


def _check(budgets: dict, figures: dict) -> int:
    """Print every budget's verdict; 1 if one is exceeded, 2 if the file is unusable."""
    try:
        found = sassbudget.verdicts(budgets, {label: f.values for label, f in figures.items()})
    except sassbudget.BudgetError as e:
        print(f"kvnumba.bench.sass: {e}", file=sys.stderr)
        return 2
    print()
    print(sassbudget.verdict_table(found))
    exceeded = [v for v in found if not v.holds]
    if not exceeded:
        print(f"all {len(found)} budgets hold")
        return 0
    print(f"{len(exceeded)} of {len(found)} budgets exceeded:")
    for verdict in exceeded:
        print(f"  {verdict}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
