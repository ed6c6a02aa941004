""""auto" converts a weight to int8 only where its calls run int8 (quant/compute/paths/int8.py), on the CPU.

The loaders keep the file's weights; under "auto", on a device with fast INT8 and no FP8 units, the first
weight of a kind of call is converted for the proof (a large one: its first rows only), and the others only when
their calls run int8. The capability itself (``int8_supported``: VNNI/AMX here) is set for these tests, so an AVX2
machine runs them too; which path wins is set by a fake clock (no wall-clock margin decides).
"""

from __future__ import annotations

import pytest
import torch

from fp8_engram.quant import Block, ComputeConfig, PerRow, PerTensor, QuantizedTensor, linear
from fp8_engram.quant.compute import Book, int8 as qint8, prove
from fp8_engram.quant.compute.paths.int8 import convert_in_place, dropped_fp8_form, sampled_conversion_sqnr_db
from helpers.allocations import bytes_allocated
from helpers.int8_calls import activation, converted, fake_clock, fp8_weights, int8_wrong_for


@pytest.fixture(autouse=True)
def fast_int8_device(monkeypatch):
    monkeypatch.setattr(qint8, "int8_supported", lambda device: torch.device(device).type == "cpu")


def test_a_model_whose_calls_never_run_int8_converts_only_the_proofs_weight(monkeypatch):
    fake_clock(monkeypatch, plain_s=0.01, int8_s=0.5)
    book = Book()
    cfg = ComputeConfig(book=book)
    ws = fp8_weights()
    x = activation()
    for w in ws:
        assert torch.equal(linear(x, w, None, cfg), linear(x, w, None, ComputeConfig(path="weight_only")))
    assert [converted(w) for w in ws] == [True, False, False]
    assert book.conversions("cpu")["layers"] == 1


def test_where_int8_wins_each_weight_converts_at_its_first_call_and_runs_int8(monkeypatch):
    fake_clock(monkeypatch, plain_s=0.5, int8_s=0.01)
    book = Book()
    cfg = ComputeConfig(book=book, fp8_form="keep")
    ws = fp8_weights()
    x = activation()
    outs = [linear(x, w, None, cfg) for w in ws]
    assert all(converted(w) for w in ws)
    for w, y in zip(ws, outs):
        w8 = w.__dict__["_derived"]["int8"][1]
        assert torch.equal(y, qint8.int8_linear(x, w8, None, torch.bfloat16))
    c = book.conversions("cpu")
    assert c["layers"] == 3 and c["parameters"] == 3 * 512 * 1024 and c["min_sqnr_db"] > 35
    assert any("int8 conversions at first use: 3 layer(s)" in line and "3 keep the file's form beside it (+2 MiB)"
               in line for line in book.summary_lines("cpu"))
    # the file's weight stays: a class where weight-only wins runs it, not the int8 form dequantized
    assert ws[0].qdata.dtype == torch.float8_e4m3fn


def test_the_sampled_conversion_sqnr_is_the_full_figure_within_half_a_db():
    w = fp8_weights(1, n=3072, k=1024)[0]
    w8 = qint8.to_int8(w)
    full, sampled = qint8.conversion_sqnr_db(w, w8), sampled_conversion_sqnr_db(w, w8)
    assert abs(full - sampled) < 0.5, (full, sampled)


