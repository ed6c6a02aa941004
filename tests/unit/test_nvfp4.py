"""NVFP4 (ComfyUI's "nvfp4", 0.29 and newer): packed e2m1 data, e4m3 scales per 1 x 16 block in the tiled order, a
float32 tensor scale. Pure torch here; agreement with comfy-kitchen itself is
tests/integration/test_nvfp4_comfy.py (it needs such a tree's environment, with comfy-kitchen)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from fp8_engram.quant import NVFP4, QuantizationError, QuantizedTensor, linear
from fp8_engram.quant.layouts import nvfp4
from fp8_engram.quant.formats import FormatError, load_file
from fp8_engram.quant.layouts.mxfp8 import unswizzle
from fp8_engram.quant.save import plan_tensors

pytestmark = pytest.mark.unit

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
SHAPES = [(64, 128), (50, 70), (130, 48), (17, 300)]


def sqnr(ref, x) -> float:
    ref = ref.double()
    return float(20 * torch.log10(ref.norm() / (ref - x.double()).norm()))


def _w(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * 0.02


def test_e2m1_codes_hold_the_grid_and_round_ties_to_even():
    v = torch.tensor(GRID + [-x for x in GRID[1:]])
    codes = nvfp4.encode_e2m1(v)
    assert torch.equal(torch.tensor(nvfp4.E2M1_VALUES)[codes.long()], v)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, -4.0])
    assert torch.equal(torch.tensor(nvfp4.E2M1_VALUES)[nvfp4.encode_e2m1(ties).long()], want)
    assert torch.equal(nvfp4.pack_codes(torch.tensor([[1, 2, 15, 0]])), torch.tensor([[0x12, 0xF0]], dtype=torch.uint8))
    assert torch.equal(nvfp4.unpack_codes(torch.tensor([[0x12, 0xF0]], dtype=torch.uint8)), torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8))


def test_stochastic_rounding_is_unbiased_between_neighbours():
    v = torch.full((200_000,), 2.4)
    g = torch.Generator().manual_seed(0)
    vals = torch.tensor(nvfp4.E2M1_VALUES)[nvfp4.encode_e2m1(v, g).long()]
    assert set(vals.unique().tolist()) == {2.0, 3.0}
    assert abs(float(vals.mean()) - 2.4) < 0.01


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_quantize_keeps_the_logical_shape_and_is_accurate(shape):
    w = _w(shape)
    qt = QuantizedTensor.from_float(w, NVFP4.for_shape(shape))
    assert tuple(qt.shape) == shape and qt.dtype == torch.float32
    assert tuple(qt.qdata.shape) == (nvfp4.padded_weight_shape(shape)[0], nvfp4.padded_weight_shape(shape)[1] // 2)
    d = qt.dequantize(torch.float32)
    assert d.shape == shape
    assert sqnr(w, d) > 17.0  # 4-bit values with fine e4m3 block scales on Gaussian weights (about 20 dB)
    # the rule: e2m1 * (ts * block), rounded in the output dtype
    block, ts = nvfp4.split_scales(qt.scale, qt.layout)
    vals = torch.tensor(nvfp4.E2M1_VALUES)[nvfp4.unpack_codes(qt.qdata).long()]
    ref = (vals.double() * (float(ts) * block.double()).repeat_interleave(16, 1))[: shape[0], : shape[1]]
    assert float((ref - d.double()).abs().max()) <= float(ref.abs().max()) * 2 ** -22


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_file_form_round_trips_and_scales_are_tiled(shape):
    qt = QuantizedTensor.from_float(_w(shape, 1), NVFP4.for_shape(shape))
    ft = nvfp4.file_tensors(qt)
    rows, cols = nvfp4.padded_weight_shape(shape)
    assert ft["weight"].dtype == torch.uint8 and tuple(ft["weight"].shape) == (rows, cols // 2)
    assert ft["weight_scale"].dtype == torch.float8_e4m3fn
    assert tuple(ft["weight_scale"].shape) == (128 * -(-rows // 128), 4 * -(-(cols // 16) // 4))
    assert ft["weight_scale_2"].dtype == torch.float32 and ft["weight_scale_2"].dim() == 0
    block, _ = nvfp4.split_scales(qt.scale, qt.layout)
    assert torch.equal(unswizzle(ft["weight_scale"].view(torch.uint8), rows, cols // 16), block.view(torch.uint8))
    layout, scale = nvfp4.scales_from_file(ft["weight_scale"], ft["weight_scale_2"], ft["weight"].shape)
    back = nvfp4.at_shape(QuantizedTensor.from_parts(ft["weight"], scale, layout, orig_dtype=qt.orig_dtype), shape)
    assert tuple(back.shape) == shape
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        assert torch.equal(back.dequantize(dt), qt.dequantize(dt))


def test_cpu_linear_is_f_linear_on_the_dequantized_weight():
    qt = QuantizedTensor.from_float(_w((50, 70)), NVFP4.for_shape((50, 70)))
    x = torch.randn(2, 3, 70, dtype=torch.bfloat16)
    b = torch.randn(50, dtype=torch.bfloat16)
    y = linear(x, qt, b)
    assert torch.equal(y, F.linear(x, qt.dequantize(torch.bfloat16), b))
    assert torch.equal(F.linear(x, qt, b), y)  # through the tensor's own dispatch
    with pytest.raises(QuantizationError, match="last input dim must be 70"):
        linear(torch.randn(2, 80), qt)


def test_moves_copies_and_requantization_keep_both_scales():
    qt = QuantizedTensor.from_float(_w((40, 48)), NVFP4.for_shape((40, 48)))
    backup = qt.clone()
    qt.requantize_(_w((40, 48), 5) * 30)  # a LoRA-style write with a fresh tensor scale
    assert not torch.equal(qt.dequantize(), backup.dequantize())
    qt.copy_(backup)  # unpatching restores the exact bytes
    assert torch.equal(qt.qdata, backup.qdata) and torch.equal(qt.scale, backup.scale)
    assert torch.equal(qt.t().dequantize(), backup.dequantize().t())


@pytest.mark.parametrize("bad,match", [
    (lambda q, s: (q.view(torch.int8), s), "must be uint8"),
    (lambda q, s: (q[:, :-1], s), "must be uint8 of shape"),
    (lambda q, s: (q, s[:-1]), "scales for a weight"),
    (lambda q, s: (q, torch.cat((s[:-4], torch.tensor([0.0]).view(torch.uint8)))), "tensor scale"),
    (lambda q, s: (q, torch.cat((torch.full((1,), 0x7F, dtype=torch.uint8), s[1:]))), "finite"),
])
def test_bad_parts_are_refused(bad, match):
    qt = QuantizedTensor.from_float(_w((32, 32)), NVFP4.for_shape((32, 32)))
    q, s = bad(qt.qdata.clone(), qt.scale.clone())
    with pytest.raises(QuantizationError, match=match):
        QuantizedTensor.from_parts(q, s, qt.layout)


def _file(tmp_path, extra=None, drop=None):
    sd = {"blocks.0.proj.weight": QuantizedTensor.from_float(_w((50, 70)), NVFP4.for_shape((50, 70))),
          "blocks.0.proj.bias": torch.zeros(50),
          "blocks.0.mlp.weight": QuantizedTensor.from_float(_w((64, 64), 2), NVFP4.for_shape((64, 64)))}
    entries, producers, metadata, info = plan_tensors(sd)
    tensors = {name: producers[name]() for name, _, _ in entries}
    for (name, dtype, shape) in entries:
        assert tensors[name].dtype == dtype and tuple(tensors[name].shape) == tuple(shape), name
    tensors.update(extra or {})
    for k in drop or ():
        tensors.pop(k)
    path = tmp_path / "nv.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path, sd, info


def test_saved_file_is_comfyuis_form_and_loads_back_bit_for_bit(tmp_path):
    path, sd, info = _file(tmp_path)
    assert any("0.29 and newer" in n for n in info["notes"])
    loaded, report = load_file(path, orig_dtype=torch.bfloat16)
    assert report.granularities == {"nvfp4": 2} and report.fp8_dtypes == ["e2m1"]
    w = loaded["blocks.0.proj.weight"]
    assert nvfp4.is_nvfp4(w) and tuple(w.shape) == (64, 80)  # the stored size until the model's Linear cuts it
    w = nvfp4.at_shape(w, (50, 70))
    assert torch.equal(w.dequantize(torch.float32), sd["blocks.0.proj.weight"].dequantize(torch.float32))
    assert torch.equal(loaded["blocks.0.mlp.weight"].dequantize(torch.float32), sd["blocks.0.mlp.weight"].dequantize(torch.float32))
    assert report.bytes_bf16 == 2 * (64 * 80 + 64 * 64 + 50)  # every value as bf16


def test_bad_nvfp4_files_name_the_key(tmp_path):
    path, _, _ = _file(tmp_path, drop=["blocks.0.proj.weight_scale_2"])
    with pytest.raises(FormatError, match="blocks.0.proj.weight_scale_2"):
        load_file(path)
    path, _, _ = _file(tmp_path, extra={"blocks.0.proj.pre_quant_scale": torch.ones(70)})
    with pytest.raises(FormatError, match="pre_quant_scale"):
        load_file(path)
    path, _, _ = _file(tmp_path, extra={"blocks.0.proj.weight_scale": torch.zeros(7, dtype=torch.float8_e4m3fn)})
    with pytest.raises(FormatError, match="bad NVFP4 scales"):
        load_file(path)
    # a file whose comfy_quant is not nvfp4 keeps refusing weight_scale_2 keys
    cq = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8)
    path, _, _ = _file(tmp_path, extra={"blocks.0.proj.comfy_quant": cq})
    with pytest.raises(FormatError):
        load_file(path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 300, 2000])
def test_cuda_weight_only_linear_matches_the_cpu_rule(m):
    """On CUDA the fused GEMM (m <= FUSED_MAX_M) or dequantize + cuBLAS: the same weights as the CPU path."""
    shape = (200, 1000)
    qt = QuantizedTensor.from_float(_w(shape, 3), NVFP4.for_shape(shape)).to("cuda")
    assert torch.equal(qt.dequantize(torch.bfloat16).cpu(), qt.to("cpu").dequantize(torch.bfloat16))
    x = torch.randn(m, shape[1], device="cuda", dtype=torch.bfloat16)
    b = torch.randn(shape[0], device="cuda", dtype=torch.bfloat16)
    y = linear(x, qt, b)
    ref = x.double() @ qt.dequantize(torch.bfloat16).double().t() + b.double()
    assert y.dtype == torch.bfloat16 and sqnr(ref, y) > 40.0


def test_layers_listed_in_quantization_metadata_load_like_comfy_quant_ones(tmp_path):
    """ComfyUI turns `_quantization_metadata` entries into `.comfy_quant` tensors, so files may say nvfp4 there."""
    from safetensors.torch import load_file as st_load

    path, sd, _ = _file(tmp_path)
    tensors = {k: v for k, v in st_load(str(path)).items() if not k.endswith(".comfy_quant")}
    meta = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": {
        "blocks.0.proj": {"format": "nvfp4"}, "blocks.0.mlp": {"format": "nvfp4"}}})}
    other = tmp_path / "meta.safetensors"
    save_file(tensors, str(other), metadata=meta)
    loaded, report = load_file(other)
    assert report.format == "comfy_quant_metadata" and report.granularities == {"nvfp4": 2}
    assert torch.equal(nvfp4.at_shape(loaded["blocks.0.proj.weight"], (50, 70)).dequantize(torch.float32),
                       sd["blocks.0.proj.weight"].dequantize(torch.float32))
