"""The loaders' dequantized_copies_gb option, in process with ComfyUI's own ModelPatcher (no server).

On the CPU a weight-only model loaded with a budget keeps its layers dequantized (in the dtype ComfyUI computes
in: that dtype is what these tests observe and the tooltip states); its layers give the bits of the same model
loaded without it; a LoRA patched in place or by replacement, and unpatched, never lets a layer multiply a
stale copy (each output equals a fresh dequantize + F.linear of the weight the layer holds then); ComfyUI's
unloading of the model (ModelPatcher.detach, as free memory and model switches do) gives every byte back.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch
import torch.nn.functional as F

from helpers import fp8_files
from helpers.host import comfy_in_process
from helpers.lora import make_lora

pytestmark = pytest.mark.integration

FILE = "dequant_copies_fp8.safetensors"


@pytest.fixture(scope="module")
def env(tiny_models_cache, tmp_path_factory):
    comfy_in_process()
    import comfy.lora  # noqa: F401  (the LoRA key mapping load_lora_for_models uses)
    import comfy.model_management
    import comfy.sd
    import folder_paths

    fp8_files.tiny_sd3_per_tensor_folder(tiny_models_cache, tmp_path_factory.mktemp("dequant_copies_models"), FILE)
    user = folder_paths.get_user_directory()
    folder_paths.set_user_directory(str(tmp_path_factory.mktemp("dequant_copies_user")))
    from fp8_engram.nodes import fp8 as nodes

    yield nodes, comfy.sd
    comfy.model_management.unload_all_models()
    folder_paths.set_user_directory(user)


def _load(env, gb: float):
    out = env[0].LoadFP8DiffusionModel.execute(FILE, "weight-only", "auto", "auto", "nearest",
                                               "proven on this device", gb)
    return out.result[0], out.ui["fp8_summary"][0]


def _linears(model) -> dict:
    from fp8_engram.quant import QuantizedTensor

    return {n: m for n, m in model.model.diffusion_model.named_modules()
            if isinstance(m, torch.nn.Linear) and isinstance(m.weight, QuantizedTensor)}


def _compute_dtype(model) -> torch.dtype:
    """The dtype ComfyUI runs this model's layers in (its manual cast dtype, else the model's)."""
    return model.model.manual_cast_dtype or model.model.get_dtype()


def _run(model, seed: int = 3) -> dict:
    """Every quantized layer's output through its own forward (the pack's linear), on inputs in the dtype
    ComfyUI computes in; with each a fresh dequantize + F.linear of the weight the layer holds now."""
    dtype = _compute_dtype(model)
    g = torch.Generator().manual_seed(seed)
    out = {}
    with torch.inference_mode():
        for n, m in sorted(_linears(model).items()):
            x = torch.randn(3, m.in_features, generator=g).to(dtype)
            bias = None if m.bias is None else m.bias.to(dtype)
            out[n] = (m(x), F.linear(x, m.weight.dequantize(dtype), bias))
    return out


def _copies(model) -> list:
    return [m.weight.__dict__["_derived"]["dequantized_copy"][1] for m in _linears(model).values()
            if "dequantized_copy" in m.weight.__dict__.get("_derived", {})]


def test_the_option_keeps_copies_in_the_compute_dtype_with_the_same_bits(env):
    from fp8_engram.quant.runtime import DEQUANT_COPIES

    nodes = env[0]
    option = next(i for i in nodes._options() if i.id == "dequantized_copies_gb")
    assert option.default == 0.0 and option.optional
    gc.collect()
    before = DEQUANT_COPIES.bytes
    model, summary = _load(env, 1.0)
    plain, plain_summary = _load(env, 0.0)
    assert "kept dequantized up to 1 GB" in summary["compute_path"]
    assert "kept dequantized" not in plain_summary["compute_path"]
    assert all(m.weight.config.dequant_cache_bytes == 1 << 30 for m in _linears(model).values())
    got, ref = _run(model), _run(plain)
    for n in got:
        assert torch.equal(got[n][0], got[n][1]), n
        assert torch.equal(got[n][0], ref[n][0]), n
    copies = _copies(model)
    assert len(copies) == len(_linears(model)) == 24 and not _copies(plain)
    dtype = _compute_dtype(model)
    assert {c.dtype for c in copies} == {dtype}
    logging.getLogger(__name__).info("ComfyUI computes this CPU model in %s; its kept copies are %s", dtype, dtype)
    assert DEQUANT_COPIES.bytes - before == sum(c.numel() * c.element_size() for c in copies)
    del copies
    model.detach(unpatch_all=True)  # what ComfyUI's unloading calls
    gc.collect()
    assert not _copies(model) and DEQUANT_COPIES.bytes == before


@pytest.mark.parametrize("inplace", [False, True], ids=["replace", "inplace"])
def test_a_lora_patch_and_unpatch_never_multiply_a_stale_copy(env, inplace):
    from fp8_engram.quant.runtime import DEQUANT_COPIES

    gc.collect()
    before = DEQUANT_COPIES.bytes
    model, _ = _load(env, 1.0)
    first = _run(model)  # copies made of the unpatched weights
    patched, _ = env[1].load_lora_for_models(model, None, make_lora(model), 1.0, 0.0)
    patched.weight_inplace_update = inplace
    with torch.inference_mode():
        patched.patch_model(device_to=torch.device("cpu"))
    during = _run(patched)
    changed = [n for n in during if not torch.equal(during[n][0], first[n][0])]
    assert len(changed) == 3, changed  # the LoRA's layers, and only those
    for n, (got, fresh) in during.items():
        assert torch.equal(got, fresh), n
    with torch.inference_mode():
        patched.unpatch_model(device_to=torch.device("cpu"))
    after = _run(model)
    for n, (got, fresh) in after.items():
        assert torch.equal(got, fresh), n
        assert torch.equal(got, first[n][0]), n
    patched.detach(unpatch_all=True)
    model.detach(unpatch_all=True)
    del model, patched
    gc.collect()
    assert DEQUANT_COPIES.bytes == before
