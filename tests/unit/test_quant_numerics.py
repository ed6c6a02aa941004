"""Accuracy of every FP8 layout x dtype x compute path, measured as SQNR against float64.

Thresholds (dB; gaussian weights, bf16 activations, measured ~1.5-3 dB above them):
    float8_e4m3fn: dequantize >= 30, weight-only linear >= 30, fp8 x fp8 linear >= 27
    float8_e5m2:   dequantize >= 24, weight-only linear >= 24, fp8 x fp8 linear >= 23
The fp8 x fp8 path is also compared with an eager float64 twin of the same scaled product
(>= 45 dB: only bf16 output rounding and accumulation order differ).
"""

import importlib

import pytest
import torch
import torch.nn.functional as F

from fp8_engram.quant import Block, ComputeConfig, PerRow, PerTensor, QuantizedTensor
from fp8_engram.quant import linear as quant_linear
from fp8_engram.quant.runtime import reset_log_once
from helpers.numerics import sqnr

pytestmark = pytest.mark.unit

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
LAYOUTS = [PerTensor(), PerRow(), Block(32, 64), Block(1, 64), Block(48, 80)]  # last: ragged edges
PATHS = ["weight_only", "fp8"]
SCALINGS = ["static", "dynamic_tensor", "dynamic_row"]
MIN_DEQ = {torch.float8_e4m3fn: 30.0, torch.float8_e5m2: 24.0}
MIN_LINEAR = {
    ("weight_only", torch.float8_e4m3fn): 30.0,
    ("weight_only", torch.float8_e5m2): 24.0,
    ("fp8", torch.float8_e4m3fn): 27.0,
    ("fp8", torch.float8_e5m2): 23.0,
}


def _weight(out_f=96, in_f=192, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(out_f, in_f, generator=g) * 0.02).to(dtype)


