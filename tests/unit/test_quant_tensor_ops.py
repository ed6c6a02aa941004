"""Generic tensor behaviour of QuantizedTensor: metadata, copies, device moves, views, transposes,
serialization (safetensors state dict, torch.save / weights_only load), module integration and the
logged dequantize fallback."""

import copy
import io
import logging

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from fp8_engram.quant import Block, ComputeConfig, PerRow, PerTensor, QuantizedTensor
from fp8_engram.quant.runtime import reset_log_once

pytestmark = pytest.mark.unit

LAYOUTS = [PerTensor(), PerRow(), Block(32, 64), Block(1, 64)]
FALLBACK = "no quantized kernel"


def _qt(layout=PerRow(), fp8=torch.float8_e4m3fn, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(96, 192, generator=g) * 0.02).to(torch.bfloat16)
    return QuantizedTensor.from_float(w, layout, fp8_dtype=fp8, **kw)


def _same(a: QuantizedTensor, b: QuantizedTensor) -> bool:
    return (torch.equal(a.qdata.view(torch.uint8), b.qdata.view(torch.uint8))
            and torch.equal(a.scale, b.scale) and a.layout == b.layout
            and a.orig_dtype == b.orig_dtype and a.transposed == b.transposed)


def _fallback_logs(caplog):
    return [r for r in caplog.records if FALLBACK in r.getMessage()]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_reports_logical_dtype_shape_and_flatten_round_trip(layout):
    qt = _qt(layout, input_scale=torch.tensor(0.01), config=ComputeConfig(path="weight_only"))
    assert isinstance(qt, torch.Tensor)
    assert qt.dtype == torch.bfloat16 and qt.shape == (96, 192) and qt.fp8_dtype == torch.float8_e4m3fn
    assert qt.is_floating_point() and not qt.requires_grad
    names, ctx = qt.__tensor_flatten__()
    assert names == ["qdata", "scale", "input_scale"]
    back = QuantizedTensor.__tensor_unflatten__({n: getattr(qt, n) for n in names}, ctx,
                                                qt.shape, qt.stride())
    assert _same(back, qt) and back.config == qt.config and torch.equal(back.input_scale, qt.input_scale)


def test_detach_shares_clone_copies():
    qt = _qt()
    d, c = qt.detach(), qt.clone()
    assert isinstance(d, QuantizedTensor) and isinstance(c, QuantizedTensor)
    assert d.qdata.data_ptr() == qt.qdata.data_ptr()
    assert c.qdata.data_ptr() != qt.qdata.data_ptr() and c.scale.data_ptr() != qt.scale.data_ptr()
    assert _same(d, qt) and _same(c, qt)
    deep = copy.deepcopy(qt)
    assert _same(deep, qt) and deep.qdata.data_ptr() != qt.qdata.data_ptr()


@pytest.mark.parametrize("target", ["cpu", "meta"])
def test_device_move_keeps_fp8(target):
    qt = _qt(PerTensor(), input_scale=torch.tensor(0.5))
    moved = qt.to(target, copy=True) if target == "cpu" else qt.to(target)
    assert isinstance(moved, QuantizedTensor)
    assert moved.qdata.dtype == torch.float8_e4m3fn and moved.dtype == torch.bfloat16
    assert moved.device.type == target and moved.scale.device.type == target
    assert moved.input_scale.device.type == target
    if target == "cpu":
        assert moved.qdata.data_ptr() != qt.qdata.data_ptr() and _same(moved, qt)
    assert qt.to("cpu") is qt  # no-op move returns the same tensor, as for plain tensors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_cuda_round_trip_keeps_fp8(layout):
    qt = _qt(layout)
    on_gpu = qt.to("cuda")
    assert isinstance(on_gpu, QuantizedTensor) and on_gpu.qdata.is_cuda and on_gpu.scale.is_cuda
    assert on_gpu.qdata.dtype == torch.float8_e4m3fn
    assert _same(on_gpu.cpu(), qt)
    # bit for bit on both devices (CUDA dequantizes in kernels.dequant, which rounds as the CPU)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert torch.equal(on_gpu.dequantize(dtype).cpu(), qt.dequantize(dtype)), dtype


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS + [Block(48, 80)], ids=str)
def test_off_cpu_dequantization_rounds_like_the_cpu(layout, fp8):
    """The rule off the CPU (float32 product rounded once; per-row/block scales rounded to bf16
    first for bf16 output, as the CPU's bf16 x bf16 multiply does) gives the CPU's bits. Checked
    here with the torch twin on CPU tensors; the CUDA test above checks the device itself."""
    from fp8_engram.quant.kernels import dequant

    qt = _qt(layout, fp8)
    block = (layout.rows, layout.cols) if isinstance(layout, Block) else (1, 192)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        twin = dequant.dequantize_torch(qt.qdata, qt.scale, block, dtype, isinstance(layout, PerTensor))
        assert torch.equal(twin, qt.dequantize(dtype)), dtype


