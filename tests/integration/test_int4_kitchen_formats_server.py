"""AWQ W4A16 and SVDQuant W4A4 layers (comfy-kitchen 0.2.40's forms, as a Qwen-Image-Edit int4 bundle mixes
them) through the real server: the tiny SD3 with its modulation linears in AWQ and its attention and MLP
linears in SVDQuant samples through Load FP8 Diffusion Model as stock UNETLoader samples the same model with
those layers' effective weights in bf16, and Save FP8 Model writes every int4 tensor back byte for byte.
The pack needs none of ComfyUI's own code for these formats, so this runs on every ComfyUI the suite uses."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.graphs import TINY_UNET, fp8_loader, saved_latent, sd3_txt2img
from helpers.numerics import sqnr

pytestmark = pytest.mark.integration

QUANT, REF = "int4_mixed_tiny_sd3.safetensors", "int4_mixed_reference_tiny_sd3.safetensors"


@pytest.fixture(scope="module")
def int4_files(models_dir):
    from fp8_engram.quant.formats import load_file as pack_load
    from helpers.int4_files import awq_parts, svdquant_parts

    folder = models_dir / "diffusion_models"
    sd = load_file(str(folder / TINY_UNET))
    out, kinds = {}, {}
    for key, v in sd.items():
        layer = key[: -len(".weight")]
        if key.endswith(".weight") and v.dim() == 2 and "adaLN_modulation" in key:
            parts, kinds[layer] = awq_parts(v), "awq_w4a16"
        elif key.endswith(".weight") and v.dim() == 2 and (".attn." in key or ".mlp.fc" in key) \
                and v.shape[0] % 128 == 0 and v.shape[1] % 64 == 0:
            parts, kinds[layer] = svdquant_parts(v, 16, seed=len(kinds)), "svdquant_w4a4"
        else:
            out[key] = v
            continue
        out.update({f"{layer}.{suffix}": t for suffix, t in parts.items()})
    for name in (QUANT, REF):
        (folder / name).unlink(missing_ok=True)
    save_file(out, str(folder / QUANT))
    loaded, _ = pack_load(folder / QUANT)
    ref = {k: (v.dequantize(torch.bfloat16) if hasattr(v, "qdata") else v) for k, v in loaded.items()}
    save_file(ref, str(folder / REF))
    return kinds


def _latent(comfy, output_dir, loader: dict, prefix: str):
    hist = comfy.run(sd3_txt2img(model=loader, save="latent", seed=3, prefix=prefix))
    return saved_latent(hist, output_dir), hist


def test_awq_and_svdquant_layers_sample_like_their_effective_weights(comfy, output_dir, int4_files):
    auto, hist_auto = _latent(comfy, output_dir, fp8_loader(QUANT), "int4_pack_auto")
    path = hist_auto["outputs"]["1"]["fp8_summary"][0]["compute_path"]
    assert "awq_w4a16 layers weight-only" in path and "svdquant_w4a4 layers weight-only" in path, path
    ours, hist = _latent(comfy, output_dir, fp8_loader(QUANT, "weight-only"), "int4_pack")
    assert torch.equal(auto, ours)  # no fast path takes these layers under "auto"
    theirs, _ = _latent(comfy, output_dir, {"class_type": "UNETLoader",
                                            "inputs": {"unet_name": REF, "weight_dtype": "default"}}, "int4_ref")
    s = hist["outputs"]["1"]["fp8_summary"][0]
    counts = {k: sum(1 for v in int4_files.values() if v == k) for k in set(int4_files.values())}
    assert s["granularity"] == counts and counts["awq_w4a16"] >= 4 and counts["svdquant_w4a4"] >= 8, s
    assert s["layers_quantized"] == len(int4_files)
    assert any("awq_w4a16" in n for n in s["notes"]) and any("svdquant_w4a4" in n for n in s["notes"]), s["notes"]
    assert torch.isfinite(ours).all()
    db = sqnr(theirs, ours)
    print(f"int4 layers through the pack vs stock on their effective bf16 weights: {db:.1f} dB")
    assert db > 40.0, db


def test_saved_int4_model_writes_every_int4_tensor_back(comfy, output_dir, models_dir, int4_files):
    prefix = "int4save/m"
    hist = comfy.run({
        "1": fp8_loader(QUANT, "weight-only"),
        "2": {"class_type": "FP8Engram.SaveFP8Model", "inputs": {"model": ["1", 0], "filename_prefix": prefix}},
    })
    saved = hist["outputs"]["2"]["fp8_summary"][0]  # the written file, read back by the pack's reader
    assert saved["granularity"] == {k: sum(1 for v in int4_files.values() if v == k) for k in set(int4_files.values())}
    files = sorted(output_dir.glob(prefix + "_*.safetensors"))
    assert len(files) == 1, files
    original, written = load_file(str(models_dir / "diffusion_models" / QUANT)), load_file(str(files[0]))
    for layer in int4_files:
        for key in (k for k in original if k.startswith(layer + ".") and not k.endswith((".comfy_quant", ".bias"))):
            a, b = original[key], written[key]
            assert a.dtype == b.dtype and a.shape == b.shape, key
            assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                               b.view(torch.uint8) if b.element_size() == 1 else b), f"{key} differs after load and save"
