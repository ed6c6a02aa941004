"""The CPU weight-only path's memory behaviour: dequantization into caller-given buffers (the
table path and the plain path), and the per-thread reusable buffer the weight-only linear uses so
that a model does not pay for fresh full-precision pages on every layer of every step, without
changing any result (inference_mode, no_grad, and autograd, which must keep its own copy)."""

import threading

import pytest
import torch
import torch.nn.functional as F

from fp8_engram.quant import Block, PerRow, PerTensor, QuantizationError, QuantizedTensor
from fp8_engram.quant import runtime
from fp8_engram.quant import layouts
from fp8_engram.quant import ComputeConfig, linear

WEIGHT_ONLY = ComputeConfig(path="weight_only")


def qlinear(x, w):
    """The weight-only path, whose buffer these tests are about ("auto" may prove int8 faster on a VNNI CPU)."""
    return linear(x, w, None, WEIGHT_ONLY)

pytestmark = pytest.mark.unit

LAYOUTS = [PerTensor(), PerRow(), Block(128, 128), Block(1, 64)]


def _qt(layout, out_f=1024, in_f=1024, seed=0, fp8=torch.float8_e4m3fn):
    g = torch.Generator().manual_seed(seed)
    return QuantizedTensor.from_float(torch.randn(out_f, in_f, generator=g) * 0.05, layout, fp8_dtype=fp8)


