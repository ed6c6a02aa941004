"""Per-tensor FP8 dequantization of the pack against the ComfyUI in use, through that ComfyUI's own API.

Runs in process with the tree that scripts/comfyhost.py picks (0.3.75 by default, 0.29 and 0.33 in CI's
second and third legs), so it lives with the integration tests and holds on all of them (0.33 follows
0.29's rule; NVFP4's agreement is tests/integration/test_nvfp4_comfy.py):

- ComfyUI 0.3.75: `TensorCoreFP8Layout.dequantize(qdata, scale, dtype)` converts the FP8 data to the
  output dtype and multiplies by the float32 scale, rounding once. The pack does the same: the bits
  must be equal, for every output dtype and both FP8 dtypes.
- ComfyUI 0.29 and newer (comfy-kitchen layouts, `dequantize(qdata, params)` with a `Params(scale, orig_dtype,
  orig_shape)`): the scale is first rounded to the output dtype, then multiplied
  (`q.to(dtype) * scale.to(dtype)`). The test checks that 0.29 really follows that rule (bit for bit),
  that for float32 output the pack equals it, and that for bf16/fp16 the pack (one rounding of the
  float32 product) is at least as close as 0.29 to the float32 product `q * scale` on every element.
  Mostly they differ by one unit in the last place; for e5m2 into fp16 the scale (absmax / 57344) is an
  fp16 subnormal, and rounding it first costs 0.29 several units.
Both directions: the pack's quantized data dequantized by ComfyUI, and ComfyUI's quantizer's data
dequantized by the pack.
"""

from __future__ import annotations

import pytest
import torch

from helpers.host import comfy_in_process

pytestmark = pytest.mark.integration

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
OUT = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(scope="module")
def quant_ops():
    comfy_in_process()
    import comfy.quant_ops

    return comfy.quant_ops


def _kitchen_era(quant_ops) -> bool:
    return hasattr(quant_ops.TensorCoreFP8Layout, "Params")


def _layout_for(quant_ops, fp8):
    if _kitchen_era(quant_ops):
        return quant_ops.TensorCoreFP8E4M3Layout if fp8 == torch.float8_e4m3fn else quant_ops.TensorCoreFP8E5M2Layout
    return quant_ops.TensorCoreFP8Layout


def comfy_dequantize(quant_ops, qdata: torch.Tensor, scale: torch.Tensor, out: torch.dtype) -> torch.Tensor:
    """ComfyUI's own per-tensor dequantization, whichever API this tree has."""
    layout = _layout_for(quant_ops, qdata.dtype)
    if _kitchen_era(quant_ops):
        params = layout.Params(scale=scale, orig_dtype=out, orig_shape=tuple(qdata.shape))
        return layout.dequantize(qdata, params)
    return layout.dequantize(qdata, scale, out)


def comfy_quantize(quant_ops, w: torch.Tensor, fp8) -> tuple[torch.Tensor, torch.Tensor]:
    """ComfyUI's own per-tensor quantizer (absmax scale): (fp8 data, float32 scale)."""
    layout = _layout_for(quant_ops, fp8)
    if _kitchen_era(quant_ops):
        qdata, params = layout.quantize(w, scale="recalculate")
        return qdata, params.scale
    qdata, params = layout.quantize(w, dtype=fp8)
    return qdata, params["scale"]


def _weight(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 0.02).to(dtype)


def _check(quant_ops, qdata, scale, out, ours):
    theirs = comfy_dequantize(quant_ops, qdata, scale, out)
    assert ours.dtype == theirs.dtype == out and ours.shape == theirs.shape
    if not _kitchen_era(quant_ops) or out == torch.float32:
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8)), "dequantization differs from ComfyUI's"
        return 0.0
    # The rule 0.29 follows, checked bit for bit so the comparison below compares what it claims to.
    rule = qdata.to(out) * scale.to(out)
    assert torch.equal(theirs.view(torch.uint8), rule.view(torch.uint8)), "ComfyUI 0.29 no longer rounds the scale first"
    product = qdata.to(torch.float32) * scale.to(torch.float32)
    err_ours = (ours.float() - product).abs()
    err_theirs = (theirs.float() - product).abs()
    worse = err_ours > err_theirs
    assert not bool(worse.any()), f"{int(worse.sum())} elements further from q * scale than ComfyUI's"
    return float((ours != theirs).float().mean())


@pytest.mark.parametrize("out", OUT, ids=str)
@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("shape", [(96, 192), (1024, 1024)], ids=["small", "table-path"])
def test_per_tensor_dequantize_agrees_with_comfyui(quant_ops, fp8, out, shape):
    from fp8_engram.quant import PerTensor, QuantizedTensor

    w = _weight(shape, out)
    qt = QuantizedTensor.from_float(w, PerTensor(), fp8_dtype=fp8)
    differ = _check(quant_ops, qt.qdata, qt.scale, out, qt.dequantize())
    # and ComfyUI's own quantizer's data dequantizes the same way through the pack's tensor
    cq, cscale = comfy_quantize(quant_ops, w, fp8)
    assert cq.dtype == fp8
    ours2 = QuantizedTensor.from_parts(cq, cscale.float(), PerTensor(), orig_dtype=out).dequantize()
    differ2 = _check(quant_ops, cq, cscale.float(), out, ours2)
    print(f"{fp8} -> {out} {shape}: elements differing from ComfyUI {differ:.1%} / {differ2:.1%}")
