"""comfy-kitchen's AWQ W4A16 and SVDQuant W4A4 linears as paths of the registry
(quant/compute/paths/kitchen_int4.py), with the pinned comfy-kitchen release (helpers/kitchen.py).

The layers are made by kitchen's own code (helpers/kitchen_awq.py, helpers/kitchen_svdquant.py) and read by
the pack's loader; the calls go through the real dispatch (``linear`` with an "auto" config and a test book) in
a subprocess whose ``import comfy_kitchen`` finds that release, on the CPU. The candidates are offered on CUDA
devices only (where kitchen's CUDA backend runs them); no GPU runs here, so the device check is opened for the
test (``fast_here``) and kitchen's public ops run its eager backend: this shows the paths' logic (operands,
proofs, refusals, the route served), not that kitchen's CUDA kernels pass their proofs, which needs a GPU.
"""

import json
import os

import pytest
from helpers.kitchen import kitchen_dir, run_kitchen
from helpers.kitchen_awq import write_awq_file
from helpers.kitchen_svdquant import write_svdquant_file

pytestmark = pytest.mark.unit

KITCHEN = "0.2.40"
PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), ".host", "pkg")

# name: (out, in, group size, scale dtype, JSON declares the group size)
AWQ = {"awq": (512, 1024, 64, "bfloat16", True), "awq_f32": (512, 1024, 64, "float32", True)}
# name: (out, in, rank, dtype, weight_scale and proj_up tile-packed too, act_unsigned)
SVDQ = {"svdq": (512, 1024, 32, "bfloat16", True, False), "svdq_unsigned": (512, 1024, 32, "bfloat16", True, True),
        "svdq_natural_parts": (512, 1024, 32, "bfloat16", False, False),
        "svdq_f32": (512, 1024, 32, "float32", True, False)}

SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from fp8_engram.quant import ComputeConfig, formats
from fp8_engram.quant.compute import Book, proof
from fp8_engram.quant.compute.linear import linear, route_of
from fp8_engram.quant.compute.paths import plain
from fp8_engram.quant.compute.paths import kitchen_int4 as k4

out = {"cpu_is_fast": k4.fast_here(k4.SVDQ_OPS, "cpu") or k4.fast_here((k4.AWQ_OP,), "cpu")}
# No GPU here: the CUDA-only device check is opened so the paths' logic runs on kitchen's eager backend.
k4.fast_here = lambda ops, device, min_capability=(0, 0): True

clock = [0.0]  # a fake clock that only the slowed plain path advances: no wall-clock margin decides

def fake_clock(device):
    def timed(fn):
        t0 = clock[0]
        fn()
        return clock[0] - t0
    return timed

proof.clock_for = fake_clock
book = Book()
AUTO = ComputeConfig(book=book)
sd = {}
for path in sys.argv[2:]:
    sd.update(formats.load_file(path)[0])
layers = sorted(k[: -len(".weight")] for k in sd if k.endswith(".weight"))
g = torch.Generator().manual_seed(0)
x = torch.randn(200, 1024, generator=g).bfloat16()

def call(name, kind):
    book.reset()
    w, b = sd[name + ".weight"], sd[name + ".bias"]
    y = linear(x, w, b, AUTO)
    vs = [v for v in book.verdicts("cpu") if v.kind == kind]
    v = vs[0] if vs else None
    info = None if v is None else {"chosen": v.chosen, "why": v.why, "proofs": v.proofs, "seconds": v.seconds,
                                   "route": route_of(x, w, b, AUTO)}
    wo = linear(x, w, b, ComputeConfig(path="weight_only"))
    return y, info, bool(torch.equal(y, wo))

def offered(path, name):
    return path.operand(sd[name + ".weight"], AUTO, "cpu", torch.bfloat16) is not None

out["operand"] = {n: {"awq": offered(k4.KITCHEN_AWQ, n), "svdquant": offered(k4.KITCHEN_SVDQUANT, n)} for n in layers}
out["awq_at_fp16"] = k4.awq_takes(sd["awq.weight"], torch.float16)
out["forced_weight_only"] = k4.KITCHEN_AWQ.operand(sd["awq.weight"], ComputeConfig(path="weight_only"), "cpu",
                                                   torch.bfloat16) is not None
for name, kind in (("awq", "awq"), ("svdq", "svdquant"), ("svdq_unsigned", "svdquant")):
    out[name] = call(name, kind)[1]
for name in ("awq_f32", "svdq_natural_parts", "svdq_f32"):
    book.reset()
    linear(x, sd[name + ".weight"], sd[name + ".bias"], AUTO)
    out[name] = sorted({p for v in book.verdicts("cpu") for p in v.proofs})

def faulty(attr, wrong, name, kind):
    real = getattr(k4, attr)
    setattr(k4, attr, wrong(real))
    try:
        y, info, is_weight_only = call(name, kind)
    finally:
        setattr(k4, attr, real)
    return None if info is None else dict(info, served_weight_only=is_weight_only)

def scaled(real):
    return lambda *a, **k: real(*a, **k) * 1.01

