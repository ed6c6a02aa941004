"""comfy-kitchen 0.2.40's 6-bit ``asym_w4a8_int8`` ("W6A8") files, made by kitchen's own quantize code and
checked against kitchen's own eager dequantization, bit for bit, in float32 and bfloat16; they run the int8
path, and Save FP8 Model writes them in the int8_tensorwise form ComfyUI 0.33 reads. (That ComfyUI 0.33 itself,
with its comfy-kitchen 0.2.31, cannot run 6-bit rows is tests/integration/test_comfy033_w6a8.py.)

Kitchen 0.2.40 is installed by pip into `.host/kitchen/` on first use (helpers/kitchen.py) and run in a
subprocess: the test process may have another comfy-kitchen (ComfyUI 0.33's environment pins 0.2.31).
Without it (offline, no wheel for this platform) the tests skip and say so.
"""

import json

import pytest
import torch
from safetensors import safe_open

from fp8_engram.quant import ComputeConfig, formats, linear, save
from fp8_engram.quant.compute.int8 import is_int8
from helpers.kitchen import kitchen_dir, write_asym_file
from helpers.numerics import sqnr

pytestmark = pytest.mark.unit

KITCHEN = "0.2.40"
# name: (out, in, group_size, convrot_groupsize, bits)
LAYERS = {
    "six_g16": (24, 512, 16, 256, 6),
    "six_g64": (16, 1024, 64, 256, 6),
    "six_g32_rot64": (16, 256, 32, 64, 6),
    "six_k96": (8, 96, 16, 16, 6),
    "four_g16": (24, 512, 16, 256, 4),  # the 4-bit form (with kitchen's codebook) from the same release
}


@pytest.fixture(scope="module")
def kitchen_files(tmp_path_factory):
    return write_asym_file(kitchen_dir(KITCHEN), LAYERS, tmp_path_factory.mktemp("w6a8"))


def test_kitchen_wrote_both_row_widths(kitchen_files):
    path, _ = kitchen_files
    with safe_open(str(path), "pt") as f:
        for name, (n, k, _group, _rot, bits) in LAYERS.items():
            q = f.get_tensor(name + ".weight")
            assert q.dtype == torch.int8 and tuple(q.shape) == (n, k * bits // 8), name
            assert (name + ".weight_codebook" in f.keys()) == (bits == 4), name
            if bits == 6:  # the top-bits plane is in use, so a reader that ignores it would be caught
                assert bool(q[:, k // 2:].ne(0).any()), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w6a8_dequantizes_to_kitchens_bits(kitchen_files, dtype):
    path, refs = kitchen_files
    sd, report = formats.load_file(path, orig_dtype=dtype)
    assert report.granularities == {"asym_w4a8_int8": len(LAYERS)}
    for name, (n, k, _group, _rot, _bits) in LAYERS.items():
        w = sd[name + ".weight"]
        assert is_int8(w) and tuple(w.shape) == (n, k), name
        assert torch.equal(w.qdata, refs[name + ".grid"]), name  # the int8 grid the GEMM runs on
        got, want = w.dequantize(dtype), refs[f"{name}.{str(dtype).split('.')[1]}"]
        assert got.dtype == want.dtype == dtype and torch.equal(got, want), name


def test_w6a8_runs_the_int8_path(kitchen_files):
    path, refs = kitchen_files
    sd, _ = formats.load_file(path, config=ComputeConfig(path="int8"))
    g = torch.Generator().manual_seed(5)
    weight_db, out_db = {}, {}
    for name, (_n, k, _group, _rot, _bits) in LAYERS.items():
        w = sd[name + ".weight"]
        weight_db[name] = sqnr(refs[name + ".source"], w.dequantize(torch.float32))
        x = torch.randn(9, k, generator=g)
        x[:, :4] *= 40
        out_db[name] = sqnr(torch.nn.functional.linear(x.double(), w.dequantize(torch.float64)), linear(x, w))
    assert min(out_db.values()) >= 27.0, out_db  # the int8 GEMM against the exact product of its weight
    # 6 bits keep the weight ~3x closer than 4 bits do (kitchen's claim), measured on the same weight
    assert weight_db["six_g16"] >= weight_db["four_g16"] + 8.0, weight_db


def test_loaded_w6a8_saves_in_a_form_comfyui_0_33_reads(kitchen_files, tmp_path):
    """ComfyUI 0.33 with its kitchen 0.2.31 cannot dequantize 6-bit rows, so Save FP8 Model writes a loaded
    W6A8 layer as int8_tensorwise (per channel, ConvRot 256 where K allows), never as 6-bit rows."""
    path, refs = kitchen_files
    sd, _ = formats.load_file(path)
    six = {name + ".weight": sd[name + ".weight"] for name, spec in LAYERS.items() if spec[4] == 6}
    save.save_state_dict(six, tmp_path / "saved.safetensors")
    back, report = formats.load_file(tmp_path / "saved.safetensors")
    assert report.granularities == {"int8_tensorwise": len(six)}
    with safe_open(str(tmp_path / "saved.safetensors"), "pt") as f:
        for key, w in six.items():
            conf = json.loads(bytes(f.get_tensor(key[: -len("weight")] + "comfy_quant").tolist()))
            assert conf["format"] == "int8_tensorwise" and f.get_tensor(key).shape == w.shape, key
            assert sqnr(w.dequantize(torch.float32), back[key].dequantize(torch.float32)) > 38.0, key
