"""What every compute path declares, and the reference math their proofs share.

A path is one way to compute ``y = x @ W.T + b`` for a QuantizedTensor W. It answers:

    name          its registered name (verdicts, summaries and the verdict file name it by this)
    plain         True for the plain path (dequantize, then matmul): the reference math, never proven
    grad_ok       whether it may run where autograd records (its own backward)
    takes         whether it applies to this weight, config, device and compute dtype (cheap: asked when a
                  kind of call is first routed; never converts anything)
    operand       the weight it multiplies there (the int8 path converts FP8 weights, once per weight, the
                  first time it is proven or runs on one)
    accepts       whether it takes this call's activation (alignment, strides): checked per call
    trusted       whether it runs at ``m`` tokens where the config trusts fast paths (no proof)
    kind / mode   its label in summaries, and the part of the verdict key its options make
    run           the product; ``op=True`` runs the entry points torch.compile's graphs call (custom ops),
                  which is also what every proof runs
    check         (twin, reference, agrees) on a sample of an output: its eager twin, the reference of its
                  math in float64 (float32 on a GPU), an extra check, for ``prove``
    failure_key   the kind of product a failure of it is remembered for

The plain path's proof is its reference alone. Pure torch; never imports ComfyUI.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...layouts.fp8 import dequantize_eager
from ...runtime import tracing
from .. import proof

__all__ = ["Path", "weight_reference", "ref_product", "bias_cols", "cached_on_weight"]


class Path:
    name = "path"
    plain = False
    grad_ok = False

    def takes(self, w, cfg, device, cdt) -> bool:
        return self.operand(w, cfg, device, cdt) is not None

    def operand(self, w, cfg, device, cdt):
        return None

    def rows_operand(self, w, cfg, device, cdt, rows: int):
        """The operand of ``w``'s first ``rows`` rows alone, for a proof timed on them (``prove.decide`` on a
        large CPU weight), where this path would rather not make the whole operand before its verdict; None to
        make the whole one (the default)."""
        return None

    def accepts(self, x2d: torch.Tensor, wop) -> bool:
        return True

    def trusted(self, m: int, device) -> bool:
        return True

    def kind(self, wop, cfg) -> str:
        return self.name

    def mode(self, wop, cfg) -> str:
        return cfg.path

    def run(self, x2d: torch.Tensor, wop, bias, cdt: torch.dtype, cfg, *, op: bool = False) -> torch.Tensor:
        raise NotImplementedError

    def check(self, x2d: torch.Tensor, wop, bias, cdt: torch.dtype, cfg, sample: proof.Sample, wref):
        """(twin, reference, agrees) for ``sample`` of this path's output on ``x2d``; ``wref()`` gives the
        sampled rows of the weight in float32 (``weight_reference``)."""
        rdt = proof.reference_dtype(x2d.device)
        xr = x2d.index_select(0, sample.rows)

        def twin():
            return F.linear(xr.to(cdt), wref().to(cdt), bias_cols(bias, sample, cdt))

        return twin, lambda: ref_product(xr, wref(), bias, sample, rdt), None

    def failure_key(self, wop, cfg, x_dtype, cdt) -> tuple:
        return (repr(wop.layout), wop.qdata.dtype, x_dtype, cdt)

    def __repr__(self) -> str:
        return f"<path {self.name}>"


def weight_reference(w, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of the weight (the output columns a proof compares) as float32 ``[len(rows), K]``, by
    eager torch ops only (no dequantization kernel); only those rows are dequantized where the layout
    allows it (a 12288 x 3072 layer's proof reads 256 of its rows)."""
    shape = tuple(w.qdata.shape)
    block = w.layout.kernel_block(shape)
    if w.layout.family == "fp8" and block is not None and len(shape) == 2:
        (r, c), per_tensor = block
        q = w.qdata.index_select(0, rows)
        if per_tensor:
            return dequantize_eager(q, w.scale, (1, shape[1]), torch.float32, True)
        scale = w.scale.to(torch.float32).reshape(-(-shape[0] // r), -1).index_select(
            0, torch.div(rows, r, rounding_mode="floor"))
        return dequantize_eager(q, scale, (1, c), torch.float32, False)
    if w.layout.family == "int8" and len(shape) == 2:
        scale = w.scale if w.scale.numel() == 1 else w.scale.reshape(shape[0], -1).index_select(0, rows)
        return w.layout.dequantize(w.qdata.index_select(0, rows), scale, torch.float32)
    return w.layout.dequantize(w.qdata, w.scale, torch.float32).index_select(0, rows)


def bias_cols(bias, s: proof.Sample, dtype):
    return None if bias is None else bias.index_select(0, s.cols).to(dtype)


def ref_product(a_rows: torch.Tensor, w_cols: torch.Tensor, bias, s: proof.Sample, rdt) -> torch.Tensor:
    out = a_rows.to(rdt) @ w_cols.to(rdt).t()
    b = bias_cols(bias, s, rdt)
    return out if b is None else out + b


def cached_on_weight(w, name: str, build):
    """A value derived from the weight's scale (a scale operand, a converted weight), built once and kept on
    the weight. Rebuilt when the scale is replaced or written in place: by its version counter, and, for
    inference tensors (what ComfyUI's loaders make under inference_mode; they have no version counter),
    because every in-place write of the pack's own (copy_, requantize_, LoRA patches) calls
    ``QuantizedTensor.scales_written()``. Never cached while torch.compile traces (a cached tensor would
    outlive the trace's fake mode)."""
    if tracing():
        return build()
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
