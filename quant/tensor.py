"""QuantizedTensor: an FP8 weight that looks like its original (logical) tensor.

A ``torch.Tensor`` wrapper subclass. It reports the logical dtype (``orig_dtype``) and shape and
holds, declared once in ``_TENSOR_FIELDS`` / ``_META_FIELDS``:

    qdata        FP8 data (float8_e4m3fn or float8_e5m2) in the canonical [out, in] orientation
    scale        float32, shape given by the layout (dequantize multiplies by it)
    input_scale  float32 [] or None (static activation scale for the fp8 x fp8 path)
    layout       a layout of the registry (``layouts``): PerTensor() | PerRow() | Block(r, c) |
                 MXFP8() | NVFP4(rows, cols) (packed 4-bit data, scales as bytes) | Int8(...)
    orig_dtype   logical dtype
    config       ComputeConfig or None (per weight, i.e. per model; never on the class)
    transposed   True after .t(): the logical tensor is qdata's transpose (no data moved)

Operations arrive in three steps (see ``dispatch.py``): torch-function handlers catch whole ops
(``F.linear``, ``matmul``, ...), aten handlers cover generic ops (detach, clone, device moves,
copy_, views, transposes) and matmul-like ops, and everything else runs on the dequantized
tensor with one log line per op.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
from pathlib import Path

import torch
from torch.utils._pytree import tree_map

from ..common.fingerprint import source_digest
from .config import ComputeConfig
from .errors import QuantizationError
from .kernels.ops import kernel_entry_points
from .layouts import check_layout as _check_layout
from .runtime import log_once, tracing

logger = logging.getLogger(__name__)

__all__ = ["QuantizedTensor", "dequantize_fallback"]

_TENSOR_FIELDS = ("qdata", "scale", "input_scale")  # input_scale may be None
# where a weight that memory first made int8 in place keeps its former FP8 form (compute/paths/int8.py)
DROPPED_FP8_FORM = "_dropped_fp8_form"
_META_FIELDS = ("layout", "orig_dtype", "config", "transposed")
# where a weight whose codes are still being read keeps (reads, fill, codes) until its first use (``_Codes``)
PENDING_CODES = "_pending_codes"
_ORIG_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

# Filled by dispatch.py: aten overload -> handler(func, args, kwargs); callable -> handler(args, kwargs)
ATEN_OPS: dict = {}
TORCH_FUNCTIONS: dict = {}

def _contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


@functools.lru_cache(maxsize=1)
def _code_fingerprint() -> str:
    """sha256 of the source of this package (quant/ and its kernels), read once per process."""
    return source_digest(Path(__file__).resolve().parent)


class _Codes:
    """``QuantizedTensor.qdata`` of a weight whose codes are still being read (``defer_codes``). A non-data
    descriptor: a weight with its codes in its own ``__dict__`` (every weight once they are read) never meets
    it; a pending one waits here for its read at its first use of them, whatever the use (an op, a move, a
    pickle, torch.compile), takes the read's error if it failed, and keeps the codes from then on."""

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        d = obj.__dict__
        pending = d.get(PENDING_CODES)
        if pending is None:
            raise AttributeError("qdata")
        reads, fill, codes = pending
        reads.wait(fill)
        d["qdata"] = codes
        d.pop(PENDING_CODES, None)
        return codes


