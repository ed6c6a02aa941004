"""AWQ W4A16 files and references made by comfy-kitchen's own code (a pinned release, in a subprocess).

comfy-kitchen 0.2.40 cannot quantize AWQ itself (its ``TensorCoreAWQW4A16Layout.quantize`` raises: AWQ
weights come from offline calibration), so the script draws seeded codes, scales and zero points, names them
as kitchen's ``state_dict_tensors`` does, adds the ``comfy_quant`` JSON, and records beside them what
kitchen's layout dequantization and its eager ``gemv_awq_w4a16`` make of them.
"""

from __future__ import annotations

import json
from pathlib import Path

from helpers.kitchen import run_kitchen

_WRITE_AWQ = r"""
import json, sys
from importlib.metadata import version
import torch
from safetensors.torch import save_file
from comfy_kitchen.tensor.awq_w4a16 import TensorCoreAWQW4A16Layout as L
from comfy_kitchen.backends.eager import awq as eager

layers, out = json.loads(sys.argv[1]), sys.argv[2]
sd, refs = {}, {}
gen = torch.Generator().manual_seed(0)
for name, (n, k, group, sdt, declare_group) in layers.items():
    sdt = getattr(torch, sdt)
    qdata = torch.randint(-128, 128, (n, k // 2), generator=gen, dtype=torch.int16).to(torch.int8)
    scale = (torch.rand(k // group, n, generator=gen) * 0.05 + 1e-3).to(sdt)
    zeros = (torch.randn(k // group, n, generator=gen) * 0.03).to(sdt)
    params = L.Params(scale=scale, orig_dtype=torch.float32, orig_shape=(n, k), zeros=zeros, group_size=group)
    for suffix, t in L.state_dict_tensors(qdata, params).items():
        sd[name + ".weight" + suffix] = t.contiguous()
    conf = {"format": "awq_w4a16"}
    if declare_group:
        conf["group_size"] = group
    sd[name + ".comfy_quant"] = torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)
    sd[name + ".bias"] = (torch.randn(n, generator=gen) * 0.1).to(sdt)
    for dtype in (torch.float32, torch.bfloat16):
        p = L.Params(scale=scale, orig_dtype=dtype, orig_shape=(n, k), zeros=zeros, group_size=group)
        refs[name + "." + str(dtype).split(".")[1]] = L.dequantize(qdata, p)
    x = torch.randn(5, k, generator=gen).to(sdt)
    refs[name + ".x"] = x
    refs[name + ".gemv"] = eager.gemv_awq_w4a16(x, qdata, scale, zeros, bias=sd[name + ".bias"], group_size=group)
save_file(sd, out + "/awq.safetensors", metadata={"kitchen": version("comfy-kitchen")})
save_file(refs, out + "/awq_refs.safetensors")
"""


def write_awq_file(folder: Path, layers: dict, out: Path) -> tuple[Path, dict]:
    """`out/awq.safetensors` made with the comfy-kitchen in `folder` from `layers` ({name: (out, in, group_size,
    scale dtype name, whether the JSON declares group_size)}), and its references {"<name>.float32" /
    "<name>.bfloat16": kitchen's layout dequantization (its result dtype: the output dtype promoted with the
    scales'), "<name>.x": an activation, "<name>.gemv": kitchen's eager gemv_awq_w4a16 of it with the bias}."""
    from safetensors import safe_open

    run_kitchen(folder, _WRITE_AWQ, json.dumps(layers), str(out))
    path = out / "awq.safetensors"
    with safe_open(str(path), "pt") as f:
        made_by = f.metadata()["kitchen"]
    if not folder.name.endswith("-" + made_by):
        raise AssertionError(f"{path} was written by comfy-kitchen {made_by}, not the one in {folder}")
    with safe_open(str(out / "awq_refs.safetensors"), "pt") as f:
        return path, {k: f.get_tensor(k) for k in f.keys()}
