"""In process, with ComfyUI's own ModelPatcher (no server): a LoRA patched onto quantized weights changes
them as dequantize -> add -> requantize, and unpatching restores every original byte and scale exactly:
with in-place and replacing updates, under inference_mode (where ComfyUI patches, and where the weight
backups go through the `Tensor.to` overloads) and outside it. Two kinds of weight:

- fp8: an FP8 file (ComfyUI mixed-precision metadata) loaded weight-only; the patched weight keeps the
  file's layout, FP8 dtype and scale. Threshold: patched weight vs float64 (dequantized original + LoRA
  delta) > 25 dB (per-tensor e4m3fn).
- int8: an FP8 file (per-layer comfy_quant) loaded with the int8 compute path, so its weights are int8
  (converted once at load, with a per-layer SQNR report); the patch requantizes into the same Int8
  layout (rotation included) and the patched model runs the int8 path. Thresholds: patched weight > 35 dB
  (int8 per channel); conversion SQNR of every layer > 30 dB (the FP8 weights dequantized, float64).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from helpers import lora as lora_helpers
from helpers.lora import LORA_LAYERS, lora_delta, make_lora
from helpers.numerics import sqnr

pytestmark = pytest.mark.integration

# kind -> (file format written from the tiny model, compute path, patched-weight floor in dB)
KINDS = {"fp8": ("comfy_quant_metadata", "weight_only", 25.0), "int8": ("comfy_quant_per_layer", "int8", 35.0)}


@pytest.fixture(scope="module")
def comfy_modules():
    return lora_helpers.comfy_modules()


@pytest.fixture(scope="module")
def fp8_files(tiny_models_cache, tmp_path_factory):
    files = {}
    for kind, (fmt, _, _) in KINDS.items():
        files[kind] = lora_helpers.write_tiny_fp8(tiny_models_cache, tmp_path_factory.mktemp(f"{kind}_lora"), fmt)
    return files


def _load(comfy_modules, path, compute_path: str):
    """(model, its operations class, the file's weights dequantized in float64)."""
    comfy_sd, make_fp8_ops = comfy_modules
    from fp8_engram.quant import ComputeConfig, formats

    cfg = ComputeConfig(path=compute_path)
    sd, _ = formats.load_file(str(path), config=cfg)
    fp8 = {k: v.dequantize(torch.float64) for k, v in sd.items() if hasattr(v, "qdata")}
    ops = make_fp8_ops(cfg)
    model = comfy_sd.load_diffusion_model_state_dict(sd, model_options={"custom_operations": ops})
    return model, ops, fp8


def _snapshot(model, kind: str) -> dict:
    return lora_helpers.snapshot(model, (lambda w: w.fp8_dtype) if kind == "fp8" else (lambda w: w.qdata.dtype))


def test_int8_load_converts_every_fp8_layer_and_reports_its_sqnr(comfy_modules, fp8_files):
    from fp8_engram.quant.compute.int8 import is_int8

    model, ops, fp8 = _load(comfy_modules, fp8_files["int8"], "int8")
    snap = _snapshot(model, "int8")
    assert len(snap) == 24 and all(v[3] == torch.int8 for v in snap.values())
    dm = model.model.diffusion_model
    assert all(is_int8(dm.get_submodule(n).weight) for n in snap)
    assert len(ops.int8_layers) == 24 and min(db for _, db in ops.int8_layers) > 30.0
    for name, db in ops.int8_layers:
        # the report is the truth: the weight against the FP8 file's values, on every row up to 256 rows and on
        # 256 rows spread over a larger layer (within 0.5 dB of the whole layer's figure)
        got = sqnr(fp8[f"{name}.weight"], snap[name][4])
        sampled = fp8[f"{name}.weight"].shape[0] > 256
        assert abs(got - db) < (0.5 if sampled else 0.05), (name, got, db)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_an_int8_load_rotates_by_the_block_of_the_device_it_will_compute_on(comfy_modules, fp8_files, monkeypatch,
                                                                             device):
    """A GPU model's weights are converted on the CPU at load but rotated by the GPU's block, 128 (the one its
    fused quantizer holds); a CPU model's by 256 where that divides the layer's input width. Only ComfyUI's
    compute device is named "cuda" here (no GPU is used: the weights stay on the CPU)."""
    import comfy.model_management
    from fp8_engram.quant.compute.int8 import is_int8

    monkeypatch.setattr(comfy.model_management, "get_torch_device", lambda: torch.device(device))
    model, _, _ = _load(comfy_modules, fp8_files["int8"], "int8")
    weights = [m.weight for m in model.model.diffusion_model.modules() if is_int8(getattr(m, "weight", None))]
    want = [256 if device == "cpu" and w.qdata.shape[1] % 256 == 0 else 128 for w in weights]
    assert weights and [w.layout.rotation for w in weights] == want
    assert (256 in want) == (device == "cpu")  # the tiny model has layers 256 divides


@pytest.mark.parametrize("inplace", [False, True], ids=["replace", "inplace"])
@pytest.mark.parametrize("mode", ["inference_mode", "grad_mode"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_unpatching_a_lora_restores_the_bytes_and_scales_exactly(comfy_modules, fp8_files, kind, inplace, mode):
    comfy_sd, _ = comfy_modules
    from fp8_engram.quant import QuantizedTensor, linear
    from fp8_engram.quant.compute.int8 import int8_linear

    _, compute_path, floor = KINDS[kind]
    base, _, _ = _load(comfy_modules, fp8_files[kind], compute_path)
    before = _snapshot(base, kind)
    assert len(before) == 24
    lora = make_lora(base)
    ctx = torch.inference_mode() if mode == "inference_mode" else contextlib.nullcontext()
    with ctx:
        patched, _ = comfy_sd.load_lora_for_models(base, None, lora, 1.0, 0.0)
        patched.weight_inplace_update = inplace
        patched.patch_model(device_to=torch.device("cpu"))
        during = _snapshot(patched, kind)
        for layer in LORA_LAYERS:
            want = before[layer][4] + lora_delta(lora, layer)
            q = sqnr(want, during[layer][4])
            assert q > floor, f"{layer}: patched weight vs dequantized + LoRA delta {q:.1f} dB"
            assert not torch.equal(during[layer][0], before[layer][0])  # the patch really changed the bytes
            assert during[layer][2] == before[layer][2]  # same layout
            if kind == "fp8":
                assert during[layer][3] == before[layer][3]
            else:
                assert during[layer][3] == torch.int8
                # the patched weight still runs the int8 path
                w = patched.model.diffusion_model.get_submodule(layer).weight
                x = torch.randn(3, w.shape[1])
                assert torch.equal(linear(x, w), int8_linear(x, w, None, torch.float32))
        untouched = [n for n in before if n not in LORA_LAYERS]
        assert all(torch.equal(during[n][0], before[n][0]) for n in untouched)
        patched.unpatch_model(device_to=torch.device("cpu"))
    after = _snapshot(base, kind)
    assert after.keys() == before.keys()
    for name, (qbytes, scale, layout, dtype, _) in before.items():
        w = base.model.diffusion_model.get_submodule(name).weight
        stored = w.fp8_dtype if kind == "fp8" else w.qdata.dtype
        assert isinstance(w, QuantizedTensor) and w.layout == layout and stored == dtype, name
        assert torch.equal(after[name][0], qbytes), f"{name}: {kind} bytes differ after unpatching"
        assert torch.equal(after[name][1], scale), f"{name}: scale differs after unpatching"
