"""Layers that "auto" makes int8 in place, on the loaders, in process with ComfyUI's own ModelPatcher (no server).

compute_path "auto (memory first)" is "auto" with ``ComputeConfig.fp8_form="drop"``: a layer whose call ran int8
becomes its int8 form in place and its FP8 data is freed (quant/compute/paths/int8.py ``drop_fp8_form``); plain
"auto" ("serving") does the same for a layer that had run no weight-only call before, "auto (keep both forms)"
("keep") never does. What is shown here:

- the loader's choice reaches the config of every weight, and the loader's summary says which it is;
- a LoRA patched onto such a model (before or after its layers dropped their FP8 form, replacing or in place),
  run, unpatched and run again gives the right numbers: every layer's output against float64 (the file's
  FP8 weights dequantized, plus the LoRA's delta while patched) and against the same model loaded without
  memory first; unpatching brings back the unpatched weights;
- Save FP8 Model writes a memory-first model in the FP8 form it was loaded in (per-tensor e4m3fn here, read by
  stock ComfyUI), not in the int8 form its layers happened to run in, LoRA included.

Every layer runs int8 here whatever the CPU: the device's INT8 capability is set for these tests and the loads
trust fast paths by capability (no timing decides which path runs).

Floors (dB), measured on the tiny SD3 model (3 tokens per layer, worst layer): an int8 layer's output against
float64 of the FP8 weights 37.9 (floor 30), a patched layer's 30.9 (floor 25); memory first against
both forms kept, same inputs, 30.6 on patched layers (floor 25), and after unpatching they are equal here
(floor 30); an unpatched weight against the file's FP8 values 41.2 (floor 35; the LoRA moves a patched one
to 7-14 dB); a weight written back to FP8 from its int8 values against the file's FP8 values 44.6 (floor 35),
a patched one against the float64 patched weight 30.9 (floor 25).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from helpers import fp8_files
from helpers.host import comfy_in_process
from helpers.lora import LORA_LAYERS, lora_delta, make_lora
from helpers.numerics import sqnr

pytestmark = pytest.mark.integration

FILE = "memory_first_fp8.safetensors"


@pytest.fixture(scope="module")
def env(tiny_models_cache, tmp_path_factory):
    comfy_in_process()
    import comfy.lora  # noqa: F401  (the LoRA key mapping load_lora_for_models uses)
    import comfy.model_management
    import comfy.sd
    import folder_paths

    path = fp8_files.tiny_sd3_per_tensor_folder(tiny_models_cache, tmp_path_factory.mktemp("memory_first_models"), FILE)
    user, out = folder_paths.get_user_directory(), folder_paths.get_output_directory()
    folder_paths.set_user_directory(str(tmp_path_factory.mktemp("memory_first_user")))
    folder_paths.set_output_directory(str(tmp_path_factory.mktemp("memory_first_output")))
    from fp8_engram.nodes import fp8 as nodes

    yield nodes, comfy.sd, comfy.model_management, path
    comfy.model_management.unload_all_models()
    folder_paths.set_user_directory(user)
    folder_paths.set_output_directory(out)


@pytest.fixture(autouse=True)
def fast_int8_cpu(monkeypatch):
    from fp8_engram.quant.compute import int8 as qint8

    monkeypatch.setattr(qint8, "int8_fast", lambda device: torch.device(device).type == "cpu")
    monkeypatch.setattr(qint8, "int8_supported", lambda device: torch.device(device).type == "cpu")


def _load(env, compute_path: str, fast_paths: str = "trust without proving"):
    nodes = env[0]
    out = nodes.LoadFP8DiffusionModel.execute(FILE, compute_path, "auto", "auto", "nearest", fast_paths)
    return out.result[0], out.ui["fp8_summary"][0]


def _linears(model) -> dict:
    """name -> the model's Linear modules whose weight is quantized."""
    from fp8_engram.quant import QuantizedTensor

    return {n: m for n, m in model.model.diffusion_model.named_modules()
            if isinstance(m, torch.nn.Linear) and isinstance(m.weight, QuantizedTensor)}


def _inputs(model) -> dict:
    g = torch.Generator().manual_seed(3)
    return {n: torch.randn(3, m.in_features, generator=g) for n, m in sorted(_linears(model).items())}


def _run(model, xs: dict) -> dict:
    """Every quantized layer's output through its own forward (the pack's linear), as ComfyUI runs them."""
    layers = _linears(model)
    with torch.inference_mode():
        return {n: layers[n](x).double() for n, x in xs.items()}


