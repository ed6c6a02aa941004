"""A Qwen-Image int4 bundle, as the ones published for it mix AWQ W4A16 and SVDQuant W4A4 (comfy-kitchen
0.2.40's forms), loaded by Load FP8 Diffusion Model in a real server and sampled.

The file: the tiny Qwen-Image of tests/helpers/tiny_archs.py (`QWEN_IMAGE_INT4`: 2 blocks 128 wide, built by
ComfyUI's own class) with every block's modulation linears (`img_mod.1`, `txt_mod.1`) in AWQ W4A16 (group 64),
its attention and MLP linears in SVDQuant W4A4 (rank 16, tile-packed), everything else bf16; the layers are
made by tests/helpers/int4_files.py, as test_int4_kitchen_formats_server.py makes its own (whose helpers pin
the formats to kitchen's code). The server is one of the module's own, whose detection takes the tiny sizes
(ComfyUI fixes Qwen-Image to 24 heads of 128; tests/helpers/tiny_arch_server.py), with seeded conditioning of
Qwen's 3584-wide text in place of a text encoder.

The comparison: a 64x64 latent, 2 euler steps, sampled through the pack's loader and through stock
UNETLoader on the same weights dequantized to float32 in a plain file, every int4 layer read by comfy-kitchen
0.2.40's own code, not the pack's (tests/helpers/kitchen_int4_reference.py; SVDQuant: its effective weight,
the low-rank branch folded in). Both multiply the same float32 weights in float32 on the CPU, so they may
differ by float32 rounding only (about 1e-7 relative, 140 dB; measured: bit-identical, inf dB); SQNR_BOUND
(80 dB) leaves that room many times over while any misread layer is far below it. That int4 errors are far
from the bound is checked in the same run: the model before int4 (its bf16 weights), sampled the same way, is
below 40 dB from the int4 one (measured 28.9 dB); and int4 layers read wrong fall far below the bound (tried:
the pack's AWQ codes offset by 7 in place of 8 gave 17.5 dB, SVDQuant without its low-rank branch 18.1 dB).

Time: about 50 s on the shared 2-core machine (the server's start, three 2-step samplings, kitchen's reading).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from helpers.graphs import fp8_loader, saved_latent
from helpers.numerics import sqnr

pytestmark = pytest.mark.integration

QUANT = "qwen_image_int4_bundle.safetensors"
REF = "qwen_image_int4_dequantized_f32.safetensors"
SOURCE = "qwen_image_source_bf16.safetensors"
KITCHEN = "0.2.40"
SQNR_BOUND = 80.0  # dB: float32 rounding only (see the module docstring)
INT4_VISIBLE = 40.0  # dB: the int4 model differs from its source by more than this


def bundle_kind(key: str, t: torch.Tensor) -> str | None:
    """The int4 format a published Qwen-Image bundle gives this tensor's layer (None: kept bf16)."""
    if not key.endswith(".weight") or t.dim() != 2 or not key.startswith("transformer_blocks."):
        return None
    if "_mod." in key:
        return "awq_w4a16"
    if (".attn." in key or "_mlp." in key) and t.shape[0] % 128 == 0 and t.shape[1] % 64 == 0:
        return "svdquant_w4a4"
    return None


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory):
    """(client, base directory, {layer: format}): the server, with the three files in its diffusion_models."""
    from helpers import tiny_archs
    from helpers.host import comfy_in_process
    from helpers.int4_files import awq_parts, svdquant_parts
    from helpers.kitchen import kitchen_dir
    from helpers.kitchen_int4_reference import dequantize_with_kitchen
    from helpers.tiny_arch_server import start_tiny_arch_server

    comfy_in_process()
    import comfy.supported_models

    missing = tiny_archs.missing_from(tiny_archs.QWEN_IMAGE_INT4, comfy)
    if missing:
        pytest.skip(missing)
    base = tmp_path_factory.mktemp("qwen_int4_base")
    folder = base / "models" / "diffusion_models"
    folder.mkdir(parents=True)
    sd = tiny_archs.build_state_dict(tiny_archs.QWEN_IMAGE_INT4, comfy)
    save_file(sd, str(folder / SOURCE))
    out, kinds = {}, {}
    for key, v in sd.items():
        kind = bundle_kind(key, v)
        if kind is None:
            out[key] = v
            continue
        layer = key[: -len(".weight")]
        kinds[layer] = kind
        parts = awq_parts(v) if kind == "awq_w4a16" else svdquant_parts(v, 16, seed=len(kinds))
        out.update({f"{layer}.{suffix}": t for suffix, t in parts.items()})
    save_file(out, str(folder / QUANT))
    read = dequantize_with_kitchen(kitchen_dir(KITCHEN), folder / QUANT, folder / REF)
    assert read == {k: sum(1 for v in kinds.values() if v == k) for k in read}, read
    server = start_tiny_arch_server(base, tiny_archs.QWEN_IMAGE_INT4.name)
    yield server.client(), base, kinds
    server.stop()


