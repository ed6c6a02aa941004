"""comfy-kitchen 0.2.40's SVDQuant W4A4 layers in the tile-packed form (``kitchen_tile_packed_w4a4``): built as
SVDQuant builds them, tiled and checked with kitchen's own code, read by the pack as their effective weight.

The pack runs them weight-only (its compute floor has no W4A4 product), so the comparison is against the
float64 product of the effective weight: the pack's output within its dtype's rounding, kitchen's eager W4A4
product within its 4-bit activation rounding (~17-23 dB here), and the two as close to each other as kitchen is
to that product. Kitchen's own dequantization (its kernel on an identity input) agrees with the pack's
effective weight within kitchen's roundings. Without kitchen (offline, no wheel) the tests skip and say so.
"""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fp8_engram.quant import formats, linear, save
from fp8_engram.quant.errors import FormatError
from fp8_engram.quant.layouts.svdquant import is_svdquant, tile_weight, untile_weight
from helpers.kitchen import kitchen_dir
from helpers.kitchen_svdquant import write_svdquant_file
from helpers.numerics import sqnr

pytestmark = pytest.mark.unit

KITCHEN = "0.2.40"
# name: (out, in, rank, dtype, weight_scale and proj_up tile-packed too, act_unsigned)
LAYERS = {
    "attn_qkv": (256, 192, 16, "bfloat16", True, False),
    "f32_natural_parts": (128, 256, 32, "float32", False, False),
    "mlp_fc2_unsigned": (128, 128, 8, "bfloat16", True, True),
    "fp16": (128, 64, 16, "float16", True, False),
}


@pytest.fixture(scope="module")
def kitchen_files(tmp_path_factory):
    return write_svdquant_file(kitchen_dir(KITCHEN), LAYERS, tmp_path_factory.mktemp("svdq"))


def _tensors(path) -> dict:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_tiling_round_trips():
    w = torch.arange(256 * 64, dtype=torch.int32).view(256, 64).to(torch.int8)
    t = tile_weight(w)
    assert t.shape == (2, 2, 32, 128) and torch.equal(untile_weight(t), w)
    # row q of a tile holds outputs 4q..4q+3, each 32 bytes of one group of 64 inputs
    assert torch.equal(t[1, 0, 3, 32:64], w[128 + 13, :32]) and torch.equal(t[0, 1, 0, :32], w[0, 32:])


def test_effective_weight_matches_kitchens_dequantization(kitchen_files):
    path, refs = kitchen_files
    sd, report = formats.load_file(path)
    assert report.granularities == {"svdquant_w4a4": len(LAYERS)} and report.fp8_dtypes == ["int4"]
    assert report.linear_weights == len(LAYERS)
    assert any("svdquant_w4a4" in n and "weight-only" in n and "1 act_unsigned" in n for n in report.notes)
    figures = {}
    for name, (n, k, _r, dt, _tiled, _u) in LAYERS.items():
        w = sd[name + ".weight"]
        assert is_svdquant(w) and tuple(w.shape) == (n, k), name
        theirs = refs[name + ".dequant"]
        figures[name] = sqnr(theirs.double(), w.dequantize(torch.float64))
        # kitchen forms it through its kernel on an identity input, rounding in the layer's dtype at each step
        assert figures[name] >= (120.0 if dt == "float32" else 45.0), figures
        assert sqnr(refs[name + ".source"], w.dequantize(torch.float32)) >= 17.0, name  # 4-bit residual + rank-r branch


def test_weight_only_product_agrees_with_kitchens_w4a4_product(kitchen_files):
    path, refs = kitchen_files
    sd, _ = formats.load_file(path)
    file_t = _tensors(path)
    for name, (_n, _k, _r, dt, _tiled, unsigned) in LAYERS.items():
        w, b, x = sd[name + ".weight"], sd[name + ".bias"], refs[name + ".x"]
        exact = torch.nn.functional.linear(x.double(), w.dequantize(torch.float64), b.double())
        ours, theirs = linear(x, w, b), refs[name + ".kitchen_out"]
        ours_db, kitchen_db = sqnr(exact, ours), sqnr(exact, theirs)
        assert ours_db >= (100.0 if dt == "float32" else 40.0), (name, ours_db)
        assert 14.0 <= kitchen_db < ours_db, (name, kitchen_db)  # kitchen rounds the activation to 4 bits
        assert sqnr(theirs, ours) >= kitchen_db - 1.0, (name, sqnr(theirs, ours), kitchen_db)
        if unsigned:  # the shift's constant is in the loaded bias; without it the product is far off
            assert not torch.equal(b, file_t[name + ".bias"])
            without = linear(x, w, file_t[name + ".bias"])
            assert sqnr(theirs, without) < kitchen_db - 6.0, (name, sqnr(theirs, without))


