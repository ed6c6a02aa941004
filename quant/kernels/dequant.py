"""Weight dequantization off the CPU: FP8 ``q[N, K]`` times its scales -> bf16/fp16/fp32, as one
Triton pass (reads one byte and writes one element per weight, no float32 copy), beside its
plain-torch twin.

Scales are described by a block shape ``(R, C)`` over the [N, K] weight: per-tensor is one block
covering everything, per-row ``(1, K)``, ``Block(r, c)`` itself. The rounding is ``numerics``' one
rule, ``round(float32(q) * float32(scale))`` for every layout and output dtype, as the CPU path in
``layouts/fp8.py`` computes it, so a weight dequantizes to the same bits on every device.

Scales are read per tile, not per element: a tile of the kernel lies in one column block wherever
the block width is a multiple of the tile width (per-row, per-tensor, 128x128, 1x64), so it loads
one scale per row of the tile (a [BN] vector, one integer division per row) and broadcasts it.
Other block widths (odd ones such as 48x80) take a gathered load per element.
"""

from __future__ import annotations

import torch

from ..layouts.fp8 import dequantize_eager as dequantize_torch  # the twin: the layout's own eager code
from ._triton import HAS_TRITON, INTERPRET, fp8_bits_to_f32, jit, round_bf16, tl, triton

__all__ = ["dequantize", "dequantize_torch", "dequantize_triton", "native_fp8", "tile_for"]

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@jit
def _dequant_kernel(q_ptr, s_ptr, o_ptr, N, K, sqn, sqk, son, ssr, ssc, R, C,
                    BN: tl.constexpr, BK: tl.constexpr, SCALES: tl.constexpr,
                    NATIVE: tl.constexpr, E5M2: tl.constexpr, EXACT: tl.constexpr):
    """SCALES 0: one scale (per tensor); 1: the tile lies in one column block, one scale per
    row of the tile; 2: any block shape, one gathered scale per element."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BN + tl.arange(0, BN)
    k = pid_k * BK + tl.arange(0, BK)
    nmask = n < N
    mask = nmask[:, None] & (k[None, :] < K)
    n64 = n[:, None].to(tl.int64)
    q = tl.load(q_ptr + n64 * sqn + k[None, :] * sqk, mask=mask)
    if NATIVE:
        w = q.to(tl.float32)
    else:
        w = fp8_bits_to_f32(q, E5M2)
    if SCALES == 0:
        y = w * tl.load(s_ptr)
    elif SCALES == 1:
        s = tl.load(s_ptr + (n // R) * ssr + ((pid_k * BK) // C) * ssc, mask=nmask, other=1.0)
        y = w * s[:, None]
    else:
        s = tl.load(s_ptr + (n[:, None] // R) * ssr + (k[None, :] // C) * ssc, mask=mask, other=1.0)
        y = w * s
    if EXACT and o_ptr.dtype.element_ty == tl.bfloat16:
        y = round_bf16(y)
    tl.store(o_ptr + n64 * son + k[None, :], y.to(o_ptr.dtype.element_ty), mask=mask)


def tile_for(per_tensor: bool, block, k: int) -> tuple:
    """(BN, BK, SCALES) of the dequantize kernel for a weight of ``k`` columns: 32x256 tiles
    (8 KB of FP8 each), narrowed to the block width where that lets a tile sit in one block."""
    if per_tensor:
        return 32, 256, 0
    c = block[1]
    if c >= k or c % 256 == 0:
        return 32, 256, 1
    for bk in (128, 64):
        if c % bk == 0:
            return 8192 // bk, bk, 1
    return 32, 256, 2


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
    bn, bk, mode = tile_for(per_tensor, block, k)
    if n and k:
        _dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
            qin, s, out, n, k, q.stride(0), q.stride(1), out.stride(0), ssr, ssc, r, c,
            BN=bn, BK=bk, SCALES=mode, NATIVE=native,
            E5M2=q.dtype == torch.float8_e5m2, EXACT=INTERPRET, num_warps=4)
    return out


def dequantize(q: torch.Tensor, scale: torch.Tensor, block, dtype: torch.dtype,
               per_tensor: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatch: the Triton pass for 2-D CUDA weights when Triton imports, else the twin."""
    if (HAS_TRITON and q.is_cuda and q.dim() == 2 and dtype in _OUT_DTYPES
            and (out is None or out.is_contiguous())):
        return dequantize_triton(q, scale, block, dtype, per_tensor, out)
    return dequantize_torch(q, scale, block, dtype, per_tensor, out)