def test_memory_first_drops_the_fp8_form_once_a_call_runs_int8(monkeypatch):
    fake_clock(monkeypatch, plain_s=0.5, int8_s=0.01)
    x = activation()
    kept, dropped = fp8_weights(2), fp8_weights(2)  # the same values twice
    both = [linear(x, w, None, ComputeConfig(book=Book(), fp8_form="keep")) for w in kept]
    cfg = ComputeConfig(book=Book(), fp8_form="drop")
    first = [linear(x, w, None, cfg) for w in dropped]
    for w, k, y, y_kept in zip(dropped, kept, first, both):
        assert torch.equal(y, y_kept)  # the call that converts computes what it did with both forms
        w8 = k.__dict__["_derived"]["int8"][1]  # the conversion the kept weight holds beside its FP8 form
        assert w.layout == w8.layout and torch.equal(w.qdata, w8.qdata) and torch.equal(w.scale, w8.scale)
        assert w.dtype == k.dtype and tuple(w.shape) == tuple(k.shape) and w.config is None
        assert "_derived" not in w.__dict__  # no second copy: the weight is the int8 form
        held = lambda t: sum(v.untyped_storage().nbytes() for v in (t.qdata, t.scale))  # noqa: E731
        assert held(k) + held(w8) - held(w) == 512 * 1024 + 512 * 4  # the FP8 byte a parameter, its row scales
        # later calls run the int8 form, proven anew for its layout; weight-only dequantizes the int8 values
        assert torch.equal(linear(x, w, None, cfg), qint8.int8_linear(x, w8, None, torch.bfloat16))
        wo = ComputeConfig(path="weight_only")
        assert torch.equal(linear(x, w, None, wo), linear(x, w8, None, wo))
        assert not torch.equal(linear(x, w, None, wo), linear(x, k, None, wo))


def test_memory_first_keeps_the_fp8_form_where_weight_only_wins(monkeypatch):
    fake_clock(monkeypatch, plain_s=0.01, int8_s=0.5)
    cfg = ComputeConfig(book=Book(), fp8_form="drop")
    x = activation()
    for w in fp8_weights(2):
        assert torch.equal(linear(x, w, None, cfg), linear(x, w, None, ComputeConfig(path="weight_only")))
        assert w.qdata.dtype == torch.float8_e4m3fn


def test_memory_first_converts_proven_weights_in_their_own_storage(monkeypatch):
    """The proof's weight (512 rows: proven whole) gets a second copy, the proof's operand; every later weight of
    the kind is converted where its FP8 codes were: the same bits, the same storage, the same figure."""
    fake_clock(monkeypatch, plain_s=0.5, int8_s=0.01)
    x = activation()
    kept, dropped = fp8_weights(3), fp8_weights(3)
    both = [linear(x, w, None, ComputeConfig(book=Book(), fp8_form="keep")) for w in kept]
    book = Book()
    cfg = ComputeConfig(book=book, fp8_form="drop")
    ptrs = [w.qdata.data_ptr() for w in dropped]
    first = [linear(x, w, None, cfg) for w in dropped]
    assert [w.qdata.data_ptr() == p for w, p in zip(dropped, ptrs)] == [False, True, True]
    for w, k, y, y_kept in zip(dropped, kept, first, both):
        w8 = k.__dict__["_derived"]["int8"][1]
        assert torch.equal(y, y_kept) and torch.equal(w.qdata, w8.qdata) and torch.equal(w.scale, w8.scale)
        assert w.layout == w8.layout and dropped_fp8_form(w).layout == k.layout
    c = book.conversions("cpu")
    figures = [sampled_conversion_sqnr_db(k, k.__dict__["_derived"]["int8"][1]) for k in kept]
    assert c["layers"] == 3 and abs(c["min_sqnr_db"] - min(figures)) < 0.006, (c, figures)  # the book keeps 0.01 dB
    assert abs(c["mean_sqnr_db"] - sum(figures) / 3) < 0.006, (c, figures)


def test_a_failing_int8_kernel_after_an_in_place_conversion_runs_the_int8_form_weight_only(monkeypatch):
    fake_clock(monkeypatch, plain_s=0.5, int8_s=0.01)
    x = activation()
    cfg = ComputeConfig(book=Book(), fp8_form="drop")
    ws = fp8_weights(2)
    linear(x, ws[0], None, cfg)  # the proof
    real = qint8.int8_linear_mm

    def broken(*a, **k):
        raise RuntimeError("kernel lost")

    monkeypatch.setattr(qint8, "int8_linear_mm", broken)
    y = linear(x, ws[1], None, cfg)
    monkeypatch.setattr(qint8, "int8_linear_mm", real)
    assert qint8.is_int8(ws[1])  # converted in place before the kernel failed
    assert torch.equal(y, linear(x, ws[1], None, ComputeConfig(path="weight_only")))


