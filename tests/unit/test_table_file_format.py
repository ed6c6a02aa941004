"""Engram table files: round trip, metadata, atomic writes, clear errors."""

import json
import os
import struct

import pytest
import torch

from fp8_engram.engram import ue8m0
from fp8_engram.engram.store import LocalRowStore
from fp8_engram.engram.table_file import TableFile, TableFileError, read_table_file, write_table_file

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_round_trip_from_row_chunks_with_opaque_metadata(dtype, tmp_path):
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(30, 128, generator=g), torch.randn(12, 128, generator=g)]
    if dtype == torch.float8_e4m3fn:
        pairs = [ue8m0.quantize_rows(t) for t in full]
        tables, scales = [q for q, _ in pairs], [s for _, s in pairs]
    else:
        tables, scales = [t.bfloat16() for t in full], None
    path = tmp_path / "t.safetensors"
    chunked = [[t[:7], t[7:]] for t in tables]  # e.g. one chunk per rank
    chunked_scales = [[s[:7], s[7:]] for s in scales] if scales else None
    write_table_file(path, chunked, chunked_scales, hashing={"max_ngram": 3, "seed": 0}, streams=[{"name": "clip_l", "cols": [0, 768]}])
    got_tables, got_scales, meta = read_table_file(path)
    assert meta["hashing"] == {"max_ngram": 3, "seed": 0} and meta["streams"] == [{"name": "clip_l", "cols": [0, 768]}]
    assert meta["geometry"]["rows_per_layer"] == [30, 12] and meta["geometry"]["dtype"] == str(dtype).removeprefix("torch.")
    for a, b in zip(got_tables, tables):
        assert a.dtype == dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if scales:
        for a, b in zip(got_scales, scales):
            assert torch.equal(a, b)
    with TableFile(path) as f:
        data, sf = f.read_rows(0, 25, 34)  # past the end: zero rows
        assert torch.equal(data[:5].view(torch.uint8), tables[0][25:].view(torch.uint8))
        assert torch.all(data[5:].float() == 0)
    assert [p.name for p in tmp_path.iterdir()] == ["t.safetensors"]  # no temp file left behind


def test_local_store_round_trip_through_a_file(tmp_path):
    store = LocalRowStore([50], 256, torch.float8_e4m3fn)
    store.write_rows(0, torch.arange(50), torch.randn(50, 256))
    store.save_table_file(tmp_path / "a.safetensors", hashing=None, streams=None)
    again = LocalRowStore.from_table_file(tmp_path / "a.safetensors")
    assert torch.equal(again.read_rows(0, torch.arange(50)), store.read_rows(0, torch.arange(50)))


def test_truncated_file_is_named_in_the_error(tmp_path):
    path = tmp_path / "t.safetensors"
    write_table_file(path, [torch.zeros(64, 128, dtype=torch.bfloat16)])
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(TableFileError, match="t.safetensors.*truncated"):
        TableFile(path)


def test_wrong_geometry_and_foreign_files_name_file_and_key(tmp_path):
    path = tmp_path / "t.safetensors"
    write_table_file(path, [torch.zeros(64, 128, dtype=torch.bfloat16), torch.zeros(8, 128, dtype=torch.bfloat16)])
    with TableFile(path) as f:
        with pytest.raises(TableFileError, match=r"layers\.1\.rows.*8 rows, expected 16"):
            f.check_geometry([64, 16], 128, torch.bfloat16)
        f.check_geometry([64, 16], 128, torch.bfloat16, allow_fewer_rows=True)
        with pytest.raises(TableFileError, match="hidden is 128"):
            f.check_geometry([64, 8], 256, torch.bfloat16)
        with pytest.raises(TableFileError, match="dtype"):
            f.check_geometry([64, 8], 128, torch.float8_e4m3fn)
    store = LocalRowStore([64, 8], 256)
    with pytest.raises(TableFileError, match="t.safetensors.*hidden"):
        store.load_table_file(path)
    # a plain safetensors file is not a table file
    from safetensors.torch import save_file

    other = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(2, 2)}, str(other))
    with pytest.raises(TableFileError, match="model.safetensors.*engram.format"):
        TableFile(other)


def test_a_key_with_the_wrong_shape_is_named(tmp_path):
    path = tmp_path / "t.safetensors"
    write_table_file(path, [torch.zeros(4, 128, dtype=torch.bfloat16)])
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    geometry = json.loads(header["__metadata__"]["engram.geometry"])
    geometry["rows_per_layer"] = [5]
    header["__metadata__"]["engram.geometry"] = json.dumps(geometry)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n :])
    with pytest.raises(TableFileError, match=r"'layers\.0\.rows' is BF16 \[4, 128\], expected BF16 \[5, 128\]"):
        TableFile(path)


def test_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "t.safetensors"
    write_table_file(path, [torch.ones(4, 128, dtype=torch.bfloat16)])
    before = path.read_bytes()
    with pytest.raises(ValueError, match="chunk must be"):
        write_table_file(path, [[torch.ones(4, 128, dtype=torch.bfloat16), torch.ones(4, 64, dtype=torch.bfloat16)]])
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["t.safetensors"]


def test_a_written_table_file_has_the_mode_of_any_new_file(tmp_path):
    """0666 less the umask (the temp file it is renamed from must not stay 0600), and no temp left."""
    import os

    old = os.umask(0o027)
    try:
        path = tmp_path / "mode.safetensors"
        write_table_file(path, [torch.zeros(4, 128, dtype=torch.bfloat16)])
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["mode.safetensors"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_a_memory_saved_at_one_rank_count_loads_at_any_other(dtype, tmp_path):
    """Tables are padded to a multiple of the rank count, so a memory saved on 3 ranks (or a 4-GPU machine)
    has more rows than the same memory on 1 or 2 ranks: with the rows the memory addresses given, every
    store loads it (the padding is never addressed), the addressed rows bit for bit; a file holding fewer
    rows than those is refused naming the key."""
    from fp8_engram.engram.group import EngramGroup
    from fp8_engram.engram.host_tier import HostRowStore

    needed = [88, 61]  # what the hashing addresses, per layer

    def padded(ranks):
        return [-(-n // ranks) * ranks for n in needed]

    source = EngramGroup(padded(3), 64, dtype, num_ranks=3, device="cpu")
    try:
        g = torch.Generator().manual_seed(5)
        for layer, n in enumerate(needed):
            source.write_rows(layer, torch.arange(n), torch.randn(n, 64, generator=g))
        path = str(tmp_path / "three_ranks.safetensors")
        source.save_table_file(path)
        want = [source.read_rows(layer, torch.arange(n)) for layer, n in enumerate(needed)]
    finally:
        source.close()
    assert TableFile(path).rows_per_layer == [90, 63]

    stores = [LocalRowStore(padded(1), 64, dtype), EngramGroup(padded(2), 64, dtype, num_ranks=2, device="cpu"),
              EngramGroup(padded(4), 64, dtype, num_ranks=4, device="cpu"), HostRowStore.new(padded(1), 64, dtype)]
    try:
        for store in stores:
            with pytest.raises(TableFileError, match="layers.0.rows"):
                store.load_table_file(path)  # without the addressed rows: the geometry must match
            store.load_table_file(path, rows_needed=needed)
            for layer, n in enumerate(needed):
                assert torch.equal(store.read_rows(layer, torch.arange(n)), want[layer]), (type(store).__name__, layer)
        with pytest.raises(TableFileError, match="layers.1.rows.*addresses 64"):
            stores[0].load_table_file(path, rows_needed=[88, 64])
    finally:
        for store in stores:
            store.close()
