"""The INT8 half of bench/quant_linear.py (run that script with ``--int8``; CPU or ``--device cuda``).

On the four Flux shapes (tokens x in -> out, with bias): bf16 ``F.linear`` (the anchor), the
weight-only path, the int8 path (weights converted once from a per-row FP8 weight, 128-wide
Hadamard rotation; and without rotation), and on the CPU float32 ``F.linear`` (what ComfyUI computes
in there) and ``torch._int_mm`` alone (the int8 GEMM's floor); fp8 x fp8 per row where the device
has FP8 units (its CPU kernel is ~5x bf16 and is measured for accuracy only). Times: interleaved
rounds, median and best, as ratios to bf16's median. Accuracy: SQNR (dB) against the float64 product
of the FP8 weight (what the file holds) on the first rows, for Gaussian activations and for
activations with 8 outlier channels x60, for every variant including fp8 x fp8 per row.
On a GPU without INT8-only hardware (H100/H200) the int8 rows stand in for Ampere's INT8 units.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.nn.functional as F

from fp8_engram.quant import ComputeConfig, PerRow, QuantizedTensor, linear
from fp8_engram.quant.compute.int8 import int8_supported, to_int8
from fp8_engram.quant.kernels.int8_mm import quantize_rows_int8

SHAPES = [("flux-proj", 1024, 3072, 3072), ("flux-proj", 4608, 3072, 3072),
          ("flux-mlp-up", 256, 3072, 12288), ("flux-mlp-down", 1024, 12288, 3072)]
QUICK_SHAPES = [("small", 256, 512, 1024), ("small", 64, 1024, 512)]
SQNR_ROWS = 64


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _time(fns: dict, rounds: int, device: str, inner: int) -> dict:
    for fn in fns.values():
        fn()
    _sync(device)
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            _sync(device)
            times[name].append((time.perf_counter() - t0) / inner)
    return times


def activations(tokens, in_f, outliers: bool, g, device):
    x = torch.randn(tokens, in_f, generator=g)
    if outliers:
        idx = torch.randperm(in_f, generator=g)[:8]
        x[:, idx] *= 60.0
    return x.to(torch.bfloat16).to(device)


def _sqnr(ref, y) -> float:
    ref = ref.double()
    return round(float(20 * torch.log10(ref.norm() / (ref - y.double()).norm())), 2)


def bench_shape(name, tokens, in_f, out_f, rounds, device, g, fp8_units):
    w = (torch.randn(out_f, in_f, generator=g) * 0.02).to(torch.bfloat16).to(device)
    b = (torch.randn(out_f, generator=g) * 0.1).to(torch.bfloat16).to(device)
    fp8 = QuantizedTensor.from_float(w, PerRow())  # the "file": per-row FP8
    wq = fp8.dequantize(torch.bfloat16)  # bf16 runs the same weights the file holds
    w8 = to_int8(fp8)
    w8_plain = to_int8(fp8, rotation=0)
    cfg = {"wo": ComputeConfig(path="weight_only"), "int8": ComputeConfig(path="int8"),
           "fp8": ComputeConfig(path="fp8", activation_scaling="dynamic_row")}
    row = {"shape": name, "tokens": tokens, "in": in_f, "out": out_f, "sqnr_db": {}}
    for kind in ("gaussian", "outliers"):
        x = activations(tokens, in_f, kind == "outliers", g, device)
        with torch.inference_mode():
            xs = x[:SQNR_ROWS]
            ref = F.linear(xs.double(), fp8.dequantize(torch.float64), b.double())
            row["sqnr_db"][kind] = {
                "bf16": _sqnr(ref, F.linear(xs, wq, b)),
                "weight-only": _sqnr(ref, linear(xs, fp8, b, cfg["wo"])),
                "int8": _sqnr(ref, linear(xs, w8, b, cfg["int8"])),
                "int8 no rotation": _sqnr(ref, linear(xs, w8_plain, b, cfg["int8"])),
                "fp8xfp8 per-row": _sqnr(ref, linear(xs, fp8, b, cfg["fp8"])),
            }
    # timing on the outlier activations (the values do not change the cost)
    fns = {"bf16": lambda: F.linear(x, wq, b),
           "weight-only": lambda: linear(x, fp8, b, cfg["wo"]),
           "int8": lambda: linear(x, w8, b, cfg["int8"]),
           "int8 no rotation": lambda: linear(x, w8_plain, b, cfg["int8"])}
    if device == "cpu":
        xf, wf, bf = x.float(), wq.float(), b.float()
        xq8, _ = quantize_rows_int8(x)
        fns["fp32"] = lambda: F.linear(xf, wf, bf)
        fns["_int_mm alone"] = lambda: torch._int_mm(xq8, w8.qdata.t())
    if fp8_units:
        fns["fp8xfp8 per-row"] = lambda: linear(x, fp8, b, cfg["fp8"])
    inner = 1 if device == "cpu" else 10
    with torch.inference_mode():
        times = _time(fns, rounds, device, inner)
    base = statistics.median(times["bf16"])
    row["ms_median"] = {k: round(statistics.median(v) * 1e3, 3) for k, v in times.items()}
    row["ratio_median"] = {k: round(statistics.median(v) / base, 3) for k, v in times.items()}
    row["ratio_best"] = {k: round(min(v) / min(times["bf16"]), 3) for k, v in times.items()}
    return row


def main_int8(args):
    device = args.device
    rounds = args.repeats or (5 if device == "cpu" else 20)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.only:
        shapes = [s for s in shapes if args.only in s[0]]
    fp8_units = device == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
    cap = (torch.backends.cpu.get_cpu_capability() if device == "cpu"
           else "sm_%d%d" % torch.cuda.get_device_capability())
    load = os.getloadavg()[0]
    print(f"int8 bench: device={device} ({cap}) threads={torch.get_num_threads()} torch={torch.__version__} "
          f"rounds={rounds} loadavg={load:.2f} int8_auto={int8_supported(device)}"
          + (" (an FP8 GPU's INT8 units stand in for Ampere's)" if fp8_units else ""))
    g = torch.Generator().manual_seed(0)
    rows = []
    for name, tokens, in_f, out_f in shapes:
        row = bench_shape(name, tokens, in_f, out_f, rounds, device, g, fp8_units)
        rows.append(row)
        print(f"\n{name} {tokens}x{in_f}->{out_f}   time/bf16 (median; best)   ms median")
        for k in row["ms_median"]:
            print(f"  {k:18s} {row['ratio_median'][k]:7.3f} ({row['ratio_best'][k]:.3f})   {row['ms_median'][k]:10.2f}")
        print(f"  SQNR dB vs float64 {'':6s}" + " ".join(f"{k:>17s}" for k in row["sqnr_db"]["gaussian"]))
        for kind, vals in row["sqnr_db"].items():
            print(f"  {kind:24s}" + " ".join(f"{v:17.2f}" for v in vals.values()))
    return {"bench": "quant_linear_int8", "device": device, "capability": cap, "threads": torch.get_num_threads(),
            "rounds": rounds, "int8_auto": int8_supported(device), "fp8_units": fp8_units,
            "loadavg_1min": [round(load, 2), round(os.getloadavg()[0], 2)],
            "statistic": "time ratio to bf16 F.linear (median of interleaved rounds; best in ratio_best)",
            "cases": rows}
