"""common/reads.py: positioned reads filling a buffer, split over threads where large, and the tensor reads of
quant/safetensors_file.py that use them.

- the parts cover the buffer exactly, page-aligned, one part under ``PARALLEL_MIN_BYTES`` or on one core;
- a split read gives the file's bytes, for sizes at and around the parts' edges, at any offset;
- a file that ends inside a part: the bytes read up to where it ended, counted from the buffer's start;
- a part that fails: its error is raised only once every other part has ended (the buffer is not freed under
  a reading thread);
- a large tensor read now (a kept 16-bit layer) is read in parts and holds the file's bytes; a file truncated
  inside it after its header was read gives a FormatError naming the file, the key and the byte where it ended.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time

import pytest
import torch

from fp8_engram.common import reads
from fp8_engram.quant import formats, safetensors_file
from fp8_engram.quant.errors import FormatError

pytestmark = pytest.mark.unit

MIB = 1 << 20


@pytest.fixture
def two_cores(monkeypatch):
    """Split as on a machine with two cores or more, whatever this one's affinity says."""
    monkeypatch.setattr(reads, "_threads", lambda: 2)


def _file(tmp_path, size: int, seed: int = 0) -> tuple[str, bytes]:
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    raw = data.numpy().tobytes()
    path = tmp_path / "data.bin"
    path.write_bytes(raw)
    return str(path), raw


@pytest.mark.parametrize("size", [1, reads.PAGE + 3, reads.PARALLEL_MIN_BYTES - 1, reads.PARALLEL_MIN_BYTES,
                                  3 * reads.PARALLEL_MIN_BYTES + 12345])
@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_parts_cover_the_buffer_page_aligned(size, threads):
    got = reads.parts(size, threads)
    assert got[0][0] == 0 and got[-1][1] == size
    assert all(a == prev_b for (_, prev_b), (a, _) in zip(got, got[1:]))
    assert all(b > a for a, b in got)
    if size < reads.PARALLEL_MIN_BYTES or threads == 1:
        assert got == [(0, size)]
    else:
        assert 2 <= len(got) <= threads
        assert all(a % reads.PAGE == 0 for a, _ in got)
        assert all(b - a >= reads.PARALLEL_MIN_BYTES // 2 for a, b in got[:-1])


@pytest.mark.parametrize("size", [reads.PARALLEL_MIN_BYTES, reads.PARALLEL_MIN_BYTES + 1,
                                  2 * reads.PARALLEL_MIN_BYTES + 777])
@pytest.mark.parametrize("offset", [0, 5, reads.PAGE])
def test_split_read_gives_the_files_bytes(tmp_path, two_cores, size, offset):
    path, raw = _file(tmp_path, size + offset + 100)
    buf = bytearray(size)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert reads.read_into(fd, memoryview(buf), offset) == size
    finally:
        os.close(fd)
    assert bytes(buf) == raw[offset:offset + size]


def test_split_read_stops_where_the_file_ends(tmp_path, two_cores):
    size = 2 * reads.PARALLEL_MIN_BYTES
    path, raw = _file(tmp_path, size - 1000)  # ends inside the last part
    buf = bytearray(size)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert reads.read_into(fd, memoryview(buf), 0) == size - 1000
        assert reads.read_into(fd, memoryview(buf), 2000) == size - 3000
    finally:
        os.close(fd)
    assert bytes(buf[: size - 3000]) == raw[2000:]


def test_a_failed_part_is_raised_after_every_part_ended(tmp_path, two_cores, monkeypatch):
    size = 4 * reads.PARALLEL_MIN_BYTES
    path, raw = _file(tmp_path, size)
    monkeypatch.setattr(reads, "_threads", lambda: 4)
    real, ended = reads.read_at, []

    def read_at(fd, view, offset):
        if offset == 0:
            raise OSError(5, "Input/output error")  # the caller's own part, at once
        time.sleep(0.05)  # the others still reading when it fails
        n = real(fd, view, offset)
        ended.append(offset)
        return n

    monkeypatch.setattr(reads, "read_at", read_at)
    buf = bytearray(size)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="Input/output"):
            reads.read_into(fd, memoryview(buf), 0)
    finally:
        os.close(fd)
    assert len(ended) == len(reads.parts(size, 4)) - 1


def test_one_thread_is_one_read(tmp_path, monkeypatch):
    path, raw = _file(tmp_path, 2 * reads.PARALLEL_MIN_BYTES)
    monkeypatch.setattr(reads, "_threads", lambda: 1)
    calls = []
    real = reads.read_at
    monkeypatch.setattr(reads, "read_at", lambda fd, view, off: calls.append(off) or real(fd, view, off))
    buf = bytearray(len(raw))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert reads.read_into(fd, memoryview(buf), 0) == len(raw)
        assert reads.read_into(fd, memoryview(buf), 0, parallel=False) == len(raw)
    finally:
        os.close(fd)
    assert calls == [0, 0] and bytes(buf) == raw


def _kept_layer_file(path, rows: int = 2048, cols: int = 2560) -> torch.Tensor:
    """A safetensors file with one bf16 weight of rows x cols (10 MiB: read in parts) and a small bias."""
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    from safetensors.torch import save_file

    save_file({"layer.weight": w, "layer.bias": torch.ones(rows, dtype=torch.bfloat16)}, str(path))
    return w


def test_a_large_tensor_read_now_is_read_in_parts(tmp_path, two_cores, monkeypatch):
    path = tmp_path / "kept.safetensors"
    w = _kept_layer_file(path)
    assert w.numel() * 2 >= reads.PARALLEL_MIN_BYTES
    seen = []
    real = reads.read_at
    monkeypatch.setattr(reads, "read_at",
                        lambda fd, view, off: seen.append(threading.get_ident()) or real(fd, view, off))
    sd, _ = formats.load_file(path)
    assert torch.equal(sd["layer.weight"].view(torch.int16), w.view(torch.int16))
    assert len(set(seen)) >= 2  # the caller and a helper


def test_a_file_truncated_inside_a_large_tensor_names_where_it_ended(tmp_path, two_cores):
    path = tmp_path / "kept.safetensors"
    _kept_layer_file(path)
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    start, end = header["layer.weight"]["data_offsets"]
    cut = 8 + n + end - 3 * MIB  # inside the weight's last part
    rd = safetensors_file._FileReader(str(path))
    rd.header = safetensors_file.read_header(str(path), file=rd.open())  # the header saw the whole file
    os.truncate(path, cut)  # then it was cut short, as by a download rewriting it
    try:
        with pytest.raises(FormatError) as err:
            rd.get("layer.weight")
    finally:
        rd.close()
    text = str(err.value)
    assert str(path) in text and "layer.weight" in text and f"ended at byte {cut:,}" in text
