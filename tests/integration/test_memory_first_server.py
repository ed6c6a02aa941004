"""compute_path "auto (memory first)" on a real ComfyUI server: the server takes the choice, the tiny SD3 model
samples as under "auto", and Save FP8 Model, run on the same (cached) loaded model after sampling, writes the
FP8 form the file had, which stock UNETLoader reads and samples close to the memory-first model.

Fast paths are trusted by capability, so on a CPU with VNNI/AMX every layer runs int8 and drops its FP8 form
(on another CPU nothing runs int8 and nothing is dropped: the save then writes the file's bytes). Floors, with
what this VNNI CPU measured: the memory-first latent against the "auto" one > 30 dB (2 euler steps; the same
int8 products: equal); stock UNETLoader's latent from the saved file against the memory-first one > 25 dB
(37.3; weight-only against int8); each saved weight against the file's > 35 dB (44.6 at worst).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from helpers import fp8_files
from helpers.graphs import TINY_UNET, fp8_loader, saved_latent, sd3_txt2img
from helpers.numerics import sqnr

pytestmark = pytest.mark.integration

NAME = "memory_first_server_fp8.safetensors"


@pytest.fixture(scope="module")
def fp8_file(models_dir):
    sd = load_file(str(models_dir / "diffusion_models" / TINY_UNET))
    path = models_dir / "diffusion_models" / NAME
    fp8_files.write_format(sd, path, "comfy_quant_metadata")  # per-tensor e4m3fn
    return path


def _loader(compute_path: str) -> dict:
    node = fp8_loader(NAME, compute_path)
    node["inputs"]["fast_paths"] = "trust without proving"
    return node


def test_memory_first_samples_like_auto_and_saves_the_loaded_fp8_form(comfy, output_dir, models_dir, fp8_file):
    from fp8_engram.quant import formats
    from fp8_engram.quant.compute.int8 import int8_fast

    auto = saved_latent(comfy.run(sd3_txt2img(model=_loader("auto"), save="latent", prefix="mfs_auto")), output_dir)
    hist = comfy.run(sd3_txt2img(model=_loader("auto (memory first)"), save="latent", prefix="mfs_first"))
    first = saved_latent(hist, output_dir)
    q = sqnr(auto, first)
    assert q > 30.0, q
    summary = hist["outputs"]["1"]["fp8_summary"][0]
    dropped = int8_fast("cpu")
    assert ("auto (memory first): int8" if dropped else "memory first changes nothing") in summary["compute_path"], summary

    # the same loader node and inputs: ComfyUI hands the cached model, whose layers ran while sampling
    save = {"1": _loader("auto (memory first)"),
            "2": {"class_type": "FP8Engram.SaveFP8Model", "inputs": {"model": ["1", 0], "filename_prefix": "mfs_saved"}}}
    hist = comfy.run(save)
    text = hist["outputs"]["2"]["text"][0]
    assert ("24 layer(s) had run int8 under compute_path auto and kept no FP8 data" in text) == dropped, text
    assert "Stock ComfyUI's Load Diffusion Model reads it unchanged." in text, text
    files = sorted(output_dir.glob("mfs_saved_*.safetensors"))
    assert len(files) == 1, files
    saved, report = formats.load_file(str(files[0]))
    assert report.granularities == {"tensor": 24}
    loaded, _ = formats.load_file(str(fp8_file))
    for key, w in loaded.items():
        if hasattr(w, "qdata"):
            got = saved[key]
            assert got.qdata.dtype == torch.float8_e4m3fn
            assert sqnr(w.dequantize(torch.float64), got.dequantize(torch.float64)) > 35.0, key
    # stock ComfyUI's own loader reads the saved file and samples what the memory-first model sampled
    shutil.copy(files[0], models_dir / "diffusion_models" / "memory_first_server_saved.safetensors")
    stock = {"class_type": "UNETLoader", "inputs": {"unet_name": "memory_first_server_saved.safetensors",
                                                     "weight_dtype": "default"}}
    lat = saved_latent(comfy.run(sd3_txt2img(model=stock, save="latent", prefix="mfs_stock")), output_dir)
    q = sqnr(first, lat)
    assert q > 25.0, q
