"""MXFP8 diffusion models (ComfyUI 0.29's "mxfp8" per-layer files) through the pack's Load FP8 Diffusion
Model on the real server, on whichever ComfyUI is in use.

The file is the tiny SD3 with every linear in MXFP8: on ComfyUI 0.29+ made by 0.29's own quantizer and
serializer; on older ComfyUI (which has no MXFP8) made by the pack's MXFP8 layout written in 0.29's
on-disk form. The pack runs it weight-only. Thresholds: sampled latent vs the full-precision model
> 20 dB (2 euler steps); on 0.29, vs stock UNETLoader on the same file > 35 dB (the same weights, only
the compute differs).

Saving: the MXFP8 model loaded by the pack and written by Save FP8 Model is the same file, tensor for
tensor and bit for bit (0.29's own per-layer form: padded weight, tiled UE8M0 scales, comfy_quant);
on 0.29 stock UNETLoader samples exactly the same latent from the saved file as from the original;
the node says that 0.3.75 cannot read MXFP8 and that per tensor is the form for it.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import comfy029, fp8_files
from helpers.graphs import TINY_UNET, fp8_loader, saved_latent, sd3_txt2img
from helpers.numerics import sqnr

pytestmark = pytest.mark.integration

NAME = "mxfp8_tiny_sd3.safetensors"


def _pack_written(sd: dict) -> dict:
    from fp8_engram.quant import QuantizedTensor
    from fp8_engram.quant.layouts.mxfp8 import MXFP8, scales_for_file

    out = {}
    for key, w in sd.items():
        if not fp8_files.default_quantize(key, w):
            out[key] = w
            continue
        layer = key[: -len(".weight")]
        qt = QuantizedTensor.from_float(w, MXFP8())
        out[key] = qt.qdata
        out[f"{layer}.weight_scale"] = scales_for_file(qt.scale)
        out[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps({"format": "mxfp8"}).encode()), dtype=torch.uint8)
    return out


@pytest.fixture(scope="module")
def mxfp8_file(comfyui_tree, models_dir):
    sd = load_file(str(models_dir / "diffusion_models" / TINY_UNET))
    stock = comfy029.is_kitchen_era(comfyui_tree)
    if stock:
        from helpers.host import comfy_in_process

        comfy_in_process()
        import comfy.ops
        import comfy.quant_ops

        written, _ = comfy029.stock_write(comfy.quant_ops, comfy.ops, sd, "mxfp8")
    else:
        written = _pack_written(sd)
    save_file({k: v.contiguous() for k, v in written.items()}, str(models_dir / "diffusion_models" / NAME))
    return stock


def _latent(comfy, output_dir, loader: dict, prefix: str) -> tuple[torch.Tensor, dict]:
    hist = comfy.run(sd3_txt2img(model=loader, save="latent", seed=5, prefix=prefix))
    return saved_latent(hist, output_dir), hist


def test_mxfp8_file_loads_in_the_pack_and_samples_like_full_precision(comfy, output_dir, mxfp8_file):
    ours, hist = _latent(comfy, output_dir, fp8_loader(NAME), "mx_pack")
    full, _ = _latent(comfy, output_dir, {"class_type": "UNETLoader",
                                          "inputs": {"unet_name": TINY_UNET, "weight_dtype": "default"}}, "mx_full")
    q_full = sqnr(full, ours)
    summary = hist["outputs"]["1"]["fp8_summary"][0]
    print(f"MXFP8 through the pack vs full precision: {q_full:.1f} dB ({'0.29-made' if mxfp8_file else 'pack-made'} file)")
    assert q_full > 20.0
    assert summary["layers_quantized"] >= 20 and "mxfp8" in json.dumps(summary)
    if mxfp8_file:
        stock, _ = _latent(comfy, output_dir, {"class_type": "UNETLoader",
                                               "inputs": {"unet_name": NAME, "weight_dtype": "default"}}, "mx_stock")
        q_stock = sqnr(stock, ours)
        print(f"MXFP8 through the pack vs stock 0.29 on the same file: {q_stock:.1f} dB")
        assert q_stock > 35.0


def test_saved_mxfp8_model_is_the_same_file_and_loads_in_stock_029(comfy, output_dir, models_dir, mxfp8_file):
    src = models_dir / "diffusion_models" / NAME
    prefix = "mxfp8save/m"
    hist = comfy.run({
        # weight-only: under "auto" a CPU with VNNI/AMX converts the weights to int8 at load, and Save then
        # writes those (int8_tensorwise), not the file's own layers
        "1": fp8_loader(NAME, "weight-only"),
        "2": {"class_type": "FP8Engram.SaveFP8Model", "inputs": {"model": ["1", 0], "filename_prefix": prefix}},
    })
    text = hist["outputs"]["2"]["text"][0]
    assert "0.3.75 cannot" in text and "per tensor" in text, text
    files = sorted(output_dir.glob(prefix + "_*.safetensors"))
    assert len(files) == 1, files
    saved = files[0]
    original, written = load_file(str(src)), load_file(str(saved))
    assert set(written) == set(original), sorted(set(written) ^ set(original))
    for key, t in original.items():
        w = written[key]
        assert w.dtype == t.dtype and w.shape == t.shape, (key, w.dtype, t.dtype, w.shape, t.shape)
        assert torch.equal(w.view(torch.uint8) if w.element_size() == 1 else w,
                           t.view(torch.uint8) if t.element_size() == 1 else t), f"{key} differs after load and save"
    if not mxfp8_file:
        return  # ComfyUI without MXFP8: the pack reads it back (above); the stock loader cannot
    copy = models_dir / "diffusion_models" / "mxfp8_saved_by_pack.safetensors"
    copy.write_bytes(saved.read_bytes())
    stock = {"class_type": "UNETLoader", "inputs": {"unet_name": NAME, "weight_dtype": "default"}}
    again = {"class_type": "UNETLoader", "inputs": {"unet_name": copy.name, "weight_dtype": "default"}}
    a, _ = _latent(comfy, output_dir, stock, "mx_stock_orig")
    b, _ = _latent(comfy, output_dir, again, "mx_stock_saved")
    assert torch.equal(a, b), f"stock 0.29 samples differently from the saved file: {sqnr(a, b):.1f} dB"
