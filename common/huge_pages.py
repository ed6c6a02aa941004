"""Transparent huge pages for fresh read buffers: which of them may ask for huge pages, and the asking.

A read buffer of HUGE_PAGE_MIN_BYTES or more has its memory marked for transparent huge pages before it is filled
(madvise MADV_HUGEPAGE, honoured where THP is "madvise" or "always"): filling a fresh buffer costs mostly its page
faults, one per 4 KiB page otherwise. 541 MB in 18 buffers read from the page cache, 2-core AMD EPYC Zen 5 VM,
Linux 6.18, THP "madvise": 210-247 ms into plain buffers, 52-58 ms into marked ones (2 rounds of 24 took 0.56-1.2 s:
the VM's host faulting in memory the guest had not touched; the kernel counted no compaction or reclaim); the
Flux-shaped e2e file's load (136 MB of kept layers read at load) 36-40 ms -> 19-21 ms. Only as many bytes as the
kernel holds free in blocks of a huge page or more (half of them, per load: ``HugePages``), so that no fault waits
for the kernel to compact or reclaim memory for one (with THP's defrag on "madvise", the default of several
distributions, a fault in such a region does that synchronously when no free block is left). Elsewhere (no
MADV_HUGEPAGE: Windows, macOS; THP "never"; no room) buffers are as torch.empty gives them.

Standard library only (the caller allocates the buffer and passes its address).
"""

from __future__ import annotations

import ctypes
import logging
import mmap

logger = logging.getLogger(__name__)

__all__ = ["HUGE_PAGE_MIN_BYTES", "free_block_bytes", "huge_page_room", "HugePages", "advise"]

HUGE_PAGE_MIN_BYTES = 4 << 20
AVAILABLE = hasattr(mmap, "MADV_HUGEPAGE")  # Linux
_THP = "/sys/kernel/mm/transparent_hugepage"


def free_block_bytes(buddyinfo: str, min_order: int, page: int) -> int:
    """Bytes free in blocks of ``page << min_order`` bytes or more, from the text of ``/proc/buddyinfo``."""
    total = 0
    for line in buddyinfo.splitlines():
        parts = line.split()  # Node 0, zone Normal <free blocks of order 0> <order 1> ...
        if len(parts) < 5 or parts[2] != "zone":
            continue
        for order, count in enumerate(parts[4:]):
            if order >= min_order and count.isdigit():
                total += int(count) * (page << order)
    return total


def huge_page_room() -> int:
    """Bytes the kernel holds free in blocks of a transparent huge page or more; 0 where huge pages cannot be had
    (no MADV_HUGEPAGE, THP "never", unreadable settings)."""
    if not AVAILABLE:
        return 0
    try:
        with open(f"{_THP}/enabled") as f:
            mode = f.read()
        with open("/proc/buddyinfo") as f:
            text = f.read()
    except OSError:
        return 0
    huge = huge_size()
    if "[never]" in mode or huge <= mmap.PAGESIZE:
        return 0
    return free_block_bytes(text, (huge // mmap.PAGESIZE).bit_length() - 1, mmap.PAGESIZE)


class HugePages:
    """The read buffers of one load that may ask for huge pages: half of ``huge_page_room()`` when the first one is
    asked, each taken in full or not at all."""

    def __init__(self):
        self.left: int | None = None

    def take(self, nbytes: int) -> bool:
        if nbytes < HUGE_PAGE_MIN_BYTES or not AVAILABLE:
            return False
        if self.left is None:
            self.left = huge_page_room() // 2
        if nbytes > self.left:
            return False
        self.left -= nbytes
        return True


def advise(addr: int, nbytes: int) -> None:
    """Mark the whole huge pages of the memory at ``addr`` (``nbytes`` long, not yet touched) MADV_HUGEPAGE; a
    failure is logged at debug level and changes nothing else (the memory keeps its small pages)."""
    global _madvise
    if _madvise is None:
        try:
            _madvise = ctypes.CDLL(None, use_errno=True).madvise
            _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            _madvise.restype = ctypes.c_int
        except (OSError, AttributeError):
            _madvise = False
    size = huge_size()
    start, end = -(-addr // size) * size, (addr + nbytes) // size * size
    if _madvise and AVAILABLE and end > start and _madvise(start, end - start, mmap.MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())


_madvise = None
_HUGE_SIZE: int | None = None


def huge_size() -> int:
    """Bytes of a transparent huge page (2 MiB on x86-64 where the kernel does not say)."""
    global _HUGE_SIZE
    if _HUGE_SIZE is None:
        try:
            with open(f"{_THP}/hpage_pmd_size") as f:
                _HUGE_SIZE = int(f.read())
        except (OSError, ValueError):
            _HUGE_SIZE = 2 << 20
    return _HUGE_SIZE
