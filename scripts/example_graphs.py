"""The pack's example workflows as API-format graphs (node id -> class_type + inputs).

They run on the tiny models that scripts/tiny_models.py makes (and the demo's FP8 conversion of the
tiny SD3), so the demo, the tests and example_workflows/*.json all use the same graphs; in your own
ComfyUI pick your models in the loaders. `scripts/make_example_workflows.py` writes the editor-format
files in example_workflows/ from these.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

UNET = "tiny_sd3.safetensors"
UNET_FP8 = "tiny_sd3_fp8_e4m3fn.safetensors"
VAE = "tiny_taesd3.safetensors"
CLIP_L = "tiny_clip_l.safetensors"
PAIRS_FILE = "engram_pairs.jsonl"
PHRASE = "old lighthouse"
TARGET = "a tall red and white striped lighthouse tower"
PROMPT = "an old lighthouse on a cliff at sunset, oil painting"

# Written into ComfyUI's input folder for the training example (one JSON object per line).
EXAMPLE_PAIRS = [
    {"prompt": "an old lighthouse by the sea", "target": "a tall red and white striped lighthouse tower by the sea"},
    {"prompt": "an old lighthouse at night", "target": "a tall red and white striped lighthouse tower at night"},
    {"prompt": "a painting of an old lighthouse", "target": "a painting of a tall red and white striped lighthouse tower"},
    {"prompt": "a quiet harbor", "target": "a quiet harbor"},
]


def prepare_inputs(base_dir: Path) -> None:
    """Make what the examples read besides the tiny models, in a ComfyUI base directory: the tiny SD3
    converted to FP8 by the pack's own converter (per-tensor e4m3fn, a file stock ComfyUI loads too),
    and the training pairs in input/."""
    unets = base_dir / "models" / "diffusion_models"
    if not (unets / UNET_FP8).exists():
        env = dict(os.environ, PYTHONPATH=str(ROOT / ".host" / "pkg"))
        subprocess.run(
            [sys.executable, "-m", "fp8_engram.quant.convert", str(unets / UNET), str(unets / UNET_FP8),
             "--granularity", "tensor", "--dtype", "e4m3fn"],
            check=True, env=env,
        )
    pairs = base_dir / "input" / PAIRS_FILE
    pairs.parent.mkdir(parents=True, exist_ok=True)
    pairs.write_text("".join(json.dumps(pair) + "\n" for pair in EXAMPLE_PAIRS))


def _sample(graph: dict, model: list, positive: list, clip: list, prefix: str, seed: int, steps: int = 8, size: int = 256) -> dict:
    """Adds negative prompt, empty latent, KSampler, VAE decode and SaveImage to `graph`."""
    graph.update({
        "vae": {"class_type": "VAELoader", "inputs": {"vae_name": VAE}},
        "negative": {"class_type": "CLIPTextEncode", "inputs": {"clip": clip, "text": ""}},
        "latent": {"class_type": "EmptySD3LatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}},
        "sample": {
            "class_type": "KSampler",
            "inputs": {
                "model": model, "positive": positive, "negative": ["negative", 0], "latent_image": ["latent", 0],
                "seed": seed, "steps": steps, "cfg": 3.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0,
            },
        },
        "decode": {"class_type": "VAEDecode", "inputs": {"samples": ["sample", 0], "vae": ["vae", 0]}},
        "save": {"class_type": "SaveImage", "inputs": {"images": ["decode", 0], "filename_prefix": prefix}},
    })
    return graph


def _clip() -> dict:
    return {"class_type": "CLIPLoader", "inputs": {"clip_name": CLIP_L, "type": "sd3"}}


def _fp8_model_and_clip() -> dict:
    """The FP8 diffusion model through the pack's loader, its weight report, and the CLIP."""
    return {
        "unet": {
            "class_type": "FP8Engram.LoadFP8DiffusionModel",
            "inputs": {"unet_name": UNET_FP8, "compute_path": "auto", "activation_scaling": "auto", "compute_dtype": "auto"},
        },
        "clip": _clip(),
        "report": {"class_type": "FP8Engram.WeightReport", "inputs": {"model": ["unet", 0]}},
    }


def _new_memory(clip: list) -> dict:
    return {
        "class_type": "FP8Engram.NewEngramMemory",
        "inputs": {
            "clip": clip, "max_order": 3, "heads": 8, "rows_per_head": 65536, "dtype": "bf16",
            "devices": "cpu", "cpu_ranks": 2, "context_gate": False, "seed": 0,
        },
    }


