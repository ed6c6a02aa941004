"""ConvRot groups (``convrot_groupsize`` of int8_tensorwise / convrot_w4a4) are checked against the
layer before anything is built (issue 27, finding 2): the group must divide the layer's inputs, be a
power of 4, and its rotation matrix (4 * group**2 bytes) may not cost more than the layer's own weights.

The address-space check: files declaring group sizes of 2**30, 4**12 and 4**8, loaded by a child
process whose address space is limited to 6 GiB: each must be a FormatError that names the file and
the layer, within 5 s of the load starting. Before the fix the loader built the group's Hadamard
matrix first (16 GiB for 4**8): a bare allocator RuntimeError, after 3-15 s.

Two files of each format: one whose group does not divide the layer's inputs, and one made so that it
does (a [1, group] weight), which only the memory rule refuses. A control file with ComfyUI's default
group 256 loads under the same limit. The child reports each load's time and outcome as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from fp8_engram.quant.layouts import int8 as int8_layout
from fp8_engram.quant.formats import FormatError, load_file

pytestmark = pytest.mark.unit

LIMIT_BYTES = 6 << 30
MAX_SECONDS = 5.0

CHILD = r"""
import json, resource, sys, time
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from fp8_engram.quant.formats import FormatError, load_file
for path in sys.argv[2:]:
    t0 = time.perf_counter()
    try:
        load_file(path)
        outcome, msg = "loaded", ""
    except Exception as exc:  # every outcome is reported; the parent judges
        outcome, msg = type(exc).__name__, str(exc)[:2000]
    print(json.dumps({"path": path, "outcome": outcome, "message": msg, "seconds": time.perf_counter() - t0}),
          flush=True)
"""


def cq(conf) -> torch.Tensor:
    return torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)


def _file(tmp_path, fmt: str, n: int, k: int, gs: int) -> str:
    if fmt == "int8_tensorwise":
        sd = {"l.weight": torch.ones(n, k, dtype=torch.int8), "l.weight_scale": torch.full((n, 1), 0.01),
              "l.comfy_quant": {"format": fmt, "convrot": True, "convrot_groupsize": gs}}
    else:
        sd = {"l.weight": torch.ones(n, k // 2, dtype=torch.int8), "l.weight_scale": torch.full((n,), 0.01),
              "l.comfy_quant": {"format": fmt, "convrot_groupsize": gs}}
    sd["l.comfy_quant"] = cq(sd["l.comfy_quant"])
    path = tmp_path / f"{fmt}_{gs}_{n}x{k}.safetensors"
    save_file(sd, str(path))
    return str(path)


CASES = [(fmt, n, k, gs) for fmt in ("int8_tensorwise", "convrot_w4a4") for (n, k, gs) in (
    (16, 1024, 2 ** 30), (16, 1024, 4 ** 12), (16, 1024, 4 ** 8),  # the group does not divide K
    (1, 4 ** 12, 4 ** 12), (1, 4 ** 8, 4 ** 8),  # it does; the matrix would be 1 PiB / 16 GiB
)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux's RLIMIT_AS")
def test_huge_convrot_groups_are_named_errors_under_a_6_gib_address_space(tmp_path):
    files = [_file(tmp_path, *case) for case in CASES]
    control = _file(tmp_path, "int8_tensorwise", 64, 1024, 256)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(LIMIT_BYTES), *files, control],
                          capture_output=True, text=True, timeout=600, env=env)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and len(rows) == len(files) + 1, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    for r in rows:  # shown with -s: the figures of the check
        print(f"RLIMIT_AS 6 GiB: {os.path.basename(r['path'])}: {r['outcome']} in {r['seconds'] * 1000:.2f} ms")
    for (fmt, n, k, gs), row in zip(CASES, rows):
        assert row["outcome"] == "FormatError", (fmt, gs, row)
        assert row["path"] in row["message"] and "'l.comfy_quant'" in row["message"], row
        assert f"ConvRot group size {gs}" in row["message"], row
        assert row["seconds"] < MAX_SECONDS, (fmt, gs, row["seconds"])
    assert rows[-1]["outcome"] == "loaded", rows[-1]


def _raises_named(path, *parts) -> str:
    with pytest.raises(FormatError) as info:
        load_file(path)
    msg = str(info.value)
    assert str(path) in msg
    for part in parts:
        assert part in msg, msg
    return msg


@pytest.mark.parametrize("fmt", ["int8_tensorwise", "convrot_w4a4"])
@pytest.mark.parametrize("n,k,gs,why", [
    (8, 4096, 4 ** 6, "more than the layer's own"),  # divides K; a 64 MiB matrix for 32 KiB of weights
    (16, 1024, 4 ** 6, "does not divide"),
    (16, 1024, 4 ** 5, "more than the layer's own"),  # divides K; 4 MiB for 16 KiB
    (16, 1024, 2048, "does not divide"),
    (16, 1024, 128, "power of 4"),
])
def test_convrot_group_is_checked_against_the_layer_before_anything_is_built(tmp_path, fmt, n, k, gs, why):
    before = set(int8_layout._hadamards)
    path = _file(tmp_path, fmt, n, k, gs)
    msg = _raises_named(path, "'l.comfy_quant'", f"ConvRot group size {gs}", why)
    assert "256" in msg  # what to use instead
    assert set(int8_layout._hadamards) == before  # no matrix was built (nor cached)


def test_convrot_groups_whose_matrix_fits_the_layer_load(tmp_path):
    """The rule refuses what costs more than the layer, not large groups: 1024 (a 4 MiB matrix) on a
    4 MiB layer loads with its 1024-wide rotation; ComfyUI's default 256 loads on a layer of any size."""
    path = _file(tmp_path, "int8_tensorwise", 1024, 4096, 1024)
    w = load_file(path)[0]["l.weight"]
    assert w.layout.rotation == 1024 and w.layout.regular
    small = _file(tmp_path, "convrot_w4a4", 2, 256, 256)  # 256 bytes of weights, a 256 KiB matrix
    assert load_file(small)[0]["l.weight"].layout.rotation == 256
