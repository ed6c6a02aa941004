"""The int8 x int8 path: the activation rotated like the weight and quantized per token in one pass, then one
int8 GEMM with both scales, the bias and the output dtype in its epilogue (``compute/int8.py``).

It multiplies Int8 weights: ComfyUI's int8 files and the pack's own conversion of FP8 weights (made at load
where the loaders convert, or here, once per weight, where the config forces "int8"). Under "auto" it is a
candidate wherever an int8 GEMM runs (``int8_available``; by ``int8_fast`` where fast paths are trusted).
Its twin: the same int8 operands multiplied in float32. Pure torch; never imports ComfyUI.
"""

from __future__ import annotations

import torch

from ...kernels.int8_mm import quantize_rows_int8_torch
from .. import int8, proof
from .base import Path, bias_cols, cached_on_weight

__all__ = ["Int8Path", "INT8", "int8_operand"]


def int8_operand(w, cfg, device):
    """The Int8 weight an int8 path multiplies for ``w`` under ``cfg``, or None."""
    if cfg.path == "weight_only" or w.transposed or w.qdata.dim() != 2:
        return None
    if int8.is_int8(w):
        if cfg.path != "auto":
            return w  # an int8 weight under "fp8" or "int8" runs int8, as forced
        fast = int8.int8_fast(device) if cfg.trust_fast_paths else int8.int8_available(device)
        return w if fast else None
    if cfg.path == "int8":
        # one conversion kept per rotation choice: a call that overrides int8_rotation must not get the other's
        if cfg.int8_rotation:
            return cached_on_weight(w, "int8", lambda: int8.to_int8(w, None))
        return cached_on_weight(w, "int8_unrotated", lambda: int8.to_int8(w, 0))
    return None


class Int8Path(Path):
    name = "int8"

    def operand(self, w, cfg, device, cdt):
        return int8_operand(w, cfg, device)

    def trusted(self, m, device) -> bool:
        return int8.int8_fast(device)

    def kind(self, w8, cfg) -> str:
        return "int8"

    def run(self, x2d, w8, bias, cdt, cfg=None, *, op: bool = False):
        return int8.int8_linear(x2d, w8, None if bias is None else bias.to(cdt), cdt)

    def check(self, x2d, w8, bias, cdt, cfg, sample, wref):
        rdt = proof.reference_dtype(x2d.device)
        layout = w8.layout
        xq, sa = quantize_rows_int8_torch(x2d.index_select(0, sample.rows), layout.rotation, layout.regular)
        wq = w8.qdata.index_select(0, sample.cols)
        sb = w8.scale.to(torch.float32).reshape(-1)
        sb = sb.index_select(0, sample.cols) if sb.numel() > 1 else sb.expand(len(sample.cols))

        def product(dt):
            out = (xq.to(dt) @ wq.to(dt).t()) * sa.to(dt) * sb.to(dt)[None, :]
            b = bias_cols(bias, sample, dt)
            return out if b is None else out + b

        return (lambda: product(torch.float32).to(cdt)), (lambda: product(rdt)), None


INT8 = Int8Path()
