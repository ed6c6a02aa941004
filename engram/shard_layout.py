"""The byte layout of one rank's shard buffer, identical on every rank, so that every row of every rank
is one row of a single view of the shards mapped back to back (what the gathers index)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .allocators import PAGE_SIZE

# Limit of DeepEP's EngramBuffer configuration: scale rows start at a multiple of this.
ROW_ALIGNMENT_BYTES = 64


def align(x: int, alignment: int) -> int:
    return -(-x // alignment) * alignment


@dataclass(frozen=True)
class ShardLayout:
    """Byte layout of one rank's shard buffer (identical on every rank).

    `[table l=0] .. [table l=L-1] [zero row] [scales l=0] .. [scales l=L-1] [zero scale row] [padding]`.
    Table offsets are multiples of `row_bytes` and scale offsets multiples of `sf_row_bytes`, and the
    total is a multiple of both and of the page size: with shards mapped back to back, every row of
    every rank is one row of a single `[rows, row_bytes]` view of the whole range.
    """

    rows_per_layer: tuple[int, ...]
    row_bytes: int
    sf_row_bytes: int
    table_offsets: tuple[int, ...]
    zero_row_offset: int
    sf_offsets: tuple[int, ...]
    zero_sf_offset: int
    num_bytes: int

    @staticmethod
    def build(rows_per_layer: Sequence[int], row_bytes: int, sf_row_bytes: int) -> ShardLayout:
        offset = 0
        table_offsets = []
        for n in rows_per_layer:
            table_offsets.append(offset)
            offset += n * row_bytes
        zero_row_offset = offset
        offset += row_bytes
        sf_offsets = []
        zero_sf_offset = 0
        if sf_row_bytes:
            offset = align(offset, math.lcm(sf_row_bytes, ROW_ALIGNMENT_BYTES))
            for n in rows_per_layer:
                sf_offsets.append(offset)
                offset += n * sf_row_bytes
            zero_sf_offset = offset
            offset += sf_row_bytes
        total = align(offset, math.lcm(row_bytes, sf_row_bytes or 1, PAGE_SIZE))
        return ShardLayout(tuple(rows_per_layer), row_bytes, sf_row_bytes, tuple(table_offsets), zero_row_offset, tuple(sf_offsets), zero_sf_offset, total)
