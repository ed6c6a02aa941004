"""Saving FP8 state dicts: files round-trip bit for bit through this pack's reader, per-tensor files
use the forms stock ComfyUI 0.3.75 reads, writes are atomic and never overwrite silently."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from fp8_engram.quant import formats, save
from fp8_engram.quant.quantize_model import quantize_state_dict
from fp8_engram.quant.tensor import QuantizedTensor

pytestmark = pytest.mark.unit


def float_sd() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    sd = {
        "blocks.0.attn.qkv.weight": torch.randn(384, 128, generator=g),
        "blocks.0.attn.qkv.bias": torch.randn(384, generator=g),
        "blocks.0.mlp.fc1.weight": torch.randn(200, 136, generator=g),  # not a multiple of any block
        "blocks.0.norm.weight": torch.ones(128),
        "embedder.proj.weight": torch.randn(128, 64, generator=g),  # kept by the default patterns
    }
    return {k: v.to(torch.bfloat16) for k, v in sd.items()}


CASES = [("tensor", "e4m3fn", (128, 128)), ("tensor", "e5m2", (128, 128)), ("row", "e4m3fn", (128, 128)),
         ("block", "e4m3fn", (128, 128)), ("block", "e5m2", (1, 64))]


@pytest.mark.parametrize("gran,dtype,block", CASES)
def test_roundtrip_is_bit_exact(tmp_path, gran, dtype, block):
    qsd, report = quantize_state_dict(float_sd(), granularity=gran, fp8_dtype=dtype, block=block)
    assert report.summary()["layers_quantized"] == 2
    path = tmp_path / "m.safetensors"
    res = save.save_state_dict(qsd, path)
    assert res.layers_quantized == 2
    back, rep = formats.load_file(path)
    assert set(back) == set(qsd)
    for k, v in qsd.items():
        if isinstance(v, QuantizedTensor):
            b = back[k]
            assert isinstance(b, QuantizedTensor)
            assert b.layout == v.layout
            assert torch.equal(b.qdata.view(torch.uint8), v.qdata.view(torch.uint8))
            assert torch.equal(b.scale, v.scale)
            assert b.dtype == torch.bfloat16
        else:
            assert torch.equal(back[k], v) and back[k].dtype == v.dtype
    assert rep.stock_comfy_readable == (gran == "tensor") == res.stock_comfy_readable


def test_per_tensor_e4m3fn_file_carries_the_stock_forms(tmp_path):
    qsd, _ = quantize_state_dict(float_sd(), granularity="tensor")
    path = tmp_path / "m.safetensors"
    save.save_state_dict(qsd, path)
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["_quantization_metadata"])
        keys = set(f.keys())
        assert f.get_tensor("blocks.0.attn.qkv.weight_scale").shape == ()
        assert f.get_tensor("blocks.0.attn.qkv.weight_scale").dtype == torch.float32
        blob = bytes(f.get_tensor("blocks.0.attn.qkv.comfy_quant").tolist())
    # every layer entry is an object (the string form crashes 0.3.75)
    assert meta["layers"] == {"blocks.0.attn.qkv": {"format": "float8_e4m3fn"}, "blocks.0.mlp.fc1": {"format": "float8_e4m3fn"}}
    assert json.loads(blob) == {"format": "float8_e4m3fn"}
    assert "embedder.proj.weight_scale" not in keys
    assert formats.detect_format(path).report.format == "comfy_quant_metadata"


def test_e5m2_per_tensor_uses_the_legacy_marker(tmp_path):
    qsd, _ = quantize_state_dict(float_sd(), granularity="tensor", fp8_dtype="e5m2")
    path = tmp_path / "m.safetensors"
    save.save_state_dict(qsd, path)
    with safe_open(str(path), framework="pt") as f:
        assert f.get_tensor("scaled_fp8").dtype == torch.float8_e5m2
        assert "blocks.0.attn.qkv.scale_weight" in f.keys()
    assert formats.detect_format(path).report.format == "comfy_scaled_fp8"


def test_never_overwrites_silently(tmp_path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(b"precious")
    with pytest.raises(FileExistsError, match=str(path)):
        save.save_state_dict(float_sd(), path)
    assert path.read_bytes() == b"precious"
    free = save.unique_path(path)
    assert free != str(path) and free.endswith("_00001.safetensors")
    save.save_state_dict(float_sd(), free)
    assert os.path.exists(free)


def test_failed_write_leaves_nothing_behind(tmp_path):
    path = tmp_path / "m.safetensors"
    sd = float_sd()

    class Boom(Exception):
        pass

    def progress(done, total):
        if done == 2:
            raise Boom

    with pytest.raises(Boom):
        save.save_state_dict(sd, path, progress=progress)
    assert list(tmp_path.iterdir()) == []


def test_streamed_file_is_valid_safetensors(tmp_path):
    path = tmp_path / "plain.safetensors"
    sd = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor(3.5), "c": torch.zeros(0),
          "d": torch.tensor([True, False]), "e": torch.randn(3, 3).to(torch.float8_e4m3fn)}
    save.save_state_dict(sd, path)
    with safe_open(str(path), framework="pt") as f:
        for k, v in sd.items():
            got = f.get_tensor(k)
            assert got.dtype == v.dtype and got.shape == v.shape
            assert torch.equal(got.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else got,
                               v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v)
