"""FP8 expert banks: the 3-D weights of mixture-of-experts layers, one float32 scale per expert.

A bank stores E experts' matrices as one tensor ``[E, rows, cols]`` (ComfyUI 0.33's ``MoEExperts`` keeps
``[E, out, in]``; Hugging Face gpt-oss keeps ``[E, in, out]`` and multiplies with ``bmm``). The layout
does not care which: it scales whole experts. A bank with one scale for everything is ``PerTensor()``
(any rank); this layout is the per-expert form, scale ``[E, 1, 1]`` (files write ``[E]`` or
``[E, 1, 1]``). ``NVFP4Bank`` holds E NVFP4 matrices, each in the 2-D form of ``nvfp4.py``.

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
from .nvfp4 import NVFP4

__all__ = ["PerExpert", "NVFP4Bank", "nvfp4_file_scales", "bank_at_shape"]


def _need_3d(shape, name: str = "PerExpert") -> None:
    if len(shape) != 3:
        raise QuantizationError(
            f"layout {name} needs a 3-D expert bank [experts, rows, cols], got shape {list(shape)}")


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


@dataclass(frozen=True)
class NVFP4Bank(LayoutBase):
    """An expert bank of NVFP4 matrices, each stored exactly as a 2-D ``NVFP4(rows, cols)`` weight
    (``nvfp4.py``): qdata uint8 ``[E, R, C / 2]``, scale uint8 ``[E, n]`` (expert e's block scale bytes, then
    its float32 tensor scale, so a file's tensor scale may be one per expert or shared). ``rows x cols`` is
    one expert's logical shape; the number of experts is the data's first dimension."""

    rows: int
    cols: int

    name = "nvfp4_bank"
    family = "nvfp4"
    data_dtypes = (torch.uint8,)
    packed = True

    def __post_init__(self):
        NVFP4(self.rows, self.cols)  # the same checks of the sizes

    @property
    def expert_layout(self) -> NVFP4:
        return NVFP4(self.rows, self.cols)

    @classmethod
    def for_shape(cls, shape) -> "NVFP4Bank":
        _need_3d(shape, "NVFP4Bank")
        return cls(int(shape[1]), int(shape[2]))

    def logical_shape(self, storage_shape) -> tuple:
        return (int(storage_shape[0]), self.rows, self.cols)

    def check_parts(self, qdata: torch.Tensor, scale: torch.Tensor) -> None:
        lay = self.expert_layout
        if not isinstance(qdata, torch.Tensor) or qdata.dim() != 3 or qdata.dtype != torch.uint8 \
                or tuple(qdata.shape[1:]) != lay.storage_shape:
            raise QuantizationError(
                f"NVFP4 bank data for experts of shape {[self.rows, self.cols]} must be uint8 of shape "
                f"[experts, {lay.storage_shape[0]}, {lay.storage_shape[1]}], got "
                f"{getattr(qdata, 'dtype', type(qdata).__name__)} {list(getattr(qdata, 'shape', []))}")
        n = qdata.shape[0]
        if not isinstance(scale, torch.Tensor) or scale.dtype != torch.uint8 \
                or tuple(scale.shape) != (n, lay.scale_numel()):
            raise QuantizationError(
                f"NVFP4 bank scales for {n} experts of shape {[self.rows, self.cols]} must be uint8 of shape "
                f"[{n}, {lay.scale_numel()}] (each expert's block scale bytes, then its float32 tensor scale), "
                f"got {getattr(scale, 'dtype', type(scale).__name__)} {list(getattr(scale, 'shape', []))}")
        for e in range(n):
            try:
                lay.check_parts(qdata[e], scale[e])
            except QuantizationError as exc:
                raise QuantizationError(f"expert {e}: {exc}") from exc

    def quantize(self, w: torch.Tensor, fp8_dtype, generator):
        _need_3d(w.shape, "NVFP4Bank")
        lay = self.expert_layout
        parts = [lay.quantize(w[e], fp8_dtype, generator) for e in range(w.shape[0])]
        return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        lay = self.expert_layout
        if out is None:
            out = torch.empty((q.shape[0], self.rows, self.cols), dtype=dtype, device=q.device)
        for e in range(q.shape[0]):
            lay.dequantize(q[e], scale[e], dtype, out[e])
        return out


def nvfp4_file_scales(weight_scale: torch.Tensor, weight_scale_2: torch.Tensor, storage_shape):
    """A file's NVFP4 scales -> (layout at the stored size, the QuantizedTensor's scale bytes, and per matrix
    (its NVFP4 layout, its scale bytes) for range checks). ``storage_shape`` ``[R, C / 2]`` is a 2-D layer
    (``nvfp4.scales_from_file``); ``[E, R, C / 2]`` an expert bank in ComfyUI 0.33's ``MoEExperts`` form:
    ``weight_scale`` ``[E, ...]`` holds each expert's block scales as a 2-D layer's, ``weight_scale_2`` is
    ``[E]`` (one tensor scale per expert) or one value shared by all. QuantizationError otherwise."""
    from .nvfp4 import scales_from_file

    if len(storage_shape) == 2:
        layout, scale = scales_from_file(weight_scale, weight_scale_2, storage_shape)
        return layout, scale, [(layout, scale)]
    n = int(storage_shape[0])
    if weight_scale.dim() < 2 or weight_scale.shape[0] != n:
        raise QuantizationError(f"NVFP4 bank block scales must hold one set per expert, [{n}, ...], got "
                                f"{list(weight_scale.shape)}")
    if weight_scale_2.numel() not in (1, n):
        raise QuantizationError(f"NVFP4 bank tensor scales must be [{n}] (one per expert) or one value, got "
                                f"{list(weight_scale_2.shape)}")
    ts = weight_scale_2.reshape(-1)
    parts = []
    for e in range(n):
        try:
            lay, s = scales_from_file(weight_scale[e], ts[e if ts.numel() == n else 0], storage_shape[1:])
        except QuantizationError as exc:
            raise QuantizationError(f"expert {e}: {exc}") from exc
        parts.append(s)
    bank = NVFP4Bank(lay.rows, lay.cols)
    scale = torch.stack(parts)
    return bank, scale, [(lay, s) for s in scale]


def bank_at_shape(w, shape):
    """An NVFP4 bank read at its padded size, given the model's true ``[E, out, in]`` (a new layout over the
    same storage, as ``nvfp4.at_shape``); ``w`` itself when that does not apply (the caller reports a mismatch)."""
    from .nvfp4 import padded_weight_shape

    want = tuple(int(v) for v in shape)
    lay = getattr(w, "layout", None)
    if not isinstance(lay, NVFP4Bank) or len(want) != 3 or tuple(w.shape) == want or want[0] != w.shape[0]:
        return w
    if padded_weight_shape(want[1:]) != lay.expert_layout.padded:
        return w
    return w._replace(layout=NVFP4Bank(want[1], want[2]))