class QuantizedTensor(torch.Tensor):
    """FP8 data + layout scales, reporting the logical dtype and shape. See module docstring.

    Build with :meth:`from_float` (quantize) or :meth:`from_parts` (validated existing data);
    the constructor itself does not validate and is for internal use.
    """

    qdata = _Codes()

    @staticmethod
    def __new__(cls, qdata, scale, layout, orig_dtype, input_scale=None, config=None,
                transposed=False):
        shape = layout.logical_shape(qdata.shape)  # packed data (NVFP4): the layout holds it
        if transposed:
            shape = shape[::-1]
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=_contiguous_strides(shape), dtype=orig_dtype,
            device=qdata.device, requires_grad=False,
        )

    def __init__(self, qdata, scale, layout, orig_dtype, input_scale=None, config=None,
                 transposed=False):
        self.qdata = qdata
        self.scale = scale
        self.input_scale = input_scale
        self._qlayout = layout
        self.orig_dtype = orig_dtype
        self.config = config
        self.transposed = bool(transposed)
        # the stored matrix's logical shape, before any transpose: read per call by the compute floor
        # as a plain tuple (``.shape`` of a tensor subclass goes through ``__torch_function__``)
        self.matrix_shape = tuple(layout.logical_shape(qdata.shape))

    # ``layout`` is the quantization layout; torch's own tensor layout of this wrapper is strided.
    @property
    def layout(self):
        return self._qlayout

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.qdata.dtype

    # Storage questions are answered for the FP8 data, so memory accounting and pinning see the
    # real footprint (ComfyUI computes sizes as nelement() * element_size() and pins tensors
    # named "QuantizedTensor" through data_ptr()).
    def element_size(self) -> int:
        return self._raw_codes().element_size()

    def data_ptr(self) -> int:
        return self.qdata.data_ptr()

    def is_contiguous(self, memory_format=torch.contiguous_format) -> bool:
        return self._raw_codes().is_contiguous(memory_format=memory_format)

    # -- codes still being read -------------------------------------------------------------------------

    def defer_codes(self, reads, fill) -> "QuantizedTensor":
        """Mark this weight's codes (its ``qdata``, allocated, not yet written) as being read by ``reads``
        (``safetensors_file.DeferredReads``) as ``fill``: any use of ``qdata`` waits for that read first. Views,
        detached copies and config changes of the weight (``nn.Parameter``, ``with_config``) wait with it
        without reading. Returns self."""
        d = self.__dict__
        d[PENDING_CODES] = (reads, fill, d.pop("qdata"))
        return self

    def codes_pending(self) -> bool:
        """Whether this weight's codes are still to be waited for (``defer_codes``)."""
        return PENDING_CODES in self.__dict__

    def _raw_codes(self) -> torch.Tensor:
        """``qdata`` as a tensor object without waiting for its bytes (its shape, dtype, strides and device are
        known before they are read)."""
        pending = self.__dict__.get(PENDING_CODES)
        return self.__dict__["qdata"] if pending is None else pending[2]

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_float(cls, w: torch.Tensor, layout, fp8_dtype=torch.float8_e4m3fn,
                   stochastic_rounding=None, input_scale=None, config=None) -> "QuantizedTensor":
        """Quantize a float tensor (amax-based scales; round to nearest, or stochastic rounding
        with the int seed ``stochastic_rounding``)."""
        if isinstance(w, QuantizedTensor):
            w = w.dequantize()
        if not isinstance(w, torch.Tensor) or w.dtype not in _ORIG_DTYPES:
            raise QuantizationError(
                f"from_float needs a float32/float16/bfloat16/float64 tensor, got "
                f"{getattr(w, 'dtype', type(w).__name__)}"
            )
        _check_layout(layout)
        if not layout.packed:  # a packed layout's data type is fixed (NVFP4: e2m1)
            layout.check_data_dtype(fp8_dtype, "fp8_dtype")
        if w.dim() == 0:
            raise QuantizationError("from_float needs at least a 1-D tensor, got a scalar")
        if not bool(torch.isfinite(w).all()):
            raise QuantizationError(
                f"from_float: the tensor of shape {list(w.shape)} holds inf or nan values; "
                f"they cannot be quantized"
            )
        generator = None
        if stochastic_rounding is not None:
            if isinstance(stochastic_rounding, bool) or not isinstance(stochastic_rounding, int):
                raise QuantizationError(
                    f"stochastic_rounding must be an int seed or None, got {stochastic_rounding!r}"
                )
            generator = torch.Generator(device=w.device)
            generator.manual_seed(stochastic_rounding)
        with torch.no_grad():
            qdata, scale = layout.quantize(w.detach(), fp8_dtype, generator)
        return cls.from_parts(qdata, scale, layout, orig_dtype=w.dtype, input_scale=input_scale,
                              config=config)

    @classmethod
    def from_parts(cls, qdata, scale, layout, orig_dtype=torch.bfloat16, input_scale=None,
                   config=None) -> "QuantizedTensor":
        """Wrap existing FP8 data and scales after checking them (QuantizationError on bad input)."""
        _check_layout(layout)
        if not isinstance(qdata, torch.Tensor) or isinstance(qdata, QuantizedTensor):
            raise QuantizationError(f"qdata must be a plain torch.Tensor, got {type(qdata).__name__}")
        if layout.packed:  # packed data and byte scales (NVFP4): the layout checks them
            if orig_dtype not in _ORIG_DTYPES:
                raise QuantizationError(f"orig_dtype must be one of {_ORIG_DTYPES}, got {orig_dtype}")
            if config is not None and not isinstance(config, ComputeConfig):
                raise QuantizationError(f"config must be a ComputeConfig or None, got {config!r}")
            layout.check_parts(qdata, scale)
            return cls(qdata, scale.to(qdata.device), layout, orig_dtype, None, config)
        layout.check_data_dtype(qdata.dtype, "qdata.dtype")
        if qdata.dim() == 0:
            raise QuantizationError("qdata must have at least one dimension, got a scalar")
        if orig_dtype not in _ORIG_DTYPES:
            raise QuantizationError(
                f"orig_dtype must be one of {_ORIG_DTYPES}, got {orig_dtype}"
            )
        scale = _check_scale(scale, "scale")
        scale = layout.normalize_scale(scale, tuple(qdata.shape)).to(qdata.device)
        if input_scale is not None:
            input_scale = _check_scale(input_scale, "input_scale")
            if input_scale.numel() != 1:
                raise QuantizationError(
                    f"input_scale must hold one value, got shape {list(input_scale.shape)}"
                )
            input_scale = input_scale.reshape(()).to(qdata.device)
        if config is not None and not isinstance(config, ComputeConfig):
            raise QuantizationError(f"config must be a ComputeConfig or None, got {config!r}")
        return cls(qdata, scale, layout, orig_dtype, input_scale, config)

    # -- the fields, declared once ---------------------------------------------------------------

    def _fields(self, raw: bool = False) -> dict:
        """The fields; with ``raw`` the codes as they are (``_raw_codes``: not waited for)."""
        return {
            "qdata": self._raw_codes() if raw else self.qdata, "scale": self.scale, "input_scale": self.input_scale,
            "layout": self._qlayout, "orig_dtype": self.orig_dtype, "config": self.config,
            "transposed": self.transposed,
        }

    def _replace(self, **changes) -> "QuantizedTensor":
        """A new weight of these fields with ``changes``; one that keeps the codes of a weight still being read
        waits with it (``defer_codes``) instead of waiting now."""
        f = self._fields(raw=True)
        f.update(changes)
        args = (f["qdata"], f["scale"], f["layout"], f["orig_dtype"], f["input_scale"],
                f["config"], f["transposed"])
        if torch.is_inference_mode_enabled() and not self.is_inference():
            # Views of a normal tensor must stay normal tensors under inference_mode (autograd
            # shares their version counter, which inference tensors do not have). ComfyUI runs
            # models under inference_mode with weights made outside it.
            with torch.inference_mode(False):
                out = QuantizedTensor(*args)
        else:
            out = QuantizedTensor(*args)
        pending = self.__dict__.get(PENDING_CODES)
        if pending is not None and "qdata" not in changes:
            out.defer_codes(pending[0], pending[1])
        form = self.__dict__.get(DROPPED_FP8_FORM)
        if form is not None and "layout" not in changes:
            # the same weight (a detached copy, a move, another config: what torch's Module.to and
            # nn.Parameter make of it) still knows the FP8 form memory first dropped
            out.__dict__[DROPPED_FP8_FORM] = form
        return out

    def _map_tensors(self, fn, alias: bool = False) -> "QuantizedTensor":
        """New QuantizedTensor with ``fn`` applied to every inner tensor (clone, detach, moves). ``alias``: ``fn``
        makes a view that reads no bytes (detach, alias), so codes still being read are not waited for: the new
        weight waits for the same read."""
        pending = self.__dict__.get(PENDING_CODES) if alias else None
        changes = {}
        for name in _TENSOR_FIELDS:
            t = pending[2] if name == "qdata" and pending is not None else getattr(self, name)
            changes[name] = None if t is None else fn(t)
        out = self._replace(**changes)
        if pending is not None:
            out.defer_codes(pending[0], pending[1])
        return out

    def __tensor_flatten__(self):
        names = [n for n in _TENSOR_FIELDS if getattr(self, n) is not None]
        return names, tuple(getattr(self, "_qlayout" if n == "layout" else n) for n in _META_FIELDS)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        layout, orig_dtype, config, transposed = ctx
        return QuantizedTensor(inner_tensors["qdata"], inner_tensors["scale"], layout, orig_dtype,
                               inner_tensors.get("input_scale"), config, transposed)

    def _stable_hash_for_caching(self) -> str:
        """Key of this tensor in torch.compile's compiled-graph cache: its metadata and its inner
        tensors' shapes, dtypes, strides and device types. Never the values (they are graph inputs),
        as torch's default for wrapper subclasses, which warns when a subclass lacks this method.
        The key also holds a fingerprint of this package's code: the cached graph is what this
        class's dispatch traced to, which the traced model's own graph does not show, so a changed
        pack (an update, a new rounding rule) must not reuse a graph compiled by the old one."""
        parts = [_code_fingerprint(), tuple(self.shape), repr(self._qlayout), str(self.orig_dtype),
                 repr(self.config), self.transposed, routing_state(self.config)]
        for name in _TENSOR_FIELDS:
            t = getattr(self, name)
            parts.append(None if t is None else
                         (name, tuple(t.shape), str(t.dtype), tuple(t.stride()), t.device.type))
        return hashlib.sha256(repr(parts).encode()).hexdigest()

    def __reduce_ex__(self, protocol):
        f = self._fields()
        return (_rebuild_quantized_tensor, tuple(f[n] for n in _TENSOR_FIELDS + _META_FIELDS))

    def __deepcopy__(self, memo):
        out = self._map_tensors(lambda t: t.clone())
        memo[id(self)] = out
        return out

    # -- public helpers -----------------------------------------------------------------------------

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Plain tensor ``qdata * expand(scale)`` in ``dtype`` (orig_dtype by default)."""
        dtype = self.orig_dtype if dtype is None else dtype
        if not dtype.is_floating_point or dtype.itemsize < 2:
            raise QuantizationError(f"dequantize needs a float dtype of 16 bits or more, got {dtype}")
        with torch.no_grad():
            kernel = self._qlayout.kernel_block(tuple(self.qdata.shape))
            if kernel is not None and (self.qdata.device.type != "cpu" or tracing()):
                # one pass in kernels.dequant (Triton on CUDA; the custom op while torch.compile
                # traces), rounding as the layout's own CPU code does: same bits on every device
                block, per_tensor = kernel
                w = kernel_entry_points().dequantize(self.qdata, self.scale, None if per_tensor else block,
                                                     dtype, per_tensor)
            else:
                w = self._qlayout.dequantize(self.qdata, self.scale, dtype)
        return w.t() if self.transposed else w

    def with_config(self, config: ComputeConfig | None) -> "QuantizedTensor":
        """Same storage, another compute config."""
        if config is not None and not isinstance(config, ComputeConfig):
            raise QuantizationError(f"config must be a ComputeConfig or None, got {config!r}")
        return self._replace(config=config)

    def canonical(self) -> "QuantizedTensor":
        """The un-transposed [out, in] view of this weight (shares storage)."""
        return self._replace(transposed=False) if self.transposed else self

    def requantize_(self, w: torch.Tensor, stochastic_rounding=None) -> "QuantizedTensor":
        """Overwrite this tensor's data in place from the logical float tensor ``w`` (fresh scales,
        same layout and FP8 dtype)."""
        if tuple(w.shape) != tuple(self.shape):
            raise QuantizationError(
                f"cannot write a tensor of shape {list(w.shape)} into a QuantizedTensor of shape "
                f"{list(self.shape)}"
            )
        if self.transposed:
            w = w.t()
        fresh = QuantizedTensor.from_float(w.to(self.qdata.device), self._qlayout, self.fp8_dtype,
                                           stochastic_rounding)
        with torch.no_grad():
            self.qdata.copy_(fresh.qdata)
            self.scale.copy_(fresh.scale)
        self.scales_written()
        return self

    def scales_written(self) -> None:
        """Forget what was derived from the scales and cached on this tensor (the fp8 path's
        row-wise weight scale): every in-place write of ``scale`` calls this. Inference tensors,
        which ComfyUI's loaders make, have no version counter to tell such a write otherwise."""
        self.__dict__.pop("_derived", None)

    def __repr__(self, *, tensor_contents=None):
        extra = ", transposed" if self.transposed else ""
        return (f"QuantizedTensor(shape={list(self.shape)}, dtype={self.orig_dtype}, "
                f"fp8={self.fp8_dtype}, layout={self._qlayout}, device={self.device}{extra})")

    # -- dispatch -------------------------------------------------------------------------------------

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = TORCH_FUNCTIONS.get(func)
        if handler is not None:
            out = handler(args, kwargs)
            if out is not NotImplemented:
                return out
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = ATEN_OPS.get(func)
        if handler is not None:
            return handler(func, args, kwargs)
        return dequantize_fallback(func, args, kwargs)


