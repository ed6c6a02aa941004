"""Layers a file keeps in 16 bits, on a CPU model that computes in float32, in process with ComfyUI's own
ModelPatcher (no server).

The loaders hold such a layer as the file has it (bf16 here) and widen it to the model's float32 once, at its
first call (nodes/ops.py ``_widen_at_first_call``): widening every kept layer at load was most of a load's time
(the Flux-shaped e2e model: 0.135 s of 0.2 s). What is shown here, on the tiny SD3 model converted by this pack
(its embedders and final layer stay bf16):

- after the load the kept layers are bf16; after one sampling call they are float32 with the same values, and
  the model's output is bit-identical to a load that widened them at once (widening bf16 is exact);
- ComfyUI's memory planning is told the model's size as it will be once they are widened;
- a layer ComfyUI patches per call (lowvram's weight functions) stays bf16 and its output is the patched one;
- a LoRA patched onto a kept layer runs with the patched values, and after unpatching the layer runs with the
  file's values again (ComfyUI's backup is the bf16 weight, widened again at its next call).
"""

from __future__ import annotations

import pytest
import torch

from helpers import tiny_sd3
from helpers.host import comfy_in_process

pytestmark = pytest.mark.integration

FILE = "kept_widen_fp8.safetensors"
KEPT = ("context_embedder", "y_embedder.mlp.0", "final_layer.linear")


@pytest.fixture(scope="module")
def env(tiny_models_cache, tmp_path_factory):
    comfy_in_process()
    import comfy.lora  # noqa: F401  (the LoRA key mapping load_lora_for_models uses)
    import comfy.model_management
    import comfy.sd
    import folder_paths

    from fp8_engram.quant.convert import convert_file

    folder = tmp_path_factory.mktemp("kept_widen_models")
    convert_file(tiny_models_cache / "diffusion_models" / "tiny_sd3.safetensors", folder / FILE, granularity="tensor")
    folder_paths.add_model_folder_path("diffusion_models", str(folder))
    user = folder_paths.get_user_directory()
    folder_paths.set_user_directory(str(tmp_path_factory.mktemp("kept_widen_user")))
    from fp8_engram.nodes import fp8 as nodes
    from fp8_engram.nodes import ops

    yield nodes, ops, comfy
    comfy.model_management.unload_all_models()
    folder_paths.set_user_directory(user)


def _load(env, monkeypatch=None, eager: bool = False):
    nodes, ops, _ = env
    if eager:
        monkeypatch.setattr(ops, "_widens_later", lambda *a: False)
    model = nodes.LoadFP8DiffusionModel.execute(FILE, "weight-only", "auto", "auto").result[0]
    if eager:
        monkeypatch.undo()
    return model


def _kept(model) -> dict:
    dm = model.model.diffusion_model
    return {n: dm.get_submodule(n) for n in KEPT}


def test_kept_layers_load_as_the_file_has_them_and_widen_at_their_first_call(env, monkeypatch):
    model = _load(env)
    assert model.model.manual_cast_dtype in (None, torch.float32) and model.model.get_dtype() == torch.float32
    before = {n: m.weight.detach().clone() for n, m in _kept(model).items()}
    assert all(w.dtype == torch.bfloat16 for w in before.values()), {n: w.dtype for n, w in before.items()}
    out = tiny_sd3.apply(model, seed=11)
    for n, m in _kept(model).items():
        assert m.weight.dtype == torch.float32, n
        assert torch.equal(m.weight, before[n].float()), n
    eager = _load(env, monkeypatch, eager=True)
    assert all(m.weight.dtype == torch.float32 for m in _kept(eager).values())
    assert torch.equal(tiny_sd3.apply(eager, seed=11), out)
    assert torch.equal(tiny_sd3.apply(model, seed=11), out)  # and again, widened


def test_comfyui_is_told_the_size_the_model_has_once_its_kept_layers_are_widened(env):
    comfy = env[2]
    model = _load(env)
    loaded = comfy.model_management.module_size(model.model)
    widened_bytes = sum(m.weight.numel() * 2 for m in model.model.diffusion_model.modules()
                        if getattr(m, "fp8_widen_to", None) is not None)
    assert widened_bytes > 0 and model.model_size() == loaded + widened_bytes
    tiny_sd3.apply(model, seed=11)
    assert comfy.model_management.module_size(model.model) == model.model_size()


def test_a_layer_patched_per_call_stays_as_loaded(env):
    model = _load(env)
    layer = _kept(model)["final_layer.linear"]
    w = layer.weight.detach().clone()
    layer.weight_function.append(lambda weight: weight * 2)
    try:
        x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(2))
        with torch.inference_mode():
            got = layer(x)
        assert layer.weight.dtype == torch.bfloat16
        torch.testing.assert_close(got, torch.nn.functional.linear(x, w.float() * 2, layer.bias), rtol=0, atol=0)
    finally:
        layer.weight_function.clear()


def test_a_lora_on_a_kept_layer_runs_patched_and_the_file_values_after_unpatching(env):
    import comfy.sd

    model = _load(env)
    name = "context_embedder"
    file_w = _kept(model)[name].weight.detach().clone()
    g = torch.Generator().manual_seed(5)
    lora = {f"diffusion_model.{name}.lora_up.weight": torch.randn(file_w.shape[0], 4, generator=g) * 0.1,
            f"diffusion_model.{name}.lora_down.weight": torch.randn(4, file_w.shape[1], generator=g) * 0.1}
    patched, _ = comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0.0)
    with torch.inference_mode():
        patched.patch_model(device_to=torch.device("cpu"))
    layer = _kept(patched)[name]
    patched_w = layer.weight.detach().clone()
    assert patched_w.dtype == torch.bfloat16 and not torch.equal(patched_w, file_w)
    x = torch.randn(2, layer.in_features, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        got = layer(x)
    assert layer.weight.dtype == torch.float32 and torch.equal(layer.weight, patched_w.float())
    assert torch.equal(got, torch.nn.functional.linear(x, patched_w.float(), layer.bias))
    with torch.inference_mode():
        patched.unpatch_model(device_to=torch.device("cpu"))
    layer = _kept(patched)[name]
    assert layer.weight.dtype == torch.bfloat16 and torch.equal(layer.weight, file_w)
    with torch.inference_mode():
        again = layer(x)
    assert layer.weight.dtype == torch.float32
    assert torch.equal(again, torch.nn.functional.linear(x, file_w.float(), layer.bias))
