"""The INT8 linear's two steps, each a Triton kernel beside its plain-torch twin.

1. ``quantize_rows_int8(x2d, rotation, regular)``: activation ``[M, K]`` (bf16/fp16/fp32) -> int8
   ``[M, K]`` + float32 per-row scales ``[M, 1]``, with the block Hadamard rotation of K applied in
   the same pass (the kernel reads x twice from cache-resident tiles: once for the row's absmax of
   the rotated values, once to write the bytes; nothing rotated goes to memory).
   Rule (both implementations): ``xr = x @ blockdiag(H)`` in float32, ``scale = absmax(xr) / 127``
   (zero rows 1), ``q = clamp(rne(xr * (1 / scale)), -128, 127)``. Without rotation the bytes agree
   exactly; with it the kernel multiplies by the +-1 matrix (on tensor cores with bf16/fp16
   operands, exact but for the float32 accumulation) and normalizes after, while torch multiplies
   by the normalized matrix: sums in another order, which moves a value sitting on a rounding tie
   by one step at most. Rotations up to 128 wide run in the kernel; wider ones (ComfyUI's 256) in
   the twin.
2. ``int8_linear_mm(xq, sa, wq, sb, bias, out_dtype)``: ``(xq @ wq.T) * sa * sb.T + bias`` with int32
   accumulation and the scales, bias and output dtype in the GEMM's epilogue. On the CPU the twin
   is ``torch._int_mm`` (oneDNN's int8 GEMM; the weight's ``[N, K]`` row-major bytes passed as the
   transposed view, the layout it is fast on) and one float32 epilogue.

On the CPU both twins run by blocks that stay in cache when their tensors are large (same bits; see
``BLOCK_ABOVE``).

The Triton kernels run on CUDA from capability 8.0 (Triton has no int8 dot for Turing); the tests run them through
``TRITON_INTERPRET=1`` with float32 rotation operands, which the interpreter computes right.
"""

from __future__ import annotations

import torch

from ..layouts.int8 import hadamard, int8_scale, rotate
from ..runtime import tracing, workspace
from ._triton import HAS_TRITON, INTERPRET, grouped_tile, jit, tl, triton

__all__ = ["quantize_rows_int8", "quantize_rows_int8_torch", "kernel_quantizes", "int8_linear_mm", "int8_linear_mm_torch",
           "use_triton"]

_RNE = 12582912.0  # 1.5 * 2**23: (v + c) - c rounds a float32 |v| < 2**22 to an integer, ties to even


def use_triton(t: torch.Tensor) -> bool:
    return HAS_TRITON and t.is_cuda


# ---------------------------------------------------------------------------------------------
# plain-torch twins
# ---------------------------------------------------------------------------------------------


def quantize_rows_int8_torch(x2d: torch.Tensor, rotation: int = 0, regular: bool = False):
    xf = rotate(x2d, rotation, regular) if rotation else x2d.to(torch.float32)
    amax = xf.abs().amax(dim=1, keepdim=True) if xf.shape[1] else \
        torch.zeros(xf.shape[0], 1, dtype=torch.float32, device=xf.device)
    scale = int8_scale(amax)
    q = xf.mul_(torch.reciprocal(scale)) if xf is not x2d else xf * torch.reciprocal(scale)
    return q.round_().clamp_(-128.0, 127.0).to(torch.int8), scale


def int8_linear_mm_torch(xq, sa, wq, sb, bias, out_dtype):
    acc = torch._int_mm(xq, wq.t())  # [M, N] int32
    out = torch.mul(acc, sb.reshape(1, -1))  # int32 * float32 -> float32, one pass
    out.mul_(sa)
    if bias is not None:
        out.add_(bias.to(torch.float32))
    return out.to(out_dtype)


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------


@jit
def _rne(v):
    # the literal is _RNE (a jit function can read only constexpr globals)
    return (v + 12582912.0) - 12582912.0


@jit
def _rotated_tile(x_ptr, h, rows, cols, k0, rmask, K, sxm, sxk, norm,
                  ROT: tl.constexpr, F32_DOT: tl.constexpr):
    """One [BM, RB] tile of x, rotated (times the +-1 Hadamard ``h``, then ``norm``) in float32.
    +-1 entries are exact in every dtype, so with x's own bf16/fp16 operands the tensor-core
    product is exact up to its float32 accumulation; float32 x (and the interpreter, whose bf16
    dot is wrong) take the float32 dot."""
    m = rmask[:, None] & ((k0 + cols) < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * sxm + (k0 + cols)[None, :] * sxk, mask=m, other=0.0)
    if ROT:
        if F32_DOT:
            x = tl.dot(x.to(tl.float32), h, input_precision="ieee") * norm
        else:
            x = tl.dot(x, h) * norm
    return x.to(tl.float32)


