"""Builders of API-format ComfyUI graphs for the tests (node id -> {class_type, inputs})."""

from __future__ import annotations

TINY_UNET = "tiny_sd3.safetensors"
TINY_VAE = "tiny_taesd3.safetensors"
TINY_CLIP_L = "tiny_clip_l.safetensors"


def fp8_loader(unet_name: str, compute_path: str = "auto") -> dict:
    """A Load FP8 Diffusion Model node (static activation scaling, compute dtype auto)."""
    return {"class_type": "FP8Engram.LoadFP8DiffusionModel",
            "inputs": {"unet_name": unet_name, "compute_path": compute_path, "activation_scaling": "static",
                       "compute_dtype": "auto"}}


def sd3_txt2img(
    prompt: str = "a red apple on a wooden table",
    *,
    seed: int = 0,
    steps: int = 2,
    size: int = 64,
    model: dict | None = None,
    conditioning: dict | None = None,
    save: str = "image",
    prefix: str = "test",
) -> dict:
    """A complete text-to-image graph on the tiny SD3 models.

    `model` replaces the UNETLoader node ("1") and `conditioning` the positive CLIPTextEncode ("3");
    other nodes may refer to "2" (the CLIP) and "1" (the MODEL). `save`: "image" saves a PNG,
    "latent" saves the sampled latent (exact numbers for comparisons), "both" does both.
    """
    graph: dict = {
        "1": model or {"class_type": "UNETLoader", "inputs": {"unet_name": TINY_UNET, "weight_dtype": "default"}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": TINY_CLIP_L, "type": "sd3"}},
        "3": conditioning or {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": prompt}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": ""}},
        "5": {"class_type": "EmptySD3LatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}},
        "6": {
            "class_type": "KSampler",
            "inputs": {
                "model": ["1", 0], "positive": ["3", 0], "negative": ["4", 0], "latent_image": ["5", 0],
                "seed": seed, "steps": steps, "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple",
                "denoise": 1.0,
            },
        },
    }
    if save in ("image", "both"):
        graph["7"] = {"class_type": "VAELoader", "inputs": {"vae_name": TINY_VAE}}
        graph["8"] = {"class_type": "VAEDecode", "inputs": {"samples": ["6", 0], "vae": ["7", 0]}}
        graph["9"] = {"class_type": "SaveImage", "inputs": {"images": ["8", 0], "filename_prefix": prefix}}
    if save in ("latent", "both"):
        graph["10"] = {"class_type": "SaveLatent", "inputs": {"samples": ["6", 0], "filename_prefix": f"latents/{prefix}"}}
    return graph


def output_images(history: dict, node_id: str) -> list[dict]:
    """The `images` entries ({filename, subfolder, type}) a node reported in a history entry."""
    return history["outputs"].get(node_id, {}).get("images", [])


def saved_latent(history: dict, output_dir, node_id: str = "10"):
    """The latent tensor (a copy) that the SaveLatent node `node_id` wrote under `output_dir` in a history entry."""
    from pathlib import Path

    from safetensors import safe_open

    entry = history["outputs"][node_id]["latents"][0]
    with safe_open(str(Path(output_dir) / entry["subfolder"] / entry["filename"]), framework="pt") as f:
        return f.get_tensor("latent_tensor").clone()
