"""A check kept apart from the suite: a ``torch._scaled_mm`` that returns wrong numbers must be refused.

    .venv/bin/python bench/check_wrong_scaled_mm.py [--error 0.01]

Replaces ``torch._scaled_mm`` itself (the function the pack calls, below its own code) by one whose
product is off by ``--error`` (relative), forces the fp8 path on the CPU (``ComputeConfig(path="fp8")``),
and checks that the pack refuses it: the output equals the weight-only output, not the wrong product;
the log has the refusal with its figures; the verdicts' summary says "wrong on this device". Exit status
0 when all hold. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / ".host" / "pkg"))

from fp8_engram.quant import ComputeConfig, PerRow, QuantizedTensor, linear  # noqa: E402
from fp8_engram.quant.compute import choice, scaled_mm as sm  # noqa: E402


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--error", type=float, default=0.01, help="relative error of the wrong product")
    args = ap.parse_args()
    if sm.scaled_mm_api("cpu") != "torch._scaled_mm":
        sys.stdout.write(json.dumps({"skipped": f"torch {torch.__version__} has no CPU torch._scaled_mm"}) + "\n")
        return 0
    log = _Lines()
    logging.getLogger("fp8_engram").addHandler(log)
    logging.getLogger("fp8_engram").setLevel(logging.INFO)
    g = torch.Generator().manual_seed(0)
    w = QuantizedTensor.from_float(torch.randn(1024, 2048, generator=g) * 0.02, PerRow())
    x = torch.randn(2, 300, 2048, generator=g).to(torch.bfloat16)
    bias = torch.randn(1024, generator=g).to(torch.bfloat16)
    cfg = ComputeConfig(path="fp8")
    with torch.no_grad():
        right = linear(x, w, bias, cfg)  # proven and taken: the real kernel
        right_chosen = [v.chosen for v in choice.verdicts("cpu")]
        choice.reset()
        real = torch._scaled_mm

        def wrong(*a, **k):
            out = real(*a, **k)
            return (out[0] * (1 + args.error), *out[1:]) if isinstance(out, tuple) else out * (1 + args.error)

        torch._scaled_mm = wrong
        try:
            got = linear(x, w, bias, cfg)
            again = linear(x, w, bias, cfg)
        finally:
            torch._scaled_mm = real
        weight_only = linear(x, w, bias, ComputeConfig(path="weight_only"))
    wrong_product = right.float() * (1 + args.error)
    refused = [line for line in log.lines if "fp8 gives wrong numbers, refused" in line]
    summary = choice.summary_lines("cpu")
    checks = {
        "the real kernel was proven and taken": right_chosen == ["fp8"],
        "output is weight-only's": torch.equal(got, weight_only) and torch.equal(again, weight_only),
        "output is not the wrong product": not torch.allclose(got.float(), wrong_product, rtol=1e-3, atol=0),
        "the log says so once, with figures": len(refused) == 1 and "dB" in refused[0],
        "the summary says so": any("wrong on this device" in line for line in summary),
    }
    for name, ok in checks.items():
        sys.stdout.write(f"{'ok  ' if ok else 'FAIL'} {name}\n")
    if refused:
        sys.stdout.write(f"log: {refused[0]}\n")
    for line in summary:
        sys.stdout.write(f"summary: {line}\n")
    sys.stdout.write(json.dumps({"error": args.error, "passed": all(checks.values()), "checks": checks,
                                 "log": refused, "summary": summary}) + "\n")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
