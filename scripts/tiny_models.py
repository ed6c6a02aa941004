"""Make the small random models that the demo, the tests and the benchmarks run on.

They are real ComfyUI models, only small and untrained, so every stock loader detects them:
- diffusion_models/tiny_sd3.safetensors: an MMDiT (hidden 128, depth 2, 16 latent channels) that
  ComfyUI detects as SD3; context 4096 and pooled 2048, so real SD3 text conditioning drives it.
- vae/tiny_taesd3.safetensors: a random 16-channel TAESD, detected by VAELoader.
- text_encoders/tiny_clip_l.safetensors: a random full-size CLIP-L text encoder (about 124 M
  parameters) that CLIPLoader loads with the real CLIP tokenizer (type "sd3" or "stable_diffusion").

Usage: python scripts/tiny_models.py MODELS_DIR [--comfyui PATH] [--force]
Runs with ComfyUI's tree on sys.path (default: scripts/comfyhost.py's comfyui_root()). Files that
already exist from the same recipe are kept unless --force. Writes go to a temporary file renamed into place.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger("tiny_models")

ROOT = Path(__file__).resolve().parents[1]

UNET = "tiny_sd3.safetensors"
VAE = "tiny_taesd3.safetensors"
CLIP_L = "tiny_clip_l.safetensors"
# Geometry of the tiny SD3: ComfyUI infers depth = hidden // 64 from the patch embedding.
HIDDEN = 128
CONTEXT = 4096
POOLED = 2048
POS_EMBED_MAX = 32
# Written into each file's metadata; a file from an older recipe is made again. 2: buffers (the SD3
# position embedding) are seeded too; before, they held whatever torch.empty gave, NaN at times.
RECIPE = "2"


def comfyui_path(explicit: str | None) -> Path:
    if explicit:
        return Path(explicit)
    from comfyhost import comfyui_root  # the one place that decides which tree is in use

    try:
        return comfyui_root()
    except FileNotFoundError as exc:
        raise SystemExit(f"{exc} (or pass --comfyui PATH)") from exc


def import_comfy(path: Path):
    if not Path(path).resolve().is_relative_to(ROOT / ".host"):
        sys.dont_write_bytecode = True  # a user's own tree: leave no __pycache__ behind in it
    sys.path.insert(0, str(path))
    import comfy.cli_args

    comfy.cli_args.args.cpu = True  # keep model_management away from CUDA at import
    import comfy.clip_model
    import comfy.ldm.modules.diffusionmodules.mmdit as mmdit
    import comfy.taesd.taesd as taesd

    return comfy, mmdit, taesd


def is_current(path: Path) -> bool:
    """The file exists and was made by this recipe."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("fp8_engram_tiny_models") == RECIPE
    except Exception:  # missing, truncated or not safetensors: make it again
        return False


def save(state_dict: dict, path: Path) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file({k: v.contiguous() for k, v in state_dict.items()}, str(tmp), metadata={"fp8_engram_tiny_models": RECIPE})
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    logger.info("wrote %s (%.1f MB)", path, path.stat().st_size / 1e6)


def init_random(model, torch) -> None:
    """Give every parameter defined values: ComfyUI's layers skip initialization (torch.empty).

    Matrices and convolutions get unit-variance outputs (std 1/sqrt(fan_in)), norms 1, the rest small.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 0:
                continue
            if param.dim() >= 2 and name.endswith("weight"):
                fan_in = param[0].numel()
                param.normal_(0.0, fan_in ** -0.5)
            elif "norm" in name or ".ln_" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
        for name, buf in model.named_buffers():  # e.g. SD3's pos_embed, made with torch.empty
            if buf.is_floating_point():
                buf.normal_(0.0, 0.02)


def make_unet(mmdit, torch, dtype) -> dict:
    torch.manual_seed(0)
    model = mmdit.MMDiT(
        patch_size=2,
        in_channels=16,
        out_channels=16,
        depth=HIDDEN // 64,
        adm_in_channels=POOLED,
        context_embedder_config={"target": "torch.nn.Linear", "params": {"in_features": CONTEXT, "out_features": HIDDEN}},
        pos_embed_max_size=POS_EMBED_MAX,
        num_patches=POS_EMBED_MAX * POS_EMBED_MAX,
        qk_norm="rms",
        dtype=torch.float32,
        operations=torch.nn,
    )
    init_random(model, torch)
    return {k: v.to(dtype) for k, v in model.state_dict().items()}


def make_vae(taesd, torch) -> dict:
    torch.manual_seed(1)
    model = taesd.TAESD(latent_channels=16)
    init_random(model, torch)
    return {k: v.float() for k, v in model.state_dict().items()}


def make_clip_l(comfy, torch) -> dict:
    import json

    config = json.loads((Path(comfy.clip_model.__file__).parent / "sd1_clip_config.json").read_text())
    torch.manual_seed(2)
    model = comfy.clip_model.CLIPTextModel(config, dtype=torch.float32, device="cpu", operations=torch.nn)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                continue
            param.normal_(0.0, 0.02)
    return {k: v.to(torch.float16) for k, v in model.state_dict().items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models_dir", type=Path, help="ComfyUI models folder to write into")
    parser.add_argument("--comfyui", help="ComfyUI tree to import (default: the one set up)")
    parser.add_argument("--force", action="store_true", help="rewrite files that exist")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[tiny_models] %(message)s")

    import torch

    comfy, mmdit, taesd = import_comfy(comfyui_path(args.comfyui))
    targets = {
        args.models_dir / "diffusion_models" / UNET: lambda: make_unet(mmdit, torch, torch.bfloat16),
        args.models_dir / "vae" / VAE: lambda: make_vae(taesd, torch),
        args.models_dir / "text_encoders" / CLIP_L: lambda: make_clip_l(comfy, torch),
    }
    for path, build in targets.items():
        if is_current(path) and not args.force:
            logger.info("kept %s", path)
            continue
        save(build(), path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
