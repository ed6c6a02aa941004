"""Shared by the in-process LoRA patch/unpatch tests (ComfyUI's own ModelPatcher, no server): ComfyUI's
modules, the tiny SD3 model written as an FP8 file, a seeded LoRA on a few layers, and a snapshot of
every quantized weight."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from helpers import fp8_files
from helpers.host import comfy_in_process

LORA_LAYERS = ("joint_blocks.0.x_block.mlp.fc1", "joint_blocks.0.x_block.attn.qkv", "joint_blocks.1.x_block.mlp.fc2")


def comfy_modules():
    """(comfy.sd, make_fp8_ops), with ComfyUI imported in this process."""
    comfy_in_process()
    import comfy.lora  # noqa: F401  (registers the LoRA key mapping load_lora_for_models uses)
    import comfy.sd

    from fp8_engram.nodes.ops import make_fp8_ops

    return comfy.sd, make_fp8_ops


def write_tiny_fp8(tiny_models_cache: Path, directory: Path, fmt: str) -> Path:
    """The tiny SD3 diffusion model written to `directory` as an FP8 file in format `fmt`."""
    from safetensors.torch import load_file

    sd = load_file(str(tiny_models_cache / "diffusion_models" / "tiny_sd3.safetensors"))
    path = directory / "tiny_sd3_fp8.safetensors"
    fp8_files.write_format(sd, path, fmt)
    return path


def make_lora(model) -> dict:
    """A rank-4 LoRA (seeded) on LORA_LAYERS of the loaded model."""
    g = torch.Generator().manual_seed(5)
    lora = {}
    dm = model.model.diffusion_model
    for layer in LORA_LAYERS:
        w = dm.get_submodule(layer).weight
        lora[f"diffusion_model.{layer}.lora_up.weight"] = torch.randn(w.shape[0], 4, generator=g) * 0.1
        lora[f"diffusion_model.{layer}.lora_down.weight"] = torch.randn(4, w.shape[1], generator=g) * 0.1
    return lora


def lora_delta(lora: dict, layer: str) -> torch.Tensor:
    """The float64 weight delta (up @ down) the LoRA adds to `layer`."""
    up = lora[f"diffusion_model.{layer}.lora_up.weight"].double()
    down = lora[f"diffusion_model.{layer}.lora_down.weight"].double()
    return up @ down


def snapshot(model, dtype_of: Callable) -> dict:
    """Per quantized layer: (bytes, scale, layout, dtype_of(weight), float64 dequantized weight), all copies."""
    from fp8_engram.quant import QuantizedTensor

    out = {}
    for name, m in model.model.diffusion_model.named_modules():
        w = getattr(m, "weight", None)
        if isinstance(w, QuantizedTensor):
            out[name] = (w.qdata.view(torch.uint8).clone(), w.scale.clone(), w.layout, dtype_of(w), w.dequantize(torch.float64))
    return out
