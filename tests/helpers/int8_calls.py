"""What the tests of "auto"'s int8 conversions share: a fake clock for the proofs' timing, FP8 weights, one call.

The clock makes which path wins a choice of the test, never a wall-clock margin: the plain path's
dequantization and the int8 GEMM advance it by what the test says, and the proofs read only it.
"""

from __future__ import annotations

import importlib

import torch

from fp8_engram.quant import PerRow, QuantizedTensor
from fp8_engram.quant.compute import int8 as qint8, proof

plain = importlib.import_module("fp8_engram.quant.compute.paths.plain")


def fake_clock(monkeypatch, plain_s: float, int8_s: float):
    """Timing on a fake clock: the plain path's dequantization and the int8 GEMM take what the test says."""
    now = [0.0]

    def for_device(device):
        def timed(fn):
            t0 = now[0]
            fn()
            return now[0] - t0
        return timed

    monkeypatch.setattr(proof, "clock_for", for_device)
    real_dq, real_mm = plain._dequantized, qint8.int8_linear_mm

    def dq(*a, **k):
        now[0] += plain_s
        return real_dq(*a, **k)

    def mm(*a, **k):
        now[0] += int8_s
        return real_mm(*a, **k)

    monkeypatch.setattr(plain, "_dequantized", dq)
    monkeypatch.setattr(qint8, "int8_linear_mm", mm)


def int8_wrong_for(monkeypatch, rows: int) -> None:
    """The int8 GEMM wrong (its last output one too large) for a weight of ``rows`` rows only: right on the first
    rows a proof judges and times a large CPU weight on, wrong on the whole weight."""
    real = qint8.int8_linear_mm

    def wrong(xq, sa, wq, sb, bias, out_dtype):
        out = real(xq, sa, wq, sb, bias, out_dtype)
        if wq.shape[0] == rows:
            out[:, -1] += 1.0
        return out

    monkeypatch.setattr(qint8, "int8_linear_mm", wrong)


def fp8_weights(count=3, n=512, k=1024):
    """``count`` per-row FP8 weights [n, k] of seeded random values (the same values at every call)."""
    g = torch.Generator().manual_seed(0)
    return [QuantizedTensor.from_float(torch.randn(n, k, generator=g) * 0.03, PerRow()) for _ in range(count)]


def activation(tokens: int = 40) -> torch.Tensor:
    """``tokens`` tokens of 1024 (bfloat16): one call's activation, the same in every test."""
    return torch.randn(tokens, 1024, generator=torch.Generator().manual_seed(1)).bfloat16()


def converted(w) -> bool:
    """Whether ``w`` holds an int8 conversion beside its FP8 form."""
    return "int8" in w.__dict__.get("_derived", {})
