"""The host tier: engram tables in host memory, one copy per machine, for memories bigger than the GPUs.

A `HostTable` holds every layer's rows (and FP8 scales) in host memory that other processes share:

* from a table file: the file memory-mapped copy-on-write (`MAP_PRIVATE`). Opening maps the file and
  reads nothing; a fetch pages in only the rows it reads (the map is advised random access, so no
  read-ahead), from the page cache that every process mapping the file shares, so two loads of one file,
  in one process or in several, cost its size once. A write copies only the pages it touches into the
  writing process; the file itself never changes (saves write a new file and rename it into place).
* for a new memory: a shared-memory segment in /dev/shm (unlinked once mapped, so nothing outlives the
  process), zero until written. Its pages are reserved when it is made (`posix_fallocate`), so the
  whole table takes memory at once and a /dev/shm without room for it is a SharedMemoryFullError with
  the figures then, never a SIGBUS at a later write.

Writes and fetches may run at once (Memorize or Train while a prefetch thread looks up a prompt): a
sequence lock makes every fetch see the table before or after a write, never a torn row nor a row
beside another row's scales. Writers take a lock and bump the sequence number before and after
writing; a reader notes the number, gathers, and gathers again if it moved (after a few tries it takes
the writers' lock, so a reader always finishes).

`HostEngramBuffer` serves the `LocalEngramBuffer` contract (buffer.py) from a HostTable, as one rank
holding every row: `write(storages, sfs)` with whole layers, `fetch(indices, num_qps,
use_tma_aligned_col_major_sf)` returning one hook per layer, BF16 or FP8 + packed UE8M0 scales in either
layout, zero rows and zero scales for invalid ids. On the CPU a fetch is one `index_select` per layer
straight into the output (plus zeroing the rows of invalid ids). On CUDA the rows are gathered on the host
into pinned memory and copied to the device on a side stream; a hook makes the calling stream wait
for that copy (an event), so the host never waits for the compute stream (pass CPU indices: CUDA
indices must be copied to the host first, which waits for the work that made them).

`HostRowStore` is the `RowStore` (store.py) of a memory placed on the host tier.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import secrets
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from . import ue8m0
from .allocators import reserve_segment
from .table_file import TableFileError
from .rows import (
    check_buffer_indices,
    check_buffer_storages,
    check_fetch_indices,
    check_layer,
    check_rows,
    check_table_geometry,
    check_values,
    decode_checked,
    encode_rows,
    last_occurrence,
    make_hook,
    table_bytes,
    word_dtype,
)

logger = logging.getLogger(__name__)

_SHM_DIR = "/dev/shm"
_MADV_NORMAL, _MADV_RANDOM = 0, 1
_READ_TRIES = 3
# A fetch of at most this many rows of a mapped file first asks the kernel to read them all at once
# (prompt-sized lookups on a cold file: one parallel batch of disk reads instead of one fault at a time).
_WILLNEED_MAX_ROWS = 16384


def _advise(t: torch.Tensor, advice: int) -> None:
    """madvise over a tensor's pages: random access (no read-ahead: a fetch pages in its rows, not their
    neighbours) while serving, normal read-ahead while the whole table is read (a save)."""
    if t is None or t.numel() == 0:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        start = t.data_ptr() & ~(mmap.PAGESIZE - 1)
        length = t.data_ptr() + t.numel() * t.element_size() - start
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice)
    except (OSError, AttributeError):  # not Linux: read-ahead stays on, nothing else changes
        pass


class _SeqLock:
    """Writers exclude each other and bump `seq` around their writes; readers retry when it moved."""

    def __init__(self) -> None:
        self.seq = 0
        self.lock = threading.Lock()

    def write(self, fn: Callable[[], None]) -> None:
        with self.lock:
            self.seq += 1
            try:
                fn()
            finally:
                self.seq += 1

    def read(self, fn: Callable[[], Any]) -> Any:
        for _ in range(_READ_TRIES):
            seq = self.seq
            if seq % 2 == 0:
                result = fn()
                if self.seq == seq:
                    return result
        with self.lock:  # writers keep coming: read between two of them
            return fn()


class HostTable:
    """Every layer's rows of one memory in shared host memory (see the module docstring).

    `tables[l]`: uint8 `[rows_l, row_bytes]` view; `scales[l]`: uint8 `[rows_l, sf_row_bytes]` (FP8 only).
    `source`: the table file mapped, or None for a shared-memory segment. `sf_dtype` is the dtype of
    the packed scales (int32 unless written otherwise).
    """

    def __init__(self, rows_per_layer: Sequence[int], hidden: int, table_dtype: torch.dtype, backing: torch.Tensor,
                 table_offsets: Sequence[int], sf_offsets: Sequence[int] | None, source: str | None) -> None:
        self.rows_per_layer = [int(n) for n in rows_per_layer]
        self.num_layers = len(self.rows_per_layer)
        self.hidden = hidden
        self.table_dtype = table_dtype
        self.num_sf_packs = ue8m0.num_sf_packs(hidden) if table_dtype == torch.float8_e4m3fn else 0
        self.row_bytes = hidden * table_dtype.itemsize
        self.sf_row_bytes = self.num_sf_packs * 4
        self.sf_dtype = torch.int32
        self.source = source
        self.num_bytes = table_bytes(self.rows_per_layer, hidden, table_dtype)
        self._backing = backing
        self.seqlock = _SeqLock()
        self._table_offsets, self._sf_offsets = list(table_offsets), list(sf_offsets or [])
        self._fd: int | None = None
        self._file_state: tuple[int, int] | None = None
        if source is not None:
            self._fd = os.open(source, os.O_RDONLY)
            self._fd_closer = weakref.finalize(self, os.close, self._fd)
            self._file_state = _file_state(self._fd)
            if self._file_state[0] != backing.numel():
                raise TableFileError(f"{source}: the file changed while it was being loaded ({backing.numel()} bytes mapped, "
                                     f"{self._file_state[0]} bytes now); load it again")

        def region(offset: int, n: int, width: int) -> torch.Tensor:
            return backing[offset : offset + n * width].view(n, width)

        self.tables = [region(o, n, self.row_bytes) for o, n in zip(table_offsets, self.rows_per_layer)]
        self.scales = [region(o, n, self.sf_row_bytes) for o, n in zip(sf_offsets, self.rows_per_layer)] if sf_offsets is not None else None
        # Word views for the gathers: rows move as int64 words where row width and offset allow.
        self.table_words = [t.view(word_dtype(self.row_bytes, o)) for t, o in zip(self.tables, table_offsets)]
        self.sf_words = [s.view(word_dtype(self.sf_row_bytes, o)) for s, o in zip(self.scales, sf_offsets)] if self.scales is not None else None

    # ----- construction -----

    @classmethod
    def map_file(cls, path: str | os.PathLike) -> HostTable:
        """Map a table file copy-on-write (reads nothing; TableFileError naming the file when it is bad)."""
        from .table_file import TableFile, rows_key, scales_key

        path = os.path.abspath(os.fspath(path))
        with TableFile(path) as f:
            rows, hidden, dtype = list(f.rows_per_layer), f.hidden, f.table_dtype
            table_offsets = [f.byte_range(rows_key(l))[0] for l in range(f.num_layers)]
            sf_offsets = [f.byte_range(scales_key(l))[0] for l in range(f.num_layers)] if dtype == torch.float8_e4m3fn else None
        size = os.path.getsize(path)
        backing = torch.from_file(path, shared=False, size=size, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        _advise(backing, _MADV_RANDOM)
        return cls(rows, hidden, dtype, backing, table_offsets, sf_offsets, path)

    @classmethod
    def new_segment(cls, rows_per_layer: Sequence[int], hidden: int, table_dtype: torch.dtype) -> HostTable:
        """Zero tables in a fresh shared-memory segment (FP8 zero rows carry the smallest scale)."""
        rows = check_table_geometry(rows_per_layer, hidden, table_dtype)
        row_bytes = hidden * table_dtype.itemsize
        packs = ue8m0.num_sf_packs(hidden) if table_dtype == torch.float8_e4m3fn else 0
        offset, table_offsets, sf_offsets = 0, [], []
        for n in rows:
            table_offsets.append(offset)
            offset += n * row_bytes
        if packs:
            offset = -(-offset // 64) * 64
            for n in rows:
                sf_offsets.append(offset)
                offset += n * packs * 4
        size = max(mmap.PAGESIZE, -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE)
        backing = _segment(size)
        table = cls(rows, hidden, table_dtype, backing, table_offsets, sf_offsets if packs else None, None)
        if table.scales is not None:
            _, zero_sf = ue8m0.quantize_rows(torch.zeros((1, hidden)))
            for s in table.scales:
                s.view(torch.int32).copy_(zero_sf.expand(s.shape[0], -1))
        return table

    # ----- rows -----

    def gather(self, layer: int, ids: torch.Tensor, out: torch.Tensor, sf_out: torch.Tensor | None) -> None:
        """out[i] (uint8 [k, row_bytes]) = row ids[i] of the layer, zero when invalid; sf_out likewise.

        Not guarded against writers: `read()` is."""
        # As few passes over the ids as possible, so the cost stays that of the select itself: one
        # reduction tells whether every id is valid (the usual case); otherwise clamp into the table,
        # select, and zero the rows of the ids the clamp moved.
        n = self.rows_per_layer[layer]
        if ids.numel() == 0:
            return
        if self._fd is not None and ids.numel() <= _WILLNEED_MAX_ROWS:
            self._will_need(layer, ids)
        # The bookkeeping on the ids runs in numpy, single-threaded: a few tiny passes that as torch ops
        # would each start the intra-op thread pool (milliseconds apiece on a busy machine).
        ids_np = ids.contiguous().numpy()
        all_valid = int(ids_np.min()) >= 0 and int(ids_np.max()) < n
        if all_valid:
            safe = ids
        else:
            safe_np = np.clip(ids_np, 0, n - 1)
            invalid = torch.from_numpy(np.flatnonzero(safe_np != ids_np))
            safe = torch.from_numpy(safe_np)
        words = self.table_words[layer]
        torch.index_select(words, 0, safe, out=out.view(words.dtype))
        if sf_out is not None:
            sf_words = self.sf_words[layer]
            torch.index_select(sf_words, 0, safe, out=sf_out.view(sf_words.dtype))
        if not all_valid:
            out.index_fill_(0, invalid, 0)
            if sf_out is not None:
                sf_out.index_fill_(0, invalid, 0)

    def _will_need(self, layer: int, ids: torch.Tensor) -> None:
        """Start reading the file pages of these rows (and scales) at once; advisory, never fails."""
        n = self.rows_per_layer[layer]
        table_at, sf_at = self._table_offsets[layer], self._sf_offsets[layer] if self._sf_offsets else None
        try:
            for row in torch.unique(ids).tolist():
                if 0 <= row < n:
                    os.posix_fadvise(self._fd, table_at + row * self.row_bytes, self.row_bytes, os.POSIX_FADV_WILLNEED)
                    if sf_at is not None:
                        os.posix_fadvise(self._fd, sf_at + row * self.sf_row_bytes, self.sf_row_bytes, os.POSIX_FADV_WILLNEED)
        except (OSError, AttributeError):  # no posix_fadvise here: the faults read the rows one by one
            pass

    def read(self, fn: Callable[[], Any]) -> Any:
        """Run a gather so that it sees no write half done (see the module docstring)."""
        self.check_source()
        return self.seqlock.read(fn)

    def check_source(self) -> None:
        """Refuse to read a mapped table file that changed on disk since it was mapped.

        Saves replace a file by renaming a new one into place, which leaves this map's file intact; but a
        file overwritten in place (`cp new.safetensors memory.safetensors` truncates it first) would make
        every read of a page past its new end kill the process with SIGBUS, and a rewrite of the same
        size would serve another memory's rows. One fstat per fetch (about a microsecond) catches both
        before any page is touched; a truncation in the microseconds between the check and the gather
        remains possible, as with any mapped file."""
        if self._fd is None:
            return
        now = _file_state(self._fd)
        if now != self._file_state:
            size, new_size = self._file_state[0], now[0]
            what = f"its size went from {size} to {new_size} bytes" if new_size != size else "it was rewritten in place (same size, new modification time)"
            raise TableFileError(f"{self.source}: the memory file changed on disk after it was loaded ({what}); its rows can no "
                                 "longer be read safely from this load. Load the memory again (Load Engram Memory reloads a "
                                 "changed file on the next prompt); save memories to a new name or with Save Engram Memory, "
                                 "which replaces a file without touching the loaded one")

    def write_rows(self, layer: int, rows: torch.Tensor, data: torch.Tensor, sf: torch.Tensor | None) -> None:
        """Encoded rows (unique valid ids, int64) into the layer, atomically for concurrent fetches."""
        data = data.contiguous().view(torch.uint8).view(-1, self.row_bytes)
        sf = sf.contiguous().view(torch.uint8).view(-1, self.sf_row_bytes) if sf is not None else None

        def write() -> None:
            self.tables[layer].index_copy_(0, rows, data)
            if sf is not None:
                self.scales[layer].index_copy_(0, rows, sf)

        self.seqlock.write(write)

    def close(self) -> None:
        if self._fd is not None:
            self._fd_closer()
            self._fd = None
        self.tables = self.table_words = []
        self.scales = self.sf_words = None
        self._backing = None


def _file_state(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_size, st.st_mtime_ns


def _segment(size: int) -> torch.Tensor:
    """`size` zero bytes of shared memory: a /dev/shm file mapped shared and unlinked at once (the pages
    live while mapped; nothing is left behind if the process dies). Anonymous memory without /dev/shm."""
    if not os.path.isdir(_SHM_DIR):
        return torch.zeros(size, dtype=torch.uint8)
    path = os.path.join(_SHM_DIR, f"fp8engram-host-{os.getpid()}-{secrets.token_hex(6)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        # Backed now: a full /dev/shm is a SharedMemoryFullError here, not SIGBUS at the first write.
        reserve_segment(fd, size, "a host-memory table (shared-memory segment)", _SHM_DIR)
        return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    finally:
        os.close(fd)
        os.unlink(path)


class HostEngramBuffer:
    """The `LocalEngramBuffer` contract served from a HostTable (one rank holding every row).

    Not collective: any process may build one over the same table file. `device` is where fetched rows
    go (the CPU, or a CUDA device: host gather, then an asynchronous copy; see the module docstring).
    """

    def __init__(
        self,
        num_entries_per_layer: Sequence[int],
        hidden: int,
        num_max_tokens: int,
        num_entries_per_token: int,
        dtype: torch.dtype = torch.bfloat16,
        num_sf_packs: int = 0,
        *,
        device: torch.device | str = "cpu",
        table: HostTable | None = None,
    ) -> None:
        if dtype not in (torch.bfloat16, torch.float8_e4m3fn):
            raise ValueError(f"unsupported engram table dtype {dtype}; use torch.bfloat16 or torch.float8_e4m3fn")
        if (dtype == torch.float8_e4m3fn) != (num_sf_packs > 0):
            raise ValueError(f"FP8 tables need num_sf_packs > 0 and BF16 tables need 0, got dtype={dtype} num_sf_packs={num_sf_packs}")
        if num_max_tokens <= 0 or num_entries_per_token <= 0 or hidden <= 0:
            raise ValueError(f"sizes must be positive, got num_max_tokens={num_max_tokens} num_entries_per_token={num_entries_per_token} hidden={hidden}")
        if num_sf_packs and num_sf_packs != ue8m0.num_sf_packs(hidden):
            raise ValueError(f"num_sf_packs={num_sf_packs} does not fit hidden {hidden} (UE8M0 blocks of {ue8m0.SF_BLOCK}: {ue8m0.num_sf_packs(hidden)})")
        rows = [int(n) for n in num_entries_per_layer]
        if table is None:
            table = HostTable.new_segment(rows, hidden, dtype)
        elif table.rows_per_layer != rows or table.hidden != hidden or table.table_dtype != dtype:
            raise ValueError(f"the host table is {table.rows_per_layer} rows x {table.hidden} {table.table_dtype}, "
                             f"the buffer asks for {rows} x {hidden} {dtype}")
        self.table = table
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.rank_idx, self.num_ranks = 0, 1
        self.num_entries_per_layer = rows
        self.num_layers = len(rows)
        self.hidden = hidden
        self.dtype = dtype
        self.num_max_tokens = num_max_tokens
        self.num_entries_per_token = num_entries_per_token
        self.num_sf_packs = num_sf_packs
        self.use_fp8 = num_sf_packs > 0
        self.gather_mode = "host"
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @property
    def sf_dtype(self) -> torch.dtype:
        return self.table.sf_dtype

    def _check_alive(self) -> None:
        if self.table is None:
            raise RuntimeError("this HostEngramBuffer has been destroyed")

    def destroy(self) -> None:
        """Drop this buffer's hold on the table (the table lives while other holders keep it)."""
        self.table = None

    def write(self, storages: Sequence[torch.Tensor], sfs: Sequence[torch.Tensor] | None = None) -> None:
        """Copy whole layers `[n_l, hidden]` (and FP8 scale factors `[n_l, packs]`, 4-byte elements) into the table."""
        self._check_alive()
        check_buffer_storages(storages, self.num_entries_per_layer, self.hidden, self.dtype)
        if self.use_fp8:
            if sfs is None or len(sfs) != self.num_layers:
                raise ValueError(f"FP8 engram tables need one scale-factor tensor per layer ({self.num_layers}), got {None if sfs is None else len(sfs)}")
            for layer, sf in enumerate(sfs):
                if sf.dim() != 2 or tuple(sf.shape) != (self.num_entries_per_layer[layer], self.num_sf_packs) or sf.element_size() != 4:
                    raise ValueError(f"layer {layer}: scale factors must be [{self.num_entries_per_layer[layer]}, {self.num_sf_packs}] "
                                     f"with 4-byte elements, got {sf.dtype} {tuple(sf.shape)}")
                if sf.dtype != sfs[0].dtype:
                    raise ValueError(f"layer {layer}: scale-factor dtype {sf.dtype} differs from layer 0's {sfs[0].dtype}")
        elif sfs is not None:
            raise ValueError("BF16 engram tables take no scale factors")
        table = self.table

        def write() -> None:
            for layer, storage in enumerate(storages):
                table.tables[layer].copy_(storage.cpu().view(torch.uint8).view(storage.shape[0], table.row_bytes))
                if self.use_fp8:
                    table.scales[layer].copy_(sfs[layer].cpu().contiguous().view(torch.uint8).view(-1, table.sf_row_bytes))
            if self.use_fp8:
                table.sf_dtype = sfs[0].dtype

        table.seqlock.write(write)

    def fetch(self, indices: torch.Tensor, num_qps: int = 0, use_tma_aligned_col_major_sf: bool = True) -> list[Callable[[], object]]:
        """Gather the requested rows of every layer; one hook per layer (the LocalEngramBuffer contract).

        `indices` may be on the CPU or on the buffer's device. `num_qps` is accepted and ignored."""
        del num_qps
        self._check_alive()
        num_layers, num_tokens, entries = check_buffer_indices(indices, self.num_layers, self.num_entries_per_token, self.num_max_tokens)
        cuda = self.device.type == "cuda"
        host_ids = indices if indices.device.type == "cpu" else indices.cpu()
        table = self.table
        n = num_tokens * entries
        # Rows land in their final layout on the host (pinned when they go on to a GPU).
        data = torch.empty((num_layers, num_tokens, entries * self.hidden), dtype=self.dtype, pin_memory=cuda)
        sf_width = entries * self.num_sf_packs
        if self.use_fp8:
            if use_tma_aligned_col_major_sf:
                mn_stride = -(-num_tokens // 4) * 4
                sf_layer_stride, sf_strides = sf_width * mn_stride, (1, mn_stride)
            else:
                sf_layer_stride, sf_strides = sf_width * num_tokens, (sf_width, 1)
            sf_backing = torch.empty((num_layers, sf_layer_stride), dtype=table.sf_dtype, pin_memory=cuda)
            if use_tma_aligned_col_major_sf and mn_stride > num_tokens:  # the alignment padding reads as zero
                sf_backing.view(num_layers, sf_width, mn_stride)[:, :, num_tokens:].zero_()
            # Row-major scales are gathered straight into place; MN-major ones through rows, then transposed.
            sf_rows = torch.empty((n, table.sf_row_bytes), dtype=torch.uint8) if use_tma_aligned_col_major_sf else None

        def gather_all() -> None:
            for layer in range(num_layers):
                out_rows = data[layer].view(torch.uint8).view(n, table.row_bytes)
                if not self.use_fp8:
                    table.gather(layer, host_ids[layer].view(n), out_rows, None)
                elif sf_rows is None:
                    table.gather(layer, host_ids[layer].view(n), out_rows, sf_backing[layer].view(torch.uint8).view(n, table.sf_row_bytes))
                else:
                    table.gather(layer, host_ids[layer].view(n), out_rows, sf_rows)
                    sf = sf_backing.as_strided((num_tokens, sf_width), sf_strides, layer * sf_layer_stride)
                    sf.copy_(sf_rows.view(table.sf_dtype).view(num_tokens, sf_width))

        table.read(gather_all)
        event = None
        if cuda:
            caller = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self._copy_stream):
                data = data.to(self.device, non_blocking=True)
                if self.use_fp8:
                    sf_backing = sf_backing.to(self.device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._copy_stream)
            # The outputs were made on the copy stream and are used on the caller's.
            data.record_stream(caller)
            if self.use_fp8:
                sf_backing.record_stream(caller)
        results: list[object] = []
        for layer in range(num_layers):
            if self.use_fp8:
                results.append((data[layer], sf_backing.as_strided((num_tokens, sf_width), sf_strides, layer * sf_layer_stride)))
            else:
                results.append(data[layer])
        return [make_hook(r, event, self.device) for r in results]


