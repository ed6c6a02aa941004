"""The CPU int8 path by cache-sized blocks (kernels/int8_mm.py) gives the bits of its whole-tensor twins.

The blocks only change where the work happens, never the arithmetic: the activation's quantization is per
row and the epilogue per element after an exact int32 GEMM. Thresholds are lowered here so small tensors
take the blocked code with tails in every dimension; the real thresholds are exercised once at their size.
"""

from __future__ import annotations

import pytest
import torch

from fp8_engram.quant.kernels import int8_mm


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(int8_mm, "BLOCK_ABOVE", 64)
    monkeypatch.setattr(int8_mm, "BLOCK_ELEMS", 16 * 96)  # 16-row blocks of a 96-wide activation
    monkeypatch.setattr(int8_mm, "OUT_BLOCK_ELEMS", 8)  # the smallest column block: 512


def _operands(m, k, n, gen, per_row=True):
    xq = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=gen)
    wq = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    sa = torch.rand(m, 1, generator=gen) + 0.01
    sb = torch.rand(n, 1, generator=gen) + 0.01 if per_row else torch.tensor(0.37)
    return xq, sa, wq, sb


@pytest.mark.parametrize("m,n", [(37, 1300), (1, 515), (200, 1024)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("per_row", [True, False])
def test_blocked_epilogue_equals_the_twin(small_blocks, m, n, dtype, per_row):
    gen = torch.Generator().manual_seed(m * 7 + n)
    xq, sa, wq, sb = _operands(m, 96, n, gen, per_row)
    bias = torch.randn(n, generator=gen).to(dtype)
    for b in (bias, None):
        got = int8_mm.int8_linear_mm(xq, sa, wq, sb, b, dtype)
        want = int8_mm.int8_linear_mm_torch(xq, sa, wq, sb, b, dtype)
        assert got.dtype == dtype and got.shape == (m, n)
        assert torch.equal(got, want), f"blocked epilogue differs at {m} x {n} ({dtype}, bias {b is not None})"


@pytest.mark.parametrize("m", [1, 15, 16, 17, 70])
@pytest.mark.parametrize("rotation", [0, 32])
def test_blocked_quantization_equals_the_twin(small_blocks, m, rotation):
    gen = torch.Generator().manual_seed(m + rotation)
    x = torch.randn(m, 96, generator=gen).to(torch.bfloat16)
    x[m // 2] *= 40  # one outlier row: its scale must not leak into the rows of its block
    x[0].zero_() if m > 2 else None  # an all-zero row (scale 1)
    q, s = int8_mm.quantize_rows_int8(x, rotation)
    q0, s0 = int8_mm.quantize_rows_int8_torch(x, rotation)
    assert torch.equal(q, q0) and torch.equal(s, s0)


def test_the_real_thresholds_take_blocks_and_keep_the_bits(monkeypatch):
    """At the shapes the thresholds were set for (a Flux MLP at 1024 tokens, smaller K), the blocked code
    runs (counted) and equals the twin."""
    calls = {"q": 0, "mm": 0}
    real_q, real_mm = int8_mm._quantize_rows_blocked, int8_mm._int8_linear_blocked

    def q(*a):
        calls["q"] += 1
        return real_q(*a)

    def mm(*a):
        calls["mm"] += 1
        return real_mm(*a)

    monkeypatch.setattr(int8_mm, "_quantize_rows_blocked", q)
    monkeypatch.setattr(int8_mm, "_int8_linear_blocked", mm)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1024, 2304, generator=gen).to(torch.bfloat16)
    xq, sa = int8_mm.quantize_rows_int8(x, 128)
    xq0, sa0 = int8_mm.quantize_rows_int8_torch(x, 128)
    assert torch.equal(xq, xq0) and torch.equal(sa, sa0)
    wq = torch.randint(-128, 128, (2500, 2304), dtype=torch.int8, generator=gen)
    sb = torch.rand(2500, 1, generator=gen)
    bias = torch.randn(2500, generator=gen).to(torch.bfloat16)
    got = int8_mm.int8_linear_mm(xq, sa, wq, sb, bias, torch.bfloat16)
    assert torch.equal(got, int8_mm.int8_linear_mm_torch(xq, sa, wq, sb, bias, torch.bfloat16))
    assert calls == {"q": 1, "mm": 1}
    small = torch.randn(16, 2304, generator=gen).to(torch.bfloat16)
    int8_mm.quantize_rows_int8(small, 128)
    assert calls["q"] == 1, "a 16-token activation must stay whole (blocks cost more than they save there)"
