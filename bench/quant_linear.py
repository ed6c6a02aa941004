"""Benchmark: FP8 QuantizedTensor linear vs bf16 F.linear, side by side in one process.

CPU (default without a GPU): a square 4096 case and Flux-like MLP shapes; bf16 F.linear vs our
weight-only path, vs what the loaders give a user here ("ours auto (chosen)": the file's FP8 weight under
"auto": per token class the path proven and measured fastest, see quant/compute/prove.py, an int8 form made
at the first call of a class that chose int8; its first call, which proves, is the warm-up), and vs
ComfyUI 0.3.75's own QuantizedTensor linear on the same FP8 weights, when a ComfyUI tree is present.
Statistic: best of N interleaved rounds (wall clock); printed as the time ratio (variant / bf16, lower is
better) and the speedup (bf16 / variant, higher is better).

CUDA (``--device cuda``): the shapes of issue 10 (Flux 4608 tokens, 1024 and 256 tokens, Wan-14B
FFN) with bias, timed with CUDA events in interleaved rounds; statistic: median over rounds of the
mean time per call. Variants: bf16 F.linear (anchor), the scaled_mm floor (pre-quantized
activation), ours auto / static input_scale / dynamic per tensor / weight-only (forced, plus its
fused-GEMM and dequantize+cuBLAS halves), comfy_kitchen's FP8 QuantizedTensor (when it imports),
torchao float8 dynamic (when it imports). Each variant's output SQNR vs float64 (on the first
rows). Then a whole Flux-sized double block (linears + attention + norms), bf16 vs our FP8.

    .venv/bin/python bench/quant_linear.py [--device cpu|cuda] [--repeats N] [--quick] [--int8] [--forced-fp8]

``--int8``: the INT8 path instead (see ``bench/_quant_linear_int8.py``): the four Flux shapes, bf16 /
weight-only / int8 (rotated and not) / fp32 and ``_int_mm`` alone on the CPU / fp8 x fp8 per row on
FP8 GPUs, time ratios to bf16 and SQNR vs float64 on Gaussian and outlier activations.

The last line printed is one JSON object: {"bench": "quant_linear", ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / ".host" / "pkg"
COMFYUI = Path(os.environ.get("COMFYUI_PATH", ROOT / ".host" / "comfyui"))
sys.path.insert(0, str(PKG))

from fp8_engram.quant import Block, ComputeConfig, PerRow, PerTensor, QuantizedTensor  # noqa: E402
from fp8_engram.quant.compute import default_book  # noqa: E402
from fp8_engram.quant.quantize_model import sqnr_db  # noqa: E402


def load_comfy_quant_ops(device: str):
    if not (COMFYUI / "comfy" / "quant_ops.py").is_file():
        return None
    sys.path.insert(0, str(COMFYUI))
    import comfy.cli_args

    comfy.cli_args.args.cpu = device == "cpu"
    import comfy.quant_ops as quant_ops

    return quant_ops


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_round_robin(fns: dict, repeats: int, device: str) -> dict:
    """Run every fn once to warm up, then `repeats` interleaved rounds; seconds per call."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    sync(device)
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return times


