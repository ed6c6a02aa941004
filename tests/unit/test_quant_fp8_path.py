"""Choosing and running the fp8 x fp8 path: per call / per weight choice, the two scaled_mm APIs,
falling back (logged once, never raising) when the kernel fails, and CUDA runs where present."""

import importlib
import logging

import pytest
import torch
import torch.nn.functional as F

from fp8_engram.quant import Block, ComputeConfig, PerRow, PerTensor, QuantizedTensor, fp8_supported
from fp8_engram.quant import linear as quant_linear
from fp8_engram.quant.runtime import reset_log_once
from helpers.numerics import sqnr

pytestmark = pytest.mark.unit

lin = importlib.import_module("fp8_engram.quant.compute.linear")
sm = importlib.import_module("fp8_engram.quant.compute.scaled_mm")
fp8_path = importlib.import_module("fp8_engram.quant.compute.paths.fp8")
kernels = importlib.import_module("fp8_engram.quant.kernels")
# these tests count the kernel calls and failures of a trusted path; proving is tested in test_fast_path_choice.py
FP8 = ComputeConfig(path="fp8", trust_fast_paths=True)
HAS_FP8_GPU = torch.cuda.is_available() and fp8_supported(torch.device("cuda"))


def _data(out_f=96, in_f=192, tokens=24, device="cpu"):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(out_f, in_f, generator=g) * 0.02).to(torch.bfloat16).to(device)
    x = torch.randn(tokens, in_f, generator=g).to(torch.bfloat16).to(device)
    return w, x


@pytest.fixture(autouse=True)
def _fresh_failure_memory(monkeypatch):
    """linear.py remembers failed kinds of products for the process: each test starts clean."""
    monkeypatch.setattr(sm, "_needs", {})


