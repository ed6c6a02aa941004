"""MXFP8 (ComfyUI 0.29's "mxfp8"): e4m3fn data, one UE8M0 scale per 1 x 32 block, scales stored in
cuBLAS's 128 x 4 tiled order.

The file builder here writes the tiled order with plain loops from its definition (independent of
quant/mxfp8.py's reshapes), so a wrong permutation cannot pass. Thresholds: MXFP8 dequantization of
gaussian weights >= 28 dB vs float64 (power-of-two scales waste up to one binade: measured ~31 dB),
weight-only linear >= 28 dB.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from fp8_engram.quant import QuantizedTensor, formats
from fp8_engram.quant.mxfp8 import MXFP8, e8m0_to_float32, float32_to_e8m0, scales_from_file, swizzle, unswizzle

pytestmark = pytest.mark.unit


def sqnr(ref, x) -> float:
    ref = ref.double()
    return float(20 * torch.log10(ref.norm() / (ref - x.double()).norm()))


def tiled_by_loops(codes: torch.Tensor) -> torch.Tensor:
    """[rows, blocks] uint8 -> the flat tiled byte order, one element at a time."""
    rows, blocks = codes.shape
    tr, tc = -(-rows // 128), -(-blocks // 4)
    out = []
    for r_tile in range(tr):
        for c_tile in range(tc):
            for j in range(32):
                for i in range(4):
                    for c in range(4):
                        r, b = r_tile * 128 + 32 * i + j, c_tile * 4 + c
                        out.append(int(codes[r, b]) if r < rows and b < blocks else 0)
    return torch.tensor(out, dtype=torch.uint8).reshape(tr * 128, tc * 4)


def mx_weight(rows, cols, seed=0):
    """(fp8 data, uint8 codes [rows, cols/32], float64 values) with codes spread over many binades."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(110, 140, (rows, cols // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    q = (torch.randn(rows, cols, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    values = q.double() * torch.exp2(codes.double() - 127).repeat_interleave(32, 1)
    return q, codes, values


@pytest.mark.parametrize("rows,blocks", [(128, 4), (96, 5), (300, 2), (1, 1)])
def test_tiled_order_round_trips_and_matches_its_definition(rows, blocks):
    g = torch.Generator().manual_seed(rows)
    codes = torch.randint(0, 255, (rows, blocks), generator=g, dtype=torch.int32).to(torch.uint8)
    tiled = tiled_by_loops(codes)
    assert torch.equal(swizzle(codes), tiled)
    assert torch.equal(unswizzle(tiled, rows, blocks), codes)
    assert torch.equal(unswizzle(tiled.flatten(), rows, blocks), codes)


