"""Runs ``int8_interpreter_cases.py`` (the INT8 path's Triton kernels on the CPU through Triton's
interpreter, against their torch twins) in a fresh pytest process: the interpreter has to be
switched on before triton is first imported, and this process has imported it already."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

HERE = Path(__file__).resolve().parent


def test_int8_kernels_match_their_twins_under_the_interpreter():
    pytest.importorskip("triton", reason="needs the triton package (ships with torch's Linux wheels)")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         str(HERE / "int8_interpreter_cases.py")],
        cwd=str(HERE.parents[1]), env=env, capture_output=True, text=True, timeout=600)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "failed" not in proc.stdout, tail
