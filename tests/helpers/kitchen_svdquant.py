"""SVDQuant W4A4 layers in the tile-packed form, and what comfy-kitchen's own code makes of them (a pinned
release, in a subprocess).

comfy-kitchen 0.2.40 cannot make SVDQuant weights (its layout's ``quantize`` raises: they come from offline
calibration), so the script builds a layer the way SVDQuant does (a rank-R branch from the weight's SVD, the
smoothed residual rounded to 4 bits per 64 inputs with kitchen's own packing), tiles it, checks the tiling
against kitchen's own untiling functions, and records kitchen's layout dequantization (its effective weight) and
its runtime product (``_w4a4_forward``: the activation quantized to 4 bits, eager on the CPU).
"""

from __future__ import annotations

import json
from pathlib import Path

from helpers.kitchen import run_kitchen

_WRITE_SVDQ = r"""
import json, sys
from importlib.metadata import version
import torch
from safetensors.torch import save_file
from comfy_kitchen.backends.eager import svdquant as eager
from comfy_kitchen.tensor.base import QuantizedTensor as KQT
from comfy_kitchen.tensor.svdquant_w4a4 import TensorCoreSVDQuantW4A4Layout as L, _w4a4_forward

layers, out = json.loads(sys.argv[1]), sys.argv[2]
sd, refs = {}, {}
gen = torch.Generator().manual_seed(0)
for name, (n, k, r, dt, tiled_parts, unsigned) in layers.items():
    dt = getattr(torch, dt)
    w = torch.randn(n, k, generator=gen, dtype=torch.float64) * 0.05
    w[:, ::29] *= 6
    smooth = torch.rand(k, generator=gen, dtype=torch.float64) * 1.5 + 0.5
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    up, down = (u[:, :r] * s[:r]).to(dt), vh[:r].t().contiguous().to(dt)
    resid = (w - up.double() @ down.double().t()) * smooth.to(dt).double()[None, :]
    g = resid.view(n, k // 64, 64)
    scale = (g.abs().amax(-1) / 7).clamp(min=1e-8).to(dt)
    codes = (g / scale.double().unsqueeze(-1)).round().clamp(-8, 7).to(torch.int8).view(n, k)
    natural = eager._pack_int4_row_major(codes)
    tiles = natural.view(n // 128, 32, 4, k // 64, 32).permute(0, 3, 1, 2, 4).reshape(n // 128, k // 64, 32, 128).contiguous()
    assert torch.equal(eager._tile_packed_weight_to_row_major(tiles), natural)
    wscale = scale.t().contiguous()
    up_t = up.view(n // 128, 128, r).permute(0, 2, 1).contiguous()
    ws_t = wscale.view(k // 64, n // 128, 128).permute(1, 0, 2).contiguous()
    assert torch.equal(eager._tile_packed_lora_up_to_natural(up_t), up)
    assert torch.equal(eager._tile_packed_scales_to_natural(ws_t), wscale)
    sm = smooth.to(dt)
    conf = {"format": "svdquant_w4a4", "layout": "kitchen_tile_packed_w4a4", "lowrank_branch_input_basis": "raw",
            "proj_down_smooth_folded": True}
    if unsigned:
        conf["act_unsigned"] = True
    parts = {"weight": tiles, "weight_scale": ws_t if tiled_parts else wscale, "smooth_factor": sm,
             "proj_down": down, "proj_up": up_t if tiled_parts else up,
             "bias": (torch.randn(n, generator=gen) * 0.1).to(dt)}
    for key, t in parts.items():
        sd[name + "." + key] = t.contiguous()
    sd[name + ".comfy_quant"] = torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)
    refs[name + ".source"] = w.float()
    # in the layer's own dtype: kitchen 0.2.40's dequantize fails for another one (its product mixes dtypes)
    p = L.Params(scale=parts["weight_scale"], orig_dtype=dt, orig_shape=(n, k), proj_down=down, proj_up=parts["proj_up"],
                 smooth_factor=sm)
    refs[name + ".dequant"] = L.dequantize(tiles, p)
    x = torch.randn(7, k, generator=gen).to(dt)
    if unsigned:
        x = torch.nn.functional.gelu(x.float()).to(dt)  # what such a layer reads: post-GELU values
    p = L.Params(scale=parts["weight_scale"], orig_dtype=dt, orig_shape=(n, k), proj_down=down, proj_up=parts["proj_up"],
                 smooth_factor=sm, act_unsigned=bool(unsigned))
    refs[name + ".x"] = x
    refs[name + ".kitchen_out"] = _w4a4_forward(x, KQT(tiles, "TensorCoreSVDQuantW4A4Layout", p), parts["bias"])
save_file(sd, out + "/svdq.safetensors", metadata={"kitchen": version("comfy-kitchen")})
save_file(refs, out + "/svdq_refs.safetensors")
"""


def write_svdquant_file(folder: Path, layers: dict, out: Path) -> tuple[Path, dict]:
    """`out/svdq.safetensors` made with the comfy-kitchen in `folder` from `layers` ({name: (out, in, rank, dtype
    name, weight_scale and proj_up tile-packed too, act_unsigned)}), and references {"<name>.source": the float
    weight, "<name>.dequant": kitchen's layout dequantization (in the layer's dtype), "<name>.x": an activation,
    "<name>.kitchen_out": kitchen's W4A4 product of it with the bias}."""
    from safetensors import safe_open

    run_kitchen(folder, _WRITE_SVDQ, json.dumps(layers), str(out))
    path = out / "svdq.safetensors"
    with safe_open(str(path), "pt") as f:
        made_by = f.metadata()["kitchen"]
    if not folder.name.endswith("-" + made_by):
        raise AssertionError(f"{path} was written by comfy-kitchen {made_by}, not the one in {folder}")
    with safe_open(str(out / "svdq_refs.safetensors"), "pt") as f:
        return path, {k: f.get_tensor(k) for k in f.keys()}
