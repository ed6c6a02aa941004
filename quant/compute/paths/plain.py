"""The plain path, "weight-only": W dequantized into the compute dtype, then ``F.linear`` (stock ComfyUI's math).

Every weight can take it; it is what every other path is proven and timed against, and what a call
falls back to. On the CPU, where autograd will not keep the weight, W is dequantized into this thread's
reusable buffer (a model that dequantizes every layer each step otherwise pays its full-precision size
in page faults per step; ``runtime.workspace``). The pack's own rotated int8 weights multiply the rotated
activation by the weight as stored when the activation has fewer rows than W (rotating the fewer rows).

Where the config gives a budget (``ComputeConfig.dequant_cache_bytes``), the CPU's dequantized W is kept on
the weight instead, within the process's account (``runtime.DEQUANT_COPIES``), and later calls reuse it: the
same bits (it is what each call would dequantize), without the dequantization that dominates a call of a few
tokens.

On the CPU in float32 (what ComfyUI computes in there), a call of few rows goes by row blocks of W instead: each
block dequantized into a cache-sized buffer and multiplied while it is in cache (``BLOCKED_MAX_ROWS``). The
whole-W form writes W's float32 size to memory and reads it back, and at 20 rows the GEMM cannot hide that:
a 3072 -> 12288 call, 2-core AMD EPYC Zen 5, took 27-31 ms against float32 F.linear's 18-22; by blocks 18.5-20
(the same with torch, oneDNN and MKL capped at AVX2: 18.6 against 29.7). Blocks start on multiples of
``BLOCK_ROW_ALIGN`` rows, where the BLAS's own panels start, so MKL sums each output element as in the whole GEMM
for 1 and 12+ rows (not for 2-11: its kernel for so few columns of W @ x.T sums otherwise); the first call of each
shape checks that bit for bit against the whole-W form and keeps whichever gave the whole form's bits
(``blocked_same_bits``). Pure torch; never imports ComfyUI.
"""

from __future__ import annotations

import logging
import math
import weakref

import torch
import torch.nn.functional as F

from ...layouts.int8 import rotate
from ..int8 import fp8_rows
from ...runtime import DEQUANT_COPIES, tracing, workspace
from .base import Path

__all__ = ["WeightOnly", "WEIGHT_ONLY", "rotates_activation", "rotation_macs", "kept_copy", "drop_kept_copies",
           "blocked_same_bits", "BLOCKED_MAX_ROWS"]

logger = logging.getLogger(__name__)

# the blocked form (see the module's docstring): calls of at most this many rows (above it the GEMM's own time
# hides the round trip: 1040 rows of a 12288 x 3072 weight took 445 ms by blocks against 418 whole), blocks of
# about BLOCK_ELEMS float32 elements (4 MiB), a multiple of BLOCK_ROW_ALIGN rows each
BLOCKED_MAX_ROWS = 128
BLOCK_ELEMS = 1 << 20
BLOCK_ROW_ALIGN = 16
# (rows, in, out, block rows, bias, x's strides and alignment, threads) -> whether the blocked form gave the whole
# form's bits (MKL's here: the same for 1 and 12+ rows, other sums for 2-11 rows, which keep the whole form)
blocked_same_bits: dict[tuple, bool] = {}

# where a weight keeps its dequantized copy: in the weight's derived values, which every in-place write of its
# data or scales forgets (``QuantizedTensor.scales_written``) and memory first's drop of the FP8 form clears
_COPY = "dequantized_copy"


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


def _version(t: torch.Tensor):
    # inference tensors (ComfyUI's loaders make them) have no version counter: their writes call scales_written
    return None if t.is_inference() else t._version


def kept_copy(w, cdt, budget: int, stored: bool = False) -> torch.Tensor | None:
    """The dequantized copy of ``w`` in ``cdt`` kept on the weight (made now if ``budget`` bytes, counted over
    every copy of the process, still allow it), or None: the caller dequantizes as without a budget. Only for
    the calls that would use the CPU workspace (the caller checks); never for a part of a larger storage (an
    expert of a bank, a proof's slice: a weight object made anew at every call, whose copy would be too). A copy made for other data, scales or dtype (its
    key: their storages and version counters) is dropped and, budget allowing, made anew."""
    qdata, scale = w.qdata, w.scale
    if budget <= 0 or qdata.untyped_storage().nbytes() != qdata.numel() * qdata.element_size():
        return None
    key = (cdt, stored, qdata.data_ptr(), scale.data_ptr(), _version(qdata), _version(scale))
    derived = w.__dict__.get("_derived")
    hit = None if derived is None else derived.get(_COPY)
    if hit is not None:
        if hit[0] == key:
            return hit[1]
        derived.pop(_COPY, None)  # stale: freed, its bytes return through its finalizer
    nbytes = qdata.numel() * cdt.itemsize
    if not DEQUANT_COPIES.reserve(nbytes, budget):
        return None
    try:
        dequantize = w.layout.dequantize_stored if stored else w.layout.dequantize
        # a normal tensor (not an inference one), made once, read by later calls under and outside inference mode
        with torch.inference_mode(False), torch.no_grad():
            copy = dequantize(qdata, scale, cdt)
    except BaseException:
        DEQUANT_COPIES.release(nbytes)
        raise
    weakref.finalize(copy, DEQUANT_COPIES.release, nbytes)
    w.__dict__.setdefault("_derived", {})[_COPY] = (key, copy)
    return copy


