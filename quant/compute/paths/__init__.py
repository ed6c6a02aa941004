"""The registry of compute paths: every way the pack runs ``y = x @ W.T + b``, one module each.

    plain.py     "weight-only": dequantize, then ``F.linear`` (the plain path: always eligible, never proven)
    fp8.py       "fp8": activation to FP8, then one scaled matmul
    int8.py      "int8": activation rotated and quantized per token, int8 GEMM
    kitchen.py   "kitchen int8": comfy-kitchen's int8 linear, where the ComfyUI in use brings comfy-kitchen
    kitchen_int4.py  "kitchen awq" and "kitchen svdquant": comfy-kitchen's AWQ W4A16 and SVDQuant W4A4 linears,
                 on CUDA devices where kitchen's CUDA backend is enabled (elsewhere its eager code is
                 weight-only's own math)
    fused.py     "fused weight-only" and "fused nvfp4": the CUDA GEMMs that convert the weight in registers
    base.py      what every path declares (``Path``), and the reference math of their proofs

``linear`` asks each path of ``PATHS`` whether it takes a weight (``Path.operand``), proves and times the
ones that do against each other and the plain path (``prove.py``), and runs the one the book chose.
Adding a fast path: its module (a ``Path`` with ``operand``, ``run``, ``check``), one line in ``PATHS``,
and its tests. Verdicts naming a path that is not registered are dropped when the verdict file is read.
"""

from __future__ import annotations

from .. import book as _book
from .base import Path
from .fp8 import FP8
from .fused import FUSED_NVFP4, FUSED_WEIGHT_ONLY
from .int8 import INT8
from .kitchen import KITCHEN_INT8
from .kitchen_int4 import KITCHEN_AWQ, KITCHEN_SVDQUANT
from .plain import WEIGHT_ONLY

__all__ = ["Path", "PATHS", "REGISTRY", "WEIGHT_ONLY", "FP8", "INT8", "KITCHEN_INT8", "KITCHEN_AWQ",
           "KITCHEN_SVDQUANT", "FUSED_WEIGHT_ONLY",
           "FUSED_NVFP4"]

# In order of preference where fast paths are trusted (no proof); the plain path last.
PATHS = (FP8, INT8, KITCHEN_INT8, KITCHEN_AWQ, KITCHEN_SVDQUANT, FUSED_WEIGHT_ONLY, FUSED_NVFP4, WEIGHT_ONLY)
REGISTRY = {p.name: p for p in PATHS}
assert len(REGISTRY) == len(PATHS) and PATHS[-1].plain
_book.REGISTERED.update(REGISTRY)  # what the verdict book accepts from its file
