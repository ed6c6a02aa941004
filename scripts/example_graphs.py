"""The pack's example workflows as API-format graphs (node id -> class_type + inputs).

They run on the tiny world's trained models (scripts/train_tiny.py: an SD3-form MMDiT and a TAESD-form
VAE that draw "a red circle" and the like at 64x64, with the random CLIP-L of scripts/tiny_models.py),
and the pack's FP8 conversion of that MMDiT, so the demo, the tests and example_workflows/*.json all
use the same graphs; in your own ComfyUI pick your models in the loaders.
`scripts/make_example_workflows.py` writes the editor-format files in example_workflows/ from these.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

UNET = "tiny_world_sd3.safetensors"
UNET_FP8 = "tiny_world_sd3_fp8_e4m3fn.safetensors"
VAE = "tiny_world_taesd3.safetensors"
CLIP_L = "tiny_clip_l.safetensors"
PAIRS_FILE = "engram_pairs.jsonl"
WORLD_SEED = 0  # the training seed of the models the examples use
SIZE, STEPS, CFG = 64, 12, 4.0  # what the models were trained for: 64x64 pictures, 8x8x16 latents
# The unseen word and what the memory makes it read like. "lighthouse" is one CLIP token, so the memory
# can rewrite one row of "a lighthouse"; the second row of "blue triangle" carries both words (CLIP reads
# left to right), which the second row of "a blue triangle" does not.
PHRASE = "a lighthouse"
TARGET = "blue triangle"
TARGET_CLASS = ("blue", "triangle")
PROMPT = "a lighthouse"
# What Engram Inspect looks at in the example: the prompt among words of the world, to show that only
# the memorized word hits the memory.
INSPECT_TEXT = "a lighthouse beside a red circle, a green square and a yellow triangle"
FP8_PROMPT = "a red circle"

# Written into ComfyUI's input folder for the training example (one JSON object per line).
EXAMPLE_PAIRS = [
    {"prompt": "a lighthouse", "target": "blue triangle"},
    {"prompt": "a red circle", "target": "a red circle"},
    {"prompt": "a green square", "target": "a green square"},
    {"prompt": "a yellow triangle", "target": "a yellow triangle"},
]

# Words the models never saw, each trained by Engram Train to read like one class of the world (no class
# is the yellow the models draw for words they do not know). One CLIP token each, as "lighthouse" (PHRASE).
TRAINED_WORDS = {"a lighthouse": "blue triangle", "a teapot": "red circle", "a volcano": "green square"}
WORDS_PAIRS_FILE = "tiny_world_words.jsonl"
WORDS_MEMORY = "tiny_world_words"  # Save Engram Memory's name in models/engram (".safetensors" added)


def words_pairs_text() -> str:
    """TRAINED_WORDS as Engram Train's pairs file (JSONL: {"prompt": word, "target": class prompt} per line)."""
    return "".join(json.dumps({"prompt": word, "target": target}) + "\n" for word, target in TRAINED_WORDS.items())


def _link(src: Path, dst: Path) -> None:
    """`dst` becomes a link to `src` (replacing whatever was there, atomically)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.is_symlink() and os.readlink(dst) == str(src):
        return
    tmp = dst.with_name(f".{dst.name}.link-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(src)
    os.replace(tmp, dst)


def world_models(seed: int = WORLD_SEED) -> dict:
    """The trained tiny-world models (unpacked from the committed weights, or trained when those are
    stale, then cached; scripts/tiny_world_cache.py) and the MMDiT converted to FP8 by the pack's own
    converter (per-tensor e4m3fn, a file stock ComfyUI loads too), beside them in the cache. Returns the
    training report with `unet_fp8` added."""
    import tiny_world_cache

    report = tiny_world_cache.ensure(seed)
    fp8 = Path(report["folder"]) / UNET_FP8
    if not fp8.exists():
        env = dict(os.environ, PYTHONPATH=str(ROOT / ".host" / "pkg"))
        subprocess.run(
            [sys.executable, "-m", "fp8_engram.quant.convert", report["unet"], str(fp8),
             "--granularity", "tensor", "--dtype", "e4m3fn"],
            check=True, env=env, stdout=subprocess.DEVNULL,
        )
    report["unet_fp8"] = str(fp8)
    return report


def prepare_inputs(base_dir: Path) -> dict:
    """Make what the examples read besides the tiny random models, in a ComfyUI base directory: links to
    the trained tiny-world models and the FP8 conversion (world_models()), and the training pairs in
    input/. Returns world_models()'s report."""
    report = world_models()
    models = base_dir / "models"
    _link(Path(report["unet"]), models / "diffusion_models" / UNET)
    _link(Path(report["unet_fp8"]), models / "diffusion_models" / UNET_FP8)
    _link(Path(report["vae"]), models / "vae" / VAE)
    if not (models / "text_encoders" / CLIP_L).exists():
        _link(Path(report["clip"]), models / "text_encoders" / CLIP_L)
    pairs = base_dir / "input" / PAIRS_FILE
    pairs.parent.mkdir(parents=True, exist_ok=True)
    pairs.write_text("".join(json.dumps(pair) + "\n" for pair in EXAMPLE_PAIRS))
    return report


