"""comfy-kitchen's int8 linear as a path, "kitchen int8", where the ComfyUI in use brings it.

ComfyUI 0.29 and newer depend on comfy-kitchen, Comfy-Org's kernel library; for INT8 weights with one
scale per tensor or per output channel and either no rotation or ComfyUI's ConvRot (a regular Hadamard
rotation of K), stock ComfyUI runs ``comfy_kitchen.int8_linear``: per-token int8 activation, int8 GEMM,
through whichever of kitchen's backends ComfyUI enabled (its CUDA and Triton kernels on a GPU, its eager
torch code elsewhere). Offering that same call as a candidate, proven and timed like the pack's own paths,
makes the pack never slower than stock ComfyUI with kitchen on that device.

Its proof has two parts. Same math: the call against kitchen's own eager backend, in the compute dtype
(the twin) and in float32 (the reference), so a kitchen kernel 1% off fails as the pack's own would.
Same product: its output against the plain path's float64 reference must be no worse than the pack's
int8 twin's (the same per-token int8 quantization) by more than ``proof.MARGIN_DB``, so kitchen reading
a weight differently from the pack (a rotation, a scale layout) fails too, even where its eager code
agrees with its kernels.

kitchen's fp8 matmul (``scaled_mm_v2``) calls ``torch._scaled_mm``, the same cuBLASLt product the pack's
fp8 candidate runs; its NVFP4 and MXFP8 matmuls need fp4/fp8 activations on Blackwell and are not
candidates here. Imported only when present; never imports ComfyUI.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging

import torch

from ...layouts import Int8
from .. import int8, proof
from .base import Path, ref_product
from .int8 import INT8, int8_operand

logger = logging.getLogger(__name__)

__all__ = ["module", "takes", "int8_linear", "same_product", "KitchenInt8", "KITCHEN_INT8"]

_found: dict = {}


def module():
    """``comfy_kitchen`` when it imports here, else None (looked up once)."""
    if "module" not in _found:
        ck = None
        if importlib.util.find_spec("comfy_kitchen") is not None:
            try:
                ck = importlib.import_module("comfy_kitchen")
                if not callable(getattr(ck, "int8_linear", None)):
                    ck = None
            except Exception as exc:  # noqa: BLE001 - a broken install is no candidate, not an error
                logger.info("comfy-kitchen does not import here (%s: %s); its ops are no candidates", type(exc).__name__, exc)
                ck = None
        _found["module"] = ck
    return _found["module"]


def takes(w8) -> bool:
    """Whether ``comfy_kitchen.int8_linear`` computes this Int8 weight's product (its scale and rotation)."""
    layout = w8.layout
    if not isinstance(layout, Int8) or layout.cast_first or w8.transposed or w8.qdata.dim() != 2:
        return False
    return layout.rotation == 0 or layout.regular


def _args(w8) -> dict:
    rotation = w8.layout.rotation
    return {"weight_scale": w8.scale.to(torch.float32).reshape(-1), "convrot": bool(rotation),
            "convrot_groupsize": rotation or 256}


def int8_linear(x: torch.Tensor, w8, bias, out_dtype: torch.dtype) -> torch.Tensor:
    """``comfy_kitchen.int8_linear`` on an Int8 weight (``takes(w8)``), x of any rank, output in ``out_dtype``."""
    ck = module()
    return ck.int8_linear(x, w8.qdata, bias=bias, out_dtype=out_dtype, **_args(w8))


def _eager(x: torch.Tensor, w8, bias, out_dtype: torch.dtype) -> torch.Tensor:
    ck = module()
    with ck.use_backend("eager"):
        return ck.int8_linear(x, w8.qdata, bias=bias, out_dtype=out_dtype, **_args(w8))


class KitchenInt8(Path):
    """Its proof has two parts (module docstring): kitchen's own eager backend as twin and reference, and
    ``agrees``: no worse against the weight's own product than the pack's int8 twin by ``proof.MARGIN_DB``."""

    name = "kitchen int8"

    def operand(self, w, cfg, device, cdt):
        # the int8 weights of files, as they are: the pack's own conversions are rotated as kitchen does not rotate
        if cfg.path != "auto" or module() is None or not int8.is_int8(w):
            return None
        w8 = int8_operand(w, cfg, device)
        return w8 if w8 is not None and takes(w8) else None

    def kind(self, w8, cfg) -> str:
        return "int8"

    def run(self, x2d, w8, bias, cdt, cfg=None, *, op: bool = False):
        return int8_linear(x2d.to(cdt), w8, None if bias is None else bias.to(cdt), cdt)

    def check(self, x2d, w8, bias, cdt, cfg, sample, wref):
        xr = x2d.index_select(0, sample.rows)
        pack_twin = INT8.check(x2d, w8, bias, cdt, cfg, sample, wref)[0]
        rdt = proof.reference_dtype(x2d.device)

        def cols(out: torch.Tensor) -> torch.Tensor:
            return out.index_select(1, sample.cols)

        b = None if bias is None else bias.to(cdt)
        return (lambda: cols(_eager(xr, w8, b, cdt)), lambda: cols(_eager(xr, w8, b, torch.float32)),
                same_product(xr, wref, bias, sample, rdt, pack_twin, "the pack's int8"))


def same_product(xr, wref, bias, sample, rdt, baseline, who: str):
    """A proof's ``agrees``: the output against the weight's own dequantized product (``ref_product``) no worse
    than ``baseline()``'s (``who``: an implementation of the same product known to read the weight right) by
    more than ``proof.MARGIN_DB``, so a kernel reading the weight differently fails even where its own eager
    code agrees with it."""
    def agrees(got: torch.Tensor) -> str | None:
        ref = ref_product(xr, wref(), bias, sample, rdt)
        mine, theirs = proof.sqnr_db(baseline(), ref), proof.sqnr_db(got, ref)
        need = min(mine, proof.CEILING_DB) - proof.MARGIN_DB
        if theirs >= need:
            return None
        return (f"computes another product than the weight's: {theirs:.1f} dB against the dequantized weight's, "
                f"{who} {mine:.1f} dB (needs {need:.1f})")
    return agrees


KITCHEN_INT8 = KitchenInt8()
