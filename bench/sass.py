"""Static sm_90 report of kvnumba's kernels, and budgets on it: compiled, assembled,
disassembled, never run (no GPU needed).

    python -m kvnumba.bench.sass [--report] [--check [BUDGET_FILE]] [--keep DIR]
                         [--ptxas PATH] [--nvdisasm PATH] [MODULE:FUNCTION SIGNATURE ...]

`--report` builds the kernels at the specialisations of `SPECIALISATIONS` (the ones
docs/benchmarks.md lists; `bench/sass_report.sh` runs this); `--check` builds the
same and exits 1 when one of them exceeds a budget of BUDGET_FILE (default
`bench/sass_budgets.json`; format in `bench.sassbudget`). Further kernels may be
named as `module:function` with a Numba signature, e.g.
`kvnumba.kernels.copy:_copy_vectors "void(float16[:, :, :, :, :, ::1], int32[::1],
int64, int64)"`, or as the kernel a factory makes for literal arguments,
`module:factory(ARGS)`, e.g. `kvnumba.kernels.decode_kernel:decode_kernel(128,
'float16', 4, False)`. `intrinsics_probe` below (every `kvnumba.kernels.ptx` and
`tensorcore` function) is always built.

Each kernel is compiled to PTX by numba-cuda in GPU mode (`KVNUMBA_DEVICE=compile`;
libNVVM needed), assembled by `ptxas -arch=sm_90a -v` and disassembled by `nvdisasm`.
The table gives per kernel its registers and the cap of its launch bounds, spills,
stack frame (local memory), static shared memory, counts of the SASS instructions
that matter to the fast kernels, float64 instructions, 64-bit division calls, and
its kind's own figure (`bench.sassfigures`). `--keep DIR` writes each
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
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

import numpy as np

import kvnumba.device as kv_device
from kvnumba.device import cuda
from kvnumba.kernels import ptx, tensorcore

from . import sassbudget, sassfigures

CC = (9, 0)
ARCH = "sm_90a"
DEFAULT_BUDGETS = Path(__file__).with_name("sass_budgets.json")
COMPILER_HINT = ("numba-cuda compiles with libNVVM and NVRTC: `pip install -e '.[sass]'`, "
                 "`pip install numba-cuda[cu13]`, or a CUDA toolkit")
#: "factory(128, 'float16', 4)" -> "factory", "128, 'float16', 4"
FACTORY_CALL = re.compile(r"(\w+)\((.*)\)")
#: "ptxas: NVIDIA ... Cuda compilation tools, release 13.5, V13.5.37" -> "13.5"
RELEASE = re.compile(r"release (\d+\.\d+)")

TILE = 16 * 16                  # one 16x16 float16 tile: 32 lanes x 16 bytes


@cuda.jit
def intrinsics_probe(keys, values, out, scratch):
    """Every `ptx` and `tensorcore` function as the attention kernels use them, in one
    warp: stage a 16x16 float16 K tile with cp.async, load mma fragments with ldmatrix,
    multiply (f16 and bf16), reduce over the lanes of a row with shuffles, and stream 16-byte
    chunks of V through registers (f16 and bf16 unpacked, scaled, repacked)."""
    lane = cuda.laneid
    tile = cuda.shared.array(TILE, np.float16)
    tensorcore.cp_async_16(tile, lane * 8, keys, lane * 8)
    tensorcore.cp_async_commit()
    tensorcore.cp_async_wait(0)
    cuda.syncthreads()
    frag = (lane % 16) * 16 + (lane // 16) * 8
    a0, a1, a2, a3 = tensorcore.ldmatrix_x4(tile, frag)
    b0, b1, b2, b3 = tensorcore.ldmatrix_x4_trans(tile, frag)
    d0, d1, d2, d3 = tensorcore.mma_f16_f32(a0, a1, a2, a3, b0, b1, 0.0, 0.0, 0.0, 0.0)
    p = ptx.f32x2_to_bf16x2(d0, d1)
    q = ptx.f32x2_to_bf16x2(d2, d3)
    e0, e1, e2, e3 = tensorcore.mma_bf16_f32(p, q, p, q, b2, b3, d0, d1, d2, d3)
    row_max = max(e0, e1)                             # a row of D lives in 4 lanes
    row_max = max(row_max, ptx.shfl_xor(row_max, 1))
    row_max = max(row_max, ptx.shfl_xor(row_max, 2))
    scale = ptx.shfl_idx(row_max, 0) + max(e2, e3)
    u0, u1, u2, u3 = ptx.ld_nc_v4(values, lane * 8)
    lo, hi = ptx.f16x2_to_f32(u0)
    blo, bhi = ptx.bf16x2_to_f32(u1)
    w0, w1, w2, w3 = ptx.ld_v4(scratch, lane * 4)
    sign = ptx.shfl_xor(w0, 16) & 0x80000000
    flipped = ptx.u32_as_f32(ptx.f32_as_u32(scale) ^ sign)
    ptx.st_v4(out, lane * 8, ptx.f32x2_to_f16x2(lo * flipped, hi * flipped),
              ptx.f32x2_to_bf16x2(blo * scale, bhi * scale), u2 ^ w2, u3 ^ w3)
    ptx.st_v4(scratch, lane * 4, w1, w0, w3, w2)


PROBE_SIGNATURE = "void(float16[::1], float16[::1], float16[::1], uint32[::1])"


@dataclass(frozen=True)
class Specialisation:
    """A kernel of the report: its label, `module:function` or `module:factory(ARGS)`,
    and Numba signature."""

    label: str
    spec: str
    signature: str


def _decode_signature(t: str, q: str | None = None) -> str:
    """Storage of `t`, q and out of `q` (default `t`)."""
    q = q or t
    return (f"void({q}[:, :, ::1], {t}[:, :, ::1], {t}[:, :, ::1], int32[::1], "
            f"int32[:, ::1], {q}[:, :, ::1], float32[:, ::1], float32[::1], float32[::1], "
            f"{', '.join(['int64'] * 8)}, float32, float32)")


def _prefill_signature(t: str, q: str | None = None) -> str:
    """Storage of `t`, q and out of `q` (default `t`)."""
    q = q or t
    return (f"void({q}[:, :, ::1], {t}[:, :, ::1], {t}[:, :, ::1], int32[:, ::1], int64, "
            f"int32[::1], {q}[:, :, ::1], float32[:, ::1], {', '.join(['int64'] * 6)}, "
            f"float32, float32)")


def _narrow_signature(t: str) -> str:
    """The write of `t` input into e4m3 storage (uint8 bits)."""
    return (f"void(uint8[:, :, ::1], uint8[:, :, ::1], {t}[:, :, ::1], {t}[:, :, ::1], "
            f"int32[::1], int64, int64, int32[:, ::1], int64, float32, float32)")


_DECODE = "kvnumba.kernels.decode_kernel:decode_kernel"
_PREFILL = "kvnumba.kernels.prefill_kernel:prefill_kernel"
#: what --report and --check build: the kernels docs/benchmarks.md reports, at the
#: specialisations it lists (bfloat16 storage is held as uint16 bits)
SPECIALISATIONS = (
    Specialisation("probe", "kvnumba.bench.sass:intrinsics_probe", PROBE_SIGNATURE),
    Specialisation("write", "kvnumba.kernels.write:_write_vectors",
                   "void(float16[:, :, ::1], float16[:, :, ::1], float16[:, :, ::1], "
                   "float16[:, :, ::1], int32[::1], int64, int64, int32[:, ::1], int64)"),
    # into 8-bit float storage: float16 input at scale 1 (narrowed in float16 pairs), and
    # bfloat16 input scaled (widened to float32)
    Specialisation("write float8_e4m3 from float16",
                   "kvnumba.kernels.write_fp8:narrow_kernel('float16', 'e4m3', False)",
                   _narrow_signature("float16")),
    Specialisation("write float8_e4m3 from bfloat16 scaled",
                   "kvnumba.kernels.write_fp8:narrow_kernel('uint16', 'e4m3', True)",
                   _narrow_signature("uint16")),
    Specialisation("copy", "kvnumba.kernels.copy:_copy_vectors",
                   "void(float16[:, :, :, :, :, ::1], int32[::1], int64, int64)"),
    Specialisation("decode d128 float16", f"{_DECODE}(128, 'float16', 4, False)",
                   _decode_signature("float16")),
    Specialisation("decode d128 float16 2 rows", f"{_DECODE}(128, 'float16', 2, False)",
                   _decode_signature("float16")),
    Specialisation("decode d128 float16 1 row", f"{_DECODE}(128, 'float16', 1, False)",
                   _decode_signature("float16")),
    Specialisation("decode d128 bfloat16", f"{_DECODE}(128, 'uint16', 4, False)",
                   _decode_signature("uint16")),
    # 8-bit float storage (e4m3 bits as uint8, e5m2 as int8) under float16 queries: 8-byte
    # loads, so a d128 key row takes 16 lanes and a block 4 rows, as 16-bit storage
    Specialisation("decode d128 float8_e4m3", f"{_DECODE}(128, 'uint8', 4, False, 'float16')",
                   _decode_signature("uint8", "float16")),
    Specialisation("decode d128 float8_e5m2", f"{_DECODE}(128, 'int8', 4, False, 'float16')",
                   _decode_signature("int8", "float16")),
    Specialisation("decode d128 float8_e4m3 2 rows",
                   f"{_DECODE}(128, 'uint8', 2, False, 'float16')",
                   _decode_signature("uint8", "float16")),
    Specialisation("decode d128 float8_e4m3 1 row",
                   f"{_DECODE}(128, 'uint8', 1, False, 'float16')",
                   _decode_signature("uint8", "float16")),
    Specialisation("decode d128 float32", f"{_DECODE}(128, 'float32', 4, False)",
                   _decode_signature("float32")),
    Specialisation("decode d128 float16 softcap", f"{_DECODE}(128, 'float16', 4, True)",
                   _decode_signature("float16")),
    Specialisation("decode d256 float16", f"{_DECODE}(256, 'float16', 4, False)",
                   _decode_signature("float16")),
    Specialisation("decode d256 bfloat16 softcap 2 rows", f"{_DECODE}(256, 'uint16', 2, True)",
                   _decode_signature("uint16")),
    Specialisation("combine d128", "kvnumba.kernels.combine:_combine_kernel(128)",
                   "void(int32[::1], float32[::1], float32[::1], float16[:, :, ::1], "
                   "float32[:, ::1], int64, int64, int64)"),
    Specialisation("prefill d64 float16", f"{_PREFILL}(64, 64, 64, 'float16', False)",
                   _prefill_signature("float16")),
    Specialisation("prefill d128 float16", f"{_PREFILL}(128, 64, 64, 'float16', False)",
                   _prefill_signature("float16")),
    Specialisation("prefill d128 bfloat16", f"{_PREFILL}(128, 64, 64, 'bfloat16', False)",
                   _prefill_signature("uint16")),
    # 8-bit float storage staged into float16 / bfloat16 tiles (e4m3 bits as uint8, e5m2
    # as int8), queries of the mma type
    Specialisation("prefill d128 float8_e4m3",
                   f"{_PREFILL}(128, 64, 64, 'float16', False, True, None, 'e4m3')",
                   _prefill_signature("uint8", "float16")),
    Specialisation("prefill d128 float8_e5m2 bfloat16 q",
                   f"{_PREFILL}(128, 64, 64, 'bfloat16', False, True, None, 'e5m2')",
                   _prefill_signature("int8", "uint16")),
    Specialisation("prefill d128 float16 softcap", f"{_PREFILL}(128, 64, 64, 'float16', True)",
                   _prefill_signature("float16")),
    Specialisation("prefill d256 float16", f"{_PREFILL}(256, 48, 16, 'float16', False)",
                   _prefill_signature("float16")),
    Specialisation("prefill d256 bfloat16 softcap",
                   f"{_PREFILL}(256, 48, 16, 'bfloat16', True)", _prefill_signature("uint16")),
)


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