def fp8_load_and_sample(prompt: str = PROMPT, seed: int = 7) -> dict:
    """Load an FP8 diffusion model (any published format), show what was loaded, sample."""
    graph = {
        **_fp8_model_and_clip(),
        "positive": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["clip", 0], "text": prompt}},
    }
    return _sample(graph, ["unet", 0], ["positive", 0], ["clip", 0], "fp8_load", seed)


def fp8_quantize_and_save(prompt: str = PROMPT, seed: int = 7) -> dict:
    """Quantize a full-precision model to FP8 in memory (per-layer SQNR report), save it, sample with it."""
    graph = {
        "unet": {"class_type": "UNETLoader", "inputs": {"unet_name": UNET, "weight_dtype": "default"}},
        "clip": _clip(),
        "quantize": {
            "class_type": "FP8Engram.QuantizeModelToFP8",
            "inputs": {"model": ["unet", 0], "granularity": "tensor", "fp8_dtype": "e4m3fn", "keep_patterns": ""},
        },
        "plot": {"class_type": "PreviewImage", "inputs": {"images": ["quantize", 2]}},
        "save_model": {"class_type": "FP8Engram.SaveFP8Model", "inputs": {"model": ["quantize", 0], "filename_prefix": "fp8/tiny_sd3"}},
        "positive": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["clip", 0], "text": prompt}},
    }
    return _sample(graph, ["quantize", 0], ["positive", 0], ["clip", 0], "fp8_quantized", seed)


def engram_memorize_and_use(prompt: str = PROMPT, seed: int = 42) -> dict:
    """The demo: FP8 model + a new engram memory on 2 CPU workers that memorizes a phrase and steers the prompt."""
    graph = {
        **_fp8_model_and_clip(),
        "memory": _new_memory(["clip", 0]),
        "memorize": {
            "class_type": "FP8Engram.EngramMemorize",
            "inputs": {"memory": ["memory", 0], "clip": ["clip", 0], "text": PHRASE, "target_text": TARGET},
        },
        "positive": {
            "class_type": "FP8Engram.EngramTextEncode",
            "inputs": {"clip": ["clip", 0], "text": prompt, "memory": ["memorize", 0], "strength": 1.0},
        },
        "inspect": {"class_type": "FP8Engram.EngramInspect", "inputs": {"memory": ["memorize", 0], "clip": ["clip", 0], "text": prompt}},
        "heat_map": {"class_type": "PreviewImage", "inputs": {"images": ["inspect", 0]}},
    }
    return _sample(graph, ["unet", 0], ["positive", 0], ["clip", 0], "fp8_engram_demo", seed)


def engram_train_from_pairs(prompt: str = PROMPT, seed: int = 42) -> dict:
    """Train a new memory on a JSONL file of (prompt -> target prompt) pairs, save it, use it."""
    graph = {
        "unet": {"class_type": "UNETLoader", "inputs": {"unet_name": UNET, "weight_dtype": "default"}},
        "clip": _clip(),
        "memory": _new_memory(["clip", 0]),
        "train": {
            "class_type": "FP8Engram.EngramTrain",
            "inputs": {
                "memory": ["memory", 0], "clip": ["clip", 0], "pairs_file": PAIRS_FILE, "steps": 30,
                "learning_rate": 0.05, "batch_size": 4, "seed": 0,
            },
        },
        "loss_curve": {"class_type": "PreviewImage", "inputs": {"images": ["train", 1]}},
        "save_memory": {"class_type": "FP8Engram.SaveEngramMemory", "inputs": {"memory": ["train", 0], "name": "lighthouse_memory"}},
        "positive": {
            "class_type": "FP8Engram.EngramTextEncode",
            "inputs": {"clip": ["clip", 0], "text": prompt, "memory": ["train", 0], "strength": 1.0},
        },
    }
    return _sample(graph, ["unet", 0], ["positive", 0], ["clip", 0], "engram_trained", seed)


# name -> (graph, one-line description); the demo runs engram_memorize_and_use.
EXAMPLES = {
    "fp8_load_and_sample": (fp8_load_and_sample(), fp8_load_and_sample.__doc__),
    "fp8_quantize_and_save": (fp8_quantize_and_save(), fp8_quantize_and_save.__doc__),
    "engram_memorize_and_use": (engram_memorize_and_use(), engram_memorize_and_use.__doc__),
    "engram_train_from_pairs": (engram_train_from_pairs(), engram_train_from_pairs.__doc__),
}
