"""FP8 E4M3 rows with packed UE8M0 block scales: the one implementation shared by the pack.

Convention (the one DeepGEMM and DeepEP's engram tables use):

* a row of `hidden` values is cut into blocks of `block` (128) values along the row;
* each block gets a power-of-two scale `2**e` with `e = ceil(log2(amax / 448))`, so that the block's
  largest magnitude fits E4M3's range; the stored value is `q = fp8(x / 2**e)` and the dequantized value
  is `q * 2**e` (multiply convention);
* `e` is stored as a UE8M0 byte (`e + 127`, 0..254; 255 would be NaN and is never produced), and four
  consecutive block bytes are packed little-endian into one int32 ("sf pack"): block `4*p + j` sits in
  bits `8*j .. 8*j+7` of pack `p`. A row has `num_sf_packs(hidden) = ceil(ceil(hidden / block) / 4)` packs;
  unused bytes of the last pack are zero.

An all-zero packed scale (the bytes of an invalid row in a fetch) decodes to `2**-127` per block, which
times zero data is zero.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SF_BLOCK = 128
_BYTES_PER_PACK = 4
_EXPONENT_BIAS = 127


def num_sf_blocks(hidden: int, block: int = SF_BLOCK) -> int:
    """Number of scale blocks along a row of `hidden` values."""
    return -(-int(hidden) // int(block))


def num_sf_packs(hidden: int, block: int = SF_BLOCK) -> int:
    """Number of int32 packs holding the UE8M0 scale bytes of one row."""
    return -(-num_sf_blocks(hidden, block) // _BYTES_PER_PACK)


def _check_rows(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be a 2-D [rows, hidden] tensor, got shape {tuple(x.shape)}")


def pack_ue8m0(exponent_bytes: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, blocks] biased exponents -> int32 [rows, ceil(blocks / 4)] packs (little-endian)."""
    _check_rows(exponent_bytes, "exponent_bytes")
    if exponent_bytes.dtype != torch.uint8:
        raise ValueError(f"exponent_bytes must be uint8, got {exponent_bytes.dtype}")
    rows, blocks = exponent_bytes.shape
    packs = -(-blocks // _BYTES_PER_PACK)
    padded = torch.zeros((rows, packs * _BYTES_PER_PACK), dtype=torch.uint8, device=exponent_bytes.device)
    padded[:, :blocks] = exponent_bytes
    # Reinterpreting 4 bytes as one int32 is little-endian on every platform torch supports.
    return padded.view(torch.int32).view(rows, packs).clone()


def unpack_ue8m0(packs: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """int32 [rows, packs] -> uint8 [rows, num_blocks] biased exponents."""
    _check_rows(packs, "packs")
    if packs.element_size() != 4:
        raise ValueError(f"packed scales must have 4-byte elements, got {packs.dtype}")
    rows, num_packs = packs.shape
    if num_blocks > num_packs * _BYTES_PER_PACK:
        raise ValueError(f"{num_packs} packs hold at most {num_packs * _BYTES_PER_PACK} blocks, asked for {num_blocks}")
    return packs.contiguous().view(torch.uint8).view(rows, num_packs * _BYTES_PER_PACK)[:, :num_blocks]


def _ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(x)) for positive finite float32 x (frexp avoids log2 rounding at powers of two)."""
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2**exponent, mantissa in [0.5, 1)
    return torch.where(mantissa == 0.5, exponent - 1, exponent)


def quantize_rows(x: torch.Tensor, block: int = SF_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize float rows [rows, hidden] to (fp8 e4m3 [rows, hidden], int32 packed UE8M0 [rows, packs])."""
    _check_rows(x, "x")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
    rows, hidden = x.shape
    blocks = num_sf_blocks(hidden, block)
    xf = x.float()
    if not bool(torch.isfinite(xf).all()):
        raise ValueError("cannot quantize rows holding inf or NaN to FP8")
    padded = torch.zeros((rows, blocks * block), dtype=torch.float32, device=x.device)
    padded[:, :hidden] = xf
    grouped = padded.view(rows, blocks, block)
    amax = grouped.abs().amax(dim=2)
    # All-zero blocks get the smallest normal scale; their data is zero whatever the scale.
    ratio = (amax / FP8_MAX).clamp(min=2.0**-126)
    exponent = _ceil_log2(ratio).clamp(-_EXPONENT_BIAS, _EXPONENT_BIAS)
    scaled = torch.ldexp(grouped, -exponent.unsqueeze(2).float())
    q = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(rows, blocks * block)[:, :hidden].contiguous()
    sf = pack_ue8m0((exponent + _EXPONENT_BIAS).to(torch.uint8))
    return q, sf


def dequantize_rows(q: torch.Tensor, sf: torch.Tensor, block: int = SF_BLOCK, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_rows`: fp8 [rows, hidden] and int32 packs [rows, packs] -> `dtype` [rows, hidden]."""
    _check_rows(q, "q")
    if q.dtype != FP8_DTYPE:
        raise ValueError(f"q must be {FP8_DTYPE}, got {q.dtype}")
    rows, hidden = q.shape
    blocks = num_sf_blocks(hidden, block)
    if sf.dim() != 2 or sf.shape[0] != rows or sf.shape[1] < -(-blocks // _BYTES_PER_PACK):
        raise ValueError(
            f"scales of shape {tuple(sf.shape)} do not fit {rows} rows of {hidden} values "
            f"(need [{rows}, >= {-(-blocks // _BYTES_PER_PACK)}])"
        )
    exponent = unpack_ue8m0(sf, blocks).to(torch.int32) - _EXPONENT_BIAS
    scale = torch.ldexp(torch.ones((), dtype=torch.float32, device=q.device), exponent.float())
    expanded = scale.repeat_interleave(block, dim=1)[:, :hidden]
    return (q.float() * expanded).to(dtype)
