"""The engram nodes' images (ComfyUI IMAGE tensors [1, H, W, 3] in [0, 1]): the loss curve of Engram
Train and the heat map of Engram Inspect. Plain torch drawing, no plotting library."""

from __future__ import annotations

import math

import torch


def loss_curve_image(losses: list[float], width: int = 512, height: int = 256) -> torch.Tensor:
    """A plain line plot of log10(loss) per step as a ComfyUI IMAGE [1, H, W, 3]."""
    image = torch.full((height, width, 3), 0.08)
    if not losses:
        return image.unsqueeze(0)
    values = torch.tensor([math.log10(max(v, 1e-30)) for v in losses], dtype=torch.float64)
    lo, hi = float(values.min()), float(values.max())
    span = hi - lo if hi > lo else 1.0
    margin = 12
    xs = torch.linspace(margin, width - margin - 1, len(losses))
    ys = (height - margin - 1) - (values - lo) / span * (height - 2 * margin - 1)
    image[margin:height - margin, margin] = 0.5  # axes
    image[height - margin - 1, margin:width - margin] = 0.5
    for i in range(len(losses) - 1):  # draw segments densely enough to be continuous
        n = max(2, int(abs(float(xs[i + 1] - xs[i])) + abs(float(ys[i + 1] - ys[i]))) + 1)
        t = torch.linspace(0, 1, n, dtype=torch.float64)
        px = (xs[i] + (xs[i + 1] - xs[i]) * t).round().long().clamp(0, width - 1)
        py = (ys[i] + (ys[i + 1] - ys[i]) * t).round().long().clamp(0, height - 1)
        image[py, px] = torch.tensor([0.95, 0.6, 0.1])
    return image.unsqueeze(0)


def heat_map(hits, cell: int = 16) -> torch.Tensor:
    streams = sorted({h.stream for h in hits})
    if not hits:
        return torch.zeros(1, cell, cell, 3)
    rows = {s: [h for h in hits if h.stream == s] for s in streams}
    width = max(len(v) for v in rows.values())
    peak = max((h.norm for h in hits), default=0.0) or 1.0
    image = torch.zeros(len(streams) * cell, width * cell, 3)
    for r, s in enumerate(streams):
        for c, h in enumerate(rows[s]):
            level = h.norm / peak
            image[r * cell + 1:(r + 1) * cell - 1, c * cell + 1:(c + 1) * cell - 1] = torch.tensor([level, 0.3 * level, 1.0 - level]) * (0.3 + 0.7 * h.entries_hit / max(h.entries, 1))
    return image.unsqueeze(0)
