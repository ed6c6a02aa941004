"""Activation quantization for the fp8 x fp8 linear: bf16/fp16/fp32 ``x[M, K]`` -> FP8 + float32
scales, as one Triton kernel that reads the activation once, beside its plain-torch twin.

Modes:
    row     one scale per row (token): ``scale[m] = safe(absmax(x[m]) / fmax)``; scales ``[M, 1]``
    tensor  one given scale (static ``input_scale``, or a dynamic one from :func:`tensor_scale`)
    group   one scale per row and 128 columns (the activation side of 128x128 block weights);
            scales ``[M, ceil(K / 128)]`` in the column-major layout cuBLAS wants (stride (1, M))

Both implementations compute the same float32 operations in the same order, so they give the
same FP8 bytes and scales, by the rule of ``quant/numerics.py``: ``scale = absmax * float32(1 /
fmax)`` (a zero or NaN row gets 1, a tiny one float32's smallest normal), ``inv = 1 / scale`` (IEEE
division), ``q = fp8(clamp(x * inv, -fmax, fmax))`` rounded to nearest even, NaN kept as NaN.
Multiplying by the reciprocal (once per row) instead of dividing every element is what the GPU
does fast; the twin does exactly the same.
"""

from __future__ import annotations

import functools

import torch

from ..numerics import FLOAT32_TINY, rcp_fmax, scale_from_amax as _safe_scale
from ._triton import HAS_TRITON, INTERPRET, jit, round_fp8_grid, tl, triton

__all__ = ["quantize_rows", "quantize_tensor", "quantize_groups", "tensor_scale",
           "quantize_rows_torch", "quantize_tensor_torch", "quantize_groups_torch",
           "row_absmax_torch", "GROUP"]

TINY = FLOAT32_TINY
GROUP = 128
_GRID = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}
_ONE_PASS_MAX_K = 16384  # whole rows up to this many elements stay in registers


def _fmax(fp8_dtype) -> float:
    return float(torch.finfo(fp8_dtype).max)


# ---------------------------------------------------------------------------------------------
# plain-torch twins (CPU, and GPUs without Triton)
# ---------------------------------------------------------------------------------------------


def _cast(xf: torch.Tensor, inv: torch.Tensor, fp8_dtype) -> torch.Tensor:
    fmax = _fmax(fp8_dtype)
    return (xf * inv).clamp_(-fmax, fmax).to(fp8_dtype)


def row_absmax_torch(x2d: torch.Tensor) -> torch.Tensor:
    return x2d.abs().amax(dim=1).to(torch.float32) if x2d.shape[1] else \
        torch.zeros(x2d.shape[0], dtype=torch.float32, device=x2d.device)


def quantize_rows_torch(x2d: torch.Tensor, fp8_dtype=torch.float8_e4m3fn):
    xf = x2d.to(torch.float32)
    scale = _safe_scale(row_absmax_torch(xf)[:, None], _fmax(fp8_dtype))
    return _cast(xf, torch.reciprocal(scale), fp8_dtype), scale


def quantize_tensor_torch(x2d: torch.Tensor, scale: torch.Tensor, fp8_dtype=torch.float8_e4m3fn):
    scale = scale.to(device=x2d.device, dtype=torch.float32).reshape(())
    return _cast(x2d.to(torch.float32), torch.reciprocal(scale), fp8_dtype)


