"""One-pass engram gather: a Triton kernel over a device table of where the ranks' shards lie.

For every requested id `g` of layer `l` (rows per rank `n_l`), the kernel computes the owner
`rank = g // n_l` and the local row `g % n_l`, finds that rank's shard as `anchor + rel[rank]` (the
anchor is one shard, an ordinary tensor argument; `rel` holds each shard's address as this process maps
it, minus the anchor's, in 4-byte words), and copies the row (and, for FP8 tables, its packed scale
factors) straight from the owner's shard into the output: each requested row is read once and written
once. Invalid ids (negative, or past `num_ranks * n_l`) read nothing and write zeros. Scale factors
are written at any (token, column) strides, so the same kernel fills the row-major and the MN-major
TMA-aligned layouts of the fetch contract without a second pass.

Why an anchor and offsets rather than a table of raw addresses cast to pointers: after an int-to-pointer
cast the compiler no longer knows the rows are 16-byte aligned and moves them 4 bytes at a time; offsets
from an aligned tensor, declared multiples of 4 words, compile to 128-bit loads and stores (a test
compiles the kernel for sm_90 and counts them).

The launch reads no device value on the host (no synchronization) and uses fixed shapes, so it can be
captured in a CUDA graph. Ranks on other GPUs work the same way: their shards are mapped into this
process (CUDA IPC with peer access), and the kernel reads them over NVLink/PCIe at those addresses.

On the CPU the kernel runs in Triton's interpreter (`TRITON_INTERPRET=1`, or explicitly, see
`gather_rows(interpret=True)`): the interpreter follows raw addresses, so the same table over CPU
shards exercises exactly the indexing code that runs on the GPU.

This module imports Triton; engram/buffer.py imports it only when a gather uses it.
"""

from __future__ import annotations

import functools
import os

import torch

_TILE_WORDS = 4096  # 4-byte words moved per program and column step
_MAX_BLOCK_C = 512


try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - no Triton here: available() says so, gather_rows raises
    triton = tl = None


def available() -> bool:
    """Whether Triton could be imported (it ships with CUDA builds of torch on Linux)."""
    return tl is not None


if tl is not None:

    def engram_gather_rows(
        ids_ptr,
        ids_layer_stride,
        anchor_ptr,
        rel_ptr,
        meta_ptr,
        out_ptr,
        out_layer_stride,
        sf_out_ptr,
        sf_layer_stride,
        sf_stride_t,
        sf_stride_j,
        num_rows,
        num_ranks,
        entries,
        ROW_WORDS: tl.constexpr,
        SF_WORDS: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_P: tl.constexpr,
        HAS_SF: tl.constexpr,
        EVEN_C: tl.constexpr,
    ):
        # One program: BLOCK_R consecutive requested rows of one layer (program_id(1)).
        layer = tl.program_id(1).to(tl.int64)
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
        in_range = r < num_rows
        g = tl.load(ids_ptr + layer * ids_layer_stride + r, mask=in_range, other=-1).to(tl.int64)
        # meta[l] = (rows per rank, word offset of the layer's table, word offset of its scales)
        n_l = tl.load(meta_ptr + layer * 3)
        table_offset = tl.load(meta_ptr + layer * 3 + 1)
        valid = in_range & (g >= 0) & (g < n_l * num_ranks)
        safe = tl.where(valid, g, 0)
        rank = safe // n_l
        local = safe - rank * n_l
        # Shard of `rank` = anchor + rel[rank] words (plain address arithmetic: the shards are separate
        # mappings, the anchor is one of them). Addresses are 16-byte aligned and rows are multiples of
        # 16 words, so every row starts 16-byte aligned: said to the compiler for 128-bit accesses.
        rel = tl.load(rel_ptr + rank, mask=valid, other=0)
        src = anchor_ptr + tl.multiple_of(rel + table_offset + local * ROW_WORDS, 4)
        dst = out_ptr + layer * out_layer_stride + r * ROW_WORDS
        load_mask = valid[:, None]
        store_mask = in_range[:, None]
        for c in tl.static_range(0, ROW_WORDS, BLOCK_C):
            cols = c + tl.arange(0, BLOCK_C)
            if EVEN_C:  # the steps tile the row: masks constant along it, so accesses stay vectorized
                words = tl.load(src[:, None] + cols[None, :], mask=load_mask, other=0)
                tl.store(dst[:, None] + cols[None, :], words, mask=store_mask)
            else:
                col_ok = (cols < ROW_WORDS)[None, :]
                words = tl.load(src[:, None] + cols[None, :], mask=load_mask & col_ok, other=0)
                tl.store(dst[:, None] + cols[None, :], words, mask=store_mask & col_ok)
        if HAS_SF:
            sf_offset = tl.load(meta_ptr + layer * 3 + 2)
            packs = tl.arange(0, BLOCK_P)
            pack_ok = (packs < SF_WORDS)[None, :]
            sf_word = rel + sf_offset + local * SF_WORDS
            if SF_WORDS % 4 == 0:
                sf_word = tl.multiple_of(sf_word, 4)
            sf_src = anchor_ptr + sf_word
            sf = tl.load(sf_src[:, None] + packs[None, :], mask=load_mask & pack_ok, other=0)
            # Requested row r is (token t, entry e) = divmod(r, entries); its packs are columns
            # e * SF_WORDS + p of token t in the [tokens, entries * SF_WORDS] scale view.
            t = r // entries
            column = (r - t * entries) * SF_WORDS
            sf_dst = sf_out_ptr + layer * sf_layer_stride + t[:, None] * sf_stride_t + (column[:, None] + packs[None, :]) * sf_stride_j
            tl.store(sf_dst, sf, mask=store_mask & pack_ok)


