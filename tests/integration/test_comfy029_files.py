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
Runs where the ComfyUI in use is 0.29 or newer (CI's second leg); skips elsewhere and says so.
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
