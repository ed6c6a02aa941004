"""The int8 compute path on a real ComfyUI server (CPU): the tiny SD3 model as an FP8 file, loaded by
Load FP8 Diffusion Model with compute path "int8" (weights converted at load), samples end to end; its
latent is as close to the full-precision model's as the fp8 x fp8 path's (forced on the CPU, per-row
activation scales) on the same file and seed; the node reports the int8 conversion. A file in
ComfyUI 0.33's int8_tensorwise form (made by the converter) loads and samples too.

Thresholds (latent SQNR against the full-precision model, 2 euler steps): int8 > 20 dB and within
3 dB of fp8 x fp8's; the int8_tensorwise file > 20 dB on both the int8 and the weight-only path."""

from __future__ import annotations

import itertools

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from helpers import fp8_files
from helpers.graphs import TINY_UNET, saved_latent, sd3_txt2img
from helpers.numerics import sqnr

pytestmark = pytest.mark.integration

_counter = itertools.count()


def loader(name: str, compute_path: str) -> dict:
    return {"class_type": "FP8Engram.LoadFP8DiffusionModel",
            "inputs": {"unet_name": name, "compute_path": compute_path, "activation_scaling": "dynamic per row",
                       "compute_dtype": "auto"}}


def sample(comfy, output_dir, model: dict, seed: int = 3):
    hist = comfy.run(sd3_txt2img(model=model, save="latent", seed=seed, prefix=f"int8t{next(_counter)}"))
    return saved_latent(hist, output_dir), hist


@pytest.fixture(scope="module")
def files(models_dir):
    from fp8_engram.quant import convert

    folder = models_dir / "diffusion_models"
    sd = load_file(str(folder / TINY_UNET))
    fp8 = folder / "int8t_fp8_row.safetensors"
    fp8_files.write_format(sd, fp8, "comfy_quant_per_layer")
    comfy_int8 = folder / "int8t_comfy_int8.safetensors"
    if not comfy_int8.exists():
        convert.convert_file(folder / TINY_UNET, comfy_int8, granularity="int8 row convrot")
    return fp8.name, comfy_int8.name


@pytest.fixture(scope="module")
def reference(comfy, output_dir):
    lat, _ = sample(comfy, output_dir, {"class_type": "UNETLoader",
                                        "inputs": {"unet_name": TINY_UNET, "weight_dtype": "default"}})
    return lat


def test_int8_path_samples_as_close_as_fp8_matmul(comfy, output_dir, files, reference):
    fp8_name, _ = files
    lat8, hist = sample(comfy, output_dir, loader(fp8_name, "int8"))
    latf, _ = sample(comfy, output_dir, loader(fp8_name, "fp8 matmul"))
    latn, _ = sample(comfy, output_dir, loader(fp8_name, "int8 without rotation"))
    q8, qf, qn = sqnr(reference, lat8), sqnr(reference, latf), sqnr(reference, latn)
    print(f"latent SQNR vs full precision: int8 {q8:.2f} dB, int8 without rotation {qn:.2f} dB, "
          f"fp8 x fp8 per row {qf:.2f} dB")
    assert torch.isfinite(lat8).all()
    assert q8 > 20.0 and q8 >= qf - 3.0
    summary = hist["outputs"]["1"]["fp8_summary"][0]
    assert summary["compute_path"] == "int8 (rotated 128)"
    assert summary["int8"]["layers"] == summary["layers_quantized"] > 0
    assert summary["int8"]["min_sqnr_db"] > 30.0 and len(summary["int8_sqnr_db"]) == summary["int8"]["layers"]


@pytest.mark.parametrize("compute_path", ["int8", "weight-only"])
def test_a_comfyui_int8_tensorwise_file_loads_and_samples(comfy, output_dir, files, reference, compute_path):
    _, int8_name = files
    lat, hist = sample(comfy, output_dir, loader(int8_name, compute_path))
    q = sqnr(reference, lat)
    print(f"int8_tensorwise file ({compute_path}): latent SQNR vs full precision {q:.2f} dB")
    summary = hist["outputs"]["1"]["fp8_summary"][0]
    assert summary["granularity"] == {"int8_tensorwise": summary["layers_quantized"]}
    assert q > 20.0


@pytest.fixture(scope="module")
def saved_int8(comfy, output_dir, models_dir, reference):
    """Quantize Model (int8 row convrot) -> Save FP8 Model on the server; checks the file's form and that
    the pack loads it back; returns (the file's name in diffusion_models, the pack's latent from it).
    Both tests below take it, in any order or alone."""
    import json

    prefix = f"int8save/m{next(_counter)}"
    graph = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": TINY_UNET, "weight_dtype": "default"}},
             "20": {"class_type": "FP8Engram.QuantizeModelToFP8",
                    "inputs": {"model": ["1", 0], "granularity": "int8 row convrot", "fp8_dtype": "e4m3fn",
                               "keep_patterns": "*embed*, *final_layer*"}},
             "21": {"class_type": "FP8Engram.SaveFP8Model", "inputs": {"model": ["20", 0], "filename_prefix": prefix}}}
    hist = comfy.run(graph)
    assert "0.33" in hist["outputs"]["21"]["text"][0]
    assert hist["outputs"]["20"]["fp8_quality"][0]["dtype"] == "int8"
    files = sorted(output_dir.glob(prefix + "_*.safetensors"))
    assert len(files) == 1, files
    with safe_open(str(files[0]), framework="pt") as f:
        confs = {k: json.loads(bytes(f.get_tensor(k).tolist())) for k in f.keys() if k.endswith(".comfy_quant")}
        assert confs and all(c["format"] == "int8_tensorwise" for c in confs.values())
        assert all(f.get_slice(k[: -len(".comfy_quant")] + ".weight").get_dtype() == "I8" for k in confs)
    target = models_dir / "diffusion_models" / f"int8t_saved_{files[0].name}"
    target.write_bytes(files[0].read_bytes())
    lat, _ = sample(comfy, output_dir, loader(target.name, "int8"))
    return target.name, lat


def test_quantize_to_int8_then_save_writes_comfyuis_form_that_loads_back(saved_int8, reference):
    _, lat = saved_int8
    assert sqnr(reference, lat) > 20.0


def test_stock_unetloader_loads_the_saved_int8_file(comfy, output_dir, comfyui_tree, reference, request):
    # The Save node says ComfyUI 0.33 and newer load this file: stock UNETLoader, where the tree has the format.
    quant_ops = comfyui_tree / "comfy" / "quant_ops.py"
    if not (quant_ops.is_file() and "int8_tensorwise" in quant_ops.read_text(errors="replace")):
        pytest.skip("stock ComfyUI reads int8_tensorwise from 0.33 on; the tree in use is older")
    name, lat = request.getfixturevalue("saved_int8")
    stock, _ = sample(comfy, output_dir, {"class_type": "UNETLoader", "inputs": {"unet_name": name, "weight_dtype": "default"}})
    print(f"int8 file saved by the pack: stock UNETLoader {sqnr(reference, stock):.2f} dB, pack {sqnr(reference, lat):.2f} dB "
          f"vs full precision; stock vs pack {sqnr(lat, stock):.2f} dB")
    assert sqnr(reference, stock) > 20.0
    assert sqnr(lat, stock) > 30.0  # the same weights; the two loaders' activation handling may differ
