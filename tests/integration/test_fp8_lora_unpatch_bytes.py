"""In process, with ComfyUI's own ModelPatcher (no server): a LoRA patched onto FP8 weights changes
them as dequantize -> add -> requantize, and unpatching restores every original FP8 byte and scale
exactly: with in-place and replacing updates, under inference_mode (where ComfyUI patches, and where
the weight backups go through the `Tensor.to` overloads) and outside it.

Threshold: patched weight vs float64 (dequantized original + LoRA delta) > 25 dB (per-tensor e4m3fn)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from helpers import lora as lora_helpers
from helpers.lora import LORA_LAYERS, lora_delta, make_lora
from helpers.numerics import sqnr

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def comfy_modules():
    return lora_helpers.comfy_modules()


@pytest.fixture(scope="module")
def fp8_file(tiny_models_cache, tmp_path_factory):
    return lora_helpers.write_tiny_fp8(tiny_models_cache, tmp_path_factory.mktemp("fp8_lora"), "comfy_quant_metadata")


def _load(comfy_modules, path):
    comfy_sd, make_fp8_ops = comfy_modules
    from fp8_engram.quant import ComputeConfig, formats

    cfg = ComputeConfig(path="weight_only")
    sd, _ = formats.load_file(str(path), config=cfg)
    return comfy_sd.load_diffusion_model_state_dict(sd, model_options={"custom_operations": make_fp8_ops(cfg)})


def _snapshot(model) -> dict:
    return lora_helpers.snapshot(model, lambda w: w.fp8_dtype)


@pytest.mark.parametrize("inplace", [False, True], ids=["replace", "inplace"])
@pytest.mark.parametrize("mode", ["inference_mode", "grad_mode"])
def test_unpatching_a_lora_restores_the_fp8_bytes_and_scales_exactly(comfy_modules, fp8_file, inplace, mode):
    comfy_sd, _ = comfy_modules
    from fp8_engram.quant import QuantizedTensor

    base = _load(comfy_modules, fp8_file)
    before = _snapshot(base)
    assert len(before) == 24
    lora = make_lora(base)
    ctx = torch.inference_mode() if mode == "inference_mode" else contextlib.nullcontext()
    with ctx:
        patched, _ = comfy_sd.load_lora_for_models(base, None, lora, 1.0, 0.0)
        patched.weight_inplace_update = inplace
        patched.patch_model(device_to=torch.device("cpu"))
        during = _snapshot(patched)
        for layer in LORA_LAYERS:
            want = before[layer][4] + lora_delta(lora, layer)
            q = sqnr(want, during[layer][4])
            assert q > 25.0, f"{layer}: patched weight vs dequantized + LoRA delta {q:.1f} dB"
            assert not torch.equal(during[layer][0], before[layer][0])  # the patch really changed the bytes
            assert during[layer][2] == before[layer][2] and during[layer][3] == before[layer][3]
        untouched = [n for n in before if n not in LORA_LAYERS]
        assert all(torch.equal(during[n][0], before[n][0]) for n in untouched)
        patched.unpatch_model(device_to=torch.device("cpu"))
    after = _snapshot(base)
    assert after.keys() == before.keys()
    for name, (qbytes, scale, layout, fp8, _) in before.items():
        w = base.model.diffusion_model.get_submodule(name).weight
        assert isinstance(w, QuantizedTensor) and w.layout == layout and w.fp8_dtype == fp8, name
        assert torch.equal(after[name][0], qbytes), f"{name}: FP8 bytes differ after unpatching"
        assert torch.equal(after[name][1], scale), f"{name}: scale differs after unpatching"
