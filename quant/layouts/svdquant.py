"""SVDQuant W4A4: signed 4-bit weights per group of 64 inputs, a per-input smoothing factor and a low-rank
branch, in comfy-kitchen 0.2.40's tile-packed form (``comfy_quant`` ``{"format": "svdquant_w4a4", "layout":
"kitchen_tile_packed_w4a4"}``; Comfy-Org's comfy-quants spec ``svdquant_w4a4_kitchen_tilepack.md``).

What a file holds for such a layer (``N`` outputs, a multiple of 128; ``K`` inputs, a multiple of 64; rank
``R``), each key also read under kitchen's ``state_dict`` names (``weight_smooth_factor``,
``weight_proj_down``, ``weight_proj_up``):
- ``<layer>.weight``: int8 ``[N/128, K/64, 32, 128]``, two signed 4-bit values per byte (the even column in
  the low nibble), tiled: tile ``t`` of 128 outputs, group ``g`` of 64 inputs, row ``q`` of 4 interleaved
  outputs, 4 x 32 bytes; the natural form ``[N, K/2]`` is read too;
- ``<layer>.weight_scale``: ``[N/128, K/64, 128]`` (or natural ``[K/64, N]``), one scale per group and output;
- ``<layer>.smooth_factor``: ``[K]``; ``<layer>.proj_down``: ``[K, R]``; ``<layer>.proj_up``: ``[N/128, R, 128]``
  (or natural ``[N, R]``); all float (bf16, fp16 or fp32).
kitchen's product (its eager backend) is ``Q4(x / smooth) @ (w * scale).T + x @ proj_down @ proj_up.T + bias``,
with ``x + 0.171875`` in place of ``x`` in the first term for ``act_unsigned`` layers (nunchaku's post-GELU
layers), where ``Q4`` quantizes the activation to 4 bits per row and 64 inputs. The low-rank branch reads the
raw activation (the spec's ``lowrank_branch_input_basis`` "raw", ``proj_down`` smooth-folded: the only basis
kitchen runs; a file that declares another is refused).

The pack has no W4A4 product: its compute floor multiplies the effective weight (weight-only), which is the
same linear map without the activation's 4-bit rounding:
    W_eff = (w * scale) / smooth[None, :] + proj_up @ proj_down.T     (formed in float32, then cast)
and, for ``act_unsigned`` layers, a constant ``(0.171875 / smooth) @ (w * scale).T`` that the loader adds to
the layer's bias (``unsigned_shift_bias``).

In memory an SVDQuant weight is a ``QuantizedTensor`` with layout ``SVDQuantW4A4``:
    qdata  the file's int8 weight: ``[N/128, K/64, 32, 128]`` tiled, or ``[N, 1, K/2]`` for the natural form
           (never 2-D: the compute floor's fast paths read 2-D data as ``[out, in]`` elements; other data
           takes its plain path, ``layout.dequantize`` and the matmul)
    scale  uint8, flat: the bytes of weight_scale, smooth_factor, proj_down and proj_up as stored (one tensor,
           so device moves and in-place copies carry all four exactly); the layout holds their dtypes and shapes.
Pure torch; never imports ComfyUI.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from ..errors import QuantizationError
from .base import LayoutBase

__all__ = ["SVDQuantW4A4", "FORMAT", "TILE_LAYOUT", "GROUP", "TILE_N", "UNSIGNED_SHIFT", "is_svdquant",
           "plan_layer", "file_tensors", "untile_weight", "tile_weight", "unpack_signed", "unsigned_shift_bias"]

FORMAT = "svdquant_w4a4"
TILE_LAYOUT = "kitchen_tile_packed_w4a4"
GROUP = 64
TILE_N = 128
INTERLEAVE = 4
UNSIGNED_SHIFT = 0.171875  # nunchaku's post-GELU shift, as kitchen applies it to act_unsigned layers
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PART_NAMES = ("weight_scale", "smooth_factor", "proj_down", "proj_up")
# spec name -> kitchen's state_dict name (both are read; the spec's is written)
_KITCHEN_NAMES = {"smooth_factor": "weight_smooth_factor", "proj_down": "weight_proj_down",
                  "proj_up": "weight_proj_up"}


@dataclass(frozen=True)
class SVDQuantW4A4(LayoutBase):
    """Signed 4-bit weights with group scales, smoothing and a rank-``rank`` branch; ``rows x cols`` is the
    logical ``[out, in]`` weight. ``parts``: ``(name, dtype, shape)`` of each tensor held in the scale bytes,
    in ``PART_NAMES`` order, as the file stores them; ``tiled``: the weight's form; ``conf``: the layer's JSON
    (sorted, compact), written back as it was."""

    rows: int
    cols: int
    rank: int
    parts: tuple
    tiled: bool = True
    act_unsigned: bool = False
    conf: str = ""

    name = FORMAT
    family = "svdquant"
    data_dtypes = (torch.int8,)
    packed = True

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def storage_shape(self) -> tuple:
        if self.tiled:
            return self.rows // TILE_N, self.cols // GROUP, TILE_N // INTERLEAVE, INTERLEAVE * GROUP // 2
        return self.rows, 1, self.cols // 2

    def scale_numel(self) -> int:
        return sum(math.prod(shape) * torch.empty((), dtype=dt).element_size() for _, dt, shape in self.parts)

    def logical_shape(self, storage_shape) -> tuple:
        return self.shape

    def check_parts(self, qdata: torch.Tensor, scale: torch.Tensor) -> None:
        if not isinstance(qdata, torch.Tensor) or qdata.dtype != torch.int8 or tuple(qdata.shape) != self.storage_shape:
            raise QuantizationError(
                f"SVDQuant W4A4 data for a weight of shape {list(self.shape)} must be int8 of shape "
                f"{list(self.storage_shape)}, got {getattr(qdata, 'dtype', type(qdata).__name__)} "
                f"{list(getattr(qdata, 'shape', []))}")
        if (not isinstance(scale, torch.Tensor) or scale.dtype != torch.uint8 or scale.dim() != 1
                or scale.numel() != self.scale_numel()):
            raise QuantizationError(
                f"SVDQuant W4A4 scale bytes for {self!r} must be uint8 of shape [{self.scale_numel()}], got "
                f"{getattr(scale, 'dtype', type(scale).__name__)} {list(getattr(scale, 'shape', []))}")

    def split(self, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        """The scale bytes -> {name: tensor as stored} (views)."""
        out, at = {}, 0
        for name, dt, shape in self.parts:
            n = math.prod(shape) * torch.empty((), dtype=dt).element_size()
            out[name] = scale[at: at + n].view(dt).view(shape)
            at += n
        return out

    def natural(self, q: torch.Tensor, scale: torch.Tensor, unpack: bool = True):
        """(signed codes int8 [N, K] (or, without ``unpack``, their bytes [N, K/2]), scales [K/64, N], smooth [K],
        proj_down [K, R], proj_up [N, R])."""
        p = self.split(scale)
        w = untile_weight(q) if self.tiled else q.reshape(self.rows, self.cols // 2)
        ws, up = p["weight_scale"], p["proj_up"]
        if ws.dim() == 3:
            ws = ws.permute(1, 0, 2).reshape(self.cols // GROUP, self.rows)
        if up.dim() == 3:
            up = up.permute(0, 2, 1).reshape(self.rows, self.rank)
        return (unpack_signed(w) if unpack else w), ws, p["smooth_factor"], p["proj_down"], up

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """The effective ``[N, K]`` weight in ``dtype`` (see the module docstring), formed in float32 (float64
        when asked for float64) and rounded once."""
        work = torch.float64 if dtype == torch.float64 else torch.float32
        packed, ws, smooth, down, up = self.natural(q, scale, unpack=False)
        n, k = self.shape
        b = packed.view(torch.uint8)
        w = torch.empty(n, k, dtype=work, device=q.device)
        w[:, 0::2] = (b & 0x0F) ^ 8  # a signed nibble v is stored as v & 15: (v & 15) ^ 8 is v + 8
        w[:, 1::2] = (b >> 4) ^ 8
        w.sub_(8.0).view(n, k // GROUP, GROUP).mul_(ws.to(work).t().unsqueeze(-1))
        w.div_(smooth.to(work)).addmm_(up.to(work), down.to(work).t())
        w = w.to(dtype)
        if out is not None:
            return out.copy_(w)
        return w

    def shift_bias(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
        """float32 ``[N]``: the constant an ``act_unsigned`` layer's product adds (its activation shift through
        the 4-bit branch), or None for other layers."""
        if not self.act_unsigned:
            return None
        codes, ws, smooth, _, _ = self.natural(q, scale)
        n, k = self.shape
        w = (codes.float().view(n, k // GROUP, GROUP) * ws.float().t().unsqueeze(-1)).view(n, k)
        return w @ (UNSIGNED_SHIFT / smooth.float())

    def quantize(self, w, fp8_dtype=None, generator=None):
        raise QuantizationError("SVDQuant W4A4 weights come from offline calibration (smoothing and the low-rank "
                                "branch); the pack reads them but does not make them, and cannot requantize one "
                                "in place (a LoRA patch on such a layer is refused)")


def is_svdquant(t) -> bool:
    return isinstance(getattr(t, "layout", None), SVDQuantW4A4)


def untile_weight(q: torch.Tensor) -> torch.Tensor:
    """Tiled ``[N/128, K/64, 32, 128]`` -> natural ``[N, K/2]``: byte ``b`` of row ``q`` of a tile holds
    output ``4q + b // 32``, input bytes ``b % 32`` of its group."""
    t, g, quads, width = q.shape
    return q.view(t, g, quads, INTERLEAVE, width // INTERLEAVE).permute(0, 2, 3, 1, 4).reshape(
        t * TILE_N, g * GROUP // 2)


def tile_weight(w: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`untile_weight`: natural ``[N, K/2]`` -> tiled ``[N/128, K/64, 32, 128]``."""
    n, half = w.shape
    t, g = n // TILE_N, half // (GROUP // 2)
    return w.view(t, TILE_N // INTERLEAVE, INTERLEAVE, g, GROUP // 2).permute(0, 3, 1, 2, 4).reshape(
        t, g, TILE_N // INTERLEAVE, INTERLEAVE * GROUP // 2)


def unpack_signed(packed: torch.Tensor) -> torch.Tensor:
    """int8 ``[..., K/2]`` -> signed values int8 ``[..., K]`` in -8..7, the even column from the low nibble."""
    b = packed.view(torch.uint8)
    lo, hi = (b & 0x0F).view(torch.int8), (b >> 4).view(torch.int8)
    both = torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return torch.where(both >= 8, both - 16, both)


def _find(tensors: dict, name: str, part: str):
    keys = [k for k in (f"{name}.{part}", f"{name}.{_KITCHEN_NAMES.get(part, part)}") if k in tensors]
    return list(dict.fromkeys(keys))


def plan_layer(err, name: str, cq: dict, tensors: dict, get):
    """How to build one SVDQuant W4A4 layer: ``(layout, scale bytes, scale key, extra keys consumed, decode(file
    weight) -> qdata)``. Every shape and dtype is checked against the others before anything is read beyond
    the header. ``err(key, problem, expected)`` makes the caller's error (which names the file)."""
    cq_key, wk = name + ".comfy_quant", name + ".weight"
    lay = cq.get("layout")
    if lay not in (TILE_LAYOUT, None):
        raise err(cq_key, f"svdquant_w4a4 layout {lay!r}", f"'{TILE_LAYOUT}' (or no layout: the natural form)")
    basis = cq.get("lowrank_branch_input_basis", "raw")
    if basis != "raw" or cq.get("proj_down_smooth_folded", True) is not True:
        raise err(cq_key, f"the low-rank branch reads the {basis!r} activation (proj_down_smooth_folded "
                  f"{cq.get('proj_down_smooth_folded')!r}), which comfy-kitchen's product does not run (its branch "
                  "multiplies the raw activation by proj_down)",
                  "lowrank_branch_input_basis 'raw' with proj_down smooth-folded (or neither key)")
    unsigned = cq.get("act_unsigned", False)
    if not isinstance(unsigned, bool):
        raise err(cq_key, f"act_unsigned is {unsigned!r}", "true or false")
    e = tensors[wk]
    tiled = len(e.shape) == 4
    if e.dtype != torch.int8 or not (
            (tiled and tuple(e.shape[2:]) == (TILE_N // INTERLEAVE, INTERLEAVE * GROUP // 2) and min(e.shape) > 0)
            or (len(e.shape) == 2 and min(e.shape) > 0 and (2 * e.shape[1]) % GROUP == 0 and lay is None)):
        raise err(wk, f"an svdquant_w4a4 weight of dtype {e.dtype} and shape {list(e.shape)} (layout {lay!r})",
                  f"int8 [N/128, K/64, {TILE_N // INTERLEAVE}, {INTERLEAVE * GROUP // 2}] for '{TILE_LAYOUT}' "
                  "(N a multiple of 128, K of 64), or [N, K/2] without a layout")
    n, k = (e.shape[0] * TILE_N, e.shape[1] * GROUP) if tiled else (e.shape[0], e.shape[1] * 2)
    keys = {}
    for part in PART_NAMES:
        found = _find(tensors, name, part)
        if not found:
            raise err(f"{name}.{part}", "missing for an svdquant_w4a4 layer", f"a tensor '{name}.{part}'")
        if len(found) > 1:
            raise err(found[1], f"the layer has both {found}", "one of the two spellings")
        keys[part] = found[0]
    for part, key in keys.items():
        if tensors[key].dtype not in FLOAT_DTYPES:
            raise err(key, f"dtype {tensors[key].dtype}", "bfloat16, float16 or float32")
    down = tensors[keys["proj_down"]]
    rank = int(down.shape[1]) if len(down.shape) == 2 else -1
    wants = {
        "weight_scale": [(k // GROUP, n)] + ([(n // TILE_N, k // GROUP, TILE_N)] if tiled else []),
        "smooth_factor": [(k,)],
        "proj_down": [(k, max(rank, 1))],
        "proj_up": [(n, max(rank, 1))] + ([(n // TILE_N, max(rank, 1), TILE_N)] if tiled else []),
    }
    if rank > min(n, k):
        raise err(keys["proj_down"], f"a low-rank branch of rank {rank} for a weight of {n} outputs and {k} inputs",
                  f"a rank of at most {min(n, k)} (SVDQuant writes 16 to 128)")
    for part, key in keys.items():
        shape = tuple(tensors[key].shape)
        if shape not in wants[part] or rank < 1:
            raise err(key, f"shape {list(shape)} for a weight of {n} outputs and {k} inputs (rank "
                      f"{rank if rank > 0 else '?'} from proj_down)", " or ".join(str(list(s)) for s in wants[part]))
    parts, raw = [], []
    for part in PART_NAMES:
        t = get(keys[part]).contiguous()
        if not bool(torch.isfinite(t).all()):
            raise err(keys[part], "holds inf or NaN", "finite values")
        if part == "smooth_factor" and bool((t == 0).any()):
            raise err(keys[part], "holds zeros (the activation is divided by it)", "a smoothing factor without zeros")
        parts.append((part, t.dtype, tuple(t.shape)))
        raw.append(t.view(torch.uint8).reshape(-1))
    conf = json.dumps({key: v for key, v in cq.items()}, sort_keys=True, separators=(",", ":"))
    layout = SVDQuantW4A4(n, k, rank, tuple(parts), tiled, unsigned, conf)
    extra = tuple(keys[p] for p in PART_NAMES[1:]) + (cq_key,)
    return layout, torch.cat(raw), keys["weight_scale"], extra, lambda q: q.view(torch.int8).reshape(layout.storage_shape)


def unsigned_shift_bias(w) -> torch.Tensor | None:
    """The constant (float32 ``[N]``) an ``act_unsigned`` SVDQuant weight's product adds, or None."""
    return w.layout.shift_bias(w.qdata, w.scale) if is_svdquant(w) else None


def file_tensors(w) -> dict[str, torch.Tensor]:
    """An SVDQuant W4A4 QuantizedTensor in the spec's form: {"weight", "weight_scale", "smooth_factor",
    "proj_down", "proj_up", "comfy_quant"} (key suffixes of the layer), bytes as they were read."""
    if not is_svdquant(w):
        raise QuantizationError(f"not an SVDQuant W4A4 weight: {w!r}")
    lay = w.layout
    out = {"weight": w.qdata if lay.tiled else w.qdata.reshape(lay.rows, lay.cols // 2)}
    out.update(lay.split(w.scale))
    out["comfy_quant"] = torch.tensor(list(lay.conf.encode("utf-8")), dtype=torch.uint8)
    return out
