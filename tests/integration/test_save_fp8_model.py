"""Save FP8 Model keeps the weights that are not FP8 in the dtype they were loaded with (ComfyUI holds
them in float32 on the CPU; writing that doubled them), or in the dtype the user picks; the files load
in stock ComfyUI.

Measured on the tiny SD3 (4.0 MB of bf16): before, stock UNETLoader -> Quantize -> Save wrote 8.03 MB
and a 3.06 MB e5m2 file loaded and saved became 5.14 MB.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fp8_engram.quant import formats
from helpers import fp8_files
from helpers.graphs import TINY_UNET, fp8_loader, sd3_txt2img

pytestmark = pytest.mark.integration

_n = itertools.count()


def dtypes_of(path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_slice(k).get_dtype() for k in f.keys()}


def save_graph(model: dict, weight_dtype: str | None = None, quantize: bool = False) -> tuple[dict, str]:
    prefix = f"savedtype/m{next(_n)}"
    graph = {"1": model}
    src = ["1", 0]
    if quantize:
        graph["20"] = {"class_type": "FP8Engram.QuantizeModelToFP8",
                       "inputs": {"model": ["1", 0], "granularity": "tensor", "fp8_dtype": "e4m3fn",
                                  "keep_patterns": "*embed*, *final_layer*"}}
        src = ["20", 0]
    graph["21"] = {"class_type": "FP8Engram.SaveFP8Model", "inputs": {"model": src, "filename_prefix": prefix}}
    if weight_dtype is not None:
        graph["21"]["inputs"]["weight_dtype"] = weight_dtype
    return graph, prefix


def saved_file(output_dir, prefix):
    files = sorted(output_dir.glob(prefix + "_*.safetensors"))
    assert len(files) == 1, files
    return files[0]


def stock_samples(comfy, models_dir, path) -> None:
    """Stock UNETLoader loads the file and samples finite latents."""
    target = models_dir / "diffusion_models" / f"savedtype_{path.name}"
    target.write_bytes(path.read_bytes())
    graph = sd3_txt2img(model={"class_type": "UNETLoader", "inputs": {"unet_name": target.name, "weight_dtype": "default"}},
                        save="latent", prefix=f"savedtype{next(_n)}")
    hist = comfy.run(graph)
    entry = hist["outputs"]["10"]["latents"][0]
    with safe_open(str(models_dir.parent / "output" / entry["subfolder"] / entry["filename"]), framework="pt") as f:
        assert bool(torch.isfinite(f.get_tensor("latent_tensor")).all())


def test_quantized_stock_model_is_saved_with_bf16_rest(comfy, output_dir, models_dir):
    src = models_dir / "diffusion_models" / TINY_UNET
    graph, prefix = save_graph({"class_type": "UNETLoader", "inputs": {"unet_name": TINY_UNET, "weight_dtype": "default"}},
                               quantize=True)
    hist = comfy.run(graph)
    path = saved_file(output_dir, prefix)
    kinds = dtypes_of(path)
    assert {d for k, d in kinds.items() if k.endswith(".weight") and d.startswith("F8")} == {"F8_E4M3"}
    plain = {k: d for k, d in kinds.items() if not d.startswith("F8") and d != "U8" and not k.endswith(("_scale", ".scale"))}
    assert set(plain.values()) == {"BF16"}, plain
    size, source = path.stat().st_size, src.stat().st_size
    print(f"stock-loaded bf16 model {source / 1e6:.2f} MB -> quantized and saved {size / 1e6:.2f} MB")
    with safe_open(str(path), framework="pt") as f:
        fp8_numel = sum(f.get_slice(k).get_shape()[0] * f.get_slice(k).get_shape()[1] for k, d in kinds.items() if d == "F8_E4M3")
    # bf16 -> FP8 saves one byte per quantized weight; the rest stays bf16 (it was float32: 8.03 MB)
    assert abs(size - (source - fp8_numel)) < 0.03 * source, (size, source, fp8_numel)
    assert "bfloat16" in hist["outputs"]["21"]["text"][0]
    stock_samples(comfy, models_dir, path)


@pytest.mark.parametrize("fmt", ["plain_e5m2", "comfy_scaled_fp8", "comfy_quant_metadata"])
def test_loaded_fp8_file_is_saved_at_its_own_size(comfy, output_dir, models_dir, fmt):
    sd = load_file(str(models_dir / "diffusion_models" / TINY_UNET))
    name = f"savedtype_src_{fmt}.safetensors"
    src = models_dir / "diffusion_models" / name
    fp8_files.write_format(sd, src, fmt)
    # weight-only: under "auto" a CPU with VNNI/AMX converts the weights to int8 at load (and Save writes those)
    graph, prefix = save_graph(fp8_loader(name, "weight-only"))
    comfy.run(graph)
    path = saved_file(output_dir, prefix)
    size, source = path.stat().st_size, src.stat().st_size
    print(f"{fmt}: {source / 1e6:.2f} MB loaded and saved -> {size / 1e6:.2f} MB")
    assert abs(size - source) < 0.05 * source
    src_kinds, kinds = dtypes_of(src), dtypes_of(path)
    for key, dtype in kinds.items():
        if key in src_kinds and not key.endswith(("scale_weight", "weight_scale", "scale_input", "input_scale")):
            assert dtype == src_kinds[key], (key, dtype, src_kinds[key])
    assert formats.inspect_file(path).layers_quantized == formats.inspect_file(src).layers_quantized
    stock_samples(comfy, models_dir, path)


def test_picked_dtype_is_used(comfy, output_dir, models_dir):
    graph, prefix = save_graph({"class_type": "UNETLoader", "inputs": {"unet_name": TINY_UNET, "weight_dtype": "default"}},
                               weight_dtype="float32", quantize=True)
    comfy.run(graph)
    kinds = dtypes_of(saved_file(output_dir, prefix))
    assert {d for k, d in kinds.items() if k.endswith(".bias")} == {"F32"}


def test_requantizing_a_cached_model_with_other_settings_quantizes_the_original_weights(comfy, output_dir):
    """A user quantizes a model, then changes the granularity and runs again: the loader's MODEL comes from
    ComfyUI's cache, and the first prompt's FP8 weights are still patched into the module it shares with
    the second. The second quantization must read the original weights, not find nothing left to quantize."""
    loader = {"class_type": "UNETLoader", "inputs": {"unet_name": TINY_UNET, "weight_dtype": "default"}}
    first, first_prefix = save_graph(loader, quantize=True)
    comfy.run(first)
    second, second_prefix = save_graph(loader, quantize=True)
    second["20"]["inputs"]["granularity"] = "row"
    hist = comfy.run(second)
    assert hist["outputs"]["20"]["fp8_quality"][0]["layers"] > 0
    kinds = dtypes_of(saved_file(output_dir, second_prefix))
    assert {d for k, d in kinds.items() if k.endswith(".weight") and d.startswith("F8")} == {"F8_E4M3"}
    first_report = formats.inspect_file(saved_file(output_dir, first_prefix))
    second_report = formats.inspect_file(saved_file(output_dir, second_prefix))
    assert second_report.layers_quantized == first_report.layers_quantized > 0
    assert set(second_report.granularities) == {"row"}, second_report.granularities
