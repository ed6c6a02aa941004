"""The fused weight-only GEMMs on CUDA: the weight read as stored and converted in registers, no dequantized copy.

    fused weight-only   FP8 weights (per tensor, per row, blocks whose columns are a multiple of 64):
                        ``kernels/weight_only_gemm.py``
    fused nvfp4         NVFP4 weights (packed e2m1, e4m3 block scales): ``kernels/nvfp4_gemm.py``

Both compute the plain path's math (its twin: dequantize, then ``F.linear`` in the compute dtype) and are
candidates under "auto" and "weight_only"; where fast paths are trusted they run up to
``FUSED_WEIGHT_ONLY_MAX_M`` / ``FUSED_NVFP4_MAX_M`` tokens. Pure torch; never imports ComfyUI.
"""

from __future__ import annotations

import torch

from ... import kernels
from ...kernels import nvfp4_gemm, ops as kernel_ops, weight_only_gemm
from ...layouts.nvfp4 import split_scales
from ...runtime import tracing
from .base import Path

__all__ = ["FusedWeightOnly", "FusedNvfp4", "FUSED_WEIGHT_ONLY", "FUSED_NVFP4", "FUSED_NVFP4_MAX_M"]

# Trusting fast paths: at or below this many tokens the NVFP4 GEMM (weight read as 4 bits) runs on CUDA;
# above it one dequantize then cuBLAS (compute-bound there, where cuBLAS is the faster matmul).
FUSED_NVFP4_MAX_M = 1024
_HALF = (torch.bfloat16, torch.float16)


def _gemm_block(w):
    """(kernel block, per_tensor, the GEMM's scale block or None) of an FP8 weight, or None."""
    block = w.layout.kernel_block(w.qdata.shape)
    if block is None:
        return None
    gemm = None if block[1] or tuple(block[0]) == (1, w.qdata.shape[1]) else tuple(block[0])
    return block[0], block[1], gemm


class FusedWeightOnly(Path):
    name = "fused weight-only"

    def operand(self, w, cfg, device, cdt):
        if (torch.device(device).type != "cuda" or cfg.path not in ("auto", "weight_only") or w.transposed
                or w.qdata.dim() != 2 or cdt not in _HALF or w.layout.family != "fp8"):
            return None
        parts = _gemm_block(w)
        if parts is None or (parts[2] is not None and parts[2][1] % weight_only_gemm.BLOCK_COLS_MULTIPLE):
            return None
        return w

    def accepts(self, x2d, w) -> bool:
        return weight_only_gemm.supported(x2d, w.qdata, _gemm_block(w)[2])

    def trusted(self, m, device) -> bool:
        return m <= kernels.FUSED_WEIGHT_ONLY_MAX_M

    def kind(self, w, cfg) -> str:
        return "weight-only GEMM"

    def run(self, x2d, w, bias, cdt, cfg=None, *, op: bool = False):
        x2d = x2d.to(cdt)
        bias = None if bias is None else bias.to(cdt)
        block, per_tensor, _ = _gemm_block(w)
        k = kernel_ops if op else kernels
        return k.weight_only_linear(x2d, w.qdata, w.scale, block, per_tensor, bias, method="fused")


class FusedNvfp4(Path):
    name = "fused nvfp4"

    def takes(self, w, cfg, device, cdt) -> bool:
        return (torch.device(device).type == "cuda" and cfg.path in ("auto", "weight_only") and not w.transposed
                and w.layout.family == "nvfp4" and cdt in _HALF)

    def operand(self, w, cfg, device, cdt):
        # no custom op wraps this GEMM: a compiled graph runs NVFP4 weights plain (dequantize, then matmul),
        # under the verdict their eager calls filed (``takes`` answers alike while tracing)
        return w if self.takes(w, cfg, device, cdt) and not tracing() else None

    def accepts(self, x2d, w) -> bool:
        return nvfp4_gemm.supported(x2d, w.qdata)

    def trusted(self, m, device) -> bool:
        return m <= FUSED_NVFP4_MAX_M

    def kind(self, w, cfg) -> str:
        return "NVFP4 GEMM"

    def run(self, x2d, w, bias, cdt, cfg=None, *, op: bool = False):
        block, ts = split_scales(w.scale, w.layout)
        bias = None if bias is None else bias.to(cdt)
        with torch.cuda.device(w.qdata.device):
            return nvfp4_gemm.nvfp4_linear_triton(x2d.to(cdt).contiguous(), w.qdata, block.view(torch.uint8), ts,
                                                  w.layout.shape[0], bias)


FUSED_WEIGHT_ONLY = FusedWeightOnly()
FUSED_NVFP4 = FusedNvfp4()
