"""MXFP8: FP8 e4m3 weights with one power-of-two (UE8M0) scale per 32 inputs, as ComfyUI 0.29 stores them.

What a 0.29 file holds for a layer whose `<layer>.comfy_quant` says `{"format": "mxfp8"}`:
- `<layer>.weight`: float8_e4m3fn, shape `[out, in]`, each padded up to a multiple of 32 when it is not one;
- `<layer>.weight_scale`: the block exponents as bytes (safetensors `F8_E8M0`, or `U8`), value
  `2 ** (code - 127)`, one per row and 32 columns, in cuBLAS's tiled "128 x 4" order (the order its
  block-scaled matmul reads), padded to 128 rows and 4 block columns; 0.29 writes the 2-D form
  `[128 * ceil(out / 128), 4 * ceil(in / 32 / 4)]`, the only shape read (a transposed, reshaped or flat
  grid of as many bytes would read as the scales of other blocks). A `group_size` in the layer's JSON,
  where given, must be 32, and a `block_size` [1, 32].
The bytes run tile by tile (tile rows outer, tile columns inner); inside a tile of 128 rows x 4 block
columns they run by j, then i, then c, for the scale of row `32 * i + j` of the tile and its block
column c. `unswizzle` and `swizzle` convert between that and the plain `[rows, blocks]` matrix.

In memory the pack keeps MXFP8 weights as `MXFP8()`, a `Block(1, 32)` whose scales are the same powers
of two as float32 (exact), so every existing path applies: dequantization (bit-exact with
comfy-kitchen's, since multiplying by a power of two rounds only once) and the weight-only linear.
Layers whose sizes are not multiples of 32: 0.29 pads the weight (rows and columns, with zeros) to
multiples of 32 and records the true size nowhere in the file: its Linear knows it from the model
definition and cuts the dequantized weight back. The reader here keeps the padded shape (the file
alone cannot tell), and `at_shape` cuts a weight to the size the model declares when the load reaches
that layer; the cut keeps every real value, so results match 0.29's. `file_tensors` writes a weight
back in 0.29's padded form (zero data, zero scale codes in the padding, as 0.29's quantizer makes it).

The fp8 x fp8 "native" MX matmul (Blackwell's block-scaled tensor cores) is not used: those weights run
weight-only everywhere. Pure torch; never imports ComfyUI.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import QuantizationError
from .fp8 import Block

BLOCK = 32
E8M0_BIAS = 127
_TILE_ROWS, _TILE_COLS = 128, 4

__all__ = ["MXFP8", "BLOCK", "e8m0_to_float32", "float32_to_e8m0", "unswizzle", "swizzle", "scales_from_file",
           "check_tiled_shape",
           "scales_for_file", "padded_shape", "padded_weight_shape", "is_mxfp8", "at_shape", "file_tensors"]


@dataclass(frozen=True)
class MXFP8(Block):
    """One power-of-two float32 scale per 1 x 32 block of an [out, in] e4m3fn weight."""

    rows: int = 1
    cols: int = BLOCK

    name = "mxfp8"

    def __post_init__(self):
        if (self.rows, self.cols) != (1, BLOCK):
            raise QuantizationError(f"MXFP8 blocks are 1 x {BLOCK}, got {self.rows} x {self.cols}")

    def quantize(self, w: torch.Tensor, fp8_dtype, generator):
        if fp8_dtype != torch.float8_e4m3fn:
            raise QuantizationError(f"MXFP8 stores float8_e4m3fn data, got {fp8_dtype}")
        if w.dim() != 2:
            raise QuantizationError(f"layout MXFP8 needs a 2-D weight [out, in], got shape {list(w.shape)}")
        return super().quantize(w, fp8_dtype, generator)

    def _block_scale(self, amax: torch.Tensor, fmax: float) -> torch.Tensor:
        return power_of_two_scale(amax, fmax)


def power_of_two_scale(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """The smallest power of two s with amax / s <= fmax (what OCP MX and comfy-kitchen pick), within
    the UE8M0 range 2**-127 .. 2**127; all-zero blocks get 1."""
    ratio = amax.to(torch.float32) / fmax
    exp = torch.ceil(torch.log2(ratio.clamp_min(2.0 ** -127))).clamp(-127, 127)
    scale = torch.exp2(exp)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def e8m0_to_float32(codes: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes (uint8 or float8_e8m0fnu) -> float32 `2 ** (code - 127)`; code 255 (NaN) raises."""
    c = codes.view(torch.uint8) if codes.dtype != torch.uint8 else codes
    if bool((c == 255).any()):
        raise QuantizationError("UE8M0 scale holds the NaN code 255")
    # exponent bits straight into a float32: code c > 0 is the normal number 2**(c-127); code 0 is
    # 2**-127, a float32 subnormal (bit 22 set).
    bits = torch.where(c > 0, c.to(torch.int32) << 23, torch.full_like(c, 1, dtype=torch.int32) << 22)
    return bits.view(torch.float32)


