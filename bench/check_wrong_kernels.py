"""A check kept apart from the suite: kernels wrong only on some shapes or rows must never be served.

    .venv/bin/python bench/check_wrong_kernels.py

Replaces ``torch._int_mm`` and ``torch._scaled_mm`` themselves (the functions the pack calls, below all of
its own code) by versions that are wrong in one way a real kernel goes wrong, then runs linears through
the pack's real dispatch at several token counts, the fp8 path forced, the int8 path forced, and "auto" on
an int8 weight (where this CPU proves and times int8 against weight-only) and on an FP8 one (where a CPU with
fast int8 converts it, in its own storage, at its first call that runs int8), each in a fresh book:

    1% off         every product 1% too large
    tail rows      rows past the last full 16-row tile zeroed (m = 40, 77)
    nan row        row 1 NaN
    gemv           wrong only for one token (m = 1)
    n tail         output columns past the last full 64-column tile zeroed (1000 outputs)
    past slices    output columns past the first TIME_ROWS zeroed, on a weight of 2 x TIME_ROWS + 512 rows (where
                   "auto" on the CPU proves and times a candidate on the weight's first rows only)

A case fails when any call returns an output worse against the float64 reference by more than 3 dB than
both the plain path's and the same path's with the real kernels (run first, in a book of its own), or
with NaN/Inf where the reference has none. Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / ".host" / "pkg"))

from fp8_engram.quant import ComputeConfig, PerRow, QuantizedTensor, linear  # noqa: E402
from fp8_engram.quant.compute import Book, int8 as qint8, proof, prove, scaled_mm as sm  # noqa: E402

TOKENS = (1, 16, 40, 77, 100, 300)
N, K = 1000, 512


def _fault(name):
    def wrong(out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        m, n = out.shape
        if name == "1% off":
            return out * 1.01 if out.is_floating_point() else (out.double() * 1.01).round().to(out.dtype)
        if name == "tail rows" and m % 16:
            out[m // 16 * 16:] = 0
        if name == "nan row" and m > 1:
            if out.is_floating_point():
                out[1] = float("nan")
            else:
                out[1] = torch.iinfo(out.dtype).max  # int32 accumulators cannot hold NaN: a garbage row
        if name == "gemv" and m == 1:
            out = out * 2
        if name == "n tail" and n % 64:
            out[:, n // 64 * 64:] = 0
        if name == "past slices" and n > prove.TIME_ROWS:
            out[:, prove.TIME_ROWS:] = 0
        return out
    return wrong


def _install(fault):
    real_int, real_scaled = torch._int_mm, torch._scaled_mm
    wrong = _fault(fault)

    def int_mm(a, b, *args, **kwargs):
        return wrong(real_int(a, b, *args, **kwargs))

    def scaled(*args, **kwargs):
        out = real_scaled(*args, **kwargs)
        return (wrong(out[0]), *out[1:]) if isinstance(out, tuple) else wrong(out)

    torch._int_mm, torch._scaled_mm = int_mm, scaled
    return lambda: (setattr(torch, "_int_mm", real_int), setattr(torch, "_scaled_mm", real_scaled))


def run_case(fault: str, mode: str, w: torch.Tensor) -> dict:
    book = Book()

    def make():  # "fp8 auto" converts an FP8 weight in its own storage: each run gets a weight of its own
        fp8 = QuantizedTensor.from_float(w, PerRow())
        return qint8.to_int8(fp8) if mode == "int8 auto" else fp8

    weight = make()
    path = {"fp8 forced": "fp8", "int8 forced": "int8", "int8 auto": "auto", "fp8 auto": "auto"}[mode]
    cfg = ComputeConfig(path=path, book=Book(every_size=True) if mode.endswith("auto") else book)
    wo = ComputeConfig(path="weight_only", book=Book())
    right_cfg = ComputeConfig(path=path, book=Book(every_size=True))
    xs = {m: torch.randn(m, K, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16) for m in TOKENS}
    with torch.no_grad():
        twin = make() if mode == "fp8 auto" else weight
        right = {m: linear(x, twin, None, right_cfg) for m, x in xs.items()}  # the real kernels
    served_wrong = []
    restore = _install(fault)
    try:
        for m, x in xs.items():
            with torch.no_grad():
                got = linear(x, weight, None, cfg)
                plain = linear(x, weight, None, wo)
            ref = x.double() @ weight.dequantize(torch.float64).t()
            dbs = [proof.sqnr_db(t, ref) for t in (got, plain, right[m])]
            if not dbs[0] >= min(dbs[1:]) - proof.MARGIN_DB:
                served_wrong.append(f"m={m}: {dbs[0]:.1f} dB (plain {dbs[1]:.1f}, right kernel {dbs[2]:.1f})")
    finally:
        restore()
    verdicts = [f"{v.chosen}: {v.why}" for v in cfg.book.verdicts("cpu")]
    return {"fault": fault, "mode": mode, "served_wrong": served_wrong, "verdicts": verdicts}


def main() -> int:
    logging.basicConfig(level=logging.ERROR)
    if sm.scaled_mm_api("cpu") != "torch._scaled_mm":
        print(json.dumps({"bench": "check_wrong_kernels", "skipped": f"torch {torch.__version__} has no CPU "
                          "torch._scaled_mm"}))
        return 0
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(0)) * 0.05
    large = torch.randn(2 * prove.TIME_ROWS + 512, K, generator=torch.Generator().manual_seed(0)) * 0.05
    results = []
    print(f"{'fault':<12}{'path':<13}{'wrong products served':<40}verdict")
    for fault in ("1% off", "tail rows", "nan row", "gemv", "n tail", "past slices"):
        for mode in ("fp8 forced", "int8 forced", "int8 auto", "fp8 auto"):
            r = run_case(fault, mode, large if fault == "past slices" else w)
            results.append(r)
            told = "; ".join(r["served_wrong"]) or "none"
            print(f"{fault:<12}{mode:<13}{told[:38]:<40}{(r['verdicts'] or ['-'])[0][:70]}")
    bad = [r for r in results if r["served_wrong"]]
    print(f"{len(bad)} of {len(results)} cases served a wrong product")
    print(json.dumps({"bench": "check_wrong_kernels", "cases": len(results), "served_wrong": len(bad),
                      "results": results}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
