"""Weight-only FP8 linear on GPUs: ``y = x @ (q * scale).T + bias`` as one Triton GEMM that loads
the FP8 weight tile and converts it in registers (no dequantized copy of the weight in memory).
Where it cannot run, ``kernels.weight_only_linear`` dequantizes and calls ``F.linear`` instead.

Per-tensor and per-row scales are constant along K, so they are applied once to the float32
accumulator (``acc * scale[n]``) instead of to every weight element; block scales (R x C blocks,
C a multiple of 64: DeepSeek 128x128, musubi 1x64) are applied per K step to that step's partial
product, with the K step dividing C. The FP8 values themselves convert exactly into bf16/fp16, so
the only roundings are the tensor-core accumulation and the final cast.

Two kernels, one fixed table (``config_for``), no autotuning in the hot path:

- ``M <= SMALL_M_MAX`` tokens (modulation vectors, text encoders, small batches): the product is
  computed transposed, ``y.T = W @ x.T``, so that the weight tile (converted FP8 -> bf16 in
  registers) is the MMA's A operand, which Hopper's wgmma takes from registers, and the few tokens
  are its N (16..64); K is split over ``SPLIT`` programs (split-K) so that N / 128 tiles still fill
  the GPU (3072 / 128 = 24 tiles on 132 SMs without it). Each split writes float32 partials that a
  second small kernel sums in a fixed order (deterministic), adding the bias and casting.
- larger M: one program per output tile, the weight as the B operand (staged through shared
  memory for wgmma), the classic grouped tile order.

The table was chosen from sm_90 compiles (no spills, wgmma where the tile allows it; see
tests/unit/test_sm90_compile.py) and is meant to be tuned on a GPU with ``bench/quant_linear.py
--device cuda``, which times ``CANDIDATES`` beside it; first calls of a new shape compile at most
one kernel per (class, flags) and never time anything.
"""

from __future__ import annotations

import torch

import functools

from ._triton import (HAS_TRITON, INTERPRET, fp8_bits_to_f32, grouped_tile, jit, jit_unspecialized, round_bf16,
                      tl, triton)
from .dequant import native_fp8
from ..runtime import tracing

__all__ = ["weight_only_linear_triton", "supported", "config_for", "SMALL_M_MAX", "CANDIDATES"]

SMALL_M_MAX = 64  # at or below: the transposed split-K kernel


BLOCK_COLS_MULTIPLE = 64  # block scales need column blocks that whole K steps fit in


def supported(x2d: torch.Tensor, q: torch.Tensor, block=None) -> bool:
    """Can the fused GEMM take this product? ``block``: None for per-tensor / per-row scales,
    else the (rows, cols) of the weight's scale blocks."""
    # rows of the weight and of x must start 16-byte aligned: else every load is scalar and the
    # tiles lose cp.async (measured in sm_90 compiles); dequantize + cuBLAS serves those
    return (HAS_TRITON and x2d.is_cuda and q.is_cuda and q.dim() == 2
            and x2d.dtype in (torch.bfloat16, torch.float16)
            and q.stride(1) == 1 and q.stride(0) % 16 == 0 and x2d.stride(1) == 1
            and x2d.stride(0) % 8 == 0 and (block is None or block[1] % BLOCK_COLS_MULTIPLE == 0)
            # a traced tensor has no address: the compiled graph's op asks again when it runs
            and (tracing() or (x2d.data_ptr() % 16 == 0 and q.data_ptr() % 16 == 0)))


@jit_unspecialized("M")
def _wo_gemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K,
                    sxm, sxk, swn, swk, sym, ssn, ssc, R, C,
                    HAS_BIAS: tl.constexpr, SCALES: tl.constexpr, EVEN_K: tl.constexpr,
                    NATIVE: tl.constexpr, E5M2: tl.constexpr, UPCAST: tl.constexpr,
                    EXACT: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)

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