def quantize_groups_torch(x2d: torch.Tensor, fp8_dtype=torch.float8_e4m3fn):
    m, k = x2d.shape
    ng = -(-k // GROUP)
    xf = x2d.to(torch.float32)
    padded = torch.nn.functional.pad(xf, (0, ng * GROUP - k)).reshape(m, ng, GROUP)
    scale = _safe_scale(padded.abs().amax(dim=2), _fmax(fp8_dtype))  # [M, ng]
    q = _cast(padded, torch.reciprocal(scale)[:, :, None], fp8_dtype).reshape(m, ng * GROUP)[:, :k]
    return q.contiguous(), scale.t().contiguous().t()


def tensor_scale(x2d: torch.Tensor, fp8_dtype=torch.float8_e4m3fn) -> torch.Tensor:
    """The dynamic per-tensor scale (0-d float32, on x's device; no host synchronization)."""
    if x2d.is_cuda and _triton_ok(x2d):
        amax = quantize_rows(x2d, fp8_dtype, absmax_only=True).amax()
    else:
        amax = row_absmax_torch(x2d).amax() if x2d.shape[0] else torch.zeros((), device=x2d.device)
    return _safe_scale(amax, _fmax(fp8_dtype))


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------


@jit
def _max_keep_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@jit
def _absmax(x, axis: tl.constexpr):
    """Row absmax that is NaN where the row holds a NaN, as torch.amax (tl.max drops NaN)."""
    return tl.reduce(tl.abs(x), axis, _max_keep_nan)


@jit
def _scale_of(amax, RCP: tl.constexpr, TINY_: tl.constexpr):
    """``numerics.scale_from_amax``: one float32 multiply; zero and NaN give 1."""
    s = amax * RCP
    return tl.where(s > 0, tl.maximum(s, TINY_), 1.0)


@jit
def _store_fp8(q_ptrs, y, mask, FMAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
               EXACT: tl.constexpr):
    # NaN stays NaN (torch.clamp keeps it; a plain min/max pair would turn it into +-FMAX)
    y = tl.clamp(y, -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL)
    if EXACT:
        y = round_fp8_grid(y, MBITS, EMIN)
    v = y.to(q_ptrs.dtype.element_ty)
    if EXACT:  # the interpreter's cast turns NaN into a finite code; the GPU's gives NaN (0x7F)
        v = tl.where(y != y, tl.full(y.shape, 0x7F, tl.uint8).to(v.dtype, bitcast=True), v)
    tl.store(q_ptrs, v, mask=mask)


@jit
def _rows_kernel(x_ptr, q_ptr, s_ptr, M, K, sxm, sxk, sqm,
                 MODE: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                 ONE_PASS: tl.constexpr, FMAX: tl.constexpr, RCP: tl.constexpr,
                 TINY_: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, EXACT: tl.constexpr):
    """MODE 0: dynamic per row (writes q and scale per row); 1: static (s_ptr holds the one
    scale; writes q); 2: row absmax only (writes absmax per row into s_ptr)."""
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    rmask = rows < M
    cols = tl.arange(0, BLOCK_K)
    x_row = x_ptr + rows[:, None].to(tl.int64) * sxm
    q_row = q_ptr + rows[:, None].to(tl.int64) * sqm
    if ONE_PASS:
        mask = rmask[:, None] & (cols[None, :] < K)
        x = tl.load(x_row + cols[None, :] * sxk, mask=mask, other=0.0).to(tl.float32)
        if MODE == 1:
            inv = tl.math.div_rn(1.0, tl.load(s_ptr))
            _store_fp8(q_row + cols[None, :], x * inv, mask, FMAX, MBITS, EMIN, EXACT)
        else:
            amax = _absmax(x, 1)
            if MODE == 2:
                tl.store(s_ptr + rows, amax, mask=rmask)
            else:
                s = _scale_of(amax, RCP, TINY_)
                inv = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), s)
                _store_fp8(q_row + cols[None, :], x * inv[:, None], mask, FMAX, MBITS, EMIN, EXACT)
                tl.store(s_ptr + rows, s, mask=rmask)
    else:
        # rows too long for registers: a first pass for the absmax (the second read mostly hits L2)
        if MODE == 1:
            inv = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), tl.load(s_ptr))
        else:
            amax = tl.zeros([ROWS], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                c = k0 + cols
                mask = rmask[:, None] & (c[None, :] < K)
                x = tl.load(x_row + c[None, :] * sxk, mask=mask, other=0.0).to(tl.float32)
                amax = _max_keep_nan(amax, _absmax(x, 1))
            if MODE == 0:
                s = _scale_of(amax, RCP, TINY_)
                inv = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), s)
                tl.store(s_ptr + rows, s, mask=rmask)
            else:
                tl.store(s_ptr + rows, amax, mask=rmask)
        if MODE != 2:
            for k0 in range(0, K, BLOCK_K):
                c = k0 + cols
                mask = rmask[:, None] & (c[None, :] < K)
                x = tl.load(x_row + c[None, :] * sxk, mask=mask, other=0.0).to(tl.float32)
                _store_fp8(q_row + c[None, :], x * inv[:, None], mask, FMAX, MBITS, EMIN, EXACT)


@jit
def _groups_kernel(x_ptr, q_ptr, s_ptr, M, K, sxm, sxk, sqm, ssm, ssg,
                   ROWS: tl.constexpr, GROUP_: tl.constexpr, FMAX: tl.constexpr,
                   RCP: tl.constexpr, TINY_: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
                   EXACT: tl.constexpr):
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    rows = pid_m * ROWS + tl.arange(0, ROWS)
    cols = g * GROUP_ + tl.arange(0, GROUP_)
    rmask = rows < M
    mask = rmask[:, None] & (cols[None, :] < K)
    r64 = rows[:, None].to(tl.int64)
    x = tl.load(x_ptr + r64 * sxm + cols[None, :] * sxk, mask=mask, other=0.0).to(tl.float32)
    amax = _absmax(x, 1)
    s = _scale_of(amax, RCP, TINY_)
    inv = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), s)
    _store_fp8(q_ptr + r64 * sqm + cols[None, :], x * inv[:, None], mask, FMAX, MBITS, EMIN, EXACT)
    tl.store(s_ptr + rows * ssm + g * ssg, s, mask=rmask)


