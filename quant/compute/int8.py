"""The INT8 compute path: FP8 (or bf16) weights converted once to int8, activations quantized per token.

Where a device has fast INT8 matrix units but no FP8 ones (CUDA capability 8.0 to 8.8: Ampere;
x86 CPUs with VNNI or AMX), an int8 x int8 product with int32 accumulation is the fastest
way to run an FP8 checkpoint:

- at load, each FP8 weight (any layout) or float weight becomes an ``Int8`` QuantizedTensor: one
  scale per output channel, and (by default, where ``in_features`` is a multiple of 128) the
  weight rotated once by a 128-wide block Hadamard transform along K (``layouts/int8.py``);
- per call, one fused pass rotates the activation the same way and quantizes it per token
  (``kernels.int8_mm.quantize_rows_int8``), then one int8 GEMM applies both scales, the bias and
  the output dtype in its epilogue (``kernels.int8_mm.int8_linear_mm``).

The rotation matters for diffusion transformers, whose activations carry a few huge channels: a
per-token int8 scale set by one outlier leaves the other channels a few levels; rotated, the
outlier is spread over its 128-block (bench/quant_linear.py measures both cases).
Pure torch; never imports ComfyUI.
"""

from __future__ import annotations

import logging
import math
import os
import sys

import torch

from ..errors import QuantizationError
from ..kernels.int8_mm import int8_linear_mm, quantize_rows_int8
from ..layouts import Int8
from ..layouts.fp8 import fp8_to, mul_blocks
from ..runtime import tracing
from ..tensor import QuantizedTensor

logger = logging.getLogger(__name__)

__all__ = ["fp8_rows", "int8_supported", "int8_fast", "int8_available", "to_int8", "to_int8_in_place", "int8_linear",
           "default_rotation", "conversion_sqnr_db", "is_int8", "ROTATION_BLOCK", "CPU_ROTATION_BLOCK"]

ROTATION_BLOCK = 128
# On the CPU, 256 where it divides K: converted by its Kronecker factors (16 x 16, 32 multiply-adds an element against
# the 128-block's dense 128), a 12288 x 3072 Flux layer converts in 0.068-0.077 s against 0.098 and comes out 1.1 dB
# closer to its FP8 weight (41.3 against 40.0 dB, a Gaussian weight with outlier input channels; 2-core AMD EPYC Zen
# 5). GPUs keep 128: the fused Triton activation quantizer holds a 128-block in shared memory, not a 256 one.
CPU_ROTATION_BLOCK = 256
_cuda_ok: dict = {}


