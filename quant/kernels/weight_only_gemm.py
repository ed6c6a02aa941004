"""Weight-only FP8 linear on GPUs: ``y = x @ (q * scale).T + bias`` as one Triton GEMM that loads
the FP8 weight tile and converts it in registers (no dequantized copy of the weight in memory).
Where it cannot run, ``kernels.weight_only_linear`` dequantizes and calls ``F.linear`` instead.

Per-tensor and per-row scales are constant along K, so they are applied once to the float32
accumulator (``acc * scale[n]``) instead of to every weight element; block scales (R x C blocks,
C a multiple of 64: DeepSeek 128x128, musubi 1x64) are applied per K step to that step's partial
product, with the K step dividing C. The FP8 values themselves convert exactly into bf16/fp16, so
the only roundings are the tensor-core accumulation and the final cast.

Tile configurations: a small table keyed on M, or ``triton.autotune`` over a few Hopper-friendly
configs keyed on the M bucket, N and K (``autotune=True``, the default on CUDA).
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, INTERPRET, fp8_bits_to_f32, jit, round_bf16, tl, triton
from .dequant import native_fp8

__all__ = ["weight_only_linear_triton", "supported"]


BLOCK_COLS_MULTIPLE = 64  # block scales need column blocks that whole K steps fit in


def supported(x2d: torch.Tensor, q: torch.Tensor, block=None) -> bool:
    """Can the fused GEMM take this product? ``block``: None for per-tensor / per-row scales,
    else the (rows, cols) of the weight's scale blocks."""
    return (HAS_TRITON and x2d.is_cuda and q.is_cuda and q.dim() == 2
            and x2d.dtype in (torch.bfloat16, torch.float16)
            and (block is None or block[1] % BLOCK_COLS_MULTIPLE == 0))