def drop_kept_copies(weights) -> int:
    """Drop the dequantized copies kept on these weights (others are skipped): their bytes return to the
    account as soon as no call is using them. Returns how many were dropped."""
    dropped = 0
    for w in weights:
        derived = getattr(w, "__dict__", {}).get("_derived")
        if derived is not None and derived.pop(_COPY, None) is not None:
            dropped += 1
    return dropped


def _dequantized(x, w, bias, cdt, stored: bool = False, budget: int = 0) -> torch.Tensor:
    """W in ``cdt`` for one product (``stored``: an int8 weight as stored, still rotated); on the CPU its kept
    copy where ``budget`` (bytes) allows one (``kept_copy``), else this thread's reusable buffer."""
    dequantize = w.layout.dequantize_stored if stored else w.layout.dequantize
    if not _into_buffers(x, w, bias):
        return w.dequantize(cdt) if not stored else dequantize(w.qdata, w.scale, cdt)
    kept = kept_copy(w, cdt, budget, stored) if budget else None
    if kept is not None:
        return kept
    buf = workspace("weight_only", w.qdata.numel(), cdt).view(w.qdata.shape)
    return dequantize(w.qdata, w.scale, cdt, out=buf)


class WeightOnly(Path):
    name = "weight-only"
    plain = True
    grad_ok = True

    def operand(self, w, cfg, device, cdt):
        return w

    def run(self, x2d, w, bias, cdt, cfg=None, *, op: bool = False):
        # copies are kept for the model's own calls only: a proof's run (op=True) may be for a weight whose
        # calls then take a fast path, and a copy made there would hold its bytes for nothing
        cfg = cfg if cfg is not None else w.config
        budget = 0 if op or cfg is None else cfg.dequant_cache_bytes
        if x2d.dtype != cdt:
            x2d = x2d.to(cdt)
        if bias is not None and bias.dtype != cdt:
            bias = bias.to(cdt)
        if rotates_activation(w, x2d.shape[0]) and not tracing():
            return F.linear(rotate(x2d, w.layout.rotation).to(cdt), _dequantized(x2d, w, bias, cdt, True, budget),
                            bias)
        if not budget and cdt == torch.float32 and x2d.shape[0] <= BLOCKED_MAX_ROWS:
            blocked = _blocked(x2d, w, bias)
            if blocked is not None:
                return blocked
        return F.linear(x2d, _dequantized(x2d, w, bias, cdt, budget=budget), bias)


def _into_buffers(x, w, bias) -> bool:
    """Whether this call may dequantize W into reused (or kept) CPU buffers: a CPU weight stored plainly, outside a
    traced graph, whose dequantized form autograd will not keep (that one must be a tensor of its own)."""
    keeps_weight = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
    return w.qdata.is_cpu and not (keeps_weight or w.transposed or w.layout.packed or tracing())


def _block_rows(k: int, align: int) -> int:
    """Rows of W per block: about BLOCK_ELEMS elements, a multiple of BLOCK_ROW_ALIGN and of the scales' block."""
    step = math.lcm(align, BLOCK_ROW_ALIGN)
    return max(step, BLOCK_ELEMS // max(k, 1) // step * step)


def _blocked(x2d, w, bias) -> torch.Tensor | None:
    """``F.linear(x2d, W, bias)`` in float32 by row blocks of W (module docstring), or None where the blocked form
    does not apply (not an FP8 weight on the CPU, W of one block, autograd keeping the weight, tracing) or gave other
    bits than the whole form for this shape."""
    if not x2d.is_cpu or not _into_buffers(x2d, w, bias):
        return None
    rows_of = fp8_rows(w)
    if rows_of is None:
        return None
    align, fill = rows_of
    (n, k), m = w.qdata.shape, x2d.shape[0]
    step = _block_rows(k, align)
    # x's alignment too: a BLAS may take another kernel for another alignment (MKL documents results that vary with it)
    key = (m, k, n, step, bias is not None, tuple(x2d.stride()), x2d.data_ptr() % 64, torch.get_num_threads())
    same = blocked_same_bits.get(key)
    if n <= step or same is False:
        return None
    buf = workspace("weight_only_block", min(n, step) * k, torch.float32)
    out = torch.empty((n, m), dtype=torch.float32)
    xt = x2d.t()
    for i in range(0, n, step):
        j = min(n, i + step)
        block = buf[: (j - i) * k].view(j - i, k)
        fill(i, j, block)
        if bias is None:
            torch.mm(block, xt, out=out[i:j])
        else:
            torch.addmm(bias[i:j, None], block, xt, out=out[i:j])
    y = out.t().contiguous()
    if same is None:  # the first call of this shape: the whole form's bits, or the whole form from now on
        whole = F.linear(x2d, _dequantized(x2d, w, bias, torch.float32), bias)
        if not torch.equal(y.view(torch.int32), whole.view(torch.int32)):
            if bool(torch.isfinite(whole).all()):  # a NaN's payload may differ: undecided, ask again next call
                blocked_same_bits[key] = False
                logger.debug("weight-only by row blocks differs from the whole GEMM for %s: whole from now on", key)
            return whole
        blocked_same_bits[key] = True
    return y


WEIGHT_ONLY = WeightOnly()
