"""Kept dequantized copies of weight-only layers on the CPU (``ComputeConfig.dequant_cache_bytes``): the same
bits as dequantizing at every call, only within the process's budget, dropped when the weight's data or
scales are rewritten (the pack's requantization, as its LoRA patches do), freed on release and with the
weight, never made where autograd keeps the weight, while tracing, or by a proof's run."""

import gc
import threading

import pytest
import torch
import torch.nn.functional as F

from fp8_engram.quant import Block, ComputeConfig, PerRow, PerTensor, QuantizationError, QuantizedTensor, linear
from fp8_engram.quant.compute.paths import plain
from fp8_engram.quant.compute.paths.plain import WEIGHT_ONLY, drop_kept_copies, kept_copy
from fp8_engram.quant.runtime import DEQUANT_COPIES, CopyAccount

pytestmark = pytest.mark.unit

MIB = 1 << 20


def _cfg(budget: int) -> ComputeConfig:
    return ComputeConfig(path="weight_only", dequant_cache_bytes=budget)


def _qt(layout=PerTensor(), out_f=512, in_f=1024, seed=0, budget=0) -> QuantizedTensor:
    g = torch.Generator().manual_seed(seed)
    return QuantizedTensor.from_float(torch.randn(out_f, in_f, generator=g) * 0.05, layout, config=_cfg(budget))


def _x(m=20, k=1024, dtype=torch.bfloat16, seed=7):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _fresh(x, w, bias=None):
    """A fresh dequantize, then F.linear: stock ComfyUI's math."""
    return F.linear(x, w.dequantize(x.dtype), bias)


def _has_copy(w) -> bool:
    return "dequantized_copy" in w.__dict__.get("_derived", {})


@pytest.fixture(autouse=True)
def _account():
    """Each test starts from the account as it is (other tests keep nothing) and must give back all it booked."""
    gc.collect()
    before = DEQUANT_COPIES.bytes
    yield before
    gc.collect()
    assert DEQUANT_COPIES.bytes == before


