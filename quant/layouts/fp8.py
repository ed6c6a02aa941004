"""FP8 storage layouts: how a 2-D weight is cut into scale groups, and the math for each.

Convention everywhere: dequantization MULTIPLIES, ``w ~= qdata.float() * expand(scale)``.
Scales are float32 and strictly positive. Pure torch; never imports ComfyUI.

Layouts (frozen dataclasses, so they can be shared, hashed and pickled safely):

- ``PerTensor()``     scale shape ``[]``                                   (any rank of weight)
- ``PerRow()``        scale shape ``[out, 1]`` (one per output channel)    (2-D weights)
- ``Block(r, c)``     scale shape ``[ceil(out / r), ceil(in / c)]``        (2-D weights)
  ``Block(128, 128)`` is the DeepSeek-style 2-D block; ``Block(1, 64)`` the musubi-tuner 1xB block.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from ..errors import QuantizationError
from ..numerics import fp8_max, scale_from_amax
from ..runtime import tracing, workspace
from .base import FP8_DTYPES, LayoutBase, check_fp8_dtype  # noqa: F401 - FP8_DTYPES, check_fp8_dtype re-exported

__all__ = ["FP8_DTYPES", "PerTensor", "PerRow", "Block", "Layout", "fp8_to", "check_fp8_dtype",
           "dequantize_eager", "mul_blocks"]


# Mantissa bits and smallest normal exponent, for stochastic rounding onto the FP8 grid.
_GRID = {
    torch.float8_e4m3fn: (3, -6),
    torch.float8_e5m2: (2, -14),
}


# ---------------------------------------------------------------------------------------------
# FP8 -> float conversion
# ---------------------------------------------------------------------------------------------

# On the CPU, torch converts FP8 element by element in scalar code. A 65536-entry table that maps
# each PAIR of FP8 bytes straight to two results turns the conversion into one gather. 16-bit results
# pair up into an int32 table (256 KiB), float32 results into an int64 table (512 KiB).
# - Without a scale the table holds torch's own conversion (NaN payloads included) and is built once
#   per (FP8 dtype, result dtype).
# - With a scale, a large tensor gets a table of the scaled results, built per call (~0.05 ms), with
#   the same rounding as "convert, then multiply in float32"; a smaller one gathers exact float32
#   values from the cached table, multiplies them and rounds once into the result dtype.
# Measured against torch's conversion (bf16, one thread): 1.6x faster at 4K elements, 3.5x at 16K, 11x at 9M.
_SCALED_TABLE_MIN_NUMEL = 1 << 18
_PAIR_WORD = {torch.bfloat16: (torch.int16, torch.int32, 16, 0xFFFF),
              torch.float16: (torch.int16, torch.int32, 16, 0xFFFF),
              torch.float32: (torch.int32, torch.int64, 32, 0xFFFFFFFF)}
_tables: dict = {}


def _all_codes(fp8_dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype)


def _pair_table(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """256 results in ``dtype`` -> the table of pairs: entry (hi << 8 | lo) holds values[lo] in the
    low half (the first byte, little endian) and values[hi] in the high half."""
    half, word, shift, mask = _PAIR_WORD[dtype]
    bits = values.view(half).to(word) & mask
    return ((bits << shift)[:, None] | bits[None, :]).reshape(-1)


def _cached_table(fp8_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    table = _tables.get((fp8_dtype, dtype))
    if table is None:
        # outside inference_mode, so the cached table is a normal tensor wherever it is first built
        with torch.inference_mode(False), torch.no_grad():
            table = _pair_table(_all_codes(fp8_dtype).to(dtype), dtype)
        _tables[(fp8_dtype, dtype)] = table
    return table


def _gather_pairs(q: torch.Tensor, table: torch.Tensor, into: torch.Tensor) -> None:
    """``into`` (flat, q's element count) <- table[each pair of q's bytes]."""
    pairs = q.reshape(-1).view(torch.int16).view(torch.uint16)
    idx = workspace("pair_lut_index", pairs.numel(), torch.int32)
    idx.copy_(pairs)
    torch.index_select(table, 0, idx, out=into.view(table.dtype))


# Large tensors take another road: shifted bits. An FP8 byte's exponent and mantissa bits, moved under the sign of a
# wider float, are that float's bits for the value times a power of two (subnormals included: they land on the
# wider format's subnormals, same ratio): e4m3fn gives its value times 2**-8 as a float16, times 2**-120 as a
# bfloat16 or float32 (their exponent range); e5m2 is the high byte of a float16 (same bias, inf and NaN included),
# and its value times 2**-112 as a bfloat16 or float32. So per element: the byte sign-extended to the result's
# width, a shift, a mask (in a reused buffer, in cache), then one multiply in float32 by the scale times that power
# of two (exact: a power of two) into the result, rounded once - the same bits as the tables' "convert, then
# multiply in float32" (a float16 or bfloat16 tensor times a float32 0-d tensor is computed in float32 on the CPU:
# the element widened, the scalar kept float32, one rounding). A code whose bits the shifted view cannot stand for
# (e4m3fn's NaN codes 0x7F and 0xFF; e5m2's inf and NaN outside float16) sends its chunk to the tables. Chunks
# stay in cache. Per element, 2-core AMD EPYC Zen 5 (AVX-512), 38M e4m3fn elements, the NaN check included:
# bfloat16 0.16 ns against the scaled table's 0.45; float32 0.23-0.25 against 0.54 (and 0.25 by the float16 bits
# widened, which this replaces: a pass more).
_SHIFT_MIN_NUMEL = 1 << 14
_SHIFT_CHUNK_ELEMS = 1 << 20
_INT = {2: torch.int16, 4: torch.int32}
# (FP8 dtype, result dtype): (left shift of the sign-extended byte, mask of the bits kept (as a signed integer of
# the result's width) or None, the power of two the shifted bits' value is off by, the byte bits that mark a code
# the shifted bits cannot stand for (all of them set) or 0)
_SHIFTS = {
    (torch.float8_e4m3fn, torch.float16): (7, -16512, 8, 0x7F),  # mask 0xBF80
    (torch.float8_e5m2, torch.float16): (8, None, 0, 0),
    (torch.float8_e4m3fn, torch.bfloat16): (4, -30736, 120, 0x7F),  # mask 0x87F0
    (torch.float8_e5m2, torch.bfloat16): (5, -28704, 112, 0x7C),  # mask 0x8FE0
    (torch.float8_e4m3fn, torch.float32): (20, -2014314496, 120, 0x7F),  # mask 0x87F00000
    (torch.float8_e5m2, torch.float32): (21, -1881145344, 112, 0x7C),  # mask 0x8FE00000
}


def _shifted(q: torch.Tensor, dtype: torch.dtype) -> bool:
    return (q.dtype, dtype) in _SHIFTS and q.numel() >= _SHIFT_MIN_NUMEL


def _shift_route(q: torch.Tensor, dtype: torch.dtype, scale, out: torch.Tensor | None) -> torch.Tensor:
    """FP8 ``q`` (contiguous, CPU) -> ``dtype`` times an optional scalar ``scale``, by shifted bits (above)."""
    shift, mask, power, special = _SHIFTS[(q.dtype, dtype)]
    mult = torch.tensor(1.0) if scale is None else scale.to(torch.float32).reshape(())
    if power:
        mult = mult * 2.0 ** power
        if not bool(torch.isfinite(mult)):  # a scale over float32's largest / 2**power: the tables take it
            return _cpu_pairs(q, dtype, scale, out)
    if out is None:
        out = torch.empty(q.shape, dtype=dtype)
    src, flat = q.reshape(-1).view(torch.int8), out.view(-1)
    n = src.numel()
    step = min(n, _SHIFT_CHUNK_ELEMS)
    # the bits are made in a reused buffer, then multiplied into the result: 30 % faster than all of it in place
    bits = workspace("fp8_shifted_bits", step, _INT[dtype.itemsize])
    marks = workspace("fp8_shifted_marks", step, torch.int8) if special else None
    for i in range(0, n, step):
        j = min(n, i + step)
        codes = src[i:j]
        if special and int(torch.bitwise_and(codes, special, out=marks[: j - i]).max()) == special:
            _cpu_pairs(codes.view(q.dtype), dtype, scale, flat[i:j])  # a code the bits cannot hold: torch's value
            continue
        h = bits[: j - i]
        h.copy_(codes)
        h.bitwise_left_shift_(shift)
        if mask is not None:
            h.bitwise_and_(mask)
        # by 1 too (e5m2 into float16, unscaled): a signalling NaN comes out quiet, as from torch's own conversion
        torch.mul(h.view(dtype), mult, out=flat[i:j])
    return out


def _cpu_pairs(q: torch.Tensor, dtype: torch.dtype, scale, out) -> torch.Tensor:
    if out is None:
        out = torch.empty(q.shape, dtype=dtype)
    flat = out.view(-1)
    if scale is None:
        _gather_pairs(q, _cached_table(q.dtype, dtype), flat)
    elif q.numel() >= _SCALED_TABLE_MIN_NUMEL:
        values = (_all_codes(q.dtype).to(torch.float32) * scale.to(torch.float32).reshape(())).to(dtype)
        _gather_pairs(q, _pair_table(values, dtype), flat)
    else:
        direct = dtype == torch.float32
        values = flat if direct else workspace("pair_f32", q.numel(), torch.float32)
        _gather_pairs(q, _cached_table(q.dtype, torch.float32), values)
        values.mul_(scale if scale.dtype == torch.float32 and scale.dim() == 0 else scale.to(torch.float32).reshape(()))
        if not direct:
            flat.copy_(values)  # one rounding, from the float32 product
    return out


def fp8_to(q: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 ``q`` -> a ``dtype`` tensor, times an optional scalar float32 ``scale``.

    The product is formed in float32 and rounded once into ``dtype`` (the same bits as
    ``q.to(dtype).mul_(scale)`` on the CPU, which is what ComfyUI 0.3.75 does). ``out``: an
    optional contiguous tensor of q's shape and ``dtype`` to write into (returned).
    """
    if scale is not None and scale.numel() != 1:
        raise QuantizationError(f"fp8_to takes a scalar scale, got shape {list(scale.shape)}")
    if out is not None and (out.dtype != dtype or tuple(out.shape) != tuple(q.shape)
                            or not out.is_contiguous() or out.is_cpu != q.is_cpu or out.get_device() != q.get_device()):
        raise QuantizationError(
            f"fp8_to: out must be a contiguous {dtype} tensor of shape {list(q.shape)} on "
            f"{q.device}, got {out.dtype} {list(out.shape)} on {out.device}"
        )
    if (
        q.is_cpu
        and dtype in _PAIR_WORD
        and q.numel() % 2 == 0
        and q.is_contiguous()
        and sys.byteorder == "little"
        and not tracing()
    ):
        if _shifted(q, dtype):
            return _shift_route(q, dtype, scale, out)
        return _cpu_pairs(q, dtype, scale, out)
    if out is None:
        out = q.to(dtype)
    else:
        out.copy_(q)
    if scale is not None:
        if dtype == torch.float32 or dtype == torch.float64:
            out.mul_(scale.reshape(()).to(dtype))
        else:
            out.mul_(scale.reshape(()))
    return out


