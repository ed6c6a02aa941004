"""What the fp8 path remembers when a scaled matmul fails, and how 128x128 block scales are
checked by value before any layer uses them.

This CPU has no block-wise scaled matmul (cuBLASLt 12.9+ on Hopper has it), so the block tests
stand in for it with small emulators of what cuBLASLt may read from the scale operands (strides
honoured; K-blocks padded to a multiple of 4; scales ignored). The failure tests make the CPU's
real scaled matmul fail on chosen calls. The same checks on a real GPU are in test_kernels_cuda.py.
"""

import importlib
import logging

import pytest
import torch
import torch.nn.functional as F

from fp8_engram.quant import Block, ComputeConfig, PerRow, QuantizedTensor
from fp8_engram.quant.compute import default_book
from fp8_engram.quant.runtime import reset_log_once
from helpers.numerics import sqnr

pytestmark = pytest.mark.unit

lin = importlib.import_module("fp8_engram.quant.compute.linear")

sm = importlib.import_module("fp8_engram.quant.compute.scaled_mm")

kernels = importlib.import_module("fp8_engram.quant.kernels")
FP8_PATH = importlib.import_module("fp8_engram.quant.compute.paths").FP8
# these tests count the kernel calls and failures of a trusted path; proving is tested in test_fast_path_choice.py
FP8 = ComputeConfig(path="fp8", trust_fast_paths=True)
CPU = torch.device("cpu")


@pytest.fixture
def api(monkeypatch):
    """The CPU's scaled-matmul API name, with every remembered answer of linear.py cleared."""
    name = sm.scaled_mm_api(CPU)
    if name is None:
        pytest.skip(f"torch {torch.__version__} has no scaled matmul with a CPU kernel")
    monkeypatch.setattr(sm, "_needs", {})
    monkeypatch.setattr(sm, "_blockwise_for", {})
    reset_log_once()
    return name


