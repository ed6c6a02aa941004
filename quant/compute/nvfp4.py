"""The NVFP4 linear: weight-only on every device (the fp4 x fp4 matmul needs Blackwell).

The CPU dequantizes and multiplies; CUDA runs ``kernels/nvfp4_gemm.py``, which decodes the 4-bit
weight in registers, up to ``FUSED_MAX_M`` tokens. Pure torch; never imports ComfyUI.
"""

from __future__ import annotations

import torch

from ..errors import QuantizationError
from ..kernels import nvfp4_gemm
from ..layouts.nvfp4 import split_scales

__all__ = ["weight_only_linear", "FUSED_MAX_M"]

# At or below this many tokens the fused GEMM (weight read as 4 bits) runs on CUDA; above it one
# dequantize then cuBLAS (compute-bound there, where cuBLAS is the faster matmul).
FUSED_MAX_M = 1024


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
    if w.qdata.is_cuda and not needs_grad and x2d.shape[0] <= FUSED_MAX_M and nvfp4_gemm.supported(x2d, w.qdata):
        block, ts = split_scales(w.scale, w.layout)
        with torch.cuda.device(w.qdata.device):
            y = nvfp4_gemm.nvfp4_linear_triton(x2d.contiguous(), w.qdata, block.view(torch.uint8), ts, out_f, bias)
        return y.reshape(*x.shape[:-1], out_f)
    return torch.nn.functional.linear(x, w.dequantize(cdt), bias)
