"""The INT8 path's Triton kernels (``quant/kernels/int8_mm.py``) run on the CPU by Triton's
interpreter, against their torch twins. Not collected on its own: ``test_int8_kernels_interpreter.py``
runs it in a fresh process with ``TRITON_INTERPRET=1`` (which must be set before triton imports).
Shapes are small and odd on purpose (masked tails in M, N and K)."""

import os
import sys

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run this module with TRITON_INTERPRET=1 in a fresh process")
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from fp8_engram.quant.kernels import int8_mm  # noqa: E402
from fp8_engram.quant.kernels._triton import INTERPRET  # noqa: E402

pytestmark = pytest.mark.unit


def test_the_interpreter_is_on():
    assert INTERPRET


def _activation(m, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 2
    x[:, 1::37] *= 60  # outlier channels
    x[min(1, m - 1)] = 0  # a zero row takes scale 1
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k", [(1, 128), (19, 200), (33, 384)])
def test_row_quantization_without_rotation_gives_the_twins_bytes(dtype, m, k):
    x = _activation(m, k, dtype)
    q, s = int8_mm._quantize_rows_triton(x, 0, False)
    qt, st = int8_mm.quantize_rows_int8_torch(x, 0, False)
    assert torch.equal(s, st)
    assert torch.equal(q, qt)


@pytest.mark.parametrize("rotation,regular", [(128, False), (64, False), (64, True), (16, True)])
def test_row_quantization_with_rotation_matches_the_twin(rotation, regular):
    x = _activation(21, rotation * 3, torch.float32, seed=1)
    q, s = int8_mm._quantize_rows_triton(x, rotation, regular)
    qt, st = int8_mm.quantize_rows_int8_torch(x, rotation, regular)
    assert torch.allclose(s, st, rtol=1e-6, atol=0)
    # float32 dot products in another order: a value on a rounding tie may move by one step
    assert int((q.int() - qt.int()).abs().max()) <= 1
    assert float((q != qt).float().mean()) < 1e-3


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k,per_row,bias", [(5, 40, 72, True, True), (37, 33, 130, False, True),
                                                (16, 64, 64, True, False)])
def test_gemm_epilogue_matches_the_twin(out_dtype, m, n, k, per_row, bias):
    g = torch.Generator().manual_seed(2)
    xq = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    wq = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    sa = torch.rand(m, 1, generator=g) + 0.01
    sb = torch.rand(n, 1, generator=g) + 0.01 if per_row else torch.tensor(0.37)
    b = torch.randn(n, generator=g).to(out_dtype) if bias else None
    y = int8_mm._int8_linear_triton(xq, sa, wq, sb, b, out_dtype)
    ref = int8_mm.int8_linear_mm_torch(xq, sa, wq, sb, b, out_dtype)
    assert y.dtype == out_dtype and y.shape == (m, n)
    # the int32 sums are exact in both; the float epilogue multiplies in another order (1 ulp)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[out_dtype]
    assert torch.allclose(y.float(), ref.float(), rtol=tol, atol=tol)


def test_gemm_reads_a_strided_activation():
    g = torch.Generator().manual_seed(3)
    big = torch.randint(-128, 128, (9, 2 * 96), generator=g, dtype=torch.int8)
    xq = big[:, ::2]  # non-contiguous rows
    wq = torch.randint(-128, 128, (24, 96), generator=g, dtype=torch.int8)
    sa, sb = torch.rand(9, 1, generator=g), torch.rand(24, 1, generator=g)
    y = int8_mm._int8_linear_triton(xq, sa, wq, sb, None, torch.float32)
    assert torch.allclose(y, int8_mm.int8_linear_mm_torch(xq.contiguous(), sa, wq, sb, None, torch.float32),
                          rtol=1e-5)
