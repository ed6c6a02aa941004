"""The FP8 kernels natively on a CUDA GPU: the same bytes and scales as the torch twins, the same
dequantized bits as the CPU, GEMM accuracy against float64, and every linear path (fp8 with each
activation scaling, block-wise where this torch supports it, weight-only fused and through
cuBLAS) without a fallback. All skip without a GPU; names contain ``cuda`` for ``-k cuda``."""

import importlib
import logging

import pytest
import torch
import torch.nn.functional as F

from fp8_engram.quant import Block, ComputeConfig, PerRow, PerTensor, QuantizedTensor, fp8_supported
from fp8_engram.quant import kernels
from fp8_engram.quant.kernels import act_quant, dequant, weight_only_gemm
from fp8_engram.quant.runtime import reset_log_once
from helpers.numerics import sqnr

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
HAS_FP8_GPU = torch.cuda.is_available() and fp8_supported(torch.device("cuda"))
quant_linear = importlib.import_module("fp8_engram.quant.compute.linear")
sm = importlib.import_module("fp8_engram.quant.compute.scaled_mm")
needs_fp8 = pytest.mark.skipif(not HAS_FP8_GPU,
                               reason="needs a CUDA GPU with FP8 matrix units (capability 8.9+)")
needs_triton = pytest.mark.skipif(not kernels.HAS_TRITON, reason="needs triton on the CUDA machine")


def _bytes_equal(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _x(m, k, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k + 8, generator=g) * torch.logspace(-3, 2, m)[:, None]
    x[1] = 0
    return x.to(dtype).cuda()[:, 8:]  # non-contiguous rows


@needs_fp8
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("k", [45, 3072, 20000])
def test_cuda_activation_kernels_give_the_twins_bytes(k, dtype):
    x = _x(37, k, dtype)
    q, s = act_quant.quantize_rows(x)
    q_ref, s_ref = act_quant.quantize_rows_torch(x)
    assert _bytes_equal(q, q_ref) and torch.equal(s, s_ref)
    st = torch.tensor(0.01, device="cuda")
    assert _bytes_equal(act_quant.quantize_tensor(x, st), act_quant.quantize_tensor_torch(x, st))
    qg, sg = act_quant.quantize_groups(x)
    qg_ref, sg_ref = act_quant.quantize_groups_torch(x)
    assert _bytes_equal(qg, qg_ref) and torch.equal(sg, sg_ref)


@needs_triton
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("layout", [PerTensor(), PerRow(), Block(128, 128), Block(1, 64),
                                    Block(48, 80)], ids=str)
def test_cuda_dequantize_gives_the_cpu_bits(layout, fp8):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 520, generator=g) * torch.logspace(-4, 1, 300)[:, None]
    qt = QuantizedTensor.from_float(w, layout, fp8_dtype=fp8)
    on_gpu = qt.to("cuda")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert torch.equal(on_gpu.dequantize(dtype).cpu(), qt.dequantize(dtype)), dtype
        block = (layout.rows, layout.cols) if isinstance(layout, Block) else (1, 520)
        twin = dequant.dequantize_torch(on_gpu.qdata, on_gpu.scale, block, dtype,
                                        isinstance(layout, PerTensor))
        assert torch.equal(twin.cpu(), qt.dequantize(dtype))


