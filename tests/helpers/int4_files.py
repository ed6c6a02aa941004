"""Int4 layers built with the pack's own code, for tests that need many of them in a model (the kitchen-made
fixtures of helpers/kitchen_awq.py and kitchen_svdquant.py pin the formats themselves).

`svdquant_parts(w, rank)`: an SVDQuant W4A4 layer for the float weight `w` [N, K] (N a multiple of 128, K of
64), as SVDQuant makes one: a rank-`rank` branch from the weight's SVD, a smoothing factor, the smoothed
residual rounded to signed 4 bits per 64 inputs (scale = absmax / 7), tiled; tensors under the spec's names.
`awq_parts(w, group)`: an AWQ W4A16 layer by the pack's round-to-nearest quantizer, in kitchen's form.
"""

from __future__ import annotations

import json

import torch

from fp8_engram.quant import QuantizedTensor
from fp8_engram.quant.layouts import awq, svdquant
from fp8_engram.quant.layouts.comfy_int8 import pack_int4


def _json(conf: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)


def svdquant_parts(w: torch.Tensor, rank: int, dtype=torch.bfloat16, seed: int = 0) -> dict[str, torch.Tensor]:
    n, k = w.shape
    g = torch.Generator().manual_seed(seed)
    w = w.double()
    smooth = (torch.rand(k, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    up, down = (u[:, :rank] * s[:rank]).to(dtype), vh[:rank].t().contiguous().to(dtype)
    resid = (w - up.double() @ down.double().t()) * smooth.double()[None, :]
    groups = resid.view(n, k // 64, 64)
    scale = (groups.abs().amax(-1) / 7).clamp(min=1e-8).to(dtype)
    codes = (groups / scale.double().unsqueeze(-1)).round().clamp(-8, 7).view(n, k)
    return {"weight": svdquant.tile_weight(pack_int4(codes)),
            "weight_scale": scale.t().contiguous().view(k // 64, n // 128, 128).permute(1, 0, 2).contiguous(),
            "smooth_factor": smooth, "proj_down": down,
            "proj_up": up.view(n // 128, 128, rank).permute(0, 2, 1).contiguous(),
            "comfy_quant": _json({"format": svdquant.FORMAT, "layout": svdquant.TILE_LAYOUT})}


def awq_parts(w: torch.Tensor, group: int = 64, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    qt = QuantizedTensor.from_float(w.float(), awq.AWQW4A16.for_shape(w.shape, group, dtype))
    return {k: v.contiguous() for k, v in awq.file_tensors(qt).items()}
