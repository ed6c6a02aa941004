"""The ops mixture-of-experts layers apply to a 3-D FP8 expert bank, one expert at a time.

A bank is a QuantizedTensor of logical shape ``[E, rows, cols]`` with layout ``PerTensor()`` (one scale),
``PerExpert()`` (one scale per expert) or ``NVFP4Bank(rows, cols)`` (E NVFP4 matrices). MoE code touches
it in three ways, all handled here:

- indexing an expert or a range of experts (``bank[i]``, ``bank[i:j]``, ``bank[idx]``, ``for w in bank``,
  ComfyUI 0.33's ``MoEExperts.expert_weight``): a QuantizedTensor view of the same FP8 bytes, nothing
  dequantized (one expert comes back as a 2-D ``PerTensor()`` weight, so ``F.linear(x, bank[i])`` takes
  the compute floor like any linear);
- batched products (``torch.bmm``, ``torch.matmul`` with a 2-D or 3-D other side; Hugging Face gpt-oss
  multiplies its ``[E, in, out]`` banks with ``bmm``);
- ``torch.einsum`` with two operands, the bank's first subscript being the expert axis.

Memory bound: a product dequantizes ONE expert's matrix at a time (``rows * cols`` elements of the other
operand's dtype), never the bank; the result itself is the only bank-sized allocation. Each expert's
product is the plain op on that expert's matrix dequantized by the pack's rule, so ``bmm(x, bank)[e]``
has the bits of ``x[e] @ bank.dequantize()[e]``. Ops not listed here run on the whole dequantized bank
through ``tensor.dequantize_fallback`` (logged once per op). Pure torch; never imports ComfyUI.
"""

from __future__ import annotations

import logging

import torch

from .dispatch import aten, implements, implements_torch_function
from .errors import QuantizationError
from .layouts import NVFP4Bank, PerExpert, PerTensor
from .runtime import log_once
from .tensor import QuantizedTensor, dequantize_fallback

logger = logging.getLogger(__name__)

__all__ = ["is_bank", "expert", "experts", "bank_bmm", "bank_matmul", "bank_einsum"]

_BANK_LAYOUTS = (PerTensor, PerExpert, NVFP4Bank)


def is_bank(t) -> bool:
    """True for a 3-D FP8 expert bank this module multiplies expert by expert."""
    return (isinstance(t, QuantizedTensor) and not t.transposed and len(t.matrix_shape) == 3
            and isinstance(t.layout, _BANK_LAYOUTS) and t.qdata.dim() == 3)


def _expert_scale(bank: QuantizedTensor, index):
    if isinstance(bank.layout, (PerExpert, NVFP4Bank)):
        return bank.scale[index]
    return bank.scale


def expert(bank: QuantizedTensor, e: int) -> QuantizedTensor:
    """Expert ``e`` of ``bank`` as a 2-D QuantizedTensor sharing the bank's bytes: ``PerTensor()`` for an FP8
    bank, ``NVFP4(rows, cols)`` for an NVFP4 bank."""
    n = bank.shape[0]
    e = int(e)
    if not -n <= e < n:
        raise IndexError(f"expert index {e} is out of range for a bank of {n} experts")
    if isinstance(bank.layout, NVFP4Bank):  # expert e's bytes are a 2-D NVFP4 weight as they are
        return bank._replace(qdata=bank.qdata[e], scale=bank.scale[e], layout=bank.layout.expert_layout)
    return bank._replace(qdata=bank.qdata[e], scale=_expert_scale(bank, e).reshape(()), layout=PerTensor())


def experts(bank: QuantizedTensor, index) -> QuantizedTensor:
    """The sub-bank ``bank[index]`` (a slice or a 1-D integer index tensor over experts), still quantized."""
    qdata = bank.qdata[index]
    scale = _expert_scale(bank, index)
    return bank._replace(qdata=qdata, scale=scale)


