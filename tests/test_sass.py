"""`python -m bench.sass`: its parsing, counting and tool finding (compiling for sm_90
needs libNVVM, ptxas and nvdisasm, which these tests do not assume)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import sass

ROOT = Path(__file__).resolve().parents[1]

PTXAS_V = """\
ptxas info    : 8 bytes gmem
ptxas info    : Compiling entry function '_ZN6kernelE' for 'sm_90a'
ptxas info    : Function properties for _ZN6kernelE
    48 bytes stack frame, 24 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 33792 bytes smem, 400 bytes cmem[0]
ptxas info    : Compile time = 28.019 ms
"""

SASS = """\
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*00d0*/                   LDGSTS.E.BYPASS.128 [R23], desc[UR4][R20.64] ;
        /*00f0*/                   LDG.E.128.CONSTANT R12, desc[UR4][R20.64] ;
        /*0100*/              @!P0 LDG.E.128 R8, desc[UR4][R2.64] ;
        /*0110*/                   LDG.E.64 R2, desc[UR4][R20.64] ;
        /*0150*/                   LDSM.16.M88.4 R4, [R23] ;
        /*0160*/               @P1 LDSM.16.MT88.4 R8, [R23] ;
        /*0180*/                   SHFL.BFLY PT, R19, R14, 0x2, 0x1f ;
        /*01e0*/                   SHFL.IDX PT, R16, R22, 0x3, 0x1f ;
        /*0210*/                   HMMA.16816.F32 R16, R4, R8, R16 ;
        /*0240*/                   HMMA.16816.F32.BF16 R4, R4, R10, R16 ;
        /*0250*/                   STL [R1], R4 ;
        /*0260*/                   LDL R4, [R1] ;
        /*0270*/                   DFMA R4, R4, R6, R8 ;
        /*0280*/                   DADD R4, R4, R6 ;
        /*02f0*/                   STG.E.128 desc[UR4][R14.64], R8 ;
        /*0300*/                   STG.E desc[UR4][R16.64], R4 ;
        /*0310*/                   EXIT ;
"""


def test_ptxas_figures_are_read_from_its_verbose_output():
    assert sass.parse_ptxas(PTXAS_V) == {"registers": 168, "spill_stores": 24,
                                         "spill_loads": 16, "stack": 48, "shared": 33792}


def test_sass_instructions_are_counted_by_kind_predicated_or_not():
    counts = sass.count_instructions(SASS)
    assert counts == {"LDG.E.128": 2, "STG.E.128": 1, "LDGSTS": 1, "LDSM": 2, "HMMA": 2,
                      "SHFL": 2, "LDL": 1, "STL": 1, "DADD": 1, "DMUL": 0, "DFMA": 1}


def test_a_factory_kernel_is_named_by_its_literal_arguments():
    from kvnumba.kernels import decode
    kernel = decode._decode_kernel(16, "float16", 1, False)
    got = sass.load_kernel("kvnumba.kernels.decode:_decode_kernel(16, 'float16', 1, False)")
    assert got is kernel.dispatcher
    with pytest.raises(ValueError, match="MODULE:FACTORY"):
        sass.load_kernel("_decode_kernel(16)")
    with pytest.raises(ValueError, match="MODULE:FACTORY"):
        sass.load_kernel("kvnumba.kernels.decode:_decode_kernel(16, 'float16'")


def test_tool_named_explicitly_must_exist(tmp_path):
    with pytest.raises(sass.ToolMissing, match="--ptxas="):
        sass.find_tool("ptxas", str(tmp_path / "ptxas"))


def test_tool_from_environment_variable(tmp_path, monkeypatch):
    tool = tmp_path / "nvdisasm"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("NVDISASM", str(tool))
    assert sass.find_tool("nvdisasm") == str(tool)


def test_missing_tool_says_how_to_install_it(monkeypatch):
    monkeypatch.delenv("PTXAS", raising=False)
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr(sass, "_wheel_tools", lambda name: [])
    with pytest.raises(sass.ToolMissing, match="pip install nvidia-cuda-nvcc"):
        sass.find_tool("ptxas")


def test_command_line_reports_a_missing_tool_without_compiling(tmp_path):
    env = dict(os.environ, KVNUMBA_DEVICE="compile")
    proc = subprocess.run([sys.executable, "-m", "bench.sass", "--ptxas",
                           str(tmp_path / "none")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--ptxas=" in proc.stderr and "not an executable" in proc.stderr
