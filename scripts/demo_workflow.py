"""The demo workflow as an API-format graph (node id -> class_type + inputs), on the tiny models."""

from __future__ import annotations

UNET = "tiny_sd3.safetensors"
VAE = "tiny_taesd3.safetensors"
CLIP_L = "tiny_clip_l.safetensors"


def demo_graph(prompt: str, seed: int = 42) -> dict:
    return {
        "unet": {"class_type": "UNETLoader", "inputs": {"unet_name": UNET, "weight_dtype": "default"}},
        "clip": {"class_type": "CLIPLoader", "inputs": {"clip_name": CLIP_L, "type": "sd3"}},
        "vae": {"class_type": "VAELoader", "inputs": {"vae_name": VAE}},
        "report": {"class_type": "FP8Engram.WeightReport", "inputs": {"model": ["unet", 0]}},
        "positive": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["clip", 0], "text": prompt}},
        "negative": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["clip", 0], "text": ""}},
        "latent": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 256, "height": 256, "batch_size": 1}},
        "sample": {
            "class_type": "KSampler",
            "inputs": {
                "model": ["unet", 0], "positive": ["positive", 0], "negative": ["negative", 0],
                "latent_image": ["latent", 0], "seed": seed, "steps": 8, "cfg": 3.0,
                "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0,
            },
        },
        "decode": {"class_type": "VAEDecode", "inputs": {"samples": ["sample", 0], "vae": ["vae", 0]}},
        "save": {"class_type": "SaveImage", "inputs": {"images": ["decode", 0], "filename_prefix": "fp8_engram_demo"}},
    }
