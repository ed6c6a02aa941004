"""Compute paths for ``y = x @ W.T + b`` with a QuantizedTensor weight W.

(a) weight-only: dequantize W into the compute dtype, then a plain ``F.linear``. The default on
    the CPU and on GPUs without FP8 matrix units, and the route for block-wise layouts.
(b) fp8 x fp8: quantize the activation to float8_e4m3fn (static ``input_scale``, dynamic per
    tensor, or dynamic per row) and call ``scaled_mm`` with the weight's per-tensor / per-row
    scales. Chosen when CUDA capability >= 8.9 (path "auto") or forced (path "fp8"). Any failure
    logs once and the call falls back to (a); it never raises.

The choice is made per call from ``config`` (argument) or ``weight.config`` (per model).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from .config import DEFAULT_CONFIG, ComputeConfig
from .layouts import Block, PerRow, PerTensor, QuantizationError, _safe_scale, fp8_max, workspace
from .tensor import QuantizedTensor, log_once

logger = logging.getLogger(__name__)

__all__ = ["linear", "fp8_supported"]

_ACT_DTYPE = torch.float8_e4m3fn
_capability_cache: dict = {}


def fp8_supported(device: torch.device) -> bool:
    """True where the device has FP8 matrix units (CUDA compute capability 8.9 or newer)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capability_cache:
        _capability_cache[index] = torch.cuda.get_device_capability(index) >= (8, 9)
    return _capability_cache[index]


def _compute_dtype(x: torch.Tensor, cfg: ComputeConfig) -> torch.dtype:
    if cfg.compute_dtype is not None:
        return cfg.compute_dtype
    if x.dtype.is_floating_point and x.dtype.itemsize >= 2:
        return x.dtype
    raise QuantizationError(f"linear: the input must be a float tensor, got {x.dtype}")


def _wants_fp8(x: torch.Tensor, w: QuantizedTensor, cfg: ComputeConfig) -> bool:
    if cfg.path == "weight_only" or isinstance(w.layout, Block) or x.numel() == 0:
        return False
    if cfg.path == "fp8":
        return True
    out_f, in_f = w.qdata.shape
    # cuBLASLt FP8 needs both matrix dims divisible by 16; skip quietly instead of failing.
    return fp8_supported(x.device) and in_f % 16 == 0 and out_f % 16 == 0


def _scaled_mm(a, b, scale_a, scale_b, out_dtype, rowwise: bool):
    """Call whichever scaled matmul this torch has (the public F.scaled_mm first)."""
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        recipe = F.ScalingType.RowWise if rowwise else F.ScalingType.TensorWise
        return F.scaled_mm(a, b, scale_a, recipe, scale_b, recipe, output_dtype=out_dtype)
    out = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return out[0] if isinstance(out, tuple) else out  # torch < 2.5 returned (out, amax)


def _fp8_mm(x2d: torch.Tensor, w: QuantizedTensor, cfg: ComputeConfig, out_dtype) -> torch.Tensor | None:
    """fp8 x fp8 product ``x2d @ W.T`` (no bias), or None after a logged failure."""
    try:
        qdata, wscale = w.qdata, w.scale
        n_out = qdata.shape[0]
        m = x2d.shape[0]
        fmax = fp8_max(_ACT_DTYPE)
        mode = cfg.activation_scaling
        if mode == "static" and w.input_scale is None:
            mode = "dynamic_tensor"
        xf = x2d.to(torch.float32)
        if mode == "static":
            sa = w.input_scale.to(device=x2d.device, dtype=torch.float32).reshape(())
        elif mode == "dynamic_tensor":
            sa = _safe_scale(xf.abs().amax(), fmax)
        else:
            sa = _safe_scale(xf.abs().amax(dim=1, keepdim=True), fmax)
        xq = (xf / sa).clamp_(-fmax, fmax).to(_ACT_DTYPE)
        if isinstance(w.layout, PerRow):
            sb = wscale.reshape(1, n_out)
        elif isinstance(w.layout, PerTensor):
            sb = wscale.reshape(())
        else:
            raise QuantizationError(f"no fp8 x fp8 kernel for layout {w.layout}")
        rowwise = sa.dim() > 0 or sb.dim() > 0
        if rowwise:  # both operands must then carry row-wise scales
            sa = sa.reshape(-1, 1).expand(m, 1).contiguous()
            sb = sb.reshape(1, -1).expand(1, n_out).contiguous()
            mm_dtype = torch.bfloat16  # the only output dtype row-wise kernels accept on CUDA
        else:
            mm_dtype = out_dtype
        out = _scaled_mm(xq, qdata.t(), sa, sb, mm_dtype, rowwise)
        return out if out.dtype == out_dtype else out.to(out_dtype)
    except Exception as exc:  # a kernel that cannot run here must not break the model
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        log_once(("fp8_failed", x2d.device.type, type(exc).__name__, first_line[:120]),
                 logging.WARNING,
                 "fp8 x fp8 linear failed on %s (%s: %s); using the weight-only path instead "
                 "(logged once)", x2d.device, type(exc).__name__, first_line)
        return None


