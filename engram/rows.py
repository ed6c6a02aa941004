"""Engram rows: what every row store shares, below the table file and the stores.

`RowStore` is the protocol the memory needs from its (possibly sharded) tables; the rest are the rules
every implementation applies: geometry, index and value checks, the DeepEP buffer contract's checks,
and the storage format of a row. Tables are `num_layers` tables of `rows_per_layer[l]` rows of `hidden`
values each, stored as BF16 or as FP8 E4M3 with packed UE8M0 int32 scales per block of 128 values (see
ue8m0.py). Every read returns float32; FP8 rows are dequantized with their scales. Every write of FP8
rows requantizes exactly the written rows with fresh scales.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from . import ue8m0
from .errors import TableFileError

TABLE_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


@runtime_checkable
class RowStore(Protocol):
    """Sharded or local engram tables, addressed by global row ids."""

    num_layers: int
    hidden: int
    rows_per_layer: list[int]
    table_dtype: torch.dtype

    def fetch_rows(self, indices: torch.Tensor) -> list[torch.Tensor]:
        """int32 [layers, tokens, entries] -> per layer float32 [tokens, entries, hidden]; ids < 0 or >= rows give zero rows."""

    def read_rows(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """int64 [k] -> float32 [k, hidden] (every id must be valid)."""

    def write_rows(self, layer: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Write float [k, hidden] into rows int64 [k] (every id valid; a repeated id keeps its last value)."""

    def close(self) -> None:
        """Release the tables (and processes, for a group). Idempotent."""


# ----- validation shared by every RowStore implementation -----


def check_table_geometry(rows_per_layer: Sequence[int], hidden: int, table_dtype: torch.dtype) -> list[int]:
    if table_dtype not in TABLE_DTYPES:
        raise ValueError(f"table_dtype must be torch.bfloat16 or torch.float8_e4m3fn, got {table_dtype}")
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden <= 0:
        raise ValueError(f"hidden must be a positive int, got {hidden!r}")
    rows = [int(n) for n in rows_per_layer]
    if not rows or any(n <= 0 for n in rows):
        raise ValueError(f"rows_per_layer must be a non-empty list of positive ints, got {list(rows_per_layer)!r}")
    return rows


def check_fetch_indices(indices: torch.Tensor, num_layers: int) -> None:
    if not isinstance(indices, torch.Tensor) or indices.dim() != 3:
        shape = tuple(indices.shape) if isinstance(indices, torch.Tensor) else type(indices).__name__
        raise ValueError(f"indices must be an int32 tensor [layers, tokens, entries], got {shape}")
    if indices.dtype != torch.int32:
        raise ValueError(f"indices must be int32, got {indices.dtype}")
    if indices.shape[0] != num_layers:
        raise ValueError(f"indices cover {indices.shape[0]} layers, the tables have {num_layers}")


def check_buffer_storages(storages: Sequence[torch.Tensor], rows_per_layer: Sequence[int], hidden: int, dtype: torch.dtype) -> None:
    """The EngramBuffer `write()` contract for the table storages: one contiguous `[rows, hidden]` tensor of `dtype` per layer."""
    if len(storages) != len(rows_per_layer):
        raise ValueError(f"expected {len(rows_per_layer)} storages (one per layer), got {len(storages)}")
    for layer, storage in enumerate(storages):
        n = rows_per_layer[layer]
        if tuple(storage.shape) != (n, hidden):
            raise ValueError(f"layer {layer}: storage shape {tuple(storage.shape)} != {(n, hidden)}")
        if storage.dtype != dtype or not storage.is_contiguous():
            raise ValueError(f"layer {layer}: storage must be a contiguous {dtype} tensor, got {storage.dtype} (contiguous={storage.is_contiguous()})")


def check_buffer_indices(indices: torch.Tensor, num_layers: int, entries_per_token: int, max_tokens: int,
                         device: torch.device | None = None) -> tuple[int, int, int]:
    """The EngramBuffer `fetch()` contract for `indices`: contiguous int32 `[layers, tokens, entries]` with
    at most `max_tokens` tokens (and on `device`'s type, when given); returns its shape."""
    if not isinstance(indices, torch.Tensor) or indices.dim() != 3 or indices.dtype != torch.int32 or not indices.is_contiguous():
        raise ValueError(
            f"indices must be a contiguous int32 [layers, tokens, entries] tensor, got {getattr(indices, 'dtype', type(indices).__name__)} "
            f"{tuple(getattr(indices, 'shape', ()))}"
        )
    if device is not None and indices.device.type != device.type:
        raise ValueError(f"indices are on {indices.device}, the buffer on {device}")
    layers, tokens, entries = indices.shape
    if layers != num_layers or entries != entries_per_token:
        raise ValueError(f"indices shape {tuple(indices.shape)} does not match {num_layers} layers x {entries_per_token} entries per token")
    if tokens > max_tokens:
        raise ValueError(f"num_tokens={tokens} exceeds num_max_tokens={max_tokens}")
    return layers, tokens, entries


def check_layer(layer: int, num_layers: int) -> int:
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
        raise IndexError(f"layer must be an int in [0, {num_layers}), got {layer!r}")
    return layer