def float32_to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """float32 powers of two in 2**-127 .. 2**127 -> UE8M0 codes (uint8); anything else raises."""
    s = scale.to(torch.float32)
    mant, exp = torch.frexp(s)  # s = mant * 2**exp, mant = 0.5 for powers of two
    if not bool(((mant == 0.5) & (exp - 1 >= -127) & (exp - 1 <= 127)).all()):
        raise QuantizationError("MXFP8 scales must be powers of two between 2**-127 and 2**127")
    return (exp - 1 + E8M0_BIAS).to(torch.uint8)


def padded_shape(rows: int, blocks: int) -> tuple[int, int]:
    """Shape of the tiled scale matrix for `rows` x `blocks` scales."""
    return _TILE_ROWS * math.ceil(rows / _TILE_ROWS), _TILE_COLS * math.ceil(blocks / _TILE_COLS)


def unswizzle(stored: torch.Tensor, rows: int, blocks: int) -> torch.Tensor:
    """cuBLAS-tiled scale bytes (any shape holding the padded count) -> plain `[rows, blocks]`."""
    pr, pc = padded_shape(rows, blocks)
    if stored.numel() != pr * pc:
        raise QuantizationError(f"tiled MXFP8 scales for {rows} rows x {blocks} blocks need {pr * pc} "
                                f"values ({pr} x {pc}), got shape {list(stored.shape)}")
    tr, tc = pr // _TILE_ROWS, pc // _TILE_COLS
    # per tile: 32 lines (j) of 16 bytes laid out as (i, c); the row is 32 * i + j
    t = stored.reshape(tr, tc, 32, 4, 4)            # [tile r, tile c, j, i, c]
    plain = t.permute(0, 3, 2, 1, 4).reshape(pr, pc)  # [tile r, i, j, tile c, c]
    return plain[:rows, :blocks]