@pytest.mark.parametrize("layout", [PerTensor(), PerRow(), Block(128, 128), Block(64, 256)], ids=repr)
@pytest.mark.parametrize("rotation", [None, 0])
def test_in_place_conversion_is_the_copying_conversion(layout, rotation):
    g = torch.Generator().manual_seed(5)
    w = QuantizedTensor.from_float(torch.randn(320, 768, generator=g) * 0.02, layout)
    want = qint8.to_int8(w, rotation)
    ptr = w.qdata.data_ptr()
    got = qint8.to_int8_in_place(w, rotation)
    assert got.qdata.data_ptr() == ptr and got.layout == want.layout
    assert torch.equal(got.qdata, want.qdata) and torch.equal(got.scale, want.scale)


def test_in_place_chunks_write_rows_only_after_reading_them():
    """Small chunks (3 rows) over codes that share the output's memory: each chunk is read before written, so
    the result is bit for bit that of the same chunks written elsewhere. (Against the whole-weight conversion
    only to float rounding: the rotation's matmul on 3 rows may round its last bit differently from one on 64,
    where the BLAS takes another kernel for so few rows, as on an AMD EPYC (Zen 5) here.)"""
    g = torch.Generator().manual_seed(6)
    w = QuantizedTensor.from_float(torch.randn(64, 256, generator=g) * 0.02, PerRow())
    want = qint8.to_int8(w)
    lay = want.layout
    q = w.qdata.clone()
    s = w.scale.float().reshape(-1, 1)

    def fill_from(codes):
        def fill(i, j, out):
            out.copy_(codes[i:j].float() * s[i:j])
        return fill

    apart, apart_scale = lay.quantize_rows((64, 256), fill_from(q.clone()), chunk_elems=3 * 256)
    got, scale = lay.quantize_rows((64, 256), fill_from(q), chunk_elems=3 * 256, out=q.view(torch.int8))
    assert got.data_ptr() == q.data_ptr() and torch.equal(got, apart) and torch.equal(scale, apart_scale)
    torch.testing.assert_close(scale, want.scale, rtol=1e-6, atol=0)
    assert (got.int() - want.qdata.int()).abs().max() <= 1 and (got != want.qdata).float().mean() < 1e-3


def test_in_place_refuses_what_it_cannot_finish_and_leaves_the_weight_untouched():
    g = torch.Generator().manual_seed(7)
    w = QuantizedTensor.from_float(torch.randn(64, 256, generator=g), PerTensor())
    huge = QuantizedTensor.from_parts(w.qdata.clone(), torch.tensor(1e36), PerTensor())  # rotated rows may overflow
    before = huge.qdata.clone()
    assert qint8.to_int8_in_place(huge) is None and torch.equal(huge.qdata.view(torch.uint8), before.view(torch.uint8))
    assert qint8.to_int8_in_place(w.t()) is None  # a transposed view
    assert qint8.to_int8_in_place(qint8.to_int8(w)) is None  # int8 already


def test_an_in_place_conversion_allocates_a_fraction_of_the_codes():
    """Counted by torch's profiler: the in-place conversion of a second weight (the first made the reused
    buffers) allocates its row scales and the sampled indices, far less than the int8 codes a copying
    conversion allocates (measured too)."""
    cfg = ComputeConfig(book=Book(), fp8_form="drop")
    ws = fp8_weights(3, n=1024, k=2048)
    assert convert_in_place(ws[0], cfg, torch.device("cpu"))
    in_place = bytes_allocated(lambda: convert_in_place(ws[1], cfg, torch.device("cpu")))
    copying = bytes_allocated(lambda: qint8.to_int8(ws[2]))
    codes = 1024 * 2048
    assert qint8.is_int8(ws[1]) and copying >= codes and in_place < codes // 16, (in_place, copying)


