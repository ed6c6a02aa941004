"""The matmul-like ops of QuantizedTensor, routed to the compute paths of ``linear.py``.

``F.linear`` / ``matmul`` / ``mm`` / ``addmm`` at the torch-function level (whole op, any input
rank, autograd sees plain tensors) and ``aten.linear`` / ``mm`` / ``addmm`` / ``matmul`` at the aten
level, registered into the op tables of ``tensor.py`` (whose generic ops are ``dispatch.py``'s).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..dispatch import _is_qt, _plain, aten, implements, implements_torch_function
from ..expert_bank import bank_matmul, is_bank
from .linear import linear

__all__ = []


def _matmul(a, b):
    """a @ b where either side may be a QuantizedTensor; routes to linear() when it is one."""
    if is_bank(a) or is_bank(b):  # a 3-D expert bank: expert by expert
        return bank_matmul(a, b)
    if _is_qt(b) and not _is_qt(a) and b.dim() == 2 and b.transposed:
        # x @ W.t()  ==  linear(x, W)   (the common case; any rank of x)
        return linear(a, b.canonical())
    if _is_qt(a) and not _is_qt(b) and a.dim() == 2 and not a.transposed:
        # W @ y  ==  (y^T @ W^T)^T
        if b.dim() == 1:
            return linear(b, a)
        if b.dim() >= 2:
            return linear(b.transpose(-1, -2), a).transpose(-1, -2)
    dt = a.dtype if not _is_qt(a) else (b.dtype if not _is_qt(b) else None)
    return torch.matmul(_plain(a, dt if dt is not None and dt.is_floating_point else None),
                        _plain(b, dt if dt is not None and dt.is_floating_point else None))


def _addmm(bias, a, b, beta=1, alpha=1):
    if beta == 1 and alpha == 1 and bias is not None and not _is_qt(bias) and bias.dim() <= 1 \
            and _is_qt(b) and not _is_qt(a) and b.transposed:
        return linear(a, b.canonical(), bias)
    out = _matmul(a, b)
    if alpha != 1:
        out = out * alpha
    if beta == 0:
        return out
    bias = _plain(bias, out.dtype)
    return out + (bias if beta == 1 else bias * beta)


@implements_torch_function(F.linear)
def _tf_linear(args, kwargs):
    x = args[0] if args else kwargs["input"]
    w = args[1] if len(args) > 1 else kwargs["weight"]
    b = args[2] if len(args) > 2 else kwargs.get("bias")
    return linear(x, w, b)


@implements_torch_function(torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__,
                           torch.mm, torch.Tensor.mm)
def _tf_matmul(args, kwargs):
    a = args[0] if args else kwargs["input"]
    b = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("mat2"))
    if kwargs.get("out") is not None:
        return NotImplemented
    return _matmul(a, b)


@implements_torch_function(torch.Tensor.__rmatmul__)
def _tf_rmatmul(args, kwargs):
    return _matmul(args[1], args[0])


@implements_torch_function(torch.addmm, torch.Tensor.addmm)
def _tf_addmm(args, kwargs):
    if kwargs.get("out") is not None:
        return NotImplemented
    bias = args[0] if args else kwargs["input"]
    a = args[1] if len(args) > 1 else kwargs["mat1"]
    b = args[2] if len(args) > 2 else kwargs["mat2"]
    return _addmm(bias, a, b, kwargs.get("beta", 1), kwargs.get("alpha", 1))


@implements(aten.linear.default)
def _aten_linear(func, args, kwargs):
    x, w = args[0], args[1]
    b = args[2] if len(args) > 2 else kwargs.get("bias")
    return linear(x, w, b)


@implements(aten.mm.default, aten.matmul.default)
def _aten_mm(func, args, kwargs):
    return _matmul(args[0], args[1])


@implements(aten.addmm.default)
def _aten_addmm(func, args, kwargs):
    return _addmm(args[0], args[1], args[2], kwargs.get("beta", 1), kwargs.get("alpha", 1))
