"""Seeded engram tables, seeded lookup indices and the independent per-id gather that the buffer
contract tests check every fetch against. Rank processes spawned by those tests import this module
too: it imports the pack only inside its functions, after the rank has put the pack on sys.path."""

from __future__ import annotations

import torch


def seeded_tables(rows: list[int], hidden: int, fp8: bool, seed: int):
    """Full tables of `rows` rows each: BF16 (scales None), or FP8 e4m3 with their int32 UE8M0 scales."""
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(n, hidden, generator=g) for n in rows]
    if not fp8:
        return [t.bfloat16() for t in full], None
    from fp8_engram.engram import ue8m0

    pairs = [ue8m0.quantize_rows(t) for t in full]
    return [q for q, _ in pairs], [s for _, s in pairs]


def seeded_indices(rows: list[int], entries: int, tokens: int, seed: int) -> torch.Tensor:
    """int32 [layers, tokens, entries] ids over tables of `rows` rows, with invalid ones: negatives,
    ids past the table, and at the corners -1 and the first id past the last table."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(-3, max(rows) + 5, (len(rows), tokens, entries), generator=g, dtype=torch.int32)
    idx[0, 0, 0] = -1
    idx[-1, -1, -1] = rows[-1]
    return idx


def expected_rows(full: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The oracle: row by row from the full (CPU) table, zeros for ids outside it (bytes for FP8)."""
    src = full.view(torch.uint8) if full.dtype == torch.float8_e4m3fn else full
    out = torch.zeros(ids.numel(), src.shape[1], dtype=src.dtype)
    for i, g in enumerate(ids.reshape(-1).tolist()):
        if 0 <= g < src.shape[0]:
            out[i] = src[g]
    return out


def check_fetch(buffer, full: list, sfs: list | None, indices: torch.Tensor, tma: bool, order) -> None:
    """Fetch `indices` from `buffer` and assert every hook (called in `order`) against the oracle:
    data shape, dtype and bytes; for FP8 the scales' dtype, shape, layout (TMA-aligned column-major
    in one [layers, width * aligned tokens] base, or row-major) and values."""
    fp8 = sfs is not None
    layers, tokens, entries = indices.shape
    hidden = full[0].shape[1]
    hooks = buffer.fetch(indices, num_qps=0, use_tma_aligned_col_major_sf=tma)
    assert len(hooks) == layers
    for layer in order:
        result = hooks[layer]()
        data, sf = result if fp8 else (result, None)
        assert data.shape == (tokens, entries * hidden) and data.is_contiguous()
        assert data.dtype == (torch.float8_e4m3fn if fp8 else torch.bfloat16)
        got = data.view(torch.uint8) if fp8 else data
        assert torch.equal(got.reshape(-1, hidden), expected_rows(full[layer], indices[layer])), f"data of layer {layer}"
        if fp8:
            width = entries * sfs[0].shape[1]
            assert sf.dtype == sfs[0].dtype and sf.shape == (tokens, width)
            if tma:
                mn = -(-tokens // 4) * 4
                assert sf.stride() == (1, mn)
                assert sf.storage_offset() == layer * width * mn
                assert tuple(sf._base.shape) == (layers, width * mn)
            else:
                assert sf.stride() == (width, 1)
            expect_sf = expected_rows(sfs[layer], indices[layer]).reshape(tokens, width)
            assert torch.equal(sf.contiguous(), expect_sf), f"scales of layer {layer}"


def nan_rows_copy(path, out) -> None:
    """Write to `out` the table file `path` with every table row's bytes NaN (BF16 0x7FC0, FP8 0x7F): same
    size, same header, so only a check of the rows themselves can tell."""
    import json
    import struct
    from pathlib import Path

    raw = bytearray(Path(path).read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    for key, value in header.items():
        if key.endswith(".rows"):
            start, end = (8 + n + o for o in value["data_offsets"])
            fill = b"\x7f" if value["dtype"] == "F8_E4M3" else b"\xc0\x7f"
            raw[start:end] = fill * ((end - start) // len(fill))
    Path(out).write_bytes(bytes(raw))