class _Fp8LinearWithGrad(torch.autograd.Function):
    """fp8 x fp8 forward; backward gives the input gradient through the dequantized weight."""

    @staticmethod
    def forward(ctx, x2d, w, cfg, cdt):
        ctx.weight = w
        out = _fp8_mm(x2d, w, cfg, cdt)
        if out is None:
            out = F.linear(x2d.to(cdt), w.dequantize(cdt))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        wd = ctx.weight.dequantize(grad_out.dtype)
        return grad_out @ wd, None, None, None


def _dequantized_weight(x, w: QuantizedTensor, bias, cdt) -> torch.Tensor:
    """W in ``cdt`` for one weight-only product. On the CPU, when autograd will not keep the
    weight, it goes into this thread's reusable buffer instead of fresh memory: a model that
    dequantizes every layer on every step otherwise pays for its whole full-precision size in
    page faults per step (see ``layouts.workspace``). The buffer is dead once F.linear returns."""
    keeps_weight = torch.is_grad_enabled() and (
        x.requires_grad or (bias is not None and bias.requires_grad))
    if w.qdata.device.type != "cpu" or keeps_weight or w.transposed:
        return w.dequantize(cdt)
    buf = workspace("weight_only", w.qdata.numel(), cdt).view(w.qdata.shape)
    return w.layout.dequantize(w.qdata, w.scale, cdt, out=buf)


def _weight_only(x, w: QuantizedTensor, bias, cdt):
    if x.dtype != cdt:
        x = x.to(cdt)
    if bias is not None and bias.dtype != cdt:
        bias = bias.to(cdt)
    return F.linear(x, _dequantized_weight(x, w, bias, cdt), bias)


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None,
           config: ComputeConfig | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a QuantizedTensor (or plain) weight; x of any rank >= 1.

    ``config`` overrides ``weight.config`` for this call. The output has the compute dtype
    (``config.compute_dtype``, else x's dtype).
    """
    if isinstance(bias, QuantizedTensor):
        bias = bias.dequantize()
    if isinstance(x, QuantizedTensor):
        x = x.dequantize()
    if not isinstance(weight, QuantizedTensor):
        return F.linear(x, weight, bias)
    if weight.transposed or weight.qdata.dim() != 2:
        # not an [out, in] weight: plain math on the dequantized tensor
        cdt = _compute_dtype(x, config or weight.config or DEFAULT_CONFIG)
        return F.linear(x.to(cdt), weight.dequantize(cdt), None if bias is None else bias.to(cdt))
    cfg = config or weight.config or DEFAULT_CONFIG
    out_f, in_f = weight.qdata.shape
    if x.dim() == 0 or x.shape[-1] != in_f:
        raise QuantizationError(
            f"linear: input of shape {list(x.shape)} does not fit a weight of shape "
            f"[{out_f}, {in_f}] (last input dim must be {in_f})"
        )
    cdt = _compute_dtype(x, cfg)
    if not _wants_fp8(x, weight, cfg):
        return _weight_only(x, weight, bias, cdt)

    x2d = x.reshape(-1, in_f)
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or (bias is not None and bias.requires_grad))
    if needs_grad:
        out = _Fp8LinearWithGrad.apply(x2d, weight, cfg, cdt)
    else:
        with torch.no_grad():
            out = _fp8_mm(x2d, weight, cfg, cdt)
        if out is None:
            return _weight_only(x, weight, bias, cdt)
    if bias is not None:
        out = out + bias.to(cdt)
    return out.reshape(*x.shape[:-1], out_f)
