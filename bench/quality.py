"""What each quantized format does to pictures: the tiny world's trained model (scripts/train_tiny.py) in
bf16 and converted by the pack's converter to every format it writes, sampled through a real ComfyUI.

Every prompt of the world ("a red circle", ...) at --seeds seeds, with the bf16 model (stock Load Diffusion
Model) and each converted file (Load FP8 Diffusion Model, compute path auto). Per format: the judge's
accuracy (scripts/tiny_world.py: colour, shape, both), how often it draws the class the bf16 model drew at
the same seed, and the pixel PSNR against the bf16 picture (median, lowest).

    python bench/quality.py [--seeds 2] [--formats tensor,row,...] [--keep-dir DIR]

The models come from their committed weights (scripts/tiny_world_cache.py), cached in .host/tiny-world/. Prints a
table and, as the last line, one JSON object {"bench": "quality", ...}.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import tiny_world as world  # noqa: E402
from comfyhost import ComfyServer  # noqa: E402
from example_graphs import CFG, CLIP_L, PHRASE, PROMPT, SIZE, STEPS, TARGET, TARGET_CLASS, UNET, UNET_FP8, VAE, world_comparison, world_models  # noqa: E402

logger = logging.getLogger("bench.quality")

# name -> converter arguments (python -m fp8_engram.quant.convert --help)
FORMATS = {
    "tensor e4m3fn": ["--granularity", "tensor", "--dtype", "e4m3fn"],
    "row e4m3fn": ["--granularity", "row", "--dtype", "e4m3fn"],
    "block e4m3fn": ["--granularity", "block", "--dtype", "e4m3fn"],
    "tensor e5m2": ["--granularity", "tensor", "--dtype", "e5m2"],
    "row e5m2": ["--granularity", "row", "--dtype", "e5m2"],
    "mxfp8": ["--granularity", "mxfp8"],
    "nvfp4": ["--granularity", "nvfp4"],
    "int8 tensor": ["--granularity", "int8 tensor"],
    "int8 row convrot": ["--granularity", "int8 row convrot"],
}


def file_name(fmt: str) -> str:
    return "tiny_world_sd3_" + fmt.replace(" ", "_") + ".safetensors"


def psnr(a, b) -> float:
    import numpy as np

    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def graph_for(model_node: dict, prompts: list[str], seeds: list[int]) -> tuple[dict, dict]:
    graph = {
        "unet": model_node,
        "clip": {"class_type": "CLIPLoader", "inputs": {"clip_name": CLIP_L, "type": "sd3"}},
        "vae": {"class_type": "VAELoader", "inputs": {"vae_name": VAE}},
        "negative": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["clip", 0], "text": ""}},
        "latent": {"class_type": "EmptySD3LatentImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1}},
    }
    saves = {}
    for i, prompt in enumerate(prompts):
        graph[f"prompt{i}"] = {"class_type": "CLIPTextEncode", "inputs": {"clip": ["clip", 0], "text": prompt}}
        for seed in seeds:
            n = len(saves)
            graph[f"sample{n}"] = {"class_type": "KSampler", "inputs": {
                "model": ["unet", 0], "positive": [f"prompt{i}", 0], "negative": ["negative", 0], "latent_image": ["latent", 0],
                "seed": seed, "steps": STEPS, "cfg": CFG, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}}
            graph[f"decode{n}"] = {"class_type": "VAEDecode", "inputs": {"samples": [f"sample{n}", 0], "vae": ["vae", 0]}}
            graph[f"save{n}"] = {"class_type": "PreviewImage", "inputs": {"images": [f"decode{n}", 0]}}
            saves[(prompt, seed)] = f"save{n}"
    return graph, saves


def pictures(client, history: dict, saves: dict) -> dict:
    import numpy as np
    from PIL import Image

    out = {}
    for key, node_id in saves.items():
        image = history["outputs"][node_id]["images"][0]
        data = client.view(image["filename"], image.get("subfolder", ""), image.get("type", "temp"))
        out[key] = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=2, help="seeds per prompt (seeds 1..N)")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated names of formats (default: all)")
    p.add_argument("--steer-seeds", type=int, default=16, help="seeds of the engram steering check (0: skip)")
    p.add_argument("--keep-dir", help="ComfyUI base directory to use and keep (default: a temp dir, deleted)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        p.error(f"unknown formats {unknown}; known: {list(FORMATS)}")

    report = world_models()
    base = Path(args.keep_dir) if args.keep_dir else Path(tempfile.mkdtemp(prefix="fp8_quality_"))
    unets = base / "models" / "diffusion_models"
    unets.mkdir(parents=True, exist_ok=True)
    for src, dst in ((report["unet"], unets / UNET), (report["unet_fp8"], unets / UNET_FP8), (report["vae"], base / "models" / "vae" / VAE),
                     (report["clip"], base / "models" / "text_encoders" / CLIP_L)):
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not dst.exists():
            dst.symlink_to(src)
    env = dict(os.environ, PYTHONPATH=str(ROOT / ".host" / "pkg"))
    for fmt in formats:
        out = unets / file_name(fmt)
        if not out.exists():
            subprocess.run([sys.executable, "-m", "fp8_engram.quant.convert", report["unet"], str(out), *FORMATS[fmt]],
                           check=True, env=env, stdout=subprocess.DEVNULL)

    prompts = [world.prompt(c, s) for c, s in world.CLASSES]
    seeds = list(range(1, args.seeds + 1))
    server = ComfyServer(base_dir=base).start()
    rows = []
    steering = None
    try:
        client = server.client()
        t0 = time.monotonic()
        graph, saves = graph_for({"class_type": "UNETLoader", "inputs": {"unet_name": UNET, "weight_dtype": "default"}}, prompts, seeds)
        reference = pictures(client, client.run(graph, timeout=1800), saves)
        variants = [("bf16", reference)]
        for fmt in formats:
            node = {"class_type": "FP8Engram.LoadFP8DiffusionModel", "inputs": {
                "unet_name": file_name(fmt), "compute_path": "auto", "activation_scaling": "auto", "compute_dtype": "auto"}}
            graph, saves = graph_for(node, prompts, seeds)
            variants.append((fmt, pictures(client, client.run(graph, timeout=1800), saves)))
        if args.steer_seeds:
            graph, saves = world_comparison([], [], steer_seeds=list(range(1, args.steer_seeds + 1)))
            steer = {k: world.judge(v) for k, v in pictures(client, client.run(graph, timeout=1800), saves).items()}
            with_memory = sum(v.reads(*TARGET_CLASS) for (kind, _, _), v in steer.items() if kind == "memory")
            without = sum(v.reads(*TARGET_CLASS) for (kind, _, _), v in steer.items() if kind == "plain")
            steering = {"seeds": args.steer_seeds, "with_memory": with_memory, "without_memory": without}
        sampling_s = time.monotonic() - t0
    finally:
        server.stop()
        if not args.keep_dir:
            shutil.rmtree(base, ignore_errors=True)

    ref_verdicts = {k: world.judge(v) for k, v in reference.items()}
    print(f"{len(prompts)} prompts x {len(seeds)} seeds, {STEPS} euler steps, cfg {CFG}; judge: scripts/tiny_world.py")
    print(f"{'format':<18} {'colour':>7} {'shape':>7} {'both':>7} {'= bf16':>7} {'PSNR med':>9} {'PSNR min':>9}")
    for name, pics in variants:
        n = len(pics)
        verdicts = {k: world.judge(v) for k, v in pics.items()}
        asked = {k: world.parse_prompt(k[0]) for k in pics}
        colour = sum(v.colour == asked[k][0] for k, v in verdicts.items()) / n
        shape = sum(v.shape == asked[k][1] for k, v in verdicts.items()) / n
        both = sum(v.reads(*asked[k]) for k, v in verdicts.items()) / n
        agree = sum(v.label == ref_verdicts[k].label for k, v in verdicts.items()) / n
        ps = [psnr(pics[k], reference[k]) for k in pics]
        finite = [x for x in ps if math.isfinite(x)]
        med = statistics.median(ps) if ps else math.nan
        row = {"format": name, "colour": round(colour, 3), "shape": round(shape, 3), "both": round(both, 3),
               "agree_bf16": round(agree, 3), "psnr_median_db": round(med, 2) if math.isfinite(med) else "inf",
               "psnr_min_db": round(min(finite), 2) if finite else "inf"}
        rows.append(row)
        print(f"{name:<18} {colour:>7.1%} {shape:>7.1%} {both:>7.1%} {agree:>7.1%} {str(row['psnr_median_db']):>9} {str(row['psnr_min_db']):>9}")
    if steering:
        n = steering["seeds"]
        print(f"engram (FP8 model): {PROMPT!r} drew {TARGET_CLASS[0]} {TARGET_CLASS[1]} at {steering['with_memory']}/{n} seeds after "
              f"Memorize {PHRASE!r} -> {TARGET!r}, at {steering['without_memory']}/{n} without the memory")
    print(json.dumps({"bench": "quality", "steering": steering, "prompts": len(prompts), "seeds": len(seeds), "steps": STEPS, "cfg": CFG,
                      "model_key": Path(report["folder"]).name, "sampling_s": round(sampling_s, 1), "formats": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