def check_rows(rows: torch.Tensor, num_rows: int, layer: int) -> torch.Tensor:
    """Validate global row ids of one layer; returns them as a flat int64 tensor."""
    if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.is_floating_point() or rows.is_complex() or rows.dtype == torch.bool:
        raise ValueError(f"rows must be a 1-D integer tensor, got {getattr(rows, 'dtype', type(rows).__name__)} {tuple(getattr(rows, 'shape', ()))}")
    rows = rows.to(torch.int64)
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= num_rows):
        raise IndexError(f"layer {layer}: row ids must lie in [0, {num_rows}), got min {int(rows.min())} max {int(rows.max())}")
    return rows


def check_values(values: torch.Tensor, k: int, hidden: int, layer: int) -> torch.Tensor:
    if not isinstance(values, torch.Tensor) or not values.is_floating_point():
        raise ValueError(f"layer {layer}: values must be a floating-point tensor, got {getattr(values, 'dtype', type(values).__name__)}")
    if tuple(values.shape) != (k, hidden):
        raise ValueError(f"layer {layer}: values must have shape {(k, hidden)}, got {tuple(values.shape)}")
    if not bool(torch.isfinite(values).all()):
        raise ValueError(f"layer {layer}: values hold inf or NaN")
    return values


def check_rows_finite(rows: torch.Tensor, ids: torch.Tensor, layer: int, source: str | None) -> torch.Tensor:
    """Raise, naming the table file (`source`), when decoded rows `[k, hidden]` (or `[..., hidden]`) of a
    layer hold NaN or inf; returns `rows`. Rows are written finite (check_values), so such a value comes
    from a file: damaged, or overwritten in place after it was loaded or mapped. One sum over what a
    fetch returns (a prompt's few rows) decides in the usual case; only a non-finite sum looks closer
    (finite rows whose sum overflows pass)."""
    if rows.numel() == 0 or bool(torch.isfinite(rows.sum())):
        return rows
    bad = ~torch.isfinite(rows.reshape(-1, rows.shape[-1])).all(dim=1)
    if not bool(bad.any()):
        return rows
    bad_ids = ids.reshape(-1)[bad.to(ids.device)][:5].tolist() if ids.numel() == bad.numel() else []
    rows_text = f" (row ids {', '.join(map(str, bad_ids))}{', ...' if int(bad.sum()) > len(bad_ids) else ''})" if bad_ids else ""
    what = (f"{int(bad.sum())} of the {bad.numel()} rows of layer {layer} this lookup fetched{rows_text} hold NaN or "
            "infinite values")
    if source is None:
        raise ValueError(f"the engram memory's tables: {what}")
    raise TableFileError(f"{source}: {what}: the memory file is damaged, or was overwritten after it was loaded. "
                         "Load a good copy of the memory (or save it again from one); a changed file is reloaded on the "
                         "next prompt only when its modification time changed")


def decode_checked(data: torch.Tensor, sf: torch.Tensor | None, ids: torch.Tensor, layer: int, source: str | None) -> torch.Tensor:
    """`decode_rows` of fetched rows, refused by `check_rows_finite` when they hold NaN or inf (BF16 rows
    are checked as stored, half the bytes of the float32 they decode to; FP8 rows with their scales)."""
    if sf is None:
        check_rows_finite(data, ids, layer, source)
        return decode_rows(data, sf)
    return check_rows_finite(decode_rows(data, sf), ids, layer, source)


def last_occurrence(rows: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop repeated row ids, keeping the last value written for each (deterministic scatter)."""
    unique, inverse = torch.unique(rows, return_inverse=True)
    if unique.numel() == rows.numel():
        return rows, values
    position = torch.arange(rows.numel(), device=rows.device)
    last = torch.full((unique.numel(),), -1, dtype=torch.int64, device=rows.device)
    last.scatter_reduce_(0, inverse, position, reduce="amax")
    return unique, values.index_select(0, last)


def encode_rows(values: torch.Tensor, table_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float [k, hidden] -> (table rows, packed scales or None) in the storage format of `table_dtype`."""
    if table_dtype == torch.float8_e4m3fn:
        return ue8m0.quantize_rows(values)
    return values.to(torch.bfloat16).contiguous(), None


def decode_rows(data: torch.Tensor, sf: torch.Tensor | None) -> torch.Tensor:
    """Stored rows (BF16, or FP8 with packed scales) -> float32."""
    if data.dtype == torch.float8_e4m3fn:
        return ue8m0.dequantize_rows(data, sf)
    return data.float()


def make_hook(result: object, event: Any = None, device: torch.device | None = None) -> Callable[[], object]:
    """A fetch's hook (the EngramBuffer contract: one per layer): returns the layer's result; with a CUDA
    `event`, the calling stream first waits for the copy that fills it."""

    def hook() -> object:
        if event is not None:
            torch.cuda.current_stream(device).wait_event(event)
        return result

    return hook


def table_bytes(rows_per_layer: Sequence[int], hidden: int, table_dtype: torch.dtype) -> int:
    """Bytes of a memory's rows and scales."""
    packs = ue8m0.num_sf_packs(hidden) if table_dtype == torch.float8_e4m3fn else 0
    return sum(int(n) for n in rows_per_layer) * (hidden * table_dtype.itemsize + packs * 4)


def word_dtype(*sizes: int) -> torch.dtype:
    """Widest integer type dividing every size (row widths, byte offsets), so that gathers and copies move
    words rather than bytes; uint8 when none does."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        if all(s % dtype.itemsize == 0 for s in sizes):
            return dtype
    return torch.uint8
