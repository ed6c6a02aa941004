"""MXFP8 (ComfyUI 0.29's "mxfp8"): e4m3fn data, one UE8M0 scale per 1 x 32 block, scales stored in
cuBLAS's 128 x 4 tiled order.

The file builder here writes the tiled order with plain loops from its definition (independent of
quant/layouts/mxfp8.py's reshapes), so a wrong permutation cannot pass. Thresholds: MXFP8 dequantization of
gaussian weights >= 28 dB vs float64 (power-of-two scales waste up to one binade: measured ~31 dB),
weight-only linear >= 28 dB.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from fp8_engram.quant import PerTensor, QuantizedTensor, formats
from fp8_engram.quant.layouts.mxfp8 import MXFP8, e8m0_to_float32, float32_to_e8m0, scales_from_file, swizzle, unswizzle

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
    from fp8_engram.quant.layouts.mxfp8 import scales_for_file

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


# ---- odd sizes: 0.29 pads to multiples of 32; the model's Linear gives the true size -------------------

def padded_file_form(w: torch.Tensor):
    """Reference for 0.29's padded on-disk form, from its definition: zero-pad to multiples of 32, take
    the smallest power-of-two scale per 1 x 32 block (code 0 for an all-zero block), tile with loops."""
    out, inp = w.shape
    pr, pc = -(-out // 32) * 32, -(-inp // 32) * 32
    x = torch.zeros(pr, pc, dtype=torch.float32)
    x[:out, :inp] = w.float()
    amax = x.reshape(pr, pc // 32, 32).abs().amax(-1)
    exp = torch.ceil(torch.log2((amax / 448).clamp_min(2.0 ** -127))).clamp(-127, 127)
    codes = torch.where(amax > 0, exp + 127, torch.zeros_like(exp)).to(torch.uint8)
    s = torch.where(amax > 0, torch.exp2(exp), torch.ones_like(exp))
    q = (x.reshape(pr, pc // 32, 32) / s[..., None]).clamp(-448, 448).reshape(pr, pc).to(torch.float8_e4m3fn)
    return q, tiled_by_loops(codes)


@pytest.mark.parametrize("shape", [(50, 70), (33, 64), (64, 45), (1, 1), (130, 200)])
def test_odd_sized_layer_is_cut_to_the_model_size_without_changing_a_value(tmp_path, shape):
    from fp8_engram.quant.layouts.mxfp8 import at_shape, padded_weight_shape

    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    w = torch.randn(*shape, generator=g) * 0.05
    q, tiled = padded_file_form(w)
    cq = torch.tensor(list(json.dumps({"format": "mxfp8"}).encode()), dtype=torch.uint8)
    path = tmp_path / "odd.safetensors"
    save_file({"l.weight": q, "l.weight_scale": tiled, "l.comfy_quant": cq}, str(path))
    loaded, _ = formats.load_file(str(path))
    padded = loaded["l.weight"]
    assert padded.shape == padded_weight_shape(shape) == tuple(q.shape)  # the file alone cannot tell
    cut = at_shape(padded, shape)
    assert cut.shape == shape and cut.layout == MXFP8() and cut.scale.shape == (shape[0], -(-shape[1] // 32))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(cut.dequantize(dtype), padded.dequantize(dtype)[: shape[0], : shape[1]])
    assert sqnr(w, cut.dequantize(torch.float32)) >= 28.0
    # not the padded form of the asked size, or not MXFP8: left alone for the caller to report
    assert at_shape(padded, (shape[0] + 40, shape[1])) is padded
    assert at_shape(cut, shape) is cut
    per_tensor = QuantizedTensor.from_float(w, PerTensor())
    assert at_shape(per_tensor, (1, 1)) is per_tensor


# ---- saving: 0.29's mxfp8 per-layer form, the exact inverse of the reader ------------------------------

@pytest.mark.parametrize("shape", [(64, 128), (50, 70), (130, 200)])
def test_saved_mxfp8_layers_are_in_029_form_and_load_back_bit_exactly(tmp_path, shape):
    from safetensors import safe_open

    from fp8_engram.quant import save
    from fp8_engram.quant.layouts.mxfp8 import at_shape, padded_weight_shape

    g = torch.Generator().manual_seed(sum(shape))
    w = (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)
    w[0, :] = 0  # an all-zero row: its blocks keep their scale through the file
    qt = QuantizedTensor.from_float(w, MXFP8())
    sd = {"l.weight": qt, "l.bias": torch.randn(shape[0], generator=g).to(torch.bfloat16),
          "t.weight": QuantizedTensor.from_float(torch.randn(64, 32, generator=g), PerTensor())}
    path = tmp_path / "saved.safetensors"
    res = save.save_state_dict(sd, path)
    assert res.granularities == {"mxfp8": 1, "tensor": 1} and not res.stock_comfy_readable
    assert any("mxfp8" in n and "per tensor" in n for n in res.notes)
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        disk_q = f.get_tensor("l.weight")
        disk_s = f.get_tensor("l.weight_scale")
        assert json.loads(bytes(f.get_tensor("l.comfy_quant").tolist())) == {"format": "mxfp8"}
        assert json.loads(bytes(f.get_tensor("t.comfy_quant").tolist())) == {"format": "float8_e4m3fn"}
    assert "l.input_scale" not in keys
    # the bytes 0.29's quantizer gives for the same weight (by its definition above), padding included;
    # only all-zero blocks differ: 0.29 writes code 0 there, the pack keeps its scale 1 (code 127), and
    # zero times either is zero
    ref_q, ref_tiled = padded_file_form(w)
    assert disk_q.dtype == torch.float8_e4m3fn and tuple(disk_q.shape) == padded_weight_shape(shape)
    assert torch.equal(disk_q.view(torch.uint8), ref_q.view(torch.uint8))
    ours_tiled = disk_s.view(torch.uint8)
    assert ours_tiled.shape == ref_tiled.shape
    differ = ours_tiled != ref_tiled
    assert bool((ref_tiled[differ] == 0).all()) and bool((ours_tiled[differ] == 127).all())
    assert int(differ.sum()) == -(-shape[1] // 32)  # the zero row's blocks, nothing else
    # and back into the pack: the same bytes and scales, and the same bits dequantized
    loaded, report = formats.load_file(str(path))
    assert report.granularities == {"mxfp8": 1, "tensor": 1}
    back = at_shape(loaded["l.weight"], shape)
    assert back.shape == shape
    assert torch.equal(back.qdata.view(torch.uint8), qt.qdata.view(torch.uint8)) and torch.equal(back.scale, qt.scale)
    assert torch.equal(back.dequantize(torch.bfloat16), qt.dequantize(torch.bfloat16))
    assert torch.equal(loaded["t.weight"].qdata.view(torch.uint8), sd["t.weight"].qdata.view(torch.uint8))
    assert torch.equal(loaded["l.bias"], sd["l.bias"])
