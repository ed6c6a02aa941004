"""comfy-kitchen's int4 linears as paths, "kitchen awq" and "kitchen svdquant", where kitchen's CUDA backend runs them.

The pack reads comfy-kitchen 0.2.40's AWQ W4A16 and SVDQuant W4A4 (tile-packed) layers bit-exactly and, by
itself, runs them weight-only (dequantize, then ``F.linear``). Where the ComfyUI in use brings comfy-kitchen,
these paths offer kitchen's own products as candidates, proven and timed against weight-only like every path:

    "kitchen awq"       ``comfy_kitchen.gemv_awq_w4a16``: the int4 weight times the 16-bit activation in one
                        kernel (kitchen's GEMV / MMA kernels up to 256 tokens, its dequantize + cuBLAS above)
    "kitchen svdquant"  ``comfy_kitchen.quantize_svdquant_w4a4`` then ``comfy_kitchen.scaled_mm_svdquant_w4a4``:
                        the activation smoothed and quantized to 4 bits per 64 inputs, an int4 x int4 GEMM, the
                        low-rank branch and the bias (what kitchen's ``TensorCoreSVDQuantW4A4Layout`` runs)

Only on CUDA devices, only where kitchen's registry has its CUDA backend enabled with the op (``fast_here``):
elsewhere kitchen's public ops run its eager backend, which is the weight-only path's own math (dequantize,
then matmul; SVDQuant's adds a 4-bit rounding of the activation), so proving it on the CPU would cost every
first use of such a layer a proof and timing rounds for a candidate that cannot be faster. A CPU never
proves them. A weight is an operand only in the form kitchen's kernels take: AWQ with bfloat16 or float16
scales in the compute dtype; SVDQuant tile-packed throughout (weight, ``weight_scale``, ``proj_up``), its parts
in the compute dtype (bfloat16 or float16), for SVDQuant a GPU of compute capability 8.0 or newer.

Proofs (``check`` -> twin, reference, agrees):
- AWQ: twin kitchen's eager ``gemv_awq_w4a16`` in the compute dtype (its kernels' math: the weight formed in
  the scales' dtype), reference the same eager code in float32 (activation, scales, zero points and bias cast
  to float32: the weight formed in float32); ``agrees``: against the weight's own dequantized product
  (``ref_product``, float64 on the CPU) no worse than the eager twin by more than ``proof.MARGIN_DB``.
- SVDQuant: the activation's 4-bit rounding is the op under proof's own (kitchen's kernels and its eager code
  do not round alike: kitchen says its eager code is no bit-parity oracle), so the GEMM is proven on the codes
  kitchen's quantizer gives for the sampled rows (rerun on them: per-row, deterministic): twin kitchen's eager
  ``scaled_mm_svdquant_w4a4`` in the compute dtype, reference the same in float32, both with kitchen's eager
  low-rank activation (float32). A GEMM 1% off, or wrong on one row, fails there. The quantizer is proven by
  ``agrees``: the product against the weight's own dequantized product (the effective weight, ``ref_product``)
  must be no worse than kitchen's whole eager product in the compute dtype (its own quantizer and GEMM) on the
  same rows by more than ``proof.MARGIN_DB`` (3 dB: twice the error power). At 4-bit activations that eager
  product is far from the float product (16 dB on the proof's seeded activation with its 30x outlier channels,
  17-23 dB on plain normal ones), so the bar sits there, not at the twin's; a quantizer that forgets the
  smoothing measures 7 dB against it (tests/unit/test_kitchen_int4_candidates.py). The GEMM's twin measures
  ~49 dB against its float32 reference, AWQ's ~50 dB; made 1% off, either measures ~40 dB and fails.
``act_unsigned`` layers (post-GELU): kitchen shifts the activation by 0.171875 before the 4-bit branch and
adds the shift's product itself; the pack's loader folded that constant into the layer's bias, so kitchen is
given the bias without it.

Imported only when present (``kitchen.module``); never imports ComfyUI.
"""

from __future__ import annotations

import torch

from ...layouts.awq import is_awq
from ...layouts.svdquant import UNSIGNED_SHIFT, is_svdquant
from .. import proof
from .base import Path, cached_on_weight
from .kitchen import module, same_product

__all__ = ["fast_here", "awq_takes", "svdquant_takes", "awq_linear", "svdquant_quantize", "svdquant_mm",
           "svdquant_linear", "KitchenAWQ", "KitchenSVDQuant", "KITCHEN_AWQ", "KITCHEN_SVDQUANT"]

HALF = (torch.bfloat16, torch.float16)
AWQ_OP = "gemv_awq_w4a16"
SVDQ_OPS = ("quantize_svdquant_w4a4", "scaled_mm_svdquant_w4a4")


