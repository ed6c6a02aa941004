"""Fast paths proven by value and chosen by measurement (quant/compute/prove.py), on the CPU.

Kernels are injected through the real dispatch: the CPU int8 GEMM (``torch._int_mm`` behind
``compute.int8.int8_linear_mm``) and the scaled matmul (``compute.scaled_mm._scaled_mm``) are replaced by
versions that are 1% off, return zeros, return NaN or are slow; ``linear`` then proves them on first use.
Timing runs on a fake clock that only the injected kernels advance (no test times real work). On a CUDA
GPU, test_every_path_proves_right_on_this_gpu runs the real proofs of every kernel (selftest on the SD3
shapes); the kernels' own value checks are in test_kernels_cuda.py (skipped without a GPU). The holes a
proof must not have (tails, rows, strides, damaged files, autograd, torch.compile) are in
test_proof_holes.py.
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from fp8_engram.quant import ComputeConfig, PerRow, QuantizedTensor, linear
from fp8_engram.quant.compute import Book, default_book, int8 as qint8, proof, prove
from fp8_engram.quant.layouts import Int8
from helpers.int8_calls import int8_wrong_for

sm = importlib.import_module("fp8_engram.quant.compute.scaled_mm")


def _cpu_row_scales() -> bool:
    """Whether this torch's CPU scaled matmul takes per-row scales (torch 2.11's takes one scale per operand)."""
    api = sm.scaled_mm_api("cpu")
    if api is None:
        return False
    a = torch.ones(16, 32).to(torch.float8_e4m3fn)
    try:
        sm.SCALED_MM_APIS[api](a, a.t(), torch.ones(16, 1), torch.ones(1, 16), None, torch.bfloat16)
        return True
    except RuntimeError:
        return False


CPU_ROW_SCALES = _cpu_row_scales()
plain = importlib.import_module("fp8_engram.quant.compute.paths.plain")

AUTO = ComputeConfig(path="auto")


class FakeClock:
    """Seconds that pass only when a test's kernel says so (``advance``)."""

    def __init__(self):
        self.now = 0.0

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def for_device(self, device):
        def timed(fn):
            t0 = self.now
            fn()
            return self.now - t0
        return timed


@pytest.fixture(autouse=True)
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(proof, "clock_for", fake.for_device)
    return fake