@needs_triton
@pytest.mark.parametrize("layout", [PerTensor(), PerRow(), Block(128, 128), Block(1, 64)], ids=str)
@pytest.mark.parametrize("m", [3, 77, 1500])
def test_cuda_weight_only_gemm_is_accurate(m, layout):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(1024, 768, generator=g) * 0.02
    qt = QuantizedTensor.from_float(w, layout).to("cuda")
    x = torch.randn(m, 768, generator=g).to(torch.bfloat16).cuda()
    b = torch.randn(1024, generator=g).to(torch.bfloat16).cuda()
    ref = F.linear(x.double(), qt.dequantize(torch.float64), b.double())
    per_tensor = isinstance(layout, PerTensor)
    block = (layout.rows, layout.cols) if isinstance(layout, Block) else (1, 768)
    for method in ("fused", "dequant", "auto"):
        y = kernels.weight_only_linear(x, qt.qdata, qt.scale, block, per_tensor, b, method)
        assert sqnr(ref, y) >= 45.0, method
    for cfg in [weight_only_gemm.config_for(m), *weight_only_gemm.CANDIDATES]:
        y = weight_only_gemm.weight_only_linear_triton(
            x, qt.qdata, qt.scale, b, per_tensor, config=cfg,
            block=block if isinstance(layout, Block) else None)
        assert sqnr(ref, y) >= 45.0, cfg


