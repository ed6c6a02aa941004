"""What a model's weights are made of: element counts and bytes per storage dtype.

Works on any `torch.nn.Module`; a weight that is a `QuantizedTensor` (or any wrapper exposing `qdata`)
is counted by the dtype and bytes it really occupies, with its scales, not by its logical dtype.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch


@dataclass
class WeightSummary:
    """Totals over a module's parameters and buffers, keyed by storage dtype name."""

    elements: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    tensors: dict[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def total_elements(self) -> int:
        return sum(self.elements.values())

    def bf16_bytes(self) -> int:
        """Bytes the same weights would take stored as bfloat16 (the usual published precision)."""
        return 2 * self.total_elements

    def as_text(self) -> str:
        lines = [f"{'dtype':<16}{'tensors':>9}{'elements':>15}{'MiB':>11}"]
        for name in sorted(self.bytes, key=lambda n: -self.bytes[n]):
            lines.append(f"{name:<16}{self.tensors[name]:>9}{self.elements[name]:>15,}{self.bytes[name] / 2**20:>11.2f}")
        lines.append(f"{'total':<16}{sum(self.tensors.values()):>9}{self.total_elements:>15,}{self.total_bytes / 2**20:>11.2f}")
        lines.append(f"as bf16: {self.bf16_bytes() / 2**20:.2f} MiB")
        return "\n".join(lines)


def _storage_parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    qdata = getattr(tensor, "qdata", None)
    if isinstance(qdata, torch.Tensor):
        parts = [qdata]
        for name in ("scale", "input_scale"):
            extra = getattr(tensor, name, None)
            if isinstance(extra, torch.Tensor):
                parts.append(extra)
        return parts
    return [tensor]


def summarize_module(module: torch.nn.Module) -> WeightSummary:
    """Count every parameter and buffer of `module` once, by the dtype its bytes are stored in."""
    elements: dict[str, int] = defaultdict(int)
    nbytes: dict[str, int] = defaultdict(int)
    tensors: dict[str, int] = defaultdict(int)
    seen: set[int] = set()
    for tensor in list(module.parameters()) + list(module.buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        logical = tensor.numel()
        for i, part in enumerate(_storage_parts(tensor)):
            name = str(part.dtype).removeprefix("torch.")
            if type(getattr(tensor, "layout", None)).__name__ == "NVFP4":
                name = "nvfp4"  # packed 4-bit data and its scale bytes, not plain uint8 tensors
            # Scales are bookkeeping: count their bytes, but only the weight's own elements.
            elements[name] += logical if i == 0 else 0
            nbytes[name] += part.numel() * part.element_size()
            tensors[name] += 1 if i == 0 else 0
    return WeightSummary(dict(elements), dict(nbytes), dict(tensors))
