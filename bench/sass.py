"""Static sm_90 report of kvnumba kernels: compiled, assembled, disassembled, never run.

    python -m bench.sass [--ptxas PATH] [--nvdisasm PATH] [--keep DIR]
                         [MODULE:FUNCTION SIGNATURE ...]

Each kernel (always `intrinsics_probe` below, which uses every `kvnumba.kernels.ptx`
function, plus any `@cuda.jit` kernel named as `module:function` with a Numba
signature, e.g. `kvnumba.kernels.copy:_copy_vectors "void(float16[:, :, :, :, :, ::1],
int64, int64, int64)"`, or the kernel a factory makes for literal arguments,
`module:factory(ARGS)`, e.g. `kvnumba.kernels.decode:_decode_kernel(128, 'float16', 4,
False)`) is compiled to PTX by numba-cuda in
GPU mode (`KVNUMBA_DEVICE=compile`: no GPU needed, but libNVVM is), assembled by
`ptxas -arch=sm_90a -v` and disassembled by `nvdisasm`. Per kernel it prints
registers, spill stores / loads, stack frame (local memory), static shared
memory, and counts of the SASS instructions that matter to the fast kernels.

ptxas and nvdisasm come from --ptxas / --nvdisasm, else $PTXAS / $NVDISASM, else
PATH, else the NVIDIA wheels in site-packages (`pip install nvidia-cuda-nvcc
nvidia-cuda-nvdisasm`).
"""
from __future__ import annotations

import os

os.environ.setdefault("KVNUMBA_DEVICE", "compile")  # before kvnumba chooses a device

import argparse  # noqa: E402
import ast  # noqa: E402
import importlib  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import site  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

import kvnumba.device as kv_device  # noqa: E402
from kvnumba.device import cuda  # noqa: E402
from kvnumba.kernels import ptx  # noqa: E402

CC = (9, 0)
ARCH = "sm_90a"
PIP_HINT = "pip install nvidia-cuda-nvcc nvidia-cuda-nvdisasm"
COMPILER_HINT = ("numba-cuda compiles with libNVVM and NVRTC: `pip install numba-cuda[cu12]` "
                 "(or [cu13]), or a CUDA toolkit")
#: report column -> predicate on a SASS opcode (e.g. "LDG.E.128.CONSTANT")
INSTRUCTIONS = {
    "LDG.E.128": lambda op: op.startswith("LDG.") and ".128" in op,
    "STG.E.128": lambda op: op.startswith("STG.") and ".128" in op,
    "LDGSTS": lambda op: op.startswith("LDGSTS"),
    "LDSM": lambda op: op.startswith("LDSM"),
    "HMMA": lambda op: op.startswith("HMMA"),
    "SHFL": lambda op: op.startswith("SHFL"),
    "LDL": lambda op: op.startswith("LDL"),
    "STL": lambda op: op.startswith("STL"),
    "DADD": lambda op: op.startswith("DADD"),
    "DMUL": lambda op: op.startswith("DMUL"),
    "DFMA": lambda op: op.startswith("DFMA"),
}
#: "factory(128, 'float16', 4)" -> "factory", "128, 'float16', 4"
FACTORY_CALL = re.compile(r"(\w+)\((.*)\)")
#: "/*0150*/   @!P0 LDSM.16.M88.4 R4, [R23] ;" -> "LDSM.16.M88.4"
SASS_LINE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_.]*)")

TILE = 16 * 16                  # one 16x16 float16 tile: 32 lanes x 16 bytes


