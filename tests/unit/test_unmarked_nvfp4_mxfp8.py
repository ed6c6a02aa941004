"""NVFP4 and MXFP8 files in ComfyUI's form but without their ``comfy_quant`` JSON or ``_quantization_metadata``
entry (ComfyUI issue #15511: stock ComfyUI loads them unquantized and crashes in the first linear). Their
tensors say what they are; the pack reads them as NVFP4 / MXFP8, reports that it did, and refuses, saying why,
a layer whose tensors only look half like the form."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file as st_load, save_file

from fp8_engram.quant import MXFP8, NVFP4, QuantizedTensor, linear
from fp8_engram.quant.formats import FormatError, load_file
from fp8_engram.quant.layouts import mxfp8, nvfp4
from fp8_engram.quant.save import save_state_dict

pytestmark = pytest.mark.unit

SHAPES = {"blocks.0.attn.qkv": (384, 256), "blocks.0.mlp.fc1": (50, 70), "blocks.0.mlp.fc2": (256, 128)}


def _model(layout_for) -> dict:
    g = torch.Generator().manual_seed(0)
    sd = {}
    for name, shape in SHAPES.items():
        w = torch.randn(*shape, generator=g) * 0.02
        w[:, 3] *= 20  # an outlier column: block scales that differ
        sd[name + ".weight"] = QuantizedTensor.from_float(w, layout_for(shape))
        sd[name + ".bias"] = torch.randn(shape[0], generator=g).to(torch.bfloat16)
    return sd


def _stripped(tmp_path, sd, extra=None) -> tuple:
    """The pack's own file of `sd`, and a copy without any comfy_quant tensor or header metadata."""
    full = tmp_path / "marked.safetensors"
    save_state_dict(sd, full)
    tensors = {k: v for k, v in st_load(str(full)).items() if not k.endswith(".comfy_quant")}
    tensors.update(extra or {})
    bare = tmp_path / "unmarked.safetensors"
    save_file(tensors, str(bare))  # no metadata at all
    return full, bare


def test_nvfp4_without_metadata_loads_as_nvfp4_with_the_same_weights(tmp_path):
    sd = _model(NVFP4.for_shape)
    ins = {name + ".input_scale": torch.tensor(0.02) for name in SHAPES}  # LTX-2.5's files carry them
    full, bare = _stripped(tmp_path, sd, ins)
    marked, _ = load_file(full)
    loaded, report = load_file(bare)
    assert report.granularities == {"nvfp4": len(SHAPES)}
    assert report.formats == {"nvfp4_without_metadata": len(SHAPES)}
    assert any("recognised as NVFP4 by their tensors" in n and "15511" in n for n in report.notes), report.notes
    assert set(loaded) == set(marked)  # scales, tensor scales and input scales consumed, nothing left as bytes
    x = torch.randn(3, 256)
    for name, shape in SHAPES.items():
        w = nvfp4.at_shape(loaded[name + ".weight"], shape)
        assert nvfp4.is_nvfp4(w) and tuple(w.shape) == shape, name
        want = sd[name + ".weight"].dequantize(torch.float32)
        assert torch.equal(w.dequantize(torch.float32), want), name
        assert torch.equal(w.dequantize(torch.bfloat16), sd[name + ".weight"].dequantize(torch.bfloat16)), name
        if shape[1] == 256:
            assert torch.equal(linear(x, w), linear(x, sd[name + ".weight"])), name
    assert report.summary()["format"] == "nvfp4_without_metadata"


def test_mxfp8_without_metadata_loads_as_mxfp8_with_the_same_weights(tmp_path):
    sd = _model(lambda shape: MXFP8())
    full, bare = _stripped(tmp_path, sd)
    loaded, report = load_file(bare)
    assert report.granularities == {"mxfp8": len(SHAPES)}
    assert report.formats == {"mxfp8_without_metadata": len(SHAPES)}
    assert any("recognised as MXFP8 by their tensors" in n for n in report.notes), report.notes
    for name, shape in SHAPES.items():
        w = mxfp8.at_shape(loaded[name + ".weight"], shape)
        assert tuple(w.shape) == shape and isinstance(w.layout, MXFP8), name
        assert torch.equal(w.dequantize(torch.float32), sd[name + ".weight"].dequantize(torch.float32)), name


def _raises(path, *parts) -> str:
    with pytest.raises(FormatError) as info:
        load_file(path)
    msg = str(info.value)
    assert str(path) in msg and all(p in msg for p in parts), msg
    return msg


def test_half_like_layers_are_refused_with_the_reason(tmp_path):
    sd = _model(NVFP4.for_shape)
    _, bare = _stripped(tmp_path, sd)
    tensors = st_load(str(bare))
    # modelopt / compressed-tensors keep block scales [out, in / 16] in plain order: not ComfyUI's tiled grid
    plain = dict(tensors)
    w = sd["blocks.0.mlp.fc1.weight"]
    block, _ = nvfp4.split_scales(w.scale, w.layout)
    plain["blocks.0.mlp.fc1.weight_scale"] = block[:50].contiguous()
    save_file(plain, str(tmp_path / "plain.safetensors"))
    _raises(tmp_path / "plain.safetensors", "'blocks.0.mlp.fc1.weight_scale'", "no comfy_quant", "plain order")
    # a bf16 weight beside a tensor scale is no packed NVFP4 weight
    wrong = dict(tensors)
    wrong["blocks.0.mlp.fc2.weight"] = torch.zeros(256, 128, dtype=torch.bfloat16)
    save_file(wrong, str(tmp_path / "bf16.safetensors"))
    _raises(tmp_path / "bf16.safetensors", "'blocks.0.mlp.fc2.weight_scale_2'", "not packed uint8")
    # a tensor scale of two values
    two = dict(tensors)
    two["blocks.0.attn.qkv.weight_scale_2"] = torch.ones(2)
    save_file(two, str(tmp_path / "two.safetensors"))
    _raises(tmp_path / "two.safetensors", "'blocks.0.attn.qkv.weight_scale_2'", "not one float32 value")


def test_saving_an_unmarked_file_writes_comfyuis_marked_form(tmp_path):
    sd = _model(NVFP4.for_shape)
    full, bare = _stripped(tmp_path, sd)
    loaded, _ = load_file(bare)
    out = tmp_path / "resaved.safetensors"
    save_state_dict(loaded, out)
    again, report = load_file(out)
    assert report.formats == {"comfy_quant_per_layer": len(SHAPES)}
    for name in SHAPES:
        assert torch.equal(again[name + ".weight"].dequantize(torch.float32),
                           loaded[name + ".weight"].dequantize(torch.float32)), name


def test_unmarked_mxfp8_with_scales_of_another_grid_is_refused_saying_why(tmp_path):
    sd = _model(lambda shape: MXFP8())
    _, bare = _stripped(tmp_path, sd)
    tensors = st_load(str(bare))
    tensors["blocks.0.attn.qkv.weight_scale"] = tensors["blocks.0.attn.qkv.weight_scale"][:, :4].contiguous()
    save_file(tensors, str(tmp_path / "grid.safetensors"))
    _raises(tmp_path / "grid.safetensors", "'blocks.0.attn.qkv.weight_scale'", "bad MXFP8 block scales",
            "taken for ComfyUI's MXFP8 form")