@jit
def _wo_gemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K,
                    sxm, sxk, swn, swk, sym, ssn, ssc, R, C,
                    HAS_BIAS: tl.constexpr, SCALES: tl.constexpr, EVEN_K: tl.constexpr,
                    NATIVE: tl.constexpr, E5M2: tl.constexpr, UPCAST: tl.constexpr,
                    EXACT: tl.constexpr, M_BUCKET,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    # grouped order: programs that run together share weight tiles in L2
    width = GROUP_M * grid_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m

    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    mmask = offs_m < M
    nmask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * sxm + offs_k[None, :] * sxk
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * swn + offs_k[:, None] * swk
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=mmask[:, None], other=0.0)
            b = tl.load(w_ptrs, mask=nmask[None, :])
        else:
            kmask = (k0 + offs_k) < K
            a = tl.load(x_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=nmask[None, :] & kmask[:, None])
        if NATIVE:
            bf = b.to(a.dtype)
        else:
            bf = fp8_bits_to_f32(b, E5M2).to(a.dtype)
        if not EVEN_K:  # masked bytes are undefined (maybe NaN codes): zero them
            bf = tl.where(kmask[:, None], bf, tl.zeros_like(bf))
        if SCALES == 2:  # block scales: this K step lies in one column block
            if UPCAST:  # the interpreter's dot is only right in float32
                part = tl.dot(a.to(tl.float32), bf.to(tl.float32))
            else:
                part = tl.dot(a, bf)
            sb = tl.load(s_ptr + (offs_n // R) * ssn + (k0 // C) * ssc, mask=nmask, other=0.0)
            acc += part * sb[None, :]
        elif UPCAST:
            acc += tl.dot(a.to(tl.float32), bf.to(tl.float32))
        else:
            acc = tl.dot(a, bf, acc)
        x_ptrs += BK * sxk
        w_ptrs += BK * swk
    if SCALES == 1:  # per row
        s = tl.load(s_ptr + offs_n * ssn, mask=nmask, other=1.0)
        acc = acc * s[None, :]
    elif SCALES == 0:  # per tensor
        acc = acc * tl.load(s_ptr)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if EXACT and y_ptr.dtype.element_ty == tl.bfloat16:
        acc = round_bf16(acc)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * sym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def _cfg(bm, bn, bk, warps, stages, group_m=8):
    return dict(BM=bm, BN=bn, BK=bk, GROUP_M=group_m, num_warps=warps, num_stages=stages)


def table_config(m: int) -> dict:
    """Untuned fallback table (used when autotuning is off)."""
    if m <= 32:
        return _cfg(32, 64, 128, 4, 4)
    if m <= 128:
        return _cfg(64, 128, 128, 4, 4)
    if m <= 512:
        return _cfg(128, 128, 64, 8, 4)
    return _cfg(128, 256, 64, 8, 3)


_autotuned = None


def _autotuned_kernel():
    """The kernel under ``triton.autotune``: a handful of tile shapes per M bucket, timed once
    per (M bucket, N, K, scale kind) on first use."""
    global _autotuned
    if _autotuned is None:
        shapes = [(32, 128, 128, 4, 4), (64, 128, 128, 4, 4), (64, 256, 64, 8, 4),
                  (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3)]
        configs = [triton.Config(dict(BM=a, BN=b, BK=c, GROUP_M=8), num_warps=w, num_stages=s)
                   for a, b, c, w, s in shapes]

        def prune(configs, named_args, **kwargs):
            # small M: skip tiles much taller than M (pure waste); block scales: K steps that
            # divide the column block
            m, c = named_args["M"], named_args["C"]
            fit = [cf for cf in configs if c % cf.kwargs["BK"] == 0] or \
                [triton.Config(dict(BM=64, BN=128, BK=64, GROUP_M=8), num_warps=4, num_stages=4)]
            kept = [cf for cf in fit if cf.kwargs["BM"] <= max(32, triton.next_power_of_2(m))]
            return kept or fit[:1]

        def quick_bench(kernel_call, quantiles):
            # shorter than triton's default (25 ms warm-up, 100 ms of repeats): enough to rank
            # a handful of tiles, and first calls of a new shape stay short
            return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)

        tune = dict(configs=configs, key=["M_BUCKET", "N", "K", "C", "SCALES"],
                    prune_configs_by={"early_config_prune": prune})
        try:
            decorator = triton.autotune(do_bench=quick_bench, **tune)
        except TypeError:  # older triton: no do_bench argument
            decorator = triton.autotune(**tune)
        _autotuned = decorator(_wo_gemm_kernel)
    return _autotuned


def _m_bucket(m: int) -> int:
    return min(triton.next_power_of_2(max(m, 1)), 8192)


def weight_only_linear_triton(x2d: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                              bias: torch.Tensor | None, per_tensor: bool,
                              config: dict | None = None, autotune: bool | None = None,
                              block=None):
    """``x2d [M, K] (bf16/fp16) @ (q [N, K] * scale).T (+ bias)`` -> [M, N] in x's dtype.
    ``scale``: 0-d / 1-element (per tensor), [N, 1] / [N] (per row), or with ``block=(R, C)``
    the [ceil(N/R), ceil(K/C)] block scales (C a multiple of 64), float32."""
    m, k = x2d.shape
    n = q.shape[0]
    y = torch.empty((m, n), dtype=x2d.dtype, device=x2d.device)
    if m == 0 or n == 0:
        return y
    if block is not None and tuple(block) == (1, k):
        block = None  # per-row scales written as blocks
    if block is not None:
        r, c = block
        s = scale.to(torch.float32)
        mode, ssn, ssc = 2, s.stride(0), s.stride(1)
    else:
        s = scale.to(torch.float32).reshape(-1)
        r, c = 1, 1 << 20  # unused by these modes; every K step divides it
        mode, ssn, ssc = (0, 0, 0) if per_tensor else (1, s.stride(0), 0)
    native = native_fp8(q.device)
    qin = q if native else q.view(torch.uint8)
    b = bias if bias is None or bias.dtype == x2d.dtype else bias.to(x2d.dtype)
    if autotune is None:
        autotune = config is None and not INTERPRET
    args = (x2d, qin, s, b if b is not None else s, y, m, n, k,
            x2d.stride(0), x2d.stride(1), q.stride(0), q.stride(1), y.stride(0), ssn, ssc, r, c)
    flags = dict(HAS_BIAS=b is not None, SCALES=mode, NATIVE=native,
                 E5M2=q.dtype == torch.float8_e5m2, UPCAST=INTERPRET, EXACT=INTERPRET,
                 M_BUCKET=_m_bucket(m))
    if autotune:
        kernel = _autotuned_kernel()

        def grid(meta):
            return (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)

        # EVEN_K depends on the config's BK: every autotuned BK divides 64-multiples
        kernel[grid](*args, EVEN_K=k % 128 == 0, **flags)
        return y
    cfg = dict(config or table_config(m))
    while c % cfg["BK"]:
        cfg["BK"] //= 2
    grid = (triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"]),)
    _wo_gemm_kernel[grid](*args, EVEN_K=k % cfg["BK"] == 0, **flags, **cfg)
    return y