@cuda.jit
def intrinsics_probe(keys, values, out, scratch):
    """Every `ptx` function as the attention kernels use them, in one warp: stage a
    16x16 float16 K tile with cp.async, load mma fragments with ldmatrix, multiply
    (f16 and bf16), reduce over the lanes of a row with shuffles, and stream 16-byte
    chunks of V through registers (f16 and bf16 unpacked, scaled, repacked)."""
    lane = cuda.laneid
    tile = cuda.shared.array(TILE, np.float16)
    ptx.cp_async_16(tile, lane * 8, keys, lane * 8)
    ptx.cp_async_commit()
    ptx.cp_async_wait(0)
    cuda.syncthreads()
    frag = (lane % 16) * 16 + (lane // 16) * 8
    a0, a1, a2, a3 = ptx.ldmatrix_x4(tile, frag)
    b0, b1, b2, b3 = ptx.ldmatrix_x4_trans(tile, frag)
    d0, d1, d2, d3 = ptx.mma_f16_f32(a0, a1, a2, a3, b0, b1, 0.0, 0.0, 0.0, 0.0)
    p = ptx.f32x2_to_bf16x2(d0, d1)
    q = ptx.f32x2_to_bf16x2(d2, d3)
    e0, e1, e2, e3 = ptx.mma_bf16_f32(p, q, p, q, b2, b3, d0, d1, d2, d3)
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


class ToolMissing(RuntimeError):
    """ptxas or nvdisasm could not be found."""


def _wheel_tools(name: str) -> list[Path]:
    """`name` in the NVIDIA pip wheels' bin folders (nvidia/<package>/bin)."""
    roots = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    return [p for r in roots if r and Path(r).is_dir()
            for p in sorted(Path(r).glob(f"nvidia/*/bin/{name}"))]


def find_tool(name: str, explicit: str | None = None) -> str:
    """Path to CUDA tool `name`: `explicit`, else $NAME, else PATH, else a pip wheel."""
    env = os.environ.get(name.upper())
    for given, origin in ((explicit, f"--{name}"), (env, f"${name.upper()}")):
        if given:
            found = shutil.which(given)
            if found is None:
                raise ToolMissing(f"{origin}={given}: not an executable")
            return found
    found = shutil.which(name) or next((str(p) for p in _wheel_tools(name)), None)
    if found is None:
        raise ToolMissing(f"{name} not found on PATH nor in an NVIDIA wheel: install it "
                          f"(`{PIP_HINT}`, or the CUDA toolkit), or pass --{name} PATH "
                          f"or set ${name.upper()}")
    return found


def load_kernel(spec: str):
    """The kernel `module:function`, or the kernel that a factory returns for literal
    arguments: `module:factory(128, 'float16', 4)`."""
    module, sep, name = spec.partition(":")
    call = FACTORY_CALL.fullmatch(name)
    if not sep or not module or not name or ("(" in name and not call):
        raise ValueError(f"{spec!r}: expected MODULE:FUNCTION or MODULE:FACTORY(ARGS)")
    kernel = getattr(importlib.import_module(module), call[1] if call else name)
    if call:
        kernel = kernel(*ast.literal_eval(f"[{call[2]}]"))
    return getattr(kernel, "dispatcher", kernel)   # a `launch.Specialised`: its dispatcher


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


def count_instructions(sass: str) -> dict:
    """How many SASS instructions of each `INSTRUCTIONS` kind `sass` holds."""
    opcodes = SASS_LINE.findall(sass)
    return {kind: sum(1 for op in opcodes if matches(op))
            for kind, matches in INSTRUCTIONS.items()}


def analyse(kernel, signature: str, ptxas: str, nvdisasm: str, folder: Path) -> dict:
    """Compile `kernel` (a `@cuda.jit` kernel, with its launch bounds, or a Python
    function) for sm_90, assemble and disassemble it; its figures."""
    pyfunc = getattr(kernel, "py_func", kernel)
    bounds = getattr(kernel, "targetoptions", {}).get("launch_bounds")
    text, _ = cuda.compile_ptx(pyfunc, signature, cc=CC, launch_bounds=bounds)
    source = folder / f"{pyfunc.__name__}.ptx"
    cubin = source.with_suffix(".cubin")
    source.write_text(text)
    assembled = _tool([ptxas, f"-arch={ARCH}", "-v", "-o", str(cubin), str(source)])
    sass = _tool([nvdisasm, "-c", str(cubin)]).stdout
    cubin.with_suffix(".sass").write_text(sass)
    return {**parse_ptxas(assembled.stdout + assembled.stderr), **count_instructions(sass)}


def _tool(command: list) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr}")
    return done


def report(name: str, figures: dict) -> str:
    counts = "  ".join(f"{kind} {figures[kind]}" for kind in INSTRUCTIONS)
    return (f"{name}\n  registers {figures['registers']}  spill stores "
            f"{figures['spill_stores']} B  spill loads {figures['spill_loads']} B  "
            f"stack (local) {figures['stack']} B  static shared {figures['shared']} B\n"
            f"  {counts}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernels", nargs="*", metavar="MODULE:FUNCTION SIGNATURE",
                        help="further kernels, each followed by its Numba signature")
    parser.add_argument("--ptxas", help="ptxas executable")
    parser.add_argument("--nvdisasm", help="nvdisasm executable")
    parser.add_argument("--keep", type=Path, help="write the .ptx, .cubin, .sass files here")
    args = parser.parse_args(argv)
    if len(args.kernels) % 2:
        parser.error("kernels come as MODULE:FUNCTION SIGNATURE pairs")
    if kv_device.SIMULATOR:
        parser.error("KVNUMBA_DEVICE=simulator cannot compile to PTX: unset it or use "
                     "'compile'")
    try:
        tools = find_tool("ptxas", args.ptxas), find_tool("nvdisasm", args.nvdisasm)
    except ToolMissing as e:
        print(f"bench.sass: {e}", file=sys.stderr)
        return 2
    kernels = [("bench.sass:intrinsics_probe", intrinsics_probe, PROBE_SIGNATURE)]
    kernels += [(spec, load_kernel(spec), sig)
                for spec, sig in zip(args.kernels[::2], args.kernels[1::2])]
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.keep or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        print(f"sm_90 static report ({ARCH}; ptxas {tools[0]}; nvdisasm {tools[1]})")
        for name, kernel, signature in kernels:
            try:
                figures = analyse(kernel, signature, *tools, folder)
            except Exception as e:  # a compiler, a library or a tool is missing or failed
                print(f"bench.sass: {name}: {type(e).__name__}: {str(e).strip()}", file=sys.stderr)
                if re.search(r"nvvm|nvrtc", str(e), re.IGNORECASE):
                    print(f"bench.sass: {COMPILER_HINT}", file=sys.stderr)
                return 1
            print(report(f"{name} {signature}", figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
