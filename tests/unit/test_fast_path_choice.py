"""Fast paths proven by value and chosen by measurement (quant/compute/choice.py), on the CPU.

Kernels are injected through the real dispatch: the CPU int8 GEMM (``torch._int_mm`` behind
``compute.int8.int8_linear_mm``) and the scaled matmul (``compute.scaled_mm._scaled_mm``) are replaced by
versions that are 1% off, return zeros, return NaN or sleep; ``linear`` then proves them on first use.
On a CUDA GPU, test_every_path_proves_right_on_this_gpu runs the real proofs of every kernel (selftest
on the SD3 shapes); the kernels' own value checks are in test_kernels_cuda.py (skipped without a GPU).
"""

from __future__ import annotations

import importlib
import json
import logging
import subprocess
import sys
import time

import pytest
import torch

from fp8_engram.quant import ComputeConfig, PerRow, QuantizedTensor, linear
from fp8_engram.quant.compute import choice, int8 as qint8, proof
from fp8_engram.quant.layouts import Int8

sm = importlib.import_module("fp8_engram.quant.compute.scaled_mm")
lin = importlib.import_module("fp8_engram.quant.compute.linear")

AUTO = ComputeConfig(path="auto")


def _weights(n=256, k=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    return QuantizedTensor.from_float(w, PerRow()), qint8.to_int8(QuantizedTensor.from_float(w, PerRow()))


def _x(m=40, k=512, seed=1):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _inject_int8(monkeypatch, how: str, calls: list | None = None):
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
            time.sleep(0.2)
        return out

    monkeypatch.setattr(qint8, "int8_linear_mm", fake)


def _slow_plain(monkeypatch, seconds=0.5):
    """The weight-only path made slower per call (its CPU dequantization) than any int8 product here."""
    real = lin._dequantized_weight

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    monkeypatch.setattr(lin, "_dequantized_weight", slow)


def _verdict(kind: str):
    found = [v for v in choice.verdicts("cpu") if v.kind == kind]
    assert len(found) == 1, [v.key for v in choice.verdicts("cpu")]
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
    verdict = proof.judge(nan, twin, ref)
    assert not verdict.ok and "NaN/Inf positions" in verdict.why
    # an infinity where the reference has one is no fault
    ref_inf = ref.clone()
    ref_inf[0, 0] = float("inf")
    both = twin.clone()
    both[0, 0] = float("inf")
    assert proof.judge(both, both, ref_inf).ok
    # a twin with float32 output is held to the ceiling, not to its own 140 dB
    exactish = ref.float()
    assert proof.judge(ref * (1 + 1e-4), exactish, ref).ok  # 80 dB: far above any wrong kernel


# ----- injected kernels, through linear() -----

@pytest.mark.parametrize("how", ["wrong", "zeros", "nan"])
def test_a_wrong_int8_kernel_is_refused_and_weight_only_runs(monkeypatch, caplog, how):
    _, w8 = _weights()
    x = _x()
    _inject_int8(monkeypatch, how)
    with caplog.at_level(logging.WARNING, logger="fp8_engram.quant.compute.linear"):
        y = linear(x, w8, None, AUTO)
        y2 = linear(x, w8, None, AUTO)
    expected = linear(x, w8, None, ComputeConfig(path="weight_only"))  # what the weight-only path gives
    assert torch.equal(y, expected) and torch.equal(y2, expected)
    v = _verdict("int8")
    assert v.chosen == "weight-only" and v.proofs["int8"]["ok"] is False
    assert "weight-only" in v.proofs and v.proofs["weight-only"]["ok"] is True
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1 and "int8" in refused[0], refused  # logged once, with the figures
    if how == "nan":
        assert "NaN/Inf positions" in refused[0]
    else:
        assert "dB" in refused[0] and "twin" in refused[0]
    assert any("wrong on this device" in line for line in choice.summary_lines("cpu"))


def test_a_forced_int8_path_that_is_wrong_runs_weight_only(monkeypatch):
    w, _ = _weights()
    x = _x()
    _inject_int8(monkeypatch, "wrong")
    y = linear(x, w, None, ComputeConfig(path="int8"))
    assert torch.equal(y, torch.nn.functional.linear(x, w.dequantize(torch.bfloat16)))  # the FP8 weight, not int8
    v = _verdict("int8")
    assert v.chosen == "weight-only" and v.why.startswith("forced, refused")


def test_the_slow_path_loses_either_way(monkeypatch):
    _, w8 = _weights()
    x = _x()
    _inject_int8(monkeypatch, "slow")
    linear(x, w8, None, AUTO)
    v = _verdict("int8")
    assert v.proofs["int8"]["ok"] and v.chosen == "weight-only", v.as_dict()
    assert v.seconds["int8"] > v.seconds["weight-only"] + 0.15
    # and the other way: the plain path made slow, the (right) int8 path wins
    monkeypatch.undo()
    choice.reset()
    _slow_plain(monkeypatch)
    calls = []
    _inject_int8(monkeypatch, "none", calls)
    y = linear(x, w8, None, AUTO)
    v = _verdict("int8")
    assert v.chosen == "int8" and "x weight-only" in v.why, v.as_dict()
    assert torch.equal(y, qint8.int8_linear(x, w8, None, torch.bfloat16))
    n = len(calls)
    linear(x, w8, None, AUTO)
    assert len(calls) == n + 1  # decided once: the second call runs the kernel once, proves nothing


def test_a_wrong_scaled_mm_is_refused_on_the_forced_fp8_path(monkeypatch, caplog):
    if sm.scaled_mm_api("cpu") is None:
        pytest.skip(f"torch {torch.__version__} has no scaled matmul with a CPU kernel")
    w, _ = _weights()
    x = _x()
    right = linear(x, w, None, ComputeConfig(path="fp8"))
    assert _verdict("fp8 x fp8 per row").chosen == "fp8"
    choice.reset()
    real = sm._scaled_mm
    monkeypatch.setattr(sm, "_scaled_mm", lambda *a: real(*a) * 1.01)
    with caplog.at_level(logging.WARNING, logger="fp8_engram.quant.compute.linear"):
        y = linear(x, w, None, ComputeConfig(path="fp8"))
    assert torch.equal(y, torch.nn.functional.linear(x, w.dequantize(torch.bfloat16)))
    assert not torch.equal(y, right)
    assert any("refused" in r.getMessage() for r in caplog.records)


def test_the_int8_conversion_at_load_is_decided_by_measurement(monkeypatch):
    w, _ = _weights()
    _slow_plain(monkeypatch)
    assert lin.int8_conversion_wins(w, "cpu") is True
    monkeypatch.undo()
    choice.reset()
    _inject_int8(monkeypatch, "slow")
    assert lin.int8_conversion_wins(w, "cpu") is False
    v = _verdict("int8 at load")
    assert v.chosen == "weight-only" and set(v.seconds) == {"int8", "weight-only"}
    # trusting fast paths: by capability, nothing measured
    choice.reset()
    trusted = w.with_config(ComputeConfig(trust_fast_paths=True))
    assert lin.int8_conversion_wins(trusted, "cpu") is qint8.int8_supported("cpu")
    assert not choice.verdicts("cpu")


def test_trusting_fast_paths_proves_nothing(monkeypatch):
    _, w8 = _weights()
    _inject_int8(monkeypatch, "wrong")
    y = linear(_x(), w8, None, ComputeConfig(path="int8", trust_fast_paths=True))
    assert not choice.verdicts("cpu")
    assert not torch.equal(y, linear(_x(), w8, None, ComputeConfig(path="weight_only")))


# ----- the cache file -----

_SECOND = r"""
import json, sys, time
import torch
from fp8_engram.quant import ComputeConfig, PerRow, QuantizedTensor, linear
from fp8_engram.quant.compute import choice, int8 as qint8
if sys.argv[2] == "new-pack":
    choice._pack_version = lambda: "99.0"
choice.configure(sys.argv[1])
w = torch.randn(256, 512, generator=torch.Generator().manual_seed(0)) * 0.05
w8 = qint8.to_int8(QuantizedTensor.from_float(w, PerRow()))
x = torch.randn(40, 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
t0 = time.perf_counter()
linear(x, w8, None, ComputeConfig())
took = time.perf_counter() - t0
v = [v for v in choice.verdicts("cpu") if v.kind == "int8"][0]
print(json.dumps({"source": v.source, "chosen": v.chosen, "took": took}))
"""


def _run_second(path, mode="same"):
    import os
    from pathlib import Path

    import fp8_engram

    env = dict(os.environ, PYTHONPATH=str(Path(fp8_engram.__file__).parent.parent))  # the link the tests import it by
    out = subprocess.run([sys.executable, "-c", _SECOND, str(path), mode], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_reuses_the_verdicts_and_a_changed_stack_proves_again(tmp_path):
    path = tmp_path / "user" / "fp8_engram" / "fast_paths.json"
    choice.configure(path)
    _, w8 = _weights()
    linear(_x(), w8, None, AUTO)
    first = _verdict("int8")
    assert first.source == "measured" and path.exists()
    data = json.loads(path.read_text())
    (sid, entry), = data["stacks"].items()
    assert entry["stack"]["device_type"] == "cpu" and entry["stack"]["torch"] == torch.__version__
    assert first.key in entry["verdicts"]
    again = _run_second(path)
    assert again["source"] == "cache" and again["chosen"] == first.chosen
    changed = _run_second(path, "new-pack")
    assert changed["source"] == "measured"
    assert len(json.loads(path.read_text())["stacks"]) == 2  # the old stack's verdicts are kept beside it


def test_a_damaged_cache_file_is_proven_again_and_rewritten(tmp_path, caplog):
    path = tmp_path / "fast_paths.json"
    path.write_text("{ not json")
    choice.configure(path)
    _, w8 = _weights()
    with caplog.at_level(logging.WARNING, logger="fp8_engram.quant.compute.linear"):
        linear(_x(), w8, None, AUTO)
    assert any(str(path) in r.getMessage() for r in caplog.records)
    assert _verdict("int8").source == "measured"
    assert json.loads(path.read_text())["format"] == choice.FORMAT


def test_forget_proves_again(tmp_path):
    path = tmp_path / "fast_paths.json"
    choice.configure(path)
    _, w8 = _weights()
    linear(_x(), w8, None, AUTO)
    choice.forget("cpu")
    assert not choice.verdicts("cpu") and not json.loads(path.read_text())["stacks"]
    linear(_x(), w8, None, AUTO)
    assert _verdict("int8").source == "measured"


# ----- the selftest CLI -----

def test_selftest_tells_a_wrong_kernel_and_a_right_one(monkeypatch, capsys):
    from fp8_engram.quant import selftest

    monkeypatch.setattr(selftest, "SHAPES", {"sd3": ((256, 512),)})
    assert selftest.main(["--device", "cpu", "--models", "sd3", "--tokens", "16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    kinds = {v["kind"] for v in report["verdicts"]}
    assert {"int8", "int8 at load"} <= kinds, kinds
    assert all(p["ok"] for v in report["verdicts"] for p in v["proofs"].values())
    assert report["stack"]["device_type"] == "cpu"
    choice.reset()
    _inject_int8(monkeypatch, "wrong")
    assert selftest.main(["--device", "cpu", "--models", "sd3", "--tokens", "16"]) == 0
    text = capsys.readouterr().out
    int8_rows = [line for line in text.splitlines() if line.startswith("int8 ")]
    assert int8_rows and all("wrong on this device" in line for line in int8_rows), text
    assert all(" weight-only " in line for line in int8_rows), text


@pytest.mark.parametrize("layout", ["nvfp4", "mxfp8", "block", "per_tensor"])
def test_the_load_time_measurement_takes_every_layout_at_its_logical_shape(layout):
    """A packed NVFP4 weight's data is half as wide as the layer (the CI run that found it: a shape error
    at load); every layout a loader may meet is measured at the layer's own shape and converts right."""
    from fp8_engram.quant import MXFP8, NVFP4, Block, PerTensor

    shape = (160, 256)
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(2)) * 0.05
    make = {"nvfp4": lambda: NVFP4.for_shape(shape), "mxfp8": MXFP8, "block": lambda: Block(128, 128),
            "per_tensor": PerTensor}[layout]
    qt = QuantizedTensor.from_float(w, make())
    assert lin.int8_conversion_wins(qt, "cpu") in (True, False)
    v = _verdict("int8 at load")
    assert "n<=256|k<=256" in v.key and all(p["ok"] for p in v.proofs.values()), v.as_dict()


def test_a_product_too_small_to_pay_for_proving_takes_the_plain_path(monkeypatch):
    """Under "auto", a product under SMALL_MACS multiply-adds at its class's token count is not proven nor
    timed (a fast path could win microseconds a call, proving costs more): weight-only, filed as a rule
    in memory and not in the cache; a forced path is still proven, and selftest proves every size."""
    calls = []
    _inject_int8(monkeypatch, "none", calls)
    _, w8 = _weights(n=128, k=256)
    x = _x(m=40, k=256)
    assert choice.too_small(40, 128, 256) and not choice.too_small(40, 256, 512)
    y = linear(x, w8, None, AUTO)
    assert not calls, "a small product ran the int8 kernel under auto"
    assert torch.equal(y, linear(x, w8, None, ComputeConfig(path="weight_only")))
    v = _verdict("int8")
    assert v.source == "rule" and v.chosen == "weight-only" and "too small" in v.why and not v.proofs
    linear(x, w8, None, ComputeConfig(path="int8"))  # forced: proven (another key), then run
    assert calls and any(v.proofs for v in choice.verdicts("cpu"))
    choice.reset()
    with choice.every_size():
        linear(x, w8, None, AUTO)
    assert _verdict("int8").source == "measured"
    # a ComfyUI ConvRot weight of the same size: its plain path rotates the whole weight back per call
    # (256 x 256 x 256 multiply-adds more than the product), so it is proven and timed after all
    choice.reset()
    convrot = QuantizedTensor.from_float(torch.randn(256, 256) * 0.05, Int8(False, 256, True), fp8_dtype=torch.int8)
    assert choice.too_small(40, 256, 256)  # by its product alone it would be
    linear(x, convrot, None, AUTO)
    assert _verdict("int8").source == "measured"


def test_timing_stops_once_one_candidate_is_decisively_faster():
    from fp8_engram.quant.compute import proof

    calls = {"fast": 0, "slow": 0}

    def fn(name, seconds):
        def run():
            calls[name] += 1
            time.sleep(seconds)
        return run

    fns = {"fast": fn("fast", 0.001), "slow": fn("slow", 0.02)}
    got = proof.time_interleaved(fns, "cpu", rounds=3, decisive=2.0)
    assert calls == {"fast": 2, "slow": 2} and got["slow"] > 2 * got["fast"]  # two rounds, then decided
    proof.time_interleaved(fns, "cpu", rounds=3)  # without: every round
    assert calls == {"fast": 5, "slow": 5}
    close = {"a": fn("fast", 0.005), "b": fn("slow", 0.006)}
    calls.update(fast=0, slow=0)
    proof.time_interleaved(close, "cpu", rounds=3, decisive=2.0)  # within 2x: all rounds
    assert calls == {"fast": 3, "slow": 3}


def test_a_large_layer_is_timed_on_its_first_rows(monkeypatch):
    """On the CPU, a weight of more than 2 x TIME_ROWS rows: the fast path's proof runs on the whole
    weight, the timing of every candidate on its first SMALL_ROWS and TIME_ROWS rows, and the plain path
    (the reference math itself) is never run whole while deciding; the call's own output is the whole
    product."""
    calls = []
    _inject_int8(monkeypatch, "none")
    real_mm = qint8.int8_linear_mm

    def recording(xq, sa, wq, sb, bias, out_dtype):
        calls.append(("int8", wq.shape[0]))
        return real_mm(xq, sa, wq, sb, bias, out_dtype)

    monkeypatch.setattr(qint8, "int8_linear_mm", recording)
    real_dq = lin._dequantized_weight

    def dequantized(x, w, *args, **kwargs):
        calls.append(("weight-only", w.qdata.shape[0]))
        return real_dq(x, w, *args, **kwargs)

    monkeypatch.setattr(lin, "_dequantized_weight", dequantized)
    rows = 2 * choice.TIME_ROWS + 512
    _, w8 = _weights(n=rows, k=256)
    x = _x(m=40, k=256)
    y = linear(x, w8, None, AUTO)
    v = _verdict("int8")
    assert v.source == "measured" and set(v.seconds) == {"int8", "weight-only"}, v.as_dict()
    deciding = calls[:-1]  # the last call is the product itself, on the chosen path
    assert ("int8", rows) in deciding, "the int8 kernel was not proven on the whole weight"
    assert ("weight-only", rows) not in deciding, "the plain path ran on the whole weight while deciding"
    assert {("int8", choice.TIME_ROWS), ("weight-only", choice.TIME_ROWS), ("int8", choice.SMALL_ROWS),
            ("weight-only", choice.SMALL_ROWS)} <= set(deciding), deciding
    assert calls[-1][1] == rows and y.shape == (40, rows)
    assert v.proofs["weight-only"]["ok"] and v.proofs["weight-only"]["why"] == "the plain path"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the real kernels are proven there)")
def test_every_path_proves_right_on_this_gpu(capsys):
    """selftest on cuda:0 (SD3 shapes, 16 and 1024 tokens): every kernel this GPU runs (the weight-only and
    NVFP4 GEMMs, int8 where Triton compiles it, fp8 x fp8 per row / tensor / block-wise on FP8 GPUs) is
    proven right against its twin; a kernel refused here is a bug of the pack on this GPU."""
    from fp8_engram.quant import selftest

    assert selftest.main(["--device", "cuda:0", "--models", "sd3", "--tokens", "16,1024", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    refused = [(v["kind"], v["key"], name, p["why"]) for v in report["verdicts"] for name, p in v["proofs"].items()
               if not p["ok"]]
    assert not refused, refused
    kinds = {v["kind"] for v in report["verdicts"]}
    assert {"weight-only GEMM", "NVFP4 GEMM"} <= kinds, kinds
    if torch.cuda.get_device_capability() >= (8, 9):
        assert {"fp8 x fp8 per row", "fp8 x fp8 per tensor", "fp8 x fp8 block-wise"} <= kinds, kinds


def test_one_call_slowed_by_something_else_does_not_decide():
    """The plain path's first timed call is slowed tenfold once (another process, a page fault storm): it
    still measures as what it is, faster than the candidate (the decisive stop waits for a second round)."""
    from fp8_engram.quant.compute import proof

    seen = {"plain": 0}

    def plain():
        seen["plain"] += 1
        time.sleep(0.05 if seen["plain"] == 1 else 0.003)

    got = proof.time_interleaved({"fast": lambda: time.sleep(0.008), "plain": plain}, "cpu", rounds=3, decisive=2.0)
    assert got["plain"] < got["fast"], got
    assert seen["plain"] >= 2, "stopped on the slowed call"


def test_the_whole_layer_time_is_the_line_through_two_slices():
    """A per-call part (an activation quantizer) and a per-row part: the line through the two slices'
    times gives the whole layer's, where scaling the larger slice alone would count the per-call part
    rows / TIME_ROWS times."""
    per_call, per_row = 0.004, 1e-5
    t = {r: per_call + per_row * r for r in (choice.SMALL_ROWS, choice.TIME_ROWS)}
    whole = choice.extrapolate(t[choice.SMALL_ROWS], t[choice.TIME_ROWS], choice.SMALL_ROWS, choice.TIME_ROWS, 12288)
    assert abs(whole - (per_call + per_row * 12288)) < 1e-9
    # noise made the small slice the slower one: in proportion to the larger slice
    assert choice.extrapolate(0.002, 0.001, 128, 1024, 4096) == 0.004