@pytest.mark.parametrize("layout", [PerTensor(), PerRow(), Block(128, 128)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_outputs_are_bit_identical_with_and_without_copies(layout, dtype, mode, _account):
    with torch.inference_mode() if mode == "inference_mode" else torch.no_grad():
        w = _qt(layout, budget=64 * MIB)
        off = w.with_config(_cfg(0))
        bias = torch.randn(512, generator=torch.Generator().manual_seed(3)).to(dtype)
        for seed in range(3):  # the first call makes the copy, the later ones reuse it
            x = _x(dtype=dtype, seed=seed)
            got = linear(x, w, bias)
            assert torch.equal(got, linear(x, off, bias))
            assert torch.equal(got, _fresh(x, w, bias))
        assert _has_copy(w) and not _has_copy(off)
        assert DEQUANT_COPIES.bytes - _account == 512 * 1024 * dtype.itemsize
        held = w.__dict__["_derived"]["dequantized_copy"][1]
        assert not held.is_inference()  # usable by later calls outside inference mode as well
    x = _x(dtype=dtype, seed=9)
    with torch.no_grad():
        assert torch.equal(linear(x, w, bias), _fresh(x, w, bias))
    del w, off, held
    gc.collect()
    assert DEQUANT_COPIES.bytes == _account


def test_the_copy_is_reused_not_made_again():
    w = _qt(budget=64 * MIB)
    with torch.no_grad():
        a = kept_copy(w, torch.bfloat16, w.config.dequant_cache_bytes)
        b = kept_copy(w, torch.bfloat16, w.config.dequant_cache_bytes)
    assert a is not None and a is b
    assert torch.equal(a, w.dequantize(torch.bfloat16))


def test_budget_zero_keeps_nothing(_account):
    w = _qt(budget=0)
    with torch.no_grad():
        x = _x()
        assert torch.equal(linear(x, w), _fresh(x, w))
    assert not _has_copy(w) and DEQUANT_COPIES.bytes == _account


def test_copies_are_made_only_within_the_budget_first_come_first_kept(_account):
    size = 512 * 1024 * 2  # one bf16 copy of a 512 x 1024 weight: 1 MiB
    ws = [_qt(seed=i, budget=2 * size + size // 2) for i in range(3)]
    x = _x()
    with torch.no_grad():
        for w in ws:
            assert torch.equal(linear(x, w), _fresh(x, w))
    assert [_has_copy(w) for w in ws] == [True, True, False]
    assert DEQUANT_COPIES.bytes - _account == 2 * size
    drop_kept_copies(ws[:1])  # room again: the next call of the third keeps its copy
    with torch.no_grad():
        assert torch.equal(linear(x, ws[2]), _fresh(x, ws[2]))
    assert [_has_copy(w) for w in ws] == [False, True, True]
    assert DEQUANT_COPIES.bytes - _account == 2 * size


def test_one_account_for_every_model_bounded_by_the_largest_budget(_account):
    size = 512 * 1024 * 2
    big = [_qt(seed=i, budget=2 * size) for i in range(2)]
    small = _qt(seed=5, budget=size)  # another model, a smaller budget: the total is already past it
    x = _x()
    with torch.no_grad():
        for w in big + [small]:
            linear(x, w)
    assert [_has_copy(w) for w in big] == [True, True] and not _has_copy(small)
    assert DEQUANT_COPIES.bytes - _account == 2 * size


def test_the_nodes_in_place_patch_drops_the_copy_of_an_inference_weight():
    """ComfyUI's loaders make inference tensors (no version counter): the LoRA patch of nodes/ops.py writes
    qdata and scale in place and calls scales_written; the next call must multiply the patched weight."""
    x = _x()
    with torch.inference_mode():
        w = _qt(budget=64 * MIB)
        before = linear(x, w)
        assert _has_copy(w)
        patched = QuantizedTensor.from_float(w.dequantize(torch.float32) * 1.5 + 0.01, w.layout)
        w.qdata.copy_(patched.qdata)
        w.scale.copy_(patched.scale)
        w.scales_written()
        after = linear(x, w)
        assert not torch.equal(after, before)
        assert torch.equal(after, _fresh(x, w))
        assert _has_copy(w)  # kept again, for the patched data


@pytest.mark.parametrize("inference", [True, False], ids=["inference", "normal"])
def test_requantize_and_copy_drop_the_copy(inference):
    x = _x()
    with torch.inference_mode(inference), torch.no_grad():
        w = _qt(budget=64 * MIB)
        linear(x, w)
        w.requantize_(w.dequantize(torch.float32) * -2)
        assert torch.equal(linear(x, w), _fresh(x, w))
        w.copy_(_qt(seed=4))
        assert torch.equal(linear(x, w), _fresh(x, w))
        assert torch.equal(w.dequantize(torch.float32), _qt(seed=4).dequantize(torch.float32))


def test_a_data_write_that_tells_nobody_is_still_seen_on_a_normal_tensor():
    """Outside inference mode the key holds the version counters of qdata and scale: a write of qdata alone,
    without scales_written, still makes the next call dequantize the new data."""
    x = _x()
    with torch.no_grad():
        w = _qt(budget=64 * MIB)
        linear(x, w)
        w.qdata.copy_(_qt(seed=8).qdata)
        assert torch.equal(linear(x, w), _fresh(x, w))


def test_released_copies_and_collected_weights_give_their_bytes_back(_account):
    x = _x()
    with torch.no_grad():
        ws = [_qt(seed=i, budget=64 * MIB) for i in range(3)]
        for w in ws:
            linear(x, w)
    assert DEQUANT_COPIES.copies >= 3 and DEQUANT_COPIES.bytes - _account == 3 * 512 * 1024 * 2
    assert drop_kept_copies([ws[0], torch.zeros(2), None]) == 1
    assert DEQUANT_COPIES.bytes - _account == 2 * 512 * 1024 * 2
    del w, ws
    gc.collect()
    assert DEQUANT_COPIES.bytes == _account


def test_no_copy_where_autograd_keeps_the_weight(_account):
    w = _qt(budget=64 * MIB)
    x = _x(dtype=torch.float32).requires_grad_(True)
    out = linear(x, w)
    out.sum().backward()
    assert not _has_copy(w) and DEQUANT_COPIES.bytes == _account
    assert torch.equal(out.detach(), _fresh(x.detach(), w))


def test_no_copy_while_tracing(monkeypatch, _account):
    w = _qt(budget=64 * MIB)
    x = _x()
    monkeypatch.setattr(plain, "tracing", lambda: True)
    with torch.no_grad():
        out = WEIGHT_ONLY.run(x, w, None, torch.bfloat16, w.config)
    assert torch.equal(out, _fresh(x, w))
    assert not _has_copy(w) and DEQUANT_COPIES.bytes == _account


def test_no_copy_for_a_proofs_run_nor_for_a_part_of_a_larger_weight(_account):
    w = _qt(budget=64 * MIB)
    x = _x()
    with torch.no_grad():
        WEIGHT_ONLY.run(x, w, None, torch.bfloat16, w.config, op=True)  # how prove.decide runs every candidate
        assert not _has_copy(w)
        rows = w._replace(qdata=w.qdata[:256])  # an expert of a bank, a proof's slice: made anew per call
        assert torch.equal(WEIGHT_ONLY.run(x, rows, None, torch.bfloat16, w.config), _fresh(x, rows))
        assert not _has_copy(rows)
    assert DEQUANT_COPIES.bytes == _account


def test_the_config_takes_only_a_non_negative_int():
    assert ComputeConfig().dequant_cache_bytes == 0
    assert ComputeConfig(dequant_cache_bytes=3 << 30).dequant_cache_bytes == 3 << 30
    for bad in (-1, 1.5, True, "1", None):
        with pytest.raises(QuantizationError, match="dequant_cache_bytes"):
            ComputeConfig(dequant_cache_bytes=bad)


def test_the_account_never_books_past_the_budget_from_many_threads():
    account = CopyAccount()
    granted = []

    def book():
        for _ in range(200):
            if account.reserve(7, 1000):
                granted.append(7)

    threads = [threading.Thread(target=book) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert account.bytes == sum(granted) == 994  # 142 copies of 7 bytes fit in 1000
    assert not account.reserve(0, 1000)
    for n in granted:
        account.release(n)
    assert account.bytes == 0 and account.copies == 0
