"""The plain path, "weight-only": W dequantized into the compute dtype, then ``F.linear`` (stock ComfyUI's math).

Every weight can take it; it is what every other path is proven and timed against, and what a call
falls back to. On the CPU, where autograd will not keep the weight, W is dequantized into this thread's
reusable buffer (a model that dequantizes every layer each step otherwise pays its full-precision size
in page faults per step; ``runtime.workspace``). The pack's own rotated int8 weights multiply the rotated
activation by the weight as stored when the activation has fewer rows than W (rotating the fewer rows).
Pure torch; never imports ComfyUI.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...layouts.int8 import rotate
from ...runtime import tracing, workspace
from .base import Path

__all__ = ["WeightOnly", "WEIGHT_ONLY", "rotates_activation", "rotation_macs"]


def _is_int8(w) -> bool:
    return w.layout.family == "int8"


def rotates_activation(w, m: int) -> bool:
    """Whether weight-only multiplies an ``m``-row activation, rotated, by this int8 weight as stored: the
    pack's own rotation (not ComfyUI's, whose dequantization stays as ComfyUI's) and fewer rows than W."""
    layout = w.layout
    return (_is_int8(w) and bool(layout.rotation) and not layout.regular and not layout.cast_first
            and m < w.qdata.shape[0] and not w.transposed)


def rotation_macs(w, m: int) -> int:
    """Multiply-adds the weight-only path spends rotating a rotated int8 weight back per call (0 where it
    rotates the activation instead, or the weight is not rotated)."""
    if not _is_int8(w) or not w.layout.rotation or rotates_activation(w, m):
        return 0
    return w.qdata.shape[0] * w.qdata.shape[1] * w.layout.rotation


def _dequantized(x, w, bias, cdt, stored: bool = False) -> torch.Tensor:
    """W in ``cdt`` for one product (``stored``: an int8 weight as stored, still rotated)."""
    keeps_weight = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
    dequantize = w.layout.dequantize_stored if stored else w.layout.dequantize
    if not w.qdata.is_cpu or keeps_weight or w.transposed or w.layout.packed or tracing():
        return w.dequantize(cdt) if not stored else dequantize(w.qdata, w.scale, cdt)
    buf = workspace("weight_only", w.qdata.numel(), cdt).view(w.qdata.shape)
    return dequantize(w.qdata, w.scale, cdt, out=buf)


class WeightOnly(Path):
    name = "weight-only"
    plain = True
    grad_ok = True

    def operand(self, w, cfg, device, cdt):
        return w

    def run(self, x2d, w, bias, cdt, cfg=None, *, op: bool = False):
        if x2d.dtype != cdt:
            x2d = x2d.to(cdt)
        if bias is not None and bias.dtype != cdt:
            bias = bias.to(cdt)
        if rotates_activation(w, x2d.shape[0]) and not tracing():
            return F.linear(rotate(x2d, w.layout.rotation).to(cdt), _dequantized(x2d, w, bias, cdt, stored=True), bias)
        return F.linear(x2d, _dequantized(x2d, w, bias, cdt), bias)


WEIGHT_ONLY = WeightOnly()
