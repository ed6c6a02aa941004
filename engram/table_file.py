"""Engram table files: safetensors holding every layer's GLOBAL rows plus metadata.

Keys, per layer `l`:
  `layers.<l>.rows`    [rows_l, hidden]       bfloat16, or float8_e4m3fn
  `layers.<l>.scales`  [rows_l, num_sf_packs] int32 packed UE8M0 (FP8 tables only; see ue8m0.py)
Header metadata (safetensors `__metadata__`, all strings):
  `engram.format` = "fp8-engram-table", `engram.format_version` = "1",
  `engram.geometry` = JSON {num_layers, hidden, rows_per_layer, dtype, num_sf_packs, sf_block},
  `engram.hashing`, `engram.streams` = JSON given by the caller, stored and returned untouched.

The writer streams row chunks straight to a temp file in the target folder and renames it into place,
so a table sharded over several processes is written without concatenating it. Readers memory-map the
file (safetensors `safe_open`) and read row ranges, so a worker touches only its own rows.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
from collections.abc import Sequence
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from . import ue8m0
from .errors import TableFileError, TableFileWriteError
from ..common.files import new_temp_file
from ..common.proc import kib_fields, overcommit_mode
from ..common.sizes import size_text as gib_text

FORMAT_NAME = "fp8-engram-table"
FORMAT_VERSION = "1"
_ST_DTYPES = {torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3", torch.int32: "I32"}
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float8_e4m3fn: "float8_e4m3fn"}
_DTYPES_BY_NAME = {v: k for k, v in _DTYPE_NAMES.items()}
_WRITE_CHUNK_BYTES = 64 << 20


# A table file's metadata is a few KB of JSON; anything far larger is not one of ours.
MAX_METADATA_JSON_BYTES = 16 * 1024 * 1024


def _json_field(path: str, key: str, text: str | None, default: str = "null"):
    text = default if text is None else text
    if len(text) > MAX_METADATA_JSON_BYTES:
        raise TableFileError(f"{path}: metadata {key!r} is {len(text):,} characters long, at most "
                             f"{MAX_METADATA_JSON_BYTES:,} expected")
    try:
        return json.loads(text)
    except RecursionError:
        raise TableFileError(f"{path}: metadata {key!r} is JSON nested too deeply") from None
    except ValueError as e:  # bad JSON, or an integer literal beyond Python's digit limit
        raise TableFileError(f"{path}: metadata {key!r} is not valid JSON ({str(e)[:200]})") from None


def rows_key(layer: int) -> str:
    return f"layers.{layer}.rows"


def scales_key(layer: int) -> str:
    return f"layers.{layer}.scales"


Chunks = torch.Tensor | Sequence[torch.Tensor]


def _as_chunks(x: Chunks) -> list[torch.Tensor]:
    return [x] if isinstance(x, torch.Tensor) else list(x)


def _write_tensor_bytes(f, t: torch.Tensor) -> int:
    flat = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    written = 0
    for start in range(0, flat.numel(), _WRITE_CHUNK_BYTES):
        written += f.write(memoryview(flat[start : start + _WRITE_CHUNK_BYTES].numpy()))
    return written


def write_table_file(
    path: str | os.PathLike,
    tables: Sequence[Chunks],
    scales: Sequence[Chunks] | None = None,
    *,
    hashing: Any = None,
    streams: Any = None,
) -> None:
    """Write a table file atomically.

    `tables[l]` is layer l's rows `[rows_l, hidden]`, or a list of row chunks whose concatenation is those
    rows (e.g. one shard per rank); `scales[l]` likewise (FP8 only). `hashing` and `streams` must be
    JSON-serializable; they are stored as given.
    """
    path = os.fspath(path)
    tables = [_as_chunks(t) for t in tables]
    if not tables or any(not chunks for chunks in tables):
        raise ValueError(f"{path}: need at least one layer, each with at least one row chunk")
    dtype = tables[0][0].dtype
    hidden = tables[0][0].shape[-1] if tables[0][0].dim() == 2 else -1
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"{path}: table dtype must be bfloat16 or float8_e4m3fn, got {dtype}")
    fp8 = dtype == torch.float8_e4m3fn
    packs = ue8m0.num_sf_packs(hidden) if fp8 else 0
    if fp8 != (scales is not None):
        raise ValueError(f"{path}: FP8 tables need scales and BF16 tables take none")
    scale_chunks = [_as_chunks(s) for s in scales] if scales is not None else None
    if scale_chunks is not None and len(scale_chunks) != len(tables):
        raise ValueError(f"{path}: {len(tables)} tables but {len(scale_chunks)} scale tensors")

    header: dict[str, Any] = {}
    pieces: list[torch.Tensor] = []
    offset = 0
    rows_per_layer = []

    def add(key: str, chunks: list[torch.Tensor], width: int, want: torch.dtype) -> int:
        nonlocal offset
        for c in chunks:
            if c.dim() != 2 or c.shape[1] != width or c.dtype != want:
                raise ValueError(f"{path}: {key} chunk must be {want} [rows, {width}], got {c.dtype} {tuple(c.shape)}")
        rows = sum(c.shape[0] for c in chunks)
        nbytes = rows * width * want.itemsize
        header[key] = {"dtype": _ST_DTYPES[want], "shape": [rows, width], "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        pieces.extend(chunks)
        return rows

    for layer, chunks in enumerate(tables):
        rows = add(rows_key(layer), chunks, hidden, dtype)
        if scale_chunks is not None:
            if add(scales_key(layer), scale_chunks[layer], packs, torch.int32) != rows:
                raise ValueError(f"{path}: {scales_key(layer)} has a different row count than {rows_key(layer)}")
        rows_per_layer.append(rows)

    geometry = {
        "num_layers": len(tables),
        "hidden": hidden,
        "rows_per_layer": rows_per_layer,
        "dtype": _DTYPE_NAMES[dtype],
        "num_sf_packs": packs,
        "sf_block": ue8m0.SF_BLOCK if fp8 else 0,
    }
    header["__metadata__"] = {
        "engram.format": FORMAT_NAME,
        "engram.format_version": FORMAT_VERSION,
        "engram.geometry": json.dumps(geometry),
        "engram.hashing": json.dumps(hashing),
        "engram.streams": json.dumps(streams),
    }
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)

    folder = os.path.dirname(os.path.abspath(path))
    total = 8 + len(header_bytes) + offset
    existed = os.path.exists(path)
    try:
        free = shutil.disk_usage(folder).free
    except OSError as e:
        raise _write_failed(path, e, 0, total, existed) from e
    if free < total:
        raise TableFileWriteError(errno.ENOSPC, f"{path}: the table file needs {total / 2**20:,.2f} MiB but only "
                                  f"{free / 2**20:,.2f} MiB are free in {folder}; nothing was written")
    try:
        fd, tmp = new_temp_file(folder, ".tmp-", ".safetensors")
    except OSError as e:  # a read-only folder or filesystem, no permission: the message names the destination
        raise _cannot_create(path, folder, e, existed) from e
    written = 0
    try:
        with os.fdopen(fd, "wb") as f:
            written += f.write(struct.pack("<Q", len(header_bytes)))
            written += f.write(header_bytes)
            for piece in pieces:
                written += _write_tensor_bytes(f, piece)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError) and not isinstance(e, TableFileWriteError):
            raise _write_failed(path, e, written, total, existed) from e
        raise


def _cannot_create(path: str, folder: str, e: OSError, existed: bool) -> TableFileWriteError:
    why = e.strerror or str(e)
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        advice = (f"{folder} is read-only ({why}): make it writable, or save into a folder that is (ComfyUI's "
                  "extra_model_paths.yaml can add one)")
    else:
        advice = f"no new file can be made in {folder} ({why})"
    before = "the file that was there is unchanged" if existed else "nothing was written"
    return TableFileWriteError(e.errno or errno.EIO, f"{path}: cannot write the table file: {advice}; {before}")


def _write_failed(path: str, e: OSError, written: int, total: int, existed: bool) -> TableFileWriteError:
    why = e.strerror or str(e)
    if e.errno == errno.ENOSPC:
        why += " (the disk is full)"
    before = "the table file that was there is unchanged" if existed else "no file was created"
    return TableFileWriteError(e.errno or errno.EIO, f"{path}: writing the table file failed after {written:,} of "
                               f"{total:,} bytes: {why}; the partial temporary file was removed and {before}")


def map_room() -> tuple[int | None, str]:
    """(bytes this process can still map copy-on-write, what sets that limit; None: no limit).

    Readers map a whole table file privately (safetensors, and the host tier), and Linux charges such a
    map like memory: with the default overcommit heuristic one map may not exceed the machine's memory
    plus swap, with strict overcommit what is left of the commit limit; RLIMIT_AS and RLIMIT_DATA bound
    it too. Whatever cannot be read counts as no limit."""
    import resource

    limits: list[tuple[int, str]] = []
    info = kib_fields("/proc/meminfo") or {}
    mode = overcommit_mode()
    if mode == 0 and "MemTotal" in info:
        total = info["MemTotal"] + info.get("SwapTotal", 0)
        limits.append((total, f"this machine has {gib_text(info['MemTotal'])} of memory and {gib_text(info.get('SwapTotal', 0))} of swap"))
    elif mode == 2 and "CommitLimit" in info:
        left = info["CommitLimit"] - info.get("Committed_AS", 0)
        limits.append((left, f"this machine's commit limit leaves {gib_text(max(left, 0))} (strict overcommit)"))
    status = kib_fields("/proc/self/status") or {}
    for limit, used, name in ((resource.RLIMIT_AS, "VmSize", "address space"), (resource.RLIMIT_DATA, "VmData", "data size")):
        soft = resource.getrlimit(limit)[0]
        if soft != resource.RLIM_INFINITY and used in status:
            left = soft - status[used]
            limits.append((left, f"this process's {name} limit leaves {gib_text(max(left, 0))}"))
    if not limits:
        return None, "no limit"
    return min(limits)


def _declared_rows(path: str) -> str:
    """The rows a file's header declares, in words, for an error message (empty when unreadable)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_METADATA_JSON_BYTES * 8:
                return ""
            header = json.loads(f.read(n))
        rows = [int(v["shape"][0]) for k, v in header.items() if k.endswith(".rows") and isinstance(v, dict)]
    except (OSError, ValueError, struct.error, KeyError, TypeError, IndexError, RecursionError):
        return ""
    return f"{sum(rows):,} rows in {len(rows)} layer(s), " if rows else ""