def _matrix(bank: QuantizedTensor, e: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Expert ``e``'s matrix dequantized into ``dtype`` on ``device`` (its quantized bytes move, not the
    dequantized matrix): the only weight memory a product holds at once."""
    return expert(bank, e).to(device).dequantize(dtype)


def _float_dtype(t: torch.Tensor, bank: QuantizedTensor) -> torch.dtype:
    return t.dtype if t.dtype.is_floating_point and t.dtype.itemsize >= 2 else bank.orig_dtype


def bank_bmm(a, b) -> torch.Tensor:
    """``torch.bmm(a, b)`` where one side is a bank ``[E, ., .]`` and the other a plain ``[E, ., .]`` tensor."""
    bank, other, bank_left = (a, b, True) if is_bank(a) else (b, a, False)
    if not is_bank(bank) or isinstance(other, QuantizedTensor):
        raise QuantizationError("bank_bmm needs one expert bank and one plain tensor")
    return _per_expert(bank, other, bank_left, batched=True)


def bank_matmul(a, b) -> torch.Tensor:
    """``torch.matmul(a, b)`` with a bank on one side and a plain 2-D (shared by every expert) or 3-D
    ``[E, ., .]`` tensor on the other; other ranks run on the dequantized bank (logged)."""
    bank, other, bank_left = (a, b, True) if is_bank(a) else (b, a, False)
    if isinstance(other, QuantizedTensor) or other.dim() not in (2, 3):
        return _whole_bank(torch.matmul, (a, b))
    return _per_expert(bank, other, bank_left, batched=other.dim() == 3)


def _per_expert(bank, other, bank_left: bool, batched: bool) -> torch.Tensor:
    n = bank.shape[0]
    if batched and other.shape[0] != n:
        raise QuantizationError(
            f"batched product of an expert bank of shape {list(bank.shape)} with a tensor of shape "
            f"{list(other.shape)}: the batch sizes differ ({n} experts, batch {other.shape[0]})")
    dtype = _float_dtype(other, bank)
    rows, cols = bank.shape[1], bank.shape[2]
    inner = other.shape[-2] if bank_left else other.shape[-1]
    if inner != (cols if bank_left else rows):
        raise QuantizationError(
            f"product of an expert bank of shape {list(bank.shape)} with a tensor of shape "
            f"{list(other.shape)}: inner sizes differ")
    out_shape = (n, rows, other.shape[-1]) if bank_left else (n, other.shape[-2], cols)
    if torch.is_grad_enabled() and other.requires_grad:  # out= does not record autograd: stack the products
        return torch.stack([_matrix(bank, e, dtype, other.device) @ (other[e] if batched else other) if bank_left
                            else (other[e] if batched else other) @ _matrix(bank, e, dtype, other.device)
                            for e in range(n)])
    out = torch.empty(out_shape, dtype=dtype, device=other.device)
    for e in range(n):
        w = _matrix(bank, e, dtype, other.device)
        x = other[e] if batched else other
        torch.mm(w, x, out=out[e]) if bank_left else torch.mm(x, w, out=out[e])
        del w
    return out


def _whole_bank(func, args):
    log_once(logger, ("expert bank", getattr(func, "__name__", str(func))), logging.WARNING,
             "expert bank: %s of these shapes runs on the whole dequantized bank (logged once)",
             getattr(func, "__name__", func))
    plain = [a.dequantize() if isinstance(a, QuantizedTensor) else a for a in args]
    return func(*plain)


def bank_einsum(equation: str, a, b) -> torch.Tensor:
    """``torch.einsum(equation, a, b)`` with one operand a bank whose first subscript is its expert axis:
    one einsum per expert (the expert letter dropped), stacked on that letter's output axis, or summed
    when the output drops it."""
    eq = equation.replace(" ", "")
    if "->" not in eq or "." in eq or eq.count(",") != 1:
        return _whole_bank(lambda x, y: torch.einsum(equation, x, y), (a, b))
    ins, out_s = eq.split("->")
    sa, sb = ins.split(",")
    bank_first = is_bank(a)
    bank, other = (a, b) if bank_first else (b, a)
    s_bank, s_other = (sa, sb) if bank_first else (sb, sa)
    if len(s_bank) != 3 or len(s_other) != other.dim() or isinstance(other, QuantizedTensor) \
            or len(set(s_bank)) != 3:
        return _whole_bank(lambda x, y: torch.einsum(equation, x, y), (a, b))
    letter = s_bank[0]
    n = bank.shape[0]
    if letter in s_other and other.shape[s_other.index(letter)] != n:
        raise QuantizationError(
            f"einsum {equation!r}: the expert axis {letter!r} has {n} experts in the bank and "
            f"{other.shape[s_other.index(letter)]} in the other operand")
    sub_other = s_other.replace(letter, "")
    sub_bank = s_bank[1:]
    sub_out = out_s.replace(letter, "")
    sub_eq = (f"{sub_bank},{sub_other}" if bank_first else f"{sub_other},{sub_bank}") + "->" + sub_out
    dtype = _float_dtype(other, bank)
    result = None
    parts = []
    for e in range(n):
        w = _matrix(bank, e, dtype, other.device)
        x = other.select(s_other.index(letter), e) if letter in s_other else other
        y = torch.einsum(sub_eq, w, x) if bank_first else torch.einsum(sub_eq, x, w)
        del w
        if letter in out_s:
            parts.append(y)
        else:
            result = y if result is None else result.add_(y)
    if letter in out_s:
        return torch.stack(parts, dim=out_s.index(letter))
    return result


# ---------------------------------------------------------------------------------------------
# Registration: views at the aten level (indexing reaches dispatch as select / slice / index),
# products at the torch-function level (before autograd or decomposition see them)
# ---------------------------------------------------------------------------------------------


@implements(aten.select.int)
def _aten_select(func, args, kwargs):
    t, dim, index = args[0], args[1], args[2]
    if is_bank(t) and dim % 3 == 0:
        return expert(t, index)
    return dequantize_fallback(func, args, kwargs)


@implements(aten.slice.Tensor)
def _aten_slice(func, args, kwargs):
    t = args[0]
    names = ("dim", "start", "end", "step")
    bound = dict(zip(names, args[1:]))
    bound.update(kwargs)
    dim = bound.get("dim", 0)
    if is_bank(t) and dim % 3 == 0:
        return experts(t, slice(bound.get("start"), bound.get("end"), bound.get("step", 1)))
    return dequantize_fallback(func, args, kwargs)


@implements(aten.index.Tensor)
def _aten_index(func, args, kwargs):
    t, indices = args[0], args[1]
    if is_bank(t) and len(indices) == 1 and indices[0] is not None and indices[0].dim() == 1 \
            and not indices[0].dtype.is_floating_point and indices[0].dtype != torch.bool:
        return experts(t, indices[0].to(t.qdata.device))
    return dequantize_fallback(func, args, kwargs)


@implements(aten.unbind.int)
def _aten_unbind(func, args, kwargs):
    t = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if is_bank(t) and dim % 3 == 0:
        return tuple(expert(t, e) for e in range(t.shape[0]))
    return dequantize_fallback(func, args, kwargs)


@implements(aten.bmm.default)
def _aten_bmm(func, args, kwargs):
    a, b = args[0], args[1]
    if (is_bank(a) and not isinstance(b, QuantizedTensor)) or (is_bank(b) and not isinstance(a, QuantizedTensor)):
        return bank_bmm(a, b)
    # a 2-D weight never reaches bmm in a linear; other batched products use the dequantized data
    log_once(logger, ("bmm", "dequantize"), logging.DEBUG, "QuantizedTensor: bmm runs on dequantized data")
    return dequantize_fallback(func, args, kwargs, quiet=True)


@implements_torch_function(torch.bmm, torch.Tensor.bmm)
def _tf_bmm(args, kwargs):
    a = args[0] if args else kwargs["input"]
    b = args[1] if len(args) > 1 else kwargs["mat2"]
    if kwargs.get("out") is not None:
        return NotImplemented
    if (is_bank(a) and not isinstance(b, QuantizedTensor)) or (is_bank(b) and not isinstance(a, QuantizedTensor)):
        return bank_bmm(a, b)
    return NotImplemented


@implements_torch_function(torch.einsum)
def _tf_einsum(args, kwargs):
    equation, operands = args[0], list(args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if len(operands) == 2 and isinstance(equation, str) and not kwargs:
        a, b = operands
        if (is_bank(a) and not isinstance(b, QuantizedTensor)) or (is_bank(b) and not isinstance(a, QuantizedTensor)):
            return bank_einsum(equation, a, b)
    return NotImplemented
