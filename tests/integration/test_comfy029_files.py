"""Files that stock ComfyUI 0.29 writes load in the pack bit for bit (0.29's own code makes them, in process).

- Per-layer files: each linear quantized by 0.29's layout (`TensorCoreFP8E4M3Layout` / `E5M2` with
  its absmax scale, `TensorCoreMXFP8Layout`) and serialized by 0.29's own mixed-precision `Linear`
  (`state_dict()`: `weight`, `weight_scale`, the `comfy_quant` uint8 JSON). The pack must hold the same
  FP8 bytes and the same scales, and dequantize to exactly what 0.29 dequantizes to in float32 (and,
  for MXFP8, in every dtype: a power-of-two scale rounds once).
- Legacy conversions: 0.29 turns a legacy `scaled_fp8` file (with and without fp8 matmul) and a
  `_quantization_metadata` file into per-layer form with `comfy.utils.convert_old_quants`; the
  converted file loads in the pack to the same weights as the original, and keeps the "no fp8 matmul"
  flag.
Runs where the ComfyUI in use is 0.29 or newer (CI's second and third legs: 0.29.0, 0.33.0); skips elsewhere
and says so.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import comfy029, fp8_files
from helpers.host import comfy_in_process

pytestmark = pytest.mark.integration

FORMATS = ["float8_e4m3fn", "float8_e5m2", "mxfp8"]


@pytest.fixture(scope="module")
def c29():
    comfy_in_process()
    import comfy.quant_ops as quant_ops

    if not hasattr(quant_ops.TensorCoreFP8Layout, "Params"):
        pytest.skip("needs ComfyUI 0.29 or newer (comfy-kitchen quantization); the tree in use is older")
    if "mxfp8" not in quant_ops.QUANT_ALGOS:
        pytest.skip("this ComfyUI's comfy-kitchen has no MXFP8")
    import comfy.ops
    import comfy.utils

    return SimpleNamespace(qo=quant_ops, ops=comfy.ops, utils=comfy.utils)


def _sd() -> dict[str, torch.Tensor]:
    # input sizes 128 and 96: multiples of 32, as MXFP8 needs without padding
    return fp8_files.small_float_sd(seed=4)


def stock_write(c29, sd: dict, fmt: str):
    return comfy029.stock_write(c29.qo, c29.ops, sd, fmt)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("fmt", FORMATS)
def test_per_layer_files_written_by_029_load_bit_exactly(c29, tmp_path, fmt):
    from fp8_engram.quant import QuantizedTensor, formats

    written, theirs = stock_write(c29, _sd(), fmt)
    assert any(k.endswith(".comfy_quant") for k in written) and any(k.endswith(".weight_scale") for k in written)
    path = tmp_path / f"stock029_{fmt}.safetensors"
    save_file({k: v.contiguous() for k, v in written.items()}, str(path))
    ours, report = formats.load_file(str(path))
    assert report.format == formats.COMFY_PER_LAYER and report.layers_quantized == len(theirs)
    for key, qt29 in theirs.items():
        qt = ours[key]
        assert isinstance(qt, QuantizedTensor) and qt.shape == qt29.shape
        assert torch.equal(_bits(qt.qdata), _bits(qt29._qdata)), f"{key}: FP8 bytes differ"
        dtypes = (torch.float32, torch.bfloat16, torch.float16) if fmt == "mxfp8" else (torch.float32,)
        for dtype in dtypes:
            params = type(qt29._params)(**{**qt29._params.__dict__, "orig_dtype": dtype})
            ref = c29.qo.get_layout_class(qt29._layout_cls).dequantize(qt29._qdata, params)
            ref = ref[: qt.shape[0], : qt.shape[1]]
            assert torch.equal(_bits(qt.dequantize(dtype)), _bits(ref)), f"{key} {dtype}: dequantized weights differ"
    for key in written:
        if not key.endswith((".weight_scale", ".comfy_quant")) and not isinstance(ours[key], QuantizedTensor):
            assert torch.equal(ours[key], written[key])


@pytest.mark.parametrize("legacy", ["comfy_scaled_fp8", "comfy_scaled_fp8_no_mm", "comfy_quant_metadata"])
def test_legacy_files_converted_by_029_load_like_the_originals(c29, tmp_path, legacy):
    from fp8_engram.quant import formats
    from safetensors import safe_open

    src = tmp_path / f"{legacy}.safetensors"
    fp8_files.write_format(_sd(), src, legacy)
    with safe_open(str(src), framework="pt") as f:
        metadata = f.metadata() or {}
    converted, _ = c29.utils.convert_old_quants(load_file(str(src)), "", metadata=dict(metadata))
    assert any(k.endswith(".comfy_quant") for k in converted)
    dst = tmp_path / f"{legacy}_as_029.safetensors"
    save_file({k: v.contiguous() for k, v in converted.items()}, str(dst))
    before, rep_before = formats.load_file(str(src))
    after, rep_after = formats.load_file(str(dst))
    assert rep_after.layers_quantized == rep_before.layers_quantized > 0
    assert rep_after.fp8_matmul_allowed == rep_before.fp8_matmul_allowed == (legacy != "comfy_scaled_fp8_no_mm")
    for key, qt in before.items():
        if key not in after:
            continue
        a = after[key]
        if hasattr(qt, "qdata"):
            assert torch.equal(_bits(a.qdata), _bits(qt.qdata)) and torch.equal(a.scale, qt.scale), key
        else:
            assert torch.equal(a, qt), key


# ---- MXFP8 layers whose sizes are not multiples of 32 --------------------------------------------------

def _odd_sd() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(29)
    sd = {
        "blocks.0.proj.weight": torch.randn(50, 70, generator=g),    # both sizes padded by 0.29
        "blocks.0.proj.bias": torch.randn(50, generator=g) * 0.1,
        "blocks.0.out.weight": torch.randn(96, 45, generator=g),     # input size only
        "blocks.0.head.weight": torch.randn(33, 64, generator=g),    # output size only
        "blocks.0.even.weight": torch.randn(64, 128, generator=g),   # no padding
    }
    return {k: v.to(torch.bfloat16) for k, v in sd.items()}


def _dequant_029(c29, qt29, dtype) -> torch.Tensor:
    """0.29's own dequantization of its QuantizedTensor in `dtype`, cut to the layer's size by 0.29."""
    params = type(qt29._params)(**{**qt29._params.__dict__, "orig_dtype": dtype})
    return type(qt29)(qt29._qdata, qt29._layout_cls, params).dequantize()


def test_odd_sized_mxfp8_layers_written_by_029_load_at_their_true_size(c29, tmp_path):
    """0.29 pads such layers to multiples of 32 in the file and keeps the true size only in its model;
    the pack cuts them to the size the model declares (`mxfp8.at_shape`, what Load FP8 Diffusion
    Model's Linear does) and then holds exactly 0.29's weights: its FP8 bytes without the padding,
    and bit for bit 0.29's dequantized weight in every dtype."""
    from fp8_engram.quant import QuantizedTensor, formats
    from fp8_engram.quant.layouts.mxfp8 import MXFP8, at_shape

    sd = _odd_sd()
    written, theirs = stock_write(c29, sd, "mxfp8")
    assert tuple(written["blocks.0.proj.weight"].shape) == (64, 96)  # 0.29's padding, as the file holds it
    path = tmp_path / "stock029_mxfp8_odd.safetensors"
    save_file({k: v.contiguous() for k, v in written.items()}, str(path))
    ours, report = formats.load_file(str(path))
    assert report.layers_quantized == len(theirs) == 4
    for key, qt29 in theirs.items():
        true = tuple(sd[key].shape)
        assert tuple(qt29.shape) == true
        qt = at_shape(ours[key], true)
        assert isinstance(qt, QuantizedTensor) and qt.layout == MXFP8() and qt.shape == true, key
        assert torch.equal(_bits(qt.qdata), _bits(qt29._qdata[: true[0], : true[1]])), f"{key}: FP8 bytes differ"
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            ref = _dequant_029(c29, qt29, dtype)
            assert ref.shape == true
            assert torch.equal(_bits(qt.dequantize(dtype)), _bits(ref)), f"{key} {dtype}: dequantized weights differ"
    assert torch.equal(ours["blocks.0.proj.bias"], sd["blocks.0.proj.bias"])
    # the pack's own Linear (Load FP8 Diffusion Model's ops) takes the padded weight at the model's size
    from fp8_engram.nodes.ops import make_fp8_ops

    lin = make_fp8_ops().Linear(70, 50, bias=True)
    missing, unexpected = lin.load_state_dict({"weight": ours["blocks.0.proj.weight"],
                                               "bias": ours["blocks.0.proj.bias"]}, strict=False)
    assert not missing and not unexpected and tuple(lin.weight.shape) == (50, 70)
    x = torch.randn(3, 70, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ref = x.double() @ _dequant_029(c29, theirs["blocks.0.proj.weight"], torch.float32).double().t()
    ref = ref + sd["blocks.0.proj.bias"].double()
    y = lin(x)
    assert y.shape == (3, 50)
    err = float((y.double() - ref).norm() / ref.norm())
    assert err < 0.01, f"weight-only linear on the cut weight: relative error {err:.4f} vs 0.29's weights"


def _029_layer(c29, tensors: dict, layer: str, shape) -> torch.nn.Module:
    """Load one layer of a file the way stock 0.29 loads a model's Linear (its mixed-precision ops)."""
    ops = c29.ops.mixed_precision_ops(compute_dtype=torch.bfloat16)
    lin = ops.Linear(shape[1], shape[0], bias=f"{layer}.bias" in tensors)
    part = {k[len(layer) + 1:]: v for k, v in tensors.items() if k.startswith(layer + ".")}
    lin.load_state_dict(part, strict=False)
    return lin


def test_mxfp8_files_the_pack_saves_load_in_029_bit_exactly(c29, tmp_path):
    """Save FP8 Model's writer on MXFP8 weights (odd and even sizes) beside a per-tensor layer: stock
    0.29 loads every layer in its own classes (MXFP8 and E4M3 layouts, the file's FP8 bytes) and
    dequantizes to exactly the pack's weights (MXFP8 in every dtype; per tensor in float32, where the
    math is the same); the pack reads the file back to the same bytes and scales."""
    from fp8_engram.quant import PerTensor, QuantizedTensor, formats, save
    from fp8_engram.quant.layouts.mxfp8 import MXFP8, at_shape

    sd = _odd_sd()
    state = {k: (QuantizedTensor.from_float(v, MXFP8()) if fp8_files.default_quantize(k, v) else v) for k, v in sd.items()}
    state["blocks.1.tensor.weight"] = QuantizedTensor.from_float(sd["blocks.0.even.weight"], PerTensor())
    path = tmp_path / "pack_mxfp8.safetensors"
    res = save.save_state_dict(state, path)
    assert res.granularities == {"mxfp8": 4, "tensor": 1}
    tensors = load_file(str(path))
    for key, qt in state.items():
        if not isinstance(qt, QuantizedTensor):
            continue
        layer = key[: -len(".weight")]
        lin = _029_layer(c29, tensors, layer, qt.shape)
        w29 = lin.weight
        assert isinstance(w29, c29.qo.QuantizedTensor), f"0.29 did not load {layer} as quantized"
        assert tuple(w29.shape) == tuple(qt.shape)
        mx = isinstance(qt.layout, MXFP8)
        assert lin.quant_format == ("mxfp8" if mx else "float8_e4m3fn")
        out, inp = qt.shape
        assert torch.equal(_bits(w29._qdata[:out, :inp]), _bits(qt.qdata)), f"{key}: 0.29 holds other FP8 bytes"
        for dtype in ((torch.float32, torch.bfloat16, torch.float16) if mx else (torch.float32,)):
            ref = _dequant_029(c29, w29, dtype)
            assert torch.equal(_bits(ref), _bits(qt.dequantize(dtype))), f"{key} {dtype}: 0.29 dequantizes otherwise"
        if "blocks.0.proj.bias" in tensors and layer == "blocks.0.proj":
            assert torch.equal(lin.bias, sd["blocks.0.proj.bias"])
    back, report = formats.load_file(str(path))
    assert report.granularities == {"mxfp8": 4, "tensor": 1}
    for key, qt in state.items():
        if isinstance(qt, QuantizedTensor):
            b = at_shape(back[key], qt.shape)
            assert torch.equal(_bits(b.qdata), _bits(qt.qdata)) and torch.equal(b.scale, qt.scale), key