def one_row(real):
    def run(*a, **k):
        y = real(*a, **k).clone()
        y[3] = -y[3]
        return y
    return run

out["awq 1.01"] = faulty("awq_linear", scaled, "awq", "awq")
out["awq row"] = faulty("awq_linear", one_row, "awq", "awq")
out["svdq 1.01"] = faulty("svdquant_mm", scaled, "svdq", "svdquant")
out["svdq row"] = faulty("svdquant_mm", one_row, "svdq", "svdquant")
out["svdq unsmoothed"] = faulty(
    "svdquant_quantize",
    lambda real: lambda x, w, parts: real(x, w, dict(parts, smooth_factor=torch.ones_like(parts["smooth_factor"]))),
    "svdq", "svdquant")
out["svdq shift twice"] = faulty("_svdq_bias", lambda real: lambda w, bias, cdt: bias, "svdq_unsigned", "svdquant")

def slow(fn):  # 0.5 s on the fake clock: slower than kitchen's calls, which take none
    def run(*a, **k):
        clock[0] += 0.5
        return fn(*a, **k)
    return run
plain._dequantized = slow(plain._dequantized)
for name, kind, fn in (("awq", "awq", k4.awq_linear), ("svdq", "svdquant", k4.svdquant_linear),
                       ("svdq_unsigned", "svdquant", k4.svdquant_linear)):
    y, info, _ = call(name, kind)
    b = sd[name + ".bias"].bfloat16()
    kitchens = bool(torch.equal(y, fn(x, sd[name + ".weight"], b, torch.bfloat16)))
    out["fastest " + name] = None if info is None else dict(info, served_is_kitchens=kitchens)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    folder = kitchen_dir(KITCHEN)
    awq_path, _ = write_awq_file(folder, AWQ, tmp_path_factory.mktemp("awq"))
    svdq_path, _ = write_svdquant_file(folder, SVDQ, tmp_path_factory.mktemp("svdq"))
    done = run_kitchen(folder, SCRIPT, PKG, str(awq_path), str(svdq_path))
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_candidates_only_for_the_weights_kitchens_kernels_take(report):
    assert report["cpu_is_fast"] is False  # the CPU never proves them
    assert report["operand"] == {
        "awq": {"awq": True, "svdquant": False}, "awq_f32": {"awq": False, "svdquant": False},
        "svdq": {"awq": False, "svdquant": True}, "svdq_unsigned": {"awq": False, "svdquant": True},
        "svdq_natural_parts": {"awq": False, "svdquant": False}, "svdq_f32": {"awq": False, "svdquant": False}}
    assert report["awq_at_fp16"] is False and report["forced_weight_only"] is False
    for name in ("awq_f32", "svdq_natural_parts", "svdq_f32"):
        assert not any(p.startswith("kitchen") for p in report[name]), report[name]


@pytest.mark.parametrize("name,path", [("awq", "kitchen awq"), ("svdq", "kitchen svdquant"),
                                       ("svdq_unsigned", "kitchen svdquant")])
def test_kitchens_product_is_proven(report, name, path):
    v = report[name]
    p = v["proofs"][path]
    assert p["ok"] and p["sqnr_db"] >= p["twin_db"] - 3, v
    assert path in v["seconds"] and "weight-only" in v["seconds"], v


@pytest.mark.parametrize("case,path", [("awq 1.01", "kitchen awq"), ("awq row", "kitchen awq"),
                                       ("svdq 1.01", "kitchen svdquant"), ("svdq row", "kitchen svdquant")])
def test_a_wrong_kitchen_kernel_is_refused_and_weight_only_served(report, case, path):
    v = report[case]
    p = v["proofs"][path]
    assert not p["ok"] and "needs" in p["why"], v
    assert v["chosen"] == "weight-only" and v["route"] == "weight-only", v
    assert v["served_weight_only"], v


def test_kitchens_quantizer_computing_another_product_is_refused(report):
    # the GEMM is right on the codes it is given (its proof against kitchen's eager GEMM passes); the
    # quantizer forgot the smoothing: the product is another one than the weight's
    v = report["svdq unsmoothed"]
    p = v["proofs"]["kitchen svdquant"]
    assert not p["ok"] and "another product" in p["why"], v
    assert v["chosen"] == "weight-only" and v["served_weight_only"], v


def test_an_unsigned_layers_shift_counted_twice_is_refused(report):
    # the loader folded the act_unsigned constant into the bias; kitchen adds it itself: given the folded bias
    # unchanged, the product is off by that constant
    v = report["svdq shift twice"]
    p = v["proofs"]["kitchen svdquant"]
    assert not p["ok"] and "dB" in p["why"], v
    assert v["chosen"] == "weight-only" and v["served_weight_only"], v


@pytest.mark.parametrize("name,path", [("awq", "kitchen awq"), ("svdq", "kitchen svdquant"),
                                       ("svdq_unsigned", "kitchen svdquant")])
def test_kitchen_chosen_where_fastest_runs_the_call(report, name, path):
    v = report["fastest " + name]
    assert v["chosen"] == path and v["route"] == path, v
    assert v["served_is_kitchens"], v