@needs_fp8
@pytest.mark.parametrize("layout", [PerTensor(), PerRow()], ids=str)
@pytest.mark.parametrize("scaling", ["auto", "static", "dynamic_tensor", "dynamic_row"])
def test_cuda_fp8_path_is_accurate_and_does_not_fall_back(layout, scaling, caplog):
    reset_log_once()
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(512, 1024, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(3, 50, 1024, generator=g).to(torch.bfloat16)
    b = (torch.randn(512, generator=g) * 0.1).to(torch.bfloat16)
    qt = QuantizedTensor.from_float(w, layout, input_scale=x.float().abs().amax() / 448,
                                    config=ComputeConfig(activation_scaling=scaling)).to("cuda")
    ref = F.linear(x.double(), w.double(), b.double())
    with caplog.at_level(logging.WARNING):
        for dtype in (torch.bfloat16, torch.float16):
            y = F.linear(x.to(dtype).cuda(), qt, b.to(dtype).cuda())
            assert y.dtype == dtype and y.shape == (3, 50, 512)
            assert sqnr(ref, y.cpu()) >= 27.0
    assert not [r for r in caplog.records if "failed" in r.getMessage()]


@needs_fp8
def test_cuda_block_weights_use_block_scaling_where_torch_has_it(caplog):
    g = torch.Generator().manual_seed(4)
    w = torch.randn(256, 512, generator=g) * torch.logspace(-2, 0, 256)[:, None]
    x = torch.randn(64, 512, generator=g).to(torch.bfloat16)
    ref = F.linear(x.double(), w.double())
    for layout in (Block(128, 128), Block(1, 64)):
        qt = QuantizedTensor.from_float(w, layout).to("cuda")
        with caplog.at_level(logging.WARNING):
            y = F.linear(x.cuda(), qt)
        assert sqnr(ref, y.cpu()) >= 27.0
    from fp8_engram.quant.compute.paths import FP8

    wants = FP8.operand(QuantizedTensor.from_float(w, Block(128, 128)).to("cuda"), ComputeConfig(),
                        torch.device("cuda"), torch.bfloat16) is not None
    assert wants == sm.blockwise_supported(torch.device("cuda"))
    assert not [r for r in caplog.records if "failed" in r.getMessage()]


@needs_fp8
def test_cuda_forced_weight_only_takes_the_kernels(monkeypatch):
    calls = []
    real = kernels.weight_only_linear
    monkeypatch.setattr(kernels, "weight_only_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    w = torch.randn(256, 512) * 0.02
    qt = QuantizedTensor.from_float(w, PerRow(), config=ComputeConfig(path="weight_only")).to("cuda")
    x = torch.randn(4, 512, dtype=torch.bfloat16, device="cuda")
    with torch.inference_mode():
        y = F.linear(x, qt)
    assert calls and sqnr(F.linear(x.double(), w.double().cuda()), y) >= 30


@needs_triton
@pytest.mark.parametrize("layout", [PerTensor(), PerRow(), Block(128, 128)], ids=str)
@pytest.mark.parametrize("m", [1, 7, 16, 33, 64])
def test_cuda_small_m_split_k_gemm_is_accurate(m, layout):
    """The transposed split-K kernel at a Flux modulation shape (3072 -> 9216)."""
    g = torch.Generator().manual_seed(8)
    w = torch.randn(9216, 3072, generator=g) * 0.02
    qt = QuantizedTensor.from_float(w, layout).to("cuda")
    x = torch.randn(m, 3072, generator=g).to(torch.bfloat16).cuda()
    b = torch.randn(9216, generator=g).to(torch.bfloat16).cuda()
    assert weight_only_gemm.config_for(m).get("small")
    block = (128, 128) if isinstance(layout, Block) else (1, 3072)
    y = kernels.weight_only_linear(x, qt.qdata, qt.scale, block, isinstance(layout, PerTensor), b,
                                   "fused")
    ref = F.linear(x.double(), qt.dequantize(torch.float64), b.double())
    assert sqnr(ref, y) >= 45.0


@needs_fp8
@needs_triton
def test_cuda_nan_activations_stay_nan():
    x = _x(9, 3072)
    x[4, 100] = float("nan")
    for q, s in (act_quant.quantize_rows(x), act_quant.quantize_groups(x)):
        assert bool(q[4, 100].float().isnan()) and int(q.float().isnan().sum()) == 1
        q_ref, s_ref = (act_quant.quantize_rows_torch(x) if s.shape[1] == 1
                        else act_quant.quantize_groups_torch(x))
        assert torch.equal(s, s_ref)
        keep = ~q.float().isnan()
        assert torch.equal(q.view(torch.uint8)[keep], q_ref.view(torch.uint8)[keep])


@needs_fp8
def test_cuda_block_weights_at_real_layer_shapes_match_the_dequantized_product(caplog):
    """K = 3840 (30 K-blocks, 30 % 4 = 2) and N = 384 (3 scale rows): where this torch has a
    block-wise matmul, the probe's chosen scale form computes the right numbers at a real layer
    shape; where none is right, the layer runs weight-only."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(384, 3840, generator=g) * torch.logspace(-2, 0, 384)[:, None]
    x = torch.randn(77, 3840, generator=g).to(torch.bfloat16)
    qt = QuantizedTensor.from_float(w, Block(128, 128), config=ComputeConfig(path="fp8")).to("cuda")
    with caplog.at_level(logging.WARNING):
        y = F.linear(x.cuda(), qt)
    form = sm.blockwise_form(torch.device("cuda"))
    # the product of what was quantized: activation groups and weight blocks, in float64
    xq, sa = act_quant.quantize_groups_torch(x.cuda())
    xd = xq.double() * sa.double().repeat_interleave(128, 1)
    ref = xd @ qt.dequantize(torch.float64).t()
    if form is not None:
        assert sqnr(ref, y.double()) >= 40.0, form
    assert sqnr(F.linear(x.double(), w.double()), y.cpu()) >= 27.0
    assert not [r for r in caplog.records if "failed" in r.getMessage()]


@needs_triton
def test_cuda_unaligned_weight_rows_take_dequantize_and_cublas():
    """K % 16 != 0: rows of the FP8 weight are not 16-byte aligned, which costs the fused GEMM its
    vector loads and cp.async (and spills at sm_90): those products go to dequantize + cuBLAS."""
    g = torch.Generator().manual_seed(10)
    for k, fused in ((200, False), (256, True)):
        qt = QuantizedTensor.from_float(torch.randn(512, k, generator=g) * 0.02, PerRow()).to("cuda")
        x = torch.randn(8, k, generator=g).to(torch.bfloat16).cuda()
        assert weight_only_gemm.supported(x, qt.qdata) is fused, k
        y = kernels.weight_only_linear(x, qt.qdata, qt.scale, (1, k), False, None)
        assert sqnr(F.linear(x.double(), qt.dequantize(torch.float64)), y) >= 45.0
