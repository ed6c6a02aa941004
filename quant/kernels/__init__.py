"""Kernels for the FP8 paths, each a Triton kernel beside its plain-torch twin, chosen here.

Layouts and the compute floor (``compute/``) say *what* is computed; this package says *how*. Every function below
takes the Triton kernel only where it can run (a CUDA tensor, ``import triton`` works, a dtype
and shape it handles) and otherwise calls the twin, which computes the same thing with torch ops
(on the CPU, on GPUs without Triton, on other devices).

    act_quant.py         activation -> FP8 + float32 scales (per row, per tensor, per 1x128 group)
    dequant.py           FP8 weight -> bf16/fp16/fp32 in one pass (every layout)
    weight_only_gemm.py  x @ dequant(W).T + b with the FP8 weight converted in registers
"""

from __future__ import annotations

import contextlib

import torch

from . import act_quant, dequant as _dequant, weight_only_gemm
from ._triton import HAS_TRITON

__all__ = ["HAS_TRITON", "quantize_rows", "quantize_tensor", "quantize_groups", "dequantize",
           "weight_only_linear", "FUSED_WEIGHT_ONLY_MAX_M"]

# Weight-only on GPUs: at or below this many tokens the fused GEMM (weight read once as FP8)
# should win; above it a one-pass dequantize into bf16 then cuBLAS does, because the GEMM is
# compute-bound there and cuBLAS is the faster matmul. Not yet measured on a GPU: `bench/
# quant_linear.py --device cuda` times both sides at 1..2048 tokens ("weight_only_table" in its
# JSON: measured_crossover_m) and this constant is to be set from that.
FUSED_WEIGHT_ONLY_MAX_M = 1024


_SAME_DEVICE = contextlib.nullcontext()


def _on(t: torch.Tensor):
    """Triton launches on the current CUDA device: switch to the tensor's when it differs
    (models spread over several GPUs)."""
    if t.device.index is None or t.device.index == torch.cuda.current_device():
        return _SAME_DEVICE
    return torch.cuda.device(t.device)


def _triton_act(x2d: torch.Tensor) -> bool:
    return HAS_TRITON and x2d.is_cuda and x2d.dtype in (torch.bfloat16, torch.float16,
                                                        torch.float32)


def quantize_rows(x2d: torch.Tensor, fp8_dtype=torch.float8_e4m3fn):
    """(q [M, K], scale [M, 1]) with one dynamic scale per row."""
    if _triton_act(x2d):
        with _on(x2d):
            return act_quant.quantize_rows(x2d, fp8_dtype)
    return act_quant.quantize_rows_torch(x2d, fp8_dtype)


def quantize_tensor(x2d: torch.Tensor, scale: torch.Tensor | None, fp8_dtype=torch.float8_e4m3fn):
    """(q [M, K], scale 0-d): the given static scale, or a dynamic one (absmax of all of x)."""
    if _triton_act(x2d):
        with _on(x2d):
            if scale is None:
                scale = act_quant.tensor_scale(x2d, fp8_dtype)
            scale = scale.to(device=x2d.device, dtype=torch.float32).reshape(())
            return act_quant.quantize_tensor(x2d, scale, fp8_dtype), scale
    if scale is None:
        scale = act_quant.tensor_scale(x2d, fp8_dtype)
    scale = scale.to(device=x2d.device, dtype=torch.float32).reshape(())
    return act_quant.quantize_tensor_torch(x2d, scale, fp8_dtype), scale


def quantize_groups(x2d: torch.Tensor, fp8_dtype=torch.float8_e4m3fn):
    """(q [M, K], scale [M, ceil(K/128)] column-major) with one scale per row and 128 columns."""
    if _triton_act(x2d):
        with _on(x2d):
            return act_quant.quantize_groups(x2d, fp8_dtype)
    return act_quant.quantize_groups_torch(x2d, fp8_dtype)


def dequantize(q, scale, block, dtype, per_tensor: bool, out=None):
    """FP8 weight -> ``dtype`` with the bits the CPU path gives (see ``dequant.py``)."""
    if q.is_cuda:
        with _on(q):
            return _dequant.dequantize(q, scale, block, dtype, per_tensor, out)
    return _dequant.dequantize(q, scale, block, dtype, per_tensor, out)


def weight_only_linear(x2d: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block,
                       per_tensor: bool, bias: torch.Tensor | None, method: str = "auto"):
    """``x2d @ dequant(q).T + bias`` in x's dtype for a CUDA weight (the GPU weight-only path).

    method: "auto" (by token count, see FUSED_WEIGHT_ONLY_MAX_M), "fused" (the Triton GEMM;
    per-tensor, per-row, and blocks whose columns are a multiple of 64), "dequant" (one-pass
    dequantize, then cuBLAS)."""
    gemm_block = None if per_tensor or tuple(block) == (1, q.shape[1]) else tuple(block)
    fused_ok = weight_only_gemm.supported(x2d, q, gemm_block)
    if method == "auto":
        method = "fused" if fused_ok and x2d.shape[0] <= FUSED_WEIGHT_ONLY_MAX_M else "dequant"
    if method == "fused" and fused_ok:
        with _on(x2d):
            return weight_only_gemm.weight_only_linear_triton(x2d, q, scale, bias, per_tensor,
                                                              block=gemm_block)
    w = dequantize(q, scale, block, x2d.dtype, per_tensor)
    return torch.nn.functional.linear(x2d, w, None if bias is None else bias.to(x2d.dtype))
