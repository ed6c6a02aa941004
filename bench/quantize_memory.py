"""Peak memory of quantizing a ~1 GiB bf16 model to FP8, against the model's size.

Each variant runs in its own fresh subprocess: it builds a random bf16 model of `--layers` linear
layers of `--width` x `--width` (32 x 4096 x 4096 = 1 GiB by default), records the process's RSS,
quantizes per tensor (e4m3fn, SQNR per layer as the node reports it), and reports the peak RSS
(ru_maxrss) above the RSS measured right before the model was made, as a multiple of the model's bytes.

- model only:            the model alone (what any variant must hold at least: 1.0x)
- state dict, released:  `quantize_state_dict(..., release_source=True)` (each source weight freed as
                         soon as it is quantized: the converter's and a script's path)
- state dict, kept:      `quantize_state_dict` with the caller keeping its dict (model + all FP8 copies)
- module (node):         `quantize_module` over an nn.Module, the Quantize Model node's path: the module
                         keeps its weights (ComfyUI's cache holds the loader's model), FP8 copies are added
- module, old SQNR:      the same with the previous SQNR measurement (whole-layer float64 copies), to
                         show what one layer's temporaries cost before

    python bench/quantize_memory.py [--layers 32] [--width 4096]

Prints a table and, as the last line, one JSON object {"bench": "quantize_memory", ...}.
The default 1 GiB run takes several minutes on a shared 2-core machine; `--layers 4` checks the
script in under a minute (there one layer's temporaries are a quarter of the model, so the ratios
are larger).

Measured (2-core CPU shared with other jobs, load ~10, 1 GiB = 32 x 4096x4096 bf16): peak RSS above
the start, as a multiple of the model's bytes: model only 1.00, state dict released 1.23, state dict
kept 1.67, module (node) 1.65, module with the old SQNR measurement 2.01. So the node holds the model,
its FP8 copy (0.5x) and one layer's temporaries (~0.15x); no second full-precision copy.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("model_only", "state_dict_released", "state_dict_kept", "module_node", "module_old_sqnr")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_variant(variant: str, layers: int, width: int) -> dict:
    sys.path.insert(0, str(ROOT / ".host" / "pkg"))
    import math

    import torch

    from fp8_engram.quant import quantize_model as qm

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    base = rss_bytes()
    g = torch.Generator().manual_seed(0)
    model_bytes = layers * width * width * 2
    if variant.startswith("module"):
        module = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False, dtype=torch.bfloat16) for _ in range(layers)])
        with torch.no_grad():
            for m in module:
                m.weight.normal_(generator=g)
    else:
        sd = {f"blocks.{i}.fc.weight": torch.randn(width, width, generator=g, dtype=torch.bfloat16) for i in range(layers)}
    after_model = rss_bytes()
    if variant == "module_old_sqnr":
        def old_sqnr(ref, approx):
            ref = ref.double()
            err = (ref - approx.double()).norm()
            return math.inf if float(err) == 0.0 else float(20 * torch.log10(ref.norm() / err))

        qm.sqnr_db = old_sqnr
    t0 = time.perf_counter()
    if variant == "state_dict_released":
        out, report = qm.quantize_state_dict(sd, keep=(), release_source=True)
    elif variant == "state_dict_kept":
        out, report = qm.quantize_state_dict(sd, keep=())
    elif variant.startswith("module"):
        out, report = qm.quantize_module(module, keep=())
    else:
        out, report = {}, None
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"variant": variant, "model_bytes": model_bytes, "model_rss_x": round((after_model - base) / model_bytes, 3),
            "peak_above_base_x": round((peak - base) / model_bytes, 3), "seconds": round(seconds, 2),
            "layers_quantized": len(report.quantized) if report else 0,
            "sqnr_min_db": report.summary()["sqnr_db_min"] if report else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.layers, args.width)))
        return 0
    rows = []
    for variant in VARIANTS:
        done = subprocess.run([sys.executable, __file__, "--variant", variant, "--layers", str(args.layers),
                               "--width", str(args.width)], capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    gib = rows[0]["model_bytes"] / 2**30
    print(f"quantizing a {gib:.2f} GiB bf16 model ({args.layers} x {args.width}x{args.width}) to FP8 e4m3fn per tensor")
    print(f"{'variant':<22}{'peak RSS above start':>22}{'seconds':>9}{'min SQNR dB':>13}")
    for r in rows:
        print(f"{r['variant']:<22}{r['peak_above_base_x']:>18.3f} x model{r['seconds']:>9.2f}{str(r['sqnr_min_db']):>13}")
    by = {r["variant"]: r for r in rows}
    print(json.dumps({"bench": "quantize_memory", "model_gib": round(gib, 3),
                      **{f"peak_x_{k}": v["peak_above_base_x"] for k, v in by.items()},
                      **{f"seconds_{k}": v["seconds"] for k, v in by.items() if k != "model_only"}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