def _input(*lead, in_f=192, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*lead, in_f, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_dequantize_sqnr_per_layout(layout, fp8):
    w = _weight(out_f=100, in_f=200) if isinstance(layout, Block) else _weight()
    qt = QuantizedTensor.from_float(w, layout, fp8_dtype=fp8)
    assert qt.qdata.dtype == fp8 and qt.dtype == torch.bfloat16 and qt.shape == w.shape
    assert qt.scale.dtype == torch.float32
    assert tuple(qt.scale.shape) == layout.scale_shape(tuple(w.shape))
    assert sqnr(w, qt.dequantize()) >= MIN_DEQ[fp8]
    assert qt.dequantize().dtype == torch.bfloat16
    assert qt.dequantize(torch.float32).dtype == torch.float32


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_linear_sqnr_every_layout_dtype_path(layout, fp8, path, scaling, monkeypatch):
    w = _weight()
    x = _input(3, 5)
    bias = (torch.randn(96, generator=torch.Generator().manual_seed(2)) * 0.1).to(torch.bfloat16)
    qt = QuantizedTensor.from_float(w, layout, fp8_dtype=fp8,
                                    input_scale=x.float().abs().amax() / 448)
    cfg = ComputeConfig(path=path, activation_scaling=scaling)
    calls = []
    lin = importlib.import_module("fp8_engram.quant.compute.linear")  # the module, not the function
    sm = importlib.import_module("fp8_engram.quant.compute.scaled_mm")
    real = sm._scaled_mm
    monkeypatch.setattr(sm, "_scaled_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    y = F.linear(x, qt.with_config(cfg), bias)
    ref = F.linear(x.double(), w.double(), bias.double())
    assert y.shape == (3, 5, 96) and y.dtype == torch.bfloat16
    assert sqnr(ref, y) >= MIN_LINEAR[(path, fp8)]
    # the path really taken: scaled_mm for fp8 (per-tensor / per-row), never for weight-only
    expect_fp8 = path == "fp8" and not isinstance(layout, Block)
    assert bool(calls) == expect_fp8


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("layout", [PerTensor(), PerRow()], ids=str)
def test_fp8_path_matches_eager_twin(layout, scaling):
    """Forced fp8 x fp8 on the CPU equals the same scaled product computed in float64."""
    w = _weight()
    x = _input(2, 9)
    in_scale = torch.tensor(0.004)  # small on purpose: static scaling must saturate, not overflow
    qt = QuantizedTensor.from_float(w, layout, input_scale=in_scale).with_config(
        ComputeConfig(path="fp8", activation_scaling=scaling))
    y = F.linear(x, qt)
    x2 = x.reshape(-1, 192).double()
    if scaling == "static":
        sa = in_scale.double()
    elif scaling == "dynamic_tensor":
        sa = x2.abs().max() / 448
    else:
        sa = x2.abs().amax(dim=1, keepdim=True) / 448
    xq = (x2 / sa).clamp(-448, 448).float().to(torch.float8_e4m3fn).double() * sa
    twin = xq @ qt.dequantize(torch.float64).t()
    assert sqnr(twin, y.reshape(-1, 96)) >= 45.0


def test_finer_layouts_win_on_uneven_rows():
    """Rows spanning six decades: per-row and block scales keep every row accurate; one
    per-tensor scale pushes the small rows into FP8's subnormals (worst-row SQNR)."""
    w = _weight(out_f=128, in_f=256).double() * torch.logspace(-6, 0, 128, dtype=torch.float64)[:, None]

    def worst_row(layout):
        d = QuantizedTensor.from_float(w, layout).dequantize(torch.float64)
        return min(sqnr(w[i], d[i]) for i in range(w.shape[0]))

    assert worst_row(PerTensor()) < 10.0
    for layout in (PerRow(), Block(1, 64)):
        assert worst_row(layout) >= 28.0
    assert worst_row(Block(16, 64)) >= 15.0  # a block spans ~0.7 decades of rows


@pytest.mark.parametrize("rank", [1, 2, 3, 4])
@pytest.mark.parametrize("path", PATHS)
def test_inputs_of_rank_1_to_4(rank, path):
    w = _weight()
    qt = QuantizedTensor.from_float(w, PerRow()).with_config(ComputeConfig(path=path))
    lead = [2, 3, 4][: rank - 1]
    x = _input(*lead)
    ref = F.linear(x.double(), w.double())
    for y in (F.linear(x, qt), quant_linear(x, qt), x @ qt.t(), torch.matmul(x, qt.T)):
        assert y.shape == (*lead, 96)
        assert sqnr(ref, y) >= MIN_LINEAR[(path, torch.float8_e4m3fn)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", ["inference_mode", "no_grad", "grad"])
def test_linear_under_inference_mode_no_grad_and_grad(mode, path, caplog):
    reset_log_once()
    w = _weight()
    qt = QuantizedTensor.from_float(w, PerTensor()).with_config(ComputeConfig(path=path))
    bias = torch.zeros(96, dtype=torch.bfloat16)
    x = _input(4, 6)
    ref = F.linear(x.double(), w.double())
    ctx = {"inference_mode": torch.inference_mode(), "no_grad": torch.no_grad(),
           "grad": torch.enable_grad()}[mode]
    if mode == "grad":
        x.requires_grad_(True)
    with ctx:
        outs = [F.linear(x, qt, bias), torch.nn.functional.linear(x, qt), x @ qt.t(),
                torch.addmm(bias, x.reshape(-1, 192), qt.t()).reshape(4, 6, 96)]
        # the aten level: torch-function handling switched off, so the op arrives decomposed
        # (t + mm/addmm under no_grad, or whole under inference_mode)
        with torch._C.DisableTorchFunctionSubclass():
            outs.append(F.linear(x, qt, bias))
            outs.append(torch.ops.aten.linear.default(x, qt, bias))
            outs.append(torch.mm(x.reshape(-1, 192), qt.t()).reshape(4, 6, 96))
    for y in outs:
        assert sqnr(ref, y) >= MIN_LINEAR[(path, torch.float8_e4m3fn)]
    # every form was handled by a quantized kernel, none by the dequantize fallback
    assert not [r for r in caplog.records if "no quantized kernel" in r.getMessage()]
    if mode == "grad":
        outs[0].float().square().sum().backward()
        assert qt.requires_grad is False
        # d/dx sum(y^2) = 2 y W, compared with float64
        y64 = F.linear(x.double(), w.double())
        ref_grad = 2 * y64 @ w.double()
        assert x.grad is not None and sqnr(ref_grad, x.grad) >= 24.0


def test_matmul_forms_agree_with_linear():
    w = _weight()
    qt = QuantizedTensor.from_float(w, Block(32, 64))
    x = _input(10)
    y = F.linear(x, qt)
    col = _input(5).t().contiguous()  # [192, 5]
    assert torch.equal(torch.mm(x, qt.t()), y)
    assert torch.equal(torch.addmm(torch.zeros(96, dtype=torch.bfloat16), x, qt.t()), y)
    # W @ y (weight on the left): the transposed form of linear
    assert sqnr(w.double() @ col.double(), qt @ col) >= 30
    assert sqnr(w.double() @ col[:, 0].double(), torch.matmul(qt, col[:, 0])) >= 30


def test_compute_dtype_and_float32_inputs():
    w = _weight()
    qt = QuantizedTensor.from_float(w, PerRow())
    x = _input(3).float()
    assert F.linear(x, qt).dtype == torch.float32
    y = F.linear(x, qt.with_config(ComputeConfig(compute_dtype=torch.bfloat16)))
    assert y.dtype == torch.bfloat16
    assert sqnr(F.linear(x.double(), w.double()), y) >= 30
    # a per-call config beats the weight's own
    assert quant_linear(x, qt, config=ComputeConfig(compute_dtype=torch.float16)).dtype == torch.float16


@pytest.mark.parametrize("fp8", FP8, ids=str)
def test_stochastic_rounding_is_unbiased(fp8):
    """A constant between two FP8 grid points: round-to-nearest is off by a fixed amount on every
    element; stochastic rounding is right on average (mean error < 1/10 of RTN's)."""
    n = 1 << 16
    # the 1.0 entry sets the scale to 1/max, so the constant sits at 1.0375 in FP8 units, 30% of
    # the way from 1.0 to the next grid point (1.125 for e4m3fn, 1.25 for e5m2 at 0.15)
    step = 0.125 if fp8 == torch.float8_e4m3fn else 0.25
    fmax = torch.finfo(fp8).max
    value = (1.0 + 0.3 * step) / fmax
    w = torch.full((1, n), value, dtype=torch.float32)
    w[0, 0] = 1.0
    rtn = QuantizedTensor.from_float(w, PerTensor(), fp8_dtype=fp8).dequantize(torch.float64)
    sr = QuantizedTensor.from_float(w, PerTensor(), fp8_dtype=fp8,
                                    stochastic_rounding=1234).dequantize(torch.float64)
    err_rtn = abs((rtn[0, 1:] - value).mean().item())
    err_sr = abs((sr[0, 1:] - value).mean().item())
    assert err_rtn > 0.2 * step / fmax
    assert err_sr < 0.1 * err_rtn
    # both grid neighbours are used, and the seed makes it reproducible
    assert len(torch.unique(sr[0, 1:])) == 2
    again = QuantizedTensor.from_float(w, PerTensor(), fp8_dtype=fp8, stochastic_rounding=1234)
    assert torch.equal(again.dequantize(torch.float64), sr)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_stochastic_rounding_keeps_accuracy(layout):
    w = _weight()
    qt = QuantizedTensor.from_float(w, layout, stochastic_rounding=7)
    assert sqnr(w, qt.dequantize()) >= 26.0  # SR adds noise: a bit below RTN's 30 dB


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32}.get(t.dtype, torch.int16))


@pytest.mark.parametrize("copies", [1, 4], ids=["gathered-then-scaled", "scaled-table"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("fp8", FP8, ids=str)
def test_cpu_pair_tables_equal_the_plain_conversion_for_every_byte_pair(fp8, dtype, copies, monkeypatch):
    """The fast CPU dequantization (65536-entry tables over byte pairs) gives exactly the bits of
    "convert, then multiply by the float32 scale" for all 65536 pairs: below the scaled table's size
    by gathering exact float32 values and scaling them, from it on through a scaled table. Without a
    scale, the bits of torch's own conversion, NaN payloads included; tables first built under
    inference_mode still serve autograd."""
    from fp8_engram.quant.layouts import fp8 as fp8_layout

    monkeypatch.setattr(fp8_layout, "_tables", {})
    monkeypatch.setattr(fp8_layout, "_SHIFT_MIN_NUMEL", 1 << 30)  # the tables, not the shifted bits
    pairs = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.uint8).view(fp8)
    q = pairs.repeat(copies).reshape(256 * copies, 512)
    scale = torch.tensor(0.0123)
    with torch.inference_mode():
        fast = fp8_layout.fp8_to(q, dtype, scale)
        plain = fp8_layout.fp8_to(q, dtype)
    slow = q.to(dtype).mul_(scale)
    finite = ~slow.isnan()
    assert torch.equal(fast.isnan(), slow.isnan())
    assert torch.equal(_bits(fast)[finite], _bits(slow)[finite])
    assert torch.equal(_bits(plain), _bits(q.to(dtype)))
    assert not any(t.is_inference() for t in fp8_layout._tables.values())
    # an odd count or a strided view takes torch's conversion
    odd = q.reshape(-1)[:-1]
    assert torch.equal(_bits(fp8_layout.fp8_to(odd, dtype)), _bits(odd.to(dtype)))


def _codes(fp8, numel: int, special: int = 0) -> torch.Tensor:
    """`numel` FP8 codes cycling over every byte but those whose `special` bits are all set (0: none left
    out), shuffled."""
    byte = torch.arange(256, dtype=torch.int32)
    if special:
        byte = byte[(byte & special) != special]
    codes = byte.repeat(-(-numel // byte.numel()))[:numel].to(torch.uint8)
    return codes[torch.randperm(numel, generator=torch.Generator().manual_seed(2))].view(fp8)


def _special(fp8, dtype) -> int:
    """The byte bits that mark codes the shifted route leaves to the tables, for FP8 `fp8` into `dtype`."""
    from fp8_engram.quant.layouts import fp8 as fp8_layout

    return fp8_layout._SHIFTS[(fp8, dtype)][3]


def _converted(q, dtype, s):
    """The plain conversion: torch's own without a scale, else the float32 product rounded once into `dtype`."""
    return q.to(dtype) if s is None else q.to(torch.float32).mul_(s).to(dtype)


@pytest.mark.parametrize("scale", [None, 0.0123, 1e38, 1e-44, 2.0 ** -149], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fp8", FP8, ids=str)
def test_cpu_shifted_bits_are_the_plain_conversion_bit_for_bit(fp8, dtype, scale, monkeypatch):
    """FP8 -> float32, float16 and bfloat16 on the CPU by shifted bits (every code the route takes: subnormals,
    both zeros, e5m2's inf and NaN into float16; scales down to float32's smallest subnormal and up
    to where the multiply by the route's power of two would overflow, which takes the table): the bits of
    "convert, then multiply by the float32 scale, round once". Without a code the route leaves to the tables no
    chunk takes them."""
    from fp8_engram.quant.layouts import fp8 as fp8_layout

    tabled = []
    real = fp8_layout._cpu_pairs
    monkeypatch.setattr(fp8_layout, "_cpu_pairs", lambda q, *a: tabled.append(q.numel()) or real(q, *a))
    monkeypatch.setattr(fp8_layout, "_SHIFT_CHUNK_ELEMS", 1 << 15)
    q = _codes(fp8, 3 * (1 << 15) + 100, _special(fp8, dtype)).reshape(-1, 4)  # four chunks, the last one short
    s = None if scale is None else torch.tensor(scale)
    out = torch.empty(q.shape, dtype=dtype)
    got = fp8_layout.fp8_to(q, dtype, s, out=out)
    want = _converted(q, dtype, s)
    assert got.data_ptr() == out.data_ptr()
    nan = want.isnan() if s is not None else torch.zeros_like(want, dtype=torch.bool)  # unscaled: NaN bits too
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(_bits(got)[~nan], _bits(want)[~nan])
    power = fp8_layout._SHIFTS[(fp8, dtype)][2]
    overflows = scale == 1e38 and power > 0
    assert tabled == ([q.numel()] if overflows else [])


@pytest.mark.parametrize("fp8,byte,dtype", [
    (torch.float8_e4m3fn, 0xFF, torch.float32), (torch.float8_e4m3fn, 0x7F, torch.float16),
    (torch.float8_e4m3fn, 0x7F, torch.bfloat16), (torch.float8_e5m2, 0x7C, torch.bfloat16),
    (torch.float8_e5m2, 0xFE, torch.bfloat16), (torch.float8_e5m2, 0xFC, torch.float32)], ids=str)
def test_a_chunk_with_a_code_the_view_cannot_hold_takes_the_table(fp8, byte, dtype, monkeypatch):
    """e4m3fn's NaN codes (every result dtype) and e5m2's inf and NaN (bfloat16 and float32; float16 holds them
    as they are) send their chunk, and only it, to the table: torch's own inf and NaN come back."""
    from fp8_engram.quant.layouts import fp8 as fp8_layout

    tabled = []
    real = fp8_layout._cpu_pairs
    monkeypatch.setattr(fp8_layout, "_cpu_pairs", lambda q, *a: tabled.append(q.numel()) or real(q, *a))
    monkeypatch.setattr(fp8_layout, "_SHIFT_CHUNK_ELEMS", 1 << 14)
    q = _codes(fp8, 3 << 14, _special(fp8, dtype))
    q.view(torch.uint8)[(1 << 14) + 5] = byte  # in the second chunk
    got = fp8_layout.fp8_to(q, dtype, torch.tensor(0.5))
    want = _converted(q, dtype, torch.tensor(0.5))
    assert tabled == [1 << 14]
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    assert bool(~torch.isfinite(got[(1 << 14) + 5]))
    assert torch.equal(_bits(got)[~want.isnan()], _bits(want)[~want.isnan()])
