"""In one ComfyUI 0.29 server, a model quantized by stock 0.29 (per-layer e4m3fn, loaded by stock
UNETLoader) and a model loaded by the pack (Load FP8 Diffusion Model), each with a LoRA, sampled in
the same workflow, give exactly what each gives in a workflow of its own. Both LoRAs must really move
their model's output (> 5% of the latent's norm), so the comparison cannot pass on a LoRA that did
nothing.

The single-model runs use copies of the files under other names, so ComfyUI's node cache cannot hand
the combined workflow their results. Runs where the ComfyUI in use is 0.29 or newer; skips elsewhere.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers import comfy029, fp8_files
from helpers.graphs import TINY_UNET, fp8_loader, sd3_txt2img
from helpers.host import comfy_in_process

pytestmark = pytest.mark.integration

LORA_LAYERS = ("joint_blocks.0.x_block.mlp.fc1", "joint_blocks.0.x_block.attn.qkv", "joint_blocks.0.context_block.mlp.fc2")


@pytest.fixture(scope="module")
def files(comfyui_tree, models_dir):
    if not comfy029.is_kitchen_era(comfyui_tree):
        pytest.skip("needs ComfyUI 0.29 or newer (comfy-kitchen quantization); the tree in use is older")
    comfy_in_process()
    import comfy.ops
    import comfy.quant_ops

    sd = load_file(str(models_dir / "diffusion_models" / TINY_UNET))
    folder = models_dir / "diffusion_models"
    stock, _ = comfy029.stock_write(comfy.quant_ops, comfy.ops, sd, "float8_e4m3fn")
    save_file({k: v.contiguous() for k, v in stock.items()}, str(folder / "beside_stock_a.safetensors"))
    fp8_files.write_format(sd, folder / "beside_pack_a.safetensors", "comfy_quant_metadata")
    for name in ("beside_stock", "beside_pack"):
        shutil.copyfile(folder / f"{name}_a.safetensors", folder / f"{name}_b.safetensors")
    loras = {}
    for i, tag in enumerate(("stock", "pack")):
        g = torch.Generator().manual_seed(20 + i)
        lora = {}
        for layer in LORA_LAYERS:
            w = sd[layer + ".weight"]
            lora[f"diffusion_model.{layer}.lora_up.weight"] = torch.randn(w.shape[0], 4, generator=g) * 0.2
            lora[f"diffusion_model.{layer}.lora_down.weight"] = torch.randn(4, w.shape[1], generator=g) * 0.2
        path = models_dir / "loras" / f"beside_{tag}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(lora, str(path))
        loras[tag] = path.name
    return loras


def _branch(loader: dict, lora: str | None, seed: int, prefix: str, offset: int) -> dict:
    """sd3_txt2img with its node ids moved by `offset` and an optional LoRA between loader and sampler."""
    graph = sd3_txt2img(model=loader, save="latent", seed=seed, prefix=prefix)
    if lora:
        graph["30"] = {"class_type": "LoraLoaderModelOnly",
                       "inputs": {"model": ["1", 0], "lora_name": lora, "strength_model": 1.0}}
        graph["6"]["inputs"]["model"] = ["30", 0]

    def move(v):
        return [str(int(v[0]) + offset), v[1]] if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) else v

    return {str(int(k) + offset): {**node, "inputs": {n: move(v) for n, v in node["inputs"].items()}}
            for k, node in graph.items()}


def _stock(name):
    return {"class_type": "UNETLoader", "inputs": {"unet_name": name, "weight_dtype": "default"}}


def _latents(comfy, output_dir, graph) -> dict[str, torch.Tensor]:
    hist = comfy.run(graph)
    out = {}
    for node_id, node_out in hist["outputs"].items():
        for entry in node_out.get("latents", []):
            with safe_open(str(output_dir / entry["subfolder"] / entry["filename"]), framework="pt") as f:
                out[node_id] = f.get_tensor("latent_tensor").clone()
    return out


def test_stock_and_pack_fp8_models_with_loras_in_one_workflow_match_their_own_runs(comfy, output_dir, files):
    stock_alone = _latents(comfy, output_dir, _branch(_stock("beside_stock_a.safetensors"), files["stock"], 3, "bs1", 0))["10"]
    pack_alone = _latents(comfy, output_dir, _branch(fp8_loader("beside_pack_a.safetensors"), files["pack"], 3, "bs2", 0))["10"]
    both = {**_branch(_stock("beside_stock_b.safetensors"), files["stock"], 3, "bs3", 0),
            **_branch(fp8_loader("beside_pack_b.safetensors"), files["pack"], 3, "bs4", 100)}
    together = _latents(comfy, output_dir, both)
    assert torch.equal(together["10"], stock_alone), "the stock FP8 model's output changed beside the pack's"
    assert torch.equal(together["110"], pack_alone), "the pack's FP8 model's output changed beside stock's"
    # the LoRAs were applied: without them each model gives something else
    stock_plain = _latents(comfy, output_dir, _branch(_stock("beside_stock_a.safetensors"), None, 3, "bs5", 0))["10"]
    pack_plain = _latents(comfy, output_dir, _branch(fp8_loader("beside_pack_a.safetensors"), None, 3, "bs6", 0))["10"]
    for with_lora, plain in ((stock_alone, stock_plain), (pack_alone, pack_plain)):
        assert float((with_lora - plain).norm()) > 0.05 * float(plain.norm())
