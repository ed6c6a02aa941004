"""Injection of fetched engram rows into a CONDITIONING tensor.

Per token of a stream: `v = combine(fetched entries)` (the sum of the entries' rows, truncated to the
stream width, or the sum times a projection [hidden, width]); an optional context gate
`a = sigmoid(ssqrt(<RMSNorm(c), RMSNorm(k)> / sqrt(D)))` with `ssqrt(x) = sign(x) * sqrt(|x|)` and the
key `k = v`; then `c' = c + strength * a * v`.

The update is applied with `torch.where(v != 0, c + strength * a * v, c)`, element by element, so an
element whose memory value is zero keeps its exact bits (adding 0.0 would turn -0.0 into +0.0). A
prompt with no stored n-gram therefore comes back bit-identical.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .streams import StreamTokens


def combine(fetched: torch.Tensor, width: int, projection: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [tokens, width] from fetched rows [tokens, entries, hidden] (invalid entries are zero).

    Without a projection the rows must be at least `width` wide and their first `width` columns are
    used; with one ([hidden, width]) the summed row is multiplied by it."""
    if fetched.dim() != 3:
        raise ValueError(f"fetched rows must be [tokens, entries, hidden], got shape {tuple(fetched.shape)}")
    summed = fetched.float().sum(dim=1)
    if projection is not None:
        if projection.shape != (summed.shape[1], width):
            raise ValueError(f"projection must be [{summed.shape[1]}, {width}], got {tuple(projection.shape)}")
        return summed @ projection.float()
    if summed.shape[1] < width:
        raise ValueError(f"rows of width {summed.shape[1]} cannot fill a stream of width {width} without a projection")
    return summed[:, :width]


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def signed_sqrt(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.sqrt(torch.abs(x))


def context_gate(c: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Gate [..., 1] in (0, 1) per token from the conditioning c and the memory key k ([..., D])."""
    d = c.shape[-1]
    score = (rms_norm(c.float()) * rms_norm(k.float())).sum(dim=-1, keepdim=True) / math.sqrt(d)
    return torch.sigmoid(signed_sqrt(score))


def inject_block(block: torch.Tensor, v: torch.Tensor, strength: float, gate: bool = False) -> torch.Tensor:
    """New values of a CONDITIONING block [batch, tokens, width] given v [tokens, width].

    Elements where v is zero keep their exact bits; the result has the block's dtype."""
    if block.shape[-2:] != v.shape:
        raise ValueError(f"memory values {tuple(v.shape)} do not match the conditioning block {tuple(block.shape[-2:])}")
    v = v.to(block.device)
    scale = torch.as_tensor(float(strength), dtype=torch.float32, device=block.device)
    if gate:
        update = context_gate(block, v.expand_as(block)) * v * scale
    else:
        update = (v * scale).expand_as(block)
    moved = (block.float() + update).to(block.dtype)
    return torch.where((v != 0).expand_as(block), moved, block)


def inject(cond: torch.Tensor, placed: Sequence[StreamTokens], values: Sequence[torch.Tensor], strength: float = 1.0, gate: bool = False) -> torch.Tensor:
    """A copy of `cond` ([batch, rows, cols]) with every stream's values added to its block.

    `values[i]` is float32 [tokens_i, width_i] for `placed[i]` (rows of dead tokens are zero).
    The input tensor is never modified."""
    if cond.dim() != 3:
        raise ValueError(f"CONDITIONING must be [batch, rows, columns], got shape {tuple(cond.shape)}")
    if len(placed) != len(values):
        raise ValueError(f"{len(placed)} streams but {len(values)} value blocks")
    if not math.isfinite(float(strength)):
        raise ValueError(f"strength must be a finite number, got {float(strength)!r}")
    out = cond.clone()
    if float(strength) == 0.0:
        return out
    for p, v in zip(placed, values):
        rows, cols = p.rows, p.cols
        if rows.stop > cond.shape[1] or cols.stop > cond.shape[2]:
            raise ValueError(
                f"stream {p.stream.name} covers rows [{rows.start}, {rows.stop}) and columns [{cols.start}, {cols.stop}) "
                f"but the CONDITIONING is {tuple(cond.shape)}; it was made by another text encoder or text"
            )
        if not bool((v != 0).any()):
            continue
        out[:, rows, cols] = inject_block(cond[:, rows, cols], v, strength, gate)
    return out