def _too_big_to_map(path: str, size: int, why: str) -> TableFileError:
    return TableFileError(f"{path}: the file declares {_declared_rows(path)}{size:,} bytes ({gib_text(size)}), more than can be "
                          f"mapped to read it: {why}. A memory file holds the rows its hashing addresses; this one is "
                          "not a memory saved by this pack, or the machine is too small for it")


class TableFile:
    """A validated, memory-mapped table file. Use as a context manager or call `close()`."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise TableFileError(f"{self.path}: no such table file")
        # The whole file is mapped below: one whose size the machine cannot map is refused first, with the
        # figures (a consistent sparse file may declare terabytes of rows in a few kilobytes on disk).
        size = os.path.getsize(self.path)
        room, why = map_room()
        if room is not None and size > room:
            raise _too_big_to_map(self.path, size, why)
        try:
            self._file = safe_open(self.path, framework="pt", device="cpu")
            self._handle = self._file.__enter__()
        except (SafetensorError, OSError, ValueError) as e:
            raise TableFileError(f"{self.path}: not a readable safetensors file ({e}); truncated or not a table file?") from e
        except (MemoryError, RuntimeError) as e:  # the map itself refused (a limit map_room could not see)
            if isinstance(e, RuntimeError) and "Cannot allocate memory" not in str(e):
                raise
            raise _too_big_to_map(self.path, size, f"mapping it failed ({e})") from e
        try:
            self._validate()
        except BaseException:
            self.close()  # a refused file must not stay mapped
            raise

    def _validate(self) -> None:
        meta = self._handle.metadata() or {}
        if meta.get("engram.format") != FORMAT_NAME:
            raise TableFileError(f"{self.path}: metadata 'engram.format' is {meta.get('engram.format')!r}, expected {FORMAT_NAME!r}")
        if meta.get("engram.format_version") != FORMAT_VERSION:
            raise TableFileError(
                f"{self.path}: metadata 'engram.format_version' is {meta.get('engram.format_version')!r}, this reader knows {FORMAT_VERSION!r}"
            )
        if "engram.geometry" not in meta:
            raise TableFileError(f"{self.path}: metadata 'engram.geometry' is missing")
        geometry = _json_field(self.path, "engram.geometry", meta["engram.geometry"])
        self.hashing = _json_field(self.path, "engram.hashing", meta.get("engram.hashing"))
        self.streams = _json_field(self.path, "engram.streams", meta.get("engram.streams"))
        try:
            self.num_layers = int(geometry["num_layers"])
            self.hidden = int(geometry["hidden"])
            self.rows_per_layer = [int(n) for n in geometry["rows_per_layer"]]
            self.table_dtype = _DTYPES_BY_NAME[geometry["dtype"]]
            self.num_sf_packs = int(geometry["num_sf_packs"])
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise TableFileError(f"{self.path}: metadata 'engram.geometry' is malformed ({str(e)[:200]!r})") from e
        if self.num_layers < 0 or self.hidden < 1:
            raise TableFileError(f"{self.path}: metadata 'engram.geometry' says {self.num_layers} layers of width "
                                 f"{self.hidden}; expected at least 0 layers of width 1 or more")
        if len(self.rows_per_layer) != self.num_layers:
            raise TableFileError(f"{self.path}: geometry lists {len(self.rows_per_layer)} row counts for {self.num_layers} layers")
        fp8 = self.table_dtype == torch.float8_e4m3fn
        if fp8 and self.num_sf_packs != ue8m0.num_sf_packs(self.hidden):
            raise TableFileError(f"{self.path}: num_sf_packs {self.num_sf_packs} does not fit hidden {self.hidden}")
        keys = set(self._handle.keys())
        for layer, rows in enumerate(self.rows_per_layer):
            self._check_key(keys, rows_key(layer), self.table_dtype, [rows, self.hidden])
            if fp8:
                self._check_key(keys, scales_key(layer), torch.int32, [rows, self.num_sf_packs])
        self.metadata = {"hashing": self.hashing, "streams": self.streams, "geometry": geometry}

    def _check_key(self, keys: set[str], key: str, dtype: torch.dtype, shape: list[int]) -> None:
        if key not in keys:
            raise TableFileError(f"{self.path}: key {key!r} is missing")
        sl = self._handle.get_slice(key)
        got_dtype, got_shape = sl.get_dtype(), list(sl.get_shape())
        if got_dtype != _ST_DTYPES[dtype] or got_shape != shape:
            raise TableFileError(f"{self.path}: key {key!r} is {got_dtype} {got_shape}, expected {_ST_DTYPES[dtype]} {shape}")

    def byte_range(self, key: str) -> tuple[int, int]:
        """(first byte, end) of a tensor's data in the file, as absolute file offsets (for memory maps)."""
        if not hasattr(self, "_offsets"):
            with open(self.path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            self._offsets = {k: (8 + n + int(v["data_offsets"][0]), 8 + n + int(v["data_offsets"][1]))
                             for k, v in header.items() if k != "__metadata__"}
        try:
            return self._offsets[key]
        except KeyError:
            raise TableFileError(f"{self.path}: key {key!r} is missing") from None

    def check_geometry(self, rows_per_layer: Sequence[int], hidden: int, table_dtype: torch.dtype, *, allow_fewer_rows: bool = False,
                       rows_needed: Sequence[int] | None = None) -> None:
        """Raise TableFileError unless the file's tables fit the given geometry.

        With `allow_fewer_rows`, a layer of the file may have fewer rows than expected (a table padded to a
        multiple of the rank count); the missing tail reads as zeros. With `rows_needed` (the rows a memory's
        hashing can address, per layer), a layer may have more or fewer rows than expected as long as both
        hold the needed ones: a memory saved at one rank count (its tables padded to a multiple of it) loads
        at any other; the padding rows past the needed ones are never addressed, and are not read.
        """
        rows_per_layer = [int(n) for n in rows_per_layer]
        if table_dtype != self.table_dtype:
            raise TableFileError(f"{self.path}: table dtype is {self.table_dtype}, expected {table_dtype}")
        if hidden != self.hidden:
            raise TableFileError(f"{self.path}: hidden is {self.hidden}, expected {hidden}")
        if len(rows_per_layer) != self.num_layers:
            raise TableFileError(f"{self.path}: {self.num_layers} layers, expected {len(rows_per_layer)}")
        if rows_needed is not None:
            needed = [int(n) for n in rows_needed]
            if len(needed) != self.num_layers:
                raise TableFileError(f"{self.path}: {self.num_layers} layers, the memory addresses {len(needed)}")
            for layer, (have, want, need) in enumerate(zip(self.rows_per_layer, rows_per_layer, needed)):
                if have < need:
                    raise TableFileError(f"{self.path}: key {rows_key(layer)!r} has {have} rows, the memory addresses {need}")
                if want < need:
                    raise ValueError(f"layer {layer}: the tables hold {want} rows, fewer than the {need} the memory addresses")
            return
        for layer, (have, want) in enumerate(zip(self.rows_per_layer, rows_per_layer)):
            if have > want or (have < want and not allow_fewer_rows):
                raise TableFileError(f"{self.path}: key {rows_key(layer)!r} has {have} rows, expected {want}")

    def read_rows(self, layer: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows [start, stop) of a layer (and their scales); rows past the file's end read as zeros."""
        if not 0 <= layer < self.num_layers:
            raise TableFileError(f"{self.path}: layer {layer} out of range (file has {self.num_layers})")
        have = self.rows_per_layer[layer]
        stop_in = max(start, min(stop, have))
        data = torch.zeros((stop - start, self.hidden), dtype=self.table_dtype)
        if stop_in > start:
            data[: stop_in - start] = self._handle.get_slice(rows_key(layer))[start:stop_in]
        sf = None
        if self.table_dtype == torch.float8_e4m3fn:
            _, zero_sf = ue8m0.quantize_rows(torch.zeros((1, self.hidden)))
            sf = zero_sf.expand(stop - start, -1).contiguous()
            if stop_in > start:
                sf[: stop_in - start] = self._handle.get_slice(scales_key(layer))[start:stop_in]
        return data, sf

    def close(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle is not None:
            self._file.__exit__(None, None, None)

    def __enter__(self) -> TableFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_table_file(path: str | os.PathLike) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, dict]:
    """Whole tables (and scales) of a file plus its metadata; for tools and tests (one process reads everything)."""
    with TableFile(path) as f:
        pairs = [f.read_rows(layer, 0, n) for layer, n in enumerate(f.rows_per_layer)]
        scales = [sf for _, sf in pairs] if f.table_dtype == torch.float8_e4m3fn else None
        return [d for d, _ in pairs], scales, f.metadata
