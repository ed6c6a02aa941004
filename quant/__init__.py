"""FP8 quantized tensors for ComfyUI models - pure torch, never imports ComfyUI.

    from fp8_engram.quant import QuantizedTensor, PerTensor, PerRow, Block, ComputeConfig
    qt = QuantizedTensor.from_float(w, PerRow(), fp8_dtype=torch.float8_e4m3fn)
    y = torch.nn.functional.linear(x, qt, bias)      # or fp8_engram.quant.linear(x, qt, bias)
"""

import torch

from .config import ComputeConfig
from .errors import QuantizationError
from .layouts import FP8_DTYPES, LAYOUTS, MXFP8, NVFP4, Block, Int8, NVFP4Bank, PerExpert, PerRow, PerTensor
from .numerics import fp8_max
from .tensor import QuantizedTensor, _rebuild_quantized_tensor
from . import dispatch as _dispatch  # noqa: F401  (fills the op tables)
from . import expert_bank as _expert_bank  # noqa: F401  (the expert-bank ops)
from .compute import default_book, fp8_supported, linear

# torch.load(weights_only=True) may rebuild these: every registered layout, and a config's verdict book, which
# comes back as this process's in-memory book (a file never names the path of a book it would write to)
torch.serialization.add_safe_globals(
    [QuantizedTensor, _rebuild_quantized_tensor, *LAYOUTS, ComputeConfig, default_book]
)

__all__ = [
    "QuantizedTensor",
    "PerTensor",
    "PerRow",
    "Block",
    "PerExpert",
    "NVFP4Bank",
    "MXFP8",
    "Int8",
    "NVFP4",
    "ComputeConfig",
    "QuantizationError",
    "FP8_DTYPES",
    "fp8_max",
    "fp8_supported",
    "linear",
]
