"""What the compute paths remember of a device: products that failed there, and the keys they are filed under.

A kernel that cannot run on a device (no kernel for the dtype, a compile error, a refused shape) is
tried once per kind of product; the failure is logged once and the kind runs its fallback from then
on. Out of memory is never remembered: that call alone falls back.
"""

from __future__ import annotations

import logging

import torch

from ..runtime import log_once

logger = logging.getLogger("fp8_engram.quant.compute.linear")

__all__ = ["fp8_failed", "int8_failed", "wo_failed", "first_line", "device_key", "is_oom", "remember_failure"]

# fp8 products that failed for a reason other than memory, per (device key, layout kind,
# activation scaling, input dtype, weight dtype, output dtype): later calls go weight-only at once
fp8_failed: set = set()
# int8 products that failed likewise, per (device key, int8 layout, input dtype, output dtype): a kernel
# that cannot compile or launch there would otherwise be retried (and recompiled) on every call
int8_failed: set = set()
# fused weight-only GEMMs that failed likewise, per (device key, scale blocks, weight dtype, compute dtype)
wo_failed: set = set()


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:160] if text else ""


def device_key(device: torch.device):
    device = torch.device(device)
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return device.type, index


def is_oom(exc: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None)
    return (oom is not None and isinstance(exc, oom)) or "out of memory" in str(exc).lower()


def remember_failure(failed: set, key, exc: BaseException, what: str, device, kind: str) -> None:
    """A product of `key`'s kind failed: remember it in `failed` (later calls take the fallback without
    trying), logged once. Out of memory is never remembered: that call alone falls back."""
    if is_oom(exc):
        log_once(logger, (what, "oom", key), logging.WARNING, "%s ran out of memory on %s; this call runs weight-only "
                 "(later calls try it again; logged once)", what, device)
        return
    failed.add(key)
    log_once(logger, (what, "failed", key), logging.WARNING, "%s failed on %s for %s (%s: %s); these run weight-only "
             "from now on (logged once)", what, device, kind, type(exc).__name__, first_line(exc))
