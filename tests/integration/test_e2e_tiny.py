"""bench/e2e.py --tiny: the end-to-end GPU measurement's own code, run on the CPU (ComfyUI in-process).

The script runs as the GPU check runs it (a subprocess of the ComfyUI tree's python, COMFYUI_PATH set), with
tiny shapes; its last line is checked. The Flux-sized models it builds on a GPU are too big for the CPU, so
their geometry is checked here on the meta device against ComfyUI's own model detection. The offloading it
measures on a GPU (ComfyUI's partial load) is exercised here on the CPU: the bookkeeping, FP8 kept, same output.

Thresholds: latent SQNR of the FP8 variants vs the bf16 run >= 20 dB (the issue's bar), image >= 20 dB."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.host import comfy_in_process

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "e2e.py"
VARIANTS = ("stock_bf16", "stock_fp8_cast", "stock_fp8_fast", "stock_fp8_mixed", "pack_auto", "pack_weight_only",
            "pack_memory_first", "pack_weight_only_copies")  # the last on the CPU only


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from comfyhost import comfyui_python, comfyui_root

    try:
        tree, python = comfyui_root(), comfyui_python()
    except FileNotFoundError as exc:
        from helpers.host import missing_tree

        missing_tree(f"needs a ComfyUI tree and its environment: {exc}")
    env = dict(os.environ, COMFYUI_PATH=str(tree), PYTHONUNBUFFERED="1")
    work = tmp_path_factory.mktemp("e2e_tiny")
    # three loads a variant, not --tiny's eleven: the figures are not asserted, the rounds' code runs all the same
    proc = subprocess.run([str(python), str(SCRIPT), "--tiny", "--load-repeats", "3", "--keep-dir", str(work)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=str(ROOT))
    assert proc.returncode == 0, f"bench/e2e.py --tiny failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    lines = [l for l in proc.stdout.splitlines() if l.strip()]
    return json.loads(lines[-1]), proc.stdout


def test_tiny_run_measures_every_variant_through_comfyui(tiny_run):
    result, table = tiny_run
    assert result["bench"] == "e2e" and result["mode"] == "tiny" and result["device"] == "cpu"
    rows = {r["variant"]: r for r in result["variants"]}
    assert tuple(rows) == VARIANTS
    for name, row in rows.items():
        assert row["finite"], f"{name}: the sampled latent holds inf/nan"
        assert row["first_step_s"] > row["load_s"] > 0, name  # the first step comes after the load
        assert row["step_s"] > 0 and row["steps_timed"] == result["shape"]["steps"] - 1, name
        assert len(row["loads_s"]) == 3, name  # --load-repeats 3: two in the interleaved rounds, then the sampled one
        assert row["peak_alloc_gib"] is None, f"{name}: no VRAM on the CPU, yet a figure was reported"
    assert rows["stock_bf16"]["sqnr_db"] == "inf"  # the baseline against itself
    for name in ("stock_fp8_cast", "stock_fp8_mixed", "pack_auto", "pack_weight_only", "pack_memory_first"):
        assert rows[name]["sqnr_db"] >= 20.0, f"{name}: latent {rows[name]['sqnr_db']} dB vs bf16"
    # the kept copies are the bits each call would dequantize: the same latent as weight-only
    assert rows["pack_weight_only_copies"]["sqnr_db"] == rows["pack_weight_only"]["sqnr_db"]
    # FP8 weights stay FP8 in memory (the tiny model's bf16 embedders and norms keep it above half of bf16).
    for name in ("stock_fp8_mixed", "pack_auto", "pack_weight_only", "pack_memory_first"):
        assert rows[name]["model_bytes"] < 0.8 * rows["stock_bf16"]["model_bytes"], name
    assert result["vae"]["image_sqnr_pack_auto_vs_bf16_db"] >= 20.0
    assert result["ratios"]["fastest_stock_fp8"] in ("stock_fp8_cast", "stock_fp8_fast", "stock_fp8_mixed")
    # One size by default for the tiny SD3 run: its "sizes" entry holds the same rows and the per-size ratios.
    (size,) = result["sizes"]
    assert size["image"] == 32 and size["tokens"] == 20 and size["variants"] == result["variants"]
    assert size["ratios"]["pack_auto_later_step_over_stock_bf16"] > 0
    assert size["ratios"]["pack_auto_first_step_over_pack_weight_only"] > 0
    # The paired later steps: each of the three models sampled once a round (3 rounds by default), each round's
    # ratio to stock_bf16 taken within the round.
    paired = size["paired"]
    assert paired["rounds"] == 3 and set(paired["step_s"]) == {"stock_bf16", "pack_weight_only", "pack_auto"}
    assert all(len(v) == 3 and all(t > 0 for t in v) for v in paired["step_s"].values()), paired
    for name in ("pack_weight_only", "pack_auto"):
        within = [a / b for a, b in zip(paired["step_s"][name], paired["step_s"]["stock_bf16"])]
        assert min(within) <= paired["ratios"][f"{name}_later_step_over_stock_bf16"] <= max(within), paired
    assert "paired later steps (3 rounds" in table
    assert "pack_auto" in table and "stock_bf16" in table  # the readable table precedes the JSON line


def test_tiny_run_says_what_the_cpu_skips(tiny_run):
    result, table = tiny_run
    assert "offload" not in result and "unload" not in result and "targets" not in result
    assert any("offloading" in s for s in result["skipped"]) and any("VRAM" in s for s in result["skipped"])
    assert "skipped on the CPU: offloading" in table


def test_tiny_run_uses_engram_nodes_in_the_workflow(tiny_run):
    result, _ = tiny_run
    e = result["engram"]
    assert e["ranks"] == 2 and e["ranks_how"].startswith("devices=cpu")
    assert e["conditioning_moved"], "the memorized phrase did not change the prompt's conditioning"
    assert e["sampled"] and e["plain_ms"] > 0 and e["engram_ms"] > 0
    assert e["latent_sqnr_engram_vs_plain_db"] != "inf", "the engram conditioning did not reach the sampler"
    # The node offers fewer ranks than asked for (on the CPU: 2 of 3), so a library-made memory is measured too.
    lib = e["library_ranks"]
    assert lib["ranks"] == 3 and lib["conditioning_moved"] and lib["engram_ms"] > 0


@pytest.fixture(scope="module")
def e2e_module():
    comfy_in_process()
    spec = importlib.util.spec_from_file_location("bench_e2e", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_e2e"] = module
    spec.loader.exec_module(module)
    return module


def test_the_gpu_flux_model_is_detected_as_flux_dev(e2e_module):
    import comfy.model_detection
    import comfy.supported_models

    shape = e2e_module.Shape(arch="flux", double=5, single=10, image=1024, text_tokens=512, steps=8, vec_dim=768,
                             engram_repeats=1)
    sd = e2e_module.flux_module(shape).state_dict()
    config = comfy.model_detection.model_config_from_unet(sd, "")
    assert type(config) is comfy.supported_models.Flux, type(config)
    unet = config.unet_config
    assert (unet["hidden_size"], unet["num_heads"], unet["depth"], unet["depth_single_blocks"]) == (3072, 24, 5, 10)
    assert unet["guidance_embed"] and unet["context_in_dim"] == 4096 and unet["vec_in_dim"] == 768
    assert shape.image_tokens == 4096  # 1024x1024 -> 128x128 latent -> 64x64 patches


def test_the_gpu_text_encoders_are_detected_as_clip_l_and_t5_xxl(e2e_module):
    import comfy.sd

    assert comfy.sd.detect_te_model(e2e_module.t5xxl_module().state_dict()) == comfy.sd.TEModel.T5_XXL
    assert comfy.sd.detect_te_model(e2e_module.clip_l_module().state_dict()) == comfy.sd.TEModel.CLIP_L


def test_partial_loading_keeps_fp8_weights_and_the_result(e2e_module, tmp_path):
    """What bench/e2e.py's offload part does on a GPU, done with ComfyUI's own partial load on the CPU: the
    modules ComfyUI cannot fit are switched to per-call casting (lowvram), their weights stay FP8, and the
    model's output is bit-identical to the full load's; unloading leaves every FP8 byte in place."""
    import types

    import torch

    import comfy.model_management
    import comfy.sd
    from fp8_engram.nodes.ops import make_fp8_ops
    from fp8_engram.quant import ComputeConfig, QuantizedTensor, formats, save

    shape = e2e_module.Shape(arch="sd3", double=2, single=0, image=32, text_tokens=16, steps=1, vec_dim=2048,
                             engram_repeats=1)
    sd = e2e_module.sd3_state_dict(types.SimpleNamespace(torch=torch), shape, torch.device("cpu"))
    path = tmp_path / "tiny_fp8.safetensors"
    save.save_state_dict(e2e_module.quantize_for_file(sd), path)
    cfg = ComputeConfig()
    qsd, _ = formats.load_file(str(path), config=cfg)
    patcher = comfy.sd.load_diffusion_model_state_dict(qsd, model_options={"custom_operations": make_fp8_ops(cfg)})
    dm = patcher.model.diffusion_model

    def fp8_bytes():
        return {n: m.weight.qdata.view(torch.uint8).clone() for n, m in dm.named_modules()
                if isinstance(getattr(m, "weight", None), QuantizedTensor)}

    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 4, 4, generator=g)
    ctx, y = torch.randn(1, 16, 4096, generator=g), torch.randn(1, 2048, generator=g)
    t = torch.tensor([0.5])
    before = fp8_bytes()
    assert len(before) >= 10
    cpu = torch.device("cpu")
    with torch.inference_mode():
        patcher.load(cpu, lowvram_model_memory=0, full_load=True)
        full = patcher.model.apply_model(x, t, c_crossattn=ctx, y=y)
        patcher.unpatch_model(cpu)
        # the model as it is now: its kept bf16 layers were widened to float32 by the full load's call (on the CPU;
        # ComfyUI cached the size it had before; the loader nodes count it in: nodes/ops.py count_widened_size)
        size = comfy.model_management.module_size(patcher.model)
        patcher.load(cpu, lowvram_model_memory=int(size * 0.6))  # what load_models_gpu does when VRAM is short
        assert patcher.model.model_lowvram, "ComfyUI loaded the whole model: the budget did not bite"
        assert 0 < patcher.loaded_size() < size
        cast = [n for n, m in dm.named_modules() if isinstance(getattr(m, "weight", None), QuantizedTensor)
                and getattr(m, "comfy_cast_weights", False) and hasattr(m, "prev_comfy_cast_weights")]
        assert cast, "no FP8 layer was left to per-call casting"
        partial = patcher.model.apply_model(x, t, c_crossattn=ctx, y=y)
        patcher.unpatch_model(cpu)
    assert torch.equal(partial, full), "the partially loaded model computes something else"
    after = fp8_bytes()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