def _reference(weights: dict, model, xs: dict) -> dict:
    """float64 outputs of `weights` (name -> float64 weight) with the model's biases."""
    layers = _linears(model)
    out = {}
    for n, x in xs.items():
        b = layers[n].bias
        out[n] = x.double() @ weights[n].t() + (0 if b is None else b.detach().double())
    return out


def _fp8_weights(model) -> dict:
    return {n: m.weight.dequantize(torch.float64) for n, m in _linears(model).items()}


def _all_int8(model) -> bool:
    from fp8_engram.quant.compute.int8 import is_int8

    return all(is_int8(m.weight) for m in _linears(model).values())


def test_the_memory_first_choice_reaches_every_weight_and_the_summary(env):
    nodes = env[0]
    assert list(nodes.COMPUTE_PATHS)[:5] == ["auto", "fp8 matmul", "weight-only", "int8", "int8 without rotation"]
    combo = nodes._options()[0]
    assert combo.id == "compute_path" and combo.default == "auto"
    assert combo.options[-2:] == ["auto (memory first)", "auto (keep both forms)"]  # added last: saved choices stay
    for choice, form, label in (("auto (memory first)", "drop", "drop their FP8 form"),
                                ("auto (keep both forms)", "keep", "keep their FP8 form beside"),
                                ("auto", "serving", "keep their FP8 form only where it already ran weight-only")):
        model, summary = _load(env, choice, "proven on this device")
        weights = [m.weight for m in _linears(model).values()]
        assert len(weights) == 24
        assert all(w.config.path == "auto" and w.config.fp8_form == form for w in weights), choice
        assert all(w.qdata.dtype == torch.float8_e4m3fn for w in weights)  # nothing converted at load
        assert summary["compute_path"].startswith(f"{choice}: int8") and label in summary["compute_path"], summary


def test_auto_frees_the_fp8_form_of_layers_that_only_ran_int8(env):
    """Plain "auto": every call of this model runs int8 (trusted here), so no FP8 form serves a call."""
    from fp8_engram.quant.compute.paths.int8 import dropped_fp8_form

    model, _ = _load(env, "auto")
    fp8 = _fp8_weights(model)
    xs = _inputs(model)
    ptrs = {n: m.weight.qdata.data_ptr() for n, m in _linears(model).items()}
    got = _run(model, xs)
    assert _all_int8(model)
    # no other tensor reads the loaded codes (the loader's state dict is gone): each converted in its own storage
    assert all(m.weight.qdata.data_ptr() == ptrs[n] for n, m in _linears(model).items())
    ref = _reference(fp8, model, xs)
    for n in xs:
        assert sqnr(ref[n], got[n]) > 30.0, n
        assert dropped_fp8_form(_linears(model)[n].weight).dtype == torch.float8_e4m3fn


def test_memory_first_frees_the_fp8_form_of_the_layers_that_ran_int8(env):
    from fp8_engram.quant.compute.paths.int8 import dropped_fp8_form

    model, _ = _load(env, "auto (memory first)")
    fp8 = _fp8_weights(model)
    xs = _inputs(model)
    got = _run(model, xs)
    assert _all_int8(model)
    ref = _reference(fp8, model, xs)
    for n in xs:
        assert sqnr(ref[n], got[n]) > 30.0, n
        w = _linears(model)[n].weight
        assert dropped_fp8_form(w).dtype == torch.float8_e4m3fn and "_derived" not in w.__dict__
    kept, _ = _load(env, "auto (keep both forms)")
    _run(kept, xs)
    assert all(m.weight.qdata.dtype == torch.float8_e4m3fn for m in _linears(kept).values())


