"""Weight dequantization off the CPU: FP8 ``q[N, K]`` times its scales -> bf16/fp16/fp32, as one
Triton pass (reads one byte and writes one element per weight, no float32 copy), beside its
plain-torch twin.

Scales are described by a block shape ``(R, C)`` over the [N, K] weight: per-tensor is one block
covering everything, per-row ``(1, K)``, ``Block(r, c)`` itself. The rounding matches the CPU path
in ``layouts.py`` bit for bit, so a weight dequantizes to the same bits on every device:

- per-tensor, and any layout into float16 / float32: ``round(float(q) * scale)`` in float32;
- per-row and block layouts into bfloat16: the scale is rounded to bfloat16 first (the CPU path
  multiplies two bf16 tensors there), then ``round(float(q) * bf16(scale))``.
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, INTERPRET, fp8_bits_to_f32, jit, round_bf16, tl, triton

__all__ = ["dequantize", "dequantize_torch", "dequantize_triton", "scale_rounds_to_bf16",
           "native_fp8"]

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def scale_rounds_to_bf16(per_tensor: bool, dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and not per_tensor


def _full_scale(scale: torch.Tensor, block, shape) -> torch.Tensor:
    n, k = shape
    r, c = block
    return scale.repeat_interleave(r, 0)[:n].repeat_interleave(c, 1)[:, :k]


def dequantize_torch(q: torch.Tensor, scale: torch.Tensor, block, dtype: torch.dtype,
                     per_tensor: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """The twin: float32 product, one rounding (see the module docstring)."""
    s = scale.to(torch.float32)
    if scale_rounds_to_bf16(per_tensor, dtype):
        s = s.to(torch.bfloat16).to(torch.float32)
    if per_tensor or q.dim() != 2:
        w = q.to(torch.float32) * s.reshape(())
    else:
        n, k = q.shape
        r, c = block
        if n % r == 0 and k % c == 0:
            w = (q.to(torch.float32).view(n // r, r, k // c, c) * s[:, None, :, None]).view(n, k)
        else:
            w = q.to(torch.float32) * _full_scale(s, block, (n, k))
    if out is None:
        return w.to(dtype)
    return out.copy_(w)


@jit
def _dequant_kernel(q_ptr, s_ptr, o_ptr, N, K, sqn, sqk, son, ssr, ssc, R, C,
                    BN: tl.constexpr, BK: tl.constexpr, SCALE_BF16: tl.constexpr,
                    NATIVE: tl.constexpr, E5M2: tl.constexpr, EXACT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BN + tl.arange(0, BN)
    k = pid_k * BK + tl.arange(0, BK)
    mask = (n[:, None] < N) & (k[None, :] < K)
    n64 = n[:, None].to(tl.int64)
    q = tl.load(q_ptr + n64 * sqn + k[None, :] * sqk, mask=mask)
    if NATIVE:
        w = q.to(tl.float32)
    else:
        w = fp8_bits_to_f32(q, E5M2)
    s = tl.load(s_ptr + (n[:, None] // R) * ssr + (k[None, :] // C) * ssc, mask=mask, other=1.0)
    if SCALE_BF16:
        if EXACT:
            s = round_bf16(s)
        else:
            s = s.to(tl.bfloat16).to(tl.float32)
    y = w * s
    if EXACT and o_ptr.dtype.element_ty == tl.bfloat16:
        y = round_bf16(y)
    tl.store(o_ptr + n64 * son + k[None, :], y.to(o_ptr.dtype.element_ty), mask=mask)


_native: dict = {}


def native_fp8(device: torch.device) -> bool:
    """Can Triton use FP8 types directly on this device (CUDA capability 8.9+, or the
    interpreter)? Elsewhere the kernels decode the raw bytes themselves."""
    if device.type != "cuda":
        return True
    hit = _native.get(device.index)
    if hit is None:
        hit = _native[device.index] = torch.cuda.get_device_capability(device) >= (8, 9)
    return hit


def dequantize_triton(q: torch.Tensor, scale: torch.Tensor, block, dtype: torch.dtype,
                      per_tensor: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    n, k = q.shape
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=q.device)
    s = scale.to(torch.float32)
    if per_tensor:
        s, r, c, ssr, ssc = s.reshape(1), 1, 1, 0, 0
    else:
        r, c = block
        ssr, ssc = s.stride(0), s.stride(1)
    native = native_fp8(q.device)
    qin = q if native else q.view(torch.uint8)
    bn, bk = 32, 256
    if n and k:
        _dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
            qin, s, out, n, k, q.stride(0), q.stride(1), out.stride(0), ssr, ssc, r, c,
            BN=bn, BK=bk, SCALE_BF16=scale_rounds_to_bf16(per_tensor, dtype), NATIVE=native,
            E5M2=q.dtype == torch.float8_e5m2, EXACT=INTERPRET, num_warps=4)
    return out


def dequantize(q: torch.Tensor, scale: torch.Tensor, block, dtype: torch.dtype,
               per_tensor: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatch: the Triton pass for 2-D CUDA weights when Triton imports, else the twin."""
    if (HAS_TRITON and q.is_cuda and q.dim() == 2 and dtype in _OUT_DTYPES
            and (out is None or out.is_contiguous())):
        return dequantize_triton(q, scale, block, dtype, per_tensor, out)
    return dequantize_torch(q, scale, block, dtype, per_tensor, out)