def test_round_trip_through_save_is_byte_identical(kitchen_files, tmp_path):
    path, _ = kitchen_files
    sd, _ = formats.load_file(path)
    with pytest.raises(ValueError, match="mlp_fc2_unsigned.*act_unsigned"):
        save.save_state_dict(sd, tmp_path / "refused.safetensors")
    keep = {k: v for k, v in sd.items() if not k.startswith("mlp_fc2_unsigned.")}
    out = tmp_path / "saved.safetensors"
    result = save.save_state_dict(keep, out)
    assert any("svdquant_w4a4" in n for n in result.notes)
    src, back = _tensors(path), _tensors(out)
    for name in (n for n in LAYERS if n != "mlp_fc2_unsigned"):
        for suffix in (".weight", ".weight_scale", ".smooth_factor", ".proj_down", ".proj_up", ".bias"):
            a, b = src[name + suffix], back[name + suffix]
            assert a.dtype == b.dtype and a.shape == b.shape, (name, suffix)
            assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a.contiguous().view(torch.int16 if a.element_size() == 2 else torch.int32),
                               b.view(torch.uint8) if b.element_size() == 1 else b.contiguous().view(torch.int16 if b.element_size() == 2 else torch.int32)), (name, suffix)
        assert json.loads(bytes(back[name + ".comfy_quant"].tolist())) == json.loads(bytes(src[name + ".comfy_quant"].tolist()))


def test_kitchens_state_dict_names_are_read(kitchen_files, tmp_path):
    path, refs = kitchen_files
    t = _tensors(path)
    for part in ("smooth_factor", "proj_down", "proj_up"):
        t[f"attn_qkv.weight_{part}"] = t.pop(f"attn_qkv.{part}")
    other = tmp_path / "kitchen_names.safetensors"
    save_file(t, str(other))
    sd, _ = formats.load_file(other)
    assert sqnr(refs["attn_qkv.dequant"].double(), sd["attn_qkv.weight"].dequantize(torch.float64)) >= 45.0
    assert not any("weight_proj" in k or "smooth" in k for k in sd)


def _bad(kitchen_files, tmp_path, change):
    path, _ = kitchen_files
    t = {k: v for k, v in _tensors(path).items() if k.startswith("fp16.")}
    change(t)
    bad = tmp_path / "bad_svdq.safetensors"
    save_file(t, str(bad))
    with pytest.raises(FormatError) as info:
        formats.load_file(bad)
    msg = str(info.value)
    assert "bad_svdq.safetensors" in msg
    return msg


def _conf(**extra):
    conf = {"format": "svdquant_w4a4", "layout": "kitchen_tile_packed_w4a4", **extra}
    return torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)


