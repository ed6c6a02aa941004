"""Load FP8 Checkpoint and Load FP8 Text Encoder on the real server.

- A checkpoint made by the test from the tiny SD3 + TAESD3 + CLIP-L with the key prefixes ComfyUI's
  detection expects (`model.diffusion_model.`, `first_stage_model.`, `text_encoders.clip_l.transformer.`),
  the diffusion model and the text encoder's linear layers per-tensor e4m3fn (ComfyUI's
  `_quantization_metadata` form), loads through the pack's node as MODEL + CLIP + VAE and samples and
  decodes close to the separate full-precision files loaded by the stock nodes.
- The tiny CLIP-L, converted to FP8 by the pack's converter, loads through Load FP8 Text Encoder with
  the `sd3` type; sampling with its conditioning is close to the stock CLIPLoader on the fp16 file,
  and (in process, ComfyUI's own text encoder classes with the pack's ops) its conditioning is close
  to the stock encoder's.

Thresholds: checkpoint latent > 15 dB and decoded image > 15 dB vs full precision (both the model and
the encoder are FP8; measured 26.5 / 29.5 dB); text encoder (per-tensor e4m3fn through 12 layers):
conditioning > 18 dB and pooled output > 18 dB vs the fp16 encoder (measured 22.3 / 22.5 dB), sampled
latent > 20 dB (measured 29.5 dB).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from helpers import fp8_files
from helpers.host import comfy_in_process
from helpers.graphs import TINY_CLIP_L, TINY_UNET, TINY_VAE, output_images, saved_latent, sd3_txt2img
from helpers.numerics import sqnr

pytestmark = pytest.mark.integration

PROMPT = "a red apple on a wooden table"
_counter = itertools.count()


def _options() -> dict:
    return {"compute_path": "auto", "activation_scaling": "static", "compute_dtype": "auto"}


def _run(comfy, output_dir, graph) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    hist = comfy.run(graph)
    latent = saved_latent(hist, output_dir)
    image = None
    images = output_images(hist, "9")
    if images:
        img = Image.open(output_dir / images[0]["subfolder"] / images[0]["filename"])
        image = torch.from_numpy(np.asarray(img.convert("RGB"), dtype=np.float32) / 255.0)
    return latent, image, hist


def _not_embedding(key: str, t: torch.Tensor) -> bool:
    return fp8_files.default_quantize(key, t) and "embed" not in key.split(".")[-2]


@pytest.fixture(scope="module")
def fp8_checkpoint(models_dir) -> str:
    sd = {}
    for k, v in load_file(str(models_dir / "diffusion_models" / TINY_UNET)).items():
        sd["model.diffusion_model." + k] = v
    for k, v in load_file(str(models_dir / "vae" / TINY_VAE)).items():
        sd["first_stage_model." + k] = v
    for k, v in load_file(str(models_dir / "text_encoders" / TINY_CLIP_L)).items():
        sd["text_encoders.clip_l.transformer." + k] = v
    path = models_dir / "checkpoints" / "fp8t_tiny_sd3_checkpoint.safetensors"
    fp8_files.write_format(sd, path, "comfy_quant_metadata", quantize=_not_embedding)
    return path.name


@pytest.fixture(scope="module")
def fp8_clip(models_dir) -> str:
    from fp8_engram.quant.convert import convert_file

    path = models_dir / "text_encoders" / "fp8t_tiny_clip_l_fp8.safetensors"
    if path.exists():
        path.unlink()
    result, layer_sqnr = convert_file(models_dir / "text_encoders" / TINY_CLIP_L, path)
    assert result.layers_quantized > 0 and result.stock_comfy_readable and min(layer_sqnr.values()) > 25.0
    return path.name


def test_load_fp8_checkpoint_gives_model_clip_and_vae_close_to_full_precision(comfy, output_dir, fp8_checkpoint):
    reference, ref_image, _ = _run(comfy, output_dir, sd3_txt2img(PROMPT, seed=21, save="both",
                                                                 prefix=f"fp8ck{next(_counter)}"))
    graph = sd3_txt2img(PROMPT, seed=21, save="both", prefix=f"fp8ck{next(_counter)}",
                        model={"class_type": "FP8Engram.LoadFP8Checkpoint",
                               "inputs": {"ckpt_name": fp8_checkpoint, **_options()}})
    graph["3"]["inputs"]["clip"] = ["1", 1]
    graph["4"]["inputs"]["clip"] = ["1", 1]
    graph["8"]["inputs"]["vae"] = ["1", 2]
    del graph["2"], graph["7"]
    latent, image, hist = _run(comfy, output_dir, graph)
    q_lat, q_img = sqnr(reference, latent), sqnr(ref_image, image)
    print(f"Load FP8 Checkpoint vs separate full-precision files: latent {q_lat:.1f} dB, image {q_img:.1f} dB")
    assert q_lat > 15.0 and q_img > 15.0
    summary = hist["outputs"]["1"]["fp8_summary"][0]
    # 24 linear layers of the tiny SD3 + the CLIP-L's linear layers (embeddings stay fp16)
    assert summary["format"] == fp8_files.DETECTED_AS["comfy_quant_metadata"]
    assert summary["layers_quantized"] > 24 and summary["bytes_on_disk"] < summary["bytes_bf16"]


def _clip_conditioning(models_dir, name: str, fp8: bool):
    """(cond, pooled) for PROMPT from ComfyUI's own text-encoder loader in this process."""
    comfy_in_process()
    import comfy.sd

    path = str(models_dir / "text_encoders" / name)
    if fp8:
        from fp8_engram.nodes.ops import make_fp8_ops
        from fp8_engram.quant import ComputeConfig, formats

        cfg = ComputeConfig()
        sd, _ = formats.load_file(path, config=cfg)
        clip = comfy.sd.load_text_encoder_state_dicts([sd], clip_type=comfy.sd.CLIPType.SD3,
                                                      model_options={"custom_operations": make_fp8_ops(cfg)})
    else:
        clip = comfy.sd.load_clip([path], clip_type=comfy.sd.CLIPType.SD3)
    with torch.inference_mode():
        cond, pooled = clip.encode_from_tokens(clip.tokenize(PROMPT), return_pooled=True)
    return cond.float().clone(), pooled.float().clone()


