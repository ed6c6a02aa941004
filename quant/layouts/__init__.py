"""The layout registry: every way the pack stores a quantized weight, one module per family.

    fp8.py         PerTensor, PerRow, Block(r, c): FP8 data with float32 scales; FP8 <-> float
    mxfp8.py       MXFP8: a Block(1, 32) with power-of-two scales, in ComfyUI 0.29's file form
    nvfp4.py       NVFP4(rows, cols): packed e2m1 data with e4m3 block and float32 tensor scales
    int8.py        Int8(per_row, rotation, ...): int8 data, optional block Hadamard rotation of K
    comfy_int8.py  ComfyUI 0.33's int8 file forms (int8_tensorwise, convrot_w4a4, asym_w4a8_int8)
    expert.py      PerExpert: a 3-D FP8 expert bank [E, rows, cols] with one float32 scale per expert;
                   NVFP4Bank: E NVFP4 matrices in their 2-D form
    awq.py         AWQW4A16(rows, cols, group): unsigned 4-bit codes, a float scale and zero per group (kitchen 0.2.40)
    svdquant.py    SVDQuantW4A4: signed 4-bit tiles, smoothing and a low-rank branch (kitchen 0.2.40), read as its
                   effective weight
    base.py        what every layout declares (the questions the floors above ask)

Floors above ask a layout what it is and can do (``family``, ``kernel_block``, ``fp8_scaling``, ...;
see ``base.py``) and ask this module which layouts exist, never testing classes themselves. Adding a
format: its layout module, its file form, its tests, and one line in ``LAYOUTS`` (and in
``GRANULARITIES`` when ``quantize_model`` may write it).
"""

from __future__ import annotations

from ..errors import QuantizationError
from .awq import AWQW4A16
from .awq import unfit_reason as awq_unfit_reason
from .base import FP8_DTYPES, LayoutBase, check_fp8_dtype
from .comfy_int8 import DEFAULT_CONVROT
from .expert import NVFP4Bank, PerExpert
from .fp8 import Block, PerRow, PerTensor, fp8_to
from .int8 import Int8
from .mxfp8 import MXFP8
from .nvfp4 import NVFP4
from .svdquant import SVDQuantW4A4

__all__ = ["LAYOUTS", "GRANULARITIES", "is_layout", "check_layout", "layout_for", "unfit_reason", "LayoutBase",
           "PerTensor", "PerRow", "Block", "PerExpert", "NVFP4Bank", "MXFP8", "NVFP4", "Int8", "AWQW4A16", "SVDQuantW4A4", "FP8_DTYPES", "check_fp8_dtype",
           "fp8_to", "QuantizationError"]

# The registry: one line per layout class (MXFP8 before Block, of which it is a special case).
LAYOUTS = (PerTensor, PerRow, MXFP8, Block, PerExpert, NVFP4Bank, NVFP4, Int8, AWQW4A16, SVDQuantW4A4)

# Granularity names (what quantize_model, convert and the nodes offer) -> how to make the layout:
# fn(block, shape) -> layout; shape-bound layouts (NVFP4) give None without a shape (one per weight).
GRANULARITIES = {
    "tensor": lambda block, shape: PerTensor(),
    "row": lambda block, shape: PerRow(),
    "block": lambda block, shape: Block(int(block[0]), int(block[1])),
    "mxfp8": lambda block, shape: MXFP8(),
    "nvfp4": lambda block, shape: None if shape is None else NVFP4.for_shape(shape),
    "int8 tensor": lambda block, shape: Int8(False),
    "int8 row convrot": lambda block, shape: Int8(True, DEFAULT_CONVROT, True),
    # comfy-kitchen 0.2.40's AWQ W4A16 (group 64, bf16 scales and zero points), by round to nearest per group
    "awq w4a16": lambda block, shape: None if shape is None else AWQW4A16.for_shape(shape),
}

# Why a granularity cannot hold a weight of some shape (None: it can); the quantizers keep such layers.
_UNFIT = {"awq w4a16": awq_unfit_reason}


def is_layout(obj) -> bool:
    return isinstance(obj, LAYOUTS)


def check_layout(layout) -> None:
    if not is_layout(layout):
        raise QuantizationError(
            f"layout must be PerTensor(), PerRow(), Block(rows, cols), PerExpert() or Int8(...), got {layout!r}"
        )


def unfit_reason(granularity: str, shape) -> str | None:
    """Why ``granularity`` cannot hold a weight of ``shape`` (None: it can, or the granularity takes any shape)."""
    check = _UNFIT.get(granularity)
    return None if check is None else check(tuple(shape))


def layout_for(granularity: str, block=(128, 128), shape=None):
    """The layout of a granularity name of ``GRANULARITIES``; KeyError for any other name."""
    return GRANULARITIES[granularity](block, shape)
