"""What "auto" keeps of a weight it converted to int8 (``ComputeConfig.fp8_form``), on the CPU.

By default ("serving") the file's FP8 form stays beside the int8 conversion only while it serves a call: a weight
whose calls all ran int8 becomes its int8 form in place, one that already ran weight-only keeps both. A weight
that became int8 takes the verdicts its FP8 form's int8 proofs reached, so its next calls are not proven again.
The int8 capability is set for these tests (an AVX2 machine runs them too); which path wins is set by a fake clock.
"""

from __future__ import annotations

import json

import pytest
import torch

from fp8_engram.quant import ComputeConfig, QuantizationError, linear
from fp8_engram.quant.compute import Book, int8 as qint8, prove
from fp8_engram.quant.compute.paths.int8 import convert_in_place, dropped_fp8_form
from helpers.int8_calls import activation, converted, fake_clock, fp8_weights


@pytest.fixture(autouse=True)
def fast_int8_device(monkeypatch):
    monkeypatch.setattr(qint8, "int8_supported", lambda device: torch.device(device).type == "cpu")


@pytest.fixture
def proofs(monkeypatch):
    """The token classes ``prove.decide`` was asked to prove, in order."""
    asked = []
    real = prove.decide

    def counting(book, device, key, *a, **k):
        asked.append(key.m_class)
        return real(book, device, key, *a, **k)

    monkeypatch.setattr(prove, "decide", counting)
    return asked


@pytest.fixture
def checks(monkeypatch):
    """The call shapes ``prove.check_call`` checked by value, in order."""
    seen = []
    real = prove.check_call

    def counting(book, device, key, path, x2d, *a, **k):
        seen.append(tuple(x2d.shape))
        return real(book, device, key, path, x2d, *a, **k)

    monkeypatch.setattr(prove, "check_call", counting)
    return seen


def _conversion_line(book) -> str:
    return next(line for line in book.summary_lines("cpu") if line.startswith("int8 conversions"))


def test_weights_whose_calls_all_ran_int8_become_their_int8_form_in_place(monkeypatch):
    fake_clock(monkeypatch, plain_s=0.5, int8_s=0.01)
    x = activation()
    kept, served = fp8_weights(), fp8_weights()  # the same values twice
    both = [linear(x, w, None, ComputeConfig(book=Book(), fp8_form="keep")) for w in kept]
    book = Book()
    cfg = ComputeConfig(book=book)
    assert cfg.fp8_form == "serving"  # the default
    ptrs = [w.qdata.data_ptr() for w in served]
    outs = [linear(x, w, None, cfg) for w in served]
    for w, k, y, y_kept in zip(served, kept, outs, both):
        w8 = k.__dict__["_derived"]["int8"][1]
        assert torch.equal(y, y_kept)  # the same bits as with both forms kept
        assert qint8.is_int8(w) and torch.equal(w.qdata, w8.qdata) and torch.equal(w.scale, w8.scale)
        assert dropped_fp8_form(w).layout == k.layout and not converted(w)
    # the proof's weight (512 rows: proven whole) got a copy, the proof's operand; the others converted in place
    assert [w.qdata.data_ptr() == p for w, p in zip(served, ptrs)] == [False, True, True]
    c = book.conversions("cpu")
    assert (c["layers"], c["dropped_layers"], c["dropped_parameters"]) == (3, 3, 3 * 512 * 1024)
    line = _conversion_line(book)
    assert "3 hold only the int8 form" in line and "keep the file's form" not in line, line


def test_a_weight_that_already_ran_weight_only_keeps_its_fp8_form(monkeypatch):
    """One token is too small to prove: that call runs weight-only on the FP8 form, which then serves a kind
    of call; at 40 tokens int8 wins, and the weight converts beside its FP8 form. The same values never called
    at one token become int8 in place."""
    fake_clock(monkeypatch, plain_s=0.5, int8_s=0.01)
    book = Book()
    cfg = ComputeConfig(book=book)
    both, alone = fp8_weights(2)
    x1, x40 = activation(1), activation(40)
    assert torch.equal(linear(x1, both, None, cfg), linear(x1, both, None, ComputeConfig(path="weight_only")))
    y = linear(x40, both, None, cfg)
    linear(x40, alone, None, cfg)
    assert both.qdata.dtype == torch.float8_e4m3fn and converted(both) and dropped_fp8_form(both) is None
    assert torch.equal(y, qint8.int8_linear(x40, both.__dict__["_derived"]["int8"][1], None, torch.bfloat16))
    assert qint8.is_int8(alone)
    # the weight-only call still multiplies the file's FP8 values
    assert torch.equal(linear(x1, both, None, cfg), linear(x1, both, None, ComputeConfig(path="weight_only")))
    c = book.conversions("cpu")
    assert (c["layers"], c["dropped_layers"]) == (2, 1)
    line = _conversion_line(book)
    assert "1 hold only the int8 form" in line and "1 keep the file's form beside it (+0 MiB)" in line, line


