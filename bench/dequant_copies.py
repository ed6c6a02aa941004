"""Benchmark: small-token weight-only calls on the CPU with and without kept dequantized copies.

Per shape (default Flux's 3072->12288, 12288->3072 and 3072->3072 at 20 tokens): ``F.linear`` on the
full-precision weight in ``--dtype`` ("dense": the floor; bf16 by default, float32 is what ComfyUI computes in on
the CPU), the pack's weight-only linear on the FP8 weight (dequantizes the weight at every call: in float32 by
row blocks that stay in cache, ``quant/compute/paths/plain.py``), the same with the row blocks off ("whole": the
whole weight dequantized, then one GEMM; the same as weight-only in bf16), and the same with
``ComputeConfig(dequant_cache_bytes=...)`` (the dequantized weight kept on the weight after the first call). The
outputs of the three weight-only variants are checked bit-equal.
Statistic: the best of ``--repeats`` interleaved rounds of ``--calls`` calls each, in milliseconds a call,
under ``inference_mode`` as ComfyUI runs nodes.

    .venv/bin/python bench/dequant_copies.py [--tokens 20] [--repeats 5] [--calls 5] [--threads N]
        [--shapes 3072x12288,12288x3072,3072x3072] [--dtype bfloat16]

The last line printed is one JSON object: {"bench": "dequant_copies", ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / ".host" / "pkg"))

from fp8_engram.quant import ComputeConfig, PerTensor, QuantizedTensor, linear  # noqa: E402
from fp8_engram.quant.compute.paths import plain as plain_path  # noqa: E402
from fp8_engram.quant.runtime import DEQUANT_COPIES  # noqa: E402

DEFAULT_SHAPES = "3072x12288,12288x3072,3072x3072"  # in x out


def best_ms(fns: dict, repeats: int, calls: int) -> dict:
    """Best over interleaved rounds of the mean milliseconds a call of each fn (after one warm-up call)."""
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / calls * 1e3)
    return best


def whole(fn):
    """``fn`` with weight-only's row blocks off: the whole weight dequantized, then one GEMM."""
    def run():
        saved, plain_path.BLOCKED_MAX_ROWS = plain_path.BLOCKED_MAX_ROWS, -1
        try:
            return fn()
        finally:
            plain_path.BLOCKED_MAX_ROWS = saved
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated INxOUT")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    plain = ComputeConfig(path="weight_only")
    kept = ComputeConfig(path="weight_only", dequant_cache_bytes=64 << 30)
    rows = []
    with torch.inference_mode():
        for spec in args.shapes.split(","):
            k, n = (int(v) for v in spec.lower().split("x"))
            g = torch.Generator().manual_seed(0)
            w = (torch.randn(n, k, generator=g) * 0.02).to(dtype)
            x = torch.randn(args.tokens, k, generator=g).to(dtype)
            qt = QuantizedTensor.from_float(w, PerTensor(), config=plain)
            qk = qt.with_config(kept)
            y = linear(x, qt)
            same = torch.equal(y, linear(x, qk)) and torch.equal(y, whole(lambda: linear(x, qt))())
            ms = best_ms({"dense": lambda: F.linear(x, w), "weight_only": lambda: linear(x, qt),
                          "weight_only_whole": whole(lambda: linear(x, qt)),
                          "weight_only_kept": lambda: linear(x, qk)}, args.repeats, args.calls)
            rows.append({"shape": f"{args.tokens}x{k}->{n}", **{key: round(v, 3) for key, v in ms.items()},
                         "weight_only_vs_dense": round(ms["weight_only"] / ms["dense"], 2),
                         "whole_vs_dense": round(ms["weight_only_whole"] / ms["dense"], 2),
                         "kept_vs_dense": round(ms["weight_only_kept"] / ms["dense"], 2),
                         "kept_vs_weight_only": round(ms["weight_only_kept"] / ms["weight_only"], 3),
                         "bit_equal": same, "kept_bytes": DEQUANT_COPIES.bytes})
            del qt, qk
    print(f"{'shape':<18}{'dense ms':>9}{'w-only ms':>11}{'whole ms':>10}{'kept ms':>9}{'w-only/dense':>14}"
          f"{'whole/dense':>13}{'kept/dense':>12}{'kept/w-only':>13}  equal   ({args.dtype})")
    for r in rows:
        print(f"{r['shape']:<18}{r['dense']:>9.3f}{r['weight_only']:>11.3f}{r['weight_only_whole']:>10.3f}"
              f"{r['weight_only_kept']:>9.3f}{r['weight_only_vs_dense']:>14.2f}{r['whole_vs_dense']:>13.2f}"
              f"{r['kept_vs_dense']:>12.2f}{r['kept_vs_weight_only']:>13.3f}  {r['bit_equal']}")
    print(json.dumps({"bench": "dequant_copies", "dtype": args.dtype, "tokens": args.tokens,
                      "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "repeats": args.repeats,
                      "calls": args.calls, "torch": torch.__version__, "rows": rows}))
    return 0 if all(r["bit_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