def _triton_ok(x: torch.Tensor) -> bool:
    return HAS_TRITON and (x.is_cuda or INTERPRET) and x.dtype in (
        torch.bfloat16, torch.float16, torch.float32)


def _launch_shape(k: int):
    return _launch_shape_for(k, _ONE_PASS_MAX_K)


@functools.lru_cache(maxsize=256)
def _launch_shape_for(k: int, one_pass_max: int):
    """(rows per program, block width, one pass?, warps): about 4-16K elements per program, so
    that small-M calls still fill the GPU (one program per row once rows are long)."""
    block_k = max(16, triton.next_power_of_2(max(k, 1)))
    one_pass = block_k <= one_pass_max
    if not one_pass:
        block_k = 4096
    rows = max(1, min(16, 4096 // block_k))
    elems = rows * block_k
    warps = 4 if elems <= 4096 else (8 if elems <= 8192 else 16)
    return rows, block_k, one_pass, warps


@functools.lru_cache(maxsize=None)
def _kernel_args_cached(fp8_dtype):
    mbits, emin = _GRID[fp8_dtype]
    return dict(FMAX=_fmax(fp8_dtype), RCP=rcp_fmax(_fmax(fp8_dtype)), TINY_=TINY, MBITS=mbits, EMIN=emin, EXACT=INTERPRET)


def _kernel_args(fp8_dtype):
    return _kernel_args_cached(fp8_dtype)


def quantize_rows(x2d: torch.Tensor, fp8_dtype=torch.float8_e4m3fn, absmax_only: bool = False):
    """Dynamic per-row quantization with the Triton kernel: (q [M, K], scale [M, 1] float32).
    ``absmax_only``: just the float32 row absmax [M] (the first step of a dynamic per-tensor scale)."""
    m, k = x2d.shape
    rows, block_k, one_pass, warps = _launch_shape(k)
    s = torch.empty(m, dtype=torch.float32, device=x2d.device)
    q = s if absmax_only else torch.empty((m, k), dtype=fp8_dtype, device=x2d.device)
    if m:
        _rows_kernel[(triton.cdiv(m, rows),)](
            x2d, q, s, m, k, x2d.stride(0), x2d.stride(1), q.stride(0) if not absmax_only else 0,
            MODE=2 if absmax_only else 0, ROWS=rows, BLOCK_K=block_k, ONE_PASS=one_pass,
            num_warps=warps, **_kernel_args(fp8_dtype))
    return s if absmax_only else (q, s[:, None])


def quantize_tensor(x2d: torch.Tensor, scale: torch.Tensor, fp8_dtype=torch.float8_e4m3fn):
    """Quantization with one given float32 scale (a 0-d or 1-element tensor on x's device)."""
    m, k = x2d.shape
    rows, block_k, one_pass, warps = _launch_shape(k)
    scale = scale.to(device=x2d.device, dtype=torch.float32).reshape(1)
    q = torch.empty((m, k), dtype=fp8_dtype, device=x2d.device)
    if m:
        _rows_kernel[(triton.cdiv(m, rows),)](
            x2d, q, scale, m, k, x2d.stride(0), x2d.stride(1), q.stride(0),
            MODE=1, ROWS=rows, BLOCK_K=block_k, ONE_PASS=one_pass, num_warps=warps,
            **_kernel_args(fp8_dtype))
    return q


def quantize_groups(x2d: torch.Tensor, fp8_dtype=torch.float8_e4m3fn):
    """Per row and 128 columns: (q [M, K], scale [M, ceil(K/128)] with strides (1, M))."""
    m, k = x2d.shape
    ng = -(-k // GROUP)
    q = torch.empty((m, k), dtype=fp8_dtype, device=x2d.device)
    s = torch.empty((ng, m), dtype=torch.float32, device=x2d.device).t()
    rows = 32
    if m and k:
        _groups_kernel[(triton.cdiv(m, rows), ng)](
            x2d, q, s, m, k, x2d.stride(0), x2d.stride(1), q.stride(0), s.stride(0), s.stride(1),
            ROWS=rows, GROUP_=GROUP, num_warps=4, **_kernel_args(fp8_dtype))
    return q, s
