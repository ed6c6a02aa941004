"""AWQ W4A16: 4-bit unsigned weight codes with a float scale and a float zero point per group of inputs,
as comfy-kitchen 0.2.40 stores them (``TensorCoreAWQW4A16Layout``, per-layer ``comfy_quant``
``{"format": "awq_w4a16", "group_size": G}``; G = 64 unless the JSON says otherwise).

What a file holds for such a layer (``N`` outputs, ``K`` inputs):
- ``<layer>.weight``: int8 ``[N, K/2]``, two unsigned codes 0..15 per byte: column ``2j`` in bits 0..3 (the
  low nibble), column ``2j+1`` in bits 4..7;
- ``<layer>.weight_scale``: ``[K/G, N]`` float (bf16, fp16 or fp32), one scale per group and output;
- ``<layer>.weight_zeros`` (ComfyUI's and kitchen's name; the comfy-quants spec writes ``weight_zero``, read
  too): ``[K/G, N]``, the same dtype, one zero point per group and output.
A value is ``(code - 8) * scale + zero``. comfy-kitchen's eager dequantization forms it in the output dtype
promoted with the scales' dtype: the code minus 8 (exact), times the scale (one rounding), plus the zero (a
second rounding). ``dequantize`` does exactly those operations, so the bits are kitchen's in every dtype.

In memory an AWQ weight is a ``QuantizedTensor`` with layout ``AWQW4A16(rows=N, cols=K, group=G,
scale_dtype)``:
    qdata  int8 ``[N, 1, K/2]``: the file's bytes, viewed with a middle axis of one. Not 2-D on purpose:
           the compute floor's fast paths read ``[out, in]`` element data from 2-D ``qdata``; a weight whose
           data is not 2-D takes the plain path there (``layout.dequantize``, then the matmul).
    scale  ``[2, K/G, N]`` in the file's scale dtype: the scales, then the zero points (one tensor, so every
           generic operation, device moves and in-place copies alike, carries both exactly).
Pure torch; never imports ComfyUI.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from ..errors import QuantizationError
from .base import LayoutBase

__all__ = ["AWQW4A16", "FORMAT", "DEFAULT_GROUP", "ZERO_SUFFIXES", "is_awq", "unfit_reason", "unpack_codes",
           "pack_codes", "plan_layer", "file_tensors", "comfy_quant_conf"]

FORMAT = "awq_w4a16"
DEFAULT_GROUP = 64
SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# the zero points' key suffix: ComfyUI's loader and kitchen's state_dict first, the spec's spelling second
ZERO_SUFFIXES = (".weight_zeros", ".weight_zero")


@dataclass(frozen=True)
class AWQW4A16(LayoutBase):
    """Unsigned 4-bit codes with a scale and a zero point per ``group`` inputs and output; ``rows x cols`` is
    the logical ``[out, in]`` weight; ``scale_dtype`` the dtype the scales and zero points are stored in."""

    rows: int
    cols: int
    group: int = DEFAULT_GROUP
    scale_dtype: torch.dtype = torch.bfloat16

    name = FORMAT
    family = "awq"
    data_dtypes = (torch.int8,)
    packed = True

    def __post_init__(self):
        for v, what in ((self.rows, "rows"), (self.cols, "cols"), (self.group, "group")):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise QuantizationError(f"AWQW4A16 {what} must be a positive int, got {v!r}")
        if self.cols % 2 or self.cols % self.group:
            raise QuantizationError(f"AWQW4A16 needs an even in_features that the group size divides, got "
                                    f"in_features {self.cols} with group size {self.group}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise QuantizationError(f"AWQW4A16 scales are bfloat16, float16 or float32, got {self.scale_dtype}")

    @classmethod
    def for_shape(cls, shape, group: int = DEFAULT_GROUP, scale_dtype=torch.bfloat16) -> "AWQW4A16":
        if len(shape) != 2:
            raise QuantizationError(f"layout AWQW4A16 needs a 2-D weight [out, in], got shape {list(shape)}")
        return cls(int(shape[0]), int(shape[1]), int(group), scale_dtype)

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def groups(self) -> int:
        return self.cols // self.group

    @property
    def storage_shape(self) -> tuple[int, int, int]:
        return self.rows, 1, self.cols // 2

    @property
    def scale_shape(self) -> tuple[int, int, int]:
        return 2, self.groups, self.rows

    def logical_shape(self, storage_shape) -> tuple:
        return self.shape

    def check_parts(self, qdata: torch.Tensor, scale: torch.Tensor) -> None:
        """QuantizationError unless qdata/scale are this layout's storage (see the module docstring)."""
        if not isinstance(qdata, torch.Tensor) or qdata.dtype != torch.int8 or tuple(qdata.shape) != self.storage_shape:
            raise QuantizationError(
                f"AWQ W4A16 data for a weight of shape {list(self.shape)} must be int8 of shape "
                f"{list(self.storage_shape)}, got {getattr(qdata, 'dtype', type(qdata).__name__)} "
                f"{list(getattr(qdata, 'shape', []))}")
        if (not isinstance(scale, torch.Tensor) or scale.dtype != self.scale_dtype
                or tuple(scale.shape) != self.scale_shape):
            raise QuantizationError(
                f"AWQ W4A16 scales for a weight of shape {list(self.shape)} (group size {self.group}) must be "
                f"{self.scale_dtype} of shape {list(self.scale_shape)} (scales, then zero points), got "
                f"{getattr(scale, 'dtype', type(scale).__name__)} {list(getattr(scale, 'shape', []))}")
        if not bool(torch.isfinite(scale).all()):
            raise QuantizationError("AWQ W4A16 scales and zero points must be finite (inf or NaN found)")

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """``[N, K]`` in ``dtype``: ``(code - 8) * scale + zero`` formed as comfy-kitchen forms it (in ``dtype``
        promoted with the scale dtype, one rounding per operation), then cast to ``dtype``."""
        n, k, g = self.rows, self.cols, self.group
        s, z = scale[0].t().unsqueeze(-1), scale[1].t().unsqueeze(-1)
        if torch.promote_types(dtype, scale.dtype) == dtype:
            # the same operations in place, in one buffer: the codes converted while they are unpacked
            b = q.reshape(n, k // 2).view(torch.uint8)
            w = out if out is not None and out.dtype == dtype and out.is_contiguous() else torch.empty(
                n, k, dtype=dtype, device=q.device)
            w = w.view(n, k)
            w[:, 0::2] = b & 0x0F
            w[:, 1::2] = b >> 4
            w.view(n, k // g, g).sub_(8.0).mul_(s).add_(z)
            if out is None:
                return w
            return out if w.data_ptr() == out.data_ptr() else out.copy_(w)
        codes = unpack_codes(q.reshape(n, k // 2)).view(n, k // g, g).to(dtype)
        w = ((codes - 8.0) * s + z).view(n, k).to(dtype)  # formed in the promoted dtype, then cast
        if out is not None:
            return out.copy_(w)
        return w

    def quantize(self, w: torch.Tensor, fp8_dtype=None, generator=None):
        """A float ``[rows, cols]`` weight -> (data, scales): per group and output, round to nearest (or
        stochastically with ``generator``) onto 16 levels from the group's minimum to its maximum; the
        scale ``(max - min) / 15`` and zero ``min + 8 * scale`` are rounded to ``scale_dtype`` first and the
        codes computed against the rounded values, so the stored parts give the closest grid they can."""
        if tuple(w.shape) != self.shape:
            raise QuantizationError(f"layout AWQW4A16({self.rows}, {self.cols}) cannot hold a weight of shape "
                                    f"{list(w.shape)}")
        n, k, g = self.rows, self.cols, self.group
        x = w.to(torch.float32).reshape(n, k // g, g)
        lo, hi = x.amin(dim=-1), x.amax(dim=-1)
        s = ((hi - lo) / 15.0).to(self.scale_dtype)
        z = (lo.to(torch.float64) + 8.0 * s.to(torch.float64)).to(self.scale_dtype)
        sf, zf = s.to(torch.float32), z.to(torch.float32)
        safe = torch.where(sf == 0, torch.ones_like(sf), sf)
        v = (x - zf.unsqueeze(-1)) / safe.unsqueeze(-1) + 8.0
        v = torch.where((sf == 0).unsqueeze(-1), torch.full_like(v, 8.0), v)
        if generator is None:
            codes = torch.round(v)
        else:
            noise = torch.rand(v.shape, generator=generator, device=v.device, dtype=torch.float32)
            codes = torch.floor(v + noise)
        codes = codes.clamp_(0, 15).to(torch.uint8).reshape(n, k)
        scale = torch.stack((s.t(), z.t())).contiguous()
        return pack_codes(codes).reshape(self.storage_shape), scale


def unfit_reason(shape, group: int = DEFAULT_GROUP) -> str | None:
    """Why a weight of ``shape`` cannot be written as AWQ W4A16 with ``group`` (None: it can), for a quantizer
    that keeps such layers in full precision instead of failing."""
    if len(shape) != 2:
        return f"not a 2-D weight (shape {list(shape)})"
    if shape[1] % 2 or shape[1] % group:
        return f"in_features {shape[1]} is not a multiple of the AWQ group size {group}"
    return None


def is_awq(t) -> bool:
    """Whether ``t`` is a QuantizedTensor (or anything with a ``layout``) in the AWQ W4A16 layout."""
    return isinstance(getattr(t, "layout", None), AWQW4A16)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """int8 ``[..., K/2]`` -> uint8 codes ``[..., K]`` in 0..15: column 2j from bits 0..3, 2j+1 from bits 4..7."""
    b = packed.view(torch.uint8)
    return torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`unpack_codes`: codes 0..15 ``[..., K]`` (K even) -> int8 ``[..., K/2]``."""
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def _group(err, key: str, cq: dict) -> int:
    g = cq.get("group_size", DEFAULT_GROUP)
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
        raise err(key, f"group_size is {g!r}", "a positive integer (comfy-kitchen writes 64)")
    return g


def plan_layer(err, name: str, cq: dict, tensors: dict, get):
    """How to build one AWQ W4A16 layer: ``(layout, scale [2, K/G, N], scale key, extra keys consumed,
    decode(file weight) -> qdata)``. Every shape and dtype is checked against the others before anything is
    built. ``tensors``: the header's entries (``.dtype``, ``.shape``); ``get(key)``: reads a (small) tensor;
    ``err(key, problem, expected)`` makes the caller's error (which names the file)."""
    cq_key, wk = name + ".comfy_quant", name + ".weight"
    group = _group(err, cq_key, cq)
    e = tensors[wk]
    if e.dtype not in (torch.int8, torch.uint8) or len(e.shape) != 2 or e.shape[0] < 1 or e.shape[1] < 1:
        raise err(wk, f"an awq_w4a16 weight of dtype {e.dtype} and shape {list(e.shape)}",
                  "int8 [out, in / 2]: two unsigned 4-bit codes per byte")
    n, k = int(e.shape[0]), int(e.shape[1]) * 2
    if k % group:
        raise err(cq_key, f"group_size {group} does not divide in_features {k} (the weight's rows are {k // 2} "
                  "bytes)", "a group size that divides in_features (comfy-kitchen writes 64)")
    sk = name + ".weight_scale"
    zks = [name + s for s in ZERO_SUFFIXES if name + s in tensors]
    if sk not in tensors:
        raise err(sk, "missing for an awq_w4a16 layer", f"a tensor '{sk}' of shape [{k // group}, {n}]")
    if not zks:
        raise err(name + ZERO_SUFFIXES[0], "missing for an awq_w4a16 layer",
                  f"the zero points '{name}{ZERO_SUFFIXES[0]}' (or '{name}{ZERO_SUFFIXES[1]}') of shape "
                  f"[{k // group}, {n}]")
    if len(zks) > 1:
        raise err(zks[1], f"the layer has both {zks}", "one tensor of zero points")
    zk = zks[0]
    want = (k // group, n)
    for key in (sk, zk):
        t = tensors[key]
        if t.dtype not in SCALE_DTYPES or tuple(t.shape) != want:
            raise err(key, f"{t.dtype} of shape {list(t.shape)} for a weight of {n} outputs and {k} inputs "
                      f"(group size {group})", f"bfloat16, float16 or float32 of shape {list(want)}")
    if tensors[sk].dtype != tensors[zk].dtype:
        raise err(zk, f"zero points are {tensors[zk].dtype} but the scales are {tensors[sk].dtype}",
                  "scales and zero points of one dtype")
    layout = AWQW4A16(n, k, group, tensors[sk].dtype)
    scale = torch.stack((get(sk), get(zk))).contiguous()
    if not bool(torch.isfinite(scale).all()):
        bad = sk if not bool(torch.isfinite(scale[0]).all()) else zk
        raise err(bad, "holds inf or NaN", "finite scales and zero points")
    return layout, scale, sk, (zk, cq_key), lambda q: q.view(torch.int8).reshape(layout.storage_shape)


def comfy_quant_conf(layout: AWQW4A16) -> dict:
    return {"format": FORMAT, "group_size": layout.group}


def file_tensors(w) -> dict[str, torch.Tensor]:
    """An AWQ W4A16 QuantizedTensor in comfy-kitchen's on-disk form: ``{"weight", "weight_scale",
    "weight_zeros", "comfy_quant"}`` (key suffixes of the layer); the stored bytes as they were read."""
    if not is_awq(w):
        raise QuantizationError(f"not an AWQ W4A16 weight: {w!r}")
    lay = w.layout
    blob = json.dumps(comfy_quant_conf(lay)).encode("utf-8")
    return {"weight": w.qdata.reshape(lay.rows, lay.cols // 2),
            "weight_scale": w.scale[0], "weight_zeros": w.scale[1],
            "comfy_quant": torch.tensor(list(blob), dtype=torch.uint8)}
