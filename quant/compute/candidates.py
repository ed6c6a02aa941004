"""The candidates ``choice.decide`` proves: each path's run, its eager twin and the reference of its math.

For every path the reference takes the operands the path multiplies (the weight as stored, the
activation as the path's eager quantizer makes it), dequantized by eager torch ops, and multiplies them
in ``proof.reference_dtype`` (float64 on the CPU, float32 on a GPU) on a sample of rows and columns;
the twin computes the same product the way the eager code of the pack does, in the path's output dtype.
Nothing here runs the kernel under proof except ``run``, which the compute floor passes in.

``wref`` below is ``weight_reference(w, sample.cols)``: the sampled rows of the weight only.

    plain      dequantize, then ``F.linear`` in the compute dtype (stock ComfyUI's path): no twin
    gemm       a fused weight-only GEMM (FP8 or NVFP4 weight converted in registers): twin = plain
    fp8        activation quantized to FP8 (per row / per tensor / per 1x128 group), scaled matmul:
               twin = the eager quantizer's operands multiplied in float32
    int8       activation rotated and quantized per token, int8 GEMM: twin = the same int8 operands
               multiplied in float32
Pure torch; never imports ComfyUI.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import act_quant
from ..kernels.int8_mm import quantize_rows_int8_torch
from ..layouts.fp8 import dequantize_eager
from . import proof
from .choice import COLS, ROWS, Candidate

__all__ = ["Sample", "proof_activation", "weight_reference", "plain", "gemm", "fp8", "int8"]


class Sample:
    """The rows and columns of an ``[m, n]`` output that a proof compares."""

    def __init__(self, m: int, n: int, device):
        self.rows = proof.sample_index(m, ROWS, device)
        self.cols = proof.sample_index(n, COLS, device)

    def __call__(self, out: torch.Tensor) -> torch.Tensor:
        return out.index_select(0, self.rows).index_select(1, self.cols)


def proof_activation(m: int, k: int, dtype: torch.dtype, device) -> torch.Tensor:
    return proof.seeded_activation(m, k, dtype, device)


def weight_reference(w, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of the weight (the output columns a proof compares) as float32 ``[len(rows), K]``, by
    eager torch ops only (no dequantization kernel). Only those rows are dequantized: a proof of a
    12288 x 3072 layer reads 256 of its rows, not all of them."""
    shape = tuple(w.qdata.shape)
    block = w.layout.kernel_block(shape)
    if w.layout.family == "fp8" and block is not None and len(shape) == 2:
        (r, c), per_tensor = block
        q = w.qdata.index_select(0, rows)
        if per_tensor:
            return dequantize_eager(q, w.scale, (1, shape[1]), torch.float32, True)
        scale = w.scale.to(torch.float32).reshape(-(-shape[0] // r), -1).index_select(0, torch.div(rows, r, rounding_mode="floor"))
        return dequantize_eager(q, scale, (1, c), torch.float32, False)
    if w.layout.family == "int8" and len(shape) == 2:
        scale = w.scale if w.scale.numel() == 1 else w.scale.reshape(shape[0], -1).index_select(0, rows)
        return w.layout.dequantize(w.qdata.index_select(0, rows), scale, torch.float32)
    return w.layout.dequantize(w.qdata, w.scale, torch.float32).index_select(0, rows)


def _bias_cols(bias, s: Sample, dtype):
    return None if bias is None else bias.index_select(0, s.cols).to(dtype)


def _ref_product(a_rows: torch.Tensor, w_cols: torch.Tensor, bias, s: Sample, rdt) -> torch.Tensor:
    out = a_rows.to(rdt) @ w_cols.to(rdt).t()
    b = _bias_cols(bias, s, rdt)
    return out if b is None else out + b


def plain(run, x: torch.Tensor, wref: torch.Tensor, bias, s: Sample) -> Candidate:
    rdt = proof.reference_dtype(x.device)
    return Candidate(run=run, reference=lambda: _ref_product(x.index_select(0, s.rows), wref, bias, s, rdt))


def gemm(run, x: torch.Tensor, wref: torch.Tensor, bias, cdt: torch.dtype, s: Sample) -> Candidate:
    """A fused weight-only GEMM; its twin is the plain path on the same weight (rounded to ``cdt`` first)."""
    rdt = proof.reference_dtype(x.device)
    xr, wc = x.index_select(0, s.rows), wref

    def twin():
        return F.linear(xr.to(cdt), wc.to(cdt), _bias_cols(bias, s, cdt))

    return Candidate(run=run, twin=twin, reference=lambda: _ref_product(xr, wc, bias, s, rdt))


def _fp8_operand(x: torch.Tensor, scaling: str, mode: str, input_scale, act_dtype):
    """The activation as the eager quantizer makes it, dequantized to float32 ``[M, K]``."""
    x2d = x.to(torch.float32) if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) else x
    if scaling == "block":
        q, sa = act_quant.quantize_groups_torch(x2d, act_dtype)
        return q.float() * sa.repeat_interleave(act_quant.GROUP, 1)[:, : x.shape[1]]
    if mode == "dynamic_row":
        q, sa = act_quant.quantize_rows_torch(x2d, act_dtype)
        return q.float() * sa
    scale = input_scale if mode == "static" else act_quant.tensor_scale(x2d, act_dtype)
    scale = scale.to(device=x.device, dtype=torch.float32).reshape(())
    return act_quant.quantize_tensor_torch(x2d, scale, act_dtype).float() * scale


def fp8(run, x: torch.Tensor, wref: torch.Tensor, bias, cdt: torch.dtype, s: Sample, *, scaling: str,
        mode: str, input_scale, act_dtype) -> Candidate:
    """The fp8 x fp8 path (activation quantizer + scaled matmul) on one weight."""
    rdt = proof.reference_dtype(x.device)
    a = _fp8_operand(x, scaling, mode, input_scale, act_dtype).index_select(0, s.rows)
    wc = wref

    def twin():
        return _ref_product(a, wc, bias, s, torch.float32).to(cdt)

    return Candidate(run=run, twin=twin, reference=lambda: _ref_product(a, wc, bias, s, rdt))


def int8(run, x: torch.Tensor, w8, bias, cdt: torch.dtype, s: Sample) -> Candidate:
    """The int8 path on an Int8 weight: per-token int8 activation (rotated like the weight), int8 GEMM."""
    rdt = proof.reference_dtype(x.device)
    layout = w8.layout
    xq, sa = quantize_rows_int8_torch(x.index_select(0, s.rows), layout.rotation, layout.regular)
    wq = w8.qdata.index_select(0, s.cols)
    sb = w8.scale.to(torch.float32).reshape(-1)
    sb = sb.index_select(0, s.cols) if sb.numel() > 1 else sb.expand(len(s.cols))

    def product(dt):
        out = (xq.to(dt) @ wq.to(dt).t()) * sa.to(dt) * sb.to(dt)[None, :]
        b = _bias_cols(bias, s, dt)
        return out if b is None else out + b

    return Candidate(run=run, twin=lambda: product(torch.float32).to(cdt), reference=lambda: product(rdt))
