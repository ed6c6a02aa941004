"""The FP8 kernels as torch custom ops, so that torch.compile keeps them in its graph.

Eager code calls ``kernels`` directly (a custom op costs microseconds of dispatch per call). While
torch.compile traces, a Triton launch or a probe of what the device can run must not be traced
into; the compute floor and ``QuantizedTensor.dequantize`` then take the entry points from
:func:`kernel_entry_points`,
which gives this module's functions: same names and arguments as ``kernels``', each calling the op
``torch.ops.fp8_engram.<name>`` for CUDA tensors. The ops wrap the ``kernels`` entry points
unchanged; their fake implementations give only shapes, dtypes and strides. CPU tensors call
``kernels`` directly even then: there the kernels are plain torch code that the compiler traces
and fuses.

    quantize_rows(x, fp8_dtype) -> (q [M, K], scale [M, 1] float32)
    quantize_tensor(x, scale?, fp8_dtype) -> (q [M, K], scale [] float32)
    quantize_groups(x, fp8_dtype) -> (q [M, K], scale [M, ceil(K/128)] float32, strides (1, M))
    dequantize(q, scale, block?, dtype, per_tensor) -> [N, K] (q's shape) in dtype
    weight_only_linear(x, q, scale, block, per_tensor, bias?, method) -> [M, N] in x's dtype

The scaled matmul's op (``compute/scaled_mm.py``) is registered with :func:`define` as well.

Pure torch; never imports ComfyUI.
"""

from __future__ import annotations

import sys

import torch

from .. import kernels
from ..runtime import tracing

__all__ = ["NAMESPACE", "define", "kernel_entry_points", "quantize_rows", "quantize_tensor",
           "quantize_groups", "dequantize", "weight_only_linear"]

NAMESPACE = "fp8_engram"
_GROUP = 128  # activation group width of the 128x128 block path (kernels.act_quant.GROUP)


def define(name: str, schema: str, impl, fake):
    """Register ``NAMESPACE::name`` (once per process: a second copy of the package, imported under
    another module name, uses the ops the first one registered; their code is the same)."""
    qualname = f"{NAMESPACE}::{name}"
    if hasattr(getattr(torch.ops, NAMESPACE), name):
        return getattr(getattr(torch.ops, NAMESPACE), name)
    op = torch.library.custom_op(qualname, impl, mutates_args=(), schema=schema)
    op.register_fake(fake)
    return getattr(getattr(torch.ops, NAMESPACE), name)


# -- real implementations: the kernels' entry points, outputs never aliasing inputs ----------------


def _quantize_rows_impl(x, fp8_dtype):
    q, s = kernels.quantize_rows(x, fp8_dtype)
    return q, s


def _quantize_tensor_impl(x, scale, fp8_dtype):
    q, s = kernels.quantize_tensor(x, scale, fp8_dtype)
    return q, (s.clone() if scale is not None else s)  # a static scale comes back as given


def _quantize_groups_impl(x, fp8_dtype):
    return kernels.quantize_groups(x, fp8_dtype)


def _dequantize_impl(q, scale, block, dtype, per_tensor):
    return kernels.dequantize(q, scale, None if block is None else tuple(block), dtype, per_tensor)


def _weight_only_linear_impl(x, q, scale, block, per_tensor, bias, method):
    return kernels.weight_only_linear(x, q, scale, tuple(block), per_tensor, bias, method)


# -- fake implementations: shapes, dtypes and strides only ------------------------------------------


def _quantize_rows_fake(x, fp8_dtype):
    m, k = x.shape
    return x.new_empty((m, k), dtype=fp8_dtype), x.new_empty((m, 1), dtype=torch.float32)


def _quantize_tensor_fake(x, scale, fp8_dtype):
    m, k = x.shape
    return x.new_empty((m, k), dtype=fp8_dtype), x.new_empty((), dtype=torch.float32)


def _quantize_groups_fake(x, fp8_dtype):
    m, k = x.shape
    groups = (k + _GROUP - 1) // _GROUP
    return (x.new_empty((m, k), dtype=fp8_dtype),
            x.new_empty((groups, m), dtype=torch.float32).t())


def _dequantize_fake(q, scale, block, dtype, per_tensor):
    return q.new_empty(q.shape, dtype=dtype)


def _weight_only_linear_fake(x, q, scale, block, per_tensor, bias, method):
    return x.new_empty((x.shape[0], q.shape[0]))


_quantize_rows = define(
    "quantize_rows", "(Tensor x, ScalarType fp8_dtype) -> (Tensor, Tensor)",
    _quantize_rows_impl, _quantize_rows_fake)
_quantize_tensor = define(
    "quantize_tensor", "(Tensor x, Tensor? scale, ScalarType fp8_dtype) -> (Tensor, Tensor)",
    _quantize_tensor_impl, _quantize_tensor_fake)
_quantize_groups = define(
    "quantize_groups", "(Tensor x, ScalarType fp8_dtype) -> (Tensor, Tensor)",
    _quantize_groups_impl, _quantize_groups_fake)
_dequantize = define(
    "dequantize",
    "(Tensor q, Tensor scale, int[]? block, ScalarType dtype, bool per_tensor) -> Tensor",
    _dequantize_impl, _dequantize_fake)
_weight_only_linear = define(
    "weight_only_linear",
    "(Tensor x, Tensor q, Tensor scale, int[] block, bool per_tensor, Tensor? bias, str method) -> Tensor",
    _weight_only_linear_impl, _weight_only_linear_fake)
# -- the entry points for compiled code (same names and arguments as ``kernels``') -----------------


def quantize_rows(x2d, fp8_dtype=torch.float8_e4m3fn):
    if x2d.is_cuda:
        return _quantize_rows(x2d, fp8_dtype)
    return kernels.quantize_rows(x2d, fp8_dtype)


def quantize_tensor(x2d, scale, fp8_dtype=torch.float8_e4m3fn):
    if x2d.is_cuda:
        return _quantize_tensor(x2d, scale, fp8_dtype)
    return kernels.quantize_tensor(x2d, scale, fp8_dtype)


def quantize_groups(x2d, fp8_dtype=torch.float8_e4m3fn):
    if x2d.is_cuda:
        return _quantize_groups(x2d, fp8_dtype)
    return kernels.quantize_groups(x2d, fp8_dtype)


def dequantize(q, scale, block, dtype, per_tensor: bool, out=None):
    if q.is_cuda:
        w = _dequantize(q, scale, None if block is None else list(block), dtype, per_tensor)
        return w if out is None else out.copy_(w)
    return kernels.dequantize(q, scale, block, dtype, per_tensor, out)


def weight_only_linear(x2d, q, scale, block, per_tensor: bool, bias, method: str = "auto"):
    if x2d.is_cuda:
        return _weight_only_linear(x2d, q, scale, list(block), per_tensor, bias, method)
    return kernels.weight_only_linear(x2d, q, scale, block, per_tensor, bias, method)


def kernel_entry_points():
    """``kernels`` in eager mode; this module while torch.compile traces."""
    return _THIS if tracing() else kernels


_THIS = sys.modules[__name__]