def _sqnr(ref: torch.Tensor, y: torch.Tensor) -> float:
    return round(sqnr_db(ref, y), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="small shapes only (smoke test)")
    ap.add_argument("--only", default=None, help="run only the shapes whose name contains this")
    ap.add_argument("--int8", action="store_true",
                    help="the INT8 path vs bf16 / weight-only / fp8 per row on the Flux shapes, with SQNR on "
                    "Gaussian and outlier activations (bench/_quant_linear_int8.py)")
    ap.add_argument("--forced-fp8", action="store_true",
                    help="also measure the SQNR of fp8 x fp8 forced where the device has no FP8 units (the CPU: "
                    "torch._scaled_mm there is exact but takes minutes per shape, proof included); on FP8 GPUs "
                    "it is always measured")
    args = ap.parse_args()
    device = args.device
    if args.int8:
        from _quant_linear_int8 import main_int8  # bench/_quant_linear_int8.py

        print(json.dumps(main_int8(args)))
        return
    if device == "cuda":
        from _quant_linear_cuda import main_cuda  # bench/_quant_linear_cuda.py

        main_cuda(args)
        return
    repeats = args.repeats or (3 if device == "cpu" else 20)
    load_before = os.getloadavg()[0]

    if args.quick:
        shapes = [("square", 256, 512, 512), ("flux-mlp-up", 128, 384, 1536)]
    else:
        shapes = [
            ("square", 4096, 4096, 4096),
            ("flux-mlp-up", 1024, 3072, 12288),
            ("flux-mlp-down", 1024, 12288, 3072),
            ("flux-mlp-up", 4096, 3072, 12288),
            ("flux-mlp-down", 4096, 12288, 3072),
        ]
    if args.only:
        shapes = [sh for sh in shapes if args.only in sh[0]]
    quant_ops = load_comfy_quant_ops(device)
    fp8_units = device == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
    print(f"device={device} threads={torch.get_num_threads()} torch={torch.__version__} "
          f"repeats={repeats} loadavg={load_before:.2f} comfyui={'yes' if quant_ops else 'absent'} fp8_units={fp8_units}")

    header = (f"{'shape':14s} {'tokens':>6s} {'in':>6s} {'out':>6s} {'variant':22s} {'best ms':>9s} "
              f"{'median ms':>10s} {'time/bf16':>9s} {'speedup':>8s}")
    print(header)
    print("-" * len(header))
    results = []
    g = torch.Generator().manual_seed(0)
    for name, tokens, in_f, out_f in shapes:
        w = (torch.randn(out_f, in_f, generator=g) * 0.02).to(torch.bfloat16).to(device)
        x = torch.randn(tokens, in_f, generator=g).to(torch.bfloat16).to(device)
        ours_pt = QuantizedTensor.from_float(w, PerTensor(), config=ComputeConfig(path="weight_only"))
        fns = {"bf16 F.linear": lambda: F.linear(x, w)}
        fns["ours weight-only/tensor"] = lambda: F.linear(x, ours_pt)
        if device == "cpu":  # as the loaders give it (nodes/ops.py): the file's FP8 weight under "auto", which
            # converts to int8 at the first call of a token class that proves int8 faster (keeping the FP8 form)
            chosen = ours_pt.with_config(ComputeConfig())
            fns["ours auto (chosen)"] = lambda: F.linear(x, chosen)
        if quant_ops is not None:
            cq = quant_ops.QuantizedTensor(ours_pt.qdata, "TensorCoreFP8Layout",
                                           {"scale": ours_pt.scale, "orig_dtype": torch.bfloat16})
            fns["comfyui 0.3.75"] = lambda: F.linear(x, cq)
        if name == "square" or args.quick:
            for label, layout in (("row", PerRow()), ("block128", Block(128, 128)),
                                  ("block1x64", Block(1, 64))):
                qt = QuantizedTensor.from_float(w, layout, config=ComputeConfig(path="weight_only"))
                fns[f"ours weight-only/{label}"] = (lambda q: lambda: F.linear(x, q))(qt)
        if fp8_units:
            for scaling in ("dynamic_tensor", "dynamic_row"):
                qt = ours_pt.with_config(ComputeConfig(path="fp8", activation_scaling=scaling))
                fns[f"ours fp8xfp8/{scaling}"] = (lambda q: lambda: F.linear(x, q))(qt)
        with torch.inference_mode():
            if quant_ops is not None:  # same FP8 data, so the outputs must agree exactly
                ours_out, comfy_out = F.linear(x, ours_pt), F.linear(x, cq)
                assert torch.equal(ours_out, comfy_out), "ours and ComfyUI disagree"
            # the big CPU cases take seconds per call; the others get more rounds against noise
            n = repeats if device != "cpu" or args.repeats or tokens * in_f * out_f > 1e11 \
                else repeats + 2
            times = time_round_robin(fns, n, device)
        base_best = min(times["bf16 F.linear"])
        row = {"shape": name, "tokens": tokens, "in": in_f, "out": out_f}
        for variant, ts in times.items():
            best, med = min(ts), statistics.median(ts)
            print(f"{name:14s} {tokens:6d} {in_f:6d} {out_f:6d} {variant:22s} {best * 1e3:9.1f} "
                  f"{med * 1e3:10.1f} {best / base_best:9.3f} {base_best / best:8.3f}")
            row[f"ms[{variant}]"] = round(best * 1e3, 2)
        row["ours_vs_bf16"] = round(min(times["ours weight-only/tensor"]) / base_best, 3)
        row["ours_speedup"] = round(base_best / min(times["ours weight-only/tensor"]), 3)
        with torch.inference_mode():  # accuracy on the first rows (float64 is slow on the CPU)
            xs = x[:64]
            ref = F.linear(xs.double(), w.double())
            row["sqnr_db"] = {
                "bf16": _sqnr(ref, F.linear(xs, w)),
                "weight-only": _sqnr(ref, F.linear(xs, ours_pt)),
            }
            if fp8_units or args.forced_fp8:
                for scaling in ("dynamic_row", "dynamic_tensor"):
                    row["sqnr_db"][f"fp8 forced ({scaling.replace('_', ' ')})"] = _sqnr(ref, F.linear(
                        xs, ours_pt.with_config(ComputeConfig(path="fp8", activation_scaling=scaling))))
            if "ours auto (chosen)" in fns:
                row["sqnr_db"]["auto (chosen)"] = _sqnr(ref, F.linear(xs, chosen))
        print("SQNR vs float64 (dB, first 64 rows): " + ", ".join(
            f"{k} {v}" for k, v in row["sqnr_db"].items()))
        if quant_ops is not None:
            row["ours_vs_comfyui"] = round(min(times["ours weight-only/tensor"])
                                           / min(times["comfyui 0.3.75"]), 3)
            row["comfyui_vs_bf16"] = round(min(times["comfyui 0.3.75"]) / base_best, 3)
            if "ours auto (chosen)" in times:
                row["auto_vs_comfyui"] = round(min(times["ours auto (chosen)"]) / min(times["comfyui 0.3.75"]), 3)
        if "ours auto (chosen)" in times:
            row["auto_vs_bf16"] = round(min(times["ours auto (chosen)"]) / base_best, 3)
            row["auto_vs_weight_only"] = round(min(times["ours auto (chosen)"]) / min(times["ours weight-only/tensor"]), 3)
        if fp8_units:
            row["bf16_vs_fp8xfp8_speedup"] = round(
                base_best / min(times["ours fp8xfp8/dynamic_tensor"]), 3)
        for label in ("row", "block128", "block1x64"):
            key = f"ours weight-only/{label}"
            if key in times:
                row[f"ours_{label}_vs_bf16"] = round(min(times[key]) / base_best, 3)
        results.append(row)
        print()
        del w, x, ours_pt, fns
        chosen = None

    summary = {"bench": "quant_linear", "device": device, "threads": torch.get_num_threads(),
               "repeats": repeats, "loadavg_1min": [round(load_before, 2),
                                                    round(os.getloadavg()[0], 2)],
               "comfyui": quant_ops is not None, "fp8_units": fp8_units,
               "statistic": "ratio of best-of-N times (interleaved); speedup = bf16 / variant",
               "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
               "cases": results, "chosen": default_book().summary_lines(torch.device(device)) if device == "cpu" else None}
    print("ratios: ours/bf16 " + ", ".join(f"{r['shape']}@{r['tokens']}={r['ours_vs_bf16']}" for r in results))
    if quant_ops is not None:
        print("ratios: ours/comfyui " + ", ".join(
            f"{r['shape']}@{r['tokens']}={r['ours_vs_comfyui']}" for r in results))
        if device == "cpu":
            print("ratios: auto (chosen)/comfyui " + ", ".join(
                f"{r['shape']}@{r['tokens']}={r['auto_vs_comfyui']}" for r in results))
    for line in summary["chosen"] or []:
        print(f"chosen: {line}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
