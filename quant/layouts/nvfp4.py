"""NVFP4: 4-bit e2m1 weights with one FP8 e4m3 scale per 16 inputs and one float32 scale per tensor,
as ComfyUI stores them (comfy-kitchen's `TensorCoreNVFP4Layout`; 0.29 and newer, the form 0.33 ships).

What such a file holds for a layer whose `<layer>.comfy_quant` says `{"format": "nvfp4"}`:
- `<layer>.weight`: uint8 `[R, C / 2]`, two e2m1 codes per byte, the even column in the high nibble;
  `R, C` are the layer's `[out, in]` each rounded up to a multiple of 16 (zero padding);
- `<layer>.weight_scale`: float8_e4m3fn block scales, one per row and 16 columns, in cuBLAS's tiled
  "128 x 4" order (the same order as MXFP8's, see `mxfp8.unswizzle`), padded to
  `[128 * ceil(R / 128), 4 * ceil(C / 16 / 4)]`, the 2-D shape comfy-kitchen writes (any other shape
  holding as many bytes, transposed or flat, is refused: it would read as the scales of other blocks);
- `<layer>.weight_scale_2`: the float32 per-tensor scale (a scalar); its product with the largest block
  scale and the largest e2m1 value (6) must fit the compute dtype, else the weight would be inf;
- a `group_size` in the layer's JSON, where a file gives one, must be 16 (the only one the form has);
- optionally `<layer>.input_scale` (for Blackwell's fp4 x fp4 matmul, which the pack does not use).
A value is `e2m1 * (tensor_scale * block_scale)`. comfy-kitchen's eager dequantization forms that in
the output dtype: both scales are converted to it, multiplied (one rounding), and the e2m1 value is
multiplied by the product (a second rounding). `dequantize_padded` does exactly those operations, so
the results are the same bits in every output dtype.

In memory an NVFP4 weight is a `QuantizedTensor` with layout `NVFP4(rows, cols)` (its logical, true
`[out, in]`):
    qdata  uint8 `[R, C / 2]` as in the file (padding kept: a cut would split bytes for odd sizes)
    scale  uint8, flat: the `R x C / 16` e4m3 block scale bytes in plain row-major order, then the 4
           bytes of the float32 tensor scale. One tensor, so every generic operation (device moves,
           in-place copies of LoRA patching and unpatching, pinning) carries both scales exactly.
A file gives only the padded size; `at_shape` sets the layer's true size (a new layout, no data
moves) when the model's Linear declares it, as `mxfp8.at_shape` does.

These weights run weight-only everywhere (the fp4 x fp4 matmul needs Blackwell): `compute/nvfp4.py`.
Pure torch; never imports ComfyUI.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import QuantizationError
from .base import LayoutBase
from .mxfp8 import check_tiled_shape, swizzle, unswizzle

GROUP = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# e2m1 code -> value; bit 3 is the sign
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Round to nearest, ties to the even code: a magnitude moves past boundary i to code i + 1 when it is
# above it, or equal to it when code i + 1 is even.
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

__all__ = ["NVFP4", "GROUP", "is_nvfp4", "padded_weight_shape", "unpack_codes", "pack_codes", "split_scales",
           "join_scales", "dequantize_padded", "encode_e2m1", "at_shape", "scales_from_file", "file_tensors"]


def _round_up(v: int, m: int) -> int:
    return m * math.ceil(v / m)


def padded_weight_shape(shape) -> tuple[int, int]:
    """The logical `[out, in]` rounded up to multiples of 16 (the unpacked size of a file's data)."""
    out, inp = (int(v) for v in shape)
    return _round_up(out, GROUP), _round_up(inp, GROUP)


@dataclass(frozen=True)
class NVFP4(LayoutBase):
    """Packed e2m1 data + e4m3 block scales per 1 x 16 + a float32 tensor scale; `rows x cols` is the
    logical weight shape (the stored data is padded to multiples of 16)."""

    rows: int
    cols: int

    name = "nvfp4"
    family = "nvfp4"
    data_dtypes = (torch.uint8,)
    packed = True

    def logical_shape(self, storage_shape) -> tuple:
        return self.shape

    def __post_init__(self):
        for v, what in ((self.rows, "rows"), (self.cols, "cols")):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise QuantizationError(f"NVFP4 {what} must be a positive int, got {v!r}")

    @classmethod
    def for_shape(cls, shape) -> "NVFP4":
        if len(shape) != 2:
            raise QuantizationError(f"layout NVFP4 needs a 2-D weight [out, in], got shape {list(shape)}")
        return cls(int(shape[0]), int(shape[1]))

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def padded(self) -> tuple[int, int]:
        return padded_weight_shape(self.shape)

    @property
    def storage_shape(self) -> tuple[int, int]:
        r, c = self.padded
        return r, c // 2

    @property
    def blocks(self) -> int:
        return self.padded[1] // GROUP

    def scale_numel(self) -> int:
        return self.padded[0] * self.blocks + 4

    def check_parts(self, qdata: torch.Tensor, scale: torch.Tensor) -> None:
        """QuantizationError unless qdata/scale are this layout's storage (see the module docstring)."""
        if not isinstance(qdata, torch.Tensor) or qdata.dtype != torch.uint8 or tuple(qdata.shape) != self.storage_shape:
            raise QuantizationError(
                f"NVFP4 data for a weight of shape {list(self.shape)} must be uint8 of shape "
                f"{list(self.storage_shape)}, got {getattr(qdata, 'dtype', type(qdata).__name__)} "
                f"{list(getattr(qdata, 'shape', []))}")
        if (not isinstance(scale, torch.Tensor) or scale.dtype != torch.uint8 or scale.dim() != 1
                or scale.numel() != self.scale_numel()):
            raise QuantizationError(
                f"NVFP4 scales for a weight of shape {list(self.shape)} must be uint8 of shape "
                f"[{self.scale_numel()}] (block scale bytes, then the float32 tensor scale), got "
                f"{getattr(scale, 'dtype', type(scale).__name__)} {list(getattr(scale, 'shape', []))}")
        block, ts = split_scales(scale, self)
        t = float(ts)
        if not math.isfinite(t) or t <= 0:
            raise QuantizationError(f"NVFP4 tensor scale must be finite and > 0, got {t}")
        b = block.to(torch.float32)
        if not bool(torch.isfinite(b).all()) or bool((b < 0).any()):
            raise QuantizationError("NVFP4 block scales must be finite and >= 0 (e4m3 NaN or a negative scale found)")

    def quantize(self, w: torch.Tensor, fp8_dtype, generator):
        """A float `[rows, cols]` weight -> (packed data, scale bytes); round to nearest even, or
        stochastic with `generator`. The scales follow comfy-kitchen's quantizer: tensor scale
        amax / (448 * 6), block scale = block amax / 6 / tensor scale rounded to e4m3."""
        if tuple(w.shape) != self.shape:
            raise QuantizationError(f"layout NVFP4({self.rows}, {self.cols}) cannot hold a weight of shape "
                                    f"{list(w.shape)}")
        r, c = self.padded
        x = w.to(torch.float32)
        if (r, c) != self.shape:
            x = torch.nn.functional.pad(x, (0, c - self.cols, 0, r - self.rows))
        amax = x.abs().amax()
        ts = amax / (E4M3_MAX * E2M1_MAX)
        if not bool(ts > 0):
            ts = torch.ones((), dtype=torch.float32, device=x.device)
        groups = x.reshape(r, c // GROUP, GROUP)
        block = (groups.abs().amax(dim=-1) / E2M1_MAX / ts).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
        total = ts * block.to(torch.float32)
        safe = torch.where(total == 0, torch.ones_like(total), total)
        v = torch.where(total[..., None] == 0, torch.zeros_like(groups), groups / safe[..., None])
        codes = encode_e2m1(v.clamp(-E2M1_MAX, E2M1_MAX).reshape(r, c), generator)
        return pack_codes(codes), join_scales(block, ts)

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        block, ts = split_scales(scale, self)
        w = dequantize_padded(q, block, ts, dtype)
        if tuple(w.shape) != self.shape:
            w = w[: self.rows, : self.cols].contiguous()
        if out is not None:
            return out.copy_(w)
        return w


def is_nvfp4(t) -> bool:
    """Whether `t` is a QuantizedTensor (or anything with a `layout`) in the NVFP4 layout."""
    return isinstance(getattr(t, "layout", None), NVFP4)


def unpack_codes(qdata: torch.Tensor) -> torch.Tensor:
    """uint8 `[R, C / 2]` -> the e2m1 codes `[R, C]` (high nibble first)."""
    return torch.stack((qdata >> 4, qdata & 0x0F), dim=-1).reshape(*qdata.shape[:-1], qdata.shape[-1] * 2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes `[R, C]` (C even) -> uint8 `[R, C / 2]`, the even column in the high nibble."""
    pairs = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] << 4) | pairs[..., 1]


def split_scales(scale: torch.Tensor, layout: NVFP4) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat scale bytes -> (e4m3 block scales `[R, C / 16]`, float32 tensor scale `[]`); views."""
    n = layout.padded[0] * layout.blocks
    block = scale[:n].view(torch.float8_e4m3fn).view(layout.padded[0], layout.blocks)
    ts = scale[n:].view(torch.float32).reshape(())
    return block, ts


def join_scales(block: torch.Tensor, ts: torch.Tensor) -> torch.Tensor:
    """Inverse of `split_scales`: e4m3 `[R, B]` block scales and a float32 scalar -> flat bytes."""
    ts = torch.as_tensor(ts, dtype=torch.float32).reshape(1).to(block.device)
    return torch.cat((block.contiguous().view(torch.uint8).reshape(-1), ts.view(torch.uint8)))


def _e2m1_table(dtype: torch.dtype, device) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=dtype, device=device)


def dequantize_padded(qdata: torch.Tensor, block: torch.Tensor, ts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[R, C]` in `dtype` from packed data `[R, C / 2]`, e4m3 block scales `[R, C / 16]` (plain order) and
    the float32 tensor scale: `e2m1 * (ts * block)`, each product rounded in `dtype` (comfy-kitchen's rule)."""
    values = _e2m1_table(dtype, qdata.device)[unpack_codes(qdata).long()]
    r, c = values.shape
    total = ts.to(dtype) * block.to(dtype)
    return (values.view(r, c // GROUP, GROUP) * total.unsqueeze(-1)).view(r, c)


def encode_e2m1(v: torch.Tensor, generator=None) -> torch.Tensor:
    """float32 values in [-6, 6] -> e2m1 codes (uint8): nearest, ties to even; or, with `generator`,
    stochastic between the two neighbouring values (unbiased)."""
    a = v.abs()
    grid = _e2m1_table(torch.float32, v.device)[:8]
    if generator is None:
        code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
        for i, b in enumerate(_BOUNDS):
            up = (a >= b) if (i + 1) % 2 == 0 else (a > b)
            code += up.to(torch.uint8)
    else:
        lo = (torch.bucketize(a, grid, right=True) - 1).clamp(0, 7)
        hi = (lo + 1).clamp(max=7)
        lo_v, hi_v = grid[lo], grid[hi]
        span = torch.where(hi_v > lo_v, hi_v - lo_v, torch.ones_like(a))
        p = ((a - lo_v) / span).clamp(0, 1)
        noise = torch.rand(a.shape, generator=generator, device=a.device, dtype=torch.float32)
        code = torch.where(noise < p, hi, lo).to(torch.uint8)
    # the sign is kept on values that round to zero (-0, code 8), as comfy-kitchen's quantizer does
    return code | (torch.signbit(v).to(torch.uint8) << 3)


# ---------------------------------------------------------------------------------------------
# files (ComfyUI's form) <-> QuantizedTensor
# ---------------------------------------------------------------------------------------------


def scales_from_file(weight_scale: torch.Tensor, weight_scale_2: torch.Tensor, storage_shape) -> tuple[NVFP4, torch.Tensor]:
    """A file's scales of a layer whose data is uint8 `storage_shape` ([R, C / 2]) -> (the layout at the
    stored size, the QuantizedTensor's scale bytes). QuantizationError on anything that is not that form."""
    rows, half = (int(v) for v in storage_shape)
    if rows % GROUP or (2 * half) % GROUP or rows < 1 or half < 1:
        raise QuantizationError(f"NVFP4 data must be [R, C / 2] with R and C multiples of {GROUP}, got "
                                f"{[rows, half]}")
    if weight_scale.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise QuantizationError(f"NVFP4 block scales are float8_e4m3fn (or their bytes as uint8), got {weight_scale.dtype}")
    if weight_scale_2.numel() != 1 or not weight_scale_2.dtype.is_floating_point:
        raise QuantizationError(f"the NVFP4 tensor scale must be one float, got {weight_scale_2.dtype} "
                                f"{list(weight_scale_2.shape)}")
    layout = NVFP4(rows, half * 2)
    check_tiled_shape(weight_scale, layout.padded[0], layout.blocks,
                      f"NVFP4 block scales (one per row and {GROUP} inputs)")
    block = unswizzle(weight_scale.view(torch.uint8), layout.padded[0], layout.blocks).contiguous()
    scale = join_scales(block.view(torch.float8_e4m3fn), weight_scale_2.to(torch.float32))
    block_f, ts = split_scales(scale, layout)
    if not (math.isfinite(float(ts)) and float(ts) > 0):
        raise QuantizationError(f"the NVFP4 tensor scale must be finite and > 0, got {float(ts)}")
    b = block_f.to(torch.float32)
    if not bool(torch.isfinite(b).all()) or bool((b < 0).any()):
        raise QuantizationError("NVFP4 block scales must be finite and >= 0 (e4m3 NaN or a negative scale found)")
    return layout, scale


def at_shape(w, shape):
    """An NVFP4 weight read at its padded size, given the model's true `[out, in]` (a new layout over the
    same storage). Returns `w` itself when it is not NVFP4, already has `shape`, or cannot be that
    shape padded (the caller reports the mismatch)."""
    want = tuple(int(v) for v in shape)
    if not is_nvfp4(w) or len(want) != 2 or tuple(w.shape) == want or w.transposed:
        return w
    if padded_weight_shape(want) != w.layout.padded:
        return w
    return w._replace(layout=NVFP4(*want))


def file_tensors(w) -> dict[str, torch.Tensor]:
    """An NVFP4 QuantizedTensor in ComfyUI's on-disk form: {"weight", "weight_scale", "weight_scale_2"}
    (key suffixes of the layer), the exact inverse of `from_file`."""
    if not is_nvfp4(w):
        raise QuantizationError(f"not an NVFP4 weight: {w!r}")
    w = w.canonical() if w.transposed else w
    block, ts = split_scales(w.scale, w.layout)
    return {"weight": w.qdata.contiguous(),
            "weight_scale": swizzle(block.view(torch.uint8)).view(torch.float8_e4m3fn),
            "weight_scale_2": ts.clone()}
