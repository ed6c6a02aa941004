"""comfy-kitchen's int8_linear as a path of the registry (quant/compute/paths/kitchen.py), with a pinned
comfy-kitchen release (helpers/kitchen.py installs it; the test skips, naming pip's reason, where it
cannot). Run in a subprocess whose `import comfy_kitchen` finds that release, on the CPU (kitchen's eager
backend, what stock ComfyUI 0.29+ runs there): the candidate is offered for the int8 weights kitchen
computes (one scale per tensor or row, no rotation or ComfyUI's ConvRot) and proven and timed beside the
pack's; made 1% wrong, or made to compute another product than the weight's, it is refused; chosen, it
is what the call runs; the pack's own rotated int8 gets no kitchen candidate.
"""

import json
import os

import pytest
from helpers.kitchen import kitchen_dir, run_kitchen

pytestmark = pytest.mark.unit

KITCHEN = "0.2.40"
PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), ".host", "pkg")

SCRIPT = r"""
import importlib, json, sys
sys.path.insert(0, sys.argv[1])
import torch
from fp8_engram.quant import ComputeConfig, QuantizedTensor
from fp8_engram.quant.compute import Book, proof
from fp8_engram.quant.compute.linear import linear
from fp8_engram.quant.compute.paths import kitchen, plain
int8mod = importlib.import_module("fp8_engram.quant.compute.int8")
from fp8_engram.quant.layouts import Int8

clock = [0.0]  # a fake clock that only the slowed paths below advance: no wall-clock margin decides

def fake_clock(device):
    def timed(fn):
        t0 = clock[0]
        fn()
        return clock[0] - t0
    return timed

proof.clock_for = fake_clock
book = Book()
AUTO = ComputeConfig(book=book)
g = torch.Generator().manual_seed(0)
w = torch.randn(512, 1024, generator=g) * 0.03
x = torch.randn(200, 1024, generator=g).bfloat16()
x[:, ::97] *= 30
weights = {"convrot": Int8(False, 256, True), "rows": Int8(True, 0), "pack's own": Int8(True, 128, False)}
weights = {k: QuantizedTensor.from_float(w, layout, fp8_dtype=torch.int8) for k, layout in weights.items()}

def verdict(name):
    book.reset()
    y = linear(x, weights[name], None, AUTO)
    v = [v for v in book.verdicts("cpu") if v.kind == "int8"][0]
    return y, {"chosen": v.chosen, "why": v.why, "proofs": v.proofs, "seconds": v.seconds}

out = {"takes": {k: kitchen.takes(q) for k, q in weights.items()}}
for name in weights:
    out[name] = verdict(name)[1]

real = kitchen.int8_linear
kitchen.int8_linear = lambda *a, **k: real(*a, **k) * 1.01  # kitchen's kernel 1% off, its eager code right
y, out["wrong"] = verdict("convrot")
wo = linear(x, weights["convrot"], None, ComputeConfig(path="weight_only"))
ours = linear(x, weights["convrot"], None, ComputeConfig(path="int8"))
out["wrong_output_is_a_right_path"] = bool(torch.equal(y, wo) or torch.equal(y, ours))
kitchen.int8_linear = real

real_args = kitchen._args
kitchen._args = lambda w8: dict(real_args(w8), convrot=False)  # kernel and eager code agree, on another product
out["other product"] = verdict("convrot")[1]
kitchen._args = real_args

def slow(fn):  # 0.5 s on the fake clock: slower than kitchen's calls, which take none
    def run(*a, **k):
        clock[0] += 0.5
        return fn(*a, **k)
    return run
plain._dequantized, int8mod.int8_linear = slow(plain._dequantized), slow(int8mod.int8_linear)
y, out["fastest"] = verdict("rows")
out["chosen_output_is_kitchens"] = bool(torch.equal(y, kitchen.int8_linear(x, weights["rows"], None, torch.bfloat16)))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def report():
    done = run_kitchen(kitchen_dir(KITCHEN), SCRIPT, PKG)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_kitchen_is_a_candidate_for_the_int8_weights_it_computes(report):
    assert report["takes"] == {"convrot": True, "rows": True, "pack's own": False}
    for name in ("convrot", "rows"):
        proof = report[name]["proofs"]["kitchen int8"]
        assert proof["ok"] and proof["sqnr_db"] >= proof["twin_db"] - 3, report[name]
        assert "kitchen int8" in report[name]["seconds"], report[name]
    assert "kitchen int8" not in report["pack's own"]["proofs"], report["pack's own"]


def test_a_wrong_kitchen_kernel_is_refused(report):
    proof = report["wrong"]["proofs"]["kitchen int8"]
    assert not proof["ok"] and "dB" in proof["why"] and "needs" in proof["why"], proof
    assert report["wrong"]["chosen"] != "kitchen int8"
    assert report["wrong_output_is_a_right_path"]


def test_kitchen_computing_another_product_is_refused(report):
    proof = report["other product"]["proofs"]["kitchen int8"]
    assert not proof["ok"] and "another product" in proof["why"], proof
    assert report["other product"]["chosen"] != "kitchen int8"


def test_kitchen_chosen_where_fastest_runs_the_call(report):
    assert report["fastest"]["chosen"] == "kitchen int8", report["fastest"]
    assert report["chosen_output_is_kitchens"]