@pytest.mark.parametrize("inplace", [False, True], ids=["replace", "inplace"])
@pytest.mark.parametrize("order", ["run_then_patch", "patch_then_run"])
def test_a_lora_patched_run_unpatched_and_run_again_gives_the_right_numbers(env, order, inplace):
    _, comfy_sd, _, _ = env
    model, _ = _load(env, "auto (memory first)")
    kept, _ = _load(env, "auto (keep both forms)")  # the same file, both forms kept
    fp8 = _fp8_weights(model)
    xs = _inputs(model)
    lora = make_lora(model)
    patched_fp8 = {n: fp8[n] + (lora_delta(lora, n) if n in LORA_LAYERS else 0) for n in fp8}
    if order == "run_then_patch":
        _run(model, xs)
        assert _all_int8(model)
    patched, _ = comfy_sd.load_lora_for_models(model, None, lora, 1.0, 0.0)
    kept_patched, _ = comfy_sd.load_lora_for_models(kept, None, lora, 1.0, 0.0)
    for p in (patched, kept_patched):
        p.weight_inplace_update = inplace
    with torch.inference_mode():
        patched.patch_model(device_to=torch.device("cpu"))
    during = _run(patched, xs)
    assert _all_int8(patched)
    ref = _reference(patched_fp8, patched, xs)
    with torch.inference_mode():
        kept_patched.patch_model(device_to=torch.device("cpu"))
    kept_during = _run(kept_patched, xs)
    with torch.inference_mode():
        kept_patched.unpatch_model(device_to=torch.device("cpu"))
    for n in xs:
        floor = 25.0 if n in LORA_LAYERS else 30.0
        assert sqnr(ref[n], during[n]) > floor, (n, sqnr(ref[n], during[n]))
        assert sqnr(kept_during[n], during[n]) > floor, (n, sqnr(kept_during[n], during[n]))
    for n in LORA_LAYERS:  # the LoRA is large enough to tell a patched weight from an unpatched one
        assert sqnr(fp8[n], patched_fp8[n]) < 20.0

    with torch.inference_mode():
        patched.unpatch_model(device_to=torch.device("cpu"))
    after = _run(model, xs)
    assert _all_int8(model)
    ref = _reference(fp8, model, xs)
    kept_after = _run(kept, xs)
    for n in xs:
        assert sqnr(ref[n], after[n]) > 30.0, (n, sqnr(ref[n], after[n]))
        assert sqnr(kept_after[n], after[n]) > 30.0, n
        w = _linears(model)[n].weight.dequantize(torch.float64)
        assert sqnr(fp8[n], w) > 35.0, n  # the unpatched weight is back (the patched one is < 20 dB off)


def test_save_fp8_model_writes_a_memory_first_model_in_its_loaded_fp8_form(env):
    from fp8_engram.quant import formats

    nodes, comfy_sd, mm, _ = env
    model, _ = _load(env, "auto (memory first)")
    fp8 = _fp8_weights(model)
    _run(model, _inputs(model))
    assert _all_int8(model)
    lora = make_lora(model)
    patched, _ = comfy_sd.load_lora_for_models(model, None, lora, 1.0, 0.0)
    try:
        out = nodes.SaveFP8Model.execute(patched, "memory_first/model")
    finally:
        mm.unload_all_models()
    path, text = out.result[0], out.ui["text"][0]
    assert "24 layer(s) had run int8 under compute_path auto and kept no FP8 data" in text, text
    assert "Stock ComfyUI's Load Diffusion Model reads it unchanged." in text, text
    sd, report = formats.load_file(path)
    weights = {k[: -len(".weight")].removeprefix("diffusion_model."): v for k, v in sd.items() if hasattr(v, "qdata")}
    assert len(weights) == 24
    assert report.granularities == {"tensor": 24}
    for n, w in weights.items():
        assert w.qdata.dtype == torch.float8_e4m3fn, n
        if n in LORA_LAYERS:
            got = sqnr(fp8[n] + lora_delta(lora, n), w.dequantize(torch.float64))
            assert got > 25.0, (n, got)
        else:
            got = sqnr(fp8[n], w.dequantize(torch.float64))
            assert got > 35.0, (n, got)
    stock = comfy_sd.load_diffusion_model(path)  # stock ComfyUI's own loader reads the file
    assert stock is not None
    # the model that was saved still runs its int8 form (nothing was put back in it)
    assert _all_int8(model)


def test_the_save_leaves_weights_that_kept_their_fp8_form_byte_for_byte(env):
    from fp8_engram.quant import formats

    nodes, _, mm, source = env
    model, _ = _load(env, "auto (memory first)", "proven on this device")  # nothing has run: nothing dropped
    try:
        out = nodes.SaveFP8Model.execute(model, "memory_first/unrun")
    finally:
        mm.unload_all_models()
    assert "kept no FP8 data" not in out.ui["text"][0]
    saved, _ = formats.load_file(out.result[0])
    loaded, _ = formats.load_file(str(source))
    for k, w in loaded.items():
        if hasattr(w, "qdata"):
            assert torch.equal(saved[k].qdata.view(torch.uint8), w.qdata.view(torch.uint8)), k
            assert torch.equal(saved[k].scale, w.scale), k

