"""What every layout declares: the questions the floors above ask a layout instead of testing its class.

A layout is a frozen dataclass (shared, hashed and pickled safely) that says how a weight's data and
scales encode it. Beside its scale math (``scale_shape``, ``normalize_scale``, ``quantize``,
``dequantize``) each answers, with the defaults below unless it says otherwise:

    name              its kind in reports, saved files' summaries and failure keys
    family            which compute path runs it: "fp8" (FP8 data and float32 scales), "int8", "nvfp4"
    data_dtypes       the dtypes its ``qdata`` may have
    packed            True when ``qdata`` is not element per element (the layout holds the logical
                      shape and checks its raw scale bytes itself, ``check_parts``)
    logical_shape     the weight's logical shape, given ``qdata``'s
    kernel_block      (scale block, per_tensor) for the FP8 kernels, or None where they do not apply
    fp8_scaling       which fp8 x fp8 scaled matmul fits ("tensor", "row", "block") or None
    reshapeable       whether any view of the data keeps its meaning (a single scale)
    key               a hashable summary of the layout for the compute floor's failure memory
"""

from __future__ import annotations

import torch

from ..errors import QuantizationError

__all__ = ["LayoutBase", "FP8_DTYPES", "check_fp8_dtype"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_fp8_dtype(dtype, what: str = "fp8_dtype") -> torch.dtype:
    if dtype not in FP8_DTYPES:
        raise QuantizationError(
            f"{what} must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}"
        )
    return dtype


class LayoutBase:
    """Defaults of the questions in the module docstring (an FP8, element-wise layout)."""

    name = "layout"
    family = "fp8"
    data_dtypes: tuple = FP8_DTYPES
    packed = False
    reshapeable = False  # may any view of the data keep its meaning (one scale for everything)?

    def logical_shape(self, storage_shape) -> tuple:
        return tuple(storage_shape)

    def check_data_dtype(self, dtype, what: str) -> None:
        if self.data_dtypes == FP8_DTYPES:
            check_fp8_dtype(dtype, what)
        elif dtype not in self.data_dtypes:
            allowed = " or ".join(str(d) for d in self.data_dtypes)
            raise QuantizationError(f"{what} must be {allowed} for the {type(self).__name__} layout, got {dtype}")

    def kernel_block(self, shape):
        return None

    def first_rows(self, qdata, scale, n: int):
        """(qdata, scale) of the first ``n`` output rows of a 2-D weight, still of this layout (the compute
        floor times a large layer's candidates on such a slice), or None where the layout cannot cut
        there (the default: packed data, scales laid out across rows)."""
        return None

    def fp8_scaling(self, shape) -> str | None:
        return None

    @property
    def key(self):
        return type(self).__name__
