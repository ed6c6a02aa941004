"""A weight that memory first made int8 in place (``drop_fp8_form``) remembers the FP8 form it had, through the
copies torch and ComfyUI make of it, so Save FP8 Model can write it back in that form (``in_fp8_form``)."""

from __future__ import annotations

import pytest
import torch

from fp8_engram.quant import ComputeConfig, PerRow, PerTensor, QuantizedTensor
from fp8_engram.quant.compute import int8 as qint8
from fp8_engram.quant.compute.paths.int8 import carry_fp8_form, drop_fp8_form, dropped_fp8_form, in_fp8_form
from fp8_engram.quant.errors import QuantizationError
from helpers.numerics import sqnr


def _weight(layout, input_scale=None):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=g) * 0.02
    return QuantizedTensor.from_float(w, layout, input_scale=input_scale, config=ComputeConfig(fp8_form="drop"))


@pytest.mark.parametrize("layout", [PerTensor(), PerRow()], ids=["tensor", "row"])
def test_a_dropped_weight_goes_back_to_its_fp8_form(layout):
    w = _weight(layout, input_scale=torch.tensor(0.5) if layout == PerTensor() else None)
    fp8 = w.dequantize(torch.float64)
    had_input_scale = w.input_scale
    assert dropped_fp8_form(w) is None
    assert drop_fp8_form(w, qint8.to_int8(w))
    assert qint8.is_int8(w) and w.input_scale is None
    form = dropped_fp8_form(w)
    assert form.layout == layout and form.dtype == torch.float8_e4m3fn
    back = in_fp8_form(w)
    assert back.layout == layout and back.fp8_dtype == torch.float8_e4m3fn and back.orig_dtype == w.orig_dtype
    assert back.config == w.config and tuple(back.shape) == tuple(w.shape)
    if had_input_scale is None:
        assert back.input_scale is None
    else:
        assert torch.equal(back.input_scale, had_input_scale)
    got = sqnr(fp8, back.dequantize(torch.float64))
    assert 35.0 < got < float("inf"), got  # one more rounding: near the dropped FP8 values, not them


def test_the_form_survives_the_copies_torch_makes_and_a_patch_carries_it():
    w = _weight(PerRow())
    drop_fp8_form(w, qint8.to_int8(w))
    form = dropped_fp8_form(w)
    param = torch.nn.Parameter(w, requires_grad=False)  # a detached copy, as Module.to makes too
    assert param is not w and dropped_fp8_form(param) is form
    for copy in (w.detach(), w.to("cpu", copy=True), w.with_config(ComputeConfig()), w.clone()):
        assert dropped_fp8_form(copy) is form
    fresh = QuantizedTensor.from_float(torch.randn(256, 512), w.layout, fp8_dtype=w.fp8_dtype)
    assert dropped_fp8_form(fresh) is None
    carry_fp8_form(w, fresh)
    assert dropped_fp8_form(fresh) is form


def test_a_weight_that_kept_its_fp8_form_has_none_to_go_back_to():
    w = _weight(PerRow())
    assert not drop_fp8_form(w, w)  # not an int8 weight: nothing dropped
    with pytest.raises(QuantizationError, match="never dropped"):
        in_fp8_form(w)
