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


@pytest.mark.parametrize("prefix", ["../escape", "fp8/../../escape", "/etc/fp8", "//server/share/x", "C:/models/x",
                                    "c:model", "..\\escape", "fp8\\..\\..\\x", "a/..", "..", "fp8/\0x", "", "   ", "fp8/"])
def test_output_prefix_that_leaves_the_folder_is_refused(tmp_path, prefix):
    with pytest.raises(ValueError, match="filename_prefix"):
        save.check_output_prefix(prefix, tmp_path)


@pytest.mark.parametrize("prefix, clean, sub", [("fp8/model", "fp8/model", "fp8"), ("./fp8//model", "fp8/model", "fp8"),
                                                ("model", "model", ""), ("a\\b/c", "a/b/c", "a/b"), (" x.y ", "x.y", "")])
def test_output_prefix_inside_the_folder_is_kept(tmp_path, prefix, clean, sub):
    got, folder = save.check_output_prefix(prefix, tmp_path)
    assert got == clean
    assert folder == os.path.join(os.path.realpath(tmp_path), *([sub] if sub else []))


def test_output_prefix_through_a_link_out_of_the_folder_is_refused(tmp_path):
    out = tmp_path / "output"
    out.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (out / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="leads outside the output folder"):
        save.check_output_prefix("link/model", out)


def mixed_sd() -> dict:
    """A quantized state dict as ComfyUI holds it on the CPU: FP8 weights, everything else float32."""
    qsd, _ = quantize_state_dict(float_sd(), granularity="tensor")
    return {k: (v if isinstance(v, QuantizedTensor) else v.float()) for k, v in qsd.items()}


def test_plain_tensors_are_written_in_their_source_dtype(tmp_path):
    sd = mixed_sd()
    source = {"model.diffusion_model." + k: torch.bfloat16 for k in float_sd()}  # a checkpoint's prefixed keys
    dtypes, note = save.plain_dtypes(sd, None, source)
    plain = [k for k, v in sd.items() if not isinstance(v, QuantizedTensor)]
    assert dtypes == {k: torch.bfloat16 for k in plain} and "as loaded (bfloat16)" in note
    small = save.save_state_dict(sd, tmp_path / "as_loaded.safetensors", dtypes=dtypes)
    big = save.save_state_dict(sd, tmp_path / "in_memory.safetensors")
    with safe_open(small.path, framework="pt") as f:
        for k in plain:
            assert f.get_slice(k).get_dtype() == "BF16"
            assert torch.equal(f.get_tensor(k), sd[k].to(torch.bfloat16))
    plain_bytes = sum(sd[k].numel() for k in plain)
    data = {r.path: formats.read_header(r.path).file_size - formats.read_header(r.path).data_start for r in (small, big)}
    assert data[big.path] - data[small.path] == 2 * plain_bytes  # float32 -> bfloat16 halves exactly those
    back, _ = formats.load_file(small.path)
    assert all(isinstance(back[k], QuantizedTensor) for k in sd if isinstance(sd[k], QuantizedTensor))


def test_plain_dtype_choices_and_fallbacks():
    sd = mixed_sd()
    plain = [k for k, v in sd.items() if not isinstance(v, QuantizedTensor)]
    assert save.plain_dtypes(sd, torch.float16)[0] == {k: torch.float16 for k in plain}
    assert save.plain_dtypes(sd, None, None)[0] == {}  # unknown source: as in memory
    assert save.plain_dtypes(sd, None, None, torch.bfloat16)[0] == {k: torch.bfloat16 for k in plain}
    # keys the source lacks take its most common float dtype
    assert set(save.plain_dtypes(sd, None, {"other.weight": torch.float16})[0].values()) == {torch.float16}
    # an unscaled float8 source tensor goes back to float8 only when the values fit
    bias = "blocks.0.attn.qkv.bias"
    src = {k: torch.bfloat16 for k in plain} | {bias: torch.float8_e4m3fn}
    assert save.plain_dtypes(sd, None, src)[0][bias] == torch.float8_e4m3fn
    sd_big = dict(sd, **{bias: sd[bias] * 1e4})
    assert save.plain_dtypes(sd_big, None, src)[0][bias] == torch.bfloat16
    with pytest.raises(ValueError, match="beyond float16's range"):
        save.plain_dtypes(dict(sd, **{bias: torch.full((3,), 1e6)}), torch.float16)


def test_a_saved_file_has_the_mode_of_any_new_file(tmp_path):
    """0666 less the umask (the temp file it is renamed from must not stay 0600), and no temp left."""
    import os

    from fp8_engram.quant.save import write_safetensors

    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    old = os.umask(0o027)
    try:
        path = tmp_path / "mode.safetensors"
        write_safetensors(path, [("t", t.dtype, tuple(t.shape))], lambda name: t)
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["mode.safetensors"]
