"""Benchmark: what a quantized linear costs the host per call, at shapes where the product itself is nothing.

On one CPU thread, per shape (tokens x in -> out; default 1x64x64, 16x64x64, 1x256x256, 16x3072x3072):
bf16 ``F.linear`` (the floor), ComfyUI 0.3.75's own ``QuantizedTensor`` linear on the same FP8 weight, and
the pack's ``F.linear`` on that weight in steady state (its route cached on the weight, its shape proven):
"auto" (the plain path where too small to prove; on a VNNI CPU int8 where proven faster) and "weight-only" (bit-equal to stock). Where kernels are fast (GPUs) this
per-call cost is the floor of a small-token step. Statistic: the median of ``--rounds`` interleaved rounds
of ``--calls`` calls each, in microseconds a call; the overhead is the time above bf16 ``F.linear``.

    .venv/bin/python bench/linear_overhead.py [--rounds 15] [--calls 2000] [--shapes 1x64x64,16x64x64]

The last line printed is one JSON object: {"bench": "linear_overhead", ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / ".host" / "pkg"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_engram.quant import ComputeConfig, PerTensor, QuantizedTensor  # noqa: E402
from quant_linear import load_comfy_quant_ops  # noqa: E402

DEFAULT_SHAPES = "1x64x64,16x64x64,1x256x256,16x3072x3072"


def per_call_us(fns: dict, rounds: int, calls: int) -> dict:
    """Median over interleaved rounds of the mean microseconds a call of each fn."""
    samples = {name: [] for name in fns}
    with torch.inference_mode():  # as ComfyUI runs nodes
        for fn in fns.values():
            for _ in range(calls // 10 + 1):
                fn()
        for _ in range(rounds):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                samples[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {name: statistics.median(v) for name, v in samples.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    args = ap.parse_args()
    torch.set_num_threads(1)
    quant_ops = load_comfy_quant_ops("cpu")
    rows = []
    print(f"{'shape':<16}{'bf16 us':>10}{'stock us':>10}{'auto us':>10}{'w-only us':>11}"
          f"{'stock over':>12}{'auto over':>11}{'auto/stock':>12}")
    for text in args.shapes.split(","):
        m, k, n = (int(v) for v in text.split("x"))
        g = torch.Generator().manual_seed(0)
        w = torch.randn(n, k, generator=g) * 0.05
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        wb = w.to(torch.bfloat16)
        auto = QuantizedTensor.from_float(w, PerTensor(), config=ComputeConfig())
        wonly = auto.with_config(ComputeConfig(path="weight_only"))
        fns = {"bf16": lambda: F.linear(x, wb), "auto": lambda: F.linear(x, auto),
               "weight-only": lambda: F.linear(x, wonly)}
        if quant_ops is not None:
            cq = quant_ops.QuantizedTensor(auto.qdata, "TensorCoreFP8Layout",
                                           {"scale": auto.scale, "orig_dtype": torch.bfloat16})
            fns["stock"] = lambda: F.linear(x, cq)
            with torch.inference_mode():
                assert torch.equal(F.linear(x, cq), F.linear(x, wonly)), "ours and ComfyUI disagree"
        us = per_call_us(fns, args.rounds, args.calls)
        row = {"shape": text, **{k_: round(v, 2) for k_, v in us.items()},
               "auto_overhead_us": round(us["auto"] - us["bf16"], 2)}
        if "stock" in us:
            row["stock_overhead_us"] = round(us["stock"] - us["bf16"], 2)
            row["auto_vs_stock"] = round(us["auto"] / us["stock"], 3)
        rows.append(row)
        print(f"{text:<16}{us['bf16']:>10.1f}{us.get('stock', float('nan')):>10.1f}{us['auto']:>10.1f}"
              f"{us['weight-only']:>11.1f}{row.get('stock_overhead_us', float('nan')):>12.1f}"
              f"{row['auto_overhead_us']:>11.1f}{row.get('auto_vs_stock', float('nan')):>12.3f}")
    print(json.dumps({"bench": "linear_overhead", "threads": 1, "rounds": args.rounds, "calls": args.calls,
                      "loadavg": round(os.getloadavg()[0], 2), "comfyui": quant_ops is not None, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
