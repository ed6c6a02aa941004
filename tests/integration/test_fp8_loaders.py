"""FP8 models on a real ComfyUI server: every format made from the tiny SD3 loads through the pack's
node and samples close to the full-precision model; the pack's loader agrees with stock UNETLoader on
files stock reads; Save FP8 Model output loads in stock UNETLoader; a LoRA on FP8 weights moves the
output as on full precision and removing it restores the weights; bad files give a clear node error
and the server keeps serving.

Thresholds (SQNR of the sampled latent against the full-precision model's, 2 euler steps):
per-tensor / row / block scaled formats > 20 dB, plain casts > 15 dB (e4m3fn) / 12 dB (e5m2);
pack vs stock on the same file > 35 dB.
"""

from __future__ import annotations

import itertools
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import fp8_files
from helpers.graphs import TINY_UNET, fp8_loader, saved_latent, sd3_txt2img
from helpers.numerics import sqnr

pytestmark = pytest.mark.integration

_counter = itertools.count()


def stock_loader(name: str) -> dict:
    return {"class_type": "UNETLoader", "inputs": {"unet_name": name, "weight_dtype": "default"}}


def latent_of(comfy, output_dir, graph) -> tuple[torch.Tensor, dict]:
    hist = comfy.run(graph)
    return saved_latent(hist, output_dir), hist


def sample(comfy, output_dir, model: dict, *, seed: int = 0, extra: dict | None = None, model_ref=None):
    graph = sd3_txt2img(model=model, save="latent", seed=seed, prefix=f"fp8t{next(_counter)}")
    if extra:
        graph.update(extra)
        graph["6"]["inputs"]["model"] = model_ref
    return latent_of(comfy, output_dir, graph)


@pytest.fixture(scope="module")
def fp8_models(models_dir):
    sd = load_file(str(models_dir / "diffusion_models" / TINY_UNET))
    folder = models_dir / "diffusion_models"
    out = {}
    for fmt in fp8_files.FORMATS:
        path = folder / f"fp8t_{fmt}.safetensors"
        out[fmt] = (path.name, fp8_files.write_format(sd, path, fmt))
    return out


@pytest.fixture(scope="module")
def reference(comfy, output_dir):
    lat, _ = sample(comfy, output_dir, stock_loader(TINY_UNET))
    return lat


@pytest.mark.parametrize("fmt", fp8_files.FORMATS)
def test_every_format_loads_samples_and_is_close_to_full_precision(comfy, output_dir, fp8_models, reference, fmt):
    name, _ = fp8_models[fmt]
    lat, hist = sample(comfy, output_dir, fp8_loader(name))
    floor = {"plain_e4m3fn": 15.0, "plain_e5m2": 12.0}.get(fmt, 20.0)
    q = sqnr(reference, lat)
    print(f"{fmt}: latent SQNR vs full precision {q:.1f} dB")
    assert q > floor
    summary = hist["outputs"]["1"]["fp8_summary"][0]
    assert summary["format"] == fp8_files.DETECTED_AS[fmt]
    assert summary["layers_quantized"] == summary["layers_total"] == 24
    assert summary["bytes_on_disk"] < summary["bytes_bf16"]
    # "auto" on the CPU: int8 where it has VNNI/AMX (the weights converted at load), else weight-only;
    # the converted layers then run int8 or weight-only per token class, as proven and measured
    from fp8_engram.quant.compute.int8 import int8_supported

    assert ("int8" if int8_supported("cpu") else "weight-only") in summary["compute_path"], summary["compute_path"]
    assert isinstance(summary["fast_paths"], list)


@pytest.mark.parametrize("fmt", fp8_files.STOCK_READABLE)
def test_pack_and_stock_loader_agree_on_files_stock_reads(comfy, output_dir, fp8_models, fmt):
    name, _ = fp8_models[fmt]
    ours, _ = sample(comfy, output_dir, fp8_loader(name), seed=3)
    stock, _ = sample(comfy, output_dir, stock_loader(name), seed=3)
    q = sqnr(stock, ours)
    print(f"{fmt}: pack vs stock {q:.1f} dB")
    assert q > 35.0