def fast_here(ops: tuple, device, min_capability: tuple = (0, 0)) -> bool:
    """Whether kitchen's public ``ops`` run its CUDA kernels on ``device``: a CUDA device of at least
    ``min_capability``, kitchen's CUDA backend registered, enabled, and capable of each op (the module docstring
    says why nothing else is a candidate)."""
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < min_capability:
        return False
    ck = module()
    if ck is None or not all(callable(getattr(ck, op, None)) for op in ops):
        return False
    try:
        cuda = ck.list_backends().get("cuda") or {}
    except Exception:  # noqa: BLE001 - a kitchen without this API is no candidate
        return False
    return bool(cuda.get("available")) and not cuda.get("disabled") and set(ops) <= set(cuda.get("capabilities", ()))


def awq_takes(w, cdt) -> bool:
    """Whether ``gemv_awq_w4a16``'s kernels take this AWQ weight at compute dtype ``cdt``."""
    return is_awq(w) and not w.transposed and w.layout.scale_dtype in HALF and w.layout.scale_dtype == cdt


def svdquant_takes(w, cdt) -> bool:
    """Whether kitchen's SVDQuant kernels take this weight at ``cdt``: tile-packed weight, scales and proj_up,
    every part in ``cdt`` (bfloat16 or float16)."""
    if not is_svdquant(w) or w.transposed or cdt not in HALF or not w.layout.tiled:
        return False
    dims = {name: len(shape) for name, _, shape in w.layout.parts}
    return dims["weight_scale"] == 3 and dims["proj_up"] == 3 and all(dt == cdt for _, dt, _ in w.layout.parts)


