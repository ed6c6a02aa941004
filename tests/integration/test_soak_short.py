"""The soak, short: bench/soak.py --short through its own real ComfyUI server (three cycles of FP8 loads
over several formats, Quantize + Save FP8 Model, New/Load/Save Engram Memory, Memorize, Engram Apply,
Inspect, and /interrupt during Engram Train, Load Engram Memory and Load FP8 Diffusion Model).

Nothing may grow: the server's RSS after the last cycle within 5 % of its RSS after the first
(warm-up), as many engram worker processes and no more file descriptors than after warm-up, and no
prompt failing except the cancelled ones (as interrupted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_short_soak_keeps_memory_workers_and_descriptors_flat(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "soak.py"), "--short", "--prompts", "18", "--keep", str(tmp_path / "base")],
                          capture_output=True, text=True, timeout=900)
    lines = proc.stdout.strip().splitlines()
    assert lines, f"soak printed nothing; stderr:\n{proc.stderr[-4000:]}"
    figures = json.loads(lines[-1])
    print("\n".join(lines))
    assert figures["bench"] == "soak" and figures["prompts"] >= 18
    assert figures["unexpected_errors"] == 0, proc.stdout + proc.stderr[-4000:]
    assert figures["rss_growth"] <= 0.05
    assert figures["workers_end"] == figures["workers_warm"] >= 2  # New + Load Engram Memory, 1 worker each
    assert figures["fds_end"] <= figures["fds_warm"]
    assert figures["cancels"] >= 3 and figures["cancels_interrupted"] >= 1
    assert proc.returncode == 0
