"""Compute paths for ``y = x @ W.T + b`` with a QuantizedTensor weight W.

(a) weight-only: W converted into the compute dtype, then a plain matmul. The default on the CPU
    and on GPUs without FP8 matrix units, and the route for layouts the fp8 path cannot take.
    CPU: dequantize into a reused per-thread buffer (byte-pair table), then ``F.linear``.
    CUDA: a Triton GEMM that converts the FP8 weight in registers (up to
    ``kernels.FUSED_WEIGHT_ONLY_MAX_M`` tokens), else a one-pass dequantize then cuBLAS.
(b) fp8 x fp8: the activation is quantized to float8_e4m3fn by one fused kernel (scales per row
    by default, per tensor from ``input_scale`` or dynamic, per 1x128 group for 128x128 block
    weights), then one scaled matmul with the bias and output dtype passed to it. Chosen where
    CUDA capability >= 8.9 (path "auto") or when forced (path "fp8"). Any failure logs once and
    the call falls back to (a); it never raises.

(c) int8 x int8 (``int8.py``) for Int8 weights and where it is forced; (d) NVFP4 weights weight-only
    (``nvfp4.py``). The scaled matmul of (b) is ``scaled_mm.py``; what failed is remembered in
    ``failures.py``. The path is asked of the weight's layout (``family``, ``fp8_scaling``,
    ``kernel_block``), and chosen per call from ``config`` (argument) or ``weight.config`` (per model).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from .. import kernels
from ..config import DEFAULT_CONFIG, ComputeConfig
from ..errors import QuantizationError
from ..kernels import ops as kernel_ops
from ..layouts.int8 import rotate
from ..runtime import log_once, tracing, workspace
from ..tensor import QuantizedTensor
from . import candidates as cand, choice, failures as fails, int8, kitchen, nvfp4, scaled_mm as sm
from .failures import device_key as _device_key, first_line as _first_line, is_oom as _is_oom
from .scaled_mm import ACT_DTYPE as _ACT_DTYPE, fp8_supported

logger = logging.getLogger(__name__)

__all__ = ["linear", "fp8_supported"]


def _compute_dtype(x: torch.Tensor, cfg: ComputeConfig) -> torch.dtype:
    if cfg.compute_dtype is not None:
        return cfg.compute_dtype
    if x.dtype.is_floating_point and x.dtype.itemsize >= 2:
        return x.dtype
    raise QuantizationError(f"linear: the input must be a float tensor, got {x.dtype}")


def _traced(path: str, device: torch.device) -> bool:
    """True while torch.compile traces; says so once per path and device type."""
    if not tracing():
        return False
    log_once(logger, ("traced", path, device.type), logging.INFO,
             "torch.compile is tracing FP8 linears (%s path on %s) into its graph", path, device.type)
    return True


# ---------------------------------------------------------------------------------------------
# the fp8 x fp8 path
# ---------------------------------------------------------------------------------------------


def _wants_fp8(x: torch.Tensor, w: QuantizedTensor, cfg: ComputeConfig) -> bool:
    if cfg.path == "weight_only" or x.numel() == 0:
        return False
    out_f, in_f = w.qdata.shape
    # other block shapes (musubi 1x64, MXFP8's 1x32, ...) and other families: weight-only
    scaling = w.layout.fp8_scaling((out_f, in_f))
    fits = scaling is not None and (scaling != "block" or sm.blockwise_supported(x.device))
    if cfg.path == "fp8":
        return fits
    # cuBLASLt FP8 needs both matrix dims divisible by 16; skip quietly instead of failing.
    return fits and sm.fp8_supported(x.device) and in_f % 16 == 0 and out_f % 16 == 0


def _scaling_mode(w: QuantizedTensor, cfg: ComputeConfig) -> str:
    mode = cfg.activation_scaling
    if mode == "auto":
        # measured fastest at the best accuracy: one fused pass, no global reduction
        return "dynamic_row"
    if mode == "static" and w.input_scale is None:
        return "dynamic_tensor"  # never a made-up scale of 1.0
    return mode


def _cached_on_weight(w: QuantizedTensor, name: str, build):
    """A tensor derived from the weight's scale, built once and kept on the weight. It is rebuilt
    when the scale is replaced or written in place: by its version counter, and, for inference
    tensors (what ComfyUI's loaders make under inference_mode; they have no version counter),
    because every in-place write of the pack's own (copy_, requantize_, LoRA patches) calls
    ``QuantizedTensor.scales_written()``."""
    if tracing():
        return build()  # a cached tensor would outlive the trace's fake mode
    scale = w.scale
    # asked, not tried: reading _version of an inference tensor raises (measured ~8 us a call)
    version = None if scale.is_inference() else scale._version
    key = (name, scale.data_ptr(), version, scale.device)
    cache = w.__dict__.setdefault("_derived", {})
    hit = cache.get(name)
    if hit is not None and hit[0] == key:
        return hit[1]
    value = build()
    cache[name] = (key, value)
    return value


def _row_weight_scale(w: QuantizedTensor) -> torch.Tensor:
    """The weight's scale as the [1, N] row-wise operand of the scaled matmul."""
    n = w.qdata.shape[0]
    if w.layout.fp8_scaling(w.qdata.shape) == "row":
        return w.scale.reshape(1, n)  # a view: [N, 1] is already laid out as [1, N]
    return _cached_on_weight(w, "row_scale",
                             lambda: w.scale.reshape(1, 1).expand(1, n).contiguous())


def _failure_key(x: torch.Tensor, w: QuantizedTensor, cfg: ComputeConfig, out_dtype):
    return (_device_key(x.device), w.layout.key, _scaling_mode(w, cfg), x.dtype, w.qdata.dtype, out_dtype)


def _block_weight_scale(w: QuantizedTensor, form: str) -> torch.Tensor:
    """The weight's block scale in the form the device's matmul reads right, made once per
    weight (padding included) and kept on it, never per call."""
    if form == "transposed":
        return w.scale.t()  # a view
    return _cached_on_weight(w, "block_scale_" + form, lambda: sm.block_scale_b(w.scale, form))


def _fp8_product(x2d: torch.Tensor, w: QuantizedTensor, cfg: ComputeConfig, out_dtype,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp8 x fp8 product ``x2d @ W.T (+ bias)``: the activation quantizer, then the scaled matmul."""
    k = kernel_ops if _traced("fp8", x2d.device) else kernels
    scaling = w.layout.fp8_scaling(w.qdata.shape)
    if scaling == "block":
        a_form, b_form = sm.blockwise_form(x2d.device)
        xq, sa = k.quantize_groups(x2d, _ACT_DTYPE)
        if a_form == "m_padded":
            sa = sm.pad_rows(sa, 4)
        sb = _block_weight_scale(w, b_form)
    else:
        mode = _scaling_mode(w, cfg)
        if mode == "dynamic_row":
            xq, sa = k.quantize_rows(x2d, _ACT_DTYPE)
            sb = _row_weight_scale(w)
        else:
            xq, sa = k.quantize_tensor(
                x2d, w.input_scale if mode == "static" else None, _ACT_DTYPE)
            if scaling == "row":  # row-wise weight: both operands row-wise
                sa = sa.reshape(1, 1).expand(x2d.shape[0], 1).contiguous()
                sb = _row_weight_scale(w)
            else:
                sb = w.scale.reshape(())
    mm = sm.scaled_mm if k is kernel_ops else sm._scaled_mm
    return mm(xq, w.qdata.t(), sa, sb, bias, out_dtype)


def _fp8_mm(x2d: torch.Tensor, w: QuantizedTensor, cfg: ComputeConfig, out_dtype,
            bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``_fp8_product``, or None after a logged failure. A failure other than out-of-memory is
    remembered for its (device, layout, scaling, dtypes): later calls of that kind go weight-only
    without trying (see ``fails.fp8_failed``)."""
    try:
        return _fp8_product(x2d, w, cfg, out_dtype, bias)
    except Exception as exc:  # a kernel that cannot run here must not break the model
        key = _failure_key(x2d, w, cfg, out_dtype)
        fails.remember_failure(fails.fp8_failed, key, exc, "fp8 x fp8 linear", x2d.device,
                          f"{key[1]} weights, {key[2]} scaling, {key[3]} x {key[4]} -> {key[5]}")
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


# ---------------------------------------------------------------------------------------------
# the weight-only path
# ---------------------------------------------------------------------------------------------


def _dequantized_weight(x, w: QuantizedTensor, bias, cdt, stored: bool = False) -> torch.Tensor:
    """W in ``cdt`` for one weight-only product. On the CPU, when autograd will not keep the
    weight, it goes into this thread's reusable buffer instead of fresh memory: a model that
    dequantizes every layer on every step otherwise pays for its whole full-precision size in
    page faults per step (see ``layouts.workspace``). The buffer is dead once F.linear returns."""
    keeps_weight = torch.is_grad_enabled() and (
        x.requires_grad or (bias is not None and bias.requires_grad))
    dequantize = w.layout.dequantize_stored if stored else w.layout.dequantize  # stored: Int8 as stored (rotated)
    if (w.qdata.device.type != "cpu" or keeps_weight or w.transposed
            or _traced("weight-only", x.device)):
        return w.dequantize(cdt) if not stored else dequantize(w.qdata, w.scale, cdt)
    buf = workspace("weight_only", w.qdata.numel(), cdt).view(w.qdata.shape)
    return dequantize(w.qdata, w.scale, cdt, out=buf)


def _kernel_block(w: QuantizedTensor):
    """(block shape, per_tensor) for the kernels, or None for a layout they do not know."""
    return w.layout.kernel_block(w.qdata.shape)


def _weight_only(x, w: QuantizedTensor, bias, cdt):
    if x.dtype != cdt:
        x = x.to(cdt)
    if bias is not None and bias.dtype != cdt:
        bias = bias.to(cdt)
    if w.qdata.is_cuda and not w.transposed:
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad or (bias is not None and bias.requires_grad))
        block = _kernel_block(w)
        if block is not None and not needs_grad and cdt in (torch.bfloat16, torch.float16) and not (
                fails.wo_failed and _wo_key(x, w, block, cdt) in fails.wo_failed):
            out_f, in_f = w.qdata.shape
            # custom ops while torch.compile traces
            k = kernel_ops if _traced("weight-only", x.device) else kernels
            x2d = x.reshape(-1, in_f)
            method = "auto" if k is kernel_ops else _gemm_or_plain(x2d, w, bias, cdt, block)
            if method == "plain":
                return F.linear(x, w.dequantize(cdt), bias)
            try:
                y = k.weight_only_linear(x2d, w.qdata, w.scale, block[0], block[1], bias, method=method)
                return y.reshape(*x.shape[:-1], out_f)
            except Exception as exc:  # a GEMM kernel that cannot run on this GPU: dequantize + cuBLAS
                if k is kernel_ops or _is_oom(exc):
                    raise
                key = _wo_key(x, w, block, cdt)
                fails.wo_failed.add(key)
                log_once(logger, ("wo_failed", key), logging.WARNING,
                         "weight-only FP8 GEMM failed on %s (%s: %s); these layers dequantize and use cuBLAS from now "
                         "on (logged once)", x.device, type(exc).__name__, _first_line(exc))
    if _rotates_activation(w, x.numel() // x.shape[-1]) and not w.transposed and not _traced("weight-only", x.device):
        # the pack's own rotated int8 (converted at load): rotate the fewer rows, the activation's
        xr = rotate(x, w.layout.rotation).to(cdt)
        return F.linear(xr, _dequantized_weight(x, w, bias, cdt, stored=True), bias)
    return F.linear(x, _dequantized_weight(x, w, bias, cdt), bias)


def _gemm_or_plain(x2d, w: QuantizedTensor, bias, cdt, block) -> str:
    """"fused" or "plain" for a CUDA weight-only product: the fused GEMM where it is proven right and
    measured faster than dequantize + cuBLAS for this shape class (``choice``), by token count where
    the config trusts fast paths."""
    cfg = w.config or DEFAULT_CONFIG
    gemm_block = None if block[1] or tuple(block[0]) == (1, w.qdata.shape[1]) else tuple(block[0])
    if not kernels.weight_only_gemm.supported(x2d, w.qdata, gemm_block):
        return "plain"
    if cfg.trust_fast_paths:
        return "fused" if x2d.shape[0] <= kernels.FUSED_WEIGHT_ONLY_MAX_M else "plain"
    out_f, in_f = w.qdata.shape
    key = choice.key_for("weight-only GEMM", "weight_only", w.layout.key, x2d.shape[0], out_f, in_f, x2d.dtype,
                         w.qdata.dtype, cdt, bias is not None)
    v = choice.known(x2d.device, key)
    if v is None:
        xp, s, wref = _proof_parts(x2d, w)
        cands = {
            "gemm": cand.gemm(lambda: kernels.weight_only_linear(xp, w.qdata, w.scale, block[0], block[1], bias,
                                                                 method="fused"), xp, wref, bias, cdt, s),
            "plain": cand.plain(lambda: F.linear(xp, w.dequantize(cdt), bias), xp, wref, bias, s),
        }
        v = choice.decide(x2d.device, key, "weight-only GEMM", cands, s, fallback="plain")
    return "fused" if v.chosen == "gemm" else "plain"


def _proof_parts(x2d, w: QuantizedTensor):
    """The proof's activation for ``x2d``'s shape class, its sample, and the weight's eager reference."""
    out_f, in_f = w.qdata.shape
    m = choice.shape_class(x2d.shape[0], out_f, in_f)[1]
    xp = cand.proof_activation(m, in_f, x2d.dtype, x2d.device)
    s = cand.Sample(m, out_f, x2d.device)
    return xp, s, cand.weight_reference(w, s.cols)


def _wo_key(x: torch.Tensor, w: QuantizedTensor, block, cdt):
    return _device_key(x.device), block, w.qdata.dtype, cdt


# ---------------------------------------------------------------------------------------------
# the int8 path (int8.py)
# ---------------------------------------------------------------------------------------------


def _int8_weight(x, w: QuantizedTensor, bias, cfg: ComputeConfig):
    """The Int8 weight to run ``w``'s product with on the int8 path, or None for the other paths.
    Int8 weights take it unless weight-only is forced (under "auto" wherever INT8 is fast, FP8 GPUs
    included); FP8 weights only when it is forced, converted once and kept on the weight (the loaders
    convert them at load where "auto" wants int8)."""
    if cfg.path == "weight_only" or x.numel() == 0:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return None  # autograd goes through the dequantized weight
    if int8.is_int8(w):
        if cfg.path != "auto":
            return w
        # "auto": a candidate wherever an int8 kernel runs (the choice measures it), or by capability
        fast = int8.int8_fast(x.device) if cfg.trust_fast_paths else int8.int8_available(x.device)
        return w if fast else None
    if cfg.path == "int8":
        # one conversion kept per rotation choice: a call that overrides int8_rotation must not get the other's
        if cfg.int8_rotation:
            return _cached_on_weight(w, "int8", lambda: int8.to_int8(w, None))
        return _cached_on_weight(w, "int8_unrotated", lambda: int8.to_int8(w, 0))
    return None


# ---------------------------------------------------------------------------------------------


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None,
           config: ComputeConfig | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a QuantizedTensor (or plain) weight; x of any rank >= 1.

    ``config`` overrides ``weight.config`` for this call. The output has the compute dtype
    (``config.compute_dtype``, else x's dtype).
    """
    if torch.compiler.is_dynamo_compiling():
        # Dynamo cannot follow this Python (a layout is an object it does not model). It gets the
        # whole op instead, which comes back here through QuantizedTensor's F.linear handler while
        # the compiler traces it with fake tensors, so the compiled graph holds the same math.
        if config is not None and isinstance(weight, QuantizedTensor):
            weight = weight.with_config(config)
        return F.linear(x, weight, bias)
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
    if weight.layout.family == "nvfp4":  # packed 4-bit weights: weight-only everywhere (nvfp4.py)
        return nvfp4.weight_only_linear(x, weight, bias, _compute_dtype(x, cfg))
    out_f, in_f = weight.qdata.shape
    if x.dim() == 0 or x.shape[-1] != in_f:
        raise QuantizationError(
            f"linear: input of shape {list(x.shape)} does not fit a weight of shape "
            f"[{out_f}, {in_f}] (last input dim must be {in_f})"
        )
    cdt = _compute_dtype(x, cfg)
    w8 = _int8_weight(x, weight, bias, cfg)
    fp8 = w8 is None and _wants_fp8(x, weight, cfg)
    if w8 is not None or fp8:
        route = _route(x, weight, w8, bias, cfg, cdt)
        if route == "weight-only":  # (an int8 weight is its own w8)
            return _weight_only(x, weight, bias, cdt)
        if route == KITCHEN_INT8:
            return _kitchen_int8(x, w8, bias, cdt)
    if w8 is not None:
        b = None if bias is None else bias.to(cdt)
        if fails.int8_failed and (_device_key(x.device), w8.layout, x.dtype, cdt) in fails.int8_failed:
            return _weight_only(x, w8, b, cdt)
        try:
            return int8.int8_linear(x, w8, b, cdt)
        except Exception as exc:  # a kernel that cannot run here must not break the model
            fails.remember_failure(fails.int8_failed, (_device_key(x.device), w8.layout, x.dtype, cdt), exc, "int8 linear",
                              x.device, f"{w8.layout} weights, {x.dtype} -> {cdt}")
            return _weight_only(x, w8, b, cdt)
    if not fp8 or (fails.fp8_failed and _failure_key(x, weight, cfg, cdt) in fails.fp8_failed):
        return _weight_only(x, weight, bias, cdt)

    x2d = x if x.dim() == 2 else x.reshape(-1, in_f)
    if bias is not None and bias.dtype != cdt:
        bias = bias.to(cdt)
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or (bias is not None and bias.requires_grad))
    if needs_grad:
        out = _Fp8LinearWithGrad.apply(x2d, weight, cfg, cdt)
        if bias is not None:
            out = out + bias
    else:
        # nothing here requires grad, so no graph is recorded (no no_grad() needed: it costs
        # microseconds per call, which small-token calls feel)
        out = _fp8_mm(x2d, weight, cfg, cdt, bias)
        if out is None:
            return _weight_only(x, weight, bias, cdt)
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out_f)


# ---------------------------------------------------------------------------------------------
# the choice between the fast path and weight-only (choice.py)
# ---------------------------------------------------------------------------------------------


def _route(x, w: QuantizedTensor, w8, bias, cfg: ComputeConfig, cdt) -> str:
    """"int8", "fp8", KITCHEN_INT8 or "weight-only" for this product: the fast path where it was proven right on this
    device and, unless forced, measured faster than weight-only for this shape class. Where the config
    trusts fast paths, while torch.compile traces (without a verdict) and under autograd, the fast path
    is taken as the config asks, unproven."""
    fast = "int8" if w8 is not None else "fp8"
    if cfg.trust_fast_paths or (torch.is_grad_enabled() and (
            x.requires_grad or (bias is not None and bias.requires_grad))):
        return fast
    out_f, in_f = w.qdata.shape
    m = x.numel() // in_f
    if fast == "int8":
        kind, mode, wdt = "int8", cfg.path, w8.qdata.dtype
        lay = w8.layout  # what decides a candidate's eligibility (kitchen: the rotation's kind, the scale's)
        layout_key = f"int8/rotation{lay.rotation}{'regular' if lay.regular else ''}/{'row' if lay.per_row else 'tensor'}"
    else:
        scaling = w.layout.fp8_scaling(w.qdata.shape)
        kind = f"fp8 x fp8 per {scaling}" if scaling != "block" else "fp8 x fp8 block-wise"
        mode, layout_key, wdt = f"{cfg.path}/{_scaling_mode(w, cfg)}", w.layout.key, w.qdata.dtype
    key = choice.key_for(kind, mode, layout_key, m, out_f, in_f, x.dtype, wdt, cdt, bias is not None)
    v = choice.known(x.device, key)
    if v is None and cfg.path == "auto" and choice.too_small(m, out_f, in_f, _plain_rotation_macs(w, m)):
        v = choice.settle(x.device, key, kind, "weight-only", f"too small to prove ({choice.SMALL_MACS >> 20} M "
                          "multiply-adds a call at most): the plain path")
    if v is None:
        if tracing():
            return fast
        try:
            v = _decide(x, w, w8, bias, cfg, cdt, key, kind, fast)
        except Exception as exc:  # out of memory while proving (all else is a verdict): this call weight-only
            if not _is_oom(exc):
                raise
            log_once(logger, ("proof_oom", key), logging.WARNING, "proving %s ran out of memory on %s; this call "
                     "runs weight-only, the next proves again (logged once)", kind, x.device)
            return "weight-only"
    return v.chosen


def _rotates_activation(w: QuantizedTensor, m: int) -> bool:
    """Whether weight-only multiplies an ``m``-row activation, rotated, by this int8 weight as stored: the
    pack's own rotation (not ComfyUI's, whose dequantization stays as ComfyUI's) and fewer rows than W."""
    layout = w.layout
    return (int8.is_int8(w) and bool(layout.rotation) and not layout.regular and not layout.cast_first
            and m < w.qdata.shape[0])


def _plain_rotation_macs(w: QuantizedTensor, m: int) -> int:
    """Multiply-adds the weight-only path spends rotating a rotated int8 weight back per call (0 where it
    rotates the activation instead, or the weight is not rotated)."""
    if not int8.is_int8(w) or not w.layout.rotation or _rotates_activation(w, m):
        return 0
    return w.qdata.shape[0] * w.qdata.shape[1] * w.layout.rotation


def _decide(x, w: QuantizedTensor, w8, bias, cfg: ComputeConfig, cdt, key: str, kind: str, fast: str):
    started = time.perf_counter()
    out_f, in_f = w.qdata.shape
    x2d = x.reshape(-1, in_f)
    b = None if bias is None else bias.to(cdt)
    forced = None if cfg.path == "auto" else fast  # an int8 weight under "fp8" runs int8, as it always did
    if fast == "int8":
        xp, s, wref = _proof_parts(x2d, w8)
        cands = {"int8": cand.int8(lambda: int8.int8_linear(xp, w8, b, cdt), xp, w8, b, cdt, s)}
        if forced is None and kitchen.module() is not None and kitchen.takes(w8):  # what stock ComfyUI runs
            ours = cands["int8"]
            product_ref = cand.plain(None, xp, wref, b, s).reference
            cands[KITCHEN_INT8] = kitchen.int8_candidate(lambda: kitchen.int8_linear(xp, w8, b, cdt), xp, w8, b, cdt, s,
                                                         product_ref, ours.twin)
    else:
        xp, s, wref = _proof_parts(x2d, w)
        scaling = w.layout.fp8_scaling(w.qdata.shape)
        cands = {"fp8": cand.fp8(lambda: _fp8_product(xp, w, cfg, cdt, b), xp, wref, b, cdt, s, scaling=scaling,
                                 mode=_scaling_mode(w, cfg), input_scale=w.input_scale, act_dtype=_ACT_DTYPE)}
    if forced is None:
        base = w8 if fast == "int8" else w
        cands["weight-only"] = cand.plain(lambda: _weight_only(xp, base, b, cdt), xp, wref, b, s)
        slices = _timing_slices(x.device, base, b)
        if slices:  # a large CPU layer: every candidate timed on two of its first rows' slices (choice.TIME_ROWS)
            def timed(call):
                return {r: (lambda ws=ws, bs=bs: call(ws, bs)) for r, (ws, bs) in slices.items()}

            calls = {"weight-only": lambda ws, bs: _weight_only(xp, ws, bs, cdt)}
            if fast == "int8":
                calls["int8"] = lambda ws, bs: int8.int8_linear(xp, ws, bs, cdt)
                calls[KITCHEN_INT8] = lambda ws, bs: kitchen.int8_linear(xp, ws, bs, cdt)
            else:
                calls["fp8"] = lambda ws, bs: _fp8_product(xp, ws, cfg, cdt, bs)
            for name, c in cands.items():
                c.timed, c.rows = timed(calls[name]), base.qdata.shape[0]
    return choice.decide(x.device, key, kind, cands, s, forced=forced, fallback="weight-only",
                         setup_s=time.perf_counter() - started)


KITCHEN_INT8 = "kitchen int8"  # comfy-kitchen's int8_linear (kitchen.py), where the ComfyUI in use brings it


def _kitchen_int8(x, w8: QuantizedTensor, bias, cdt):
    b = None if bias is None else bias.to(cdt)
    key = (_device_key(x.device), "kitchen", w8.layout, x.dtype, cdt)
    if fails.int8_failed and key in fails.int8_failed:
        return _weight_only(x, w8, b, cdt)
    try:
        return kitchen.int8_linear(x.to(cdt), w8, b, cdt)
    except Exception as exc:  # proven on the proof's shape; a call that raises later must not break the model
        fails.remember_failure(fails.int8_failed, key, exc, "comfy-kitchen int8 linear", x.device,
                               f"{w8.layout} weights, {x.dtype} -> {cdt}")
        return _weight_only(x, w8, b, cdt)


def _timing_slices(device, w: QuantizedTensor, bias) -> dict:
    """{rows: (weight, bias) of ``w``'s first rows} at ``choice.SMALL_ROWS`` and ``choice.TIME_ROWS``, where
    candidates are timed on the CPU for a weight of more than twice TIME_ROWS rows; empty to time the
    whole weight (CUDA, small weights, layouts that cannot cut rows there)."""
    n = w.qdata.shape[0]
    if device.type != "cpu" or w.transposed or w.qdata.dim() != 2 or n <= 2 * choice.TIME_ROWS:
        return {}
    out = {}
    for rows in (choice.SMALL_ROWS, choice.TIME_ROWS):
        parts = w.layout.first_rows(w.qdata, w.scale, rows)
        if parts is None:
            return {}
        ws = QuantizedTensor.from_parts(parts[0], parts[1], w.layout, orig_dtype=w.orig_dtype, config=w.config)
        out[rows] = (ws, None if bias is None else bias[:rows])
    return out


_WEIGHT_ONLY = ComputeConfig(path="weight_only")


def int8_conversion_wins(w: QuantizedTensor, device, m: int = 1024) -> bool:
    """Should a loader convert this FP8 weight to int8 for ``device`` ("auto")? Yes where the int8 path,
    proven right there, runs this weight's shape class (``m`` tokens, the class most diffusion and text
    layers run in) faster than weight-only on the FP8 weight; by ``int8.int8_supported`` where the
    weight's config trusts fast paths. Measured once per shape class (kind "int8 at load")."""
    cfg = w.config or DEFAULT_CONFIG
    if cfg.trust_fast_paths:
        return int8.int8_supported(device)
    device = torch.device(device)
    if not int8.int8_available(device) or (device.type == "cuda" and sm.fp8_supported(device)):
        return False  # no int8 kernel, or FP8 units: the fp8 path is the fast one there
    out_f, in_f = w.shape  # logical: a packed (NVFP4) weight's data is narrower
    cdt = w.orig_dtype if w.orig_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    key = choice.key_for("int8 at load", "auto", w.layout.key, m, out_f, in_f, cdt, w.qdata.dtype, cdt, False)
    v = choice.known(device, key)
    if v is None:
        wd = w if w.qdata.device == device else QuantizedTensor.from_parts(
            w.qdata.to(device), w.scale.to(device), w.layout, orig_dtype=w.orig_dtype, config=cfg)
        w8 = int8.to_int8(wd, None if cfg.int8_rotation else 0)
        xp = cand.proof_activation(choice.shape_class(m, out_f, in_f)[1], in_f, cdt, device)
        s = cand.Sample(xp.shape[0], out_f, device)
        cands = {"int8": cand.int8(lambda: int8.int8_linear(xp, w8, None, cdt), xp, w8, None, cdt, s),
                 "weight-only": cand.plain(lambda: linear(xp, wd, None, _WEIGHT_ONLY), xp,
                                           cand.weight_reference(wd, s.cols), None, s)}
        v = choice.decide(device, key, "int8 at load", cands, s, fallback="weight-only")
    return v.chosen == "int8"