def test_e8m0_codes_are_exact_powers_of_two():
    codes = torch.arange(0, 255, dtype=torch.int32).to(torch.uint8)
    vals = e8m0_to_float32(codes)
    assert torch.equal(vals.double(), torch.exp2(codes.double() - 127))
    assert torch.equal(float32_to_e8m0(vals), codes)
    with pytest.raises(ValueError, match="NaN code 255"):
        e8m0_to_float32(torch.tensor([255], dtype=torch.uint8))
    with pytest.raises(ValueError, match="powers of two"):
        float32_to_e8m0(torch.tensor([0.3]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_file_in_029_form_loads_exactly(tmp_path, dtype):
    q, codes, values = mx_weight(160, 256)
    bias = torch.randn(160, dtype=torch.float64)
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    scale_bytes = tiled_by_loops(codes)
    sd = {
        "blocks.0.fc.weight": q,
        "blocks.0.fc.weight_scale": scale_bytes.view(e8m0) if e8m0 is not None else scale_bytes,
        "blocks.0.fc.comfy_quant": torch.tensor(list(json.dumps({"format": "mxfp8"}).encode()), dtype=torch.uint8),
        "blocks.0.fc.bias": bias.to(dtype),
        "blocks.0.norm.weight": torch.ones(160, dtype=dtype),
    }
    path = tmp_path / "mx.safetensors"
    save_file(sd, str(path))
    loaded, report = formats.load_file(str(path))
    w = loaded["blocks.0.fc.weight"]
    assert isinstance(w, QuantizedTensor) and w.layout == MXFP8() and w.shape == (160, 256)
    assert report.format == formats.COMFY_PER_LAYER and report.granularities == {"mxfp8": 1}
    # one rounding of the exact value, whatever the output dtype
    assert torch.equal(w.dequantize(dtype), values.to(dtype))
    assert "blocks.0.fc.weight_scale" not in loaded and "blocks.0.fc.comfy_quant" not in loaded


def test_bad_mxfp8_scales_name_the_key(tmp_path):
    q, codes, _ = mx_weight(64, 64)
    cq = torch.tensor(list(json.dumps({"format": "mxfp8"}).encode()), dtype=torch.uint8)
    bad = tiled_by_loops(codes)
    bad[0, 0] = 255
    for name, scale in (("nan", bad), ("short", tiled_by_loops(codes)[:64]), ("f32", torch.ones(128, 4))):
        path = tmp_path / f"{name}.safetensors"
        save_file({"l.weight": q, "l.weight_scale": scale, "l.comfy_quant": cq}, str(path))
        with pytest.raises(formats.FormatError, match="l.weight_scale"):
            formats.load_file(str(path))


def test_quantize_dequantize_and_weight_only_linear_sqnr():
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(192, 320, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(4, 7, 320, generator=g).to(torch.bfloat16)
    qt = QuantizedTensor.from_float(w, MXFP8())
    assert qt.qdata.dtype == torch.float8_e4m3fn and qt.scale.shape == (192, 10)
    # every scale a power of two, the smallest one that keeps its block in range
    assert torch.equal(float32_to_e8m0(qt.scale).to(torch.int32), torch.log2(qt.scale).to(torch.int32) + 127)
    amax = w.float().reshape(192, 10, 32).abs().amax(-1)
    assert bool((amax / qt.scale <= 448).all()) and bool((amax / (qt.scale / 2) > 448).all())
    assert sqnr(w, qt.dequantize()) >= 28.0
    ref = F.linear(x.double(), w.double())
    assert sqnr(ref, F.linear(x, qt)) >= 28.0
    # and the tiled file form reproduces the same scales
    from fp8_engram.quant.mxfp8 import scales_for_file

    assert torch.equal(scales_from_file(scales_for_file(qt.scale), qt.qdata.shape), qt.scale)
    with pytest.raises(ValueError, match="e4m3fn"):
        QuantizedTensor.from_float(w, MXFP8(), fp8_dtype=torch.float8_e5m2)


def test_mxfp8_weights_survive_torch_save_and_a_weights_only_load(tmp_path):
    from fp8_engram.quant import MXFP8 as exported

    w = (torch.randn(64, 96, generator=torch.Generator().manual_seed(9)) * 0.02).to(torch.bfloat16)
    qt = QuantizedTensor.from_float(w, exported())
    torch.save({"w": qt}, tmp_path / "w.pt")
    back = torch.load(tmp_path / "w.pt", weights_only=True)["w"]
    assert back.layout == MXFP8() and torch.equal(back.dequantize(), qt.dequantize())


def test_header_metadata_form_loads_like_the_per_layer_form(tmp_path):
    q, codes, values = mx_weight(64, 128, seed=2)
    meta = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": {"fc": {"format": "mxfp8"}}})}
    path = tmp_path / "meta.safetensors"
    save_file({"fc.weight": q, "fc.weight_scale": tiled_by_loops(codes), "fc.bias": torch.zeros(64)}, str(path),
              metadata=meta)
    loaded, report = formats.load_file(str(path))
    assert report.format == formats.COMFY_METADATA and loaded["fc.weight"].layout == MXFP8()
    assert torch.equal(loaded["fc.weight"].dequantize(torch.float32), values.float())