def _capability(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _cuda_ok:
        _cuda_ok[index] = torch.cuda.get_device_capability(index)
    return _cuda_ok[index]


def int8_fast(device) -> bool:
    """Does the device multiply int8 faster than bf16 with the pack's kernels: CUDA capability 8.0+
    (int8 tensor cores), or an x86 CPU with int8 dot-product instructions (AVX-512 VNNI / AVX-VNNI) or
    AMX tiles. Plain AVX2 CPUs have neither: there int8 GEMMs run slower than float ones
    (bench/quant_linear.py --int8). Turing (7.5) has int8 tensor cores, but Triton cannot compile an
    int8 dot for sm_75 (the int8 GEMM fails to compile there) and the activation quantizer needs 72 KiB
    of shared memory, over Turing's 64 KiB (both compiled for sm_75 by tests/unit/test_sm90_compile.py):
    Turing runs int8 weights weight-only."""
    device = torch.device(device)
    if device.type == "cpu":
        if _onednn_without_vnni():
            return False
        cpu = getattr(torch, "cpu", None)
        probes = ("_is_vnni_supported", "_is_amx_tile_supported")
        return any(bool(getattr(cpu, name, lambda: False)()) for name in probes)
    return device.type == "cuda" and _capability(device) >= (8, 0)


# oneDNN instruction-set caps (its ONEDNN_MAX_CPU_ISA setting) under which its int8 GEMMs, torch._int_mm's on the
# CPU, have no VNNI or AMX instructions to run, whatever the processor has: int8 is then an AVX2 CPU's slow int8
_ONEDNN_ISAS_WITHOUT_VNNI = ("SSE41", "AVX", "AVX2", "AVX512_CORE")


def _onednn_without_vnni() -> bool:
    """Whether the process capped oneDNN below its VNNI instructions (a user's setting, or a bench emulating
    an AVX2 CPU on a newer one: bench/e2e.py --cpu-isa avx2)."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", ""))
    return cap.strip().upper() in _ONEDNN_ISAS_WITHOUT_VNNI


def int8_available(device) -> bool:
    """Does an int8 GEMM of the pack run on the device at all (``torch._int_mm`` on the CPU, the Triton
    GEMM from CUDA capability 8.0)? Where it does, "auto" proves and times it against weight-only
    (``compute/prove.py``) instead of trusting ``int8_fast``."""
    device = torch.device(device)
    if device.type == "cpu":
        return hasattr(torch, "_int_mm")
    return device.type == "cuda" and _capability(device) >= (8, 0)


def int8_supported(device) -> bool:
    """Does ``auto`` convert FP8 weights to int8 on this device: where INT8 is fast and there are no FP8
    matrix units (CUDA capability 8.0 up to, not including, 8.9, where fp8 x fp8 takes over; CPUs with
    VNNI/AMX). Weights that are int8 already (ComfyUI's int8 files) run int8 wherever it is fast."""
    device = torch.device(device)
    if device.type == "cuda" and int8_fast(device):
        return _capability(device) < (8, 9)
    return int8_fast(device)


def is_int8(w) -> bool:
    return isinstance(w, QuantizedTensor) and w.layout.family == "int8"


def default_rotation(in_features: int, device=None) -> int:
    """The rotation block the path uses unless told otherwise: on the CPU ``CPU_ROTATION_BLOCK`` where it divides
    K, else (and elsewhere) ``ROTATION_BLOCK`` where it divides K, else none."""
    if device is not None and torch.device(device).type == "cpu" and in_features % CPU_ROTATION_BLOCK == 0:
        return CPU_ROTATION_BLOCK
    return ROTATION_BLOCK if in_features % ROTATION_BLOCK == 0 else 0


def to_int8(w: torch.Tensor, rotation: int | None = None, *, config=None) -> QuantizedTensor:
    """An FP8 QuantizedTensor (any layout) or a float [out, in] tensor as an ``Int8`` per-channel
    QuantizedTensor with the same logical dtype; ``rotation`` None = :func:`default_rotation`, 0 = off.
    An Int8 weight is returned as it is."""
    if is_int8(w):
        return w if config is None else w.with_config(config)
    if isinstance(w, QuantizedTensor):
        if w.transposed or w.qdata.dim() != 2:
            raise QuantizationError(f"to_int8 needs an [out, in] weight, got {w!r}")
        orig, cfg = w.orig_dtype, config or w.config
    else:
        if not isinstance(w, torch.Tensor) or not w.dtype.is_floating_point or w.dim() != 2:
            raise QuantizationError(f"to_int8 needs a 2-D float or FP8 QuantizedTensor weight, got "
                                    f"{getattr(w, 'dtype', type(w).__name__)} {list(getattr(w, 'shape', []))}")
        orig, cfg = w.dtype, config
    orig = _logical_dtype(orig)
    shape = tuple(w.qdata.shape) if isinstance(w, QuantizedTensor) else tuple(w.shape)
    device = w.qdata.device if isinstance(w, QuantizedTensor) else w.device
    rot = default_rotation(shape[1], device) if rotation is None else int(rotation)
    layout = Int8(per_row=True, rotation=rot)
    with torch.no_grad():
        rows = fp8_rows(w)
        if rows is not None:  # on the CPU: decoded, rotated and rounded a cache-sized chunk of rows at a time
            q, scale = layout.quantize_rows(shape, rows[1], align=rows[0])
        else:
            wf = w.dequantize(torch.float32) if isinstance(w, QuantizedTensor) else w.detach().to(torch.float32)
            q, scale = layout.quantize(wf)
    return QuantizedTensor.from_parts(q, scale, layout, orig_dtype=orig, config=cfg)


def to_int8_in_place(w: QuantizedTensor, rotation: int | None = None, *, config=None) -> QuantizedTensor | None:
    """:func:`to_int8` of a CPU FP8 weight written into the weight's own storage (FP8 and int8 codes are both
    one byte): the returned ``Int8`` weight's ``qdata`` is ``w.qdata`` viewed as int8, and ``w``'s FP8 codes
    are gone (the caller makes ``w`` that int8 weight at once: ``paths.int8.drop_fp8_form``). The same values
    as :func:`to_int8`; no memory is allocated for the codes, so no fresh pages are faulted in. None, with
    ``w`` untouched, where it cannot be done in place: off the CPU, another layout, a transposed or
    non-contiguous weight, codes another tensor shares (``_codes_unshared``: a copy of the weight made by
    ``with_config`` or ``detach``, a state dict still held, would read int8 bytes as FP8), or scales so large
    that the rotated rows could overflow float32 (checked before a byte is written: the one way the conversion
    could fail half way)."""
    if (not isinstance(w, QuantizedTensor) or w.layout.family != "fp8" or w.transposed or w.qdata.dim() != 2
            or not w.qdata.is_contiguous() or not _codes_unshared(w)):
        return None
    rows = fp8_rows(w)
    if rows is None:
        return None
    shape = tuple(w.qdata.shape)
    rot = default_rotation(shape[1], w.qdata.device) if rotation is None else int(rotation)
    largest = float(w.scale.to(torch.float32).abs().max()) * torch.finfo(w.qdata.dtype).max * math.sqrt(max(rot, 1))
    if not math.isfinite(largest) or largest * 4 > torch.finfo(torch.float32).max:
        return None
    layout = Int8(per_row=True, rotation=rot)
    with torch.no_grad():
        q, scale = layout.quantize_rows(shape, rows[1], align=rows[0], out=w.qdata.view(torch.int8))
    return QuantizedTensor.from_parts(q, scale, layout, orig_dtype=_logical_dtype(w.orig_dtype),
                                      config=config or w.config)


def _codes_unshared(w: QuantizedTensor) -> bool:
    """Whether ``w`` alone reads its codes: no other weight holds its ``qdata`` tensor (``with_config`` and
    ``_replace`` share it: Python's reference count of it is that of an object held by one dict and one local,
    measured beside it, so the interpreter's own counting rules cancel out), and no other tensor views its
    storage (torch's use count of the storage: ``qdata``'s and the storage object asked). False where this
    torch cannot tell: bytes another tensor may read are never rewritten."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    codes = w.__dict__.get("qdata")
    probe = {"qdata": object()}
    alone = probe["qdata"]
    if count is None or codes is None or sys.getrefcount(codes) > sys.getrefcount(alone):
        return False
    storage = codes.untyped_storage()
    return count(storage._cdata) <= 2


def _logical_dtype(orig: torch.dtype) -> torch.dtype:
    """The logical dtype an int8 conversion keeps: the weight's own where it is a float of 16+ bits, else bf16."""
    return orig if orig in (torch.bfloat16, torch.float16, torch.float32, torch.float64) else torch.bfloat16


def fp8_rows(w):
    """``(align, fill)`` for ``Int8.quantize_rows`` and weight-only's row blocks: ``fill(i, j, out)`` writes rows
    ``i:j`` of a CPU FP8 weight with one scale per tensor, row or block, dequantized to float32 exactly as
    ``w.dequantize(torch.float32)`` does (``float32(q) * scale``, the scale expanded over its block); ``align`` is
    the block's rows. None for other weights (float ones are chunked by ``Int8.quantize`` itself) and off the CPU."""
    if not isinstance(w, QuantizedTensor) or w.layout.family != "fp8" or w.qdata.device.type != "cpu" or tracing():
        return None
    shape = tuple(w.qdata.shape)
    block = w.layout.kernel_block(shape)
    if block is None:
        return None
    (r, _c), per_tensor = block
    q, s = w.qdata, w.scale.to(torch.float32)
    if per_tensor:
        s = s.reshape(())

        def fill(i, j, out):
            fp8_to(q[i:j], torch.float32, s, out)  # the scale's multiply in the decoding's own pass (same bits)
    else:
        s = s.reshape(-(-shape[0] // r), -1)

        def fill(i, j, out):
            fp8_to(q[i:j], torch.float32, None, out)
            mul_blocks(out, s[i // r: -(-j // r)], r, _c)
    return (r if not per_tensor else 1), fill


def conversion_sqnr_db(reference: torch.Tensor, w: QuantizedTensor) -> float:
    """SQNR (dB) of ``w``'s dequantized values against ``reference`` (the weight it was made from);
    float32 differences (exact for these magnitudes), float64 sums."""
    ref = reference.dequantize(torch.float32) if isinstance(reference, QuantizedTensor) else reference.float()
    err = (w.dequantize(torch.float32) - ref).pow(2).sum(dtype=torch.float64)
    sig = ref.pow(2).sum(dtype=torch.float64)
    if float(err) == 0.0:
        return math.inf
    return float(10 * torch.log10(sig / err)) if float(sig) > 0 else -math.inf


def int8_linear(x: torch.Tensor, w: QuantizedTensor, bias: torch.Tensor | None, out_dtype: torch.dtype):
    """``x @ dequant(w).T + bias`` for an ``Int8`` weight: per-token int8 activation (rotated like the
    weight), int8 GEMM, float epilogue; x of any rank >= 1, output in ``out_dtype``."""
    out_f, in_f = w.qdata.shape
    x2d = x.reshape(-1, in_f)
    layout = w.layout
    xq, sa = quantize_rows_int8(x2d, layout.rotation, layout.regular)
    out = int8_linear_mm(xq, sa, w.qdata, w.scale, bias, out_dtype)
    return out.reshape(*x.shape[:-1], out_f)
