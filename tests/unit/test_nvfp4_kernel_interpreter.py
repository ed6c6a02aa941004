"""Runs ``nvfp4_interpreter_cases.py`` (the NVFP4 weight-only GEMM on the CPU through Triton's
interpreter) in a fresh pytest process: the interpreter must be on before triton is first imported."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

HERE = Path(__file__).resolve().parent


def test_nvfp4_gemm_matches_the_cpu_path_under_the_interpreter():
    pytest.importorskip("triton", reason="needs the triton package (ships with torch's Linux wheels)")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "nvfp4_interpreter_cases.py")],
        cwd=str(HERE.parents[1]), env=env, capture_output=True, text=True, timeout=600)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "failed" not in proc.stdout, tail
