"""Run-time helpers every floor shares: reusable CPU buffers, the account of kept dequantized copies, the
torch.compile trace check, once-only logs.

Floor 1: imports nothing from the pack.
"""

from __future__ import annotations

import logging
import threading

import torch

__all__ = ["workspace", "release_workspace", "CopyAccount", "DEQUANT_COPIES", "tracing", "log_once", "reset_log_once", "device_key", "first_line",
           "is_oom"]

# Per-thread reusable CPU buffers for temporaries that never outlive one call (the gather indices,
# and the weight-only path's dequantized weight). Large fresh allocations are handed out by the
# C library as new zero-filled pages each time, so a model that dequantizes gigabytes per step
# spends more time in page faults than in the conversion itself; a buffer that stays mapped does not.
_workspace = threading.local()


def workspace(slot: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat CPU tensor of ``numel`` elements from this thread's reusable buffer ``slot``.

    Its contents are undefined and it is overwritten by the next caller of the same slot and dtype,
    so it must never be returned to a caller or saved for backward. Always a normal (non-inference)
    tensor, so it can be written under and outside ``inference_mode`` alike.
    """
    bufs = getattr(_workspace, "bufs", None)
    if bufs is None:
        bufs = _workspace.bufs = {}
    buf = bufs.get((slot, dtype))
    if buf is None or buf.numel() < numel:
        bufs.pop((slot, dtype), None)  # free the old one before allocating the larger one
        with torch.inference_mode(False), torch.no_grad():
            buf = torch.empty(numel, dtype=dtype)
        bufs[(slot, dtype)] = buf
    return buf[:numel]


def release_workspace() -> None:
    """Free this thread's reusable buffers (they are re-made on demand)."""
    _workspace.bufs = {}


class CopyAccount:
    """The bytes this process keeps in dequantized weight copies (``ComputeConfig.dequant_cache_bytes``), one
    account for every model and thread, so the total never exceeds the largest budget asked.

    ``reserve(nbytes, budget)`` books ``nbytes`` if the total stays within ``budget`` (first come, first kept:
    a copy asked once the total is full is refused, and its layer dequantizes per call); ``release(nbytes)``
    gives them back (a kept copy's finalizer calls it when the copy is freed).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes = 0
        self._copies = 0

    def reserve(self, nbytes: int, budget: int) -> bool:
        with self._lock:
            if nbytes <= 0 or self._bytes + nbytes > budget:
                return False
            self._bytes += nbytes
            self._copies += 1
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._bytes -= nbytes
            self._copies -= 1

    @property
    def bytes(self) -> int:
        """Bytes kept now."""
        with self._lock:
            return self._bytes

    @property
    def copies(self) -> int:
        """Copies kept now."""
        with self._lock:
            return self._copies


DEQUANT_COPIES = CopyAccount()
"""The process's one account of kept dequantized copies (``compute/paths/plain.py`` books and frees them)."""


_FAKE_MODE = torch._C._TorchDispatchModeKey.FAKE


def tracing() -> bool:
    """True while torch.compile traces (fake tensors). Then nothing may be cached across calls or
    written into a reused buffer: such a tensor, real or made under one compile's fake mode, is
    what makes the compiler fail ("Mixing fake modes", "convert all Tensors to FakeTensors")."""
    # is_compiling() covers the whole compile session on torch 2.14; older torch sets it only in
    # Dynamo-traced frames, not in a subclass's handlers, hence the fake-mode check as well
    return torch.compiler.is_compiling() or torch._C._get_dispatch_mode(_FAKE_MODE) is not None


_logged: set = set()
_log_lock = threading.Lock()


def log_once(logger: logging.Logger, key, level: int, msg: str, *args) -> None:
    """Log ``msg`` on ``logger`` the first time ``key`` is seen in this process."""
    with _log_lock:
        if key in _logged:
            return
        _logged.add(key)
    logger.log(level, msg, *args)


def reset_log_once() -> None:
    """Forget which messages were logged (tests use it to observe the once-only log)."""
    with _log_lock:
        _logged.clear()


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, at most 160 characters (for one-line logs)."""
    text = str(exc).strip()
    return text.splitlines()[0][:160] if text else ""


def device_key(device) -> tuple:
    """(type, index) naming one device exactly (a bare "cuda" is the current GPU)."""
    device = torch.device(device)
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return device.type, index


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error (never remembered as a failure of a kernel)."""
    oom = getattr(torch, "OutOfMemoryError", None)
    return (oom is not None and isinstance(exc, oom)) or "out of memory" in str(exc).lower()
