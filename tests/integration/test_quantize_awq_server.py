"""Quantize Model to FP8 writes AWQ W4A16 ("awq w4a16") on the real server: the stock-loaded tiny SD3 quantized
in memory samples near full precision (4-bit codes per group of 64: above INT4_FLOOR), Save FP8 Model writes
comfy-kitchen 0.2.40's form (int8 codes, bf16 scales and zero points, the comfy_quant JSON), the pack's loader
samples the saved file as the in-memory model samples (the same weights, float32 compute: above SAME_WEIGHTS),
and saving the loaded model again writes every AWQ tensor byte for byte.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from helpers.graphs import fp8_loader, saved_latent, sd3_txt2img
from helpers.numerics import sqnr

pytestmark = pytest.mark.integration

INT4_FLOOR = 10.0  # dB vs full precision after 2 steps, as for NVFP4 (4-bit weights too; ~20 dB per weight)
SAME_WEIGHTS = 60.0  # dB: the same dequantized weights in float32; only the summation order may differ
KEEP = "*embed*, *final_layer*"


def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_quantize_model_to_awq_w4a16_samples_saves_and_loads_back(comfy, output_dir, models_dir):
    full = saved_latent(comfy.run(sd3_txt2img(save="latent", seed=5, prefix="awq_full")), output_dir)
    graph = sd3_txt2img(save="latent", seed=5, prefix="awq_mem")
    graph["20"] = {"class_type": "FP8Engram.QuantizeModelToFP8",
                   "inputs": {"model": ["1", 0], "granularity": "awq w4a16", "fp8_dtype": "e4m3fn", "keep_patterns": KEEP}}
    graph["21"] = {"class_type": "FP8Engram.SaveFP8Model", "inputs": {"model": ["20", 0], "filename_prefix": "awq/m"}}
    graph["6"]["inputs"]["model"] = ["20", 0]
    hist = comfy.run(graph)
    ours = saved_latent(hist, output_dir)
    quality = hist["outputs"]["20"]["fp8_quality"][0]
    assert (quality["granularity"], quality["dtype"]) == ("awq w4a16", "uint4") and quality["layers"] > 0, quality
    db_full = sqnr(full, ours)
    assert "comfy-kitchen" in hist["outputs"]["21"]["text"][0], hist["outputs"]["21"]["text"]

    saved = sorted(output_dir.glob("awq/m_*.safetensors"))
    assert len(saved) == 1, saved
    first = _tensors(saved[0])
    layers = sorted(k[: -len(".comfy_quant")] for k in first if k.endswith(".comfy_quant"))
    assert len(layers) == quality["layers"], (len(layers), quality)
    for layer in layers:
        conf = json.loads(bytes(first[layer + ".comfy_quant"].tolist()).decode("utf-8"))
        n, k = first[layer + ".weight_scale"].shape[1], first[layer + ".weight"].shape[1] * 2
        assert conf == {"format": "awq_w4a16", "group_size": 64}, (layer, conf)
        assert first[layer + ".weight"].dtype == torch.int8 and first[layer + ".weight"].shape == (n, k // 2), layer
        for part in (".weight_scale", ".weight_zeros"):
            t = first[layer + part]
            assert t.dtype == torch.bfloat16 and t.shape == (k // 64, n), (layer + part, t.dtype, t.shape)

    target = models_dir / "diffusion_models" / "awq_quantized_tiny_sd3.safetensors"
    shutil.copy(saved[0], target)
    hist2 = comfy.run({**sd3_txt2img(model=fp8_loader(target.name), save="latent", seed=5, prefix="awq_pack"),
                       "21": {"class_type": "FP8Engram.SaveFP8Model",
                              "inputs": {"model": ["1", 0], "filename_prefix": "awq_again/m"}}})
    again = saved_latent(hist2, output_dir)
    summary = hist2["outputs"]["1"]["fp8_summary"][0]
    assert summary["granularity"] == {"awq_w4a16": len(layers)}, summary
    db_same = sqnr(ours, again)
    print(f"\n[awq quantize] in memory vs full precision {db_full:.1f} dB (weights min {quality['min_sqnr_db']} dB, "
          f"mean {quality['mean_sqnr_db']} dB); saved file through the pack vs in memory {db_same:.1f} dB")
    assert db_full > INT4_FLOOR, db_full
    assert db_same > SAME_WEIGHTS, db_same

    resaved = sorted(output_dir.glob("awq_again/m_*.safetensors"))
    assert len(resaved) == 1, resaved
    second = _tensors(resaved[0])
    for layer in layers:
        for part in (".weight", ".weight_scale", ".weight_zeros", ".comfy_quant"):
            a, b = first[layer + part], second[layer + part]
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{layer + part} changed on save"