@pytest.fixture
def spy(monkeypatch):
    calls = []
    real = sm._scaled_mm
    monkeypatch.setattr(sm, "_scaled_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_auto_on_cpu_is_weight_only(spy):
    w, x = _data()
    qt = QuantizedTensor.from_float(w, PerTensor())
    y = F.linear(x, qt)
    assert not spy
    assert torch.equal(y, F.linear(x, qt.dequantize()))


def test_choice_is_per_call_and_per_weight_not_per_class(spy):
    w, x = _data()
    a = QuantizedTensor.from_float(w, PerTensor(), config=FP8)
    b = QuantizedTensor.from_float(w, PerTensor())
    F.linear(x, a)
    assert len(spy) == 1
    F.linear(x, b)
    assert len(spy) == 1  # b kept the default
    quant_linear(x, b, config=FP8)
    assert len(spy) == 2
    quant_linear(x, a, config=ComputeConfig(path="weight_only"))
    assert len(spy) == 2


@pytest.mark.parametrize("layout", [PerTensor(), PerRow()], ids=str)
def test_failing_kernel_falls_back_logs_once_never_raises(layout, monkeypatch, caplog):
    reset_log_once()
    w, x = _data()
    qt = QuantizedTensor.from_float(w, layout, config=FP8)

    def broken(*a, **k):
        raise RuntimeError("no FP8 kernel for this shape")

    monkeypatch.setattr(sm, "_scaled_mm", broken)
    with caplog.at_level(logging.WARNING):
        y1 = F.linear(x, qt)
        y2 = F.linear(x.unsqueeze(0), qt)
    expected = F.linear(x, qt.dequantize())
    assert torch.equal(y1, expected) and torch.equal(y2[0], expected)
    fails = [r for r in caplog.records if "fp8 failed on" in r.getMessage()]
    assert len(fails) == 1 and "no FP8 kernel" in fails[0].getMessage()
    # with grad enabled the fallback still gives the right values and gradient
    xg = x.clone().requires_grad_(True)
    F.linear(xg, qt).float().sum().backward()
    assert xg.grad is not None and sqnr(qt.dequantize(torch.float64).sum(0).expand(24, -1), xg.grad) > 40


def _cpu_apis():
    """The scaled-matmul APIs present in this torch, each with whether it runs on the CPU."""
    out = {}
    for name in sm._present_apis():
        a = torch.ones(16, 32).to(torch.float8_e4m3fn)
        try:
            sm.SCALED_MM_APIS[name](a, a.t(), torch.ones(()), torch.ones(()), None, torch.bfloat16)
            out[name] = True
        except Exception:
            out[name] = False
    return out


def test_forced_fp8_on_cpu_uses_an_api_with_a_cpu_kernel_or_logs_the_fallback(caplog):
    """torch 2.9-2.14 differ: F.scaled_mm is absent before 2.10 and has no CPU kernel in 2.11,
    torch._scaled_mm has one throughout. The path must find whichever runs, or fall back (logged)."""
    reset_log_once()
    sm._api_for.clear()
    apis = _cpu_apis()
    chosen = sm.scaled_mm_api(torch.device("cpu"))
    working = [name for name, ok in apis.items() if ok]
    assert chosen == (working[0] if working else None)
    w, x = _data()
    qt = QuantizedTensor.from_float(w, PerRow(), config=FP8)
    with caplog.at_level(logging.WARNING):
        y = F.linear(x, qt)
    fails = [r for r in caplog.records if "fp8 failed on" in r.getMessage()]
    if chosen is None:
        assert len(fails) == 1 and torch.equal(y, F.linear(x, qt.dequantize()))
    else:
        assert not fails
        assert sqnr(F.linear(x.double(), w.double()), y) >= 27


def test_every_api_with_a_cpu_kernel_gives_the_same_product():
    apis = {name: ok for name, ok in _cpu_apis().items() if ok}
    if len(apis) < 2:
        pytest.skip(f"torch {torch.__version__} has {len(apis)} scaled-matmul API(s) with a CPU kernel")
    w, x = _data()
    qt = QuantizedTensor.from_float(w, PerRow())
    xq, sa = kernels.quantize_rows(x)
    bias = torch.full((96,), 0.25, dtype=torch.bfloat16)
    outs = [sm.SCALED_MM_APIS[name](xq, qt.qdata.t(), sa, qt.scale.reshape(1, -1), bias,
                                     torch.bfloat16) for name in apis]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_bias_and_output_dtype_go_into_the_scaled_matmul(monkeypatch):
    seen = []
    real = sm._scaled_mm
    monkeypatch.setattr(sm, "_scaled_mm", lambda a, b, sa, sb, bias, out_dtype:
                        seen.append((bias, out_dtype)) or real(a, b, sa, sb, bias, out_dtype))
    w, x = _data()
    bias = (torch.randn(96, generator=torch.Generator().manual_seed(5)) * 0.1).to(torch.bfloat16)
    qt = QuantizedTensor.from_float(w, PerTensor(), config=FP8)
    with torch.inference_mode():
        y = F.linear(x, qt, bias)
    assert len(seen) == 1 and seen[0][0] is not None and seen[0][1] == torch.bfloat16
    assert sqnr(F.linear(x.double(), w.double(), bias.double()), y) >= 27


def test_auto_scaling_is_dynamic_per_row():
    w, x = _data()
    x = x * torch.logspace(-6, 0, x.shape[0])[:, None].to(torch.bfloat16)  # rows over six decades
    qt = QuantizedTensor.from_float(w, PerTensor())
    auto = F.linear(x, qt.with_config(ComputeConfig(path="fp8")))
    row = F.linear(x, qt.with_config(ComputeConfig(path="fp8", activation_scaling="dynamic_row")))
    tensor = F.linear(x, qt.with_config(ComputeConfig(path="fp8", activation_scaling="dynamic_tensor")))
    assert torch.equal(auto, row)
    ref = F.linear(x.double(), w.double())
    assert sqnr(ref, auto) >= sqnr(ref, tensor) - 0.5  # the bar: within 0.5 dB
    # and the small rows, which one per-tensor scale pushes into FP8's subnormals, stay accurate
    assert sqnr(ref[0], auto[0]) >= 25 and sqnr(ref[0], tensor[0]) < 10


def test_static_without_input_scale_is_dynamic_never_one():
    w, x = _data()
    x = x * 1000  # a scale of 1.0 would saturate nearly everything
    qt = QuantizedTensor.from_float(w, PerTensor())
    static = F.linear(x, qt.with_config(ComputeConfig(path="fp8", activation_scaling="static")))
    assert sqnr(F.linear(x.double(), w.double()), static) >= 27


def test_row_weight_scale_is_built_once_and_rebuilt_after_an_in_place_change():
    w, _ = _data()
    qt = QuantizedTensor.from_float(w, PerTensor())
    a = fp8_path.row_weight_scale(qt)
    assert a.shape == (1, 96) and a.is_contiguous()
    assert fp8_path.row_weight_scale(qt) is a  # cached on the weight, not made per call
    qt.requantize_(w.float() * 2)  # writes the scale in place (as a LoRA patch does)
    b = fp8_path.row_weight_scale(qt)
    assert b is not a and torch.equal(b, qt.scale.reshape(1, 1).expand(1, 96))
    row = QuantizedTensor.from_float(w, PerRow())
    assert fp8_path.row_weight_scale(row).data_ptr() == row.scale.data_ptr()  # a view, no copy


def test_row_weight_scale_of_an_inference_tensor_is_cached_and_follows_every_in_place_write():
    """ComfyUI's loaders run under inference_mode, so weights are inference tensors with no version
    counter: the derived [1, N] scale is still built once, and each of the pack's in-place writes
    (copy_ from another weight, requantize_) makes the next call see the new scale."""
    w, _ = _data()
    with torch.inference_mode():
        qt = QuantizedTensor.from_float(w, PerTensor())
        a = fp8_path.row_weight_scale(qt)
        assert fp8_path.row_weight_scale(qt) is a
        other = QuantizedTensor.from_float(w.float() * 3, PerTensor())
        qt.copy_(other)
        b = fp8_path.row_weight_scale(qt)
        assert torch.equal(b, other.scale.reshape(1, 1).expand(1, 96))
        assert not torch.equal(b, a)
        qt.requantize_(w.float() * 5)
        c = fp8_path.row_weight_scale(qt)
        assert torch.equal(c, qt.scale.reshape(1, 1).expand(1, 96)) and not torch.equal(c, b)


def test_empty_input_and_bias():
    w, x = _data()
    qt = QuantizedTensor.from_float(w, PerTensor(), config=FP8)
    assert F.linear(x[:0], qt).shape == (0, 96)
    bias = torch.full((96,), 0.5, dtype=torch.bfloat16)
    ref = F.linear(x.double(), w.double(), bias.double())
    assert sqnr(ref, F.linear(x, qt, bias)) >= 27


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", [PerTensor(), PerRow()], ids=str)
@pytest.mark.parametrize("scaling", ["static", "dynamic_tensor", "dynamic_row"])
def test_cuda_paths_are_accurate(layout, scaling, spy):
    w, x = _data(256, 512, 64, device="cuda")
    qt = QuantizedTensor.from_float(w, layout, input_scale=x.float().abs().amax().cpu() / 448)
    ref = F.linear(x.double(), w.double())
    wo = F.linear(x, qt.with_config(ComputeConfig(path="weight_only")))
    assert not spy and sqnr(ref, wo) >= 30
    auto = F.linear(x, qt.with_config(ComputeConfig(activation_scaling=scaling)))
    assert sqnr(ref, auto) >= 27
    assert bool(spy) == HAS_FP8_GPU  # auto takes the fp8 path exactly where FP8 units exist


@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs a CUDA GPU with FP8 matrix units (capability 8.9+)")
def test_cuda_fp8_kernel_does_not_fall_back(caplog):
    reset_log_once()
    w, x = _data(512, 1024, 128, device="cuda")
    for layout in (PerTensor(), PerRow()):
        qt = QuantizedTensor.from_float(w, layout)
        with caplog.at_level(logging.WARNING):
            for scaling in ("static", "dynamic_tensor", "dynamic_row"):
                F.linear(x, qt.with_config(ComputeConfig(activation_scaling=scaling)))
    assert not [r for r in caplog.records if "failed" in r.getMessage()]


def _failing_api(monkeypatch, refuse):
    """Replace the CPU's scaled-matmul API by one that refuses some calls, as older kernels do."""
    api = sm.scaled_mm_api(torch.device("cpu"))
    if api is None:
        pytest.skip(f"torch {torch.__version__} has no scaled matmul with a CPU kernel")
    real, seen = sm.SCALED_MM_APIS[api], []

    def picky(a, b, sa, sb, bias, out_dtype):
        seen.append((bias is not None, out_dtype))
        if refuse(bias, out_dtype, sa.numel() > 1 or sb.numel() > 1):
            raise RuntimeError("not supported by this kernel")
        return real(a, b, sa, sb, bias, out_dtype)

    monkeypatch.setitem(sm.SCALED_MM_APIS, api, picky)
    monkeypatch.setattr(sm, "_needs", {})
    return seen


def test_a_kernel_without_a_bias_epilogue_gets_the_bias_added_after(monkeypatch, caplog):
    reset_log_once()
    seen = _failing_api(monkeypatch, lambda bias, dt, rowwise: bias is not None)
    w, x = _data()
    bias = torch.full((96,), 0.5, dtype=torch.bfloat16)
    qt = QuantizedTensor.from_float(w, PerTensor(), config=FP8)
    with caplog.at_level(logging.WARNING):
        y1 = F.linear(x, qt, bias)
        y2 = F.linear(x, qt, bias)
    assert not [r for r in caplog.records if "failed" in r.getMessage()]
    assert seen == [(True, torch.bfloat16), (False, torch.bfloat16), (False, torch.bfloat16)]
    assert torch.equal(y1, y2) and sqnr(F.linear(x.double(), w.double(), bias.double()), y1) >= 27


def test_row_wise_kernels_that_write_only_bf16_serve_fp16_through_a_cast(monkeypatch, caplog):
    reset_log_once()
    seen = _failing_api(monkeypatch, lambda bias, dt, rowwise: rowwise and dt != torch.bfloat16)
    w, x = _data()
    qt = QuantizedTensor.from_float(w, PerRow(), config=FP8)
    with caplog.at_level(logging.WARNING):
        y = F.linear(x.half(), qt)
        F.linear(x.half(), qt)
    assert y.dtype == torch.float16
    assert not [r for r in caplog.records if "failed" in r.getMessage()]
    assert seen == [(False, torch.float16), (False, torch.bfloat16), (False, torch.bfloat16)]
    assert sqnr(F.linear(x.double(), w.double()), y) >= 27


def test_group_quantized_activation_times_block_weight_is_accurate():
    """The math of the 128x128 block path (1x128 activation groups, scales multiply), checked in
    float64 here since the CPU has no block-wise scaled matmul."""
    g = torch.Generator().manual_seed(6)
    w = torch.randn(256, 384, generator=g) * torch.logspace(-2, 0, 256)[:, None]
    x = (torch.randn(40, 384, generator=g) * torch.logspace(-3, 1, 384)[None, :]).to(torch.bfloat16)
    qt = QuantizedTensor.from_float(w, Block(128, 128))
    xq, sa = kernels.quantize_groups(x)
    assert sa.shape == (40, 3) and sa.stride() == (1, 40)
    xd = (xq.double().view(40, 3, 128) * sa.double()[:, :, None]).view(40, 384)
    y = xd @ qt.dequantize(torch.float64).t()
    assert sqnr(F.linear(x.double(), w.double()), y) >= 27
