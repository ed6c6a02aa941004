"""NVFP4 files in ComfyUI's own form (its "nvfp4" per-layer layout on comfy-kitchen: 0.29 and newer, which
CI runs as its second and third legs) against that ComfyUI and the comfy-kitchen it pins.

- Every layer of a file written by the tree's own NVFP4 quantizer and mixed-precision Linear (shapes whose
  data and tiled scales are padded included) loads through the pack's reader and dequantizes to the bits of
  comfy-kitchen's eager `dequantize_nvfp4` (the only backend on a CPU) and of the tree's own
  QuantizedTensor, in bf16, fp16 and fp32. The pack's quantizer writes the same bytes as comfy-kitchen's.
- On the real server: the tiny SD3 with every linear but the embedders in NVFP4 samples through Load FP8 Diffusion Model
  close to the full-precision model (> 10 dB after 2 euler steps: 4-bit weights) and close to stock
  UNETLoader on the same file (> 30 dB: the same weights, only the compute differs); Save FP8 Model writes
  the file back tensor for tensor and bit for bit, and stock UNETLoader samples the same latent from
  the saved file as from the original.
Skips, saying so, where the ComfyUI in use has no NVFP4 (0.3.75).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import comfy029, fp8_files
from helpers.graphs import TINY_UNET, fp8_loader, saved_latent, sd3_txt2img
from helpers.host import comfy_in_process
from helpers.numerics import sqnr

pytestmark = pytest.mark.integration

NAME = "nvfp4_tiny_sd3.safetensors"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(scope="module")
def stock():
    """(comfy.quant_ops, comfy.ops, comfy_kitchen) of the tree in use, or a skip where it has no NVFP4."""
    comfy_in_process()
    import comfy.ops
    import comfy.quant_ops as qo

    if "nvfp4" not in getattr(qo, "QUANT_ALGOS", {}) or not getattr(qo, "_CK_AVAILABLE", False):
        pytest.skip("needs a ComfyUI with NVFP4 (its comfy-kitchen layouts: 0.29 and newer); the tree in use has none")
    import comfy_kitchen

    return qo, comfy.ops, comfy_kitchen


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def test_every_layer_dequantizes_like_comfy_kitchen(stock, tmp_path):
    from fp8_engram.quant import NVFP4, QuantizedTensor
    from fp8_engram.quant.layouts import nvfp4
    from fp8_engram.quant.formats import load_file as pack_load

    qo, ops, ck = stock
    g = torch.Generator().manual_seed(0)
    shapes = {"a.weight": (64, 128), "b.weight": (50, 70), "c.weight": (130, 48), "d.weight": (200, 1000),
              "e.weight": (17, 16)}
    sd = {k: (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}
    sd["a.weight"][3, :40] *= 300  # block scales far apart within one layer
    written, theirs = comfy029.stock_write(qo, ops, sd, "nvfp4")
    path = tmp_path / "nv.safetensors"
    save_file({k: v.contiguous() for k, v in written.items()}, str(path))
    loaded, report = pack_load(path)
    assert report.granularities == {"nvfp4": len(shapes)}
    for key, shape in shapes.items():
        layer = key[: -len(".weight")]
        qt = nvfp4.at_shape(loaded[key], shape)
        assert tuple(qt.shape) == shape
        for dt in DTYPES:
            ref = ck.dequantize_nvfp4(written[key], written[layer + ".weight_scale_2"],
                                      written[layer + ".weight_scale"], dt)[: shape[0], : shape[1]]
            ours = qt.dequantize(dt)
            assert torch.equal(_bits(ours), _bits(ref)), f"{key} {dt}: differs from comfy-kitchen's dequantization"
        tq = theirs[key]
        assert torch.equal(_bits(qt.dequantize(torch.bfloat16)), _bits(tq.dequantize()[: shape[0], : shape[1]]))
        # the pack's quantizer writes comfy-kitchen's bytes for the same tensor scale (the pack takes
        # amax / (448 * 6) in float32; stock ComfyUI divides in the weight's dtype first)
        w32 = sd[key].float()
        mine = nvfp4.file_tensors(QuantizedTensor.from_float(w32, NVFP4.for_shape(shape)))
        assert float(mine["weight_scale_2"]) == float(w32.abs().amax() / (448 * 6))
        q, bs = ck.quantize_nvfp4(w32, mine["weight_scale_2"], pad_16x=nvfp4.padded_weight_shape(shape) != shape)
        assert torch.equal(mine["weight"], q), f"{key}: other e2m1 bytes than comfy-kitchen's quantizer"
        assert torch.equal(mine["weight_scale"].view(torch.uint8), bs.view(torch.uint8))


@pytest.fixture(scope="module")
def nvfp4_file(stock, models_dir):
    qo, ops, _ = stock
    sd = load_file(str(models_dir / "diffusion_models" / TINY_UNET))
    # The embedders stay in bf16, as in the NVFP4 files Comfy-Org publishes: stock ComfyUI reads the model's
    # sizes (pooled and context widths) from their weights' shapes, and NVFP4 stores half the columns.
    written, _ = comfy029.stock_write(qo, ops, sd, "nvfp4",
                                      quantize=lambda k, w: fp8_files.default_quantize(k, w) and "embedder" not in k)
    save_file({k: v.contiguous() for k, v in written.items()}, str(models_dir / "diffusion_models" / NAME))
    return NAME


def _latent(comfy, output_dir, loader: dict, prefix: str) -> tuple[torch.Tensor, dict]:
    hist = comfy.run(sd3_txt2img(model=loader, save="latent", seed=5, prefix=prefix))
    return saved_latent(hist, output_dir), hist


def _stock_loader(name: str) -> dict:
    return {"class_type": "UNETLoader", "inputs": {"unet_name": name, "weight_dtype": "default"}}


def test_nvfp4_file_samples_through_the_pack(comfy, output_dir, nvfp4_file):
    ours, hist = _latent(comfy, output_dir, fp8_loader(nvfp4_file), "nv_pack")
    full, _ = _latent(comfy, output_dir, _stock_loader(TINY_UNET), "nv_full")
    theirs, _ = _latent(comfy, output_dir, _stock_loader(nvfp4_file), "nv_stock")
    q_full, q_stock = sqnr(full, ours), sqnr(theirs, ours)
    print(f"NVFP4 through the pack: {q_full:.1f} dB vs full precision, {q_stock:.1f} dB vs stock UNETLoader "
          f"on the same file (stock vs full precision {sqnr(full, theirs):.1f} dB)")
    summary = hist["outputs"]["1"]["fp8_summary"][0]
    assert summary["layers_quantized"] >= 18 and "nvfp4" in str(summary)
    assert q_full > 10.0
    assert q_stock > 30.0


def test_saved_nvfp4_model_is_the_same_file_and_loads_in_stock(comfy, output_dir, models_dir, nvfp4_file):
    src = models_dir / "diffusion_models" / nvfp4_file
    prefix = "nvfp4save/m"
    hist = comfy.run({
        # weight-only: under "auto" a CPU with VNNI/AMX converts the weights to int8 at load, and Save then
        # writes those (int8_tensorwise), not the file's own layers
        "1": fp8_loader(nvfp4_file, "weight-only"),
        "2": {"class_type": "FP8Engram.SaveFP8Model", "inputs": {"model": ["1", 0], "filename_prefix": prefix}},
    })
    assert "nvfp4" in hist["outputs"]["2"]["text"][0]
    files = sorted(output_dir.glob(prefix + "_*.safetensors"))
    assert len(files) == 1, files
    original, written = load_file(str(src)), load_file(str(files[0]))
    assert set(written) == set(original), sorted(set(written) ^ set(original))
    for key, t in original.items():
        w = written[key]
        assert w.dtype == t.dtype and w.shape == t.shape, (key, w.dtype, t.dtype, w.shape, t.shape)
        assert torch.equal(w.view(torch.uint8) if w.element_size() == 1 else w,
                           t.view(torch.uint8) if t.element_size() == 1 else t), f"{key} differs after load and save"
    copy = models_dir / "diffusion_models" / "nvfp4_saved_by_pack.safetensors"
    copy.write_bytes(files[0].read_bytes())
    a, _ = _latent(comfy, output_dir, _stock_loader(nvfp4_file), "nv_stock_orig")
    b, _ = _latent(comfy, output_dir, _stock_loader(copy.name), "nv_stock_saved")
    assert torch.equal(a, b), f"stock ComfyUI samples differently from the saved file: {sqnr(a, b):.1f} dB"
