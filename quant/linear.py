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

The scaled matmul is whichever API has a kernel for the device in the installed torch
(``torch._scaled_mm`` or ``F.scaled_mm``), probed once per device on a tiny product.
The choice is made per call from ``config`` (argument) or ``weight.config`` (per model).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from . import custom_ops, int8, kernels, nvfp4
from .config import DEFAULT_CONFIG, ComputeConfig
from .layouts import Block, PerRow, PerTensor, QuantizationError, tracing, workspace
from .nvfp4 import NVFP4
from .tensor import QuantizedTensor, log_once

logger = logging.getLogger(__name__)

__all__ = ["linear", "fp8_supported", "scaled_mm_api", "blockwise_supported"]

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


# ---------------------------------------------------------------------------------------------
# the scaled matmul, whichever API this torch has a kernel for
# ---------------------------------------------------------------------------------------------


def _call_private(a, b, sa, sb, bias, out_dtype):
    out = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, bias=bias, out_dtype=out_dtype)
    return out[0] if isinstance(out, tuple) else out  # torch < 2.5 returned (out, amax)


def _recipe_a(scale: torch.Tensor):
    st = F.ScalingType
    if scale.numel() == 1:
        return st.TensorWise
    # [M, 1] row scales are contiguous; 1x128 group scales are M-major (stride (1, M)), which
    # tells them apart even when K is one group wide
    if scale.shape[-1] == 1 and (scale.stride(-1) == 1 or scale.shape[0] == 1):
        return st.RowWise
    return st.BlockWise1x128


def _recipe_b(scale: torch.Tensor, n: int):
    st = F.ScalingType
    if scale.numel() == 1:
        return st.TensorWise
    if scale.shape[0] == 1 and scale.shape[-1] == n:
        return st.RowWise
    return st.BlockWise128x128


def _call_public(a, b, sa, sb, bias, out_dtype):
    return F.scaled_mm(a, b, sa, _recipe_a(sa), sb, _recipe_b(sb, b.shape[1]), bias=bias,
                       output_dtype=out_dtype)


SCALED_MM_APIS = {"torch._scaled_mm": _call_private, "F.scaled_mm": _call_public}
_api_for: dict = {}
_MISSING = object()
_blockwise_for: dict = {}


def _present_apis() -> list:
    names = []
    if hasattr(torch, "_scaled_mm"):
        names.append("torch._scaled_mm")
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        names.append("F.scaled_mm")
    return names


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:160] if text else ""


def _device_key(device: torch.device):
    device = torch.device(device)
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return device.type, index


def _traced(path: str, device: torch.device) -> bool:
    """True while torch.compile traces; says so once per path and device type."""
    if not tracing():
        return False
    log_once(("traced", path, device.type), logging.INFO,
             "torch.compile is tracing FP8 linears (%s path on %s) into its graph", path, device.type)
    return True


def _real_tensors():
    """The probes below run real products even when first asked while torch.compile traces (a
    fake product succeeds everywhere, and its answer is cached for the process)."""
    return torch.utils._python_dispatch._disable_current_modes()


def scaled_mm_api(device) -> str | None:
    """Name of the first scaled-matmul API with a kernel for ``device`` in this torch
    (``torch._scaled_mm`` first: it takes every scaling the pack uses on torch 2.5 to 2.14;
    ``F.scaled_mm`` exists from 2.10 but e.g. 2.11 has no CPU kernel for it), or None."""
    hit = _api_for.get(device, _MISSING)  # fast path: a tensor's own device object
    if hit is not _MISSING:
        return hit
    key = _device_key(device)
    if key not in _api_for:
        found, errors = None, []
        with torch.no_grad(), _real_tensors():
            for name in _present_apis():
                try:
                    a = torch.ones(16, 32, device=device).to(_ACT_DTYPE)
                    b = torch.ones(16, 32, device=device).to(_ACT_DTYPE).t()
                    one = torch.ones((), device=device)
                    SCALED_MM_APIS[name](a, b, one, one, None, torch.bfloat16)
                    found = name
                    break
                except Exception as exc:  # noqa: BLE001 - a missing kernel is an answer, not an error
                    errors.append(f"{name}: {type(exc).__name__}: {_first_line(exc)}")
        _api_for[key] = found
        if found is None:
            log_once(("no_scaled_mm", key), logging.INFO,
                     "no scaled matmul has a kernel for %s in torch %s (%s)", torch.device(device),
                     torch.__version__, "; ".join(errors) or "none present")
    if isinstance(device, torch.device) and (device.type != "cuda" or device.index is not None):
        _api_for[device] = _api_for[key]  # names one device exactly: the fast-path key
    return _api_for[key]


