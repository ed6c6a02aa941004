"""In process, with ComfyUI's own ModelPatcher (no server): a LoRA patched onto AWQ W4A16 weights goes
dequantize -> add -> requantize (the layout's round to nearest per group, same group size and scale dtype) and
unpatching restores every original byte, scale and zero point exactly; on SVDQuant W4A4 weights, which cannot
be requantized (their smoothing and low-rank branch come from calibration), the patch is refused with an error
that says so, and the model is left as it was."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import lora as lora_helpers
from helpers.lora import LORA_LAYERS, lora_delta, make_lora
from helpers.numerics import sqnr

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def comfy_modules():
    return lora_helpers.comfy_modules()


def _write(tiny_models_cache, folder, kind: str):
    from helpers.int4_files import awq_parts, svdquant_parts

    sd = load_file(str(tiny_models_cache / "diffusion_models" / "tiny_sd3.safetensors"))
    out = {}
    for key, v in sd.items():
        layer = key[: -len(".weight")]
        if key.endswith(".weight") and v.dim() == 2 and key.startswith("joint_blocks.") and v.shape[0] % 128 == 0 \
                and v.shape[1] % 64 == 0:
            parts = awq_parts(v) if kind == "awq" else svdquant_parts(v, 16)
            out.update({f"{layer}.{suffix}": t for suffix, t in parts.items()})
        else:
            out[key] = v
    path = folder / f"tiny_sd3_{kind}.safetensors"
    save_file(out, str(path))
    return path


def _load(comfy_modules, path):
    comfy_sd, make_fp8_ops = comfy_modules
    from fp8_engram.quant import ComputeConfig, formats

    cfg = ComputeConfig(path="weight_only")
    sd, _ = formats.load_file(str(path), config=cfg)
    return comfy_sd.load_diffusion_model_state_dict(sd, model_options={"custom_operations": make_fp8_ops(cfg)})


@pytest.mark.parametrize("inplace", [False, True], ids=["replace", "inplace"])
def test_lora_on_awq_weights_patches_and_unpatches_exactly(comfy_modules, tiny_models_cache, tmp_path, inplace):
    comfy_sd, _ = comfy_modules
    from fp8_engram.quant.layouts.awq import is_awq

    base = _load(comfy_modules, _write(tiny_models_cache, tmp_path, "awq"))
    before = lora_helpers.snapshot(base, lambda w: w.scale.dtype)
    assert len(before) >= 12 and all(name in before for name in LORA_LAYERS)
    lora = make_lora(base)
    with torch.inference_mode():
        patched, _ = comfy_sd.load_lora_for_models(base, None, lora, 1.0, 0.0)
        patched.weight_inplace_update = inplace
        patched.patch_model(device_to=torch.device("cpu"))
        during = lora_helpers.snapshot(patched, lambda w: w.scale.dtype)
        for layer in LORA_LAYERS:
            w = patched.model.diffusion_model.get_submodule(layer).weight
            assert is_awq(w) and during[layer][2] == before[layer][2] and during[layer][3] == before[layer][3]
            q = sqnr(before[layer][4] + lora_delta(lora, layer), during[layer][4])
            assert q > 17.0, f"{layer}: patched weight vs dequantized + LoRA delta {q:.1f} dB (4-bit, 64 per group)"
            assert not torch.equal(during[layer][0], before[layer][0])
        assert all(torch.equal(during[n][0], before[n][0]) for n in before if n not in LORA_LAYERS)
        patched.unpatch_model(device_to=torch.device("cpu"))
    after = lora_helpers.snapshot(base, lambda w: w.scale.dtype)
    for name, (qbytes, scale, layout, _dtype, _) in before.items():
        assert after[name][2] == layout, name
        assert torch.equal(after[name][0], qbytes) and torch.equal(after[name][1], scale), f"{name}: not restored"


def test_lora_on_svdquant_weights_is_refused_saying_why(comfy_modules, tiny_models_cache, tmp_path):
    comfy_sd, _ = comfy_modules
    base = _load(comfy_modules, _write(tiny_models_cache, tmp_path, "svdq"))
    before = lora_helpers.snapshot(base, lambda w: w.scale.dtype)
    lora = make_lora(base)
    with torch.inference_mode():
        patched, _ = comfy_sd.load_lora_for_models(base, None, lora, 1.0, 0.0)
        with pytest.raises(Exception, match="SVDQuant W4A4 weights come from offline calibration"):
            patched.patch_model(device_to=torch.device("cpu"))
        patched.unpatch_model(device_to=torch.device("cpu"))
    after = lora_helpers.snapshot(base, lambda w: w.scale.dtype)
    for name, (qbytes, scale, _layout, _dtype, _) in before.items():
        assert torch.equal(after[name][0], qbytes) and torch.equal(after[name][1], scale), f"{name}: changed"
