"""Every Triton kernel of ``quant/kernels`` run on the CPU by Triton's interpreter, against its
plain-torch twin (FP8 bytes and scales bit for bit) or float64 (GEMM, as SQNR).

Not collected on its own (the file name does not start with ``test_``): the interpreter must be
switched on before triton is first imported, so ``test_kernels_interpreter.py`` runs this module
in a fresh pytest process with ``TRITON_INTERPRET=1``. Shapes are small and odd on purpose.
"""

import os
import sys

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run this module with TRITON_INTERPRET=1 in a fresh process "
                       "(tests/unit/test_kernels_interpreter.py does)")
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fp8_engram.quant import Block, PerRow, PerTensor, QuantizedTensor  # noqa: E402
from fp8_engram.quant.kernels import act_quant, dequant, weight_only_gemm  # noqa: E402
from fp8_engram.quant.kernels._triton import INTERPRET  # noqa: E402
from helpers.numerics import sqnr  # noqa: E402

pytestmark = pytest.mark.unit
ACT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def test_the_interpreter_is_on():
    assert INTERPRET


def _bytes_equal(a, b) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _activation(m, k, dtype, seed=0, strided=True):
    """Rows spanning five decades, a zero row, a tiny row, and (optionally) a non-contiguous view."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k + 5, generator=g) * torch.logspace(-3, 2, m)[:, None]
    if m > 2:
        x[1] = 0.0
        x[2] *= 1e-30
    x = x.to(dtype)
    return x[:, 3:k + 3] if strided else x[:, :k].contiguous()


@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("dtype", ACT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7, 45), (33, 300), (1, 1), (18, 1000)])
def test_row_quantization_gives_the_twins_bytes_and_scales(shape, dtype, fp8):
    x = _activation(*shape, dtype)
    q, s = act_quant.quantize_rows(x, fp8)
    q_ref, s_ref = act_quant.quantize_rows_torch(x, fp8)
    assert q.shape == shape and s.shape == (shape[0], 1) and s.dtype == torch.float32
    assert _bytes_equal(q, q_ref)
    assert torch.equal(s, s_ref)
    if shape[0] > 2:
        assert s[1].item() == 1.0 and not q[1].view(torch.uint8).any()  # zero row: scale 1, zeros


def test_row_quantization_of_rows_longer_than_registers(monkeypatch):
    monkeypatch.setattr(act_quant, "_ONE_PASS_MAX_K", 256)  # force the two-pass loop
    x = _activation(5, 1100, torch.bfloat16)
    q, s = act_quant.quantize_rows(x)
    q_ref, s_ref = act_quant.quantize_rows_torch(x)
    assert _bytes_equal(q, q_ref) and torch.equal(s, s_ref)
    st = torch.tensor(0.02)
    assert _bytes_equal(act_quant.quantize_tensor(x, st), act_quant.quantize_tensor_torch(x, st))
    assert torch.equal(act_quant.quantize_rows(x, absmax_only=True), act_quant.row_absmax_torch(x))


@pytest.mark.parametrize("dtype", ACT_DTYPES, ids=str)
@pytest.mark.parametrize("scale", [0.0123, 1e-4, 3.0])  # 1e-4 saturates most of x
def test_static_quantization_gives_the_twins_bytes(dtype, scale):
    x = _activation(9, 130, dtype)
    s = torch.tensor(scale)
    assert _bytes_equal(act_quant.quantize_tensor(x, s), act_quant.quantize_tensor_torch(x, s))


@pytest.mark.parametrize("dtype", ACT_DTYPES, ids=str)
def test_dynamic_tensor_scale_is_the_absmax_over_everything(dtype):
    x = _activation(11, 77, dtype)
    amax = act_quant.quantize_rows(x, absmax_only=True)
    assert torch.equal(amax, act_quant.row_absmax_torch(x))
    assert amax.max().item() == x.float().abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(5, 128), (40, 300), (3, 100)])
def test_group_quantization_gives_the_twins_bytes_and_scales(shape, dtype):
    x = _activation(*shape, dtype)
    q, s = act_quant.quantize_groups(x)
    q_ref, s_ref = act_quant.quantize_groups_torch(x)
    ng = -(-shape[1] // 128)
    assert s.shape == (shape[0], ng) and s.stride() == (1, shape[0])  # M-major, as cuBLAS wants
    assert _bytes_equal(q, q_ref) and torch.equal(s, s_ref)


def test_all_256_fp8_codes_round_trip_through_the_kernel_cast():
    """The explicit rounding the interpreter needs is exact on values already on the grid."""
    for fp8 in FP8:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8)
        finite = codes.float().isfinite()
        x = codes.float()[finite].reshape(1, -1)
        q = act_quant.quantize_tensor(x, torch.tensor(1.0), fp8)
        assert _bytes_equal(q, act_quant.quantize_tensor_torch(x, torch.tensor(1.0), fp8))


LAYOUTS = [PerTensor(), PerRow(), Block(32, 64), Block(1, 64), Block(48, 80)]


def _block(layout, k):
    return (layout.rows, layout.cols) if isinstance(layout, Block) else (1, k)


@pytest.mark.parametrize("native", [True, False], ids=["fp8-types", "byte-decoding"])
@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_dequantize_kernel_gives_the_cpu_bits(layout, fp8, native, monkeypatch):
    monkeypatch.setattr(dequant, "native_fp8", lambda device: native)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(100, 200, generator=g) * torch.logspace(-4, 1, 100)[:, None]
    qt = QuantizedTensor.from_float(w, layout, fp8_dtype=fp8)
    per_tensor = isinstance(layout, PerTensor)
    for dtype in ACT_DTYPES:
        cpu = qt.dequantize(dtype)  # the CPU code in layouts.py
        got = dequant.dequantize_triton(qt.qdata, qt.scale, _block(layout, 200), dtype, per_tensor)
        assert torch.equal(got, cpu), (layout, fp8, dtype)


GEMM_CFG = dict(BM=16, BN=32, BK=32, GROUP_M=2, num_warps=4, num_stages=1)


@pytest.mark.parametrize("native", [True, False], ids=["fp8-types", "byte-decoding"])
@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("layout", [PerTensor(), PerRow()], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mnk", [(5, 40, 72), (33, 96, 256)])
def test_weight_only_gemm_is_accurate(mnk, dtype, layout, fp8, native, monkeypatch):
    """Against the float64 product of the same FP8 weight: only accumulation and the output's
    rounding differ (bf16 output ~ 52 dB, fp16 ~ 70 dB)."""
    monkeypatch.setattr(weight_only_gemm, "native_fp8", lambda device: native)
    m, n, k = mnk
    g = torch.Generator().manual_seed(2)
    qt = QuantizedTensor.from_float(torch.randn(n, k, generator=g) * 0.05, layout, fp8_dtype=fp8)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    y = weight_only_gemm.weight_only_linear_triton(x, qt.qdata, qt.scale, bias,
                                                   isinstance(layout, PerTensor), config=GEMM_CFG)
    assert y.shape == (m, n) and y.dtype == dtype
    ref = F.linear(x.double(), qt.dequantize(torch.float64), bias.double())
    assert sqnr(ref, y) >= (48.0 if dtype == torch.bfloat16 else 65.0)
    # and the whole weight-only result (FP8 weight error included) against the float weight
    assert sqnr(F.linear(x.double(), qt.dequantize(torch.float64)), y - bias) >= 40.0


def test_weight_only_gemm_on_a_strided_input_without_bias():
    g = torch.Generator().manual_seed(3)
    qt = QuantizedTensor.from_float(torch.randn(48, 64, generator=g) * 0.05, PerRow())
    x = torch.randn(64, 20, generator=g).to(torch.bfloat16).t()  # [20, 64], column-major
    y = weight_only_gemm.weight_only_linear_triton(x, qt.qdata, qt.scale, None, False,
                                                   config=GEMM_CFG)
    assert sqnr(F.linear(x.double(), qt.dequantize(torch.float64)), y) >= 48.0


@pytest.mark.parametrize("native", [True, False], ids=["fp8-types", "byte-decoding"])
@pytest.mark.parametrize("layout", [Block(128, 128), Block(1, 64), Block(16, 64)], ids=str)
@pytest.mark.parametrize("k", [256, 200])  # 200: a partial last block and a partial K step
def test_weight_only_gemm_with_block_scales_is_accurate(layout, k, native, monkeypatch):
    monkeypatch.setattr(weight_only_gemm, "native_fp8", lambda device: native)
    g = torch.Generator().manual_seed(4)
    w = torch.randn(144, k, generator=g) * torch.logspace(-3, 0, 144)[:, None]
    qt = QuantizedTensor.from_float(w, layout)
    x = torch.randn(9, k, generator=g).to(torch.bfloat16)
    y = weight_only_gemm.weight_only_linear_triton(x, qt.qdata, qt.scale, None, False,
                                                   config=dict(GEMM_CFG, BK=64),
                                                   block=(layout.rows, layout.cols))
    ref = F.linear(x.double(), qt.dequantize(torch.float64))
    assert sqnr(ref, y) >= 48.0


def test_ties_and_near_ties_round_like_torch():
    """Values exactly halfway between neighbouring FP8 codes (ties go to the even code), and just
    either side of halfway, across every binade and the subnormals, both signs."""
    for fp8 in FP8:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).float()
        pos = codes[(codes > 0) & codes.isfinite()].unique().sort().values
        mid = (pos[:-1] + pos[1:]) / 2
        eps = (pos[1:] - pos[:-1]) / 64
        x = torch.cat([mid, mid + eps, mid - eps, pos[:1] / 2, pos[:1] / 3])
        x = torch.cat([x, -x]).reshape(1, -1)
        one = torch.tensor(1.0)
        assert _bytes_equal(act_quant.quantize_tensor(x, one, fp8),
                            act_quant.quantize_tensor_torch(x, one, fp8))


@pytest.mark.parametrize("dtype", ACT_DTYPES, ids=str)
def test_nan_activations_stay_nan_with_the_twins_scales(dtype):
    """A NaN in a row: the kernel's scale is the twin's (NaN absmax -> 1, numerics' rule), the NaN
    element stays NaN (not +-fmax * scale) and every other byte equals the twin's."""
    x = _activation(6, 300, dtype, strided=False)
    x[3, 17] = float("nan")
    x[4, 250] = float("nan")
    for q, s, q_ref, s_ref in [(*act_quant.quantize_rows(x), *act_quant.quantize_rows_torch(x)),
                               (*act_quant.quantize_groups(x), *act_quant.quantize_groups_torch(x))]:
        assert torch.equal(s, s_ref)
        nan = q.float().isnan()
        assert torch.equal(nan, q_ref.float().isnan()) and bool(nan[3, 17]) and bool(nan[4, 250])
        assert torch.equal(q.view(torch.uint8)[~nan], q_ref.view(torch.uint8)[~nan])
    st = torch.tensor(0.05)
    q = act_quant.quantize_tensor(x, st)
    assert bool(q.float()[3, 17].isnan())
    assert torch.equal(q.view(torch.uint8)[~q.float().isnan()],
                       act_quant.quantize_tensor_torch(x, st).view(torch.uint8)[~q.float().isnan()])


def test_scales_follow_the_one_rule_not_a_division():
    """numerics' rule (amax * float32(1/fmax)) differs from amax / fmax in about half of all
    scales; kernel and twin both follow the rule, to the bit."""
    from fp8_engram.quant import numerics

    x = _activation(64, 128, torch.float32, strided=False)
    _, s = act_quant.quantize_rows(x)
    amax = x.abs().amax(dim=1, keepdim=True)
    assert torch.equal(s, numerics.scale_from_amax(amax, 448.0))
    nz = amax[:, 0] > 0
    assert bool((s[nz] != (amax / 448.0)[nz]).any()), "no scale tells the two rules apart"


SMALL_CFG = dict(BM=16, BN=32, BK=32, small=True, num_warps=4, num_stages=1)


@pytest.mark.parametrize("layout", [PerTensor(), PerRow(), Block(32, 64), Block(1, 64)], ids=str)
@pytest.mark.parametrize("mnk", [(1, 40, 256), (5, 72, 200), (16, 64, 96)])
def test_small_m_split_k_gemm_is_accurate(mnk, layout):
    """The transposed split-K kernel for few tokens: K cut into several splits (uneven ones, a
    partial last K step, splits that keep to whole scale blocks), summed by the second kernel."""
    m, n, k = mnk
    g = torch.Generator().manual_seed(5)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 0, n)[:, None]
    qt = QuantizedTensor.from_float(w, layout)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    block = (layout.rows, layout.cols) if isinstance(layout, Block) else None
    split, k_split = weight_only_gemm.split_for(m, n, k, 32, 32, block[1] if block else 1 << 20, 132)
    if k > 96:
        assert split > 1, "the case does not split K"
    if block and block[1] < k:
        assert k_split % block[1] == 0
    y = weight_only_gemm.weight_only_linear_triton(x, qt.qdata, qt.scale, bias,
                                                   isinstance(layout, PerTensor),
                                                   config=SMALL_CFG, block=block)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    ref = F.linear(x.double(), qt.dequantize(torch.float64), bias.double())
    assert sqnr(ref, y) >= 48.0


def test_the_fixed_table_never_times_anything():
    """One config per shape class, chosen by arithmetic: no autotuner object anywhere."""
    assert weight_only_gemm.config_for(1).get("small") and weight_only_gemm.config_for(64).get("small")
    assert not weight_only_gemm.config_for(65).get("small")
    assert weight_only_gemm.config_for(4096, True)["BN"] == 128  # block scales: no 128x256
    assert not hasattr(weight_only_gemm, "_autotuned_kernel")