def _recording_conversions(monkeypatch) -> list:
    """The row counts of every copying int8 conversion from here on (in-place ones are not copies)."""
    rows, real = [], qint8.to_int8

    def recording(w, *a, **k):
        rows.append(w.qdata.shape[0])
        return real(w, *a, **k)

    monkeypatch.setattr(qint8, "to_int8", recording)
    return rows


def test_a_large_weight_is_proven_on_its_first_rows_and_converted_in_its_own_storage(monkeypatch):
    """A CPU weight of more than 2 x TIME_ROWS rows, its kind's first: the proof converts its first TIME_ROWS rows
    only, and the call that runs int8 converts the whole weight where its codes were (no second copy), checks
    its own shape, and serves what the int8 product of the weight's conversion gives; the second call of that
    shape is not checked again (the int8 form's kind took the shape the call was checked at)."""
    fake_clock(monkeypatch, plain_s=0.5, int8_s=0.01)
    n = 2 * prove.TIME_ROWS + 256
    (w,), (twin,) = fp8_weights(1, n=n), fp8_weights(1, n=n)  # the same values twice
    want = qint8.int8_linear(activation(), qint8.to_int8(twin), None, torch.bfloat16)
    copies = _recording_conversions(monkeypatch)
    checks, real_check = [], prove.check_call
    monkeypatch.setattr(prove, "check_call", lambda *a, **k: checks.append(a[4].shape) or real_check(*a, **k))
    book = Book()
    cfg = ComputeConfig(book=book)
    ptr = w.qdata.data_ptr()
    y = linear(activation(), w, None, cfg)
    assert copies == [prove.TIME_ROWS], "the proof converted more than the rows it is timed on"
    assert qint8.is_int8(w) and w.qdata.data_ptr() == ptr and dropped_fp8_form(w) is not None
    assert torch.equal(y, want)
    assert checks == [(40, 1024)] and book.conversions("cpu")["layers"] == 1
    assert torch.equal(linear(activation(), w, None, cfg), want) and checks == [(40, 1024)]


def test_a_large_weight_where_weight_only_wins_is_never_converted_whole(monkeypatch):
    fake_clock(monkeypatch, plain_s=0.01, int8_s=0.5)
    n = 2 * prove.TIME_ROWS + 256
    (w,) = fp8_weights(1, n=n)
    copies = _recording_conversions(monkeypatch)
    book = Book()
    y = linear(activation(), w, None, ComputeConfig(book=book))
    assert copies == [prove.TIME_ROWS] and not converted(w) and w.qdata.dtype == torch.float8_e4m3fn
    assert book.conversions("cpu") is None  # nothing converted
    assert torch.equal(y, linear(activation(), w, None, ComputeConfig(path="weight_only")))


def test_a_kernel_wrong_past_the_proven_rows_after_the_in_place_conversion_serves_the_int8_form_weight_only(
        monkeypatch):
    """The int8 kernel right on the proof's first rows and wrong on the whole weight: the whole weight was
    converted in place when its call ran int8, the call's own check refuses int8 for the kind, on record, and the
    call (and every later one) gets weight-only's product of the int8 form, the values it now holds."""
    fake_clock(monkeypatch, plain_s=0.5, int8_s=0.01)
    n = 2 * prove.TIME_ROWS + 256
    int8_wrong_for(monkeypatch, n)
    (w,) = fp8_weights(1, n=n)
    book = Book()
    cfg = ComputeConfig(book=book)
    y = linear(activation(), w, None, cfg)
    assert qint8.is_int8(w)
    wo = linear(activation(), w, None, ComputeConfig(path="weight_only"))
    assert torch.equal(y, wo) and torch.equal(linear(activation(), w, None, cfg), wo)
    assert any("int8 refused" in v.why for v in book.verdicts("cpu")), [v.why for v in book.verdicts("cpu")]