@pytest.mark.parametrize("numel", [4096, 1 << 20], ids=["plain-path", "table-path"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_to_out_writes_the_same_bits_into_the_given_buffer(fp8, dtype, numel):
    codes = torch.arange(numel, dtype=torch.int64).remainder(256).to(torch.uint8)
    q = codes[torch.randperm(numel, generator=torch.Generator().manual_seed(1))].view(fp8).reshape(-1, 256)
    scale = torch.tensor(3.7e-3)
    out = torch.empty(q.shape, dtype=dtype)
    got = layouts.fp8_to(q, dtype, scale, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, q.to(dtype).mul_(scale), rtol=0, atol=0, equal_nan=True)


def test_fp8_to_refuses_an_unfit_out_buffer():
    q = torch.zeros(4, 8, dtype=torch.float8_e4m3fn)
    for bad in (torch.empty(4, 8, dtype=torch.float16), torch.empty(8, 4, dtype=torch.float32),
                torch.empty(8, 4, dtype=torch.float32).t()):
        with pytest.raises(QuantizationError, match="out must be a contiguous"):
            layouts.fp8_to(q, torch.float32, None, out=bad)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_weight_only_linear_reuses_one_buffer_and_matches_fresh_dequantization(layout, mode):
    a, b = _qt(layout, seed=1), _qt(layout, seed=2)
    x = torch.randn(3, 5, 1024, generator=torch.Generator().manual_seed(3))
    ctx = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
    with ctx:
        ya = qlinear(x, a)
        ptr = runtime.workspace("weight_only", a.qdata.numel(), torch.float32).data_ptr()
        yb = qlinear(x, b)
        assert runtime.workspace("weight_only", b.qdata.numel(), torch.float32).data_ptr() == ptr
    # results are exact, and the first output is not disturbed by the buffer's reuse
    assert torch.equal(ya, F.linear(x, a.dequantize(torch.float32)))
    assert torch.equal(yb, F.linear(x, b.dequantize(torch.float32)))
    # the buffer is a normal tensor: usable again outside inference_mode
    assert torch.equal(qlinear(x, a), ya)


def test_autograd_keeps_its_own_copy_of_the_weight():
    a, b = _qt(PerRow(), seed=4), _qt(PerRow(), seed=5)
    x = torch.randn(6, 1024, generator=torch.Generator().manual_seed(6), requires_grad=True)
    y = qlinear(x, a)
    qlinear(x.detach(), b)  # would overwrite a shared buffer before the backward below
    y.sum().backward()
    expected = a.dequantize(torch.float64).sum(0).expand(6, -1)
    wrong = b.dequantize(torch.float64).sum(0).expand(6, -1)
    torch.testing.assert_close(x.grad.double(), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(x.grad.double(), wrong, rtol=1e-2, atol=1e-2)


def test_each_thread_has_its_own_buffer():
    qt = _qt(PerTensor())
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(7))
    expected = F.linear(x, qt.dequantize(torch.float32))
    bufs, results = {}, {}

    def work(name):
        with torch.inference_mode():
            results[name] = qlinear(x, qt)
        # the buffer itself, not its address: a thread's buffer is freed when the thread ends, and on a busy
        # machine the second thread may start only then and get the same address for a buffer of its own
        bufs[name] = runtime.workspace("weight_only", qt.qdata.numel(), torch.float32)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bufs[0].data_ptr() != bufs[1].data_ptr()  # both alive here: one shared buffer would be one address
    assert all(torch.equal(r, expected) for r in results.values())


def test_release_workspace_frees_the_buffers():
    with torch.inference_mode():
        qlinear(torch.randn(2, 1024), _qt(PerTensor()))
    assert runtime._workspace.bufs
    runtime.release_workspace()
    assert runtime._workspace.bufs == {}
    assert runtime.workspace("weight_only", 1 << 20, torch.float32).numel() == 1 << 20


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_unscaled_small_chunks_take_the_kept_table_with_the_same_bits(fp8, dtype):
    # every pair of codes (both bytes of a looked-up word), then a small chunk
    pairs = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.uint8).view(fp8)
    for q in (pairs.reshape(-1, 512), pairs[:4096].reshape(16, -1)):
        for _ in range(2):  # built, then kept
            got = layouts.fp8_to(q, dtype, None, out=torch.empty(q.shape, dtype=dtype))
            torch.testing.assert_close(got, q.to(dtype), rtol=0, atol=0, equal_nan=True)
    with torch.inference_mode():  # a table first kept under inference_mode serves later calls outside it
        layouts.fp8._tables.clear()
        layouts.fp8_to(pairs[:4096], dtype)
    assert not layouts.fp8._tables[(fp8, dtype)].is_inference()


@pytest.fixture
def small_blocks(monkeypatch):
    """Weight-only's row blocks at 16 rows of 1024 (instead of 1 Mi elements), so small weights take them; a verdict
    table of this test's own. Returns that table."""
    from fp8_engram.quant.compute.paths import plain

    verdicts: dict = {}
    monkeypatch.setattr(plain, "BLOCK_ELEMS", 1 << 14)
    monkeypatch.setattr(plain, "blocked_same_bits", verdicts)
    return verdicts


def _blocked_linear(x, w, bias=None):
    with torch.inference_mode():
        return linear(x, w, bias, WEIGHT_ONLY)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("rows", [1, 20, 128])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_few_rows_in_float32_go_by_row_blocks_with_the_whole_gemms_bits(small_blocks, layout, rows, with_bias):
    w = _qt(layout, out_f=1000, in_f=1024, seed=rows)  # 1000 rows: blocks of 16 (128 for a 128-row block) and a tail
    g = torch.Generator().manual_seed(9)
    x = torch.randn(rows, 1024, generator=g)
    bias = torch.randn(1000, generator=g) if with_bias else None
    runtime.release_workspace()
    first = _blocked_linear(x, w, bias)  # the first call of the shape: checked against the whole form
    assert "weight_only_block" in {name for name, _ in runtime._workspace.bufs}
    again = _blocked_linear(x, w, bias)
    want = F.linear(x, w.dequantize(torch.float32), bias)
    assert torch.equal(first, want) and torch.equal(again, want)
    assert list(small_blocks.values()) == [True]


def test_a_shape_whose_blocks_sum_otherwise_keeps_the_whole_gemm(small_blocks, monkeypatch):
    """A BLAS whose block products differ from its whole GEMM (none here does: a block product nudged by one ulp
    stands in for it) must not change a result: the first call returns the whole form's and the shape keeps it."""
    real_mm, blocks = torch.mm, []

    def nudged(a, b, *, out):
        blocks.append(a.shape[0])
        real_mm(a, b, out=out)
        return out.copy_(torch.nextafter(out, torch.full_like(out, float("inf"))))

    monkeypatch.setattr(torch, "mm", nudged)
    w = _qt(PerTensor(), out_f=512, in_f=1024)
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(10))
    want = F.linear(x, w.dequantize(torch.float32))
    assert torch.equal(_blocked_linear(x, w), want)
    assert len(blocks) == 32 and list(small_blocks.values()) == [False]
    assert torch.equal(_blocked_linear(x, w), want)
    assert len(blocks) == 32  # not tried again