def test_to_float_dtype_returns_the_dequantized_tensor():
    qt = _qt(PerRow())
    for dtype in (torch.float16, torch.float32):
        out = qt.to(dtype)
        assert type(out) is torch.Tensor and out.dtype == dtype
        assert torch.equal(out, qt.dequantize(dtype))
    assert qt.to(torch.bfloat16) is qt  # its own dtype: nothing to do
    meta = qt.to("meta", torch.float32)
    assert type(meta) is torch.Tensor and meta.device.type == "meta" and meta.dtype == torch.float32


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_copy_between_quantized_and_plain(layout):
    src, dst = _qt(layout, seed=1), _qt(layout, seed=2)
    dst.copy_(src)
    assert _same(dst, src) and dst.qdata.data_ptr() != src.qdata.data_ptr()
    # plain -> quantized requantizes into the destination's layout and fp8 dtype
    plain = torch.randn(96, 192, dtype=torch.bfloat16) * 0.5
    dst.copy_(plain)
    assert dst.fp8_dtype == torch.float8_e4m3fn and dst.layout == layout
    assert torch.equal(dst.dequantize(), QuantizedTensor.from_float(plain, layout).dequantize())
    # quantized -> plain dequantizes
    out = torch.empty(96, 192, dtype=torch.float32)
    out.copy_(src)
    assert torch.equal(out, src.dequantize(torch.float32))
    # other layout -> requantized too
    other = _qt(PerTensor(), seed=3)
    dst.copy_(other)
    again = QuantizedTensor.from_float(other.dequantize(torch.float32), layout)
    assert torch.equal(dst.dequantize(torch.float32), again.dequantize(torch.float32))


def test_empty_like_is_a_valid_quantized_tensor():
    qt = _qt(Block(32, 64))
    e = torch.empty_like(qt)
    assert isinstance(e, QuantizedTensor) and e.shape == qt.shape and e.layout == qt.layout
    assert e.qdata.dtype == qt.qdata.dtype and bool((e.scale > 0).all())
    plain = torch.empty_like(qt, dtype=torch.float32)
    assert type(plain) is torch.Tensor and plain.dtype == torch.float32


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_transpose_and_views(layout, caplog):
    reset_log_once()
    qt = _qt(layout)
    for t in (qt.t(), qt.T, qt.transpose(0, 1), qt.mT, qt.permute(1, 0)):
        assert isinstance(t, QuantizedTensor) and t.shape == (192, 96) and t.transposed
        assert t.qdata.data_ptr() == qt.qdata.data_ptr()  # no data moved
        assert torch.equal(t.dequantize(), qt.dequantize().t())
    assert not qt.t().t().transposed
    assert isinstance(qt.view(96, 192), QuantizedTensor) and isinstance(qt.reshape(96, -1), QuantizedTensor)
    assert qt.contiguous() is qt or _same(qt.contiguous(), qt)
    if isinstance(layout, PerTensor):  # one scale: any view keeps its meaning
        v = qt.view(192, 96)
        assert isinstance(v, QuantizedTensor) and torch.equal(v.dequantize(), qt.dequantize().view(192, 96))
        assert not _fallback_logs(caplog)
    else:  # other layouts: the view runs on the dequantized tensor (and says so once)
        v = qt.reshape(192, 96)
        assert torch.equal(v, qt.dequantize().reshape(192, 96))
        assert len(_fallback_logs(caplog)) == 1


def test_fallback_really_computes_and_logs_once(caplog):
    reset_log_once()
    qt = _qt(PerRow())
    ref = qt.dequantize()
    with caplog.at_level(logging.WARNING, logger="fp8_engram.quant.tensor"):
        s1 = torch.sum(qt)
        s2 = qt.sum()
        added = qt + 1.0
        added2 = torch.add(qt, 2.0)
    assert torch.equal(s1, ref.sum()) and torch.equal(s2, ref.sum())
    assert torch.equal(added, ref + 1.0) and torch.equal(added2, ref + 2.0)
    msgs = [r.getMessage() for r in _fallback_logs(caplog)]
    assert len([m for m in msgs if "aten.sum" in m]) == 1
    assert len([m for m in msgs if "aten.add" in m]) == 1
    assert len(msgs) == 2