class HostRowStore:
    """A memory's tables on the host tier (a `RowStore`; see the module docstring)."""

    def __init__(self, table: HostTable) -> None:
        self._table = table
        # where the rows live and why (a placement.Placement), set by placement.make_store; None when made directly
        self.placement = None
        self.rows_per_layer = list(table.rows_per_layer)
        self.num_layers = table.num_layers
        self.hidden = table.hidden
        self.table_dtype = table.table_dtype
        self.num_sf_packs = table.num_sf_packs
        self._closed = False

    @classmethod
    def new(cls, rows_per_layer: Sequence[int], hidden: int, table_dtype: torch.dtype = torch.bfloat16) -> HostRowStore:
        """Empty tables in a shared-memory segment."""
        return cls(HostTable.new_segment(rows_per_layer, hidden, table_dtype))

    @classmethod
    def from_table_file(cls, path: str | os.PathLike) -> HostRowStore:
        """The tables of a table file, mapped (nothing is read until fetched)."""
        return cls(HostTable.map_file(path))

    def __repr__(self) -> str:
        return f"HostRowStore(rows_per_layer={self.rows_per_layer}, hidden={self.hidden}, table_dtype={self.table_dtype})"

    @property
    def table(self) -> HostTable:
        if self._closed:
            raise RuntimeError("this HostRowStore is closed")
        return self._table

    @property
    def source(self) -> str | None:
        """The table file whose map holds the rows (None: a shared-memory segment)."""
        return self.table.source

    def buffer(self, num_max_tokens: int, num_entries_per_token: int, device: torch.device | str = "cpu") -> HostEngramBuffer:
        """A LocalEngramBuffer-contract view of these tables (fetches to `device`)."""
        t = self.table
        return HostEngramBuffer(t.rows_per_layer, t.hidden, num_max_tokens, num_entries_per_token, t.table_dtype, t.num_sf_packs, device=device, table=t)

    # ----- RowStore -----

    def _gather(self, table: HostTable, layer: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        k = ids.numel()
        out = torch.empty((k, table.row_bytes), dtype=torch.uint8)
        sf = torch.empty((k, table.sf_row_bytes), dtype=torch.uint8) if table.scales is not None else None
        table.gather(layer, ids, out, sf)
        data = out.view(table.table_dtype).view(k, table.hidden)
        return data, (sf.view(table.sf_dtype).view(k, table.num_sf_packs) if sf is not None else None)

    def fetch_rows(self, indices: torch.Tensor) -> list[torch.Tensor]:
        table = self.table
        check_fetch_indices(indices, self.num_layers)
        _, tokens, entries = indices.shape
        ids = indices.cpu()
        raw = table.read(lambda: [self._gather(table, layer, ids[layer].reshape(-1)) for layer in range(self.num_layers)])
        # A mapped file overwritten in place with its timestamp put back passes check_source: its rows must still be finite.
        return [decode_checked(data, sf, ids[layer], layer, table.source).view(tokens, entries, self.hidden)
                for layer, (data, sf) in enumerate(raw)]

    def read_rows(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        table = self.table
        layer = check_layer(layer, self.num_layers)
        rows = check_rows(rows, self.rows_per_layer[layer], layer).cpu()
        return decode_checked(*table.read(lambda: self._gather(table, layer, rows)), rows, layer, table.source)

    def write_rows(self, layer: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        table = self.table
        layer = check_layer(layer, self.num_layers)
        rows = check_rows(rows, self.rows_per_layer[layer], layer).cpu()
        values = check_values(values, rows.numel(), self.hidden, layer).cpu()
        rows, values = last_occurrence(rows, values)
        data, sf = encode_rows(values.float(), self.table_dtype)
        table.write_rows(layer, rows, data, sf)

    def close(self) -> None:
        """Unmap the tables (other processes' maps of the same file are untouched). Idempotent."""
        self._closed = True
        self._table = None

    def __enter__(self) -> HostRowStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- table files -----

    def save_table_file(self, path: str, *, hashing: Any = None, streams: Any = None) -> None:
        """Write the tables to a table file atomically (temp file renamed into place), no write half in."""
        from .table_file import write_table_file

        table = self.table
        views = [t.view(self.table_dtype).view(n, self.hidden) for t, n in zip(table.tables, self.rows_per_layer)]
        scales = [s.view(table.sf_dtype).view(n, self.num_sf_packs) for s, n in zip(table.scales, self.rows_per_layer)] if table.scales is not None else None
        with table.seqlock.lock:  # writers wait; fetches go on
            table.check_source()
            if table.source is not None:
                _advise(table._backing, _MADV_NORMAL)  # read the whole file with read-ahead
            try:
                write_table_file(path, views, scales, hashing=hashing, streams=streams)
            finally:
                if table.source is not None:
                    _advise(table._backing, _MADV_RANDOM)

    def load_table_file(self, path: str, *, rows_needed: Sequence[int] | None = None) -> dict:
        """Map a table file of the same geometry (with `rows_needed`: any row count holding those, see
        TableFile.check_geometry; the store takes the file's) in place of the current tables; returns its
        metadata."""
        from .table_file import TableFile

        with TableFile(path) as f:
            f.check_geometry(self.rows_per_layer, self.hidden, self.table_dtype, rows_needed=rows_needed)
            metadata = f.metadata
        table = self.table
        new = HostTable.map_file(path)
        new.seqlock = table.seqlock  # fetches in flight on the old map finish there
        with table.seqlock.lock:
            table.seqlock.seq += 1
            self._table = new
            self.rows_per_layer = list(new.rows_per_layer)
            table.seqlock.seq += 1
        return metadata
