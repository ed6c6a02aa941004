"""FP8 expert banks: the 3-D weights of mixture-of-experts layers, one float32 scale per expert.

A bank stores E experts' matrices as one tensor ``[E, rows, cols]`` (ComfyUI 0.33's ``MoEExperts`` keeps
``[E, out, in]``; Hugging Face gpt-oss keeps ``[E, in, out]`` and multiplies with ``bmm``). The layout
does not care which: it scales whole experts. A bank with one scale for everything is ``PerTensor()``
(any rank); this layout is the per-expert form, scale ``[E, 1, 1]`` (files write ``[E]`` or
``[E, 1, 1]``).

Dequantization follows the pack's one rule (``numerics``): ``float32(q) * scale`` rounded once into the
result dtype, expert by expert, so ``dequantize(bank)[e]`` has the bits of ``dequantize(bank[e])``.
The ops that use a bank (``expert_bank.py``) never dequantize more than one expert at a time. Pure torch;
never imports ComfyUI.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import QuantizationError
from ..numerics import fp8_max, scale_from_amax
from .base import LayoutBase
from .fp8 import _to_fp8, dequantize_eager, fp8_to

__all__ = ["PerExpert"]


def _need_3d(shape) -> None:
    if len(shape) != 3:
        raise QuantizationError(
            f"layout PerExpert needs a 3-D expert bank [experts, rows, cols], got shape {list(shape)}")


@dataclass(frozen=True)
class PerExpert(LayoutBase):
    """One float32 scale per expert of a 3-D bank ``[E, rows, cols]``; scale shape ``[E, 1, 1]``."""

    name = "per_expert"

    def scale_shape(self, shape) -> tuple:
        _need_3d(shape)
        return (shape[0], 1, 1)

    def normalize_scale(self, scale: torch.Tensor, shape) -> torch.Tensor:
        _need_3d(shape)
        if tuple(scale.shape) not in ((shape[0],), (shape[0], 1, 1)):
            raise QuantizationError(
                f"per-expert scale for a bank of shape {list(shape)} must have shape [{shape[0]}] or "
                f"[{shape[0]}, 1, 1], got {list(scale.shape)}")
        return scale.reshape(shape[0], 1, 1)

    def quantize(self, w: torch.Tensor, fp8_dtype, generator):
        _need_3d(w.shape)
        fmax = fp8_max(fp8_dtype)
        scale = scale_from_amax(w.abs().amax(dim=(1, 2), keepdim=True), fmax)
        q = torch.empty(w.shape, dtype=fp8_dtype, device=w.device)
        for e in range(w.shape[0]):  # one expert's float32 temporary at a time
            q[e] = _to_fp8(w[e].to(torch.float32) / scale[e], fp8_dtype, generator)
        return q, scale

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        _need_3d(q.shape)
        if out is None:
            out = torch.empty(q.shape, dtype=dtype, device=q.device)
        elif out.dtype != dtype or tuple(out.shape) != tuple(q.shape) or not out.is_contiguous():
            raise QuantizationError(
                f"dequantize: out must be a contiguous {dtype} tensor of shape {list(q.shape)}, got "
                f"{out.dtype} {list(out.shape)}")
        for e in range(q.shape[0]):
            dequantize_expert(q[e], scale[e], dtype, out[e])
        return out


def dequantize_expert(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """One expert's matrix (FP8 ``q``, one float32 ``scale``) -> ``dtype`` by the pack's rule; the same bits
    on every device (the CPU's pair tables, elsewhere the eager twin)."""
    if q.device.type == "cpu":
        return fp8_to(q.contiguous(), dtype, scale.reshape(()), out)
    return dequantize_eager(q, scale.reshape(()), None, dtype, True, out)
