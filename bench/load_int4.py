"""Load benchmark of a Qwen-Image int4 bundle (issue 38) against the same model in bf16.

Makes two synthetic Qwen-Image files in a temporary folder, of the released width (3072: ComfyUI's detection
fixes Qwen-Image to 24 heads of 128) with `--blocks` blocks (ComfyUI reads the count from the file; the
released model has 60):
- `bf16`: every tensor bf16;
- `int4`: the layout of the published int4 bundles and of tests/integration/test_qwen_image_int4_bundle_server.py:
  the blocks' modulation linears (`img_mod.1`, `txt_mod.1`) in AWQ W4A16 (group 64), their attention and MLP
  linears in SVDQuant W4A4 (rank 32, tile-packed), everything else bf16; codes, scales and low-rank factors
  are drawn directly (seeded), at magnitudes that give weights of about the bf16 model's size.
Each loader then runs in a fresh subprocess, as bench/load.py does: time to load, time until the model has
run its first sampling step (load + first step: files are mapped or read lazily, so a load alone can
measure too little), and peak RSS (ru_maxrss) above the process baseline measured after imports.
- `stock_bf16`: stock ComfyUI (`comfy.sd.load_diffusion_model`, what UNETLoader runs) on the bf16 file;
- `pack_int4`: the pack's loader (`formats.load_file` + ComfyUI's construction with the pack's operations,
  what Load FP8 Diffusion Model runs) on the int4 bundle;
- `pack_bf16`: the pack's loader on the bf16 file (what the format alone changes, the loader held fixed).
Ratios are of the best of `--repeats` interleaved runs, all from the same run of this script.

    python bench/load_int4.py [--blocks 2] [--repeats 2] [--keep-dir DIR]

Prints a table and, as the last line, one JSON object {"bench": "load_int4", ...}. The files are deleted at
the end unless --keep-dir. On a CPU ComfyUI computes in float32, so a bf16 model is widened when it loads
(its peak RSS is about twice the file) while the int4 layers stay packed and are dequantized per matmul.

Measured (the shared 2-core CPU, busy with 3 other sessions: load average 2.9-5.2; --blocks 2: 1.34 GiB bf16,
0.43 GiB int4 = 0.32x; best of 3 interleaved runs; CPU seconds in brackets):
  load        pack int4 4.43 s [2.91], stock bf16 2.27 s [1.51] (1.95x, CPU 1.94x), pack bf16 3.49 s [2.37]
              (1.27x, CPU 1.23x): stock maps the file and reads it during the first step; the pack reads it
              into its own memory and checks every int4 part first
  to 1st step pack int4 12.27 s [8.05], stock bf16 3.88 s [2.59] (3.2x, CPU 3.1x), pack bf16 4.90 s [3.30]
              (2.5x): the int4 layers are dequantized for every matmul, SVDQuant's effective weight with its
              low-rank product formed in float32 (5.0 s of the step's 7.7 s under cProfile), and nothing
              is cached between steps
  peak RSS above baseline: pack int4 882 MiB, stock bf16 4125 MiB (0.21x; after the load alone 623 MiB,
              0.15x), pack bf16 4143 MiB (0.21x); ComfyUI widens a bf16 model to float32 on the CPU
Wall times swing with the other sessions (an earlier run, quieter, gave pack int4 0.86 s to load and 3.08 s
to the first step; another 4.46 s and 11.48 s): compare the CPU-time ratios; the RSS ratio held at 0.21-0.23.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT, TOKENS, RANK = 3584, 8, 32
LOADERS = ("stock_bf16", "pack_int4", "pack_bf16")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import load  # noqa: E402  (the same child runner)
from load import rss_mb, setup_paths  # noqa: E402  (the same ComfyUI paths and RSS reader)

logger = logging.getLogger("bench.load_int4")


def int4_kind(key: str, shape: tuple) -> str | None:
    """The int4 format the bundle gives this tensor's layer (None: kept bf16); the test's rule."""
    if not key.endswith(".weight") or len(shape) != 2 or not key.startswith("transformer_blocks."):
        return None
    if "_mod." in key:
        return "awq_w4a16"
    if (".attn." in key or "_mlp." in key) and shape[0] % 128 == 0 and shape[1] % 64 == 0:
        return "svdquant_w4a4"
    return None


def model_shapes(blocks: int) -> dict[str, tuple]:
    setup_paths()
    import comfy.ops
    import torch
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel

    with torch.device("meta"):
        model = QwenImageTransformer2DModel(num_layers=blocks, image_model="qwen_image", dtype=torch.bfloat16,
                                            device="meta", operations=comfy.ops.disable_weight_init)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _json_bytes(conf: dict):
    import torch

    return torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)


def make_files(folder: Path, blocks: int) -> dict[str, Path]:
    """Stream the bf16 model and its int4 bundle into `folder` (one tensor in memory at a time)."""
    import torch

    from fp8_engram.quant import save
    from fp8_engram.quant.layouts import awq, svdquant

    shapes = model_shapes(blocks)
    gen = torch.Generator().manual_seed(0)

    def plain(name, shape):
        if name.endswith(".weight") and len(shape) >= 2:
            return (torch.randn(shape, generator=gen) * shape[-1] ** -0.5).to(torch.bfloat16)
        if "norm" in name:
            return torch.ones(shape, dtype=torch.bfloat16)
        return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)

    bf16 = [(k, torch.bfloat16, s) for k, s in shapes.items()]
    int4, parts = [], {}
    for k, s in shapes.items():
        kind = int4_kind(k, s)
        if kind is None:
            int4.append((k, torch.bfloat16, s))
            continue
        layer, (n, kk) = k[: -len(".weight")], s
        if kind == "awq_w4a16":
            conf = {"format": awq.FORMAT, "group_size": 64}
            layer_parts = {".weight": (torch.int8, (n, kk // 2)), ".weight_scale": (torch.bfloat16, (kk // 64, n)),
                           ".weight_zeros": (torch.bfloat16, (kk // 64, n))}
        else:
            conf = {"format": svdquant.FORMAT, "layout": svdquant.TILE_LAYOUT}
            layer_parts = {".weight": (torch.int8, (n // 128, kk // 64, 32, 128)),
                           ".weight_scale": (torch.bfloat16, (n // 128, kk // 64, 128)),
                           ".smooth_factor": (torch.bfloat16, (kk,)), ".proj_down": (torch.bfloat16, (kk, RANK)),
                           ".proj_up": (torch.bfloat16, (n // 128, RANK, 128))}
        blob = _json_bytes(conf)
        layer_parts[".comfy_quant"] = (torch.uint8, tuple(blob.shape))
        for suffix, (dt, shape) in layer_parts.items():
            int4.append((layer + suffix, dt, shape))
            parts[layer + suffix] = (kind, kk, blob)

    int4_entries = {name: (dt, shape) for name, dt, shape in int4}

    def get_int4(name):
        dt, shape = int4_entries[name]
        if name not in parts:
            return plain(name, shape)
        kind, k, blob = parts[name]
        if name.endswith(".comfy_quant"):
            return blob
        if dt == torch.int8:  # random nibbles: uniform codes, std about 4.6 code steps
            return torch.randint(-128, 128, shape, generator=gen, dtype=torch.int16).to(torch.int8)
        step = k ** -0.5 / 4.6  # a code step that gives weights of std ~ 1/sqrt(fan_in)
        if name.endswith(".weight_scale"):
            return (step * (0.5 + torch.rand(shape, generator=gen))).to(torch.bfloat16)
        if name.endswith(".weight_zeros"):
            return (0.1 * step * torch.randn(shape, generator=gen)).to(torch.bfloat16)
        if name.endswith(".smooth_factor"):
            return (0.5 + torch.rand(shape, generator=gen)).to(torch.bfloat16)
        return (0.1 * shape[-2 if name.endswith(".proj_down") else -1] ** -0.5
                * torch.randn(shape, generator=gen)).to(torch.bfloat16)

    paths = {"bf16": folder / f"qwen_image_b{blocks}_bf16.safetensors",
             "int4": folder / f"qwen_image_b{blocks}_int4.safetensors"}
    if not paths["bf16"].exists():
        save.write_safetensors(paths["bf16"], bf16, lambda name: plain(name, shapes[name]))
    if not paths["int4"].exists():
        save.write_safetensors(paths["int4"], int4, get_int4)
    return paths


def child(loader: str, path: str) -> None:
    setup_paths()
    import comfy.model_management
    import comfy.sample
    import comfy.sd
    import torch

    baseline = rss_mb()
    noise = torch.randn(1, 16, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    latent = torch.zeros(1, 16, 1, 16, 16)
    cond = [[torch.randn(1, TOKENS, TEXT, generator=torch.Generator().manual_seed(1)), {}]]
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        if loader == "stock_bf16":
            model = comfy.sd.load_diffusion_model(path)
        else:
            from fp8_engram.nodes.ops import make_fp8_ops
            from fp8_engram.quant import ComputeConfig, formats

            cfg = ComputeConfig()
            sd, report = formats.load_file(path, config=cfg)
            model = comfy.sd.load_diffusion_model_state_dict(sd, model_options={"custom_operations": make_fp8_ops(cfg)})
            del sd
        t_load, c_load = time.perf_counter() - t0, time.process_time() - c0
        peak_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        out = comfy.sample.sample(model, noise, 1, 1.0, "euler", "simple", cond, cond, latent, seed=0,
                                  disable_pbar=True)
        t_first, c_first = time.perf_counter() - t0, time.process_time() - c0
    if not bool(torch.isfinite(out).all()):
        raise SystemExit(f"{loader}: the first step gave inf or NaN")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
    # CPU seconds beside wall seconds: less sensitive to the other processes of a shared machine
    sys.stdout.write(json.dumps({"loader": loader, "load_s": t_load, "first_step_s": t_first, "load_cpu_s": c_load,
                                 "first_step_cpu_s": c_first, "baseline_mb": baseline,
                      "peak_load_mb": peak_load, "peak_mb": peak}) + "\n")


def run_child(loader: str, path: Path) -> dict:
    return load.run_child(loader, path, __file__)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=2, help="transformer blocks of width 3072 (~0.7 GB of bf16 each)")
    p.add_argument("--repeats", type=int, default=2, help="runs per loader, interleaved (order alternates)")
    p.add_argument("--keep-dir", help="make the files here and keep them (default: a temp dir, deleted)")
    p.add_argument("--child", nargs=2, metavar=("LOADER", "FILE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(*args.child)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    setup_paths()
    folder = Path(args.keep_dir) if args.keep_dir else Path(tempfile.mkdtemp(prefix="fp8_bench_load_int4_"))
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    try:
        t = time.perf_counter()
        paths = make_files(folder, args.blocks)
        sizes = {k: v.stat().st_size for k, v in paths.items()}
        logger.info("files: bf16 %.2f GiB, int4 %.2f GiB (made in %.1f s)", sizes["bf16"] / 2**30,
                    sizes["int4"] / 2**30, time.perf_counter() - t)
        file_of = {"stock_bf16": paths["bf16"], "pack_int4": paths["int4"], "pack_bf16": paths["bf16"]}
        results = {k: [] for k in LOADERS}
        load0 = os.getloadavg()[0]
        for i in range(args.repeats):
            for loader in (LOADERS if i % 2 == 0 else LOADERS[::-1]):
                results[loader].append(run_child(loader, file_of[loader]))
        best = {k: {m: min(r[m] for r in v) for m in v[0] if m != "loader"} for k, v in results.items()}
        logger.info("best of %d interleaved runs per loader; load average (1 min) before/after: %.2f/%.2f on %d CPUs",
                    args.repeats, load0, os.getloadavg()[0], os.cpu_count())
        logger.info("%-11s%9s%11s%15s%17s%20s%17s", "loader", "load s", "load cpu s", "to 1st step s",
                    "to 1st cpu s", "peak-base MiB load", "peak-base MiB")
        for k in LOADERS:
            b = best[k]
            logger.info("%-11s%9.2f%11.2f%15.2f%17.2f%20.0f%17.0f", k, b["load_s"], b["load_cpu_s"], b["first_step_s"],
                        b["first_step_cpu_s"], b["peak_load_mb"] - b["baseline_mb"], b["peak_mb"] - b["baseline_mb"])

        def above(k, m="peak_mb"):
            return best[k][m] - best[k]["baseline_mb"]

        out = {"bench": "load_int4", "blocks": args.blocks, "repeats": args.repeats, "bf16_file_bytes": sizes["bf16"],
               "int4_file_bytes": sizes["int4"], "file_ratio": round(sizes["int4"] / sizes["bf16"], 3),
               "loadavg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)], "cpus": os.cpu_count()}
        for ref in ("stock_bf16", "pack_bf16"):
            tag = ref.split("_")[0]
            out[f"load_ratio_int4_vs_{tag}_bf16"] = round(best["pack_int4"]["load_s"] / best[ref]["load_s"], 3)
            out[f"first_step_ratio_int4_vs_{tag}_bf16"] = round(
                best["pack_int4"]["first_step_s"] / best[ref]["first_step_s"], 3)
            out[f"load_cpu_ratio_int4_vs_{tag}_bf16"] = round(best["pack_int4"]["load_cpu_s"] / best[ref]["load_cpu_s"], 3)
            out[f"first_step_cpu_ratio_int4_vs_{tag}_bf16"] = round(
                best["pack_int4"]["first_step_cpu_s"] / best[ref]["first_step_cpu_s"], 3)
            out[f"peak_rss_ratio_int4_vs_{tag}_bf16"] = round(above("pack_int4") / above(ref), 3)
            out[f"load_peak_rss_ratio_int4_vs_{tag}_bf16"] = round(
                above("pack_int4", "peak_load_mb") / above(ref, "peak_load_mb"), 3)
        out.update({f"{k}_{m}": round(v, 3) for k, b in best.items() for m, v in b.items()})
        sys.stdout.write(json.dumps(out) + "\n")
    finally:
        if not args.keep_dir:
            for path in paths.values():
                path.unlink(missing_ok=True)
            try:
                folder.rmdir()
            except OSError:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