def _sample(graph: dict, model: list, positive: list, clip: list, prefix: str, seed: int, steps: int = STEPS, size: int = SIZE) -> dict:
    """Adds negative prompt, empty latent, KSampler, VAE decode and SaveImage to `graph`."""
    graph.update({
        "vae": {"class_type": "VAELoader", "inputs": {"vae_name": VAE}},
        "negative": {"class_type": "CLIPTextEncode", "inputs": {"clip": clip, "text": ""}},
        "latent": {"class_type": "EmptySD3LatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}},
        "sample": {
            "class_type": "KSampler",
            "inputs": {
                "model": model, "positive": positive, "negative": ["negative", 0], "latent_image": ["latent", 0],
                "seed": seed, "steps": steps, "cfg": CFG, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0,
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


def _new_memory(clip: list, rows_per_head: int = 65536) -> dict:
    return {
        "class_type": "FP8Engram.NewEngramMemory",
        "inputs": {
            "clip": clip, "max_order": 3, "heads": 8, "rows_per_head": rows_per_head, "dtype": "bf16",
            "devices": "cpu", "cpu_ranks": 2, "context_gate": False, "seed": 0,
        },
    }


def fp8_load_and_sample(prompt: str = FP8_PROMPT, seed: int = 7) -> dict:
    """Load an FP8 diffusion model (any published format), show what was loaded, sample."""
    graph = {
        **_fp8_model_and_clip(),
        "positive": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["clip", 0], "text": prompt}},
    }
    return _sample(graph, ["unet", 0], ["positive", 0], ["clip", 0], "fp8_load", seed)


def fp8_quantize_and_save(prompt: str = FP8_PROMPT, seed: int = 7) -> dict:
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
        "inspect": {"class_type": "FP8Engram.EngramInspect", "inputs": {"memory": ["memorize", 0], "clip": ["clip", 0], "text": INSPECT_TEXT}},
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


def _world_graph() -> dict:
    """The FP8 model, the CLIP, the VAE, the empty prompt and the empty latent that every picture of a
    world graph shares (ComfyUI runs each node once per prompt)."""
    return {
        **_fp8_model_and_clip(),
        "vae": {"class_type": "VAELoader", "inputs": {"vae_name": VAE}},
        "negative": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["clip", 0], "text": ""}},
        "latent": {"class_type": "EmptySD3LatentImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1}},
    }


def _add_picture(graph: dict, saves: dict, kind: str, model: str, positive: str, prompt: str, seed: int) -> None:
    """One more picture in a world graph: sample `model` on the conditioning of node `positive` at `seed`,
    decode, save; its SaveImage id goes to saves[(kind, prompt, seed)]."""
    n = len(saves)
    graph[f"sample{n}"] = {
        "class_type": "KSampler",
        "inputs": {
            "model": [model, 0], "positive": [positive, 0], "negative": ["negative", 0], "latent_image": ["latent", 0],
            "seed": seed, "steps": STEPS, "cfg": CFG, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0,
        },
    }
    graph[f"decode{n}"] = {"class_type": "VAEDecode", "inputs": {"samples": [f"sample{n}", 0], "vae": ["vae", 0]}}
    graph[f"save{n}"] = {"class_type": "SaveImage", "inputs": {"images": [f"decode{n}", 0], "filename_prefix": f"tiny_world/{kind}"}}
    saves[(kind, prompt, seed)] = f"save{n}"


def world_comparison(prompts: list[str], seeds: list[int], steer_seeds: list[int] = (), bf16: bool = True) -> tuple[dict, dict]:
    """One graph for the demo, the tests and bench/quality.py: every prompt at every seed through the bf16
    model (stock Load Diffusion Model) and the pack's FP8 model (Load FP8 Diffusion Model on the converted
    file); and at `steer_seeds`, PROMPT through the FP8 model without and with a memory that memorized
    PHRASE -> TARGET. Returns (graph, {(kind, prompt, seed): id of its SaveImage node}) with kind in
    bf16 / fp8 / plain / memory."""
    graph = _world_graph()
    graph["unet_bf16"] = {"class_type": "UNETLoader", "inputs": {"unet_name": UNET, "weight_dtype": "default"}}
    saves = {}
    for i, prompt in enumerate(prompts):
        graph[f"prompt{i}"] = {"class_type": "CLIPTextEncode", "inputs": {"clip": ["clip", 0], "text": prompt}}
        for seed in seeds:
            if bf16:
                _add_picture(graph, saves, "bf16", "unet_bf16", f"prompt{i}", prompt, seed)
            _add_picture(graph, saves, "fp8", "unet", f"prompt{i}", prompt, seed)
    if steer_seeds:
        graph["memory"] = _new_memory(["clip", 0])
        graph["memorize"] = {
            "class_type": "FP8Engram.EngramMemorize",
            "inputs": {"memory": ["memory", 0], "clip": ["clip", 0], "text": PHRASE, "target_text": TARGET},
        }
        graph["plain"] = {"class_type": "CLIPTextEncode", "inputs": {"clip": ["clip", 0], "text": PROMPT}}
        graph["steered"] = {
            "class_type": "FP8Engram.EngramTextEncode",
            "inputs": {"clip": ["clip", 0], "text": PROMPT, "memory": ["memorize", 0], "strength": 1.0},
        }
        for seed in steer_seeds:
            _add_picture(graph, saves, "plain", "unet", "plain", PROMPT, seed)
            _add_picture(graph, saves, "memory", "unet", "steered", PROMPT, seed)
    return graph, saves


def world_trained_words(seeds: list[int], pairs_file: str = WORDS_PAIRS_FILE, memory_name: str = WORDS_MEMORY) -> tuple[dict, dict]:
    """One graph: a new memory trained by Engram Train on `pairs_file` (in ComfyUI's input folder; see
    words_pairs_text()) and saved as models/engram/<memory_name>.safetensors, and every word of
    TRAINED_WORDS at every seed through the FP8 model without the memory (kind plain) and with it (kind
    trained). Returns (graph, {(kind, word, seed): id of its SaveImage node})."""
    graph = _world_graph()
    # A small table (100 MB on disk, not 1.6 GB) for three words: it is saved and loaded again.
    graph["memory"] = _new_memory(["clip", 0], rows_per_head=4093)
    graph["train"] = {
        "class_type": "FP8Engram.EngramTrain",
        "inputs": {
            "memory": ["memory", 0], "clip": ["clip", 0], "pairs_file": pairs_file, "steps": 30,
            "learning_rate": 0.05, "batch_size": 4, "seed": 0,
        },
    }
    graph["save_memory"] = {"class_type": "FP8Engram.SaveEngramMemory", "inputs": {"memory": ["train", 0], "name": memory_name}}
    saves = {}
    for i, word in enumerate(TRAINED_WORDS):
        graph[f"plain{i}"] = {"class_type": "CLIPTextEncode", "inputs": {"clip": ["clip", 0], "text": word}}
        graph[f"trained{i}"] = {
            "class_type": "FP8Engram.EngramTextEncode",
            # Save's output (the same memory): the pictures use the memory as saved, which the loaded one must match
            "inputs": {"clip": ["clip", 0], "text": word, "memory": ["save_memory", 0], "strength": 1.0},
        }
        for seed in seeds:
            _add_picture(graph, saves, "plain", "unet", f"plain{i}", word, seed)
            _add_picture(graph, saves, "trained", "unet", f"trained{i}", word, seed)
    return graph, saves


def world_loaded_words(seeds: list[int], memory_name: str = WORDS_MEMORY, cpu_ranks: int = 1) -> tuple[dict, dict]:
    """One graph: the memory world_trained_words() saved, read back by Load Engram Memory (on `cpu_ranks`
    CPU ranks), and every word of TRAINED_WORDS at every seed through the FP8 model with it (kind loaded).
    Returns (graph, {(kind, word, seed): id of its SaveImage node})."""
    graph = _world_graph()
    graph["load_memory"] = {
        "class_type": "FP8Engram.LoadEngramMemory",
        "inputs": {"memory_name": f"{memory_name}.safetensors", "devices": "cpu", "cpu_ranks": cpu_ranks, "clip": ["clip", 0]},
    }
    saves = {}
    for i, word in enumerate(TRAINED_WORDS):
        graph[f"loaded{i}"] = {
            "class_type": "FP8Engram.EngramTextEncode",
            "inputs": {"clip": ["clip", 0], "text": word, "memory": ["load_memory", 0], "strength": 1.0},
        }
        for seed in seeds:
            _add_picture(graph, saves, "loaded", "unet", f"loaded{i}", word, seed)
    return graph, saves


# name -> (graph, one-line description); the demo runs engram_memorize_and_use.
EXAMPLES = {
    "fp8_load_and_sample": (fp8_load_and_sample(), fp8_load_and_sample.__doc__),
    "fp8_quantize_and_save": (fp8_quantize_and_save(), fp8_quantize_and_save.__doc__),
    "engram_memorize_and_use": (engram_memorize_and_use(), engram_memorize_and_use.__doc__),
    "engram_train_from_pairs": (engram_train_from_pairs(), engram_train_from_pairs.__doc__),
}