# Forms of the scale operands that a block-wise scaled matmul may want. torch's shape checks
# accept all of them, but what cuBLASLt reads differs by version (some block-wise paths want the
# K-blocks padded to a multiple of 4), and a mismatch gives wrong numbers, not an error: the probe
# below picks by value, once per device.
#   activation side (1x128 groups, [M, K/128], M-major): "m_major" as is, "m_padded" with the
#     row stride padded to a multiple of 4
#   weight side (128x128 blocks, [K/128, N/128]): "transposed" (the stored [N/128, K/128] scale,
#     transposed: no copy), "k_padded" (K-blocks padded to a multiple of 4), "contiguous"
BLOCK_SCALE_FORMS = (("m_major", "transposed"), ("m_major", "k_padded"),
                     ("m_padded", "k_padded"), ("m_major", "contiguous"))
# probe shape: (K/128) % 4 != 0 and N > 128, as in real layers (K = 3840, 8960, 13824 ...), and
# M % 4 != 0
_PROBE_M, _PROBE_N, _PROBE_K = 77, 384, 640


def _ceil4(v: int) -> int:
    return -(-v // 4) * 4


def block_scale_b(scale: torch.Tensor, form: str) -> torch.Tensor:
    """A weight's stored [N/128, K/128] float32 block scale as the matmul's [K/128, N/128] operand."""
    if form == "transposed":
        return scale.t()
    if form == "contiguous":
        return scale.t().contiguous()
    nb, kb = scale.shape
    padded = torch.ones((nb, _ceil4(kb)), dtype=torch.float32, device=scale.device)
    padded[:, :kb] = scale
    return padded[:, :kb].t()


def _probe_block_forms(api: str, device) -> tuple | None:
    """The first form whose product equals the dequantized product at the probe shape."""
    g = torch.Generator().manual_seed(0)
    m, n, k = _PROBE_M, _PROBE_N, _PROBE_K
    kb = k // 128
    a = (torch.rand(m, k, generator=g) * 4 - 2).to(_ACT_DTYPE)
    b = (torch.rand(n, k, generator=g) * 4 - 2).to(_ACT_DTYPE)
    # powers of two from 1/16 to 16, different in every block: a scale read from the wrong place
    # changes the product by far more than bf16 rounding
    sa = torch.exp2(torch.randint(-4, 5, (m, kb), generator=g).float())
    sb = torch.exp2(torch.randint(-4, 5, (n // 128, kb), generator=g).float())
    ref = (a.float() * sa.repeat_interleave(128, 1)) @ (
        b.float() * sb.repeat_interleave(128, 0).repeat_interleave(128, 1)).t()
    a, b, sa, sb = (t.to(device) for t in (a, b, sa, sb))
    tried = []
    for a_form, b_form in BLOCK_SCALE_FORMS:
        try:
            sa_op = _pad_rows(sa, 4) if a_form == "m_padded" else sa.t().contiguous().t()
            out = SCALED_MM_APIS[api](a, b.t(), sa_op, block_scale_b(sb, b_form), None,
                                      torch.bfloat16)
            err = ((out.float().cpu() - ref).norm() / ref.norm()).item()
            tried.append(f"{a_form}/{b_form}: relative error {err:.3g}")
            if err < 1e-2:  # bf16 output: ~3e-3
                return a_form, b_form
        except Exception as exc:  # noqa: BLE001 - a form the kernel refuses is an answer
            tried.append(f"{a_form}/{b_form}: {type(exc).__name__}: {_first_line(exc)}")
    log_once(("no_blockwise", _device_key(device)), logging.INFO,
             "block-wise scaled matmul unavailable or wrong on %s (%s); 128x128 block weights run "
             "weight-only there", torch.device(device), "; ".join(tried) or "nothing tried")
    return None


def _pad_rows(scale_mk: torch.Tensor, multiple: int) -> torch.Tensor:
    """[M, G] group scales as an M-major operand whose row stride is padded to ``multiple``."""
    m, gcount = scale_mk.shape
    buf = torch.ones((gcount, -(-m // multiple) * multiple), dtype=torch.float32,
                     device=scale_mk.device)
    buf[:, :m] = scale_mk.t()
    return buf[:, :m].t()


def blockwise_form(device) -> tuple | None:
    """(activation form, weight form) of block scales that this torch's scaled matmul computes
    right on ``device`` (cuBLAS 12.9+ on Hopper), or None. Probed once per device by value."""
    key = _device_key(device)
    if key not in _blockwise_for:
        api = scaled_mm_api(device)
        form = None
        if api is not None:
            with torch.no_grad(), _real_tensors():
                form = _probe_block_forms(api, device)
        _blockwise_for[key] = form
    return _blockwise_for[key]


def blockwise_supported(device) -> bool:
    """Does this torch's scaled matmul compute 1x128 x 128x128 block scales right on ``device``?"""
    return blockwise_form(device) is not None


# ---------------------------------------------------------------------------------------------
# failures, remembered per (device, scaling, dtypes)
# ---------------------------------------------------------------------------------------------

# (device key, scaling kind, a dtype, b dtype, out dtype) -> what that combination needs:
# "bf16_out" (the kernel writes bfloat16 only: cast after), "bias_apart" (no bias epilogue)
_needs: dict = {}
# fp8 products that failed for a reason other than memory, per (device key, layout kind,
# activation scaling, input dtype, weight dtype, output dtype): later calls go weight-only at once
_fp8_failed: set = set()
# int8 products that failed likewise, per (device key, int8 layout, input dtype, output dtype): a kernel
# that cannot compile or launch there would otherwise be retried (and recompiled) on every call
_int8_failed: set = set()
# fused weight-only GEMMs that failed likewise, per (device key, scale blocks, weight dtype, compute dtype)
_wo_failed: set = set()


def _is_oom(exc: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None)
    return (oom is not None and isinstance(exc, oom)) or "out of memory" in str(exc).lower()


def _remember_failure(failed: set, key, exc: BaseException, what: str, device, kind: str) -> None:
    """A product of `key`'s kind failed: remember it in `failed` (later calls take the fallback without
    trying), logged once. Out of memory is never remembered: that call alone falls back."""
    if _is_oom(exc):
        log_once((what, "oom", key), logging.WARNING, "%s ran out of memory on %s; this call runs weight-only "
                 "(later calls try it again; logged once)", what, device)
        return
    failed.add(key)
    log_once((what, "failed", key), logging.WARNING, "%s failed on %s for %s (%s: %s); these run weight-only "
             "from now on (logged once)", what, device, kind, type(exc).__name__, _first_line(exc))


def _scaling_kind(scale_a: torch.Tensor, scale_b: torch.Tensor) -> str:
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        return "tensor"
    if scale_b.shape[0] == 1 or scale_b.numel() == 1:
        return "row"
    return "block"


def _remember(key, need: str) -> None:
    _needs.setdefault(key, set()).add(need)
    what = {"bf16_out": "writes bfloat16 only (the output is cast after)",
            "bias_apart": "has no bias epilogue (the bias is added after)"}[need]
    log_once(("scaled_mm_needs", key, need), logging.INFO,
             "scaled matmul on %s:%s, %s scaling, %s x %s -> %s %s", key[0][0], key[0][1], key[1],
             key[2], key[3], key[4], what)


def _scaled_mm(a, b, scale_a, scale_b, bias, out_dtype):
    """``(a * scale_a) @ (b * scale_b) + bias`` in ``out_dtype`` through the device's API.
    The bias goes into the matmul itself where it can (bf16/fp16 output of the same dtype).
    A kernel that refuses the output dtype or the bias is retried without it, and that need is
    remembered for this (device, scaling, dtypes) only; an out-of-memory error is raised as is
    and remembered nowhere."""
    api = scaled_mm_api(a.device)
    if api is None:
        raise RuntimeError(f"no scaled matmul has a kernel for {a.device} in torch {torch.__version__}")
    fn = SCALED_MM_APIS[api]
    fused_bias = bias is not None and out_dtype in (torch.bfloat16, torch.float16) \
        and bias.dtype == out_dtype
    key = (_device_key(a.device), _scaling_kind(scale_a, scale_b), a.dtype, b.dtype, out_dtype)
    needs = _needs.get(key, ())
    if "bf16_out" in needs:
        return _bf16_then_cast(fn, a, b, scale_a, scale_b, bias, out_dtype)
    if fused_bias and "bias_apart" in needs:
        fused_bias = False
    try:
        out = fn(a, b, scale_a, scale_b, bias if fused_bias else None, out_dtype)
    except RuntimeError as exc:
        if _is_oom(exc):
            raise
        if key[1] != "tensor" and out_dtype != torch.bfloat16:
            # older row-wise kernels (CUTLASS, before cuBLAS 12.9) write bfloat16 only
            out = _bf16_then_cast(fn, a, b, scale_a, scale_b, bias, out_dtype)
            _remember(key, "bf16_out")
            return out
        if not fused_bias:
            raise
        # a kernel without a bias epilogue for this scaling: add the bias after the product
        out = fn(a, b, scale_a, scale_b, None, out_dtype)
        _remember(key, "bias_apart")
        fused_bias = False
    if bias is not None and not fused_bias:
        out = out + bias.to(out.dtype)
    return out


def _bf16_then_cast(fn, a, b, scale_a, scale_b, bias, out_dtype):
    bb = None if bias is None else bias.to(torch.bfloat16)
    return fn(a, b, scale_a, scale_b, bb, torch.bfloat16).to(out_dtype)


# ---------------------------------------------------------------------------------------------
# the fp8 x fp8 path
# ---------------------------------------------------------------------------------------------


def _is_block128(layout) -> bool:
    return isinstance(layout, Block) and (layout.rows, layout.cols) == (128, 128)


def _wants_fp8(x: torch.Tensor, w: QuantizedTensor, cfg: ComputeConfig) -> bool:
    layout = w.layout
    if cfg.path == "weight_only" or x.numel() == 0:
        return False
    out_f, in_f = w.qdata.shape
    if isinstance(layout, (PerTensor, PerRow)):
        fits = True
    elif _is_block128(layout):
        fits = in_f % 128 == 0 and out_f % 128 == 0 and blockwise_supported(x.device)
    else:
        fits = False  # other block shapes (musubi 1x64, ...) and any other layout: weight-only
    if cfg.path == "fp8":
        return fits
    # cuBLASLt FP8 needs both matrix dims divisible by 16; skip quietly instead of failing.
    return fits and fp8_supported(x.device) and in_f % 16 == 0 and out_f % 16 == 0


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
    if isinstance(w.layout, PerRow):
        return w.scale.reshape(1, n)  # a view: [N, 1] is already laid out as [1, N]
    return _cached_on_weight(w, "row_scale",
                             lambda: w.scale.reshape(1, 1).expand(1, n).contiguous())


def _failure_key(x: torch.Tensor, w: QuantizedTensor, cfg: ComputeConfig, out_dtype):
    layout = w.layout
    kind = (layout.rows, layout.cols) if isinstance(layout, Block) else type(layout).__name__
    return (_device_key(x.device), kind, _scaling_mode(w, cfg), x.dtype, w.qdata.dtype, out_dtype)


def _block_weight_scale(w: QuantizedTensor, form: str) -> torch.Tensor:
    """The weight's block scale in the form the device's matmul reads right, made once per
    weight (padding included) and kept on it, never per call."""
    if form == "transposed":
        return w.scale.t()  # a view
    return _cached_on_weight(w, "block_scale_" + form, lambda: block_scale_b(w.scale, form))


def _fp8_mm(x2d: torch.Tensor, w: QuantizedTensor, cfg: ComputeConfig, out_dtype,
            bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """fp8 x fp8 product ``x2d @ W.T (+ bias)``, or None after a logged failure. A failure other
    than out-of-memory is remembered for its (device, layout, scaling, dtypes): later calls of
    that kind go weight-only without trying (see ``_fp8_failed``)."""
    try:
        layout, k = w.layout, (custom_ops if _traced("fp8", x2d.device) else kernels)
        if _is_block128(layout):
            a_form, b_form = blockwise_form(x2d.device)
            xq, sa = k.quantize_groups(x2d, _ACT_DTYPE)
            if a_form == "m_padded":
                sa = _pad_rows(sa, 4)
            sb = _block_weight_scale(w, b_form)
        else:
            mode = _scaling_mode(w, cfg)
            if mode == "dynamic_row":
                xq, sa = k.quantize_rows(x2d, _ACT_DTYPE)
                sb = _row_weight_scale(w)
            else:
                xq, sa = k.quantize_tensor(
                    x2d, w.input_scale if mode == "static" else None, _ACT_DTYPE)
                if isinstance(layout, PerRow):  # row-wise weight: both operands row-wise
                    sa = sa.reshape(1, 1).expand(x2d.shape[0], 1).contiguous()
                    sb = _row_weight_scale(w)
                else:
                    sb = w.scale.reshape(())
        mm = custom_ops.scaled_mm if k is custom_ops else _scaled_mm
        return mm(xq, w.qdata.t(), sa, sb, bias, out_dtype)
    except Exception as exc:  # a kernel that cannot run here must not break the model
        key = _failure_key(x2d, w, cfg, out_dtype)
        _remember_failure(_fp8_failed, key, exc, "fp8 x fp8 linear", x2d.device,
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


def _dequantized_weight(x, w: QuantizedTensor, bias, cdt) -> torch.Tensor:
    """W in ``cdt`` for one weight-only product. On the CPU, when autograd will not keep the
    weight, it goes into this thread's reusable buffer instead of fresh memory: a model that
    dequantizes every layer on every step otherwise pays for its whole full-precision size in
    page faults per step (see ``layouts.workspace``). The buffer is dead once F.linear returns."""
    keeps_weight = torch.is_grad_enabled() and (
        x.requires_grad or (bias is not None and bias.requires_grad))
    if (w.qdata.device.type != "cpu" or keeps_weight or w.transposed
            or _traced("weight-only", x.device)):
        return w.dequantize(cdt)
    buf = workspace("weight_only", w.qdata.numel(), cdt).view(w.qdata.shape)
    return w.layout.dequantize(w.qdata, w.scale, cdt, out=buf)


def _kernel_block(w: QuantizedTensor):
    """(block shape, per_tensor) for the kernels, or None for a layout they do not know."""
    layout, (n, k) = w.layout, w.qdata.shape
    if isinstance(layout, PerTensor):
        return (n, k), True
    if isinstance(layout, PerRow):
        return (1, k), False
    if isinstance(layout, Block):
        return (layout.rows, layout.cols), False
    return None


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
                _wo_failed and _wo_key(x, w, block, cdt) in _wo_failed):
            out_f, in_f = w.qdata.shape
            # custom ops while torch.compile traces
            k = custom_ops if _traced("weight-only", x.device) else kernels
            try:
                y = k.weight_only_linear(
                    x.reshape(-1, in_f), w.qdata, w.scale, block[0], block[1], bias)
                return y.reshape(*x.shape[:-1], out_f)
            except Exception as exc:  # a GEMM kernel that cannot run on this GPU: dequantize + cuBLAS
                if k is custom_ops or _is_oom(exc):
                    raise
                key = _wo_key(x, w, block, cdt)
                _wo_failed.add(key)
                log_once(("wo_failed", key), logging.WARNING,
                         "weight-only FP8 GEMM failed on %s (%s: %s); these layers dequantize and use cuBLAS from now "
                         "on (logged once)", x.device, type(exc).__name__, _first_line(exc))
    return F.linear(x, _dequantized_weight(x, w, bias, cdt), bias)


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
        return w if cfg.path != "auto" or int8.int8_fast(x.device) else None
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
    if isinstance(weight.layout, NVFP4):  # packed 4-bit weights: weight-only everywhere (nvfp4.py)
        return nvfp4.weight_only_linear(x, weight, bias, _compute_dtype(x, cfg))
    out_f, in_f = weight.qdata.shape
    if x.dim() == 0 or x.shape[-1] != in_f:
        raise QuantizationError(
            f"linear: input of shape {list(x.shape)} does not fit a weight of shape "
            f"[{out_f}, {in_f}] (last input dim must be {in_f})"
        )
    cdt = _compute_dtype(x, cfg)
    w8 = _int8_weight(x, weight, bias, cfg)
    if w8 is not None:
        b = None if bias is None else bias.to(cdt)
        if _int8_failed and (_device_key(x.device), w8.layout, x.dtype, cdt) in _int8_failed:
            return _weight_only(x, w8, b, cdt)
        try:
            return int8.int8_linear(x, w8, b, cdt)
        except Exception as exc:  # a kernel that cannot run here must not break the model
            _remember_failure(_int8_failed, (_device_key(x.device), w8.layout, x.dtype, cdt), exc, "int8 linear",
                              x.device, f"{w8.layout} weights, {x.dtype} -> {cdt}")
            return _weight_only(x, w8, b, cdt)
    if not _wants_fp8(x, weight, cfg) or (
            _fp8_failed and _failure_key(x, weight, cfg, cdt) in _fp8_failed):
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
