"""Benchmark: this checkout's quant/ against another checkout's (before vs after a change), side by side in one process.

    .venv/bin/python bench/compare_trees.py --base /path/to/other/checkout [--repeats 5] [--only NAME] [--skip-load]

The other checkout is imported as the package ``fp8_engram_base`` (a link in a temporary folder), this one as
``fp8_engram``; both run the same work in interleaved rounds, so a machine that is busy for a moment slows both
alike. CPU only.

- linear: the CPU shapes of ``bench/quant_linear.py`` (square 4096; Flux MLP up/down at 1024 and 4096 tokens),
  FP8 per-tensor weights, each tree's "auto" path (weight-only on the CPU for FP8 weights) and bf16 F.linear as
  the anchor; best of the rounds; ratio this/base (lower is better).
- load: a synthetic FP8 file (24 layers 3072x3072 per tensor, ``.weight_scale``, ~216 MiB) read by each tree's
  ``formats.load_file``, then every weight dequantized once to bf16: the loader's own work, without ComfyUI.

The last line printed is one JSON object: {"bench": "compare_trees", ...}.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]

SHAPES = [("square", 4096, 4096, 4096), ("flux-mlp-up", 1024, 3072, 12288), ("flux-mlp-down", 1024, 12288, 3072),
          ("flux-mlp-up", 4096, 3072, 12288), ("flux-mlp-down", 4096, 12288, 3072)]


def _trees(base: Path, tmp: Path) -> dict:
    (tmp / "fp8_engram").symlink_to(ROOT, target_is_directory=True)
    (tmp / "fp8_engram_base").symlink_to(base.resolve(), target_is_directory=True)
    sys.path.insert(0, str(tmp))
    out = {}
    for name, pkg in (("this", "fp8_engram"), ("base", "fp8_engram_base")):
        out[name] = importlib.import_module(f"{pkg}.quant")
        out[name].formats = importlib.import_module(f"{pkg}.quant.formats")
    return out


def _rounds(fns: dict, repeats: int) -> dict:
    best = {n: float("inf") for n in fns}
    for fn in fns.values():
        fn()
    for i in range(repeats):
        order = list(fns) if i % 2 == 0 else list(reversed(list(fns)))
        for name in order:
            t0 = time.perf_counter()
            fns[name]()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def bench_linear(trees: dict, repeats: int, only: str | None) -> list:
    rows = []
    g = torch.Generator().manual_seed(0)
    for name, tokens, in_f, out_f in SHAPES:
        if only and only not in name:
            continue
        w = (torch.randn(out_f, in_f, generator=g) * 0.02).to(torch.bfloat16)
        x = torch.randn(tokens, in_f, generator=g).to(torch.bfloat16)
        qs = {t: q.QuantizedTensor.from_float(w, q.PerTensor()) for t, q in trees.items()}
        assert torch.equal(qs["this"].qdata, qs["base"].qdata)
        with torch.no_grad():
            assert torch.equal(F.linear(x, qs["this"]), F.linear(x, qs["base"])), "the trees disagree"
            best = _rounds({"bf16": lambda: F.linear(x, w), "this": lambda: F.linear(x, qs["this"]),
                            "base": lambda: F.linear(x, qs["base"])}, repeats)
        row = {"shape": f"{name}{tokens}", "this_ms": round(best["this"] * 1e3, 1), "base_ms": round(best["base"] * 1e3, 1),
               "bf16_ms": round(best["bf16"] * 1e3, 1), "this_vs_base": round(best["this"] / best["base"], 3)}
        rows.append(row)
        sys.stdout.write(f"{row['shape']:<20}{row['bf16_ms']:>10}{row['base_ms']:>10}{row['this_ms']:>10}"
                         f"{row['this_vs_base']:>10}\n")
    return rows


def bench_load(trees: dict, repeats: int, tmp: Path) -> dict:
    from safetensors.torch import save_file

    path = tmp / "fp8_layers.safetensors"
    g = torch.Generator().manual_seed(1)
    sd = {}
    for i in range(24):
        w = torch.randn(3072, 3072, generator=g) * 0.02
        scale = w.abs().amax() / 448.0
        sd[f"blocks.{i}.proj.weight"] = (w / scale).to(torch.float8_e4m3fn)
        sd[f"blocks.{i}.proj.weight_scale"] = scale.reshape(())
        sd[f"blocks.{i}.proj.bias"] = torch.zeros(3072, dtype=torch.bfloat16)
    save_file(sd, str(path))
    del sd

    def load(q):
        def run():
            loaded, _ = q.formats.load_file(str(path))
            for v in loaded.values():
                if isinstance(v, q.QuantizedTensor):
                    v.dequantize(torch.bfloat16)
        return run

    best = _rounds({t: load(q) for t, q in trees.items()}, repeats)
    path.unlink()
    out = {"this_s": round(best["this"], 3), "base_s": round(best["base"], 3),
           "this_vs_base": round(best["this"] / best["base"], 3), "file_mib": round(24 * (3072 * 3072 + 4 + 6144) / 2**20)}
    sys.stdout.write(f"load + dequantize {out['file_mib']} MiB: base {out['base_s']} s, this {out['this_s']} s, "
                     f"this/base {out['this_vs_base']}\n")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="another checkout of the pack (the 'before')")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", default=None)
    ap.add_argument("--skip-load", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="compare_trees.") as tmp:
        trees = _trees(Path(args.base), Path(tmp))
        sys.stdout.write(f"threads={torch.get_num_threads()} torch={torch.__version__} repeats={args.repeats} "
                         f"loadavg={os.getloadavg()[0]:.2f}\n")
        sys.stdout.write(f"{'shape':<20}{'bf16 ms':>10}{'base ms':>10}{'this ms':>10}{'this/base':>10}\n")
        rows = bench_linear(trees, args.repeats, args.only)
        load = None if args.skip_load else bench_load(trees, max(2, args.repeats // 2), Path(tmp))
    sys.stdout.write(json.dumps({"bench": "compare_trees", "base": str(args.base), "repeats": args.repeats,
                                 "linear": rows, "load": load, "loadavg_after": round(os.getloadavg()[0], 2)}) + "\n")


if __name__ == "__main__":
    main()