def qwen_txt2img(model: dict, prefix: str, seed: int = 3, steps: int = 2, size: int = 64) -> dict:
    """Sample a `size` image's latent in `steps` euler steps from seeded 3584-wide conditioning; saves the latent."""
    from helpers.tiny_arch_server import CONDITIONING_NODE

    return {
        "1": model,
        "3": {"class_type": CONDITIONING_NODE, "inputs": {"seed": 1}},
        "4": {"class_type": CONDITIONING_NODE, "inputs": {"seed": 2}},
        "5": {"class_type": "EmptySD3LatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}},
        "6": {"class_type": "KSampler",
              "inputs": {"model": ["1", 0], "positive": ["3", 0], "negative": ["4", 0], "latent_image": ["5", 0],
                         "seed": seed, "steps": steps, "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple",
                         "denoise": 1.0}},
        "10": {"class_type": "SaveLatent", "inputs": {"samples": ["6", 0], "filename_prefix": f"latents/{prefix}"}},
    }


def _stock(name: str) -> dict:
    return {"class_type": "UNETLoader", "inputs": {"unet_name": name, "weight_dtype": "default"}}


def test_qwen_image_int4_bundle_samples_like_its_float32_weights(qwen_server):
    client, base, kinds = qwen_server
    output = base / "output"
    hist = client.run(qwen_txt2img(fp8_loader(QUANT), "qwen_int4_pack"))
    ours = saved_latent(hist, output)
    theirs = saved_latent(client.run(qwen_txt2img(_stock(REF), "qwen_int4_ref")), output)
    source = saved_latent(client.run(qwen_txt2img(_stock(SOURCE), "qwen_source")), output)

    s = hist["outputs"]["1"]["fp8_summary"][0]
    counts = {k: sum(1 for v in kinds.values() if v == k) for k in set(kinds.values())}
    assert counts == {"awq_w4a16": 4, "svdquant_w4a4": 24}, counts  # 2 blocks: 2 modulation, 12 attention + MLP each
    assert s["granularity"] == counts and s["layers_quantized"] == len(kinds), s
    assert any("awq_w4a16" in n for n in s["notes"]) and any("svdquant_w4a4" in n for n in s["notes"]), s["notes"]
    path = s["compute_path"]
    assert path.startswith("auto: weight-only") or (
        "awq_w4a16 layers weight-only" in path and "svdquant_w4a4 layers weight-only" in path), path

    assert ours.shape == theirs.shape == (1, 16, 1, 8, 8) and bool(torch.isfinite(ours).all())
    db, db_int4 = sqnr(theirs, ours), sqnr(source, theirs)
    print(f"\n[qwen int4] pack vs stock on float32 dequantized weights: {db:.1f} dB; "
          f"int4 model vs its bf16 source: {db_int4:.1f} dB")
    assert db_int4 < INT4_VISIBLE, f"the int4 model is as good as its source ({db_int4:.1f} dB): the test cannot tell"
    assert db > SQNR_BOUND, f"the pack's int4 bundle samples {db:.1f} dB from its float32 weights (bound {SQNR_BOUND})"