def _data(out_f=96, in_f=192, tokens=24):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(out_f, in_f, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(tokens, in_f, generator=g).to(torch.bfloat16)
    return w, x


def _install(monkeypatch, name, fn):
    real, seen = sm.SCALED_MM_APIS[name], []

    def wrapped(a, b, sa, sb, bias, out_dtype):
        seen.append(out_dtype)
        return fn(real, a, b, sa, sb, bias, out_dtype)

    monkeypatch.setitem(sm.SCALED_MM_APIS, name, wrapped)
    return seen


# ----- item: failures are remembered per (device, layout, dtypes), never for out-of-memory -----


def test_a_failing_fp8_product_is_remembered_and_not_retried(api, monkeypatch, caplog):
    def broken(real, *args):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED (emulated)")

    seen = _install(monkeypatch, api, broken)
    quantized = []
    real_rows = kernels.quantize_rows
    monkeypatch.setattr(kernels, "quantize_rows",
                        lambda *a, **k: quantized.append(1) or real_rows(*a, **k))
    w, x = _data()
    qt = QuantizedTensor.from_float(w, PerRow(), config=FP8)
    with caplog.at_level(logging.WARNING):
        ys = [F.linear(x, qt) for _ in range(3)]
    assert len(seen) == 1 and len(quantized) == 1, "the failing product was tried again"
    assert len([r for r in caplog.records if "failed" in r.getMessage()]) == 1
    assert all(torch.equal(ys[0], y) for y in ys)
    assert sqnr(F.linear(x.double(), w.double()), ys[0]) >= 30
    # another output dtype is another kind of call: tried (with its bf16 retry) once on its own
    F.linear(x.half(), qt)
    tried = len(seen)
    F.linear(x.half(), qt)
    assert tried > 1 and len(seen) == tried


def test_out_of_memory_is_never_remembered(api, monkeypatch, caplog):
    """An out-of-memory error of a row-wise fp16 product used to mark the device as "row-wise
    writes bf16 only" for good; now that call runs weight-only and the next one tries fp16 again."""
    seen = []

    def short_of_memory(real, a, b, sa, sb, bias, out_dtype):
        seen.append(out_dtype)
        if len(seen) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (emulated)")
        return real(a, b, sa, sb, bias, out_dtype)

    _install(monkeypatch, api, short_of_memory)
    w, x = _data()
    qt = QuantizedTensor.from_float(w, PerRow(), config=FP8)
    with caplog.at_level(logging.WARNING):
        y1 = F.linear(x.half(), qt)  # ran weight-only
        y2 = F.linear(x.half(), qt)  # fp8 again, in fp16
    assert seen == [torch.float16, torch.float16]
    assert not default_book().failures() and not sm._needs
    ref = F.linear(x.double(), w.double())
    assert sqnr(ref, y1) >= 30 and sqnr(ref, y2) >= 27


def test_a_dtype_refusal_is_remembered_for_that_scaling_only(api, monkeypatch):
    """A row-wise kernel that writes only bf16 must not make block-wise (or per-tensor) calls cast
    too: they used to share the row-wise key of the device."""
    blockwise = _blockwise_emulator("strides")

    def bf16_only_rowwise(real, a, b, sa, sb, bias, out_dtype):
        if sa.numel() > 1 and sa.shape[-1] == 1 and out_dtype != torch.bfloat16:
            raise RuntimeError("row-wise scaling writes bfloat16 only (emulated)")
        return blockwise(real, a, b, sa, sb, bias, out_dtype)

    seen = _install(monkeypatch, api, bf16_only_rowwise)
    g = torch.Generator().manual_seed(11)
    w = torch.randn(256, 640, generator=g) * 0.02
    x = torch.randn(24, 640, generator=g).to(torch.float16)
    row = QuantizedTensor.from_float(w, PerRow(), config=FP8)
    F.linear(x, row)
    F.linear(x, row)
    assert seen == [torch.float16, torch.bfloat16, torch.bfloat16]
    block = QuantizedTensor.from_float(w, Block(128, 128), config=FP8)
    assert sm.blockwise_form(CPU) is not None
    seen.clear()
    y = F.linear(x, block)
    assert seen == [torch.float16], "a block-wise call inherited the row-wise kernel's limit"
    assert y.dtype == torch.float16 and sqnr(F.linear(x.double(), w.double()), y) >= 27
    from fp8_engram.quant import PerTensor
    seen.clear()
    F.linear(x, QuantizedTensor.from_float(w, PerTensor(), config=ComputeConfig(
        path="fp8", activation_scaling="dynamic_tensor", trust_fast_paths=True)))
    assert seen == [torch.float16]


# ----- item: block scales, checked by value at shapes with (K/128) % 4 != 0 and N > 128 -----


def _blockwise_emulator(reads: str):
    """A CPU stand-in for a block-wise scaled matmul. ``reads``: "strides" (honours the scale
    operands' strides, like a right kernel), "padded" (reads the weight scale's K-blocks with a
    row pitch padded to a multiple of 4, whatever the operand's strides), "ignores" (treats every
    block scale as 1). Per-tensor and row-wise calls go to the real CPU kernel."""

    def fn(real, a, b, sa, sb, bias, out_dtype):
        if sa.numel() == 1 or sa.shape[-1] == 1 and sb.shape[0] == 1:
            return real(a, b, sa, sb, bias, out_dtype)
        m, k = a.shape
        n = b.shape[1]
        kb = -(-k // 128)
        if reads == "ignores":
            sa_full, sb_full = torch.ones(m, kb), torch.ones(kb, -(-n // 128))
        else:
            sa_full = sa
            if reads == "strides":
                sb_full = sb
            else:
                pitch = -(-kb // 4) * 4
                flat = sb.untyped_storage()
                words = torch.tensor([], dtype=torch.float32).set_(flat).reshape(-1)
                base = sb.storage_offset()
                idx = base + torch.arange(kb)[:, None] + torch.arange(sb.shape[1])[None, :] * pitch
                sb_full = torch.where(idx < words.numel(), words[idx.clamp(max=words.numel() - 1)],
                                      torch.full_like(idx, 1e30, dtype=torch.float32))
        ad = a.float() * sa_full.float().repeat_interleave(128, 1)[:, :k]
        bd = b.float() * sb_full.float().repeat_interleave(128, 0)[:k].repeat_interleave(128, 1)[:, :n]
        out = ad @ bd
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype)

    return fn


@pytest.mark.parametrize("reads,form", [("strides", ("m_major", "transposed")),
                                        ("padded", ("m_major", "k_padded")),
                                        ("ignores", None)])
def test_the_probe_picks_the_scale_form_that_computes_right(api, monkeypatch, reads, form):
    _install(monkeypatch, api, _blockwise_emulator(reads))
    assert sm._PROBE_N > 128 and (sm._PROBE_K // 128) % 4 != 0
    assert sm.blockwise_form(CPU) == form


@pytest.mark.parametrize("reads", ["strides", "padded", "ignores"])
def test_block_weights_at_a_real_layer_shape_are_right_or_weight_only(api, monkeypatch, reads, caplog):
    """K = 3840 (30 K-blocks, 30 % 4 = 2), N = 384: a kernel reading padded K-blocks gets the
    padded scale (made once per weight), one getting scales wrong never serves a layer."""
    seen = _install(monkeypatch, api, _blockwise_emulator(reads))
    g = torch.Generator().manual_seed(7)
    w = torch.randn(384, 3840, generator=g) * torch.logspace(-2, 0, 384)[:, None]
    x = torch.randn(21, 3840, generator=g).to(torch.bfloat16)
    qt = QuantizedTensor.from_float(w, Block(128, 128), config=FP8)
    with caplog.at_level(logging.INFO):
        y = F.linear(x, qt)
        probe_calls = len(seen)
        y2 = F.linear(x, qt)
    ref = F.linear(x.double(), qt.dequantize(torch.float64))
    assert sqnr(ref, y) >= 25 and torch.equal(y, y2)
    if reads == "ignores":
        assert FP8_PATH.operand(qt, FP8, x.device, torch.bfloat16) is None
        assert any("weight-only" in r.getMessage() for r in caplog.records)
        assert len(seen) == probe_calls
    else:
        assert len(seen) == probe_calls + 1  # the second call ran the block-wise matmul
        if reads == "padded":
            cached = qt.__dict__["_derived"]["block_scale_k_padded"][1]
            assert cached.stride() == (1, 32)
            F.linear(x, qt)
            assert qt.__dict__["_derived"]["block_scale_k_padded"][1] is cached, "re-padded per call"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the fused weight-only GEMM runs on CUDA only)")
def test_a_failing_weight_only_gemm_falls_back_to_dequantize_once(monkeypatch):
    """A fused weight-only GEMM that cannot run on a GPU (no config of its table fits) fails once per
    kind: that call and later ones dequantize and use cuBLAS, nothing raises, nothing is retried."""
    w, x = _data()
    q = QuantizedTensor.from_float(w.cuda(), PerRow())
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("out of resources: shared memory, Required: 147456, Hardware limit: 101376")

    monkeypatch.setattr(kernels, "weight_only_linear", broken)
    want = F.linear(x.cuda(), q.dequantize(torch.bfloat16))
    for _ in range(3):
        got = lin.linear(x.cuda(), q, None, ComputeConfig(path="weight_only"))
        assert torch.equal(got, want)
    assert len(calls) == 1 and len(default_book().failures()) == 1
