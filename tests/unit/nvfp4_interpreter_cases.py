"""The NVFP4 weight-only GEMM (``quant/kernels/nvfp4_gemm.py``) run on the CPU by Triton's interpreter.

Not collected on its own: the interpreter must be on before triton is first imported, so
``test_nvfp4_kernel_interpreter.py`` runs this module in a fresh pytest process with
``TRITON_INTERPRET=1``. The kernel's dot runs in float32 there (the interpreter's bf16 dot is wrong).
"""

import os
import sys

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run this module with TRITON_INTERPRET=1 in a fresh process "
                       "(tests/unit/test_nvfp4_kernel_interpreter.py does)")
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from fp8_engram.quant import NVFP4, QuantizedTensor  # noqa: E402
from fp8_engram.quant.layouts import nvfp4  # noqa: E402
from fp8_engram.quant.kernels import nvfp4_gemm  # noqa: E402
from fp8_engram.quant.kernels._triton import INTERPRET  # noqa: E402

pytestmark = pytest.mark.unit
# (out, in): both padded; padded rows over a 128-row scale tile; K over several K steps
SHAPES = [(50, 70), (130, 48), (40, 272)]
TILES = dict(BM=64, BN=64, BK=64, GROUP_M=2, num_warps=4, num_stages=1)


def _weight(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * 0.05
    w[:, 3] *= 40  # one large column: block scales spread over the e4m3 range
    return QuantizedTensor.from_float(w, NVFP4.for_shape(shape))


def _run(x, qt, bias, config=None):
    block, ts = nvfp4.split_scales(qt.scale, qt.layout)
    return nvfp4_gemm.nvfp4_linear_triton(x, qt.qdata, block.view(torch.uint8), ts, qt.layout.rows, bias,
                                          config=config)


def test_the_interpreter_is_on():
    assert INTERPRET


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_decoded_weight_is_the_cpu_dequantization_bit_for_bit(shape, dtype):
    """x = identity: every output is one weight element times 1 (no sums), so y == W.T exactly when the
    kernel decodes e2m1 codes, block scales and the tensor scale with the CPU path's roundings."""
    qt = _weight(shape)
    out_f, in_f = shape
    y = _run(torch.eye(in_f, dtype=dtype), qt, None, config=TILES)
    ref = qt.dequantize(dtype).t() + 0.0  # the sums turn -0 into +0
    assert y.shape == ref.shape and torch.equal(y.view(torch.int16), ref.contiguous().view(torch.int16))


@pytest.mark.parametrize("shape,dtype,m", [((50, 70), torch.bfloat16, 1), ((130, 48), torch.float16, 37),
                                           ((40, 272), torch.bfloat16, 37)], ids=str)
def test_gemm_matches_float64_reference(shape, dtype, m):
    qt = _weight(shape, seed=1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(m, shape[1], generator=g).to(dtype)
    bias = torch.randn(shape[0], generator=g).to(dtype)
    y = _run(x, qt, bias, config=TILES)
    ref = x.double() @ qt.dequantize(dtype).double().t() + bias.double()
    sqnr = (20 * torch.log10(ref.norm() / (ref - y.double()).norm())).item()
    assert y.dtype == dtype and y.shape == (m, shape[0])
    assert sqnr > (45 if dtype == torch.bfloat16 else 60), f"{sqnr:.1f} dB"