def test_quantize_then_save_loads_in_stock_unet_loader(comfy, output_dir, models_dir, reference):
    graph = sd3_txt2img(save="latent", prefix=f"fp8t{next(_counter)}")
    graph["20"] = {"class_type": "FP8Engram.QuantizeModelToFP8",
                   "inputs": {"model": ["1", 0], "granularity": "tensor", "fp8_dtype": "e4m3fn",
                              "keep_patterns": "*embed*, *final_layer*"}}
    graph["21"] = {"class_type": "FP8Engram.SaveFP8Model", "inputs": {"model": ["20", 0], "filename_prefix": "fp8t/saved"}}
    graph["6"]["inputs"]["model"] = ["20", 0]
    lat_q, hist = latent_of(comfy, output_dir, graph)
    assert sqnr(reference, lat_q) > 20.0
    quality = hist["outputs"]["20"]["fp8_quality"][0]
    assert quality["layers"] == 17 and quality["min_sqnr_db"] > 25
    text = hist["outputs"]["21"]["text"][0]
    assert "reads it unchanged" in text
    saved = sorted((output_dir / "fp8t").glob("saved_*.safetensors"))
    assert saved
    target = models_dir / "diffusion_models" / "fp8t_saved_by_pack.safetensors"
    shutil.copy(saved[-1], target)
    lat_stock, _ = sample(comfy, output_dir, stock_loader(target.name))
    assert sqnr(lat_q, lat_stock) > 35.0  # stock reads exactly what the pack quantized
    lat_pack, _ = sample(comfy, output_dir, fp8_loader(target.name))
    assert sqnr(lat_q, lat_pack) > 35.0


def _write_lora(models_dir, sd) -> str:
    g = torch.Generator().manual_seed(7)
    lora = {}
    for layer in ("joint_blocks.0.x_block.mlp.fc1", "joint_blocks.0.x_block.attn.qkv", "joint_blocks.1.x_block.mlp.fc2"):
        w = sd[layer + ".weight"]
        r = 4
        lora[f"diffusion_model.{layer}.lora_up.weight"] = torch.randn(w.shape[0], r, generator=g) * 0.2
        lora[f"diffusion_model.{layer}.lora_down.weight"] = torch.randn(r, w.shape[1], generator=g) * 0.2
    path = models_dir / "loras" / "fp8t_lora.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(lora, str(path))
    return path.name


def test_lora_on_fp8_moves_output_like_full_precision_and_unpatch_restores(comfy, output_dir, models_dir, fp8_models):
    sd = load_file(str(models_dir / "diffusion_models" / TINY_UNET))
    lora = _write_lora(models_dir, sd)
    lora_node = {"30": {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "lora_name": lora,
                                                                           "strength_model": 1.0}}}
    name, _ = fp8_models["comfy_quant_metadata"]
    full_base, _ = sample(comfy, output_dir, stock_loader(TINY_UNET), seed=11)
    full_lora, _ = sample(comfy, output_dir, stock_loader(TINY_UNET), seed=11, extra=lora_node, model_ref=["30", 0])
    fp8_base, _ = sample(comfy, output_dir, fp8_loader(name), seed=11)
    fp8_lora, _ = sample(comfy, output_dir, fp8_loader(name), seed=11, extra=lora_node, model_ref=["30", 0])
    d_full = full_lora - full_base
    d_fp8 = fp8_lora - fp8_base
    assert float(d_full.norm()) > 0.05 * float(full_base.norm())  # the LoRA really changes the output
    q = sqnr(d_full, d_fp8)
    print(f"LoRA effect on FP8 vs on full precision: {q:.1f} dB")
    assert q > 10.0
    # after the LoRA run the loader's cached model is unpatched: a fresh seed must give exactly what a
    # freshly loaded model gives
    after, _ = sample(comfy, output_dir, fp8_loader(name), seed=12)
    comfy.free()
    fresh, _ = sample(comfy, output_dir, fp8_loader(name) | {"inputs": {**fp8_loader(name)["inputs"],
                                                                        "compute_dtype": "float32"}}, seed=12)
    assert torch.equal(after, fresh) or sqnr(fresh, after) > 60.0


@pytest.mark.parametrize("kind", fp8_files.BAD_KINDS)
def test_bad_file_gives_a_node_error_and_server_keeps_serving(comfy, output_dir, models_dir, kind, fp8_models):
    from comfyhost import WorkflowError

    sd = load_file(str(models_dir / "diffusion_models" / TINY_UNET))
    path = models_dir / "diffusion_models" / f"fp8t_bad_{kind}.safetensors"
    word = fp8_files.write_bad(sd, path, kind)
    with pytest.raises(WorkflowError) as info:
        comfy.run(sd3_txt2img(model=fp8_loader(path.name), save="latent", prefix=f"fp8t{next(_counter)}"))
    msg = str(info.value)
    assert path.name in msg and word.lower() in msg.lower(), msg
    # still serving
    lat, _ = sample(comfy, output_dir, fp8_loader(fp8_models["plain_e4m3fn"][0]), seed=100 + fp8_files.BAD_KINDS.index(kind))
    assert torch.isfinite(lat).all()
