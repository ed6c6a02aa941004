"""An NVFP4 file without its comfy_quant metadata (ComfyUI issue #15511) through the real server: Load FP8
Diffusion Model reads it as NVFP4 by its tensors, says so in its summary, and samples the same latent as from
the same file with its metadata. The file is the pack's own (Quantize to NVFP4 + the pack's writer), so this
runs on every ComfyUI the suite uses, 0.3.75 included (the pack needs none of ComfyUI's NVFP4 code)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.graphs import TINY_UNET, fp8_loader, saved_latent, sd3_txt2img
from helpers.numerics import sqnr

pytestmark = pytest.mark.integration

MARKED, BARE = "nvfp4_marked_tiny_sd3.safetensors", "nvfp4_unmarked_tiny_sd3.safetensors"


@pytest.fixture(scope="module")
def nvfp4_files(models_dir):
    from fp8_engram.quant import NVFP4, QuantizedTensor
    from fp8_engram.quant.save import save_state_dict

    folder = models_dir / "diffusion_models"
    sd = load_file(str(folder / TINY_UNET))
    # the embedders stay bf16, as in Comfy-Org's NVFP4 files (ComfyUI reads the model's widths from them)
    q = {k: (QuantizedTensor.from_float(v.float(), NVFP4.for_shape(v.shape))
             if k.endswith(".weight") and v.dim() == 2 and "embedder" not in k else v) for k, v in sd.items()}
    for name in (MARKED, BARE):
        (folder / name).unlink(missing_ok=True)
    save_state_dict(q, folder / MARKED)
    tensors = {k: v for k, v in load_file(str(folder / MARKED)).items() if not k.endswith(".comfy_quant")}
    assert any(k.endswith(".weight_scale_2") for k in tensors)
    save_file(tensors, str(folder / BARE))  # no comfy_quant tensors, no header metadata
    return sum(1 for v in q.values() if isinstance(v, QuantizedTensor))


def _latent(comfy, output_dir, name: str, prefix: str):
    hist = comfy.run(sd3_txt2img(model=fp8_loader(name, "weight-only"), save="latent", seed=11, prefix=prefix))
    return saved_latent(hist, output_dir), hist["outputs"]["1"]["fp8_summary"][0]


def test_unmarked_nvfp4_file_loads_as_nvfp4_through_the_loader(comfy, output_dir, nvfp4_files):
    marked, s_marked = _latent(comfy, output_dir, MARKED, "nv_marked")
    bare, s_bare = _latent(comfy, output_dir, BARE, "nv_bare")
    assert s_marked["format"] == "comfy_quant_per_layer"
    assert s_bare["format"] == "nvfp4_without_metadata", s_bare
    assert s_bare["layers_quantized"] == nvfp4_files == s_marked["layers_quantized"]
    assert s_bare["granularity"] == {"nvfp4": nvfp4_files}
    assert any("recognised as NVFP4 by their tensors" in n and "15511" in n for n in s_bare["notes"]), s_bare["notes"]
    assert torch.isfinite(bare).all()
    assert torch.equal(marked, bare), f"the unmarked file samples differently: {sqnr(marked, bare):.1f} dB"