@pytest.mark.parametrize("change, words", [
    (lambda t: t.update({"fp16.proj_up": t["fp16.proj_up"][:, :8].contiguous()}), ["fp16.proj_up", "rank 16"]),
    (lambda t: t.update({"fp16.proj_down": t["fp16.proj_down"][:32].contiguous()}), ["fp16.proj_down", "[64, 16]"]),
    (lambda t: t.update({"fp16.smooth_factor": t["fp16.smooth_factor"][:63].contiguous()}), ["fp16.smooth_factor", "[64]"]),
    (lambda t: t.update({"fp16.weight_scale": t["fp16.weight_scale"].reshape(-1)}), ["fp16.weight_scale", "[1, 1, 128]"]),
    (lambda t: t.update({"fp16.weight": t["fp16.weight"][:, :, :16].contiguous()}), ["fp16.weight", "[N/128, K/64, 32, 128]"]),
    (lambda t: t.pop("fp16.proj_down"), ["fp16.proj_down", "missing"]),
    (lambda t: t.update({"fp16.proj_down": torch.zeros(64, 200, dtype=torch.float16),
                         "fp16.proj_up": torch.zeros(1, 200, 128, dtype=torch.float16)}), ["fp16.proj_down", "rank 200"]),
    (lambda t: t.update({"fp16.smooth_factor": torch.zeros_like(t["fp16.smooth_factor"])}), ["fp16.smooth_factor", "zeros"]),
    (lambda t: t.update({"fp16.weight_proj_up": t["fp16.proj_up"].clone()}), ["fp16.weight_proj_up", "both"]),
    (lambda t: t.update({"fp16.comfy_quant": _conf(lowrank_branch_input_basis="post_smoothing",
                                                   proj_down_smooth_folded=False)}), ["fp16.comfy_quant", "raw"]),
    (lambda t: t.update({"fp16.comfy_quant": _conf(layout="nunchaku")}), ["fp16.comfy_quant", "kitchen_tile_packed_w4a4"]),
])
def test_inconsistent_layers_are_refused_naming_the_key(kitchen_files, tmp_path, change, words):
    msg = _bad(kitchen_files, tmp_path, change)
    assert all(w in msg for w in words), msg


def test_loading_a_weight_alone_leaves_the_bias_out(kitchen_files):
    path, _ = kitchen_files
    sd, _ = formats.load_file(path, keys=["mlp_fc2_unsigned.weight"])
    assert set(sd) == {"mlp_fc2_unsigned.weight"}



def test_the_natural_form_reads_the_same_weight(kitchen_files, tmp_path):
    """The spec's natural family (weight [N, K/2], no "layout" in the JSON) is the same layer untiled."""
    path, refs = kitchen_files
    t = {k: v for k, v in _tensors(path).items() if k.startswith("attn_qkv.")}
    t["attn_qkv.weight"] = untile_weight(t["attn_qkv.weight"]).contiguous()
    ws, up = t["attn_qkv.weight_scale"], t["attn_qkv.proj_up"]  # [N/128, K/64, 128], [N/128, R, 128]
    t["attn_qkv.weight_scale"] = ws.permute(1, 0, 2).reshape(ws.shape[1], -1).contiguous()
    t["attn_qkv.proj_up"] = up.permute(0, 2, 1).reshape(-1, up.shape[1]).contiguous()
    t["attn_qkv.comfy_quant"] = torch.tensor(list(b'{"format": "svdquant_w4a4"}'), dtype=torch.uint8)
    natural = tmp_path / "natural.safetensors"
    save_file(t, str(natural))
    sd, _ = formats.load_file(natural)
    w = sd["attn_qkv.weight"]
    assert not w.layout.tiled and w.qdata.dim() == 3
    tiled, _ = formats.load_file(path, keys=["attn_qkv.weight"])
    assert torch.equal(w.dequantize(torch.float32), tiled["attn_qkv.weight"].dequantize(torch.float32))
    save.save_state_dict(sd, tmp_path / "natural_saved.safetensors")
    back = _tensors(tmp_path / "natural_saved.safetensors")
    assert torch.equal(back["attn_qkv.weight"], t["attn_qkv.weight"])


def test_a_layer_listed_in_quantization_metadata_reads_the_same(kitchen_files, tmp_path):
    path, _ = kitchen_files
    t = {k: v for k, v in _tensors(path).items() if k.startswith("fp16.")}
    conf = json.loads(bytes(t.pop("fp16.comfy_quant").tolist()))
    meta = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": {"fp16": conf}})}
    save_file(t, str(tmp_path / "meta.safetensors"), metadata=meta)
    sd, report = formats.load_file(tmp_path / "meta.safetensors")
    base, _ = formats.load_file(path, keys=["fp16.weight"])
    assert report.formats == {"comfy_quant_metadata": 1}
    assert torch.equal(sd["fp16.weight"].dequantize(torch.float32), base["fp16.weight"].dequantize(torch.float32))

