"""The host tier (engram/host_tier.py) keeps the LocalEngramBuffer contract: BF16 and FP8 + UE8M0
tables, both scale layouts, zero rows and zero scales for invalid ids, checked against an independent
per-id gather from the full tables. Tables come both ways: written into a shared-memory segment with
`write()`, and memory-mapped from a table file. Also: a HostRowStore returns what a LocalRowStore
returns, and writes to a mapped file stay in the process (the file is unchanged until saved)."""

from __future__ import annotations

import os

import pytest
import torch

from fp8_engram.engram import ue8m0
from fp8_engram.engram.host_tier import HostEngramBuffer, HostRowStore, HostTable
from fp8_engram.engram.placement import choose_placement
from fp8_engram.engram.store import LocalRowStore
from fp8_engram.engram.table_file import write_table_file
from helpers.engram_tables import check_fetch, seeded_indices, seeded_tables

pytestmark = pytest.mark.unit

HIDDEN = 256
ROWS = [40, 24]
ENTRIES = 3


def _tables(fp8: bool, sf_dtype: torch.dtype = torch.int32):
    full, sfs = seeded_tables(ROWS, HIDDEN, fp8, seed=1234)
    return full, None if sfs is None else [s.view(sf_dtype) for s in sfs]


def _check_fetch(buffer, full, sfs, fp8: bool, tokens: int, tma: bool, order) -> None:
    indices = seeded_indices(ROWS, ENTRIES, tokens, seed=tokens * 7 + int(tma))
    check_fetch(buffer, full, sfs if fp8 else None, indices, tma, order)


def _buffer(kind: str, fp8: bool, sf_dtype, tmp_path) -> tuple[HostEngramBuffer, list, list | None]:
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    packs = ue8m0.num_sf_packs(HIDDEN) if fp8 else 0
    full, sfs = _tables(fp8, sf_dtype)
    if kind == "segment":
        buffer = HostEngramBuffer(ROWS, HIDDEN, 64, ENTRIES, dtype, packs)
        buffer.write(full, sfs)
    else:
        path = tmp_path / "table.safetensors"
        write_table_file(path, full, [s.view(torch.int32) for s in sfs] if fp8 else None)
        table = HostTable.map_file(path)
        table.sf_dtype = sf_dtype  # the file stores int32 words; the buffer hands out the written dtype
        buffer = HostEngramBuffer(ROWS, HIDDEN, 64, ENTRIES, dtype, packs, table=table)
    return buffer, full, sfs


@pytest.mark.parametrize("kind", ["segment", "file"])
@pytest.mark.parametrize("fp8,sf_dtype", [(False, None), (True, torch.int32), (True, torch.float32)])
def test_host_fetch_matches_independent_gather(kind, fp8, sf_dtype, tmp_path):
    buffer, full, sfs = _buffer(kind, fp8, sf_dtype, tmp_path)
    for tokens in (1, 5, 7, 64):
        for tma in (True, False):
            _check_fetch(buffer, full, sfs, fp8, tokens, tma, order=[1, 0] if tokens % 2 else [0, 1])


