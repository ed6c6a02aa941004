"""Quantize Model's "awq w4a16" granularity (quant.quantize_model, what the node and the converter run):
every linear whose in_features the group of 64 divides becomes comfy-kitchen 0.2.40's AWQ W4A16 by round to
nearest per group, at the SQNR 16 levels per group give; the others stay in full precision, saying why; the
written file loads in the pack's loader with the same bits, saves back byte for byte, and comfy-kitchen's own
dequantization reads it as the pack does.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors import safe_open

from fp8_engram.quant import formats, save
from fp8_engram.quant.layouts.awq import AWQW4A16, is_awq
from fp8_engram.quant.quantize_model import quantize_module, quantize_state_dict

pytestmark = pytest.mark.unit

GROUP = 64
# linears of a small model: fitting shapes (in_features a multiple of 64), one that is not, one kept by name
SHAPES = {"blocks.0.attn.qkv": (384, 128), "blocks.0.mlp.fc1": (256, 128), "blocks.0.mlp.fc2": (128, 256),
          "blocks.0.mod.lin": (192, 192), "blocks.0.odd": (64, 100), "final_layer.linear": (16, 128)}


def _model_sd(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=g) * k ** -0.5
        w[:, 3] *= 6  # an outlier column: its groups get a wide range
        sd[name + ".weight"] = w.to(torch.bfloat16)
        sd[name + ".bias"] = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
    sd["blocks.0.norm.weight"] = torch.ones(128, dtype=torch.bfloat16)
    return sd


def predicted_sqnr_db(w: torch.Tensor) -> float:
    """What round to nearest onto 16 levels from each group's minimum to its maximum gives: uniform rounding
    noise of step^2 / 12 per value, step = (max - min) / 15 of its group (from the weight alone)."""
    x = w.double().reshape(w.shape[0], -1, GROUP)
    step = (x.amax(-1) - x.amin(-1)) / 15
    noise = float((step ** 2 / 12).sum() * GROUP)
    return 10 * math.log10(float((x ** 2).sum()) / noise)


@pytest.fixture(scope="module")
def quantized():
    sd = _model_sd()
    out, report = quantize_state_dict(dict(sd), granularity="awq w4a16", keep=("final_layer*",))
    return sd, out, report


def test_awq_granularity_quantizes_fitting_linears_at_the_sqnr_of_16_levels_per_group(quantized):
    sd, out, report = quantized
    by_name = {lq.name: lq for lq in report.layers}
    fitting = [n for n, (_, k) in SHAPES.items() if k % GROUP == 0 and not n.startswith("final_layer")]
    assert sorted(lq.name for lq in report.quantized) == sorted(fitting)
    assert "multiple of the AWQ group size 64" in by_name["blocks.0.odd"].reason, by_name["blocks.0.odd"]
    assert by_name["final_layer.linear"].reason == "final_layer*"
    odd = out["blocks.0.odd.weight"]
    assert not is_awq(odd) and torch.equal(odd, sd["blocks.0.odd.weight"])
    s = report.summary()
    assert (s["granularity"], s["fp8_dtype"], s["layers_quantized"]) == ("awq w4a16", "uint4", len(fitting)), s
    for name in fitting:
        w, qt = sd[name + ".weight"], out[name + ".weight"]
        assert is_awq(qt) and qt.layout == AWQW4A16(*w.shape, GROUP, torch.bfloat16) and qt.orig_dtype == torch.bfloat16
        deq = qt.dequantize(torch.float32)
        # round to nearest: every value is within half a step of its group's grid (plus the bf16 rounding of the
        # scale and zero point the codes are taken against)
        step = qt.scale[0].float().t().repeat_interleave(GROUP, dim=1)
        worst = float(((deq - w.float()).abs() - 1e-6).div(step).max())
        assert worst <= 0.5 + 2 ** -6, f"{name}: a value {worst:.3f} steps from its code's level"
        db, want = by_name[name].sqnr_db, predicted_sqnr_db(w.float())
        assert abs(db - want) < 0.5, (name, db, want)  # ~20 dB on these weights: 4 bits, not more or less
        assert abs(db - 10 * math.log10(float((w.double() ** 2).sum() / ((w.double() - deq.double()) ** 2).sum()))) < 1e-6


def test_awq_quantize_module_gives_the_state_dict_path_bits():
    sd = _model_sd(1)
    module = torch.nn.Module()
    for name, (n, k) in SHAPES.items():
        parent = module
        for part in name.split(".")[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        lin = torch.nn.Linear(k, n, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(sd[name + ".weight"])
        parent.add_module(name.split(".")[-1], lin)
    new, report = quantize_module(module, granularity="awq w4a16", keep=())
    flat, _ = quantize_state_dict(dict(sd), granularity="awq w4a16", keep=())
    assert sorted(new) == sorted(k for k, v in flat.items() if is_awq(v)) and "blocks.0.odd.weight" not in new
    for key, qt in new.items():
        assert torch.equal(qt.qdata, flat[key].qdata) and torch.equal(qt.scale, flat[key].scale), key


def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_written_awq_file_loads_with_the_same_bits_and_saves_back_byte_for_byte(quantized, tmp_path):
    _, out, _ = quantized
    first, second = tmp_path / "awq.safetensors", tmp_path / "awq_again.safetensors"
    result = save.save_state_dict(out, first)
    n = sum(1 for v in out.values() if is_awq(v))
    assert result.granularities == {"awq_w4a16": n} and not result.stock_comfy_readable
    assert any("awq_w4a16" in note for note in result.notes), result.notes
    loaded, report = formats.load_file(first)
    assert report.granularities == {"awq_w4a16": n} and report.layers_quantized == n
    for key, v in out.items():
        if is_awq(v):
            assert is_awq(loaded[key]) and loaded[key].layout == v.layout, key
            assert torch.equal(loaded[key].qdata, v.qdata) and torch.equal(loaded[key].scale, v.scale), key
            assert torch.equal(loaded[key].dequantize(torch.float32), v.dequantize(torch.float32)), key
        else:
            assert torch.equal(loaded[key], v), key
    save.save_state_dict(loaded, second)
    a, b = _tensors(first), _tensors(second)
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert a[key].contiguous().view(torch.uint8).equal(b[key].contiguous().view(torch.uint8)), f"{key} changed"
    assert first.read_bytes() == second.read_bytes()


def test_comfy_kitchen_reads_the_written_awq_file_as_the_pack_does(quantized, tmp_path):
    from helpers.kitchen import kitchen_dir
    from helpers.kitchen_int4_reference import dequantize_with_kitchen

    _, out, _ = quantized
    path, plain = tmp_path / "awq.safetensors", tmp_path / "awq_by_kitchen_f32.safetensors"
    save.save_state_dict(out, path)
    n = sum(1 for v in out.values() if is_awq(v))
    assert dequantize_with_kitchen(kitchen_dir("0.2.40"), path, plain) == {"awq_w4a16": n, "svdquant_w4a4": 0}
    theirs = _tensors(plain)
    for key, v in out.items():
        if is_awq(v):
            assert torch.equal(theirs[key], v.dequantize(torch.float32)), f"comfy-kitchen reads {key} otherwise"


def test_converter_writes_the_same_awq_file_as_quantize(quantized, tmp_path):
    from safetensors.torch import save_file

    from fp8_engram.quant.convert import convert_file

    sd, out, report = quantized
    src, dst, ref = tmp_path / "bf16.safetensors", tmp_path / "awq_cli.safetensors", tmp_path / "awq.safetensors"
    save_file(sd, str(src))
    result, db = convert_file(src, dst, granularity="awq w4a16", keep=("final_layer*",))
    assert sorted(db) == sorted(lq.name for lq in report.quantized)
    assert all(abs(db[lq.name] - lq.sqnr_db) < 1e-9 for lq in report.quantized), db
    assert result.granularities == {"awq_w4a16": len(report.quantized)}
    save.save_state_dict(out, ref)
    a, b = _tensors(dst), _tensors(ref)
    assert sorted(a) == sorted(b) and a["blocks.0.odd.weight"].dtype == torch.bfloat16
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