@pytest.mark.parametrize("form", ["serving", "drop"])
def test_an_int8_form_takes_its_fp8_forms_verdicts_instead_of_proving_again(monkeypatch, proofs, checks, tmp_path,
                                                                             form):
    fake_clock(monkeypatch, plain_s=0.5, int8_s=0.01)
    book = Book(tmp_path / "fast_paths.json")
    cfg = ComputeConfig(book=book, fp8_form=form)
    ws = fp8_weights()
    x = activation(40)
    first = [linear(x, w, None, cfg) for w in ws]
    assert proofs == [1] and all(qint8.is_int8(w) for w in ws)  # one proof (40 tokens: class 1), all dropped
    checked = len(checks)
    again = [linear(x, w, None, cfg) for w in ws]
    assert len(checks) == checked, checks  # the shape its FP8 form was checked at is not checked again
    linear(activation(41), ws[0], None, cfg)  # a new shape of the class: checked by value, not proven
    assert proofs == [1] and checks[checked:] == [(41, 1024)], (proofs, checks)
    for w, y, y2 in zip(ws, first, again):
        assert torch.equal(y, y2) and torch.equal(y2, qint8.int8_linear(x, w, None, torch.bfloat16))
    derived = [v for v in book.verdicts("cpu") if v.source == "derived"]
    assert len(derived) == 1 and derived[0].chosen == "int8" and derived[0].key.w_dtype == "int8"
    assert derived[0].key.layout == repr(ws[0].layout) and derived[0].proofs["int8"]["ok"] is True
    assert book.covered("cpu", derived[0].key, "int8", (40, 512, 1024, True))
    # a class no FP8 form was proven in is proven for the int8 form itself
    linear(activation(300), ws[0], None, cfg)
    assert proofs == [1, 2], proofs
    # derived verdicts stay in this process: the file holds what was measured
    stacks = json.loads((tmp_path / "fast_paths.json").read_text())["stacks"]
    layouts = [v["key"]["w_dtype"] for s in stacks.values() for v in s["verdicts"]]
    assert layouts.count("int8") == 1 and layouts.count("float8_e4m3fn") == 1, layouts
    assert any(line.startswith("int8: int8 on 2 of 2 shape classes") for line in book.summary_lines("cpu"))


def test_keep_holds_both_forms_and_refuses_unknown_choices(monkeypatch):
    fake_clock(monkeypatch, plain_s=0.5, int8_s=0.01)
    cfg = ComputeConfig(book=Book(), fp8_form="keep")
    ws = fp8_weights(2)
    for w in ws:
        linear(activation(), w, None, cfg)
    assert all(w.qdata.dtype == torch.float8_e4m3fn and converted(w) for w in ws)
    with pytest.raises(QuantizationError, match="fp8_form must be one of"):
        ComputeConfig(fp8_form="sometimes")


def test_codes_another_tensor_shares_are_never_rewritten(monkeypatch):
    """A copy of a weight (``with_config``, a state dict's entry beside the module's parameter) shares its FP8
    codes: the weight that runs int8 converts by copy and drops its own form, the copy keeps reading FP8."""
    fake_clock(monkeypatch, plain_s=0.5, int8_s=0.01)
    cfg = ComputeConfig(book=Book())
    x = activation()
    proof, w = fp8_weights(2)
    linear(x, proof, None, cfg)  # the kind is proven: a later weight of it would be converted in place
    other = w.with_config(ComputeConfig(path="weight_only"))
    before = other.dequantize(torch.float32)
    ptr = w.qdata.data_ptr()
    assert not convert_in_place(w, cfg, torch.device("cpu")) and w.qdata.dtype == torch.float8_e4m3fn
    linear(x, w, None, cfg)
    assert qint8.is_int8(w) and w.qdata.data_ptr() != ptr  # its own form dropped, by a copy
    assert other.qdata.data_ptr() == ptr and torch.equal(other.dequantize(torch.float32), before)
    del other
    last = fp8_weights(3)[2]
    ptr = last.qdata.data_ptr()
    linear(x, last, None, cfg)
    assert qint8.is_int8(last) and last.qdata.data_ptr() == ptr  # nobody else reads its codes: in place
