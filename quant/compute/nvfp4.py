"""The NVFP4 linear: weight-only on every device (the fp4 x fp4 matmul needs Blackwell).

The CPU dequantizes and multiplies. On CUDA, ``kernels/nvfp4_gemm.py`` decodes the 4-bit weight in
registers; per shape class it is proven against its twin (dequantize, then ``F.linear``) and timed
against that plain path the first time (``choice``, kind "NVFP4 GEMM"), and runs only where it is right
and faster. Where the config trusts fast paths it runs up to ``FUSED_MAX_M`` tokens, unproven.
Pure torch; never imports ComfyUI.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import DEFAULT_CONFIG
from ..errors import QuantizationError
from ..kernels import nvfp4_gemm
from ..layouts.nvfp4 import split_scales
from ..runtime import tracing
from . import candidates as cand, choice

__all__ = ["weight_only_linear", "FUSED_MAX_M"]

# Trusting fast paths: at or below this many tokens the fused GEMM (weight read as 4 bits) runs on
# CUDA; above it one dequantize then cuBLAS (compute-bound there, where cuBLAS is the faster matmul).
FUSED_MAX_M = 1024


def _fused(x2d: torch.Tensor, w, bias, cdt: torch.dtype) -> bool:
    """Whether this product takes the fused GEMM: proven and measured faster for its shape class."""
    m = x2d.shape[0]
    cfg = w.config or DEFAULT_CONFIG
    if cfg.trust_fast_paths or tracing():
        return m <= FUSED_MAX_M
    out_f, in_f = w.layout.shape
    key = choice.key_for("NVFP4 GEMM", "weight_only", w.layout.key, m, out_f, in_f, x2d.dtype, w.qdata.dtype, cdt,
                         bias is not None)
    v = choice.known(x2d.device, key)
    if v is None:
        rep = choice.shape_class(m, out_f, in_f)[1]
        xp = cand.proof_activation(rep, in_f, cdt, x2d.device)
        s = cand.Sample(rep, out_f, x2d.device)
        wref = cand.weight_reference(w, s.cols)
        block, ts = split_scales(w.scale, w.layout)

        def gemm():
            with torch.cuda.device(w.qdata.device):
                return nvfp4_gemm.nvfp4_linear_triton(xp, w.qdata, block.view(torch.uint8), ts, out_f, bias)

        cands = {"gemm": cand.gemm(gemm, xp, wref, bias, cdt, s),
                 "plain": cand.plain(lambda: F.linear(xp, w.dequantize(cdt), bias), xp, wref, bias, s)}
        v = choice.decide(x2d.device, key, "NVFP4 GEMM", cands, s, fallback="plain")
    return v.chosen == "gemm"


def weight_only_linear(x: torch.Tensor, w, bias: torch.Tensor | None, cdt: torch.dtype) -> torch.Tensor:
    """``x @ W.T + bias`` in ``cdt`` for an NVFP4 QuantizedTensor ``w`` (not transposed); x of any rank."""
    if x.dtype != cdt:
        x = x.to(cdt)
    if bias is not None and bias.dtype != cdt:
        bias = bias.to(cdt)
    out_f, in_f = w.layout.shape
    if x.dim() == 0 or x.shape[-1] != in_f:
        raise QuantizationError(f"linear: input of shape {list(x.shape)} does not fit a weight of shape "
                                f"[{out_f}, {in_f}] (last input dim must be {in_f})")
    x2d = x.reshape(-1, in_f)
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
    if w.qdata.is_cuda and not needs_grad and nvfp4_gemm.supported(x2d, w.qdata) and _fused(x2d, w, bias, cdt):
        block, ts = split_scales(w.scale, w.layout)
        with torch.cuda.device(w.qdata.device):
            y = nvfp4_gemm.nvfp4_linear_triton(x2d.contiguous(), w.qdata, block.view(torch.uint8), ts, out_f, bias)
        return y.reshape(*x.shape[:-1], out_f)
    return torch.nn.functional.linear(x, w.dequantize(cdt), bias)
