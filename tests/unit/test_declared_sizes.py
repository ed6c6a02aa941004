"""Sizes a file declares are checked against the tensors they sit beside, before anything is built
(issue 27, findings 3, 7 and the NVFP4 half of 9; the ConvRot groups of finding 2 are
test_convrot_group_limits.py):

- NVFP4 and MXFP8 block scales must have the 2-D tiled shape ComfyUI stores (an element count that
  merely matches is a transposed or reshaped grid, read as the scales of other blocks), and a
  ``group_size`` / ``block_size`` in a layer's JSON must be the format's own (16, 32);
- an NVFP4 tensor scale whose product with the largest block scale and e2m1 value overflows the
  compute dtype is refused (every output would be NaN);
- a stray NVFP4 tensor scale is refused with a message that says what the pack does read.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from fp8_engram.quant import ComputeConfig, NVFP4, QuantizedTensor
from fp8_engram.quant.layouts import mxfp8, nvfp4
from fp8_engram.quant.formats import FormatError, load_file

pytestmark = pytest.mark.unit


def cq(conf) -> torch.Tensor:
    return torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)


def _raises_named(path, *parts, **load_kwargs) -> str:
    with pytest.raises(FormatError) as info:
        load_file(path, **load_kwargs)
    msg = str(info.value)
    assert str(path) in msg
    for part in parts:
        assert part in msg, msg
    return msg


# ---------------------------------------------------------------------------------------------
# finding 3: tiled block scale shapes, declared group sizes
# ---------------------------------------------------------------------------------------------

def _nvfp4_tensors(shape=(128, 128), conf=None) -> dict:
    g = torch.Generator().manual_seed(0)
    qt = QuantizedTensor.from_float(torch.randn(*shape, generator=g) * 0.02, NVFP4.for_shape(shape))
    parts = nvfp4.file_tensors(qt)
    return {"l.weight": parts["weight"], "l.weight_scale": parts["weight_scale"],
            "l.weight_scale_2": parts["weight_scale_2"], "l.comfy_quant": cq(conf or {"format": "nvfp4"})}


def _mxfp8_tensors(shape=(128, 256), conf=None) -> dict:
    g = torch.Generator().manual_seed(1)
    q, s = mxfp8.MXFP8().quantize(torch.randn(*shape, generator=g) * 0.02, torch.float8_e4m3fn, None)
    qdata, scale = mxfp8.file_tensors(q, s)
    return {"l.weight": qdata, "l.weight_scale": scale, "l.comfy_quant": cq(conf or {"format": "mxfp8"})}


def _save(tmp_path, name, tensors, metadata=None):
    path = tmp_path / f"{name}.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


RESHAPES = {
    "transposed": lambda s: s.t(),  # [8, 128] for [128, 8]: stored [K/16, N] instead of [N, K/16]
    "other_2d": lambda s: s.reshape(64, 16),
    "flat": lambda s: s.reshape(-1),
}


@pytest.mark.parametrize("how", list(RESHAPES))
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_block_scales_of_the_right_count_but_not_the_tiled_shape_are_refused(tmp_path, fmt, how):
    tensors = _nvfp4_tensors() if fmt == "nvfp4" else _mxfp8_tensors()
    assert tuple(tensors["l.weight_scale"].shape) == (128, 8)  # 128 rows, 8 blocks of 16 (nvfp4) or 32 (mxfp8)
    good = _save(tmp_path, "good", tensors)
    reference = load_file(good)[0]["l.weight"].dequantize(torch.float32)
    tensors["l.weight_scale"] = RESHAPES[how](tensors["l.weight_scale"])
    path = _save(tmp_path, how, tensors)
    _raises_named(path, "'l.weight_scale'", "[128, 8]", str(list(tensors["l.weight_scale"].shape)))
    assert torch.isfinite(reference).all()


@pytest.mark.parametrize("conf,field", [
    ({"format": "nvfp4", "group_size": 32}, "group_size"),
    ({"format": "nvfp4", "group_size": 8}, "group_size"),
    ({"format": "nvfp4", "params": {"group_size": 64}}, "group_size"),
    ({"format": "nvfp4", "block_size": [1, 32]}, "block_size"),
])
def test_nvfp4_group_size_other_than_16_is_refused(tmp_path, conf, field):
    path = _save(tmp_path, "nv_group", _nvfp4_tensors(conf=conf))
    _raises_named(path, "'l.comfy_quant'", field, "16")
    ok = _save(tmp_path, "nv_16", _nvfp4_tensors(conf={"format": "nvfp4", "group_size": 16}))
    assert nvfp4.is_nvfp4(load_file(ok)[0]["l.weight"])


def test_nvfp4_group_size_in_quantization_metadata_is_checked(tmp_path):
    tensors = _nvfp4_tensors()
    del tensors["l.comfy_quant"]
    meta = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": {
        "l": {"format": "nvfp4", "group_size": 32}}})}
    path = _save(tmp_path, "nv_meta", tensors, meta)
    _raises_named(path, "_quantization_metadata.layers.l", "group_size 32")


@pytest.mark.parametrize("conf,field", [
    ({"format": "mxfp8", "group_size": 16}, "group_size"),
    ({"format": "mxfp8", "block_size": [1, 16]}, "block_size"),
    ({"format": "mxfp8", "block_size": [32, 32]}, "block_size"),
])
def test_mxfp8_block_size_other_than_32_is_refused(tmp_path, conf, field):
    path = _save(tmp_path, "mx_group", _mxfp8_tensors(conf=conf))
    _raises_named(path, "'l.comfy_quant'", field, "32")
    ok = _save(tmp_path, "mx_32", _mxfp8_tensors(conf={"format": "mxfp8", "group_size": 32, "block_size": [1, 32]}))
    assert mxfp8.is_mxfp8(load_file(ok)[0]["l.weight"])


# ---------------------------------------------------------------------------------------------
# finding 7: NVFP4 tensor scale overflow
# ---------------------------------------------------------------------------------------------

def test_nvfp4_tensor_scale_that_overflows_is_refused(tmp_path):
    tensors = _nvfp4_tensors()
    ts = float(tensors["l.weight_scale_2"])
    block_max = float(tensors["l.weight_scale"].float().max())
    # what the file would give without the check: inf weights, so NaN after any normalisation
    tensors["l.weight_scale_2"] = torch.tensor(3e38)
    w = nvfp4.dequantize_padded(tensors["l.weight"], nvfp4.unswizzle(tensors["l.weight_scale"].view(torch.uint8),
                                128, 8).view(torch.float8_e4m3fn), tensors["l.weight_scale_2"], torch.float32)
    assert not bool(torch.isfinite(w).all())
    path = _save(tmp_path, "huge", tensors)
    _raises_named(path, "'l.weight_scale_2'", "3e+38", "inf", "NaN")
    # the range is the compute dtype's: a scale float32 holds but float16 does not is refused for float16 only
    big = 2 * 65504 / (block_max * 6)  # twice float16's largest value at the largest block
    assert big > 100 * ts
    tensors["l.weight_scale_2"] = torch.tensor(big)
    path = _save(tmp_path, "fp16", tensors)
    assert nvfp4.is_nvfp4(load_file(path)[0]["l.weight"])
    _raises_named(path, "'l.weight_scale_2'", "float16", config=ComputeConfig(compute_dtype=torch.float16))


# ---------------------------------------------------------------------------------------------
# finding 9 (half): the message for an NVFP4 key outside ComfyUI's form
# ---------------------------------------------------------------------------------------------

def test_stray_nvfp4_scale_says_what_the_pack_reads(tmp_path):
    # an unmarked layer in ComfyUI's form loads by its tensors (test_unmarked_nvfp4_mxfp8.py); one whose block
    # scales are not e4m3 is not that form, and is refused saying so
    tensors = _nvfp4_tensors()
    del tensors["l.comfy_quant"]
    tensors["l.weight_scale"] = tensors["l.weight_scale"].float()
    path = _save(tmp_path, "unmarked", tensors)
    msg = _raises_named(path, "'l.weight_scale_2'", "'l.comfy_quant'", '{"format": "nvfp4"}', "ComfyUI's form",
                        "not 2-D float8_e4m3fn")
    assert "int4/nvfp4" not in msg  # the old text said the pack does not read NVFP4, which it does
    gptq = _save(tmp_path, "gptq", {"l.qweight": torch.zeros(4, 4, dtype=torch.int32), "l.weight": torch.zeros(4, 4)})
    _raises_named(gptq, "'l.qweight'", "GPTQ")
