"""ComfyUI 0.33's own INT8 layer formats (int8_tensorwise, convrot_w4a4, asym_w4a8_int8 in the
per-layer ``comfy_quant`` form): files written here the way ComfyUI stores them, loaded, and the
weights compared bit for bit with ComfyUI's dequantization rule, restated below from its
``comfy/ops.py`` and comfy-kitchen's eager backend (plain torch, written for this test)."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from fp8_engram.quant import ComputeConfig, linear
from fp8_engram.quant import formats
from fp8_engram.quant.layouts import comfy_int8
from fp8_engram.quant.compute.int8 import is_int8

pytestmark = pytest.mark.unit

H4 = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.float32)


def regular_hadamard(size, dtype=torch.float32):
    h = H4.to(dtype)
    while h.shape[0] < size:
        h = torch.kron(h, H4.to(dtype))
    return h / (size ** 0.5)


def rotate_back(w, gs, dtype=torch.float32):
    n, k = w.shape
    return torch.matmul(w.reshape(n, k // gs, gs), regular_hadamard(gs, dtype).T.to(dtype)).reshape(n, k)


def cq(conf):
    return torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)


def nibbles(lo, hi):
    return ((lo & 0xF) | ((hi & 0xF) << 4)).to(torch.uint8).view(torch.int8)


N, K = 24, 512


@pytest.fixture
def comfy_file(tmp_path):
    g = torch.Generator().manual_seed(0)
    sd, want = {}, {}
    # int8_tensorwise, one scale
    q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    s = torch.tensor(0.0123)
    sd.update({"a.weight": q, "a.weight_scale": s, "a.comfy_quant": cq({"format": "int8_tensorwise"}),
               "a.bias": torch.randn(N, generator=g).to(torch.bfloat16)})
    want["a"] = lambda dt: (q.float() * s).to(dt)
    # int8_tensorwise per channel + ConvRot (group 256, from "params")
    q2 = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    s2 = torch.rand(N, 1, generator=g) * 0.01 + 1e-3
    sd.update({"b.weight": q2, "b.weight_scale": s2,
               "b.comfy_quant": cq({"format": "int8_tensorwise", "params": {"convrot": True, "convrot_groupsize": 256}})})
    want["b"] = lambda dt: rotate_back(q2.float() * s2, 256).to(dt)
    # convrot_w4a4: signed nibbles, low nibble = even column, per-channel scale [N], group 64
    v = torch.randint(-8, 8, (N, K), generator=g)
    s3 = torch.rand(N, generator=g) * 0.05 + 1e-3
    sd.update({"c.weight": nibbles(v[:, 0::2], v[:, 1::2]), "c.weight_scale": s3,
               "c.comfy_quant": cq({"format": "convrot_w4a4", "convrot_groupsize": 64})})
    want["c"] = lambda dt: rotate_back(v.float() * s3.reshape(-1, 1), 64).to(dt)
    # asym_w4a8_int8: unsigned codes, fp8 group scales (stored as bytes), channel scales, codebook
    codes = torch.randint(0, 16, (N, K), generator=g)
    s_rel = (torch.rand(N, K // 16, generator=g) * 20 + 1).to(torch.float8_e4m3fn)
    s_ch = torch.rand(N, generator=g) * 0.01 + 1e-4
    book = torch.sort(torch.randn(16, generator=g)).values
    sd.update({"d.weight": nibbles(codes[:, 0::2], codes[:, 1::2]), "d.weight_s_rel": s_rel.view(torch.uint8),
               "d.weight_s_channel": s_ch, "d.weight_codebook": book,
               "d.comfy_quant": cq({"format": "asym_w4a8_int8", "group_size": 16, "convrot_groupsize": 256})})

    def asym(dt, codebook=book, codes=codes, s_rel=s_rel):
        vals = codebook[codes] if codebook is not None else codes.float() - 8.0
        grid = (vals.view(N, K // 16, 16) * s_rel.float().unsqueeze(-1)).view(N, K).round().clamp(-127, 127)
        w = (grid.to(torch.int8).float().view(N, K // 16, 16) * s_ch.view(N, 1, 1)).view(N, K).to(dt)
        return rotate_back(w, 256, dt).to(dt)

    want["d"] = asym
    sd["e.weight"] = torch.randn(N, K, generator=g).to(torch.bfloat16)  # a layer kept in bf16
    path = tmp_path / "comfy_int8.safetensors"
    save_file(sd, str(path))
    return path, want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_format_dequantizes_to_comfyuis_bits(comfy_file, dtype):
    path, want = comfy_file
    sd, report = formats.load_file(path, orig_dtype=dtype)
    assert report.formats == {formats.COMFY_PER_LAYER: 4}
    assert report.granularities == {"int8_tensorwise": 2, "convrot_w4a4": 1, "asym_w4a8_int8": 1}
    assert set(sd) == {"a.weight", "a.bias", "b.weight", "c.weight", "d.weight", "e.weight"}
    assert "0.33" in " ".join(report.notes)
    for name, rule in want.items():
        w = sd[name + ".weight"]
        assert is_int8(w) and w.shape == (N, K), name
        got, exp = w.dequantize(dtype), rule(dtype)
        assert got.dtype == exp.dtype and torch.equal(got, exp), name


def test_int8_files_run_the_int8_path_accurately(comfy_file):
    path, want = comfy_file
    sd, _ = formats.load_file(path, config=ComputeConfig(path="int8"))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, K, generator=g)
    x[:, :8] *= 60
    for name in want:
        w = sd[name + ".weight"]
        ref = F.linear(x.double(), w.dequantize(torch.float64))
        y = linear(x, w)
        db = (20 * torch.log10(ref.norm() / (ref - y.double()).norm())).item()
        # "a" is unrotated (per-tensor): the outliers cost it; the rotated formats keep 27 dB+
        assert db >= (20.0 if name == "a" else 27.0), (name, db)


def test_packing_round_trips():
    v = torch.randint(-8, 8, (3, 10))
    assert torch.equal(comfy_int8.unpack_int4(comfy_int8.pack_int4(v), signed=True), v.to(torch.int8))
    u = torch.randint(0, 16, (3, 10))
    assert torch.equal(comfy_int8.unpack_int4(comfy_int8.pack_int4(u), signed=False), u.to(torch.int8))


@pytest.mark.parametrize("bad,match", [
    ({"a.weight_scale": torch.zeros(())}, "finite and > 0"),
    ({"a.weight_scale": torch.ones(N)}, r"\[24, 1\]"),
    ({"a.comfy_quant": cq({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 128})}, "power of 4"),
    ({"a.comfy_quant": cq({"format": "nvfp5"})}, "int8_tensorwise"),
])
def test_bad_int8_layers_name_the_key(tmp_path, bad, match):
    sd = {"a.weight": torch.zeros(N, K, dtype=torch.int8), "a.weight_scale": torch.tensor(0.1),
          "a.comfy_quant": cq({"format": "int8_tensorwise"})}
    sd.update(bad)
    path = tmp_path / "bad.safetensors"
    save_file(sd, str(path))
    with pytest.raises(formats.FormatError, match=match) as info:
        formats.load_file(path)
    assert "bad.safetensors" in str(info.value) and "'a." in str(info.value)


def test_missing_asym_scale_is_named(tmp_path):
    sd = {"d.weight": torch.zeros(N, K // 2, dtype=torch.int8), "d.weight_s_channel": torch.ones(N),
          "d.comfy_quant": cq({"format": "asym_w4a8_int8"})}
    save_file(sd, str(tmp_path / "m.safetensors"))
    with pytest.raises(formats.FormatError, match="d.weight_s_rel"):
        formats.load_file(tmp_path / "m.safetensors")


def test_written_int8_tensorwise_reads_back_exactly():
    from fp8_engram.quant.compute.int8 import to_int8

    g = torch.Generator().manual_seed(7)
    w = torch.randn(16, 512, generator=g)
    for w8 in (to_int8(w), to_int8(w, rotation=0)):
        q, s, conf = comfy_int8.file_tensors(w8)
        assert conf["format"] == "int8_tensorwise" and q.dtype == torch.int8 and tuple(s.shape) == (16, 1)
        back = q.float() * s
        if conf.get("convrot"):
            back = rotate_back(back, conf["convrot_groupsize"])
        assert (20 * math.log10(w.norm() / (w - back).norm())) > 38.0


@pytest.mark.parametrize("granularity,convrot", [("int8 tensor", False), ("int8 row convrot", True)])
def test_converter_writes_comfyuis_int8_tensorwise_form(tmp_path, granularity, convrot):
    from fp8_engram.quant import convert
    from safetensors import safe_open

    g = torch.Generator().manual_seed(8)
    src = {"m.big.weight": torch.randn(32, 512, generator=g).to(torch.bfloat16),
           "m.odd.weight": torch.randn(16, 96, generator=g).to(torch.bfloat16), "m.odd.bias": torch.randn(16)}
    save_file(src, str(tmp_path / "src.safetensors"))
    out = tmp_path / "out.safetensors"
    result, sqnr = convert.convert_file(tmp_path / "src.safetensors", out, granularity=granularity, keep=())
    assert result.granularities == {"int8": 2} and "0.33" in " ".join(result.notes)
    assert min(sqnr.values()) > 38.0
    with safe_open(str(out), "pt") as f:
        for layer, k in (("m.big", 512), ("m.odd", 96)):
            conf = json.loads(bytes(f.get_tensor(layer + ".comfy_quant").tolist()))
            q, s = f.get_tensor(layer + ".weight"), f.get_tensor(layer + ".weight_scale")
            assert q.dtype == torch.int8 and conf["format"] == "int8_tensorwise"
            rotated = convrot and k % 256 == 0
            assert conf.get("convrot", False) == rotated
            assert tuple(s.shape) == ((32 if k == 512 else 16, 1) if convrot else ())
            # ComfyUI's rule gives the weight back
            back = q.float() * s
            if rotated:
                back = rotate_back(back, conf["convrot_groupsize"])
            assert (20 * math.log10(src[layer + ".weight"].float().norm() / (src[layer + ".weight"].float() - back).norm())) > 38


def test_int8_weights_of_any_rotation_save_in_comfyuis_form(tmp_path):
    from fp8_engram.quant import save
    from fp8_engram.quant.compute.int8 import to_int8

    g = torch.Generator().manual_seed(9)
    w = torch.randn(24, 512, generator=g)
    sd = {"a.weight": to_int8(w), "b.weight": to_int8(w, rotation=0)}  # Sylvester 128 / none
    save.save_state_dict(sd, tmp_path / "m.safetensors")
    loaded, report = formats.load_file(tmp_path / "m.safetensors")
    assert report.granularities == {"int8_tensorwise": 2}
    assert loaded["a.weight"].layout.rotation == 256 and loaded["a.weight"].layout.regular
    assert torch.equal(loaded["b.weight"].qdata, sd["b.weight"].qdata)  # kept as it was
    for k in sd:
        assert (20 * math.log10(w.norm() / (w - loaded[k].dequantize(torch.float32)).norm())) > 38


def six_bit_rows(codes):
    """comfy-kitchen 0.2.36+'s 6-bit rows, restated: the K/2-byte nibble plane of each code's low four bits,
    then a K/4-byte plane of its top two bits (column c in byte c//4, at bit 2*(c%4))."""
    top = (codes >> 4) & 0x3
    high = top[:, 0::4] | (top[:, 1::4] << 2) | (top[:, 2::4] << 4) | (top[:, 3::4] << 6)
    return torch.cat([nibbles(codes[:, 0::2], codes[:, 1::2]), high.to(torch.uint8).view(torch.int8)], dim=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_six_bit_asym_rows_dequantize_by_kitchens_rule(tmp_path, dtype):
    g = torch.Generator().manual_seed(11)
    n, k, group, rot = 16, 384, 32, 64
    codes = torch.randint(1, 64, (n, k), generator=g)
    s_rel = (torch.rand(n, k // group, generator=g) * 3 + 0.5).to(torch.float8_e4m3fn)
    s_ch = torch.rand(n, generator=g) * 0.01 + 1e-4
    sd = {"w6.weight": six_bit_rows(codes), "w6.weight_s_rel": s_rel, "w6.weight_s_channel": s_ch,
          "w6.comfy_quant": cq({"format": "asym_w4a8_int8", "group_size": group, "convrot_groupsize": rot})}
    assert sd["w6.weight"].shape == (n, k * 3 // 4)
    save_file(sd, str(tmp_path / "w6.safetensors"))
    loaded, report = formats.load_file(tmp_path / "w6.safetensors", orig_dtype=dtype)
    assert report.granularities == {"asym_w4a8_int8": 1}
    w = loaded["w6.weight"]
    assert is_int8(w) and w.shape == (n, k)
    # uniform levels code - 32, no codebook; the int8 grid, then the channel scale, cast, rotate back
    grid = ((codes.float() - 32).view(n, k // group, group) * s_rel.float().unsqueeze(-1)).view(n, k)
    grid = grid.round().clamp(-127, 127).to(torch.int8)
    assert torch.equal(w.qdata, grid)
    want = rotate_back((grid.float() * s_ch.view(n, 1)).to(dtype), rot, dtype).to(dtype)
    assert torch.equal(w.dequantize(dtype), want)


def _asym_file(tmp_path, cols, s_rel_cols, conf, codebook=False, n=8):
    sd = {"d.weight": torch.ones(n, cols, dtype=torch.int8),
          "d.weight_s_rel": torch.ones(n, s_rel_cols).to(torch.float8_e4m3fn), "d.weight_s_channel": torch.ones(n),
          "d.comfy_quant": cq({"format": "asym_w4a8_int8", **conf})}
    if codebook:
        sd["d.weight_codebook"] = torch.linspace(-1, 1, 16)
    save_file(sd, str(tmp_path / "asym.safetensors"))
    return tmp_path / "asym.safetensors"


@pytest.mark.parametrize("cols,s_rel_cols,conf,codebook,key,match", [
    # K = 32 groups x 16 = 512: rows must be 256 (4-bit) or 384 (6-bit) bytes
    (320, 32, {"group_size": 16}, False, "'d.weight'", r"320 bytes wide.*K=512.*256 bytes at 4 bits and 384 at 6"),
    (255, 32, {"group_size": 16}, False, "'d.weight'", "255 bytes wide"),
    # the right width for the wrong group_size: K = 32 x 8 = 256, and 384 bytes is neither 128 nor 192
    (384, 32, {"group_size": 8}, False, "'d.weight'", "group_size is wrong"),
    # 6-bit rows: uniform (no codebook), group_size a multiple of 16, K a multiple of 32
    (384, 32, {"group_size": 16}, True, "'d.weight_codebook'", "6-bit form is uniform"),
    (384, 64, {"group_size": 8}, False, "'d.comfy_quant'", "group_size a multiple of 16"),
    (36, 3, {"group_size": 16, "convrot_groupsize": 16}, False, "'d.comfy_quant'", "K a multiple of 32"),
])
def test_malformed_asym_rows_are_named(tmp_path, cols, s_rel_cols, conf, codebook, key, match):
    path = _asym_file(tmp_path, cols, s_rel_cols, conf, codebook)
    with pytest.raises(formats.FormatError, match=match) as info:
        formats.load_file(path)
    assert "asym.safetensors" in str(info.value) and key in str(info.value), str(info.value)
