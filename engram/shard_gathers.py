"""The gathers of LocalEngramBuffer off its Triton kernel: fill `out[i]` (uint8 [n, row_bytes]) with global
row `ids[i]` of a layer from its owner's shard, zeros where the id is invalid; scale rows alike.

"unified" (every shard mapped into one range: one select, of one layer or of every layer at once),
"grouped" (CPU shards in separate mappings: one select per peer over only its ids) and "fixed_shape"
(CUDA without Triton: fixed-shape device ops only). `ShardGathers` is a mixin of LocalEngramBuffer and
reads the views and geometry its setup makes (`_all_rows`, `_peer_rows`, `_seg_rows`, `_zero_row`, ...).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ShardGathers:
    def _route(self, layer: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Global ids -> (valid, owner rank, local row); invalid entries get owner 0 and row 0."""
        n = self.num_entries_per_layer[layer]
        ids = ids.to(torch.int64)
        valid = (ids >= 0) & (ids < self.num_ranks * n)
        safe = torch.where(valid, ids, 0)
        if self.num_ranks == 1:
            return valid, torch.zeros_like(safe), safe
        owner = torch.div(safe, n, rounding_mode="floor")
        return valid, owner, safe - owner * n

    def _gather(self, layer: int, ids: torch.Tensor, out_rows: torch.Tensor, sf_rows: torch.Tensor | None) -> None:
        if self.gather_mode == "unified":
            self._gather_unified(layer, ids, out_rows, sf_rows)
        elif self.gather_mode == "fixed_shape":
            self._gather_fixed_shape(layer, ids, out_rows, sf_rows)
        else:
            self._gather_grouped(layer, ids, out_rows, sf_rows)

    def _gather_unified(self, layer: int | None, ids: torch.Tensor, out_rows: torch.Tensor, sf_rows: torch.Tensor | None) -> None:
        # Row r of rank p's shard is row p * seg_rows + offset + r of the single view over all shards.
        # `layer` None: ids [layers, n] of every layer, gathered by one select (the offsets broadcast).
        if layer is None:
            n, base, sf_base = self._layer_geometry()
        else:
            n = self.num_entries_per_layer[layer]
            base = self.layout.table_offsets[layer] // self.layout.row_bytes
            sf_base = self.layout.sf_offsets[layer] // self.layout.sf_row_bytes if sf_rows is not None else 0
        # int32 arithmetic when every row number fits (it does for any table that fits in memory):
        # no widening pass, half the index traffic; wrapped values of invalid ids are masked below.
        ids = ids.to(self._index_dtype)
        valid = (ids >= 0) & (ids < self.num_ranks * n)
        owner = torch.div(ids, n, rounding_mode="floor") if self.num_ranks > 1 else None

        def select(view, seg, first, zero, out):  # table rows, then scale rows: same arithmetic, own geometry
            rows = ids + first if owner is None else (owner * (seg - n)).add_(ids).add_(first)
            torch.index_select(view, 0, torch.where(valid, rows, zero).reshape(-1), out=out.view(-1, view.shape[1]))

        select(self._all_rows, self._seg_rows, base, self._zero_row, out_rows.view(self._table_word))
        if sf_rows is not None:
            select(self._all_sfs, self._seg_sf_rows, sf_base, self._zero_sf_row, sf_rows.view(self._sf_word))

    def _layer_geometry(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per layer [layers, 1]: rows per rank, first table row and first scale row in the unified view."""
        if self._geometry is None:
            sf_offsets = self.layout.sf_offsets if self.use_fp8 else (0,) * self.num_layers
            columns = [self.num_entries_per_layer, [o // self.layout.row_bytes for o in self.layout.table_offsets],
                       [o // (self.layout.sf_row_bytes or 1) for o in sf_offsets]]
            self._geometry = tuple(torch.tensor(c, dtype=self._index_dtype).view(-1, 1) for c in columns)
        return self._geometry

    def _gather_grouped(self, layer: int, ids: torch.Tensor, out_rows: torch.Tensor, sf_rows: torch.Tensor | None) -> None:
        # Host-synchronous (CPU only): select each peer's rows once, scatter them to their positions.
        valid, owner, local = self._route(layer, ids)
        out_rows[~valid] = 0
        if sf_rows is not None:
            sf_rows[~valid] = 0
        for peer in range(self.num_ranks):
            positions = torch.nonzero(valid & (owner == peer)).squeeze(1)
            if positions.numel() == 0:
                continue
            rows = local.index_select(0, positions)
            out_rows.index_copy_(0, positions, self._tables[peer][layer].index_select(0, rows))
            if sf_rows is not None:
                sf_rows.index_copy_(0, positions, self._sfs[peer][layer].index_select(0, rows))

    def _gather_fixed_shape(self, layer: int, ids: torch.Tensor, out_rows: torch.Tensor, sf_rows: torch.Tensor | None) -> None:
        # CUDA without one address space: fixed shapes only (no host sync, graph-capturable).
        n = self.num_entries_per_layer[layer]
        ids = ids.to(torch.int64)
        valid = (ids >= 0) & (ids < self.num_ranks * n)
        safe = torch.where(valid, ids, 0)
        owner = torch.div(safe, n, rounding_mode="floor")
        local = safe - owner * n
        k = ids.numel()
        # Position of id i in the stack: its owner's slice (invalid ids: rank 0's slice, which holds the zero row there).
        pick = torch.arange(k, device=ids.device).add_(owner * k)
        base = self.layout.table_offsets[layer] // self.layout.row_bytes
        self._stacked_gather(self._peer_rows, local + base, valid, owner, self._table_zero_row, pick, out_rows.view(self._table_word))
        if sf_rows is not None:
            sf_base = self.layout.sf_offsets[layer] // self.layout.sf_row_bytes
            self._stacked_gather(self._peer_sf_rows, local + sf_base, valid, owner, self._sf_zero_row, pick, sf_rows.view(self._sf_word))

    @staticmethod
    def _stacked_gather(
        views: Sequence[torch.Tensor], rows: torch.Tensor, valid: torch.Tensor, owner: torch.Tensor, zero_row: int, pick: torch.Tensor, out: torch.Tensor
    ) -> None:
        """out[i] = views[owner[i]][rows[i]] if valid[i] else views[0][zero_row], with fixed shapes only."""
        k, width = out.shape
        stack = torch.empty((len(views), k, width), dtype=out.dtype, device=out.device)
        for peer, view in enumerate(views):
            mine = valid & (owner == peer)
            torch.index_select(view, 0, torch.where(mine, rows, zero_row), out=stack[peer])
        torch.index_select(stack.view(len(views) * k, width), 0, pick, out=out)
