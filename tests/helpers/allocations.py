"""Counting what the CPU allocator hands out while a function runs (torch's profiler)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile


def bytes_allocated(fn) -> int:
    """CPU bytes allocated while ``fn`` runs, freed or not: the operators that allocate are the leaves of the
    profiler's event tree (an operator's own figure nets out what it freed before returning)."""
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(e.cpu_memory_usage, 0) for e in prof.events() if not e.cpu_children)
