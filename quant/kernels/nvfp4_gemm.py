"""Weight-only NVFP4 linear on GPUs: ``y = x @ W.T + bias`` as one Triton GEMM that loads the packed
4-bit weight tile with its e4m3 block scales and decodes it in registers (no dequantized copy).

Each weight element is decoded to exactly the value the CPU path (``nvfp4.dequantize_padded``,
comfy-kitchen's rule) gives in the compute dtype: ``round(ts * block)`` then ``round(e2m1 * that)``,
both rounded to bf16/fp16, ``ts`` already rounded to it on the host. The only other roundings are
the tensor-core accumulation and the final cast. The plain-torch twin is ``nvfp4_linear_torch``.

Data: ``q`` uint8 ``[Np, Kp / 2]`` (high nibble = even column), ``block`` the e4m3 scales as bytes
``[Np, Kp / 16]`` in plain row-major order, logical ``N <= Np``, ``K <= Kp``; x is ``[M, K]``.
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, INTERPRET, fp8_bits_to_f32, grouped_tile, jit, round_bf16, tl, triton

__all__ = ["supported", "nvfp4_linear_triton", "nvfp4_linear_torch", "table_config"]

GROUP = 16


def supported(x2d: torch.Tensor, q: torch.Tensor) -> bool:
    return (HAS_TRITON and x2d.is_cuda and q.is_cuda and q.dim() == 2 and q.dtype == torch.uint8
            and x2d.dtype in (torch.bfloat16, torch.float16))


@jit
def _round_to(v, OUT_BF16: tl.constexpr, EXACT: tl.constexpr):
    """float32 -> the nearest value of the compute dtype, still as float32."""
    if OUT_BF16:
        if EXACT:  # the interpreter truncates bf16 casts; round by bits
            return round_bf16(v)
        return v.to(tl.bfloat16).to(tl.float32)
    return v.to(tl.float16).to(tl.float32)


@jit
def _e2m1_to_f32(code):
    """e2m1 codes (int32, 0..15) -> float32, exactly: 0, 0.5 (subnormal), else (1 + m / 2) * 2**(e - 1)."""
    mag = code & 7
    e = mag >> 1
    m = mag & 1
    normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)
    val = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
    return tl.where((code & 8) != 0, -val, val)


@jit
def _nvfp4_gemm_kernel(x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, ts, M, N, K, KP,
                       sxm, sxk, sqn, ssn, sym,
                       HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr, UPCAST: tl.constexpr,
                       EXACT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       GROUP_M: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)

    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    offs_b = tl.arange(0, BK // 2)
    offs_g = tl.arange(0, BK // 16)
    mmask = offs_m < M
    nmask = offs_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kmask = (k0 + offs_k) < K
        a = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * sxm + (k0 + offs_k)[None, :] * sxk,
                    mask=mmask[:, None] & kmask[None, :], other=0.0)
        bmask = nmask[:, None] & ((k0 // 2 + offs_b) < KP // 2)[None, :]
        packed = tl.load(q_ptr + offs_n[:, None].to(tl.int64) * sqn + (k0 // 2 + offs_b)[None, :],
                         mask=bmask, other=0).to(tl.int32)
        gmask = nmask[:, None] & ((k0 // 16 + offs_g) < KP // 16)[None, :]
        sb = tl.load(s_ptr + offs_n[:, None].to(tl.int64) * ssn + (k0 // 16 + offs_g)[None, :],
                     mask=gmask, other=0)
        total = _round_to(ts * fp8_bits_to_f32(sb, False), OUT_BF16, EXACT)  # [BN, BK / 16]
        codes = tl.reshape(tl.join(packed >> 4, packed & 15), (BN, BK))  # even column = high nibble
        vals = tl.reshape(_e2m1_to_f32(codes), (BN, BK // 16, 16)) * total[:, :, None]
        w = _round_to(tl.reshape(vals, (BN, BK)), OUT_BF16, EXACT)
        w = tl.where(kmask[None, :], w, 0.0)
        if UPCAST:  # the interpreter's dot is only right in float32
            acc += tl.dot(a.to(tl.float32), tl.trans(w))
        else:
            acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if EXACT and OUT_BF16:
        acc = round_bf16(acc)
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * sym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def table_config(m: int) -> dict:
    """Tile shapes by token count (BK a multiple of 16: whole scale groups per K step)."""
    if m <= 32:
        return dict(BM=32, BN=64, BK=128, GROUP_M=8, num_warps=4, num_stages=3)
    if m <= 256:
        return dict(BM=64, BN=128, BK=64, GROUP_M=8, num_warps=4, num_stages=3)
    return dict(BM=128, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=3)


def nvfp4_linear_triton(x2d: torch.Tensor, q: torch.Tensor, block_bytes: torch.Tensor, ts: torch.Tensor,
                        n: int, bias: torch.Tensor | None, config: dict | None = None) -> torch.Tensor:
    """``x2d [M, K] (bf16/fp16) @ W[:n, :K].T (+ bias)`` -> [M, n] in x's dtype (see the module docstring).
    ``ts``: the float32 tensor scale (a 0-d tensor or a float)."""
    m, k = x2d.shape
    kp = q.shape[1] * 2
    if k > kp or n > q.shape[0] or block_bytes.shape != (q.shape[0], kp // GROUP):
        raise ValueError(f"NVFP4 GEMM: x {list(x2d.shape)}, data {list(q.shape)}, scales "
                         f"{list(block_bytes.shape)} and N={n} do not fit together")
    y = torch.empty((m, n), dtype=x2d.dtype, device=x2d.device)
    if m == 0 or n == 0:
        return y
    ts_c = float(torch.as_tensor(ts, dtype=torch.float32).to(x2d.dtype).float())  # ts rounded to the compute dtype
    b = bias if bias is None or bias.dtype == x2d.dtype else bias.to(x2d.dtype)
    cfg = dict(config or table_config(m))
    grid = (triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"]),)
    _nvfp4_gemm_kernel[grid](x2d, q, block_bytes, b if b is not None else x2d, y, ts_c, m, n, k, kp,
                             x2d.stride(0), x2d.stride(1), q.stride(0), block_bytes.stride(0), y.stride(0),
                             HAS_BIAS=b is not None, OUT_BF16=x2d.dtype == torch.bfloat16,
                             UPCAST=INTERPRET, EXACT=INTERPRET, **cfg)
    return y


def nvfp4_linear_torch(x2d: torch.Tensor, w_full: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The twin: the weight dequantized by the CPU rule (``w_full`` = ``[N, K]`` in x's dtype), then F.linear."""
    return torch.nn.functional.linear(x2d, w_full, None if bias is None else bias.to(x2d.dtype))