@functools.cache
def _compiled():
    if triton is None:
        raise RuntimeError("the one-pass engram gather needs Triton, which is not installed")
    # Interpreted when TRITON_INTERPRET=1 was set before this first use (Triton reads it here).
    return triton.jit(engram_gather_rows)


@functools.cache
def _interpreted():
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(engram_gather_rows)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def block_sizes(row_words: int, sf_words: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, BLOCK_P) for rows of `row_words` 4-byte words and `sf_words` scale packs.

    Column steps tile the row exactly when its largest power-of-two divisor is big enough (rows are
    multiples of 16 words), else the last step is masked; about `_TILE_WORDS` words move per step.
    """
    low = row_words & -row_words
    block_c = min(_MAX_BLOCK_C, low) if low >= 128 else min(_MAX_BLOCK_C, _next_pow2(row_words))
    block_r = max(1, _TILE_WORDS // block_c)
    return block_r, block_c, _next_pow2(max(1, sf_words))


def shard_table(addresses: list[int], anchor_address: int) -> list[int]:
    """`rel` for `gather_rows`: each shard address minus the anchor's, in 4-byte words (all 16-byte aligned)."""
    bad = [hex(a) for a in [*addresses, anchor_address] if a % 16]
    if bad:
        raise ValueError(f"the one-pass gather needs 16-byte aligned shards, got addresses {bad}")
    return [(a - anchor_address) // 4 for a in addresses]


def gather_rows(
    ids: torch.Tensor,
    anchor: torch.Tensor,
    rel: torch.Tensor,
    meta: torch.Tensor,
    out: torch.Tensor,
    sf_out: torch.Tensor | None,
    *,
    num_ranks: int,
    row_words: int,
    sf_words: int,
    entries: int,
    sf_layer_stride: int = 0,
    sf_stride_t: int = 0,
    sf_stride_j: int = 0,
    interpret: bool | None = None,
) -> None:
    """Launch the gather over `layers = ids.shape[0]` layers.

    * `ids`: int32/int64 `[layers, rows]` contiguous, global row ids of each layer.
    * `anchor`: an int32 tensor whose data pointer is the origin of `rel` (one of the shards).
    * `rel`: int64 `[num_ranks]`, on `out.device`: each shard's base address (as mapped in this process)
      minus the anchor's, in 4-byte words. See `shard_table`. Shards must be 16-byte aligned.
    * `meta`: int64 `[layers, 3]` contiguous: rows per rank, table word offset, scale word offset.
    * `out`: int32 `[layers, rows, row_words]` contiguous (row `i` of layer `l` gets id `ids[l, i]`).
    * `sf_out`: int32 tensor whose storage holds the scale layout (only its data pointer is used):
      pack `p` of requested row `i = t * entries + e` of layer `l` goes to element
      `l * sf_layer_stride + t * sf_stride_t + (e * sf_words + p) * sf_stride_j`; None for BF16.
    * `interpret`: run in Triton's interpreter (default: when the tensors are on the CPU).
    """
    layers, rows = ids.shape
    if rows == 0 or layers == 0:
        return
    if out.dtype != torch.int32 or not out.is_contiguous() or out.numel() != layers * rows * row_words:
        raise ValueError(f"out must be a contiguous int32 [{layers}, {rows}, {row_words}] tensor, got {out.dtype} {tuple(out.shape)}")
    if not ids.is_contiguous() or meta.dtype != torch.int64 or rel.dtype != torch.int64 or tuple(meta.shape) != (layers, 3) or anchor.dtype != torch.int32:
        raise ValueError("ids must be contiguous, anchor an int32 tensor, rel int64 [ranks] and meta int64 [layers, 3]")
    has_sf = sf_out is not None
    if has_sf and sf_out.dtype != torch.int32:
        raise ValueError(f"sf_out must be an int32 view, got {sf_out.dtype}")
    block_r, block_c, block_p = block_sizes(row_words, sf_words)
    if interpret is None:
        interpret = out.device.type == "cpu"
    if interpret and os.environ.get("TRITON_INTERPRET") != "1":
        kernel = _interpreted()
    else:
        kernel = _compiled()
    grid = ((rows + block_r - 1) // block_r, layers)
    launch_kwargs = {} if interpret else {"num_warps": 8}
    kernel[grid](
        ids,
        ids.stride(0),
        anchor,
        rel,
        meta,
        out,
        rows * row_words,
        sf_out if has_sf else out,
        sf_layer_stride,
        sf_stride_t,
        sf_stride_j,
        rows,
        num_ranks,
        entries,
        ROW_WORDS=row_words,
        SF_WORDS=max(1, sf_words),
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        BLOCK_P=block_p,
        HAS_SF=has_sf,
        EVEN_C=row_words % block_c == 0,
        **launch_kwargs,
    )
