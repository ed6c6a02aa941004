"""A pinned comfy-kitchen release, installed once for the tests that compare the pack with its own code.

`kitchen_dir(version)` installs `comfy-kitchen==version` (no dependencies: torch is the test
environment's) with pip into `.host/kitchen/comfy-kitchen-<version>`, once, and skips the calling test,
naming the package and pip's reason, where that cannot be done (offline, no wheel for this platform or
Python). `run_kitchen(folder, script, *args)` runs a Python script in a subprocess whose `import
comfy_kitchen` finds that folder first, so the release never meets the test process's own imports
(ComfyUI 0.33's environment has comfy-kitchen 0.2.31 installed). `write_asym_file` makes an
`asym_w4a8_int8` file (4- or 6-bit per layer) with that release's own quantizer, and the references
from its eager backend.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from helpers.host import missing_prerequisite

ROOT = Path(__file__).resolve().parents[2]
KITCHEN_HOME = ROOT / ".host" / "kitchen"

# Run with the release first on the path: quantizes seeded weights with the layout ComfyUI calls
# (AsymW4A8Int8Layout.quantize, bits 4 or 6), writes them under the names kitchen's state_dict gives plus
# the comfy_quant JSON ComfyUI 0.33 writes, and beside them what kitchen's eager backend makes of them.
_WRITE_ASYM = r"""
import json, sys
from importlib.metadata import version
import torch
from safetensors.torch import save_file
from comfy_kitchen.tensor.w4a8_int8 import AsymW4A8Int8Layout
from comfy_kitchen.backends.eager import w4a8_int8 as eager

layers, out = json.loads(sys.argv[1]), sys.argv[2]
sd, refs = {}, {}
gen = torch.Generator().manual_seed(0)
for name, (n, k, group, rot, bits) in layers.items():
    w = torch.randn(n, k, generator=gen) * (torch.rand(1, k, generator=gen) * 3 + 0.1)
    w[:, ::37] *= 8  # outlier columns: wide group scales, codes at both ends
    qdata, params = AsymW4A8Int8Layout.quantize(w, group_size=group, convrot_groupsize=rot, bits=bits)
    for suffix, t in AsymW4A8Int8Layout.state_dict_tensors(qdata, params).items():
        sd[name + ".weight" + suffix] = t.contiguous()
    conf = {"format": "asym_w4a8_int8", "group_size": group, "convrot_groupsize": rot}
    sd[name + ".comfy_quant"] = torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)
    refs[name + ".source"] = w
    refs[name + ".grid"] = eager._dequant_int4_grouped_to_int8(qdata, params.scale, params.codebook, group)
    for dtype in (torch.float32, torch.bfloat16):
        refs[name + "." + str(dtype).split(".")[1]] = eager.dequantize_w4a8_int8_weight(
            qdata, params.scale, params.s_channel, codebook=params.codebook, correction=params.correction,
            group_size=group, convrot_groupsize=rot, output_dtype=dtype)
save_file(sd, out + "/asym.safetensors", metadata={"kitchen": version("comfy-kitchen")})
save_file(refs, out + "/refs.safetensors")
"""


def kitchen_dir(version: str) -> Path:
    """The folder holding comfy-kitchen `version` (installed on first use); skips the test where it cannot be."""
    folder = KITCHEN_HOME / f"comfy-kitchen-{version}"
    if not (folder / "comfy_kitchen" / "__init__.py").is_file():
        KITCHEN_HOME.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".comfy-kitchen-{version}-", dir=KITCHEN_HOME))
        try:
            done = subprocess.run(
                [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                 "--target", str(partial), f"comfy-kitchen=={version}"],
                capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
                missing_prerequisite(f"comfy-kitchen {version} could not be installed with pip "
                            f"({lines[-1] if lines else f'exit {done.returncode}'})")
            try:
                partial.rename(folder)  # whole or absent: another test run may have finished first
            except OSError:
                if not (folder / "comfy_kitchen" / "__init__.py").is_file():
                    raise
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    probe = run_kitchen(folder, "import comfy_kitchen.backends.eager.w4a8_int8", check=False)
    if probe.returncode != 0:
        lines = [line for line in probe.stderr.splitlines() if line.strip()]
        missing_prerequisite(f"comfy-kitchen {version} is installed in {folder} but does not import here "
                    f"({lines[-1] if lines else f'exit {probe.returncode}'})")
    return folder


def run_kitchen(folder: Path, script: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run `script` (Python source) with `args` in a subprocess that imports comfy-kitchen from `folder`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(folder)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["CUDA_VISIBLE_DEVICES"] = ""  # kitchen's eager (CPU) code is the reference
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                          timeout=600)
    if check and done.returncode != 0:
        raise AssertionError(f"comfy-kitchen script failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return done


def write_asym_file(folder: Path, layers: dict, out: Path) -> tuple[Path, dict]:
    """`out/asym.safetensors` made by the comfy-kitchen in `folder` from `layers` ({name: (out, in,
    group_size, convrot_groupsize, bits)}), and its references {"<name>.source": the float32 weight,
    "<name>.grid": kitchen's int8 grid, "<name>.float32" / "<name>.bfloat16": kitchen's eager dequantization}."""
    from safetensors import safe_open

    run_kitchen(folder, _WRITE_ASYM, json.dumps(layers), str(out))
    path = out / "asym.safetensors"
    with safe_open(str(path), "pt") as f:
        made_by = f.metadata()["kitchen"]
    if not folder.name.endswith("-" + made_by):
        raise AssertionError(f"{path} was written by comfy-kitchen {made_by}, not the one in {folder}")
    with safe_open(str(out / "refs.safetensors"), "pt") as f:
        return path, {k: f.get_tensor(k) for k in f.keys()}
