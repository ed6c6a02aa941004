"""Numeric comparisons shared by the tests."""

from __future__ import annotations

import torch


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of `x` against `ref` in dB, computed in float64; inf when equal."""
    ref = ref.double()
    err = (ref - x.double()).norm()
    return float("inf") if float(err) == 0 else float(20 * torch.log10(ref.norm() / err))