@jit
def _quant_rows_kernel(x_ptr, h_ptr, q_ptr, s_ptr, M, K, sxm, sxk, norm,
                       BM: tl.constexpr, RB: tl.constexpr, ROT: tl.constexpr, F32_DOT: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BM + tl.arange(0, BM)
    cols = tl.arange(0, RB)
    rmask = rows < M
    h = tl.load(h_ptr + cols[:, None] * RB + cols[None, :]) if ROT else None
    amax = tl.zeros([BM], dtype=tl.float32)
    for k0 in range(0, K, RB):
        x = _rotated_tile(x_ptr, h, rows, cols, k0, rmask, K, sxm, sxk, norm, ROT, F32_DOT)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    scale = amax / 127.0
    scale = tl.where(scale > 0, tl.maximum(scale, 1.1754943508222875e-38), 1.0)
    inv = 1.0 / scale
    for k0 in range(0, K, RB):
        m = rmask[:, None] & ((k0 + cols) < K)[None, :]
        x = _rotated_tile(x_ptr, h, rows, cols, k0, rmask, K, sxm, sxk, norm, ROT, F32_DOT)
        v = tl.minimum(tl.maximum(_rne(x * inv[:, None]), -128.0), 127.0)
        tl.store(q_ptr + rows[:, None] * K + (k0 + cols)[None, :], v.to(tl.int8), mask=m)
    tl.store(s_ptr + rows, scale, mask=rmask)


def _quantize_rows_triton(x2d, rotation, regular):
    m, k = x2d.shape
    q = torch.empty(m, k, dtype=torch.int8, device=x2d.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x2d.device)
    rb = rotation or 128
    f32_dot = INTERPRET or x2d.dtype == torch.float32
    if rotation:  # the +-1 matrix (exact in any dtype); its normalization multiplies the float32 result
        h = (hadamard(rotation, regular, x2d.device) * rotation ** 0.5).round()
        h = h.to(torch.float32 if f32_dot else x2d.dtype).contiguous()
    else:
        h = s  # not read
    bm = 16
    if m:
        # one stage: the loops gain nothing from pipelining, and staged copies of H would not fit
        _quant_rows_kernel[(triton.cdiv(m, bm),)](x2d, h, q, s, m, k, x2d.stride(0), x2d.stride(1),
                                                   float(rb ** -0.5), BM=bm, RB=rb, ROT=bool(rotation),
                                                   F32_DOT=f32_dot,
                                                   **({} if INTERPRET else {"num_warps": 8, "num_stages": 1}))
    return q, s


@jit
def _int8_gemm_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, c_ptr, M, N, K,
                      sam, sak, sbn, sbk, scm, scn,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                      HAS_BIAS: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.int32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(a_ptr + rm[:, None] * sam + kk[None, :] * sak, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0)
        b = tl.load(b_ptr + rn[None, :] * sbn + kk[:, None] * sbk, mask=(rn[None, :] < N) & (kk[:, None] < K), other=0)
        acc += tl.dot(a, b)
    sa = tl.load(sa_ptr + rm, mask=rm < M, other=0.0)
    sb = tl.load(sb_ptr + rn, mask=rn < N, other=0.0)
    out = acc.to(tl.float32) * sb[None, :] * sa[:, None]
    if HAS_BIAS:
        out += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    cmask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(c_ptr + rm[:, None] * scm + rn[None, :] * scn, out.to(c_ptr.dtype.element_ty), mask=cmask)


def _int8_linear_triton(xq, sa, wq, sb, bias, out_dtype):
    m, k = xq.shape
    n = wq.shape[0]
    c = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return c
    if INTERPRET:
        bm, bn, bk = 16, 32, 32
    else:
        bm = 128 if m > 64 else (64 if m > 16 else 16)
        bn, bk = 128, 128
    sb_flat = sb.reshape(-1).to(torch.float32)
    if sb_flat.numel() == 1:
        sb_flat = sb_flat.expand(n).contiguous()
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _int8_gemm_kernel[grid](xq, wq, sa.reshape(-1), sb_flat, bias if bias is not None else sa, c, m, n, k,
                            xq.stride(0), xq.stride(1), wq.stride(0), wq.stride(1), c.stride(0), c.stride(1),
                            BM=bm, BN=bn, BK=bk, GROUP_M=8, HAS_BIAS=bias is not None,
                            **({} if INTERPRET else {"num_warps": 8 if bm == 128 else 4, "num_stages": 3}))
    return c


# ---------------------------------------------------------------------------------------------
# the dispatch point
# ---------------------------------------------------------------------------------------------


def kernel_quantizes(dtype: torch.dtype, rotation: int) -> bool:
    """Whether the fused Triton quantizer serves this activation dtype and rotation block on a GPU.

    Rotations wider than 128 (ComfyUI's ConvRot 256) need an H that does not fit a program (128 KiB
    of bf16 for 256: more shared memory than an RTX 3090 gives a block), rotations under 16 (a file's
    ConvRot group size 4) are narrower than the smallest tensor-core dot, and float32 activations would
    take the float32 dot, which spills at sm_90 (its 128x128 H in registers): all three go to cuBLAS
    for the rotation and torch for the rounding."""
    return dtype in (torch.bfloat16, torch.float16) and (rotation == 0 or 16 <= rotation <= 128)


# ---------------------------------------------------------------------------------------------
# the CPU: the twins by blocks that stay in cache
# ---------------------------------------------------------------------------------------------
# Every step of both twins is per row (the activation's quantization) or per element after an exact int32
# GEMM (the epilogue), so cutting them into blocks gives the same bits. Whole, each step is a pass over
# float32 tensors of tens of MB (a 1024 x 12288 activation: 50 MB per pass, 53 ms; a 1024 x 12288 output:
# a fresh 50 MB int32 accumulator, another 50 MB in float32, paid in page faults and memory traffic at
# every call); by blocks of about a MB, reused, they stay in the cores' caches (19 ms and 29 ms instead of
# 53 and 69, measured on a 2-core AVX-512 + AMX Xeon). Small products are left whole: the blocks' own
# overhead is then the larger cost.
BLOCK_ABOVE = 1 << 21  # elements of the activation (quantizing) or of the output (epilogue) above which blocks pay
BLOCK_ELEMS = 1 << 19  # about this many elements per row block of the activation
OUT_BLOCK_ELEMS = 1 << 20  # about this many int32 accumulator elements per column block of the output


def _quantize_rows_blocked(x2d, rotation, regular):
    m, k = x2d.shape
    rows = max(16, BLOCK_ELEMS // max(k, 1))
    q = torch.empty(m, k, dtype=torch.int8, device=x2d.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x2d.device)
    for i in range(0, m, rows):
        qi, si = quantize_rows_int8_torch(x2d[i:i + rows], rotation, regular)
        q[i:i + rows] = qi
        s[i:i + rows] = si
    return q, s


def _int8_linear_blocked(xq, sa, wq, sb, bias, out_dtype):
    m, n = xq.shape[0], wq.shape[0]
    cols = max(512, (OUT_BLOCK_ELEMS // max(m, 1)) // 256 * 256)
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    sbf = sb.reshape(-1).to(torch.float32)
    bf = None if bias is None else bias.to(torch.float32)
    for j in range(0, n, cols):
        e = min(n, j + cols)
        acc = workspace("int8_acc", m * (e - j), torch.int32).view(m, e - j)
        acc = torch._int_mm(xq, wq[j:e].t(), out=acc)  # what it returns: a replaced _int_mm may not write out
        f = workspace("int8_epilogue", m * (e - j), torch.float32).view(m, e - j)
        torch.mul(acc, sbf[j:e] if sbf.numel() > 1 else sbf, out=f)
        f.mul_(sa)
        if bf is not None:
            f.add_(bf[j:e])
        out[:, j:e].copy_(f)
    return out


def _blocks_pay(t: torch.Tensor, elems: int) -> bool:
    return t.is_cpu and elems > BLOCK_ABOVE and not tracing() and not t.requires_grad


def quantize_rows_int8(x2d: torch.Tensor, rotation: int = 0, regular: bool = False):
    """(int8 [M, K], float32 scales [M, 1]) of the (block-rotated) activation, one pass."""
    if use_triton(x2d) and kernel_quantizes(x2d.dtype, rotation):
        return _quantize_rows_triton(x2d, rotation, regular)
    if _blocks_pay(x2d, x2d.numel()):
        return _quantize_rows_blocked(x2d, rotation, regular)
    return quantize_rows_int8_torch(x2d, rotation, regular)


def int8_linear_mm(xq, sa, wq, sb, bias, out_dtype):
    """``(xq @ wq.T) * sa * sb + bias`` in ``out_dtype``: int8 ``xq [M, K]``, ``wq [N, K]``,
    ``sa [M, 1]``, ``sb`` ``[N, 1]`` or a scalar, ``bias [N]`` or None."""
    if bias is not None:
        bias = bias.to(device=xq.device)
    if use_triton(xq) and wq.is_cuda:
        return _int8_linear_triton(xq, sa, wq, sb, bias, out_dtype)
    if _blocks_pay(xq, xq.shape[0] * wq.shape[0]) and wq.is_cpu:
        return _int8_linear_blocked(xq, sa, wq, sb, bias, out_dtype)
    return int8_linear_mm_torch(xq, sa, wq, sb, bias, out_dtype)