def _no_routing_state(config) -> str:
    return ""


# What a compiled graph of this weight's linears was routed by (the fast-path verdicts of its config's book):
# the compute floor, above this one, installs the function at import (``compute/__init__.py``).
routing_state = _no_routing_state


def _rebuild_quantized_tensor(qdata, scale, input_scale, layout, orig_dtype, config, transposed):
    return QuantizedTensor(qdata, scale, layout, orig_dtype, input_scale, config, transposed)


def _check_scale(scale, what: str) -> torch.Tensor:
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        scale = torch.tensor(float(scale), dtype=torch.float32)
    if not isinstance(scale, torch.Tensor) or isinstance(scale, QuantizedTensor):
        raise QuantizationError(f"{what} must be a float tensor, got {type(scale).__name__}")
    if not scale.dtype.is_floating_point or scale.dtype in (torch.float8_e4m3fn,
                                                             torch.float8_e5m2):
        raise QuantizationError(
            f"{what} must be float32 (or another float dtype of 16+ bits), got {scale.dtype}"
        )
    if type(scale) is not torch.Tensor or scale.dtype != torch.float32 or scale.requires_grad:
        scale = scale.detach().to(torch.float32)  # (a plain float32 tensor needing no gradient is taken as it is)
    if scale.numel() == 0:
        raise QuantizationError(f"{what} is empty")
    if scale.numel() == 1 and scale.device.type == "cpu":  # one value (most files): checked as a number
        v = scale.item()
        if math.isfinite(v) and v > 0:
            return scale
    finite = torch.isfinite(scale)
    if not bool(finite.all()):
        raise QuantizationError(
            f"{what} holds inf or nan values (first at index {_first_false(finite)}); "
            f"scales must be finite"
        )
    positive = scale > 0
    if not bool(positive.all()):
        raise QuantizationError(
            f"{what} holds zero or negative values (min {scale.min().item():g}, first at index "
            f"{_first_false(positive)}); scales must be > 0"
        )
    return scale