@pytest.mark.parametrize("case", ["bfloat16", "many-rows", "autograd"])
def test_calls_the_blocks_do_not_serve_take_the_whole_weight(small_blocks, case):
    from fp8_engram.quant.compute.paths import plain

    w = _qt(PerRow(), out_f=512, in_f=1024)
    rows = plain.BLOCKED_MAX_ROWS + 1 if case == "many-rows" else 4
    x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(11))
    if case == "bfloat16":
        y, want = _blocked_linear(x.bfloat16(), w), F.linear(x.bfloat16(), w.dequantize(torch.bfloat16))
    elif case == "autograd":
        x.requires_grad_(True)
        y = linear(x, w, None, WEIGHT_ONLY)
        want = F.linear(x.detach(), w.dequantize(torch.float32))
        y.sum().backward()
        assert x.grad is not None
    else:
        y, want = _blocked_linear(x, w), F.linear(x, w.dequantize(torch.float32))
    assert torch.equal(y.detach(), want)
    assert small_blocks == {}



def test_an_activation_of_another_alignment_is_checked_on_its_own(small_blocks):
    """A BLAS may pick its kernel by the operands' alignment, so an activation 4 bytes off a 64-byte boundary (a
    view into a larger buffer) gets a verdict of its own; whatever it is, every call gives the whole GEMM's bits."""
    w = _qt(PerRow(), out_f=512, in_f=1024)
    g = torch.Generator().manual_seed(12)
    aligned = torch.randn(20, 1024, generator=g)
    shifted = torch.randn(20 * 1024 + 1, generator=g)[1:].view(20, 1024)
    assert aligned.data_ptr() % 64 == 0 and shifted.data_ptr() % 64 == 4
    for _ in range(2):  # the first call of each decides, the second follows the verdict
        for x in (aligned, shifted):
            assert torch.equal(_blocked_linear(x, w), F.linear(x, w.dequantize(torch.float32)))
    assert sorted(key[6] for key in small_blocks) == [0, 4]
    assert small_blocks[next(key for key in small_blocks if key[6] == 0)] is True


@pytest.mark.parametrize("rows", [2, 8, 11])
def test_row_counts_the_blas_sums_otherwise_by_blocks_keep_the_whole_gemm(small_blocks, monkeypatch, rows):
    """The real BLAS, no stand-in: MKL sums W @ x.T by blocks otherwise than x @ W.T whole for 2-11 rows (on the
    machine this was written on). Whatever this one does, the results are the whole GEMM's, and a shape whose
    verdict is "differs" is not run by blocks again."""
    real_mm, blocks = torch.mm, []

    def counted(*args, **kwargs):
        blocks.append(1)
        return real_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "mm", counted)  # counts the block products, computes them as they are
    w = _qt(PerTensor(), out_f=512, in_f=1024)
    x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(13))
    want = F.linear(x, w.dequantize(torch.float32))
    assert torch.equal(_blocked_linear(x, w), want)
    (verdict,) = small_blocks.values()
    first = len(blocks)
    assert torch.equal(_blocked_linear(x, w), want)
    assert len(blocks) - first == (32 if verdict else 0)
