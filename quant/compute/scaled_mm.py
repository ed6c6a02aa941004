"""The scaled matmul ``(a * scale_a) @ (b * scale_b) + bias`` through whichever API this torch has a kernel for.

``torch._scaled_mm`` or ``F.scaled_mm``, probed once per device on a tiny product; the block-wise
(1x128 x 128x128) scale operands in the form the device's kernel reads right, probed once by value;
kernels without a bias epilogue or a float16 output retried without them, that need remembered per
(device, scaling, dtypes). Registered as the custom op ``fp8_engram::scaled_mm`` so that torch.compile
keeps the probes and fallbacks out of its graph. Pure torch; never imports ComfyUI.
"""

from __future__ import annotations

import logging
import sys

import torch
import torch.nn.functional as F

from ..kernels.ops import define
from ..runtime import device_key as _device_key, first_line as _first_line, is_oom as _is_oom, log_once

logger = logging.getLogger("fp8_engram.quant.compute.linear")

__all__ = ["fp8_supported", "scaled_mm_api", "blockwise_form", "blockwise_supported", "block_scale_b",
           "pad_rows", "scaled_mm", "SCALED_MM_APIS", "BLOCK_SCALE_FORMS", "ACT_DTYPE"]

ACT_DTYPE = torch.float8_e4m3fn
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


def _real_tensors():
    """The probes below run real products even when first asked while torch.compile traces (a
    fake product succeeds everywhere, and its answer is cached for the process)."""
    return torch.utils._python_dispatch._disable_current_modes()


def scaled_mm_api(device) -> str | None:
    """Name of the first scaled-matmul API with a kernel for ``device`` in this torch
    (``torch._scaled_mm`` first: on CUDA it takes every scaling the pack uses on torch 2.5 to 2.14, on the CPU
    torch 2.11 takes one scale per operand only, so a per-row call raises and runs weight-only;
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
                    a = torch.ones(16, 32, device=device).to(ACT_DTYPE)
                    b = torch.ones(16, 32, device=device).to(ACT_DTYPE).t()
                    one = torch.ones((), device=device)
                    SCALED_MM_APIS[name](a, b, one, one, None, torch.bfloat16)
                    found = name
                    break
                except Exception as exc:  # noqa: BLE001 - a missing kernel is an answer, not an error
                    errors.append(f"{name}: {type(exc).__name__}: {_first_line(exc)}")
        _api_for[key] = found
        if found is None:
            log_once(logger, ("no_scaled_mm", key), logging.INFO,
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
    a = (torch.rand(m, k, generator=g) * 4 - 2).to(ACT_DTYPE)
    b = (torch.rand(n, k, generator=g) * 4 - 2).to(ACT_DTYPE)
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
    log_once(logger, ("no_blockwise", _device_key(device)), logging.INFO,
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


# (device key, scaling kind, a dtype, b dtype, out dtype) -> what that combination needs:
# "bf16_out" (the kernel writes bfloat16 only: cast after), "bias_apart" (no bias epilogue)
_needs: dict = {}


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
    log_once(logger, ("scaled_mm_needs", key, need), logging.INFO,
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


pad_rows = _pad_rows


def _scaled_mm_impl(a, b, scale_a, scale_b, bias, out_dtype):
    return _THIS._scaled_mm(a, b, scale_a, scale_b, bias, out_dtype)  # looked up per call (tests replace it)


def _scaled_mm_fake(a, b, scale_a, scale_b, bias, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


_scaled_mm_op = define(
    "scaled_mm",
    "(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor? bias, ScalarType out_dtype) "
    "-> Tensor",
    _scaled_mm_impl, _scaled_mm_fake)


def scaled_mm(a, b, scale_a, scale_b, bias, out_dtype):
    """``_scaled_mm`` as one op, for compiled code (every device: the API it picks, and its
    fallbacks for kernels without a bias epilogue or a float16 output, run when it runs)."""
    return _scaled_mm_op(a, b, scale_a, scale_b, bias, out_dtype)


_THIS = sys.modules[__name__]