def _awq_parts(w):
    lay = w.layout
    return w.qdata.reshape(lay.rows, lay.cols // 2), w.scale[0], w.scale[1], lay.group


def awq_linear(x: torch.Tensor, w, bias, cdt: torch.dtype) -> torch.Tensor:
    """``comfy_kitchen.gemv_awq_w4a16`` on an AWQ weight (``awq_takes``), output in ``cdt``."""
    q, s, z, group = _awq_parts(w)
    return module().gemv_awq_w4a16(x.to(cdt), q, s, z, bias=bias, group_size=group)


def _svdq_parts(w) -> dict:
    """The weight's parts as kitchen takes them (views of its bytes; a part whose address is not 16-byte
    aligned is copied once and kept on the weight)."""
    def build():
        parts = w.layout.split(w.scale)
        return {k: (t if t.data_ptr() % 16 == 0 else t.clone()) for k, t in parts.items()}
    return cached_on_weight(w, "kitchen svdquant parts", build)


def _unshifted(w, bias, cdt):
    if not w.layout.act_unsigned:
        return bias
    shift = cached_on_weight(w, "kitchen svdquant shift", lambda: w.layout.shift_bias(w.qdata, w.scale))
    return ((0.0 if bias is None else bias.float()) - shift).to(cdt)


def _svdq_bias(w, bias, cdt):
    """The bias kitchen adds: the layer's, less the act_unsigned constant the loader folded into it."""
    return _unshifted(w, bias, cdt)


def _quantize(x: torch.Tensor, w, parts: dict):
    if w.layout.act_unsigned:
        main, lora_x = (x + UNSIGNED_SHIFT).contiguous(), x
    else:
        main, lora_x = x, None
    return module().quantize_svdquant_w4a4(main, smooth=parts["smooth_factor"], lora_down=parts["proj_down"],
                                          act_unsigned=w.layout.act_unsigned, lora_x=lora_x)


def svdquant_quantize(x: torch.Tensor, w, parts: dict):
    """kitchen's activation quantizer on ``x`` (2-D, the compute dtype): (codes, scales, low-rank activation),
    padded as kitchen pads them."""
    return _quantize(x, w, parts)


def svdquant_mm(codes, ascales, lora, w, parts: dict, bias) -> torch.Tensor:
    """kitchen's W4A4 GEMM (with the low-rank branch and ``bias``) on quantized activations."""
    return module().scaled_mm_svdquant_w4a4(codes, w.qdata, ascales, parts["weight_scale"], lora, parts["proj_up"],
                                            bias=bias, act_unsigned=w.layout.act_unsigned)


def svdquant_linear(x: torch.Tensor, w, bias, cdt: torch.dtype) -> torch.Tensor:
    """kitchen's SVDQuant W4A4 product of a 2-D ``x`` (``svdquant_takes``), output in ``cdt``."""
    m = x.shape[0]
    x = x.to(cdt).contiguous()
    parts = _svdq_parts(w)
    codes, ascales, lora = svdquant_quantize(x, w, parts)
    return svdquant_mm(codes, ascales, lora, w, parts, _svdq_bias(w, bias, cdt))[:m]


class KitchenAWQ(Path):
    """``comfy_kitchen.gemv_awq_w4a16`` on AWQ W4A16 weights, CUDA only (module docstring)."""

    name = "kitchen awq"

    def operand(self, w, cfg, device, cdt):
        if cfg.path != "auto" or not awq_takes(w, cdt) or not fast_here((AWQ_OP,), device):
            return None
        return w

    def kind(self, w, cfg) -> str:
        return "awq"

    def run(self, x2d, w, bias, cdt, cfg=None, *, op: bool = False):
        return awq_linear(x2d, w, None if bias is None else bias.to(cdt), cdt)

    def check(self, x2d, w, bias, cdt, cfg, sample, wref):
        xr = x2d.index_select(0, sample.rows)
        rdt = proof.reference_dtype(x2d.device)
        q, s, z, group = _awq_parts(w)
        cols = sample.cols
        # kitchen's eager code on the sampled outputs only (its rows of the weight, scales and zero points)
        q, s, z = q.index_select(0, cols), s.index_select(1, cols), z.index_select(1, cols)
        b = None if bias is None else bias.index_select(0, cols)

        def eager(dtype):
            with module().use_backend("eager"):
                return module().gemv_awq_w4a16(xr.to(dtype), q, s.to(dtype), z.to(dtype),
                                               bias=None if b is None else b.to(dtype), group_size=group)

        twin = lambda: eager(cdt)  # noqa: E731
        agrees = same_product(xr, wref, bias, sample, rdt, twin, "kitchen's eager gemv_awq_w4a16")
        return twin, lambda: eager(torch.float32), agrees


class KitchenSVDQuant(Path):
    """kitchen's SVDQuant W4A4 quantizer and GEMM on tile-packed weights, CUDA only (module docstring)."""

    name = "kitchen svdquant"

    def operand(self, w, cfg, device, cdt):
        # kitchen's int4 MMA needs compute capability 8.0 (Ampere) or newer
        if cfg.path != "auto" or not svdquant_takes(w, cdt) or not fast_here(SVDQ_OPS, device, (8, 0)):
            return None
        return w

    def kind(self, w, cfg) -> str:
        return "svdquant"

    def run(self, x2d, w, bias, cdt, cfg=None, *, op: bool = False):
        return svdquant_linear(x2d, w, None if bias is None else bias.to(cdt), cdt)

    def check(self, x2d, w, bias, cdt, cfg, sample, wref):
        ck = module()
        m = len(sample.rows)
        x_rows = x2d.index_select(0, sample.rows)
        xr = x_rows.to(cdt).contiguous()
        rdt = proof.reference_dtype(x2d.device)
        parts = _svdq_parts(w)
        kb = _unshifted(w, bias, cdt)  # the eager products' own, never the op under proof's
        # the sampled outputs' columns of the weight in kitchen's natural form (the same bytes, untiled)
        packed, ws, _smooth, _down, up = w.layout.natural(w.qdata, w.scale, unpack=False)
        cols = sample.cols
        packed, ws, up = packed.index_select(0, cols), ws.index_select(1, cols), up.index_select(0, cols)
        kb = None if kb is None else kb.index_select(0, cols)
        memo: dict = {}

        def codes():  # the op under proof's own 4-bit activation, on the sampled rows
            if "codes" not in memo:
                q, a, _ = svdquant_quantize(xr, w, parts)
                with ck.use_backend("eager"):
                    _, _, lora = _quantize(xr, w, parts)  # kitchen's eager low-rank activation (float32)
                # copies: kitchen's CUDA quantizer returns buffers it reuses for the next call of this shape
                memo["codes"] = (q[:m].clone(), a[:, :m].clone(), lora[:m])
            return memo["codes"]

        def eager_mm(q, a, lora, dtype):
            with ck.use_backend("eager"):
                return ck.scaled_mm_svdquant_w4a4(q, packed, a.to(dtype), ws.to(dtype), lora, up.to(dtype),
                                                  bias=None if kb is None else kb.to(dtype),
                                                  act_unsigned=w.layout.act_unsigned)

        def eager_product():  # kitchen's whole eager product: its own quantizer, then its GEMM
            with ck.use_backend("eager"):
                q, a, lora = _quantize(xr, w, parts)  # kitchen's eager code itself, never the op under proof
            return eager_mm(q[:m], a[:, :m], lora[:m], cdt)

        return (lambda: eager_mm(*codes(), cdt), lambda: eager_mm(*codes(), torch.float32),
                same_product(x_rows, wref, bias, sample, rdt, eager_product, "kitchen's eager W4A4 product"))


KITCHEN_AWQ = KitchenAWQ()
KITCHEN_SVDQUANT = KitchenSVDQuant()
