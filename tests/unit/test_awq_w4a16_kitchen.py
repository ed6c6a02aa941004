"""comfy-kitchen 0.2.40's AWQ W4A16 (``awq_w4a16``) layers: files named and laid out by kitchen's own code,
read by the pack and dequantized to kitchen's own bits (float32 and bfloat16), run through the pack's linear,
written back byte for byte, and refused with the file and key named when their shapes disagree.

Kitchen 0.2.40 is installed by pip into `.host/kitchen/` on first use (helpers/kitchen.py) and run in a
subprocess; without it (offline, no wheel for this platform) the tests that need it skip and say so.
"""

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fp8_engram.quant import ComputeConfig, QuantizedTensor, formats, linear, save
from fp8_engram.quant.errors import FormatError
from fp8_engram.quant.layouts.awq import AWQW4A16, is_awq, pack_codes, unpack_codes
from helpers.kitchen import kitchen_dir
from helpers.kitchen_awq import write_awq_file
from helpers.numerics import sqnr

pytestmark = pytest.mark.unit

KITCHEN = "0.2.40"
# name: (out, in, group_size, scale dtype, the JSON declares group_size)
LAYERS = {
    "mod_g64": (48, 256, 64, "bfloat16", True),
    "g64_default": (16, 128, 64, "bfloat16", False),  # no group_size in the JSON: kitchen's default, 64
    "g128_fp16": (32, 512, 128, "float16", True),
    "g32_f32": (16, 96, 32, "float32", True),
    "g16_bf16": (8, 64, 16, "bfloat16", True),
}


@pytest.fixture(scope="module")
def kitchen_files(tmp_path_factory):
    return write_awq_file(kitchen_dir(KITCHEN), LAYERS, tmp_path_factory.mktemp("awq"))