# ---------------------------------------------------------------------------------------------
# Rounding onto the FP8 grid
# ---------------------------------------------------------------------------------------------


def _to_fp8(v: torch.Tensor, fp8_dtype: torch.dtype, generator) -> torch.Tensor:
    """float32 values already divided by their scale -> FP8 (saturating), RTN or stochastic."""
    fmax = fp8_max(fp8_dtype)
    v = v.clamp(-fmax, fmax)
    if generator is None:
        return v.to(fp8_dtype)
    mbits, emin = _GRID[fp8_dtype]
    a = v.abs()
    _, e = torch.frexp(a)  # a = m * 2**e with m in [0.5, 1)
    step = torch.ldexp(torch.ones_like(a), (e - 1).clamp_min(emin) - mbits)
    noise = torch.rand(a.shape, generator=generator, device=a.device, dtype=torch.float32)
    # floor(a/step + U) is a/step rounded up with probability frac(a/step): unbiased.
    a = torch.floor(a.div_(step).add_(noise)).mul_(step).clamp_max_(fmax)
    return a.copysign_(v).to(fp8_dtype)


def _safe_scale(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """amax -> a positive, finite float32 scale by the pack's one rule (``numerics``)."""
    return scale_from_amax(amax, fmax)


# ---------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------


def _need_2d(shape, name: str) -> None:
    if len(shape) != 2:
        raise QuantizationError(f"layout {name} needs a 2-D weight [out, in], got shape {list(shape)}")


@dataclass(frozen=True)
class PerTensor(LayoutBase):
    """One float32 scale for the whole tensor."""

    name = "per_tensor"
    reshapeable = True  # one scale for everything: any view of the data keeps its meaning

    def first_rows(self, qdata, scale, n: int):
        return (qdata[:n], scale) if qdata.dim() == 2 else None

    def kernel_block(self, shape):
        return (tuple(shape) if len(shape) == 2 else None), True

    def fp8_scaling(self, shape) -> str | None:
        return "tensor"

    def scale_shape(self, shape) -> tuple:
        return ()

    def normalize_scale(self, scale: torch.Tensor, shape) -> torch.Tensor:
        if scale.numel() != 1:
            raise QuantizationError(
                f"per-tensor scale must hold exactly one value, got shape {list(scale.shape)}"
            )
        return scale if scale.dim() == 0 else scale.reshape(())

    def quantize(self, w: torch.Tensor, fp8_dtype, generator):
        fmax = fp8_max(fp8_dtype)
        scale = _safe_scale(w.abs().amax(), fmax)
        return _to_fp8(w.to(torch.float32) / scale, fp8_dtype, generator), scale

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        if not q.is_cpu or tracing():
            return _off_cpu(q, scale, None, dtype, out)
        return fp8_to(q, dtype, scale, out)


@dataclass(frozen=True)
class PerRow(LayoutBase):
    """One float32 scale per output channel (row of the [out, in] weight)."""

    name = "per_row"

    def kernel_block(self, shape):
        return (1, shape[1]), False

    def first_rows(self, qdata, scale, n: int):
        return qdata[:n], scale.reshape(qdata.shape[0], 1)[:n]

    def fp8_scaling(self, shape) -> str | None:
        return "row"

    def scale_shape(self, shape) -> tuple:
        _need_2d(shape, "PerRow")
        return (shape[0], 1)

    def normalize_scale(self, scale: torch.Tensor, shape) -> torch.Tensor:
        _need_2d(shape, "PerRow")
        if tuple(scale.shape) not in ((shape[0],), (shape[0], 1)):
            raise QuantizationError(
                f"per-row scale for a weight of shape {list(shape)} must have shape "
                f"[{shape[0]}, 1], got {list(scale.shape)}"
            )
        return scale.reshape(shape[0], 1)

    def quantize(self, w: torch.Tensor, fp8_dtype, generator):
        _need_2d(w.shape, "PerRow")
        fmax = fp8_max(fp8_dtype)
        scale = _safe_scale(w.abs().amax(dim=1, keepdim=True), fmax)
        return _to_fp8(w.to(torch.float32) / scale, fp8_dtype, generator), scale

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        if not q.is_cpu or tracing():
            return _off_cpu(q, scale, (1, q.shape[1]), dtype, out)
        return _dequantize_scaled(q, scale, 1, q.shape[1], dtype, out)


@dataclass(frozen=True)
class Block(LayoutBase):
    """One float32 scale per ``rows x cols`` block of the [out, in] weight (edges may be partial)."""

    rows: int
    cols: int

    name = "block"

    def kernel_block(self, shape):
        return (self.rows, self.cols), False

    def first_rows(self, qdata, scale, n: int):
        if n % self.rows:
            return None
        return qdata[:n], scale[: n // self.rows]

    def fp8_scaling(self, shape) -> str | None:
        """The 128x128 block-wise scaled matmul (1x128 activation groups) takes whole blocks only."""
        if (self.rows, self.cols) == (128, 128) and shape[0] % 128 == 0 and shape[1] % 128 == 0:
            return "block"
        return None

    @property
    def key(self):
        return (self.rows, self.cols)

    def __post_init__(self):
        for v, what in ((self.rows, "rows"), (self.cols, "cols")):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise QuantizationError(f"Block {what} must be a positive int, got {v!r}")

    def scale_shape(self, shape) -> tuple:
        _need_2d(shape, f"Block({self.rows}, {self.cols})")
        return (math.ceil(shape[0] / self.rows), math.ceil(shape[1] / self.cols))

    def normalize_scale(self, scale: torch.Tensor, shape) -> torch.Tensor:
        want = self.scale_shape(shape)
        got = tuple(scale.shape)
        # musubi-tuner stores 1xB block scales as [out, n_blocks, 1]
        if len(got) == 3 and got[2] == 1:
            got = got[:2]
        if got != want:
            raise QuantizationError(
                f"Block({self.rows}, {self.cols}) scale for a weight of shape {list(shape)} must "
                f"have shape {list(want)}, got {list(scale.shape)}"
            )
        return scale.reshape(want)

    def _blocks(self, w: torch.Tensor) -> torch.Tensor:
        out, inp = w.shape
        nr, nc = self.scale_shape(w.shape)
        pad_r, pad_c = nr * self.rows - out, nc * self.cols - inp
        if pad_r or pad_c:
            w = torch.nn.functional.pad(w, (0, pad_c, 0, pad_r))
        return w.reshape(nr, self.rows, nc, self.cols)

    def _block_scale(self, amax: torch.Tensor, fmax: float) -> torch.Tensor:
        """Each block's absolute maximum -> its scale (MXFP8 rounds it up to a power of two)."""
        return _safe_scale(amax, fmax)

    def quantize(self, w: torch.Tensor, fp8_dtype, generator):
        _need_2d(w.shape, f"Block({self.rows}, {self.cols})")
        fmax = fp8_max(fp8_dtype)
        out, inp = w.shape
        blocks = self._blocks(w.to(torch.float32))
        scale = self._block_scale(blocks.abs().amax(dim=(1, 3)), fmax)
        scaled = (blocks / scale[:, None, :, None]).reshape(blocks.shape[0] * self.rows, -1)
        scaled = scaled[:out, :inp].contiguous()
        return _to_fp8(scaled, fp8_dtype, generator), scale

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        if not q.is_cpu or tracing():
            return _off_cpu(q, scale, (self.rows, self.cols), dtype, out)
        return _dequantize_scaled(q, scale, self.rows, self.cols, dtype, out)


Layout = PerTensor | PerRow | Block


def _off_cpu(q: torch.Tensor, scale: torch.Tensor, block, dtype: torch.dtype,
             out: torch.Tensor | None) -> torch.Tensor:
    """Dequantization on any device but the CPU, and of CPU weights while torch.compile traces: the
    eager twin below, which rounds exactly like the CPU code, so a weight gives the same bits on every
    device. Plain torch ops would not: on CUDA a bf16 tensor times a float32 0-d tensor rounds the
    scale to bf16 first, while the CPU keeps it float32. ``QuantizedTensor.dequantize`` takes the
    one-pass kernel of ``kernels.dequant`` (Triton, and the custom op while compiling) before this."""
    if out is not None and (out.dtype != dtype or tuple(out.shape) != tuple(q.shape)
                            or not out.is_contiguous() or out.is_cpu != q.is_cpu or out.get_device() != q.get_device()):
        raise QuantizationError(
            f"dequantize: out must be a contiguous {dtype} tensor of shape {list(q.shape)} on "
            f"{q.device}, got {out.dtype} {list(out.shape)} on {out.device}"
        )
    return dequantize_eager(q, scale, block, dtype, block is None or q.dim() != 2, out)


def _full_scale(scale: torch.Tensor, block, shape) -> torch.Tensor:
    n, k = shape
    r, c = block
    return scale.repeat_interleave(r, 0)[:n].repeat_interleave(c, 1)[:, :k]


def dequantize_eager(q: torch.Tensor, scale: torch.Tensor, block, dtype: torch.dtype,
                     per_tensor: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """The eager twin of every dequantization kernel: ``round(float32(q) * float32(scale))`` with the
    scale expanded over ``block`` (rows, cols) blocks, or one scale when ``per_tensor``."""
    s = scale.to(torch.float32)
    if per_tensor or q.dim() != 2:
        w = q.to(torch.float32) * s.reshape(())
    else:
        n, k = q.shape
        r, c = block
        if n % r == 0 and k % c == 0:
            w = (q.to(torch.float32).view(n // r, r, k // c, c) * s[:, None, :, None]).view(n, k)
        else:
            w = q.to(torch.float32) * _full_scale(s, block, (n, k))
    if out is None:
        return w.to(dtype)
    return out.copy_(w)


# rows of float32 per step of the CPU dequantization: large enough for fp8_to's pair table,
# small enough that the float32 temporary stays a bounded, reused buffer
_DEQUANT_CHUNK_ELEMS = 1 << 22


def mul_blocks(w: torch.Tensor, scale: torch.Tensor, rows: int, cols: int) -> None:
    """In place ``w *= scale`` expanded over ``rows x cols`` blocks (w float32, 2-D)."""
    m, k = w.shape
    if m % rows == 0 and k % cols == 0:
        w.view(m // rows, rows, k // cols, cols).mul_(scale[:, None, :, None])
    else:
        w.mul_(scale.repeat_interleave(rows, 0)[:m].repeat_interleave(cols, 1)[:, :k])


def _dequantize_scaled(q: torch.Tensor, scale: torch.Tensor, rows: int, cols: int,
                       dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    """CPU dequantization of a per-row / block weight: ``float32(q) * scale`` rounded once into
    ``dtype`` (``numerics``' rule), in row chunks through a reused float32 buffer. Multiplying a
    bf16 tensor by bf16(scale) would be faster and round twice (3 dB less SQNR); torch's
    mixed-dtype in-place multiply rounds once but is ~10x slower than this."""
    if out is not None and (out.dtype != dtype or tuple(out.shape) != tuple(q.shape)
                            or not out.is_contiguous() or out.is_cpu != q.is_cpu or out.get_device() != q.get_device()):
        raise QuantizationError(
            f"dequantize: out must be a contiguous {dtype} tensor of shape {list(q.shape)} on "
            f"{q.device}, got {out.dtype} {list(out.shape)} on {out.device}"
        )
    if dtype == torch.float32 or dtype == torch.float64:  # the product itself, no second rounding
        w = fp8_to(q, dtype, None, out)
        mul_blocks(w, scale.to(dtype), rows, cols)
        return w
    s = scale.to(torch.float32)
    n, k = q.shape
    if out is None:
        out = torch.empty((n, k), dtype=dtype)
    q = q.contiguous()
    step = max(rows, (_DEQUANT_CHUNK_ELEMS // max(k, 1)) // rows * rows)
    for i in range(0, n, step):
        j = min(n, i + step)
        tmp = workspace("dequant_f32", (j - i) * k, torch.float32).view(j - i, k)
        fp8_to(q[i:j], torch.float32, None, tmp)
        mul_blocks(tmp, s[i // rows: -(-j // rows)], rows, cols)
        out[i:j].copy_(tmp)
    return out
