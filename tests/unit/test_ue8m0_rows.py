"""FP8 E4M3 rows with packed UE8M0 block scales (engram/ue8m0.py)."""

import pytest
import torch

from fp8_engram.engram import ue8m0
from helpers.numerics import sqnr

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("hidden", [64, 128, 300, 1024, 2048])
def test_round_trip_sqnr_over_wide_dynamic_range(hidden):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(64, hidden, generator=g, dtype=torch.float64) * torch.logspace(-6, 6, 64, dtype=torch.float64)[:, None]
    q, sf = ue8m0.quantize_rows(x.float())
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert sf.dtype == torch.int32 and sf.shape == (64, ue8m0.num_sf_packs(hidden))
    y = ue8m0.dequantize_rows(q, sf)
    # E4M3 has 3 mantissa bits: about 30 dB per block for Gaussian data; row-wise check catches a wrong scale.
    for r in range(64):
        assert sqnr(x[r], y[r]) > 25.0, r


def test_scales_are_powers_of_two_that_fit_the_block_max():
    x = torch.tensor([[448.0] * 128 + [449.0] + [0.0] * 127, [1.0] * 128 + [0.0] * 128])
    q, sf = ue8m0.quantize_rows(x)
    exps = ue8m0.unpack_ue8m0(sf, 2).to(torch.int32) - 127
    # 448 fits exactly with scale 1; 449 needs scale 2; 1/448 -> ceil(log2) = -8.
    assert exps.tolist() == [[0, 1], [-8, -126]]
    assert float(ue8m0.dequantize_rows(q, sf)[0, 0]) == 448.0


def test_packing_is_little_endian_four_blocks_per_int32():
    b = torch.tensor([[1, 2, 3, 4, 5]], dtype=torch.uint8)
    packs = ue8m0.pack_ue8m0(b)
    assert packs.tolist() == [[0x04030201, 5]]
    assert ue8m0.unpack_ue8m0(packs, 5).tolist() == b.tolist()


def test_zero_rows_decode_to_exact_zero_also_with_zero_scales():
    q, sf = ue8m0.quantize_rows(torch.zeros(2, 256))
    assert torch.equal(ue8m0.dequantize_rows(q, sf), torch.zeros(2, 256))
    assert torch.equal(ue8m0.dequantize_rows(q, torch.zeros_like(sf)), torch.zeros(2, 256))


def test_rejects_non_finite_and_bad_shapes():
    with pytest.raises(ValueError, match="inf or NaN"):
        ue8m0.quantize_rows(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="2-D"):
        ue8m0.quantize_rows(torch.zeros(4))
    q, sf = ue8m0.quantize_rows(torch.ones(3, 512))
    with pytest.raises(ValueError, match="do not fit"):
        ue8m0.dequantize_rows(q, sf[:2])
