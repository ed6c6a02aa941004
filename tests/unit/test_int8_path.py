"""The INT8 compute path on the CPU: the Int8 layout's rule, conversion of FP8 and float weights,
the path choice (forced, auto by device, weight-only, autograd) and accuracy against float64."""

import math

import pytest
import torch
import torch.nn.functional as F

from fp8_engram.quant import ComputeConfig, PerRow, PerTensor, QuantizationError, QuantizedTensor, linear
from fp8_engram.quant.compute import int8 as qint8
from fp8_engram.quant.layouts.int8 import Int8, hadamard
from fp8_engram.quant.kernels import int8_mm
from helpers.numerics import sqnr

pytestmark = pytest.mark.unit


def outlier_activation(shape, k, seed=0, channels=8, factor=60.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, k, generator=g)
    idx = torch.randperm(k, generator=g)[:channels]
    x[..., idx] *= factor
    return x


def weight(n, k, seed=1):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / math.sqrt(k)


@pytest.mark.parametrize("size,regular", [(128, False), (2, False), (256, True), (4, True)])
def test_hadamards_are_symmetric_and_orthonormal(size, regular):
    h = hadamard(size, regular).double()
    assert torch.equal(h, h.T)
    assert torch.allclose(h @ h, torch.eye(size, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(h.abs(), torch.full_like(h, size ** -0.5))


def test_regular_hadamard_is_the_kronecker_power_of_comfyuis_4x4():
    h4 = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.float32)
    assert torch.equal(hadamard(16, True), torch.kron(h4, h4) / 4)
    with pytest.raises(QuantizationError, match="power of 4"):
        hadamard(128, True)
    with pytest.raises(QuantizationError, match="power of 2"):
        hadamard(96)


@pytest.mark.parametrize("layout", [Int8(True, 0), Int8(True, 128), Int8(False, 0), Int8(True, 64, True)])
def test_layout_round_trip_keeps_the_weight(layout):
    w = weight(96, 256)
    qt = QuantizedTensor.from_float(w, layout, torch.int8)
    assert qt.qdata.dtype == torch.int8 and qt.shape == w.shape and qt.dtype == torch.float32
    assert sqnr(w, qt.dequantize()) > (38.0 if layout.per_row else 30.0)
    # the data really is rotated: unrotated it would round-trip bit for bit through Int8(rotation=0)
    if layout.rotation:
        plain = QuantizedTensor.from_float(w, Int8(True, 0), torch.int8)
        assert not torch.equal(plain.qdata, qt.qdata)


def test_dequantize_follows_comfyuis_rule_operation_for_operation():
    g = torch.Generator().manual_seed(4)
    q = torch.randint(-128, 128, (8, 512), generator=g, dtype=torch.int8)
    s = torch.rand(8, 1, generator=g) + 0.01
    h = hadamard(256, True)
    want = torch.matmul((q.float() * s).reshape(8, 2, 256), h.T).reshape(8, 512).to(torch.bfloat16)
    got = Int8(True, 256, True).dequantize(q, s, torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    st = torch.tensor(0.02)
    assert torch.equal(Int8(False).dequantize(q, st, torch.float16), (q.float() * st).to(torch.float16))


def test_int8_data_and_layouts_must_agree():
    q = torch.zeros(4, 8, dtype=torch.int8)
    with pytest.raises(QuantizationError, match="float8"):
        QuantizedTensor.from_parts(q, torch.ones(4, 1), PerRow())
    with pytest.raises(QuantizationError, match="int8"):
        QuantizedTensor.from_parts(q.view(torch.float8_e4m3fn), torch.ones(4, 1), Int8())
    with pytest.raises(QuantizationError, match="multiple of the rotation block"):
        QuantizedTensor.from_parts(q, torch.ones(4, 1), Int8(True, 128))
    with pytest.raises(QuantizationError, match="per-row int8 scale"):
        QuantizedTensor.from_parts(q, torch.ones(3, 1), Int8())


def test_fp8_weights_convert_with_their_values_and_a_report():
    w = weight(64, 384)
    fp8 = QuantizedTensor.from_float(w, PerTensor())
    w8 = qint8.to_int8(fp8)
    assert w8.layout == Int8(True, 128) and w8.orig_dtype == fp8.orig_dtype
    assert qint8.conversion_sqnr_db(fp8, w8) > 38.0
    assert qint8.to_int8(w.to(torch.bfloat16), rotation=0).layout == Int8(True, 0)
    assert qint8.to_int8(weight(8, 100)).layout == Int8(True, 0)  # 100 is no multiple of 128
    assert qint8.to_int8(w8) is w8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_is_accurate_on_outlier_activations(dtype):
    n, k = 192, 512
    w, b = weight(n, k), torch.randn(n) * 0.1
    x = outlier_activation((3, 50), k).to(dtype)
    ref = F.linear(x.double(), w.double(), b.double())
    rotated = linear(x, qint8.to_int8(w), b.to(dtype), ComputeConfig(path="int8"))
    plain = linear(x, qint8.to_int8(w, 0), b.to(dtype), ComputeConfig(path="int8"))
    fp8_row = linear(x, QuantizedTensor.from_float(w, PerRow()), b.to(dtype), ComputeConfig(path="fp8"))
    assert rotated.dtype == dtype and rotated.shape == (3, 50, n)
    assert sqnr(ref, rotated) >= 27.0
    assert sqnr(ref, rotated) >= sqnr(ref, plain) + 5.0  # what the rotation is for
    assert sqnr(ref, rotated) >= sqnr(ref, fp8_row) - 1.0  # FP8-class quality


def test_forced_int8_converts_an_fp8_weight_once_and_keeps_it():
    w = QuantizedTensor.from_float(weight(32, 128), PerRow())
    x = torch.randn(5, 128)
    cfg = ComputeConfig(path="int8")
    y1 = linear(x, w, None, cfg)
    cached = w.__dict__["_derived"]["int8"][1]
    assert qint8.is_int8(cached)
    y2 = linear(x, w, None, cfg)
    assert w.__dict__["_derived"]["int8"][1] is cached and torch.equal(y1, y2)
    # Asking for no rotation converts again, without the rotation, and multiplies with that weight.
    y0 = linear(x, w, None, ComputeConfig(path="int8", int8_rotation=False))
    plain = w.__dict__["_derived"]["int8_unrotated"][1]
    assert w.__dict__["_derived"]["int8"][1] is cached and plain is not cached and plain.layout.rotation == 0 and cached.layout.rotation == 128
    assert torch.equal(y0, linear(x, plain, None, ComputeConfig(path="int8")))
    ref = x.double() @ w.dequantize(torch.float64).t()
    assert sqnr(ref, y0) > 30 and sqnr(ref, y1) > 30


def test_the_path_choice(monkeypatch):
    w8 = qint8.to_int8(weight(48, 256))
    x = outlier_activation((7,), 256)
    wo = linear(x, w8, None, ComputeConfig(path="weight_only"))
    # weight-only multiplies the rotated activation by the weight as stored (fewer rows to rotate than
    # the weight's): the dequantized weight's product up to float32 rounding
    plain = F.linear(x, w8.dequantize())
    assert ((wo - plain).norm() / plain.norm()).item() < 1e-6
    int8_out = qint8.int8_linear(x, w8, None, torch.float32)
    assert not torch.equal(wo, int8_out)
    assert torch.equal(linear(x, w8, None, ComputeConfig(path="int8")), int8_out)
    # trusting fast paths: "auto" by the device's capability
    for fast in (True, False):
        monkeypatch.setattr(qint8, "int8_fast", lambda device, fast=fast: fast)
        got = linear(x, w8, None, ComputeConfig(path="auto", trust_fast_paths=True))
        assert torch.equal(got, int8_out if fast else wo)
    # proving (the default): "auto" takes whichever of the two measured faster, never a third result
    got = linear(x, w8, None, ComputeConfig(path="auto"))
    assert torch.equal(got, int8_out) or torch.equal(got, wo)
    # autograd: the input gradient goes through the dequantized weight
    xg = x.clone().requires_grad_(True)
    linear(xg, w8, None, ComputeConfig(path="int8")).sum().backward()
    assert torch.allclose(xg.grad, w8.dequantize().sum(0).expand_as(x), atol=1e-5)


def test_a_rotation_first_built_under_inference_mode_still_trains(monkeypatch):
    # ComfyUI runs its loaders and samplers under inference_mode; the cached rotation those first calls
    # build must still serve a later autograd call (an inference tensor cannot be saved for backward)
    w8 = qint8.to_int8(weight(16, 128))
    assert w8.layout.rotation
    monkeypatch.setattr("fp8_engram.quant.layouts.int8._hadamards", {})  # quantizing built one already
    x = outlier_activation((3,), 128)
    with torch.inference_mode():
        linear(x, w8, None, ComputeConfig(path="weight_only"))
    assert not hadamard(w8.layout.rotation, w8.layout.regular).is_inference()
    xg = x.clone().requires_grad_(True)
    linear(xg, w8, None, ComputeConfig(path="weight_only")).sum().backward()
    assert torch.allclose(xg.grad, w8.dequantize().sum(0).expand_as(x), atol=1e-5)


def test_auto_picks_int8_on_ampere_not_on_turing_or_fp8_gpus(monkeypatch):
    # Turing: Triton cannot compile the int8 GEMM for sm_75 (test_sm90_compile.py compiles it there)
    for cap, want in (((7, 0), False), ((7, 5), False), ((8, 0), True), ((8, 6), True), ((8, 9), False),
                      ((9, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None, cap=cap: cap)
        qint8._cuda_ok.clear()
        assert qint8.int8_supported("cuda:0") is want, cap
        # int8 weights (ComfyUI's int8 files) run int8 on every GPU with int8 tensor cores
        assert qint8.int8_fast("cuda:0") is (cap >= (8, 0)), cap
    qint8._cuda_ok.clear()
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    vnni = torch.cpu._is_vnni_supported() or torch.cpu._is_amx_tile_supported()
    assert qint8.int8_supported("cpu") is bool(vnni)


@pytest.mark.parametrize("var, cap, fast", [
    ("ONEDNN_MAX_CPU_ISA", "AVX2", False), ("ONEDNN_MAX_CPU_ISA", "avx512_core", False),
    ("DNNL_MAX_CPU_ISA", "AVX2", False), ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_VNNI", True),
    ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX", True), (None, None, True)])
def test_a_onednn_cap_below_vnni_makes_the_cpu_an_avx2_one(monkeypatch, var, cap, fast):
    """ONEDNN_MAX_CPU_ISA (oneDNN runs torch._int_mm on the CPU) below its VNNI instructions: no int8 under "auto",
    whatever the processor reports (here: VNNI); a cap that keeps VNNI, or none, leaves the processor's answer."""
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: True)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if var is not None:
        monkeypatch.setenv(var, cap)
    assert qint8.int8_fast("cpu") is fast and qint8.int8_supported("cpu") is fast


def test_empty_and_odd_inputs():
    w8 = qint8.to_int8(weight(24, 40))
    assert linear(torch.randn(0, 40), w8, None, ComputeConfig(path="int8")).shape == (0, 24)
    y = linear(torch.randn(40), w8, torch.zeros(24), ComputeConfig(path="int8"))
    assert y.shape == (24,)
    zero = linear(torch.zeros(3, 40), w8, None, ComputeConfig(path="int8"))
    assert torch.equal(zero, torch.zeros(3, 24))


def test_the_fused_quantizer_takes_only_what_it_can_compile_everywhere():
    """bf16/fp16 with no rotation or a block of 16..128 go to the Triton quantizer on a GPU; ComfyUI's
    ConvRot 256 (an H over an RTX 3090's shared memory), a file's group size 4 (under the smallest
    tensor-core dot) and float32 (a spilling float32 dot) go to cuBLAS + torch."""
    for dtype in (torch.bfloat16, torch.float16):
        assert all(int8_mm.kernel_quantizes(dtype, r) for r in (0, 16, 32, 64, 128))
        assert not any(int8_mm.kernel_quantizes(dtype, r) for r in (2, 4, 8, 256, 1024))
    assert not any(int8_mm.kernel_quantizes(torch.float32, r) for r in (0, 16, 128))


def test_the_torch_twin_quantizes_per_row_with_ties_to_even():
    x = torch.tensor([[127.0, 0.5, 1.5, -2.5, 3.49]])
    q, s = int8_mm.quantize_rows_int8_torch(x)
    assert s.item() == 1.0 and q.tolist() == [[127, 0, 2, -2, 3]]


def test_module_state_dict_and_copy_keep_int8():
    import copy

    w8 = qint8.to_int8(weight(16, 128))
    lin = torch.nn.Linear(128, 16, bias=False)
    lin.weight = torch.nn.Parameter(w8, requires_grad=False)
    x = torch.randn(3, 128)
    want = lin(x)
    saved = lin.state_dict()["weight"]
    assert qint8.is_int8(saved) and torch.equal(saved.qdata, w8.qdata) and saved.layout == w8.layout
    twin = copy.deepcopy(lin)
    assert qint8.is_int8(twin.weight) and twin.weight.qdata.data_ptr() != w8.qdata.data_ptr()
    assert torch.equal(twin(x), want)
    fresh = torch.nn.Linear(128, 16, bias=False)
    fresh.weight = torch.nn.Parameter(qint8.to_int8(weight(16, 128, seed=2)), requires_grad=False)
    fresh.load_state_dict(lin.state_dict())
    assert torch.equal(fresh.weight.qdata, w8.qdata) and torch.equal(fresh(x), want)
    clone = w8.clone()
    assert torch.equal(clone.qdata, w8.qdata) and clone.layout == w8.layout
    moved = w8.to("cpu", copy=True)
    assert moved.qdata.dtype == torch.int8 and torch.equal(moved.qdata, w8.qdata)


def test_a_failing_int8_kernel_falls_back_to_weight_only_and_is_not_retried(monkeypatch):
    """A kernel that cannot compile or launch fails once per (device, layout, dtypes): later calls go
    weight-only without trying (a failed Triton compile is not cached, so each call would recompile).
    Out of memory is this call's only."""
    import importlib

    from fp8_engram.quant.compute import default_book

    w8 = qint8.to_int8(weight(16, 128))
    x = torch.randn(4, 128)
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise error

    monkeypatch.setattr(qint8, "int8_linear", broken)
    # the failure memory of a trusted path (proving is tested in test_fast_path_choice.py)
    TRUSTED_INT8 = ComputeConfig(path="int8", trust_fast_paths=True)
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 MiB")
    for _ in range(2):
        assert torch.equal(linear(x, w8, None, TRUSTED_INT8), linear(x, w8, None, ComputeConfig(path="weight_only")))
    assert len(calls) == 2 and not default_book().failures()
    error = RuntimeError("no int8 kernel here")
    for _ in range(3):
        assert torch.equal(linear(x, w8, None, TRUSTED_INT8), linear(x, w8, None, ComputeConfig(path="weight_only")))
    assert len(calls) == 3 and len(default_book().failures()) == 1
    # another activation dtype is another kind: tried
    linear(x.bfloat16(), w8, None, TRUSTED_INT8)
    assert len(calls) == 4


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)),
                    reason="needs a CUDA GPU whose int8 tensor cores Triton compiles for (capability 8.0+)")
@pytest.mark.parametrize("rotation,dtype", [(0, torch.bfloat16), (128, torch.bfloat16), (16, torch.float16),
                                            (256, torch.bfloat16), (4, torch.bfloat16), (128, torch.float32)])
@pytest.mark.parametrize("m", [1, 16, 300])
def test_cuda_int8_path_matches_the_cpu_twin(rotation, dtype, m):
    """Kernel-quantized (rotations 0/16/128 in bf16/fp16) and torch-quantized (256, 4, float32) alike."""
    w = qint8.to_int8(weight(256, 512), rotation=rotation)
    x = outlier_activation((m,), 512).to(torch.bfloat16)
    b = torch.randn(256).to(torch.bfloat16)
    cpu = qint8.int8_linear(x.float(), w, b.float(), torch.float32)
    gpu = qint8.int8_linear(x.to("cuda", dtype), w.to("cuda"), b.to("cuda", dtype), dtype)
    assert gpu.dtype == dtype and sqnr(cpu, gpu.float().cpu()) > 40.0
    ref = F.linear(x.double(), w.dequantize(torch.float64), b.double())
    assert sqnr(ref, gpu.float().cpu()) > 27.0


def test_int8_weights_survive_torch_save_and_load_with_weights_only(tmp_path):
    w8 = qint8.to_int8(weight(8, 128))
    torch.save({"w": w8}, tmp_path / "w.pt")
    back = torch.load(tmp_path / "w.pt", weights_only=True)["w"]
    assert back.layout == w8.layout and torch.equal(back.qdata, w8.qdata) and torch.equal(back.scale, w8.scale)