def _tensors(path) -> dict:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_nibble_order_is_low_first():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = pack_codes(codes)
    assert packed.view(torch.uint8).tolist() == [[0x21, 0x0F]]
    assert torch.equal(unpack_codes(packed), codes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_awq_dequantizes_to_kitchens_bits(kitchen_files, dtype):
    path, refs = kitchen_files
    sd, report = formats.load_file(path, orig_dtype=dtype)
    assert report.granularities == {"awq_w4a16": len(LAYERS)}
    assert report.fp8_dtypes == ["uint4"] and any("awq_w4a16" in n for n in report.notes)
    for name, (n, k, group, sdt, _) in LAYERS.items():
        w = sd[name + ".weight"]
        assert is_awq(w) and tuple(w.shape) == (n, k) and w.layout.group == group, name
        assert w.layout.scale_dtype == getattr(torch, sdt) and w.dtype == dtype, name
        want = refs[f"{name}.{str(dtype).split('.')[1]}"]
        # kitchen's result dtype is the output dtype promoted with the scales' (bf16 with fp16 scales: float32)
        assert want.dtype == torch.promote_types(dtype, getattr(torch, sdt)), name
        got = w.dequantize(dtype)
        assert got.dtype == dtype and torch.equal(got, want.to(dtype)), name
        assert name + ".weight_scale" not in sd and name + ".weight_zeros" not in sd and name + ".comfy_quant" not in sd


def test_awq_linear_agrees_with_kitchens_gemv(kitchen_files):
    """The pack's linear (the plain path: kitchen's dequantization, then the matmul) and kitchen's eager
    gemv_awq_w4a16 against the float64 product of the same weight: both within their dtype's rounding."""
    path, refs = kitchen_files
    sd, _ = formats.load_file(path)
    for name, (_n, _k, _g, sdt, _) in LAYERS.items():
        w, b, x = sd[name + ".weight"], sd[name + ".bias"], refs[name + ".x"]
        exact = torch.nn.functional.linear(x.double(), w.dequantize(torch.float64), b.double())
        for path_name in ("auto", "weight_only", "fp8", "int8"):  # no fast path takes these weights
            ours = linear(x, w, b, ComputeConfig(path=path_name))
            assert ours.dtype == x.dtype and ours.shape == refs[name + ".gemv"].shape, (name, path_name)
            floor = 100.0 if sdt == "float32" else 40.0
            assert sqnr(exact, ours) >= floor, (name, path_name, sqnr(exact, ours))
        kitchen_db, ours_db = sqnr(exact, refs[name + ".gemv"]), sqnr(exact, linear(x, w, b))
        assert ours_db >= kitchen_db - 3.0, (name, ours_db, kitchen_db)
        assert torch.equal(torch.nn.functional.linear(x, w, b), linear(x, w, b)), name  # F.linear goes to linear()


def test_awq_round_trip_through_save_is_byte_identical(kitchen_files, tmp_path):
    path, _ = kitchen_files
    sd, _ = formats.load_file(path)
    out = tmp_path / "saved.safetensors"
    result = save.save_state_dict(sd, out)
    assert result.granularities == {"awq_w4a16": len(LAYERS)} and any("awq_w4a16" in n for n in result.notes)
    src, back = _tensors(path), _tensors(out)
    for name, (_n, _k, group, _sdt, _) in LAYERS.items():
        for suffix in (".weight", ".weight_scale", ".weight_zeros", ".bias"):
            a, b = src[name + suffix], back[name + suffix]
            assert a.dtype == b.dtype and a.shape == b.shape, (name, suffix)
            assert a.contiguous().view(torch.uint8).reshape(-1).tolist() == \
                b.contiguous().view(torch.uint8).reshape(-1).tolist(), (name, suffix)
        conf = json.loads(bytes(back[name + ".comfy_quant"].tolist()))
        assert conf == {"format": "awq_w4a16", "group_size": group}, name
    again, _ = formats.load_file(out)
    for name in LAYERS:
        assert torch.equal(again[name + ".weight"].dequantize(torch.float32), sd[name + ".weight"].dequantize(torch.float32))


def test_awq_reads_the_specs_weight_zero_spelling(kitchen_files, tmp_path):
    path, refs = kitchen_files
    t = _tensors(path)
    t["mod_g64.weight_zero"] = t.pop("mod_g64.weight_zeros")
    spec = tmp_path / "spec.safetensors"
    save_file(t, str(spec))
    sd, _ = formats.load_file(spec)
    assert torch.equal(sd["mod_g64.weight"].dequantize(torch.float32), refs["mod_g64.float32"])
    assert "mod_g64.weight_zero" not in sd


def test_awq_from_quantization_metadata(kitchen_files, tmp_path):
    """A layer listed in `_quantization_metadata` (which ComfyUI turns into a `.comfy_quant`) reads the same."""
    path, refs = kitchen_files
    t = _tensors(path)
    conf = json.loads(bytes(t.pop("g16_bf16.comfy_quant").tolist()))
    meta = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": {"g16_bf16": conf}})}
    out = tmp_path / "meta.safetensors"
    save_file(t, str(out), metadata=meta)
    sd, report = formats.load_file(out)
    assert torch.equal(sd["g16_bf16.weight"].dequantize(torch.float32), refs["g16_bf16.float32"])
    assert report.formats.get("comfy_quant_metadata") == 1


def _layer(n=16, k=128, group=64, sdt=torch.bfloat16, conf=None):
    g = torch.Generator().manual_seed(1)
    t = {"l.weight": torch.randint(-128, 128, (n, k // 2), generator=g, dtype=torch.int16).to(torch.int8),
         "l.weight_scale": (torch.rand(k // group, n, generator=g) * 0.02).to(sdt),
         "l.weight_zeros": (torch.randn(k // group, n, generator=g) * 0.01).to(sdt)}
    blob = json.dumps(conf or {"format": "awq_w4a16", "group_size": group}).encode()
    t["l.comfy_quant"] = torch.tensor(list(blob), dtype=torch.uint8)
    return t


@pytest.mark.parametrize("change, key, words", [
    (lambda t: t.update({"l.weight_scale": t["l.weight_scale"][:1]}), "l.weight_scale", "of shape [2, 16]"),
    (lambda t: t.update({"l.weight_zeros": t["l.weight_zeros"].t().contiguous()}), "l.weight_zeros", "of shape [2, 16]"),
    (lambda t: t.pop("l.weight_zeros"), "l.weight_zeros", "zero points"),
    (lambda t: t.pop("l.weight_scale"), "l.weight_scale", "missing"),
    (lambda t: t.update({"l.weight_zero": t["l.weight_zeros"].clone()}), "l.weight_zero", "one tensor of zero points"),
    (lambda t: t.update({"l.weight_zeros": t["l.weight_zeros"].float()}), "l.weight_zeros", "one dtype"),
    (lambda t: t.update({"l.weight_scale": t["l.weight_scale"].to(torch.float8_e4m3fn)}), "l.weight_scale",
     "bfloat16, float16 or float32"),
    (lambda t: t.update({"l.comfy_quant": torch.tensor(list(b'{"format": "awq_w4a16", "group_size": 48}'),
                                                       dtype=torch.uint8)}), "l.comfy_quant", "does not divide"),
    (lambda t: t.update({"l.comfy_quant": torch.tensor(list(b'{"format": "awq_w4a16", "group_size": 0}'),
                                                       dtype=torch.uint8)}), "l.comfy_quant", "positive integer"),
    (lambda t: t["l.weight_scale"].__setitem__((0, 3), float("inf")), "l.weight_scale", "inf or NaN"),
    (lambda t: t.update({"l.weight": t["l.weight"].reshape(-1)}), "l.weight", "int8 [out, in / 2]"),
])
def test_awq_inconsistent_layers_are_refused_naming_file_and_key(tmp_path, change, key, words):
    t = _layer()
    change(t)
    path = tmp_path / "bad_awq.safetensors"
    save_file(t, str(path))
    with pytest.raises(FormatError) as info:
        formats.load_file(path)
    msg = str(info.value)
    assert "bad_awq.safetensors" in msg and key in msg and words in msg, msg


def test_awq_generic_ops_keep_the_bits():
    t = _layer(sdt=torch.float16)
    lay = AWQW4A16(16, 128, 64, torch.float16)
    w = QuantizedTensor.from_parts(t["l.weight"].reshape(lay.storage_shape),
                                   torch.stack((t["l.weight_scale"], t["l.weight_zeros"])), lay,
                                   orig_dtype=torch.bfloat16)
    ref = w.dequantize(torch.float32)
    for other in (w.clone(), w.detach(), w.to("cpu", copy=True), torch.empty_like(w).copy_(w)):
        assert torch.equal(other.dequantize(torch.float32), ref)
    assert torch.equal(w.to(torch.float32), ref)  # a dtype change dequantizes
    for dtype in (torch.float32, torch.bfloat16):  # into a caller's buffer (in place, or promoted then copied)
        buf = torch.empty(16, 128, dtype=dtype)
        assert lay.dequantize(w.qdata, w.scale, dtype, out=buf) is buf and torch.equal(buf, w.dequantize(dtype))


def test_awq_rtn_quantizer_sqnr():
    """Round to nearest per group of 64 onto 16 levels from the group's minimum to its maximum: on a
    Gaussian weight about 20.5 dB (the step is ~1/3 of a standard deviation); stochastic rounding, unbiased,
    loses about 3 dB more. Requantizing in place (what LoRA patching does) keeps the layout and dtype."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(256, 512, generator=g)
    lay = AWQW4A16.for_shape(w.shape, 64, torch.bfloat16)
    q = QuantizedTensor.from_float(w, lay)
    rtn = sqnr(w, q.dequantize(torch.float32))
    assert 19.5 <= rtn <= 22.0, rtn
    sr = sqnr(w, QuantizedTensor.from_float(w, lay, stochastic_rounding=7).dequantize(torch.float32))
    assert rtn - 5.0 <= sr < rtn, (rtn, sr)
    assert QuantizedTensor.from_float(torch.ones(4, 64), AWQW4A16.for_shape((4, 64))).dequantize(torch.float32).eq(1).all()
    before = q.qdata.clone()
    w2 = w.flip(1) * 0.5
    q.requantize_(w2)
    assert q.layout == lay and q.scale.dtype == torch.bfloat16 and not torch.equal(q.qdata, before)
    assert sqnr(w2, q.dequantize(torch.float32)) >= 19.5


def test_transposing_an_awq_weight_gives_its_transpose():
    """aten.t decides by the weight's logical rank, not its data's (AWQ's data is 3-D)."""
    w = QuantizedTensor.from_float(torch.randn(16, 128), AWQW4A16.for_shape((16, 128)))
    t = w.t()
    assert isinstance(t, torch.Tensor) and torch.equal(t.dequantize(torch.float32), w.dequantize(torch.float32).t())