def _first_false(mask: torch.Tensor) -> list:
    flat = int((~mask).reshape(-1).nonzero()[0, 0])
    return [int(i) for i in torch.unravel_index(torch.tensor(flat), mask.shape)] if mask.dim() else []


def _mutated_positions(func):
    """(positional index or kwarg name) of each argument the op writes to."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            out.append((i, arg.name))
    return out


def _companion_dtype(args, kwargs):
    """dtype of the first plain float tensor among the arguments (so that ops that insist on one
    dtype, such as convolutions, get matching operands); None = the logical dtype."""
    found = []

    def visit(a):
        if (not found and isinstance(a, torch.Tensor) and not isinstance(a, QuantizedTensor)
                and a.dtype.is_floating_point and a.dtype.itemsize >= 2):
            found.append(a.dtype)
        return a

    tree_map(visit, (args, kwargs))
    return found[0] if found else None


def dequantize_fallback(func, args, kwargs, quiet: bool = False):
    """Run ``func`` on dequantized copies of every QuantizedTensor argument.

    In-place ops write their result back into the QuantizedTensor (requantized with fresh scales),
    so the fallback keeps the op's meaning. Logged once per op unless ``quiet``.
    """
    if not quiet:
        log_once(logger, ("fallback", str(func)), logging.WARNING,
                 "QuantizedTensor has no quantized kernel for %s; running it on the dequantized "
                 "tensor instead (slower; logged once per op)", func)

    dtype = _companion_dtype(args, kwargs)

    def deq(a):
        return a.dequantize(dtype) if isinstance(a, QuantizedTensor) else a

    dargs, dkwargs = tree_map(deq, args), tree_map(deq, kwargs)
    out = func(*dargs, **dkwargs)
    if func._schema.is_mutable:
        for pos, name in _mutated_positions(func):
            original = args[pos] if pos < len(args) else kwargs.get(name)
            if isinstance(original, QuantizedTensor):
                written = dargs[pos] if pos < len(dargs) else dkwargs.get(name)
                original.requantize_(written)
                out = original
    return out