def test_host_buffer_refuses_bad_input(tmp_path):
    buffer, full, sfs = _buffer("segment", True, torch.int32, tmp_path)
    bad_writes = {
        "layers": lambda: buffer.write(full[:1], sfs),
        "shape": lambda: buffer.write([m[:-1] for m in full], sfs),
        "dtype": lambda: buffer.write([m.view(torch.uint8) for m in full], sfs),
        "missing_sf": lambda: buffer.write(full),
        "sf_rows": lambda: buffer.write(full, [s[:3] for s in sfs]),
    }
    for name, call in bad_writes.items():
        with pytest.raises(ValueError):
            call()
    for idx in (torch.zeros(2, 1, ENTRIES, dtype=torch.int64), torch.zeros(2, 1, ENTRIES + 1, dtype=torch.int32),
                torch.zeros(2, 65, ENTRIES, dtype=torch.int32), torch.zeros(3, 1, ENTRIES, dtype=torch.int32)):
        with pytest.raises(ValueError):
            buffer.fetch(idx)
    # Nothing was written by the refused calls.
    _check_fetch(buffer, full, sfs, True, 5, True, [0, 1])
    buffer.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        buffer.fetch(torch.zeros(2, 1, ENTRIES, dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_host_row_store_reads_like_a_local_store(dtype, tmp_path):
    local = LocalRowStore(ROWS, HIDDEN, dtype)
    g = torch.Generator().manual_seed(5)
    for layer, n in enumerate(ROWS):
        local.write_rows(layer, torch.arange(0, n, 2), torch.randn(-(-n // 2), HIDDEN, generator=g))
    path = str(tmp_path / "t.safetensors")
    local.save_table_file(path, hashing={"h": 1}, streams=None)
    host = HostRowStore.from_table_file(path)
    empty = HostRowStore.new(ROWS, HIDDEN, dtype)
    indices = torch.randint(-2, max(ROWS) + 3, (len(ROWS), 9, ENTRIES), generator=g, dtype=torch.int32)
    for a, b in zip(local.fetch_rows(indices), host.fetch_rows(indices)):
        assert torch.equal(a, b)
    for a, b in zip(LocalRowStore(ROWS, HIDDEN, dtype).fetch_rows(indices), empty.fetch_rows(indices)):
        assert torch.equal(a, b)  # a new segment reads as zeros (FP8: with the zero rows' scales)
    before = open(path, "rb").read()
    values = torch.randn(3, HIDDEN, generator=g)
    for store in (local, host, empty):
        store.write_rows(1, torch.tensor([0, 5, 0]), values)
        assert torch.equal(store.read_rows(1, torch.tensor([5, 0])), local.read_rows(1, torch.tensor([5, 0])))
    assert open(path, "rb").read() == before, "a write to a mapped table changed the file"
    saved = str(tmp_path / "saved.safetensors")
    host.save_table_file(saved)
    for a, b in zip(local.fetch_rows(indices), HostRowStore.from_table_file(saved).fetch_rows(indices)):
        assert torch.equal(a, b)
    host.load_table_file(path)  # back to the file's rows
    assert not torch.equal(host.read_rows(1, torch.tensor([5])), local.read_rows(1, torch.tensor([5])))
    host.close()
    with pytest.raises(RuntimeError, match="closed"):
        host.fetch_rows(indices)


def test_placement_auto_takes_the_device_when_it_fits():
    assert choose_placement("auto", 10, 100) == "device"
    assert choose_placement("auto", 60, 100) == "host"
    assert choose_placement("auto", 60, None) == "device"
    assert choose_placement("host", 1, 100) == "host" and choose_placement("device", 99, 1) == "device"
    with pytest.raises(ValueError, match="placement"):
        choose_placement("gpu", 1, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the host tier copies fetched rows to it)")
@pytest.mark.parametrize("fp8", [False, True])
def test_host_fetch_to_cuda_matches_independent_gather(fp8, tmp_path):
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    full, sfs = _tables(fp8)
    buffer = HostEngramBuffer(ROWS, HIDDEN, 64, ENTRIES, dtype, ue8m0.num_sf_packs(HIDDEN) if fp8 else 0, device="cuda")
    buffer.write(full, sfs)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # the hook orders the caller's stream after the copy
        for tokens in (1, 7, 64):
            for tma in (True, False):
                g = torch.Generator().manual_seed(tokens)
                indices = torch.randint(-3, max(ROWS) + 5, (len(ROWS), tokens, ENTRIES), generator=g, dtype=torch.int32)
                hooks = buffer.fetch(indices, use_tma_aligned_col_major_sf=tma)
                for layer in range(len(ROWS)):
                    result = hooks[layer]()
                    data, sf = result if fp8 else (result, None)
                    assert data.device.type == "cuda"
                    host = (data.view(torch.uint8) if fp8 else data).cpu().reshape(-1, HIDDEN)
                    assert torch.equal(host, _expected_rows(full[layer], indices[layer]))
                    if fp8:
                        expect = _expected_rows(sfs[layer], indices[layer]).reshape(tokens, -1)
                        assert torch.equal(sf.cpu().contiguous(), expect)


def test_memory_on_the_host_tier_memorizes_and_prefetches_like_a_local_one(tmp_path):
    """A memory over a HostRowStore (new segment, then its saved file mapped) gives what the same memory
    over a LocalRowStore gives; `prefetch` (the lookup run beside the text encoder) gives what `values` gives."""
    from fp8_engram.engram.memory import EngramMemory, make_config
    from fp8_engram.engram.streams import family_layout

    vocab = [f"w{i}" for i in range(200)]
    config, vocabs = make_config(family_layout("sd1", widths={"clip_l": 128}), {"l": vocab}, heads=4, rows_per_head=61, seed=3)
    chunk = [(198, 1.0, 0)] + [(t, 1.0, i + 1) for i, t in enumerate([10, 11, 12, 13])] + [(199, 1.0, 0)]
    tokens = {"l": [chunk + [(199, 1.0, 0)] * (77 - len(chunk))]}
    g = torch.Generator().manual_seed(2)
    base, target = torch.randn(1, 77, 128, generator=g), torch.randn(1, 77, 128, generator=g)
    local = EngramMemory(config, LocalRowStore(config.rows_per_layer(1), config.hidden, torch.float8_e4m3fn), vocabs)
    host = EngramMemory(config, HostRowStore.new(config.rows_per_layer(1), config.hidden, torch.float8_e4m3fn), vocabs)
    for memory in (local, host):
        memory.memorize(tokens, base, target)
    expected = local.apply(base, tokens)
    assert not torch.equal(expected, base)
    assert torch.equal(host.apply(base, tokens), expected)
    looked_up = host.prefetch(tokens).result()
    encoded, beside = host.lookup_beside(tokens, lambda: "encoded")
    assert encoded == "encoded" and torch.equal(host.apply(base, tokens, looked_up=beside), expected)
    with pytest.raises(KeyError):
        host.lookup_beside(tokens, lambda: {}["the encoder failed"])
    assert torch.equal(host.apply(base, tokens, looked_up=looked_up), expected)
    assert [h.entries_hit for h in host.hits(tokens, looked_up)] == [h.entries_hit for h in local.hits(tokens)]
    path = str(tmp_path / "m.safetensors")
    host.save(path)
    mapped = EngramMemory(config, HostRowStore.from_table_file(path), vocabs)
    assert torch.equal(mapped.apply(base, tokens), expected)
    with pytest.raises(Exception):
        mapped.prefetch({"t5xxl": []}).result()  # a lookup's error comes out of result()
