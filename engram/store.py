"""`LocalRowStore`: the engram tables in one process, as plain tensors (the one-rank `RowStore`).

The protocol and the rules every store shares are rows.py's (re-exported here); `EngramGroup`
(group.py) and `HostRowStore` (host_tier.py) implement the same protocol over worker processes and a
host-memory tier.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from . import ue8m0
from .rows import RowStore, decode_rows  # noqa: F401 - re-exported: the protocol and row format callers of store.py use
from .rows import check_fetch_indices, check_layer, check_rows, check_table_geometry, check_values, decode_checked, encode_rows, last_occurrence
from .table_file import TableFile, write_table_file


def _select(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """index_select that also works for FP8 tables on the CPU (through a byte view)."""
    return table.view(torch.uint8).index_select(0, rows).view(table.dtype)


class LocalRowStore:
    """Engram tables in one process, as plain tensors (the one-rank `RowStore`).

    `tables[l]` is `[rows_per_layer[l], hidden]` in `table_dtype`; for FP8, `scales[l]` is int32
    `[rows_per_layer[l], num_sf_packs]` (UE8M0, blocks of 128). Tables start at zero (FP8 zero rows carry
    the smallest scale, so they decode to exact zeros).
    """

    def __init__(
        self,
        rows_per_layer: Sequence[int],
        hidden: int,
        table_dtype: torch.dtype = torch.bfloat16,
        *,
        device: torch.device | str = "cpu",
    ) -> None:
        self.rows_per_layer = check_table_geometry(rows_per_layer, hidden, table_dtype)
        self.num_layers = len(self.rows_per_layer)
        self.hidden = hidden
        self.table_dtype = table_dtype
        self.device = torch.device(device)
        self.num_sf_packs = ue8m0.num_sf_packs(hidden) if table_dtype == torch.float8_e4m3fn else 0
        self.tables: list[torch.Tensor] = [
            torch.zeros((n, hidden), dtype=table_dtype, device=self.device) for n in self.rows_per_layer
        ]
        self.scales: list[torch.Tensor] | None = None
        if table_dtype == torch.float8_e4m3fn:
            _, zero_sf = ue8m0.quantize_rows(torch.zeros((1, hidden)))
            self.scales = [zero_sf.to(self.device).expand(n, -1).contiguous() for n in self.rows_per_layer]
        self.source: str | None = None  # the table file last loaded (named when its rows are not finite)
        # where the rows live and why (a placement.Placement), set by placement.make_store; None when made directly
        self.placement = None
        self._closed = False

    def __repr__(self) -> str:
        return f"LocalRowStore(rows_per_layer={self.rows_per_layer}, hidden={self.hidden}, table_dtype={self.table_dtype})"

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LocalRowStore is closed")

    # ----- RowStore -----

    def fetch_rows(self, indices: torch.Tensor) -> list[torch.Tensor]:
        self._check_open()
        check_fetch_indices(indices, self.num_layers)
        _, tokens, entries = indices.shape
        out = []
        for layer, num_rows in enumerate(self.rows_per_layer):
            ids = indices[layer].reshape(-1).to(device=self.device, dtype=torch.int64)
            valid = (ids >= 0) & (ids < num_rows)
            safe = torch.where(valid, ids, 0)
            sf = self.scales[layer].index_select(0, safe) if self.scales is not None else None
            rows = decode_checked(_select(self.tables[layer], safe), sf, ids, layer, self.source)
            rows = rows.masked_fill_(~valid.unsqueeze(1), 0.0)
            out.append(rows.view(tokens, entries, self.hidden))
        return out

    def read_rows(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        self._check_open()
        layer = check_layer(layer, self.num_layers)
        rows = check_rows(rows, self.rows_per_layer[layer], layer).to(self.device)
        sf = self.scales[layer].index_select(0, rows) if self.scales is not None else None
        return decode_checked(_select(self.tables[layer], rows), sf, rows, layer, self.source)

    def write_rows(self, layer: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        self._check_open()
        layer = check_layer(layer, self.num_layers)
        rows = check_rows(rows, self.rows_per_layer[layer], layer).to(self.device)
        values = check_values(values, rows.numel(), self.hidden, layer).to(self.device)
        rows, values = last_occurrence(rows, values)
        data, sf = encode_rows(values, self.table_dtype)
        # FP8 kernels are missing on the CPU for index ops: move the bytes.
        self.tables[layer].view(torch.uint8).index_copy_(0, rows, data.view(torch.uint8))
        if self.scales is not None:
            self.scales[layer].index_copy_(0, rows, sf)

    def close(self) -> None:
        self._closed = True
        self.tables = []
        self.scales = None

    def __enter__(self) -> LocalRowStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- table files -----

    def save_table_file(self, path: str, *, hashing: Any = None, streams: Any = None) -> None:
        """Write the tables to a safetensors table file (see table_file.py); `hashing`/`streams` are opaque JSON."""
        self._check_open()
        write_table_file(path, self.tables, self.scales, hashing=hashing, streams=streams)

    def load_table_file(self, path: str, *, rows_needed: Sequence[int] | None = None) -> dict:
        """Replace the tables with a table file's (same geometry and dtype; with `rows_needed`, any row count
        holding those: see TableFile.check_geometry); returns the file's metadata."""
        self._check_open()
        with TableFile(path) as f:
            f.check_geometry(self.rows_per_layer, self.hidden, self.table_dtype, rows_needed=rows_needed)
            for layer in range(self.num_layers):
                data, sf = f.read_rows(layer, 0, self.rows_per_layer[layer])
                self.tables[layer].copy_(data)
                if self.scales is not None:
                    self.scales[layer].copy_(sf)
            self.source = os.path.abspath(path)
            return f.metadata

    @classmethod
    def from_table_file(cls, path: str, *, device: torch.device | str = "cpu") -> LocalRowStore:
        """A store with a table file's geometry and contents."""
        with TableFile(path) as f:
            geometry = (f.rows_per_layer, f.hidden, f.table_dtype)
        store = cls(*geometry, device=device)
        store.load_table_file(path)
        return store
