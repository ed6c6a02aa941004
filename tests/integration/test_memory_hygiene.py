"""Memory hygiene, in process with ComfyUI's own model management (no server):

- a model loaded by Load FP8 Diffusion Model, or made by Quantize Model to FP8, fills this thread's
  dequantization workspace when it runs weight-only on the CPU; ComfyUI unloading it (free memory,
  `unload_all_models`) releases that workspace;
- quantizing a state dict with `release_source` frees every full-precision weight as soon as it is
  quantized when nothing else holds it (no second full-precision copy lives on to the end), and the
  Quantize Model node's FP8 weights hold no full-precision tensor.

Peak memory of quantizing a 1 GiB model is measured by bench/quantize_memory.py.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from fp8_engram.quant import QuantizedTensor, layouts
from fp8_engram.quant import runtime
from fp8_engram.quant.quantize_model import quantize_state_dict
from helpers import fp8_files
from helpers.host import comfy_in_process

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def comfy_env(tiny_models_cache, tmp_path_factory):
    comfy_in_process()
    import comfy.model_management
    import folder_paths
    from safetensors.torch import load_file

    folder = tmp_path_factory.mktemp("hygiene_models")
    sd = load_file(str(tiny_models_cache / "diffusion_models" / "tiny_sd3.safetensors"))
    fp8_files.write_format(sd, folder / "hygiene_fp8.safetensors", "comfy_quant_metadata")
    (folder / "hygiene_bf16.safetensors").write_bytes((tiny_models_cache / "diffusion_models" / "tiny_sd3.safetensors").read_bytes())
    folder_paths.add_model_folder_path("diffusion_models", str(folder))
    from fp8_engram.nodes import fp8 as fp8_nodes

    return comfy.model_management, fp8_nodes


def run_quantized_linears(model) -> int:
    """Run every FP8 linear of the model once (weight-only on the CPU); returns how many ran."""
    n = 0
    with torch.inference_mode():
        for module in model.model.diffusion_model.modules():
            w = getattr(module, "weight", None)
            if isinstance(w, QuantizedTensor) and w.dim() == 2:
                torch.nn.functional.linear(torch.randn(3, w.shape[1]), w, None)
                n += 1
    return n


def workspace_bytes() -> int:
    bufs = getattr(runtime._workspace, "bufs", None) or {}
    return sum(b.numel() * b.element_size() for b in bufs.values())


def assert_unload_releases_workspace(mm, model) -> None:
    """Running the model's FP8 linears fills this thread's workspace; ComfyUI's unload empties it."""
    mm.load_models_gpu([model])
    runtime.release_workspace()
    assert run_quantized_linears(model) > 0 and workspace_bytes() > 0
    mm.unload_all_models()
    assert workspace_bytes() == 0


def test_unloading_a_loaded_fp8_model_releases_the_workspace(comfy_env):
    mm, nodes = comfy_env
    out = nodes.LoadFP8DiffusionModel.execute("hygiene_fp8.safetensors", "weight-only", "static", "auto")
    assert_unload_releases_workspace(mm, out.result[0])


def test_unloading_a_quantized_model_releases_the_workspace(comfy_env):
    import comfy.sd

    mm, nodes = comfy_env
    import folder_paths

    base = comfy.sd.load_diffusion_model(folder_paths.get_full_path_or_raise("diffusion_models", "hygiene_bf16.safetensors"))
    out = nodes.QuantizeModelToFP8.execute(base, "tensor", "e4m3fn", "*embed*")
    model = out.result[0]
    assert_unload_releases_workspace(mm, model)
    # Loading another model beside it (nothing unloaded) leaves the buffers alone.
    mm.load_models_gpu([model])
    run_quantized_linears(model)
    held = workspace_bytes()
    other = comfy.sd.load_diffusion_model(folder_paths.get_full_path_or_raise("diffusion_models", "hygiene_bf16.safetensors"))
    mm.load_models_gpu([other])
    assert workspace_bytes() == held > 0
    mm.unload_all_models()
    assert workspace_bytes() == 0


def test_quantized_weights_hold_no_full_precision_tensor(comfy_env):
    import comfy.sd
    import folder_paths

    mm, nodes = comfy_env
    base = comfy.sd.load_diffusion_model(folder_paths.get_full_path_or_raise("diffusion_models", "hygiene_bf16.safetensors"))
    out = nodes.QuantizeModelToFP8.execute(base, "tensor", "e4m3fn", "*embed*")
    patches = out.result[0].object_patches
    assert patches
    for key, param in patches.items():
        qt = param.data if isinstance(param, torch.nn.Parameter) else param
        assert isinstance(qt, QuantizedTensor)
        held = [t for t in (qt.qdata, qt.scale, qt.input_scale) if isinstance(t, torch.Tensor)]
        assert qt.qdata.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        assert sum(t.numel() * t.element_size() for t in held) <= qt.numel() + 64, key


def test_release_source_frees_each_weight_once_quantized():
    g = torch.Generator().manual_seed(0)
    keys = [f"blocks.{i}.fc.weight" for i in range(6)]
    sd = {k: torch.randn(256, 256, generator=g).to(torch.bfloat16) for k in keys}
    refs = {k: weakref.ref(v) for k, v in sd.items()}
    alive_during: list[int] = []

    def progress(done, total):
        gc.collect()
        alive_during.append(sum(refs[k]() is not None for k in keys[:done]))

    out, report = quantize_state_dict(sd, keep=(), progress=progress, release_source=True)
    assert sd == {} and len(report.quantized) == 6
    assert alive_during == [0] * 6  # every quantized source weight was already freed
    # Without release_source the caller's dict keeps them all (the contract callers rely on).
    sd2 = {k: torch.randn(8, 8) for k in keys}
    quantize_state_dict(sd2, keep=())
    assert set(sd2) == set(keys)
