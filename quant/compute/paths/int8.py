"""The int8 x int8 path: the activation rotated like the weight and quantized per token in one pass, then one
int8 GEMM with both scales, the bias and the output dtype in its epilogue (``compute/int8.py``).

It multiplies Int8 weights: ComfyUI's int8 files as they are, and the pack's own conversion of other
weights, made once per weight on its own device and kept beside it (``int8.to_int8``): under "int8" for
every weight (the loaders convert at load), under "auto" where the device has fast INT8 and no FP8 units
(``int8_supported``) for a weight whose kind of call this path was proven right and measured faster on:
the first weight of a kind is converted for its proof (a CPU weight of more than twice ``prove.TIME_ROWS`` rows: its
first rows only, those the proof times: ``int8_rows_operand``), every other when it first runs int8, and a model
whose calls never run int8 converts nothing more. The file's form stays beside the conversion only while it serves
(``ComputeConfig.fp8_form``): a weight that already ran weight-only keeps both forms (about one more byte per
parameter), one whose calls all ran int8 becomes its int8 form in place (``drop_fp8_form``). Under
"auto" it is a candidate for int8 weights wherever an int8 GEMM runs (``int8_available``; by
``int8_fast`` where fast paths are trusted). Its twin: the same int8 operands multiplied in float32. Pure
torch; never imports ComfyUI.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from ...errors import QuantizationError
from ...kernels.int8_mm import quantize_rows_int8_torch
from ...layouts.fp8 import fp8_to
from ...layouts.int8 import FACTORED_MIN_BLOCK, hadamard, rotate_factored
from ...runtime import first_line, log_once, tracing, workspace
from ...tensor import DROPPED_FP8_FORM, QuantizedTensor
from .. import int8, proof
from ..book import default_book
from .base import Path, bias_cols, cached_on_weight, weight_reference

__all__ = ["Int8Path", "INT8", "int8_operand", "int8_takes", "sampled_conversion_sqnr_db", "SQNR_ROWS",
           "drop_fp8_form", "FP8Form", "dropped_fp8_form", "carry_fp8_form", "in_fp8_form", "convert_in_place",
           "drops_fp8_form", "served_plain", "FP8_SERVED", "int8_rows_operand", "has_conversion"]

logger = logging.getLogger("fp8_engram.quant.compute.linear")

SQNR_ROWS = 256  # rows a conversion's SQNR is measured on (evenly spread, first and last included)


def int8_takes(w, cfg, device) -> bool:
    """Whether an int8 path multiplies ``w`` under ``cfg`` on ``device`` (converting nothing)."""
    if cfg.path == "weight_only" or w.transposed or w.qdata.dim() != 2:
        return False
    if int8.is_int8(w):
        if cfg.path != "auto":
            return True  # an int8 weight under "fp8" or "int8" runs int8, as forced
        return int8.int8_fast(device) if cfg.trust_fast_paths else int8.int8_available(device)
    if cfg.path == "int8":
        return True
    # the same answer while torch.compile traces: the paths that take a weight make its verdict's key, and a
    # trace must find the verdict its eager calls filed (``int8_operand`` declines to convert there)
    return cfg.path == "auto" and int8.int8_supported(device)


def int8_operand(w, cfg, device):
    """The Int8 weight an int8 path multiplies for ``w`` under ``cfg``, or None; a conversion is made on
    ``device`` once and kept on the weight (one per rotation choice: a call that overrides int8_rotation
    must not get the other's)."""
    if not int8_takes(w, cfg, device):
        return None
    if int8.is_int8(w):
        return w
    if tracing():
        # forced "int8" (the loaders converted at load; a weight made int8 otherwise is traced so). "auto"
        # converts at first use, never inside a compiled graph (the traced weight is a new object each trace:
        # the conversion would run in the graph at every call): a call routed int8 is traced plain
        return int8.to_int8(w, None if cfg.int8_rotation else 0) if cfg.path == "int8" else None
    name = "int8" if cfg.int8_rotation else "int8_unrotated"
    if cfg.path == "auto":  # a weight that cannot be converted runs weight-only, said once
        w8 = cached_on_weight(w, name, lambda: _convert_or_none(w, cfg, device))
        return w8 if w8 is not _UNCONVERTIBLE else None
    return cached_on_weight(w, name, lambda: _convert(w, cfg, device))


_UNCONVERTIBLE = object()


@dataclass(frozen=True)
class FP8Form:
    """What a weight was before it was made int8 in place (``drop_fp8_form``): its layout, stored dtype and input scale
    (a few bytes; the FP8 data itself is gone)."""

    layout: object
    dtype: torch.dtype
    input_scale: torch.Tensor | None


_FP8_FORM = DROPPED_FP8_FORM  # where a weight keeps its FP8Form (its __dict__; its copies and moves keep it too)
FP8_SERVED = "_fp8_served"  # set on a weight (its __dict__) once a call multiplied its FP8 form (weight-only)


def served_plain(w) -> None:
    """Remember that a call of ``w`` ran weight-only on its FP8 form (``linear`` says so, outside compiled graphs):
    under ``fp8_form="serving"`` its form now serves a kind of call, so a later conversion keeps it."""
    d = w.__dict__
    if FP8_SERVED not in d:
        d[FP8_SERVED] = True


def drops_fp8_form(w, cfg) -> bool:
    """Whether a call of ``w`` that runs int8 under ``cfg`` makes it its int8 form, dropping the FP8 one
    (``ComputeConfig.fp8_form``, under "auto" only: a forced path keeps what it was given): always under "drop",
    never under "keep", and under "serving" (the default) where no call has run weight-only on the FP8 form yet
    (``served_plain``)."""
    form = cfg.fp8_form
    return cfg.path == "auto" and (form == "drop" or (form == "serving" and FP8_SERVED not in w.__dict__))


def dropped_fp8_form(w) -> FP8Form | None:
    """The FP8 form ``w`` had before it was dropped (``drop_fp8_form``), or None where it never was."""
    return getattr(w, "__dict__", {}).get(_FP8_FORM)


def carry_fp8_form(src, dst) -> None:
    """``dst`` replaces ``src`` (a weight patch): it remembers the FP8 form ``src`` dropped, if any."""
    form = dropped_fp8_form(src)
    if form is not None:
        dst.__dict__[_FP8_FORM] = form


def in_fp8_form(w):
    """``w`` (a weight whose FP8 form was dropped; never a transposed view, which is never dropped) re-quantized
    from its int8 values into that FP8 form: a new QuantizedTensor (same logical dtype, shape and config; the
    remembered input scale). Rounds once more, so it is near the dropped FP8 data, not equal to it."""
    form = dropped_fp8_form(w)
    if form is None:
        raise QuantizationError("in_fp8_form: this weight never dropped an FP8 form")
    fresh = QuantizedTensor.from_float(w.canonical().dequantize(torch.float32), form.layout, fp8_dtype=form.dtype)
    return QuantizedTensor.from_parts(fresh.qdata, fresh.scale, form.layout, orig_dtype=w.orig_dtype,
                                      input_scale=form.input_scale, config=w.config)


def drop_fp8_form(w, w8) -> bool:
    """Where ``drops_fp8_form`` says so: make the FP8 weight ``w`` the int8 weight ``w8`` it was
    converted to, in place (``qdata``, ``scale``, ``layout``; the logical dtype, shape and config stay), so its
    FP8 data and the cached conversion are one int8 copy instead of two; the weight remembers its FP8 form
    (``dropped_fp8_form``: layout, dtype, input scale) so a saver can write it back in that form. What was
    derived from the old form (the conversion itself, the routes of its kinds of call) is forgotten: later
    calls are routed for the int8 layout (``linear`` files the int8 kinds the verdicts the FP8 kinds reached).
    Only where both forms live on the same device (an offloaded weight's per-call copy on a GPU is not the
    weight). True where it was dropped."""
    if not int8.is_int8(w8) or int8.is_int8(w) or w8.qdata.device != w.qdata.device or w8.qdata.shape != w.qdata.shape:
        return False
    w.__dict__[_FP8_FORM] = FP8Form(w.layout, w.qdata.dtype, w.input_scale)  # what Save FP8 Model writes back
    w.qdata, w.scale, w._qlayout, w.input_scale = w8.qdata, w8.scale, w8.layout, None
    w.__dict__.pop("_derived", None)
    w.__dict__.pop("_routes", None)
    logger.debug("dropped the FP8 form of a %s weight %s: it runs as int8 from now on", w.orig_dtype,
                 list(w.matrix_shape))
    return True


def _convert_or_none(w, cfg, device):
    try:
        return _convert(w, cfg, device)
    except QuantizationError as exc:  # e.g. scales so near float32's range that the rotated weight overflows
        log_once(logger, ("unconvertible", repr(w.layout), tuple(w.matrix_shape)), logging.WARNING,
                 "a %s weight %s cannot be converted to int8 (%s); it runs weight-only (logged once)",
                 w.layout, list(w.matrix_shape), first_line(exc))
        return _UNCONVERTIBLE


def _convert(w, cfg, device):
    started = time.perf_counter()
    wd = w
    if w.qdata.device != torch.device(device):  # converted where it runs (a CUDA model on its GPU)
        wd = QuantizedTensor.from_parts(w.qdata.to(device), w.scale.to(device), w.layout, orig_dtype=w.orig_dtype,
                                        config=w.config)
    w8 = int8.to_int8(wd, None if cfg.int8_rotation else 0)
    db = sampled_conversion_sqnr_db(wd, w8)
    _book(cfg).converted(device, time.perf_counter() - started, db, w8.qdata.numel())
    return w8


def sampled_conversion_sqnr_db(reference, w8, rows: int = SQNR_ROWS) -> float:
    """SQNR (dB) of the int8 conversion ``w8`` against ``reference`` (the weight it was made from) on ``rows``
    rows spread over the weight (both dequantized there only; float32 differences and squares, float64 sums).

    On the CPU, for an FP8 reference of one scale per tensor, row or block, the rows go a block at a time
    through reused buffers (``runtime.workspace``): the figure allocates nothing per layer. Fresh pages are
    what a first step pays for most here: each is faulted in and zeroed, and on a virtual machine may be
    backed anew by the host (``bench/load.py`` counts the faults); whole-sample temporaries and their float64
    copies cost a conversion more than its own rotation and rounding did."""
    n = w8.qdata.shape[0]
    idx = proof.checked_index(n, rows, rows // 8, rows - rows // 4, w8.qdata.device)
    blocks = _row_blocks(reference, w8)
    if blocks is not None:
        err, sig = blocks(idx)
    else:
        ref = weight_reference(reference, idx)
        err = float(torch.sub(weight_reference(w8, idx), ref).square_().sum(dtype=torch.float64))
        sig = float(ref.square().sum(dtype=torch.float64))
    return _db(err, sig)


SQNR_BLOCK_ELEMS = 1 << 18  # float32 elements of sampled rows per block (1 MiB per buffer: stays in cache)


def _fp8_row_access(reference):
    """``(r, c, per_tensor, scales)`` of a CPU FP8 weight whose sampled rows the blockwise SQNR reads: its scale
    block (rows, cols), whether one scale serves the tensor, its scales as float32 (a scalar, or one row per
    block of rows); None for other weights (another family or device, a transposed or non-contiguous weight, a
    scale block that does not tile its columns) and while tracing."""
    if (not isinstance(reference, QuantizedTensor) or reference.layout.family != "fp8" or reference.transposed
            or reference.qdata.device.type != "cpu" or reference.qdata.dim() != 2
            or not reference.qdata.is_contiguous() or tracing()):
        return None
    n, k = reference.qdata.shape
    block = reference.layout.kernel_block((n, k))
    if block is None:
        return None
    (r, c), per_tensor = block
    if not per_tensor and k % c:
        return None
    s = reference.scale.to(torch.float32)
    return r, c, per_tensor, (s.reshape(()) if per_tensor else s.reshape(-(-n // r), -1))


def _row_blocks(reference, w8, saved: torch.Tensor | None = None):
    """``sums(idx) -> (err, sig)``: the squared error and signal over rows ``idx``, by blocks of rows through
    reused buffers; None where the reference has no row access (``_fp8_row_access``) or ``w8`` is not a CPU
    per-row (or per-tensor) Int8 weight of its shape. ``saved``: the FP8 codes of rows ``idx`` (uint8
    ``[len(idx), K]``), taken before the reference's own codes were overwritten (``convert_in_place``); its
    layout and scales are read from ``reference`` still."""
    access = _fp8_row_access(reference)
    if (access is None or not int8.is_int8(w8) or w8.qdata.device.type != "cpu" or not w8.qdata.is_contiguous()
            or tuple(reference.qdata.shape) != tuple(w8.qdata.shape)):
        return None
    r, c, per_tensor, fs = access
    n, k = reference.qdata.shape
    rot = w8.layout.rotation
    if (rot and k % rot) or w8.scale.numel() not in (1, n):
        return None
    s8 = w8.scale.to(torch.float32).reshape(-1)
    h = hadamard(rot, w8.layout.regular) if rot and rot < FACTORED_MIN_BLOCK else None
    step = max(1, SQNR_BLOCK_ELEMS // k)
    q_fp8, q_int8 = reference.qdata.view(torch.uint8), w8.qdata

    def sums(idx):
        err = sig = 0.0
        for i in range(0, len(idx), step):
            part = idx[i:i + step]
            m = len(part)
            ref = workspace("sqnr_reference", m * k, torch.float32).view(m, k)
            got = workspace("sqnr_converted", m * k, torch.float32).view(m, k)
            codes = saved[i:i + m] if saved is not None else \
                torch.index_select(q_fp8, 0, part, out=workspace("sqnr_fp8", m * k, torch.uint8).view(m, k))
            fp8_to(codes.view(reference.qdata.dtype), torch.float32, None, ref)
            if per_tensor:
                ref.mul_(fs)
            else:  # the scale of each sampled row's block, expanded over its columns
                ref.view(m, k // c, c).mul_(fs.index_select(0, torch.div(part, r, rounding_mode="floor"))[:, :, None])
            q = torch.index_select(q_int8, 0, part, out=workspace("sqnr_int8", m * k, torch.int8).view(m, k))
            got.copy_(q).mul_(s8 if s8.numel() == 1 else s8.index_select(0, part)[:, None])  # (int8 * float32 into
            # float32 would cast the codes to a fresh float32 temporary first)
            if rot:  # back to the weight's own basis (blockdiag(H).T, as Int8.dequantize does)
                turned = workspace("sqnr_rotated", m * k, torch.float32).view(m, k)
                if rot >= FACTORED_MIN_BLOCK:  # by its Kronecker factors: 32 multiply-adds an element, not 256
                    rotate_factored(got, rot, w8.layout.regular, out=got, scratch=turned)
                else:
                    torch.matmul(got.view(m, k // rot, rot), h.T, out=turned.view(m, k // rot, rot))
                    got = turned
            err += float(got.sub_(ref).square_().sum())
            sig += float(ref.square_().sum())
        return err, sig

    return sums


def convert_in_place(w, cfg, device) -> bool:
    """Where ``drops_fp8_form`` says so, for a weight whose calls int8 was already proven on: convert the CPU
    FP8 weight ``w`` to int8 in its own storage and make ``w`` that int8 weight (``drop_fp8_form``), instead of
    making a second copy and dropping the first. No memory for the codes, no fresh pages: what a conversion
    costs most on a first step. The conversion SQNR is measured as for any conversion, on the sampled rows'
    FP8 codes saved before they are overwritten. False, with ``w`` untouched, where it cannot be done in place
    (``int8.to_int8_in_place``; another device, a compiled graph, a weight that is int8 already): the caller
    converts it the usual way."""
    if (tracing() or not drops_fp8_form(w, cfg) or torch.device(device).type != "cpu" or _fp8_row_access(w) is None
            or not int8_takes(w, cfg, device)):
        return False
    n, k = w.qdata.shape
    started = time.perf_counter()
    idx = proof.checked_index(n, SQNR_ROWS, SQNR_ROWS // 8, SQNR_ROWS - SQNR_ROWS // 4, w.qdata.device)
    saved = workspace("sqnr_saved_fp8", len(idx) * k, torch.uint8).view(len(idx), k)
    torch.index_select(w.qdata.view(torch.uint8), 0, idx, out=saved)
    w8 = int8.to_int8_in_place(w, None if cfg.int8_rotation else 0)
    if w8 is None:
        return False
    db = _db(*_row_blocks(w, w8, saved)(idx))  # w still names its FP8 layout and scales; its codes are w8's now
    drop_fp8_form(w, w8)
    _book(cfg).converted(device, time.perf_counter() - started, db, w8.qdata.numel())
    return True


def _db(err: float, sig: float) -> float:
    if err == 0.0:
        return math.inf
    return 10 * math.log10(sig / err) if sig > 0 else -math.inf


def _book(cfg):
    return cfg.book if cfg.book is not None else default_book()


def int8_rows_operand(w, cfg, device, rows: int):
    """For the proof of a large CPU FP8 weight under "auto" (``prove.timed_on_rows``): the int8 conversion of its
    first ``rows`` rows only, those the proof judges and times. The whole weight is converted only where its
    kind of call then runs int8, at that call: in its own storage where ``drops_fp8_form`` (no second copy: the
    fresh pages of a copy of each kind's first weight were a large part of a first step), else beside it; where
    weight-only wins, it never is. None where the weight already has its conversion (the proof multiplies it),
    is int8 already, or is not a CPU FP8 weight under "auto"."""
    if (tracing() or torch.device(device).type != "cpu" or int8.is_int8(w) or cfg.path != "auto"
            or not int8_takes(w, cfg, device) or has_conversion(w, cfg) or _fp8_row_access(w) is None):
        return None
    parts = w.layout.first_rows(w.qdata, w.scale, rows)
    if parts is None:
        return None
    head = QuantizedTensor.from_parts(parts[0], parts[1], w.layout, orig_dtype=w.orig_dtype, config=w.config)
    try:
        return int8.to_int8(head, None if cfg.int8_rotation else 0)
    except QuantizationError:
        return None  # the whole weight's conversion says why, once


def has_conversion(w, cfg) -> bool:
    """Whether ``w`` holds its int8 conversion for ``cfg``'s rotation choice beside its FP8 form (``int8_operand``)."""
    return ("int8" if cfg.int8_rotation else "int8_unrotated") in w.__dict__.get("_derived", {})


class Int8Path(Path):
    name = "int8"

    def takes(self, w, cfg, device, cdt) -> bool:
        return int8_takes(w, cfg, device)

    def operand(self, w, cfg, device, cdt):
        return int8_operand(w, cfg, device)

    def rows_operand(self, w, cfg, device, cdt, rows: int):
        return int8_rows_operand(w, cfg, device, rows)

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
