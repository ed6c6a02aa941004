"""Files that lie about sizes and scales, through the real server (issue 27, findings 2 and 7):

- the tiny SD3 in ComfyUI's int8_tensorwise ConvRot form, one layer's `convrot_groupsize` set to 4**7:
  Load FP8 Diffusion Model fails with a node error naming the file and the layer within 5 s, and the
  server's memory does not grow by the 1 GiB rotation matrix the old loader built (and kept) first;
- the tiny SD3 in NVFP4 (the pack's own writer, ComfyUI's form) with the tensor scales
  `weight_scale_2` set to 3e38: a node error naming the file and the key, where the old loader
  loaded it, its weights dequantizing to inf and NaN, and sampled a wrong latent (all NaN in the
  issue's run; finite but off, largest value 2.2 for the good file's 3.0, on 0.3.75's CPU path here).
Each hostile file has a good twin that samples (a finite latent) on the same server. Runs on every
tree: the pack reads both forms itself.
"""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8_engram.quant import NVFP4, QuantizedTensor
from fp8_engram.quant.layouts import comfy_int8, nvfp4
from helpers import fp8_files
from helpers.graphs import TINY_UNET, fp8_loader, saved_latent, sd3_txt2img

pytestmark = pytest.mark.integration


def _quantized(key: str, w: torch.Tensor) -> bool:
    # the embedders stay in bf16, as in the published NVFP4 / int8 files (their widths give the model's sizes)
    return fp8_files.default_quantize(key, w) and "embedder" not in key


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def _error(comfy, graph) -> tuple[str, float]:
    t0 = time.perf_counter()
    try:
        hist = comfy.run(graph)
    except Exception as exc:  # WorkflowError: the node's exception text
        return str(exc), time.perf_counter() - t0
    raise AssertionError(f"the prompt ran without an error (outputs: {list(hist.get('outputs', {}))})")


def _sample(comfy, output_dir, name: str, prefix: str) -> torch.Tensor:
    hist = comfy.run(sd3_txt2img(model=fp8_loader(name), save="latent", seed=5, steps=1, prefix=prefix))
    return saved_latent(hist, output_dir)


def _int8_convrot(sd: dict) -> tuple[dict, str]:
    """The state dict with every linear in int8_tensorwise, per channel with ConvRot 256 where the
    inputs allow it (ComfyUI 0.33's form); returns it and a layer that has a ConvRot group."""
    from fp8_engram.quant.compute.int8 import to_int8

    out, rotated = {}, []
    for key, w in sd.items():
        if not _quantized(key, w):
            out[key] = w
            continue
        q, s, conf = comfy_int8.file_tensors(to_int8(w.float()))  # ConvRot 256 where K allows it
        layer = key[: -len(".weight")]
        out.update({key: q, layer + ".weight_scale": s, layer + ".comfy_quant": comfy_int8.comfy_quant_bytes(conf)})
        if conf.get("convrot"):
            rotated.append(layer)
    assert rotated, "no layer of the tiny model got a ConvRot group"
    return out, sorted(rotated)[0]


def test_convrot_group_that_would_cost_a_gibibyte_is_a_node_error_in_seconds(comfy, comfy_server, models_dir,
                                                                            output_dir):
    sd = load_file(str(models_dir / "diffusion_models" / TINY_UNET))
    good, layer = _int8_convrot(sd)
    folder = models_dir / "diffusion_models"
    save_file({k: v.contiguous() for k, v in good.items()}, str(folder / "convrot_good.safetensors"))
    assert torch.isfinite(_sample(comfy, output_dir, "convrot_good.safetensors", "convrot_good")).all()
    bad = dict(good)
    bad[layer + ".comfy_quant"] = comfy_int8.comfy_quant_bytes(
        {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 4 ** 7})
    save_file({k: v.contiguous() for k, v in bad.items()}, str(folder / "convrot_4pow7.safetensors"))
    rss_before = _rss_bytes(comfy_server.process.pid)
    text, seconds = _error(comfy, {"1": fp8_loader("convrot_4pow7.safetensors"),
                                   "2": {"class_type": "FP8Engram.WeightReport", "inputs": {"model": ["1", 0]}}})
    grown = _rss_bytes(comfy_server.process.pid) - rss_before
    print(f"ConvRot 4**7 through the server: node error after {seconds:.2f} s, server RSS {grown / 2**20:+.0f} MiB")
    assert "convrot_4pow7.safetensors" in text and f"{layer}.comfy_quant" in text, text
    assert "ConvRot group size 16384" in text, text
    assert seconds < 5.0
    assert grown < 256 * 2**20  # the old loader kept a 1 GiB matrix


def test_nvfp4_tensor_scale_that_overflows_is_a_node_error_not_a_nan_latent(comfy, models_dir, output_dir):
    sd = load_file(str(models_dir / "diffusion_models" / TINY_UNET))
    good, layers = {}, []
    for key, w in sd.items():
        if not _quantized(key, w):
            good[key] = w
            continue
        layer = key[: -len(".weight")]
        parts = nvfp4.file_tensors(QuantizedTensor.from_float(w.float(), NVFP4.for_shape(w.shape)))
        good.update({layer + "." + k: v for k, v in parts.items()})
        good[layer + ".comfy_quant"] = comfy_int8.comfy_quant_bytes({"format": "nvfp4"})
        layers.append(layer)
    folder = models_dir / "diffusion_models"
    save_file({k: v.contiguous() for k, v in good.items()}, str(folder / "nvfp4_scale_good.safetensors"))
    ref = _sample(comfy, output_dir, "nvfp4_scale_good.safetensors", "nv_scale_good")
    assert torch.isfinite(ref).all()
    bad = dict(good, **{name + ".weight_scale_2": torch.tensor(3e38, dtype=torch.float32) for name in layers})
    save_file({k: v.contiguous() for k, v in bad.items()}, str(folder / "nvfp4_scale_3e38.safetensors"))
    try:
        latent = _sample(comfy, output_dir, "nvfp4_scale_3e38.safetensors", "nv_scale_bad")
    except Exception as exc:  # WorkflowError with the node's exception text
        text = str(exc)
    else:
        raise AssertionError(f"the file loaded and sampled: {int(torch.isnan(latent).sum())} of {latent.numel()} "
                             f"latent values NaN, {int((~torch.isfinite(latent)).sum())} not finite, largest "
                             f"{float(latent.abs().max()):.4g} (the good file's: {float(ref.abs().max()):.4g})")
    assert "nvfp4_scale_3e38.safetensors" in text and any(f"'{name}.weight_scale_2'" in text for name in layers), text
    assert "LoadFP8DiffusionModel" in text and "NaN" in text, text
