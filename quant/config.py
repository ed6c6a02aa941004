"""Per-model compute options for QuantizedTensor weights (attached to each weight, never to a class)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import QuantizationError

__all__ = ["ComputeConfig", "PATHS", "ACTIVATION_SCALINGS", "FP8_FORMS"]

PATHS = ("auto", "fp8", "weight_only", "int8")
ACTIVATION_SCALINGS = ("auto", "static", "dynamic_tensor", "dynamic_row")
# what "auto" does with the file's form of a weight it converted to int8 (ComputeConfig.fp8_form)
FP8_FORMS = ("serving", "keep", "drop")


@dataclass(frozen=True)
class ComputeConfig:
    """How a quantized linear runs.

    path:
        "auto"        fp8 x fp8 on FP8 matrix units (CUDA capability 8.9+), weight-only elsewhere
        "fp8"         always try fp8 x fp8 via scaled_mm (also on the CPU, for testing); a failure
                      logs once and falls back to weight-only
        "weight_only" dequantize the weight into the compute dtype and run a plain matmul
        "int8"        int8 x int8 with per-token activation scales (``compute/int8.py``): weights converted
                      to int8 per output channel once (at load, or on first use, cached on the weight)
        ("auto" also picks int8 for int8 weights, and loaders convert to them, where the device has
        fast INT8 but no FP8 units: CUDA capability 8.0-8.8, CPUs with VNNI/AMX; see compute.int8.int8_supported)
    activation_scaling:
        "auto"           the fastest scaling whose accuracy is at least dynamic per tensor's:
                         dynamic per row (one fused pass, no reduction over the whole tensor)
        "static"         use the weight's ``input_scale`` (dynamic per tensor when it has none)
        "dynamic_tensor" one scale per call from the activation's absolute maximum
        "dynamic_row"    one scale per activation row (token)
    compute_dtype:
        dtype of the weight-only matmul and of the output; None = the activation's dtype
    int8_rotation:
        weights converted for the int8 path get a 128-wide block Hadamard rotation of K where K is
        a multiple of 128 (spreads activation outliers before the per-token rounding); False = none
    trust_fast_paths:
        False (the default): every fast path is proven by value on this device, and timed against the
        plain path, the first time a kind of product meets it (``compute/prove.py``); True: take the
        fast paths by the device's capability alone, without proving them
    fp8_form:
        What "auto" keeps of a weight it converted to int8 (where int8 runs: fast INT8 and no FP8 units).
        "serving" (the default): the FP8 form stays only while it serves: a weight whose calls have all run int8
        when it is converted becomes its int8 form in place (its ``qdata``, ``scale`` and ``layout``; on the CPU
        converted in its own storage), so a model whose layers only run int8 holds one byte per parameter, not
        two; a weight that has already run weight-only (a token class where weight-only won, a product too
        small to prove, a shape int8 failed on) keeps its FP8 form beside the int8 one, about one more byte per
        parameter. "keep": every converted weight keeps both forms, so any later weight-only call multiplies the
        file's FP8 values. "drop" (memory first): once a call runs int8 the FP8 form goes, whatever ran before.
        A weight without its FP8 form multiplies the int8 values in its later weight-only calls too (SQNR ~40 dB
        against the FP8 ones); its kinds of call take the verdicts the FP8 form's int8 proofs reached (the same
        int8 operands and kernels). The weight remembers its FP8 form, and Save FP8 Model writes it back in
        that form (``paths.int8.in_fp8_form``: re-quantized from the int8 values, near the file's, not equal).
    dequant_cache_bytes:
        0 (the default): off. Otherwise, on the CPU, the weight-only path keeps a weight's dequantized copy (in the
        compute dtype: 2 bytes per parameter in bfloat16, 4 in float32) on the weight and reuses it at later calls
        instead of dequantizing at every call (at ~20 tokens the dequantization costs ~10x the matmul), within
        this many bytes kept by the whole process (one account, ``runtime.DEQUANT_COPIES``; the largest budget
        asked bounds the total). First come, first kept: once the total is full, later layers dequantize per call.
        Same bits either way (the copy is what the call would dequantize). Never while torch.compile traces,
        where autograd keeps the weight, nor for transposed, packed or view weights (expert slices). A copy is
        dropped when the weight's data or scales are rewritten (LoRA patches, requantization), and freed with
        the weight, or when ComfyUI unloads the model (``paths.plain.drop_kept_copies``).
    book:
        where the verdicts of those proofs are kept (a ``compute.book.Book``: the loaders pass the one of
        ComfyUI's user folder); None = this process's in-memory book. Not part of equality or repr.
    """

    path: str = "auto"
    activation_scaling: str = "auto"
    compute_dtype: torch.dtype | None = None
    int8_rotation: bool = True
    trust_fast_paths: bool = False
    fp8_form: str = "serving"
    dequant_cache_bytes: int = 0
    book: object = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.book is not None and not callable(getattr(self.book, "verdict", None)):
            raise QuantizationError(f"ComputeConfig.book must be a compute.book.Book or None, got {self.book!r}")
        if self.path not in PATHS:
            raise QuantizationError(f"ComputeConfig.path must be one of {PATHS}, got {self.path!r}")
        if self.fp8_form not in FP8_FORMS:
            raise QuantizationError(f"ComputeConfig.fp8_form must be one of {FP8_FORMS}, got {self.fp8_form!r}")
        if self.activation_scaling not in ACTIVATION_SCALINGS:
            raise QuantizationError(
                f"ComputeConfig.activation_scaling must be one of {ACTIVATION_SCALINGS}, "
                f"got {self.activation_scaling!r}"
            )
        dc = self.dequant_cache_bytes
        if isinstance(dc, bool) or not isinstance(dc, int) or dc < 0:
            raise QuantizationError(
                f"ComputeConfig.dequant_cache_bytes must be a non-negative int (bytes; 0 = off), got {dc!r}")
        cd = self.compute_dtype
        if cd is not None and (not isinstance(cd, torch.dtype) or not cd.is_floating_point
                               or cd.itemsize < 2):
            raise QuantizationError(
                f"ComputeConfig.compute_dtype must be None or a float dtype such as torch.bfloat16, "
                f"got {cd!r}"
            )


DEFAULT_CONFIG = ComputeConfig()