def swizzle(plain: torch.Tensor) -> torch.Tensor:
    """Plain `[rows, blocks]` scales -> the cuBLAS-tiled `[padded rows, padded blocks]` (zero padding)."""
    rows, blocks = plain.shape
    pr, pc = padded_shape(rows, blocks)
    full = torch.zeros(pr, pc, dtype=plain.dtype, device=plain.device)
    full[:rows, :blocks] = plain
    t = full.reshape(pr // _TILE_ROWS, 4, 32, pc // _TILE_COLS, 4)  # [tile r, i, j, tile c, c]
    return t.permute(0, 3, 2, 1, 4).reshape(pr, pc).contiguous()


def scales_from_file(stored: torch.Tensor, weight_shape) -> torch.Tensor:
    """A 0.29 file's `weight_scale` for a weight of (stored, possibly padded) shape [rows, cols] ->
    float32 scales `[rows, cols / 32]` for `MXFP8()`."""
    rows, cols = weight_shape
    if cols % BLOCK:
        raise QuantizationError(f"an MXFP8 weight's stored input size must be a multiple of {BLOCK}, got {cols}")
    if stored.dtype not in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8)):
        raise QuantizationError(f"MXFP8 scales are UE8M0 bytes (F8_E8M0 or U8), got {stored.dtype}")
    check_tiled_shape(stored, rows, cols // BLOCK, f"MXFP8 scales (one per row and {BLOCK} inputs)")
    return e8m0_to_float32(unswizzle(stored.view(torch.uint8), rows, cols // BLOCK).contiguous())


def check_tiled_shape(stored: torch.Tensor, rows: int, blocks: int, what: str) -> None:
    """QuantizationError unless `stored` has the 2-D shape ComfyUI stores `rows x blocks` tiled scales in,
    `[128 * ceil(rows / 128), 4 * ceil(blocks / 4)]` (comfy-kitchen's `to_blocked(..., flatten=False)`).
    The element count alone does not tell a transposed or reshaped grid from the real one, and such a
    grid would read as scales of the wrong blocks."""
    want = padded_shape(rows, blocks)
    if tuple(stored.shape) != want:
        raise QuantizationError(f"{what} for {rows} rows x {blocks} blocks are stored as shape {list(stored.shape)}, "
                                f"not the tiled [{want[0]}, {want[1]}] (rows padded to 128, block columns to 4)")


def scales_for_file(scale: torch.Tensor) -> torch.Tensor:
    """Inverse of `scales_from_file`: float32 `[rows, blocks]` -> tiled UE8M0 bytes (float8_e8m0fnu
    where torch has it, else uint8)."""
    codes = swizzle(float32_to_e8m0(scale))
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    return codes.view(e8m0) if e8m0 is not None else codes


def is_mxfp8(t) -> bool:
    """Whether `t` is a QuantizedTensor (or anything with a `layout`) in the MXFP8 layout."""
    return isinstance(getattr(t, "layout", None), MXFP8)


def padded_weight_shape(shape) -> tuple[int, int]:
    """The [out, in] shape 0.29 stores a weight of logical `shape` at: both rounded up to 32."""
    out, inp = (int(v) for v in shape)
    return BLOCK * math.ceil(out / BLOCK), BLOCK * math.ceil(inp / BLOCK)


def at_shape(w, shape):
    """An MXFP8 weight read from a file at 0.29's padded shape, cut to the model's `shape` [out, in].

    Returns `w` itself when it is not MXFP8, already has `shape`, or is not the padded form of `shape`
    (the caller then reports the mismatch). The cut keeps the first `out` rows, `in` columns and
    `ceil(in / 32)` block scales: every real value with its own scale, so the dequantized weight is
    0.29's dequantized weight without the padding."""
    want = tuple(int(v) for v in shape)
    if not is_mxfp8(w) or len(want) != 2 or tuple(w.shape) == want:
        return w
    if tuple(w.shape) != padded_weight_shape(want):
        return w
    out, inp = want
    qdata = w.qdata[:out, :inp]
    if not qdata.is_contiguous():
        qdata = qdata.contiguous()
    scale = w.scale[:out, : math.ceil(inp / BLOCK)].contiguous()
    return type(w).from_parts(qdata, scale, w.layout, orig_dtype=w.orig_dtype, input_scale=w.input_scale,
                              config=w.config)


def file_tensors(qdata: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An MXFP8 weight (e4m3fn `[out, in]`, float32 scales `[out, ceil(in / 32)]`) in 0.29's on-disk form:
    the data zero-padded to multiples of 32 both ways, the scales as tiled UE8M0 bytes. The exact
    inverse of reading the file (`scales_from_file`) and cutting it (`at_shape`)."""
    if qdata.dtype != torch.float8_e4m3fn or qdata.dim() != 2:
        raise QuantizationError(f"an MXFP8 weight is 2-D float8_e4m3fn, got {qdata.dtype} {list(qdata.shape)}")
    out, inp = qdata.shape
    nb = math.ceil(inp / BLOCK)
    if tuple(scale.shape) != (out, nb):
        raise QuantizationError(f"MXFP8 scales for a weight of shape {[out, inp]} must have shape {[out, nb]}, "
                                f"got {list(scale.shape)}")
    pr, pc = padded_weight_shape((out, inp))
    if (pr, pc) != (out, inp):
        padded = torch.zeros(pr, pc, dtype=torch.uint8, device=qdata.device)
        padded[:out, :inp] = qdata.view(torch.uint8)
        qdata = padded.view(torch.float8_e4m3fn)
    return qdata, scales_for_file(scale)
