"""The numeric rules every FP8 path shares: how a scale comes from an absolute maximum, and how a
dequantized weight is rounded. Layouts (the CPU path), the plain-torch twins and the Triton kernels
all take them from here, so no two of them can drift apart by an ulp.

Scale from an absolute maximum (weights, activations, every granularity)::

    scale = amax * RCP_FMAX[fp8]            one float32 multiply (RCP_FMAX is float32(1 / fmax))
    scale = 1            where scale is 0 or NaN (an all-zero group; a group holding a NaN)
    scale = FLOAT32_TINY where 0 < scale < FLOAT32_TINY

Multiplying by a float32 constant rather than dividing by fmax: torch on CUDA computes
``tensor / python_float`` as ``tensor * (1 / python_float)`` while the CPU and a kernel's IEEE
division divide; a multiply by the same float32 constant is one correctly rounded operation that
every device and compiler performs alike (nothing to contract into an FMA). ``tl.max`` in a kernel
ignores NaN where ``torch.amax`` propagates it, so the kernels reduce with NaN propagation; the rule
above then gives such a group scale 1, and the NaN itself survives quantization (the clamp to
``[-fmax, fmax]`` keeps NaN, as ``torch.clamp`` does), so a NaN activation yields a NaN output row.

Activation quantization then multiplies by the reciprocal: ``q = fp8(clamp(x * (1 / scale)))``,
the reciprocal one IEEE division per group (weights, quantized offline, divide per element).

Dequantization rounds once: ``w = round_to_dtype(float32(q) * float32(scale))`` for every layout
and output dtype, on every device. ComfyUI 0.3.75's only FP8 layout (per tensor,
``TensorCoreFP8Layout``) does exactly that, so no layout needs another rule for agreement with it;
the per-row and block layouts, which ComfyUI has no counterpart of, round once as well (rounding the
scale to bf16 first, as an earlier version did, cost 3 dB of SQNR).
"""

from __future__ import annotations

import struct

import torch

__all__ = ["RCP_FMAX", "FLOAT32_TINY", "fp8_max", "rcp_fmax", "scale_from_amax"]

FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)


def _float32(v: float) -> float:
    """The float32 nearest to ``v`` (as a Python float, exactly representable in float32)."""
    return struct.unpack("f", struct.pack("f", v))[0]


def fp8_max(fp8_dtype: torch.dtype) -> float:
    return float(torch.finfo(fp8_dtype).max)


RCP_FMAX = {d: _float32(1.0 / fp8_max(d)) for d in (torch.float8_e4m3fn, torch.float8_e5m2)}


def rcp_fmax(fmax: float) -> float:
    """float32(1 / fmax), for an FP8 format's largest value ``fmax``."""
    return _float32(1.0 / fmax)


def scale_from_amax(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """amax (any float dtype, any shape) -> positive finite float32 scales by the rule above."""
    scale = amax.to(torch.float32) * rcp_fmax(fmax)
    # NaN > 0 is False: a NaN group gets 1, like an all-zero one
    return torch.where(scale > 0, scale.clamp_min(FLOAT32_TINY), torch.ones_like(scale))
