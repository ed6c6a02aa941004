"""Positioned reads that fill a buffer, by several threads at once where it is large.

Reading a file that sits in the page cache into fresh memory is a copy plus a page fault for every page
written, and one core does that at a few GB/s: a 136 MB read took 60 ms on one core of this project's 2-core
machine and 40 ms split over both (23 and 15 ms into pages already faulted in). Positioned reads
(``os.preadv``) share no file position, so threads may read parts of one open file at once.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

HAS_PREADV = hasattr(os, "preadv")  # not on Windows
# A buffer of this many bytes or more is read in parts by several threads; a part is at least half of it.
PARALLEL_MIN_BYTES = 8 << 20
MAX_THREADS = 4  # threads that fill one buffer, the caller's included
PAGE = 4096

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cores))


def _helpers() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=MAX_THREADS - 1, thread_name_prefix="fp8-engram-read")
        return _pool


def read_at(fd: int, view, offset: int) -> int:
    """Fill ``view`` (a writable 1-D byte buffer: a memoryview, a uint8 numpy array) from ``fd`` at ``offset`` in
    this thread; the bytes read, fewer than ``len(view)`` where the file ended. ``OSError`` as the system raised
    it."""
    done, size = 0, len(view)
    while done < size:  # one read returns at most ~2 GiB on Linux
        n = os.preadv(fd, [view[done:]], offset + done)
        if not n:
            break
        done += n
    return done


def parts(size: int, threads: int) -> list[tuple[int, int]]:
    """``(start, end)`` byte ranges splitting ``size`` bytes for ``threads`` readers: one range under
    ``PARALLEL_MIN_BYTES``, else page-aligned ranges of at least half that."""
    if threads <= 1 or size < PARALLEL_MIN_BYTES:
        return [(0, size)]
    n = min(threads, size // (PARALLEL_MIN_BYTES // 2))
    step = -(-size // n // PAGE) * PAGE
    return [(a, min(a + step, size)) for a in range(0, size, step)]


def read_into(fd: int, view, offset: int, parallel: bool = True) -> int:
    """``read_at``, with a buffer of ``PARALLEL_MIN_BYTES`` or more split over up to ``MAX_THREADS`` threads (this
    one and a shared pool's) where ``parallel`` and the process may run on several cores. Returns the bytes read
    from the start of ``view`` (where the file ended, the first part that came up short says how far); raises the
    first part's error (``OSError`` as the system raised it). Every part has ended, read or failed, when this
    returns or raises: nothing writes into the buffer afterwards."""
    if not parallel or len(view) < PARALLEL_MIN_BYTES:
        return read_at(fd, view, offset)
    ranges = parts(len(view), _threads())
    if len(ranges) == 1:
        return read_at(fd, view, offset)
    pool = _helpers()
    futures = [pool.submit(read_at, fd, view[a:b], offset + a) for a, b in ranges[1:]]
    results: list = []
    try:
        results.append(read_at(fd, view[: ranges[0][1]], offset))
    except Exception as exc:  # noqa: BLE001 - raised below, once every part has ended
        results.append(exc)
    for f in futures:  # each one waited for, whatever came before
        try:
            results.append(f.result())
        except Exception as exc:  # noqa: BLE001 - as above
            results.append(exc)
    for got in results:
        if isinstance(got, Exception):
            raise got
    for (a, b), got in zip(ranges, results):
        if got < b - a:
            return a + got
    return len(view)
