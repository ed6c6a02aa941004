"""Large engram table files for the host-tier benches, written without holding the table in memory."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".host", "pkg"))

from fp8_engram.engram import ue8m0  # noqa: E402
from fp8_engram.engram.table_file import write_table_file  # noqa: E402

_CHUNK_ROWS_BYTES = 64 << 20


def write_random_table_file(path: str, rows_per_layer: list[int], hidden: int, dtype: torch.dtype, *, hashing=None, streams=None, seed: int = 0) -> int:
    """A table file of random rows (FP8: with valid UE8M0 scales); returns its size in bytes.

    One block of random rows is repeated for every chunk of every layer: the file is written in a
    stream and this process never holds more than the block."""
    row_bytes = hidden * dtype.itemsize
    block_rows = max(1, _CHUNK_ROWS_BYTES // row_bytes)
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(block_rows, hidden, generator=g)
    if dtype == torch.float8_e4m3fn:
        block, block_sf = ue8m0.quantize_rows(values)
    else:
        block, block_sf = values.to(dtype), None
    tables, scales = [], []
    for n in rows_per_layer:
        chunks = [block] * (n // block_rows) + ([block[: n % block_rows]] if n % block_rows else [])
        tables.append(chunks)
        if block_sf is not None:
            scales.append([block_sf] * (n // block_rows) + ([block_sf[: n % block_rows]] if n % block_rows else []))
    write_table_file(path, tables, scales if block_sf is not None else None, hashing=hashing, streams=streams)
    return os.path.getsize(path)


def drop_from_page_cache(path: str) -> None:
    """Ask the kernel to forget the file's cached pages (so the next reads come from the disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def mem_available() -> int:
    """MemAvailable of /proc/meminfo, in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def pss(pid: int | str = "self") -> int:
    """Proportional set size of a process (bytes): shared pages count 1/n to each of their n users."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no Pss in /proc/{pid}/smaps_rollup")
