"""The host tier's memory and concurrency promises, measured on the real kernel mappings:

* mapping a table file reads nothing, and a fetch pages in only (about) the rows it reads;
* two processes mapping one file share its pages (each one's PSS of the map is about half its RSS);
* writes (what Memorize and Train call) running beside fetches never let a fetch see a torn row: every
  fetched row is one whole written version, FP8 data and its scales from the same version.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import fp8_engram
from fp8_engram.engram import ue8m0
from fp8_engram.engram.host_tier import HostRowStore, HostTable
from fp8_engram.engram.store import decode_rows
from fp8_engram.engram.table_file import write_table_file

pytestmark = pytest.mark.unit

needs_smaps = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc/<pid>/smaps to measure mappings")


def _map_kib(path: str, pid: int | str = "self") -> dict[str, int]:
    """Rss and Pss (KiB) of every mapping of `path` in a process, summed."""
    totals = {"Rss": 0, "Pss": 0}
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
                inside = len(fields) >= 6 and fields[5] == path
            elif inside and fields[0].rstrip(":") in totals:
                totals[fields[0].rstrip(":")] += int(fields[1])
    return totals


def _table_file(path: str, rows: int, hidden: int) -> torch.Tensor:
    table = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(3)).bfloat16()
    write_table_file(path, [table])
    return table


@needs_smaps
def test_mapping_reads_nothing_and_a_fetch_pages_in_its_rows(tmp_path):
    path = str(tmp_path / "big.safetensors")
    table = _table_file(path, 32768, 2048)  # 128 MiB of rows, 4 KiB each
    store = HostRowStore.from_table_file(path)
    assert _map_kib(path)["Rss"] < 256, "mapping the file touched its rows"
    ids = torch.tensor([[[5, 9000, 30000, 123]]], dtype=torch.int32)
    fetched = store.fetch_rows(ids)[0]
    assert torch.equal(fetched[0], table[ids[0, 0].long()].float())
    # Four rows of 4 KiB; the kernel maps at most the page-cache folio around each (up to 2 MiB where
    # the file was just written), never the file.
    assert _map_kib(path)["Rss"] < 4 * 2048 + 1024, _map_kib(path)


@needs_smaps
def test_two_processes_share_one_copy(tmp_path):
    path = str(tmp_path / "shared.safetensors")
    rows, hidden = 8192, 2048  # 32 MiB
    _table_file(path, rows, hidden)
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(fp8_engram.__file__)))
    child = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys, torch\n"
            f"sys.path.insert(0, {package_parent!r})\n"
            "from fp8_engram.engram.host_tier import HostRowStore\n"
            f"store = HostRowStore.from_table_file({path!r})\n"
            f"store.fetch_rows(torch.arange({rows}, dtype=torch.int32).view(1, -1, 1))\n"
            "print('ready', flush=True)\n"
            "sys.stdin.readline()\n"
        )],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        store = HostRowStore.from_table_file(path)
        store.fetch_rows(torch.arange(rows, dtype=torch.int32).view(1, -1, 1))
        mine, theirs = _map_kib(path), _map_kib(path, child.pid)
        size_kib = os.path.getsize(path) // 1024
        assert mine["Rss"] > 0.9 * size_kib and theirs["Rss"] > 0.9 * size_kib
        # Shared pages count half to each process: together they hold one copy.
        assert mine["Pss"] + theirs["Pss"] < 1.1 * size_kib, (mine, theirs, size_kib)
    finally:
        child.stdin.close()
        child.wait(timeout=30)


def _versions(hidden: int, dtype: torch.dtype, values: list[float]) -> list[torch.Tensor]:
    """What a fetch may legally return for a row written with each constant value (after encoding)."""
    if dtype == torch.float8_e4m3fn:
        return [ue8m0.dequantize_rows(*ue8m0.quantize_rows(torch.full((1, hidden), v)))[0] for v in values]
    return [torch.full((hidden,), v).bfloat16().float() for v in values]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_writes_beside_fetches_never_tear_a_row(dtype):
    hidden, rows = 4096, 1024
    # Constant rows whose FP8 data and scales both differ between versions: a row of one version's
    # data under another's scales decodes to neither.
    values = [1.0, 3.0, -5.0]
    legal = torch.stack(_versions(hidden, dtype, values))
    store = HostRowStore.new([rows], hidden, dtype)
    store.write_rows(0, torch.arange(rows), torch.full((rows, hidden), values[0]))
    buffer = store.buffer(num_max_tokens=rows, num_entries_per_token=1)
    stop = threading.Event()
    written = [0]

    def memorize_loop():
        i = 0
        while not stop.is_set():
            i += 1
            store.write_rows(0, torch.arange(rows), torch.full((rows, hidden), values[i % len(values)]))
            written[0] += 1

    def check(got: torch.Tensor) -> None:
        # every row equals one legal version exactly
        match = (got.unsqueeze(1) == legal.unsqueeze(0)).all(dim=2).any(dim=1)
        assert bool(match.all()), f"{int((~match).sum())} torn row(s)"

    writer = threading.Thread(target=memorize_loop)
    writer.start()
    fetches = 0
    try:
        ids = torch.arange(rows, dtype=torch.int32).view(1, rows, 1)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline or written[0] < 5:
            check(store.fetch_rows(ids)[0].view(rows, hidden))
            result = buffer.fetch(ids)[0]()
            data, sf = result if dtype == torch.float8_e4m3fn else (result, None)
            check(decode_rows(data.view(rows, hidden), sf))
            fetches += 2
    finally:
        stop.set()
        writer.join()
    assert written[0] >= 5 and fetches >= 4


_CHANGED_FILE_CHILD = """
import os, sys, torch
sys.path.insert(0, {package_parent!r})
from fp8_engram.engram.host_tier import HostRowStore
from fp8_engram.engram.table_file import TableFileError, write_table_file
path, how = {path!r}, {how!r}
store = HostRowStore.from_table_file(path)
ids = torch.tensor([[[1, 4000]]], dtype=torch.int32)
before = store.fetch_rows(ids)[0]
if how == "truncate":
    os.truncate(path, os.path.getsize(path) // 2)
elif how == "rewrite":
    with open(path, "r+b") as f:  # same size, other bytes: another memory copied over this one
        f.seek(os.path.getsize(path) // 2)
        f.write(bytes(4096))
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
else:  # a save: a new file renamed over the loaded one
    write_table_file(path + ".new", [torch.zeros(4096, 512).bfloat16()])
    os.replace(path + ".new", path)
try:
    after = store.fetch_rows(ids)[0]
except TableFileError as e:
    print("refused:", e, flush=True)
else:
    print("served", torch.equal(before, after), flush=True)
"""


@pytest.mark.parametrize("how", ["truncate", "rewrite", "replace"])
def test_a_loaded_file_changed_on_disk_is_refused_not_a_crash(tmp_path, how):
    """A mapped file truncated in place would kill the process with SIGBUS at the first read of a page past
    its new end (run in a child, so that a regression shows as that child's death, not the test run's).
    Truncated or rewritten in place: a TableFileError naming the file. Replaced by rename (what saves do):
    the loaded rows go on being served."""
    path = str(tmp_path / "changing.safetensors")
    _table_file(path, 4096, 512)  # 4 MiB
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(fp8_engram.__file__)))
    child = subprocess.run([sys.executable, "-c", _CHANGED_FILE_CHILD.format(package_parent=package_parent, path=path, how=how)],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, f"child died with {child.returncode}: {child.stderr[-2000:]}"
    if how == "replace":
        assert child.stdout.strip() == "served True", child.stdout
    else:
        assert child.stdout.startswith("refused:"), child.stdout
        assert path in child.stdout and "changed on disk" in child.stdout
        assert ("size went from" in child.stdout) == (how == "truncate"), child.stdout