@jit_unspecialized("M")
def _wo_gemm_small_m_kernel(x_ptr, w_ptr, s_ptr, p_ptr, M, N, K, K_SPLIT,
                            sxm, sxk, swn, swk, ssn, ssc, R, C,
                            SCALES: tl.constexpr, EVEN_K: tl.constexpr, NATIVE: tl.constexpr,
                            E5M2: tl.constexpr, UPCAST: tl.constexpr,
                            BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """Partial ``(W[n-tile] @ x[:, k-range].T)`` in float32 of one split of K, written to
    ``p[split, m, n]``. Program (n tile, split); all M (<= BM) tokens in one tile."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    nmask = offs_n < N
    mmask = offs_m < M
    k_lo = pid_s * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * swn + (k_lo + offs_k)[None, :] * swk
    x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * sxm + (k_lo + offs_k)[:, None] * sxk
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        if EVEN_K:
            b = tl.load(w_ptrs, mask=nmask[:, None])
            a = tl.load(x_ptrs, mask=mmask[None, :], other=0.0)
        else:
            kmask = (k0 + offs_k) < k_hi
            b = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :])
            a = tl.load(x_ptrs, mask=mmask[None, :] & kmask[:, None], other=0.0)
        if NATIVE:
            wf = b.to(a.dtype)
        else:
            wf = fp8_bits_to_f32(b, E5M2).to(a.dtype)
        if not EVEN_K:
            wf = tl.where(kmask[None, :], wf, tl.zeros_like(wf))
        if SCALES == 2:
            if UPCAST:
                part = tl.dot(wf.to(tl.float32), a.to(tl.float32))
            else:
                part = tl.dot(wf, a)
            sb = tl.load(s_ptr + (offs_n // R) * ssn + (k0 // C) * ssc, mask=nmask, other=0.0)
            acc += part * sb[:, None]
        elif UPCAST:
            acc += tl.dot(wf.to(tl.float32), a.to(tl.float32))
        else:
            acc = tl.dot(wf, a, acc)
        w_ptrs += BK * swk
        x_ptrs += BK * sxk
    if SCALES == 1:
        acc = acc * tl.load(s_ptr + offs_n * ssn, mask=nmask, other=1.0)[:, None]
    elif SCALES == 0:
        acc = acc * tl.load(s_ptr)
    p_ptrs = p_ptr + pid_s.to(tl.int64) * M * N + offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
    tl.store(p_ptrs, acc, mask=nmask[:, None] & mmask[None, :])


@jit_unspecialized("M")
def _split_k_sum_kernel(p_ptr, b_ptr, y_ptr, M, N, sym, SPLIT: tl.constexpr,
                        HAS_BIAS: tl.constexpr, EXACT: tl.constexpr, BLOCK: tl.constexpr):
    """y[m, n] = sum over splits (in order) of p[split, m, n] (+ bias[n]), cast to y's dtype."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for sp in tl.static_range(SPLIT):
        acc += tl.load(p_ptr + sp * M * N + offs, mask=mask, other=0.0)
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
    if EXACT and y_ptr.dtype.element_ty == tl.bfloat16:
        acc = round_bf16(acc)
    m = offs // N
    tl.store(y_ptr + m.to(tl.int64) * sym + n, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _cfg(bm, bn, bk, warps, stages, group_m=8):
    return dict(BM=bm, BN=bn, BK=bk, GROUP_M=group_m, num_warps=warps, num_stages=stages)


# Every configuration the code can choose (sm_90 compile test covers each; the bench times
# CANDIDATES beside the table). Small M: BN rows of the weight x BM tokens per program.
SMALL_M_CONFIGS = {16: _cfg(16, 128, 128, 4, 4), 32: _cfg(32, 128, 128, 4, 4),
                   64: _cfg(64, 128, 128, 8, 3)}  # 4 warps spill with block scales
TILE_CONFIGS = {128: _cfg(64, 128, 128, 4, 4), 512: _cfg(128, 128, 64, 8, 4),
                "large": _cfg(128, 256, 64, 8, 3),
                # block scales: 128x256 spills (256/240 bytes at sm_90); 128x128 does not
                "large_block": _cfg(128, 128, 64, 8, 4)}
CANDIDATES = [_cfg(64, 256, 64, 8, 4), _cfg(128, 128, 128, 8, 3), _cfg(64, 128, 64, 4, 4)]
_SPLIT_MAX = 16
_PARTIALS_SHARE = 4  # float32 partials at most 1/4 of the weight's bytes


def config_for(m: int, block_scales: bool = False) -> dict:
    """The fixed table: the config for ``m`` tokens (small-M entries carry ``small=True``)."""
    if m <= SMALL_M_MAX:
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        return dict(SMALL_M_CONFIGS[bm], small=True)
    if m <= 128:
        return TILE_CONFIGS[128]
    if m <= 512:
        return TILE_CONFIGS[512]
    return TILE_CONFIGS["large_block" if block_scales else "large"]


def table_config(m: int) -> dict:
    """The table's tile config for the classic kernel (kept for callers that pass it back)."""
    cfg = config_for(max(m, SMALL_M_MAX + 1))
    return dict(cfg)


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    if not torch.cuda.is_available():
        return 132  # the interpreter: an H100/H200's count, so tests see the same splits
    return torch.cuda.get_device_properties(index).multi_processor_count


def split_for(m: int, n: int, k: int, bn: int, bk: int, c: int, sms: int) -> tuple[int, int]:
    """(splits, K per split): about two programs per SM, each split a whole number of K steps
    (and of scale blocks, when blocks are narrower than K), partials bounded in size."""
    tiles = -(-n // bn)
    steps = -(-k // bk)
    unit = max(1, c // bk) if c < k else 1  # K steps per split must not straddle a scale block
    want = max(1, -(-2 * sms // tiles))
    cap = max(1, k // (_PARTIALS_SHARE * 4 * max(m, 1)))  # partials (4 B) vs weight (1 B) bytes
    split = max(1, min(want, _SPLIT_MAX, cap, steps // unit))
    per = -(-steps // split)
    per = -(-per // unit) * unit
    split = -(-steps // per)
    return split, per * bk


def weight_only_linear_triton(x2d: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                              bias: torch.Tensor | None, per_tensor: bool,
                              config: dict | None = None, block=None):
    """``x2d [M, K] (bf16/fp16) @ (q [N, K] * scale).T (+ bias)`` -> [M, N] in x's dtype.
    ``scale``: 0-d / 1-element (per tensor), [N, 1] / [N] (per row), or with ``block=(R, C)``
    the [ceil(N/R), ceil(K/C)] block scales (C a multiple of 64), float32.
    ``config``: a config from ``config_for`` / ``CANDIDATES`` (benchmarks); default the table's.
    ``small=True`` in it selects the transposed split-K kernel (M up to its BM)."""
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
    cfg = dict(config or config_for(m, block is not None))
    small = cfg.pop("small", False) and m <= cfg["BM"]
    while c % cfg["BK"]:
        cfg["BK"] //= 2
    common = dict(SCALES=mode, NATIVE=native, E5M2=q.dtype == torch.float8_e5m2, UPCAST=INTERPRET)
    if small:
        bn, bm, bk = cfg["BN"], cfg["BM"], cfg["BK"]
        split, k_split = split_for(m, n, k, bn, bk, c, _sm_count(x2d.device.index or 0))
        partials = torch.empty((split, m, n), dtype=torch.float32, device=x2d.device)
        _wo_gemm_small_m_kernel[(triton.cdiv(n, bn), split)](
            x2d, qin, s, partials, m, n, k, k_split, x2d.stride(0), x2d.stride(1), q.stride(0),
            q.stride(1), ssn, ssc, r, c, EVEN_K=k % k_split == 0 and k_split % bk == 0, BN=bn,
            BM=bm, BK=bk, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **common)
        block_sum = 1024
        _split_k_sum_kernel[(triton.cdiv(m * n, block_sum),)](
            partials, b if b is not None else partials, y, m, n, y.stride(0), SPLIT=split,
            HAS_BIAS=b is not None, EXACT=INTERPRET, BLOCK=block_sum, num_warps=4)
        return y
    grid = (triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"]),)
    _wo_gemm_kernel[grid](x2d, qin, s, b if b is not None else s, y, m, n, k,
                          x2d.stride(0), x2d.stride(1), q.stride(0), q.stride(1), y.stride(0),
                          ssn, ssc, r, c, HAS_BIAS=b is not None, EVEN_K=k % cfg["BK"] == 0,
                          EXACT=INTERPRET, **common, **cfg)
    return y
