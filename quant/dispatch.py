"""Op tables for QuantizedTensor, in the three steps the design names.

1. generic ops (any layout): detach, clone, alias, device moves (``_to_copy`` and the ``to``
   overloads that reach dispatch under ``inference_mode``), ``copy_``,
   ``empty_like``, transposes, views where the layout allows, pinning, size checks;
2. matmul-like ops: ``F.linear``, ``matmul``, ``mm``, ``addmm`` and their aten forms, registered
   by the compute floor (``compute/matmul.py``, routed to ``compute.linear``); convolutions run
   weight-only here (dequantized into the input's dtype, quietly); expert banks (3-D weights: indexing,
   ``bmm``, ``matmul``, ``einsum``) go expert by expert in ``expert_bank.py``;
3. anything else: ``tensor.dequantize_fallback`` (logged once per op).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from .errors import QuantizationError
from .tensor import ATEN_OPS, TORCH_FUNCTIONS, QuantizedTensor, _companion_dtype, dequantize_fallback

logger = logging.getLogger(__name__)
aten = torch.ops.aten


def implements(*ops):
    def register(fn):
        for op in ops:
            ATEN_OPS[op] = fn
        return fn
    return register


def implements_torch_function(*funcs):
    def register(fn):
        for f in funcs:
            TORCH_FUNCTIONS[f] = fn
        return fn
    return register


def _is_qt(t) -> bool:
    return isinstance(t, QuantizedTensor)


def _plain(t, dtype=None):
    if _is_qt(t):
        return t.dequantize(dtype)
    return t


# ---------------------------------------------------------------------------------------------
# 1. generic ops
# ---------------------------------------------------------------------------------------------


@implements(aten.detach.default, aten.alias.default)
def _detach(func, args, kwargs):
    return args[0]._map_tensors(lambda t: t.detach(), alias=True)


@implements(aten.clone.default)
def _clone(func, args, kwargs):
    # memory_format is meaningless here: the wrapper always reports contiguous strides
    return args[0]._map_tensors(lambda t: t.clone())


@implements(aten._to_copy.default)
def _to_copy(func, args, kwargs):
    qt = args[0]
    dtype = kwargs.get("dtype")
    device = kwargs.get("device")
    non_blocking = kwargs.get("non_blocking", False)
    pin = kwargs.get("pin_memory")

    def move(t):
        return aten._to_copy.default(t, device=device if device is not None else t.device,
                                     non_blocking=non_blocking, pin_memory=pin)

    if dtype is None or dtype == qt.dtype:
        return qt._map_tensors(move)  # device move / copy: the data stays FP8
    moved = qt if device is None or torch.device(device) == qt.device else qt._map_tensors(move)
    # A dtype change means "give me that tensor as <dtype>": dequantize (never ignore it).
    if dtype.is_floating_point and dtype.itemsize >= 2:
        return moved.dequantize(dtype)
    return moved.dequantize().to(dtype)


def _same_device(device, current: torch.device) -> bool:
    if device is None:
        return True
    device = torch.device(device)
    return device.type == current.type and (device.index is None or device.index == current.index)


@implements(aten.to.dtype_layout, aten.to.device, aten.to.dtype, aten.to.other)
def _to(func, args, kwargs):
    """``Tensor.to`` in the overloads that reach dispatch itself (under ``inference_mode``, where
    ComfyUI moves modules and backs weights up before patching them). Same meaning as for plain
    tensors: the tensor itself when nothing changes and no copy is asked for, a device move that
    keeps the data FP8, and a dequantized tensor for another float dtype."""
    qt = args[0]
    bound = dict(zip((a.name for a in func._schema.arguments), args))
    bound.update(kwargs)
    if "other" in bound:
        device, dtype = bound["other"].device, bound["other"].dtype
    else:
        device, dtype = bound.get("device"), bound.get("dtype")
    same_dtype = dtype is None or dtype == qt.dtype
    if _same_device(device, qt.device) and same_dtype and not bound.get("copy", False):
        return qt
    return _to_copy(aten._to_copy.default, (qt,), {
        "dtype": None if same_dtype else dtype, "device": device,
        "non_blocking": bool(bound.get("non_blocking", False))})


@implements(aten.copy_.default)
def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    if tuple(dst.shape) != tuple(src.shape):
        raise QuantizationError(
            f"copy_: shapes differ (destination {list(dst.shape)}, source {list(src.shape)})"
        )
    if not _is_qt(dst):  # plain <- quantized
        return dst.copy_(src.dequantize(dst.dtype if dst.dtype.is_floating_point
                                        and dst.dtype.itemsize >= 2 else None),
                         non_blocking=non_blocking)
    if (_is_qt(src) and src.layout == dst.layout and src.fp8_dtype == dst.fp8_dtype
            and src.transposed == dst.transposed):
        dst.qdata.copy_(src.qdata, non_blocking=non_blocking)
        dst.scale.copy_(src.scale, non_blocking=non_blocking)
        dst.scales_written()
        if src.input_scale is None:
            dst.input_scale = None
        elif dst.input_scale is None:
            dst.input_scale = src.input_scale.to(dst.qdata.device, copy=True)
        else:
            dst.input_scale.copy_(src.input_scale, non_blocking=non_blocking)
        return dst
    # other layout / plain source: requantize into the destination's layout and FP8 dtype
    dst.requantize_(_plain(src, torch.float32))
    return dst


@implements(aten.empty_like.default)
def _empty_like(func, args, kwargs):
    qt = args[0]
    dtype = kwargs.get("dtype")
    device = kwargs.get("device") or qt.device
    if dtype is not None and dtype != qt.dtype:
        return torch.empty(qt.shape, dtype=dtype, device=device)
    return qt._replace(
        qdata=torch.empty_like(qt.qdata, device=device),
        scale=torch.ones_like(qt.scale, device=device),
        input_scale=None if qt.input_scale is None else torch.ones_like(qt.input_scale,
                                                                          device=device),
    )


def _transpose(qt):
    """The transposed view of a 2-D weight (by its logical shape: packed data, as AWQ's, may have another rank)."""
    if len(qt.matrix_shape) != 2:
        return None
    return qt._replace(transposed=not qt.transposed)


@implements(aten.t.default)
def _t(func, args, kwargs):
    qt = args[0]
    if qt.dim() < 2:
        return qt._replace()
    return _transpose(qt)


@implements(aten.transpose.int)
def _transpose_int(func, args, kwargs):
    qt, d0, d1 = args[0], args[1], args[2]
    nd = qt.dim()
    d0, d1 = d0 % nd, d1 % nd
    if d0 == d1:
        return qt._replace()
    if nd == 2:
        return _transpose(qt)
    return dequantize_fallback(func, args, kwargs)


@implements(aten.permute.default)
def _permute(func, args, kwargs):
    qt, dims = args[0], [d % args[0].dim() for d in args[1]]
    if dims == list(range(qt.dim())):
        return qt._replace()
    if qt.dim() == 2:
        return _transpose(qt)
    return dequantize_fallback(func, args, kwargs)


@implements(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(func, args, kwargs):
    qt, size = args[0], list(args[1])
    numel = qt.numel()
    if -1 in size:
        known = 1
        for s in size:
            if s != -1:
                known *= s
        size[size.index(-1)] = numel // known if known else 0
    if size == list(qt.shape):
        return qt._replace()
    if qt.layout.reshapeable and not qt.transposed:
        # one scale for everything: any view of the data keeps its meaning
        return qt._replace(qdata=qt.qdata.view(size))
    return dequantize_fallback(func, args, kwargs)


@implements(aten.is_same_size.default)
def _is_same_size(func, args, kwargs):
    return tuple(args[0].shape) == tuple(args[1].shape)


@implements(aten._has_compatible_shallow_copy_type.default)
def _shallow_copy_type(func, args, kwargs):
    # only another QuantizedTensor may replace one via `param.data = ...`
    return _is_qt(args[0]) and _is_qt(args[1])


@implements(aten.is_pinned.default)
def _is_pinned(func, args, kwargs):
    return args[0].qdata.is_pinned()


@implements(aten._pin_memory.default)
def _pin_memory(func, args, kwargs):
    return args[0]._map_tensors(lambda t: t.pin_memory())


# ---------------------------------------------------------------------------------------------
# 2. ops that are weight-only by nature (the matmul-like ops are the compute floor's: compute/matmul.py)
# ---------------------------------------------------------------------------------------------


def _dequantized_call(func):
    """Torch-function handler for ops that are weight-only by nature (convolutions): dequantize
    into the input's dtype and run the stock kernel, quietly."""
    def handler(args, kwargs):
        dtype = _companion_dtype(args, kwargs)

        def deq(a):
            return a.dequantize(dtype) if _is_qt(a) else a

        return func(*tree_map(deq, args), **tree_map(deq, kwargs))
    return handler


for _conv in (F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
              F.conv_transpose3d):
    TORCH_FUNCTIONS[_conv] = _dequantized_call(_conv)


@implements(aten.convolution.default)
def _aten_convolution(func, args, kwargs):
    return dequantize_fallback(func, args, kwargs, quiet=True)