def _weights(n=256, k=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    return QuantizedTensor.from_float(w, PerRow()), qint8.to_int8(QuantizedTensor.from_float(w, PerRow()))


def _x(m=40, k=512, seed=1):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def inject_int8(monkeypatch, how: str, calls: list | None = None, clock: FakeClock | None = None):
    real = qint8.int8_linear_mm

    def fake(xq, sa, wq, sb, bias, out_dtype):
        if calls is not None:
            calls.append(xq.shape[0])
        out = real(xq, sa, wq, sb, bias, out_dtype)
        if how == "wrong":
            return out * 1.01
        if how == "zeros":
            return torch.zeros_like(out)
        if how == "nan":
            out = out.clone()
            out[0, 0] = float("nan")
            return out
        if how == "slow":
            clock.advance(0.2)
        return out

    monkeypatch.setattr(qint8, "int8_linear_mm", fake)


def slow_plain(monkeypatch, clock: FakeClock, seconds=0.5):
    """The weight-only path made slower per call (its CPU dequantization) than any int8 product here."""
    real = plain._dequantized

    def slow(*args, **kwargs):
        clock.advance(seconds)
        return real(*args, **kwargs)

    monkeypatch.setattr(plain, "_dequantized", slow)


def verdict(kind: str, book: Book | None = None):
    found = [v for v in (book or default_book()).verdicts("cpu") if v.kind == kind]
    assert len(found) == 1, [v.key.text() for v in (book or default_book()).verdicts("cpu")]
    return found[0]


# ----- the rules -----

def test_a_kernel_one_percent_off_fails_and_the_twin_passes():
    g = torch.Generator().manual_seed(3)
    ref = torch.randn(64, 256, generator=g, dtype=torch.float64)
    twin = ref.to(torch.bfloat16)
    assert proof.judge(twin, twin, ref).ok
    assert proof.judge(twin.double() * 1.01, twin, ref).ok is False
    zeros = proof.judge(torch.zeros_like(twin), twin, ref)
    assert not zeros.ok and zeros.sqnr_db == 0.0
    nan = twin.clone()
    nan[3, 7] = float("nan")
    assert not proof.judge(nan, twin, ref).ok and "NaN/Inf positions" in proof.judge(nan, twin, ref).why
    ref_inf = ref.clone()
    ref_inf[0, 0] = float("inf")
    both = twin.clone()
    both[0, 0] = float("inf")
    assert proof.judge(both, both, ref_inf).ok  # an infinity where the reference has one is no fault
    assert proof.judge(ref * (1 + 1e-4), ref.float(), ref).ok  # a float32 twin is held to the ceiling


def test_a_proof_compares_every_row_up_to_256_and_both_ends_beyond():
    s = proof.Sample(200, 300, "cpu")
    assert s.rows.tolist() == list(range(200)) and s.cols.tolist() == list(range(300))
    big = proof.Sample(4096, 3072, "cpu")
    rows, cols = big.rows.tolist(), big.cols.tolist()
    assert rows[:32] == list(range(32)) and rows[-32:] == list(range(4064, 4096)) and len(rows) == 128
    assert cols[:64] == list(range(64)) and cols[-64:] == list(range(3008, 3072)) and len(set(cols)) == 256


# ----- injected kernels, through linear() -----

@pytest.mark.parametrize("how", ["wrong", "zeros", "nan"])
def test_a_wrong_int8_kernel_is_refused_and_weight_only_runs(monkeypatch, caplog, how):
    _, w8 = _weights()
    x = _x()
    inject_int8(monkeypatch, how)
    with caplog.at_level("WARNING", logger="fp8_engram.quant.compute.linear"):
        y = linear(x, w8, None, AUTO)
        y2 = linear(x, w8, None, AUTO)
    expected = linear(x, w8, None, ComputeConfig(path="weight_only"))
    assert torch.equal(y, expected) and torch.equal(y2, expected)
    v = verdict("int8")
    assert v.chosen == "weight-only" and v.proofs["int8"]["ok"] is False and v.proofs["weight-only"]["ok"] is True
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1 and "int8" in refused[0], refused
    assert ("NaN/Inf positions" in refused[0]) if how == "nan" else ("dB" in refused[0] and "twin" in refused[0])
    assert any("wrong on this device" in line for line in default_book().summary_lines("cpu"))


def test_a_forced_int8_path_that_is_wrong_runs_weight_only(monkeypatch):
    w, _ = _weights()
    x = _x()
    inject_int8(monkeypatch, "wrong")
    y = linear(x, w, None, ComputeConfig(path="int8"))
    assert torch.equal(y, torch.nn.functional.linear(x, w.dequantize(torch.bfloat16)))  # the FP8 weight, not int8
    v = verdict("int8")
    assert v.chosen == "weight-only" and v.why.startswith("forced, refused")


def test_the_slow_path_loses_either_way(monkeypatch, clock):
    _, w8 = _weights()
    x = _x()
    inject_int8(monkeypatch, "slow", clock=clock)
    linear(x, w8, None, AUTO)
    v = verdict("int8")
    assert v.proofs["int8"]["ok"] and v.chosen == "weight-only", v.as_dict()
    assert v.seconds["int8"] == pytest.approx(0.2) and v.seconds["weight-only"] == 0.0
    # and the other way: the plain path made slow, the (right) int8 path wins
    monkeypatch.undo()
    monkeypatch.setattr(proof, "clock_for", clock.for_device)
    default_book().reset()
    slow_plain(monkeypatch, clock)
    calls = []
    inject_int8(monkeypatch, "none", calls)
    y = linear(x, w8, None, AUTO)
    v = verdict("int8")
    assert v.chosen == "int8" and v.seconds["weight-only"] == pytest.approx(0.5), v.as_dict()
    assert torch.equal(y, qint8.int8_linear(x, w8, None, torch.bfloat16))
    n = len(calls)
    linear(x, w8, None, AUTO)
    assert len(calls) == n + 1  # decided and checked once: the second call runs the kernel once, proves nothing


def test_a_wrong_scaled_mm_is_refused_on_the_forced_fp8_path(monkeypatch, caplog):
    if not CPU_ROW_SCALES:
        pytest.skip(f"torch {torch.__version__} has no CPU scaled matmul with per-row scales (the fp8 path's form)")
    w, _ = _weights()
    x = _x()
    right = linear(x, w, None, ComputeConfig(path="fp8"))
    assert verdict("fp8 x fp8 per row").chosen == "fp8"
    default_book().reset()
    real = sm._scaled_mm
    monkeypatch.setattr(sm, "_scaled_mm", lambda *a: real(*a) * 1.01)
    with caplog.at_level("WARNING", logger="fp8_engram.quant.compute.linear"):
        y = linear(x, w, None, ComputeConfig(path="fp8"))
    assert torch.equal(y, torch.nn.functional.linear(x, w.dequantize(torch.bfloat16)))
    assert not torch.equal(y, right)
    assert any("refused" in r.getMessage() for r in caplog.records)


def test_trusting_fast_paths_proves_nothing(monkeypatch):
    _, w8 = _weights()
    inject_int8(monkeypatch, "wrong")
    y = linear(_x(), w8, None, ComputeConfig(path="int8", trust_fast_paths=True))
    assert not default_book().verdicts("cpu")
    assert not torch.equal(y, linear(_x(), w8, None, ComputeConfig(path="weight_only")))


def test_each_config_keeps_its_own_book(tmp_path):
    """A loader's book (its file) and the default book do not share verdicts."""
    book = Book(tmp_path / "fast_paths.json")
    _, w8 = _weights()
    linear(_x(), w8, None, ComputeConfig(book=book))
    assert verdict("int8", book).source == "measured" and not default_book().verdicts("cpu")
    assert (tmp_path / "fast_paths.json").exists()


# ----- the verdict file -----

_SECOND = r"""
import json, sys
import torch
from fp8_engram.quant import ComputeConfig, PerRow, QuantizedTensor, linear
from fp8_engram.quant.compute import Book, book as book_module, int8 as qint8
if sys.argv[2] == "new-pack":
    book_module._pack_version = lambda: "99.0"
book = Book(sys.argv[1])
w = torch.randn(256, 512, generator=torch.Generator().manual_seed(0)) * 0.05
w8 = qint8.to_int8(QuantizedTensor.from_float(w, PerRow()))
x = torch.randn(40, 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
linear(x, w8, None, ComputeConfig(book=book))
v = [v for v in book.verdicts("cpu") if v.kind == "int8"][0]
print(json.dumps({"source": v.source, "chosen": v.chosen}))
"""


def _run_second(path, mode="same"):
    import os
    import subprocess
    import sys
    from pathlib import Path

    import fp8_engram

    env = dict(os.environ, PYTHONPATH=str(Path(fp8_engram.__file__).parent.parent))  # the link the tests import it by
    out = subprocess.run([sys.executable, "-c", _SECOND, str(path), mode], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_reuses_the_verdicts_and_a_changed_stack_proves_again(tmp_path):
    path = tmp_path / "user" / "fp8_engram" / "fast_paths.json"
    book = Book(path)
    _, w8 = _weights()
    linear(_x(), w8, None, ComputeConfig(book=book))
    first = verdict("int8", book)
    assert first.source == "measured" and path.exists()
    data = json.loads(path.read_text())
    (sid, entry), = data["stacks"].items()
    assert entry["stack"]["device_type"] == "cpu" and entry["stack"]["torch"] == torch.__version__
    assert first.key.as_json() in [v["key"] for v in entry["verdicts"]]
    again = _run_second(path)
    assert again["source"] == "cache" and again["chosen"] == first.chosen
    changed = _run_second(path, "new-pack")
    assert changed["source"] == "measured"
    assert len(json.loads(path.read_text())["stacks"]) == 2  # the old stack's verdicts are kept beside it


def test_forget_proves_again(tmp_path):
    path = tmp_path / "fast_paths.json"
    book = Book(path)
    _, w8 = _weights()
    cfg = ComputeConfig(book=book)
    linear(_x(), w8, None, cfg)
    book.forget("cpu")
    assert not book.verdicts("cpu") and not json.loads(path.read_text())["stacks"]
    linear(_x(), w8, None, cfg)
    assert verdict("int8", book).source == "measured"


# ----- the selftest CLI -----

def test_selftest_tells_a_wrong_kernel_and_a_right_one(monkeypatch, capsys):
    from fp8_engram.quant import selftest

    monkeypatch.setattr(selftest, "SHAPES", {"sd3": ((256, 512),)})
    assert selftest.main(["--device", "cpu", "--models", "sd3", "--tokens", "16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    kinds = {v["kind"] for v in report["verdicts"]}
    assert {"int8", "fp8 x fp8 per row"} <= kinds, kinds
    for v in report["verdicts"]:  # where this torch's CPU scaled matmul takes no per-row scales, fp8 raises
        for name, p in v["proofs"].items():
            assert p["ok"] or (not CPU_ROW_SCALES and name == "fp8" and p["why"].startswith("raised")), v
    assert report["stack"]["device_type"] == "cpu"
    inject_int8(monkeypatch, "wrong")
    assert selftest.main(["--device", "cpu", "--models", "sd3", "--tokens", "16"]) == 0
    text = capsys.readouterr().out
    int8_rows = [line for line in text.splitlines() if line.startswith("int8 ")]
    assert int8_rows and all("wrong on this device" in line for line in int8_rows), text
    assert all(" weight-only " in line for line in int8_rows), text


def test_a_product_too_small_to_pay_for_proving_takes_the_plain_path(monkeypatch):
    """Under "auto", a product under SMALL_MACS multiply-adds at its class's token count is not proven nor
    timed: weight-only, filed as a rule in memory and not in the file; a forced path is still proven, and a
    book that proves every size (the selftest's) proves it."""
    calls = []
    inject_int8(monkeypatch, "none", calls)
    _, w8 = _weights(n=128, k=256)
    x = _x(m=40, k=256)
    book = default_book()
    assert prove.too_small(book, 40, 128, 256) and not prove.too_small(book, 40, 256, 512)
    y = linear(x, w8, None, AUTO)
    assert not calls, "a small product ran the int8 kernel under auto"
    assert torch.equal(y, linear(x, w8, None, ComputeConfig(path="weight_only")))
    v = verdict("int8")
    assert v.source == "rule" and v.chosen == "weight-only" and "too small" in v.why and not v.proofs
    linear(x, w8, None, ComputeConfig(path="int8"))  # forced: proven (another key), then run
    assert calls and any(v.proofs for v in book.verdicts("cpu"))
    every = Book(every_size=True)
    linear(x, w8, None, ComputeConfig(book=every))
    assert verdict("int8", every).source == "measured"
    # a ComfyUI ConvRot weight of the same size: its plain path rotates the whole weight back per call
    # (256 x 256 x 256 multiply-adds more than the product), so it is proven and timed after all
    book.reset()
    convrot = QuantizedTensor.from_float(torch.randn(256, 256) * 0.05, Int8(False, 256, True), fp8_dtype=torch.int8)
    assert prove.too_small(book, 40, 256, 256)  # by its product alone it would be
    linear(x, convrot, None, AUTO)
    assert verdict("int8").source == "measured"


def test_timing_stops_once_one_candidate_is_decisively_faster(clock):
    calls = {"fast": 0, "slow": 0}

    def fn(name, seconds):
        def run():
            calls[name] += 1
            clock.advance(seconds)
        return run

    fns = {"fast": fn("fast", 0.001), "slow": fn("slow", 0.02)}
    got = proof.time_interleaved(fns, "cpu", rounds=3, decisive=2.0)
    assert calls == {"fast": 2, "slow": 2} and got == {"fast": pytest.approx(0.001), "slow": pytest.approx(0.02)}
    proof.time_interleaved(fns, "cpu", rounds=3)  # without: every round
    assert calls == {"fast": 5, "slow": 5}
    close = {"fast": fn("fast", 0.005), "slow": fn("slow", 0.006)}
    calls.update(fast=0, slow=0)
    proof.time_interleaved(close, "cpu", rounds=3, decisive=2.0)  # within 2x: all rounds
    assert calls == {"fast": 3, "slow": 3}


def test_one_call_slowed_by_something_else_does_not_decide(clock):
    """The plain path's first timed call is slowed tenfold once (another process, a page fault storm): it
    still measures as what it is, faster than the candidate (the decisive stop waits for a second round)."""
    seen = {"plain": 0}

    def plain_call():
        seen["plain"] += 1
        clock.advance(0.05 if seen["plain"] == 1 else 0.003)

    got = proof.time_interleaved({"fast": lambda: clock.advance(0.008), "plain": plain_call}, "cpu", rounds=3,
                                 decisive=2.0)
    assert got["plain"] < got["fast"], got
    assert seen["plain"] >= 2, "stopped on the slowed call"


def test_a_large_layer_is_proven_and_timed_on_its_first_rows(monkeypatch):
    """On the CPU, a weight of more than 2 x TIME_ROWS rows: the fast path is proven on its first TIME_ROWS rows
    (the rows it is timed on), every candidate timed on its first SMALL_ROWS and TIME_ROWS rows, and the plain
    path (the reference math itself) is never run whole while deciding; the call's own output is the whole
    product, checked at its own shape before it serves (an int8 kernel wrong only past the proven rows is
    caught there: test_an_error_past_the_proven_rows_is_caught_at_the_call)."""
    calls = []
    real_mm = qint8.int8_linear_mm

    def recording(xq, sa, wq, sb, bias, out_dtype):
        calls.append(("int8", wq.shape[0]))
        return real_mm(xq, sa, wq, sb, bias, out_dtype)

    monkeypatch.setattr(qint8, "int8_linear_mm", recording)
    real_dq = plain._dequantized

    def dequantized(x, w, *args, **kwargs):
        calls.append(("weight-only", w.qdata.shape[0]))
        return real_dq(x, w, *args, **kwargs)

    monkeypatch.setattr(plain, "_dequantized", dequantized)
    checked = []
    real_check = prove.check_call
    monkeypatch.setattr(prove, "check_call", lambda *a, **kw: checked.append(tuple(a[4].shape)) or real_check(*a, **kw))
    rows = 2 * prove.TIME_ROWS + 512
    _, w8 = _weights(n=rows, k=256)
    x = _x(m=40, k=256)
    y = linear(x, w8, None, AUTO)
    v = verdict("int8")
    assert v.source == "measured" and set(v.seconds) == {"int8", "weight-only"}, v.as_dict()
    assert calls.count(("int8", rows)) == 1, "the whole weight ran int8 other than for the call itself"
    whole_plain = [c for c in calls if c == ("weight-only", rows)]
    assert len(whole_plain) <= 1, "the plain path ran on the whole weight while deciding"
    assert {("int8", prove.TIME_ROWS), ("weight-only", prove.TIME_ROWS), ("int8", prove.SMALL_ROWS),
            ("weight-only", prove.SMALL_ROWS)} <= set(calls), calls
    assert y.shape == (40, rows)
    assert checked == [(40, 256)], "the call's own shape was not checked before it served"
    assert v.proofs["weight-only"]["ok"] and v.proofs["weight-only"]["why"] == "the plain path"


def test_an_error_past_the_proven_rows_is_caught_at_the_call(monkeypatch):
    """An int8 kernel right on a large weight's first TIME_ROWS rows (where it is proven and timed) and wrong in
    its last output: the call's own check refuses it, on record, and the call returns the plain path's output."""
    rows = 2 * prove.TIME_ROWS + 512
    int8_wrong_for(monkeypatch, rows)
    _, w8 = _weights(n=rows, k=256)
    x = _x(m=40, k=256)
    y = linear(x, w8, None, AUTO)
    v = verdict("int8")
    assert v.chosen == "weight-only" and not v.proofs["int8"]["ok"], v.as_dict()
    assert "wrong at 40 x 256" in v.proofs["int8"]["why"], v.as_dict()
    want = torch.nn.functional.linear(x.float(), w8.dequantize(torch.float32)).to(y.dtype)
    assert torch.allclose(y.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_the_whole_layer_time_is_the_line_through_two_slices():
    """A per-call part (an activation quantizer) and a per-row part: the line through the two slices'
    times gives the whole layer's, where scaling the larger slice alone would count the per-call part
    rows / TIME_ROWS times."""
    per_call, per_row = 0.004, 1e-5
    t = {r: per_call + per_row * r for r in (prove.SMALL_ROWS, prove.TIME_ROWS)}
    whole = prove.extrapolate(t[prove.SMALL_ROWS], t[prove.TIME_ROWS], prove.SMALL_ROWS, prove.TIME_ROWS, 12288)
    assert abs(whole - (per_call + per_row * 12288)) < 1e-9
    assert prove.extrapolate(0.002, 0.001, 128, 1024, 4096) == 0.004  # noise made the small slice slower


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the real kernels are proven there)")
def test_every_path_proves_right_on_this_gpu(capsys, monkeypatch):
    """selftest on cuda:0 (SD3 shapes, 16 and 1024 tokens): every kernel this GPU runs (the weight-only and
    NVFP4 GEMMs, int8 where Triton compiles it, fp8 x fp8 per row / tensor / block-wise on FP8 GPUs) is
    proven right against its twin; a kernel refused here is a bug of the pack on this GPU."""
    from fp8_engram.quant import selftest

    monkeypatch.setattr(proof, "clock_for", proof._clock)  # real timing on the GPU
    assert selftest.main(["--device", "cuda:0", "--models", "sd3", "--tokens", "16,1024", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    refused = [(v["kind"], v["key"], name, p["why"]) for v in report["verdicts"] for name, p in v["proofs"].items()
               if not p["ok"]]
    assert not refused, refused
    kinds = {v["kind"] for v in report["verdicts"]}
    assert {"weight-only GEMM", "NVFP4 GEMM"} <= kinds, kinds
    if torch.cuda.get_device_capability() >= (8, 9):
        assert {"fp8 x fp8 per row", "fp8 x fp8 per tensor", "fp8 x fp8 block-wise"} <= kinds, kinds


def test_a_call_in_steady_state_neither_proves_nor_rebuilds_its_route(monkeypatch):
    """After the first call of a kind (proof) and of a shape (check), a call is the route cached on the
    weight, the book's pick and the run: nothing is built, decided or checked again."""
    _, w8 = _weights()
    x = _x()
    first = linear(x, w8, None, AUTO)
    lin = importlib.import_module("fp8_engram.quant.compute.linear")
    calls = []
    monkeypatch.setattr(lin, "_build", lambda *a: calls.append("build"))
    monkeypatch.setattr(prove, "decide", lambda *a: calls.append("decide"))
    monkeypatch.setattr(prove, "check_call", lambda *a: calls.append("check"))
    for _ in range(3):
        assert torch.equal(linear(x, w8, None, AUTO), first)
    assert not calls, calls
