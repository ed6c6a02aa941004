"""The fp8 x fp8 path: the activation quantized to float8_e4m3fn by one fused kernel, then one scaled matmul.

Scales per activation row by default, per tensor from ``input_scale`` or dynamic, per 1x128 group for
128x128 block weights; the bias and the output dtype go into the matmul (``scaled_mm.py``). Applies to FP8
weights whose layout names a scaled-matmul scaling; under "auto" where the device has FP8 matrix units
(CUDA capability 8.9+) and both matrix dims are multiples of 16 (cuBLASLt's rule), under "fp8" wherever
the scaled matmul has a kernel (the CPU too). Where autograd records, the forward is this product and the
backward goes through the dequantized weight. Its twin: the eager quantizer's operands multiplied in
float32. Pure torch; never imports ComfyUI.
"""

from __future__ import annotations

import torch

from ... import kernels
from ...kernels import act_quant, ops as kernel_ops
from .. import proof, scaled_mm as sm
from .base import Path, cached_on_weight, ref_product

__all__ = ["Fp8", "FP8", "scaling_mode", "row_weight_scale", "product"]

ACT_DTYPE = sm.ACT_DTYPE


def scaling_mode(w, cfg) -> str:
    """The activation scaling this call uses ("dynamic_row", "dynamic_tensor" or "static")."""
    mode = cfg.activation_scaling
    if mode == "auto":
        return "dynamic_row"  # measured fastest at the best accuracy: one fused pass, no global reduction
    if mode == "static" and w.input_scale is None:
        return "dynamic_tensor"  # never a made-up scale of 1.0
    return mode


def row_weight_scale(w) -> torch.Tensor:
    """The weight's scale as the [1, N] row-wise operand of the scaled matmul."""
    n = w.qdata.shape[0]
    if w.layout.fp8_scaling(w.qdata.shape) == "row":
        return w.scale.reshape(1, n)  # a view: [N, 1] is already laid out as [1, N]
    return cached_on_weight(w, "row_scale", lambda: w.scale.reshape(1, 1).expand(1, n).contiguous())


def _block_weight_scale(w, form: str) -> torch.Tensor:
    """The weight's block scale in the form the device's matmul reads right, made once per weight."""
    if form == "transposed":
        return w.scale.t()  # a view
    return cached_on_weight(w, "block_scale_" + form, lambda: sm.block_scale_b(w.scale, form))


def product(x2d, w, cfg, out_dtype, bias=None, *, op: bool = False) -> torch.Tensor:
    """``x2d @ W.T (+ bias)`` by fp8 x fp8: the activation quantizer, then the scaled matmul (``op``: the
    custom ops a compiled graph calls)."""
    k = kernel_ops if op else kernels
    scaling = w.layout.fp8_scaling(w.qdata.shape)
    if scaling == "block":
        a_form, b_form = sm.blockwise_form(x2d.device)
        xq, sa = k.quantize_groups(x2d, ACT_DTYPE)
        if a_form == "m_padded":
            sa = sm.pad_rows(sa, 4)
        sb = _block_weight_scale(w, b_form)
    else:
        mode = scaling_mode(w, cfg)
        if mode == "dynamic_row":
            xq, sa = k.quantize_rows(x2d, ACT_DTYPE)
            sb = row_weight_scale(w)
        else:
            xq, sa = k.quantize_tensor(x2d, w.input_scale if mode == "static" else None, ACT_DTYPE)
            if scaling == "row":  # row-wise weight: both operands row-wise
                sa = sa.reshape(1, 1).expand(x2d.shape[0], 1).contiguous()
                sb = row_weight_scale(w)
            else:
                sb = w.scale.reshape(())
    mm = sm.scaled_mm if op else sm._scaled_mm
    return mm(xq, w.qdata.t(), sa, sb, bias, out_dtype)


class _WithGrad(torch.autograd.Function):
    """fp8 x fp8 forward; backward gives the input gradient through the dequantized weight."""

    @staticmethod
    def forward(ctx, x2d, w, cfg, cdt, op):
        ctx.weight = w
        return product(x2d, w, cfg, cdt, None, op=op)

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out @ ctx.weight.dequantize(grad_out.dtype), None, None, None, None


def _operand_a(x: torch.Tensor, scaling: str, mode: str, input_scale) -> torch.Tensor:
    """The activation as the eager quantizer makes it, dequantized to float32 ``[M, K]``."""
    x2d = x.to(torch.float32) if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) else x
    if scaling == "block":
        q, sa = act_quant.quantize_groups_torch(x2d, ACT_DTYPE)
        return q.float() * sa.repeat_interleave(act_quant.GROUP, 1)[:, : x.shape[1]]
    if mode == "dynamic_row":
        q, sa = act_quant.quantize_rows_torch(x2d, ACT_DTYPE)
        return q.float() * sa
    scale = input_scale if mode == "static" else act_quant.tensor_scale(x2d, ACT_DTYPE)
    scale = scale.to(device=x.device, dtype=torch.float32).reshape(())
    return act_quant.quantize_tensor_torch(x2d, scale, ACT_DTYPE).float() * scale


class Fp8(Path):
    name = "fp8"
    grad_ok = True

    def operand(self, w, cfg, device, cdt):
        if w.layout.family != "fp8" or cfg.path not in ("auto", "fp8") or w.transposed or w.qdata.dim() != 2:
            return None
        out_f, in_f = w.qdata.shape
        scaling = w.layout.fp8_scaling((out_f, in_f))  # other blocks (musubi 1x64, MXFP8's 1x32): weight-only
        if scaling is None or (scaling == "block" and not sm.blockwise_supported(device)):
            return None
        if cfg.path == "fp8":
            return w
        # cuBLASLt FP8 needs both matrix dims divisible by 16: skip quietly instead of failing
        return w if sm.fp8_supported(device) and in_f % 16 == 0 and out_f % 16 == 0 else None

    def kind(self, w, cfg) -> str:
        scaling = w.layout.fp8_scaling(w.qdata.shape)
        return f"fp8 x fp8 per {scaling}" if scaling != "block" else "fp8 x fp8 block-wise"

    def mode(self, w, cfg) -> str:
        return f"{cfg.path}/{scaling_mode(w, cfg)}"

    def run(self, x2d, w, bias, cdt, cfg, *, op: bool = False):
        if bias is not None and bias.dtype != cdt:
            bias = bias.to(cdt)
        if torch.is_grad_enabled() and (x2d.requires_grad or (bias is not None and bias.requires_grad)):
            out = _WithGrad.apply(x2d, w, cfg, cdt, op)
            return out if bias is None else out + bias
        return product(x2d, w, cfg, cdt, bias, op=op)

    def check(self, x2d, w, bias, cdt, cfg, sample, wref):
        rdt = proof.reference_dtype(x2d.device)
        scaling, mode = w.layout.fp8_scaling(w.qdata.shape), scaling_mode(w, cfg)
        if scaling != "block" and mode == "dynamic_tensor":  # one scale from every row: quantize them all
            a = _operand_a(x2d, scaling, mode, w.input_scale).index_select(0, sample.rows)
        else:
            a = _operand_a(x2d.index_select(0, sample.rows), scaling, mode, w.input_scale)

        def twin():
            return ref_product(a, wref(), bias, sample, torch.float32).to(cdt)

        return twin, lambda: ref_product(a, wref(), bias, sample, rdt), None

    def failure_key(self, w, cfg, x_dtype, cdt) -> tuple:
        return (repr(w.layout), scaling_mode(w, cfg), x_dtype, w.qdata.dtype, cdt)


FP8 = Fp8()