def test_in_place_fallback_writes_back_requantized(caplog):
    reset_log_once()
    qt = _qt(PerRow())
    before = qt.dequantize()
    with caplog.at_level(logging.WARNING):
        out = qt.mul_(2.0)
    assert out is qt and isinstance(qt, QuantizedTensor)
    assert torch.equal(qt.dequantize(), QuantizedTensor.from_float(before * 2, PerRow()).dequantize())
    assert len(_fallback_logs(caplog)) == 1


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_state_dict_round_trip_through_safetensors(layout, fp8, tmp_path):
    qt = _qt(layout, fp8, input_scale=torch.tensor(0.02))
    path = tmp_path / "w.safetensors"
    save_file({"l.weight": qt.qdata, "l.weight_scale": qt.scale, "l.input_scale": qt.input_scale},
              str(path))
    sd = load_file(str(path))
    assert sd["l.weight"].dtype == fp8
    back = QuantizedTensor.from_parts(sd["l.weight"], sd["l.weight_scale"], layout,
                                      orig_dtype=torch.bfloat16, input_scale=sd["l.input_scale"])
    assert _same(back, qt) and torch.equal(back.input_scale, qt.input_scale)
    assert torch.equal(back.dequantize(), qt.dequantize())


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_torch_save_and_weights_only_load(layout):
    qt = _qt(layout, config=ComputeConfig(path="fp8", activation_scaling="dynamic_row",
                                          compute_dtype=torch.bfloat16)).t()
    buf = io.BytesIO()
    torch.save({"w": qt, "plain": torch.ones(2)}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    w = loaded["w"]
    assert isinstance(w, QuantizedTensor) and _same(w, qt) and w.config == qt.config
    assert w.shape == (192, 96)


def test_works_as_a_module_parameter_and_moves_with_the_module():
    lin = torch.nn.Linear(192, 96, dtype=torch.bfloat16)
    qt = QuantizedTensor.from_float(lin.weight.detach(), PerRow())
    lin.weight = torch.nn.Parameter(qt, requires_grad=False)
    assert isinstance(lin.weight, QuantizedTensor) and isinstance(lin.weight, torch.nn.Parameter)
    x = torch.randn(2, 3, 192, dtype=torch.bfloat16)
    ref = F.linear(x.double(), qt.dequantize(torch.float64), lin.bias.double())
    y = lin(x)
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2
    sd = lin.state_dict()
    assert isinstance(sd["weight"], QuantizedTensor)
    lin.to("meta")
    assert isinstance(lin.weight, QuantizedTensor) and lin.weight.qdata.device.type == "meta"
    assert lin.weight.qdata.dtype == torch.float8_e4m3fn


def test_with_config_shares_storage():
    qt = _qt()
    other = qt.with_config(ComputeConfig(path="weight_only"))
    assert other.qdata.data_ptr() == qt.qdata.data_ptr() and other.config.path == "weight_only"
    assert qt.config is None


def test_storage_questions_describe_the_fp8_data():
    qt = _qt(PerRow())
    assert qt.element_size() == 1 and qt.nelement() * qt.element_size() == qt.qdata.nbytes
    assert qt.data_ptr() == qt.qdata.data_ptr() and qt.data_ptr() != 0
    assert qt.is_contiguous() and not qt.is_pinned()


def test_convolution_weights_dequantize_into_the_input_dtype(caplog):
    reset_log_once()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 4, 3, 3, generator=g) * 0.1
    qt = QuantizedTensor.from_float(w.to(torch.bfloat16), PerTensor())  # 4-D: per-tensor only
    x = torch.randn(2, 4, 10, 10, generator=g, dtype=torch.float32)
    ref = F.conv2d(x, qt.dequantize(torch.float32), padding=1)
    assert torch.equal(F.conv2d(x, qt, padding=1), ref)
    with torch._C.DisableTorchFunctionSubclass():  # the aten level
        assert torch.equal(F.conv2d(x, qt, padding=1), ref)
    assert not _fallback_logs(caplog)


def test_to_overloads_under_inference_mode_keep_fp8_or_dequantize(caplog):
    # Under inference_mode Tensor.to reaches dispatch as aten.to.* itself (ComfyUI moves modules and
    # backs weights up there): QuantizedTensor must answer these overloads, not the fallback.
    reset_log_once()
    qt = _qt(PerRow(), input_scale=torch.tensor(0.25))
    other_half = torch.zeros(3, dtype=torch.float16)
    with caplog.at_level(logging.WARNING), torch.inference_mode():
        assert qt.to("cpu") is qt and qt.to(torch.bfloat16) is qt and qt.to(qt) is qt  # nothing changes
        moved = qt.to("cpu", copy=True)                                   # to.device
        meta = qt.to(device="meta")                                       # to.dtype_layout
        meta_same_dtype = qt.to("meta", torch.bfloat16)                   # to.device with its dtype
        as_half = qt.to(torch.float16)                                    # to.dtype
        like_other = qt.to(other_half)                                    # to.other
        like_qt_on_meta = qt.to(meta)                                     # to.other, quantized other
    for t in (moved, meta, meta_same_dtype, like_qt_on_meta):
        assert isinstance(t, QuantizedTensor) and t.qdata.dtype == torch.float8_e4m3fn
        assert t.dtype == torch.bfloat16 and t.scale.device == t.device and t.input_scale.device == t.device
    assert moved.qdata.data_ptr() != qt.qdata.data_ptr() and _same(moved, qt)
    assert meta.device.type == "meta" and meta_same_dtype.device.type == "meta"
    assert like_qt_on_meta.device.type == "meta"
    for t in (as_half, like_other):
        assert not isinstance(t, QuantizedTensor) and t.dtype == torch.float16
        assert torch.equal(t, qt.dequantize(torch.float16))
    assert not _fallback_logs(caplog)


def test_to_float32_under_inference_mode_moves_and_dequantizes():
    qt = _qt(Block(32, 64))
    with torch.inference_mode():
        out = qt.to(device="cpu", dtype=torch.float32, copy=True)
    assert type(out) is torch.Tensor and out.dtype == torch.float32
    assert torch.equal(out, qt.dequantize(torch.float32))
