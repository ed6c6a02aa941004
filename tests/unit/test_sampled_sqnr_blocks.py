"""The conversion SQNR "auto" reports per layer is measured on sampled rows a block at a time through reused
buffers (quant/compute/paths/int8.py, ``_row_blocks``): the same figure as dequantizing the sampled rows whole
and summing in float64, for every FP8 scale form, with and without the rotation, on row counts that do not
fill the last block; and a layer's figure allocates no buffer the previous layer did not already have."""

from __future__ import annotations

import math

import pytest
import torch

from fp8_engram.quant import Block, PerRow, PerTensor, QuantizedTensor
from fp8_engram.quant.compute import int8 as qint8
from fp8_engram.quant.compute import proof
from fp8_engram.quant.compute.paths import int8 as path
from fp8_engram.quant.compute.paths.base import weight_reference
from helpers.allocations import bytes_allocated


def _weight(layout, n=384, k=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g, dtype=torch.float64) * 0.02
    w[:, 7] *= 40  # an outlier column, as diffusion weights have
    return QuantizedTensor.from_float(w.float(), layout)


def _whole_rows_db(reference, w8, rows=path.SQNR_ROWS) -> float:
    """The figure from the sampled rows dequantized whole, differences and sums in float64."""
    idx = proof.checked_index(w8.qdata.shape[0], rows, rows // 8, rows - rows // 4, "cpu")
    ref = weight_reference(reference, idx).double()
    err = (weight_reference(w8, idx).double() - ref).pow(2).sum()
    return float(10 * torch.log10(ref.pow(2).sum() / err))


LAYOUTS = [PerTensor(), PerRow(), Block(128, 128), Block(64, 256)]


@pytest.mark.parametrize("rotation", [None, 0])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: repr(lay))
@pytest.mark.parametrize("block_elems", [path.SQNR_BLOCK_ELEMS, 3 * 512])  # one block; 3 rows per block
def test_blockwise_figure_is_the_whole_rows_figure(monkeypatch, layout, rotation, block_elems):
    w = _weight(layout)
    w8 = qint8.to_int8(w, rotation)
    assert path._row_blocks(w, w8) is not None  # the blockwise route is the one measured
    monkeypatch.setattr(path, "SQNR_BLOCK_ELEMS", block_elems)
    got, want = path.sampled_conversion_sqnr_db(w, w8), _whole_rows_db(w, w8)
    assert math.isfinite(got) and abs(got - want) < 1e-4, (got, want)


def test_blockwise_figure_is_near_the_full_weight_figure():
    w = _weight(PerRow(), n=3072, k=1024, seed=3)
    w8 = qint8.to_int8(w)
    full, sampled = qint8.conversion_sqnr_db(w, w8), path.sampled_conversion_sqnr_db(w, w8)
    assert abs(full - sampled) < 0.5, (full, sampled)


def test_a_damaged_conversion_lowers_the_figure():
    w = _weight(PerTensor())
    w8 = qint8.to_int8(w)
    good = path.sampled_conversion_sqnr_db(w, w8)
    q = w8.qdata.clone()
    q[0] = -q[0]  # the first row (always sampled) negated
    bad = path.sampled_conversion_sqnr_db(w, QuantizedTensor.from_parts(q, w8.scale, w8.layout, orig_dtype=w8.orig_dtype))
    assert bad < good - 10, (good, bad)
    assert path.sampled_conversion_sqnr_db(w, w8) == good  # the buffers it reuses carry nothing over


def test_an_exact_conversion_is_infinite():
    w8 = qint8.to_int8(_weight(PerRow()), 0)
    assert path.sampled_conversion_sqnr_db(w8, w8) == math.inf  # an int8 reference takes the generic route


def test_a_layer_after_the_first_allocates_almost_nothing(monkeypatch):
    """The first layer makes the reused buffers; the next of its width allocates only the sampled indices and
    scalars, where the whole-rows route allocates several float32 copies of the sample (measured too, so the
    count is shown able to see them)."""
    ws = [_weight(PerTensor(), n=1024, k=2048, seed=s) for s in (1, 2)]
    w8s = [qint8.to_int8(w) for w in ws]
    sample_bytes = path.SQNR_ROWS * 2048 * 4
    path.sampled_conversion_sqnr_db(ws[0], w8s[0])
    blockwise = bytes_allocated(lambda: path.sampled_conversion_sqnr_db(ws[1], w8s[1]))
    monkeypatch.setattr(path, "_row_blocks", lambda *a, **k: None)
    whole = bytes_allocated(lambda: path.sampled_conversion_sqnr_db(ws[1], w8s[1]))
    assert whole > 2 * sample_bytes and blockwise < sample_bytes // 16, (blockwise, whole, sample_bytes)


def test_other_forms_take_the_generic_route():
    w = _weight(PerRow())
    assert path._row_blocks(w.dequantize(torch.float32), qint8.to_int8(w)) is None  # a float reference
    assert path._row_blocks(w, w) is None  # not an int8 conversion