def test_load_fp8_text_encoder_conditions_like_the_stock_clip_loader(comfy, output_dir, models_dir, fp8_clip):
    reference, _, _ = _run(comfy, output_dir, sd3_txt2img(PROMPT, seed=22, save="latent",
                                                         prefix=f"fp8te{next(_counter)}"))
    graph = sd3_txt2img(PROMPT, seed=22, save="latent", prefix=f"fp8te{next(_counter)}")
    graph["2"] = {"class_type": "FP8Engram.LoadFP8TextEncoder",
                  "inputs": {"clip_name": fp8_clip, "type": "sd3", **_options()}}
    latent, _, hist = _run(comfy, output_dir, graph)
    q_lat = sqnr(reference, latent)
    summary = hist["outputs"]["2"]["fp8_summary"][0]
    assert summary["layers_quantized"] > 0 and summary["bytes_on_disk"] < summary["bytes_bf16"]

    cond_ref, pooled_ref = _clip_conditioning(models_dir, TINY_CLIP_L, fp8=False)
    cond, pooled = _clip_conditioning(models_dir, fp8_clip, fp8=True)
    assert cond.shape == cond_ref.shape and pooled.shape == pooled_ref.shape
    q_cond, q_pooled = sqnr(cond_ref, cond), sqnr(pooled_ref, pooled)
    print(f"Load FP8 Text Encoder vs stock CLIPLoader (fp16 file): conditioning {q_cond:.1f} dB, "
          f"pooled {q_pooled:.1f} dB, sampled latent {q_lat:.1f} dB")
    assert q_cond > 18.0 and q_pooled > 18.0 and q_lat > 20.0
