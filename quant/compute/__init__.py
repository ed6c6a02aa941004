"""The compute floor: how ``y = x @ W.T + b`` runs for each layout family, and what a device could not run.

    linear.py     the entry point: picks the path per call (fp8 x fp8, weight-only, int8, NVFP4)
    scaled_mm.py  the fp8 x fp8 scaled matmul: API probe, block-scale forms, its custom op
    int8.py       the int8 x int8 path and the conversion of FP8 weights to int8
    nvfp4.py      the NVFP4 weight-only linear
    failures.py   failures remembered per device and kind of product
    choice.py     which path a kind of product takes: proven, timed, remembered (a JSON cache)
    proof.py      the proof-by-value and timing rules every fast path passes
    candidates.py each path's run, eager twin and reference, for the proof
    matmul.py     QuantizedTensor's matmul-like ops, routed to linear.py
"""

from __future__ import annotations

from . import matmul as _matmul  # noqa: F401  (registers the matmul-like ops)
from .linear import fp8_supported, linear

__all__ = ["linear", "fp8_supported"]
