"""Memory files and segments that cannot be served end in named errors, never a bare allocator error,
a signal or NaN conditioning (issue 27, findings 4, 6, 8 and 9):

* a consistent sparse memory file declaring 2**31 rows (3.3 TB apparent, a few KB on disk) is refused
  before it is mapped, naming the file, its rows and bytes and what the machine (or process) can map;
* a /dev/shm without room for a new host-tier segment or for CPU-rank shards is a SharedMemoryFullError
  with the bytes asked and free, where it used to be SIGBUS at a write. Tested for real: the code runs
  in a child process in a mount namespace of its own whose /dev/shm is an 8 MiB tmpfs;
* rows a memory fetches must be finite: a file rewritten in place with NaN rows (its size and
  modification time put back, as `cp -p` does) is an error naming the file at the next lookup, for the
  host tier (mapped) and for the device stores (one process, CPU ranks) that loaded it;
* a table file saved into a read-only folder is an error naming the destination and what to do.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.host import missing_prerequisite
import torch

from fp8_engram.engram import ue8m0
from fp8_engram.engram.group import EngramGroup
from fp8_engram.engram.host_tier import HostRowStore
from fp8_engram.engram.store import LocalRowStore
from fp8_engram.engram.table_file import TableFileError, rows_key, write_table_file
from helpers import fuzz_files as fz
from helpers.cramped_server import namespace_unavailable
from helpers.engram_tables import nan_rows_copy

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = 768
HUGE_ROWS = 2**31


def _memory_metadata() -> tuple[dict, dict]:
    from fp8_engram.engram.hashing import HashConfig
    from fp8_engram.engram.memory import MemoryConfig
    from fp8_engram.engram.streams import Stream, StreamLayout

    config = MemoryConfig(StreamLayout("sd1", (Stream("clip_l", "l", 0, HIDDEN),)),
                          HashConfig(num_layers=1, vocab_sizes=(500,), max_order=3, heads=2, rows_per_head=16, seed=3), hidden=HIDDEN)
    return config.to_metadata()


def write_sparse_memory_file(path: Path, rows: int = HUGE_ROWS) -> int:
    """A memory file whose one BF16 layer declares `rows` rows, consistent with its size (the data is a
    hole: a few KB on disk); returns its apparent size. Skips where the filesystem cannot hold it."""
    hashing, streams = _memory_metadata()
    nbytes = rows * HIDDEN * 2
    geometry = {"num_layers": 1, "hidden": HIDDEN, "rows_per_layer": [rows], "dtype": "bfloat16", "num_sf_packs": 0, "sf_block": 0}
    header = {rows_key(0): {"dtype": "BF16", "shape": [rows, HIDDEN], "data_offsets": [0, nbytes]},
              "__metadata__": {"engram.format": "fp8-engram-table", "engram.format_version": "1",
                               "engram.geometry": json.dumps(geometry), "engram.hashing": json.dumps(hashing),
                               "engram.streams": json.dumps(streams)}}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    try:
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            f.truncate(8 + len(text) + nbytes)
    except OSError as e:  # EFBIG: a filesystem whose files cannot be 3.3 TB long
        pytest.skip(f"the filesystem of {path.parent} cannot hold a {nbytes / 1e12:.1f} TB sparse file: {e}")
    return 8 + len(text) + nbytes


def machine_map_room() -> int | None:
    """Bytes one copy-on-write map may take on this machine by its overcommit rule (None: no limit),
    read here independently of the pack."""
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, value = line.split(":")
            info[name] = int(value.split()[0]) * 1024
    mode = int(Path("/proc/sys/vm/overcommit_memory").read_text())
    if mode == 0:
        return info["MemTotal"] + info.get("SwapTotal", 0)
    if mode == 2:
        return info["CommitLimit"] - info["Committed_AS"]
    return None


def _check_refused(exc: BaseException, path: Path) -> None:
    message = str(exc)
    assert isinstance(exc, TableFileError), f"{type(exc).__name__}: {message}"
    assert str(path) in message, message
    assert "2,147,483,648 rows" in message and "3,298,534,88" in message, message  # the rows and the bytes
    assert "GiB" in message and ("machine has" in message or "limit leaves" in message or "commit limit" in message), message


def _loaders(path: Path):
    from fp8_engram.engram.memory import config_from_table_file

    return {
        "config (Load Engram Memory's first step)": lambda: config_from_table_file(str(path)),
        "host placement (mapped)": lambda: HostRowStore.from_table_file(path),
        "device placement, one process": lambda: LocalRowStore(_rows_needed(), HIDDEN).load_table_file(str(path), rows_needed=_rows_needed()),
    }


def _rows_needed() -> list[int]:
    from fp8_engram.engram.hashing import NgramHasher
    from fp8_engram.engram.memory import MemoryConfig

    hashing, streams = _memory_metadata()
    return list(NgramHasher(MemoryConfig.from_metadata(hashing, streams).hashing).rows_needed)


def test_memory_file_declaring_2_31_rows_is_refused_with_the_figures_under_a_data_limit(tmp_path):
    """Under a data-size limit (a few GiB of room, as containers often give) the map can never be had: every
    loader must refuse the file by name with the figures, not fail in the allocator."""
    path = tmp_path / "huge.safetensors"
    size = write_sparse_memory_file(path)
    assert os.stat(path).st_blocks * 512 < 1 << 20  # a hole: nothing on disk
    with fz.memory_ceiling(4 << 30):
        for name, load in _loaders(path).items():
            with pytest.raises(Exception) as info:
                load()
            _check_refused(info.value, path)
            assert "limit leaves" in str(info.value) or "machine has" in str(info.value), f"{name}: {info.value}"


def test_memory_file_declaring_2_31_rows_is_refused_by_what_the_machine_has(tmp_path):
    """Without a process limit: the machine's overcommit rule decides (memory + swap by default)."""
    path = tmp_path / "huge.safetensors"
    size = write_sparse_memory_file(path)
    room = machine_map_room()
    if room is None or room >= size:
        pytest.skip(f"this machine's overcommit rule lets one map take {size / 1e12:.1f} TB: nothing to refuse")
    for name, load in _loaders(path).items():
        with pytest.raises(Exception) as info:
            load()
        _check_refused(info.value, path)


def test_a_memory_file_that_fits_still_loads(tmp_path):
    path = tmp_path / "small.safetensors"
    hashing, streams = _memory_metadata()
    rows = _rows_needed()
    write_table_file(path, [torch.zeros(n, HIDDEN, dtype=torch.bfloat16) for n in rows], hashing=hashing, streams=streams)
    with fz.memory_ceiling(1 << 30):
        for name, load in _loaders(path).items():
            load()


# ----- a full /dev/shm (finding 6) -----


def run_with_small_shm(code: str, shm: str = "8m", timeout: float = 240) -> subprocess.CompletedProcess:
    """Run python `code` with this checkout importable as fp8_engram, in a mount namespace whose /dev/shm
    is a tmpfs of `shm` (the host's /dev/shm is untouched)."""
    reason = namespace_unavailable()
    if reason is not None:
        missing_prerequisite(reason)
    script = f"import sys\nsys.path[:0] = [{str(ROOT / '.host' / 'pkg')!r}]\n" + textwrap.dedent(code)
    inner = f'mount -t tmpfs -o size={shm} tmpfs /dev/shm && exec "$0" -c "$1"'
    return subprocess.run(["unshare", "-m", "sh", "-c", inner, sys.executable, script],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


_SHM_CASES = """
    import torch
    try:
        from fp8_engram.engram.allocators import SharedMemoryFullError
    except ImportError:  # the code before the fix: what happens then is what this test looks at
        SharedMemoryFullError = MemoryError
    from fp8_engram.engram.group import EngramGroup
    from fp8_engram.engram.host_tier import HostRowStore

    def report(what, make, rows):
        try:
            store = make()
        except SharedMemoryFullError as e:
            print(what, "REFUSED", e, flush=True)
            return
        # writes through every row, as Memorize and Train do over a big memory: SIGBUS before the fix
        for layer, n in enumerate(store.rows_per_layer):
            ids = torch.arange(0, n, 1)
            store.write_rows(layer, ids, torch.full((n, 256), 0.5))
            assert float(store.read_rows(layer, ids[-3:]).sum()) == 0.5 * 3 * 256
        store.close()
        print(what, "SERVED", flush=True)

    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 0
"""


@pytest.mark.parametrize("kind", ["host", "cpu_ranks"])
def test_a_full_dev_shm_is_a_named_error_when_the_tables_are_made(kind):
    """12 MiB of tables (BF16, 2 x 12288 rows of 256) into an 8 MiB /dev/shm: refused when made, with the
    bytes asked and free; 2 MiB of tables are made and served in the same /dev/shm."""
    if kind == "host":
        make = "lambda n=n: HostRowStore.new([n, n], 256, torch.bfloat16)"
    else:
        make = "lambda n=n: EngramGroup([n, n], 256, torch.bfloat16, num_ranks=2, device='cpu', timeout=60)"
    code = _SHM_CASES + f"""
    for n in (12288, 2048):
        report(f"{{n}} rows:", {make}, n)
    """
    done = run_with_small_shm(code)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"the process ended with {done.returncode} (-7 / 135: SIGBUS): {out[-3000:]}"
    lines = {line.split(":")[0]: line for line in done.stdout.splitlines() if line.endswith("SERVED") or "REFUSED" in line}
    big = lines.get("12288 rows", "")
    assert "REFUSED" in big, out[-3000:]
    assert "shared memory in /dev/shm" in big and "MiB" in big and "are free" in big, big
    assert "12.0 MiB" in big or "6.0 MiB" in big, big  # the bytes asked (the whole table, or one rank's shard)
    if kind == "cpu_ranks":
        assert "CPU rank" in big, big
    assert lines.get("2048 rows", "").endswith("SERVED"), out[-3000:]


def test_cpu_rank_shards_that_race_past_the_up_front_check_fail_on_every_rank_with_the_figures(monkeypatch):
    """The up-front check passes (it is told there is room), so the shards' own reservation is what
    refuses: every rank agrees and the host raises SharedMemoryFullError, not "a worker died"."""
    code = _SHM_CASES + """
    from fp8_engram.engram import group
    group.check_shm_room = lambda what, n, folder="/dev/shm": None   # as if /dev/shm filled up after the check
    report("12288 rows:", lambda: EngramGroup([12288, 12288], 256, torch.bfloat16, num_ranks=2, device="cpu", timeout=60), 12288)
    """
    done = run_with_small_shm(code)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"the process ended with {done.returncode} (-7 / 135: SIGBUS): {out[-3000:]}"
    assert "12288 rows: REFUSED" in done.stdout, out[-3000:]
    assert "2 CPU ranks x 6.0 MiB of engram shards do not fit in /dev/shm" in done.stdout, out[-3000:]


# ----- non-finite rows in a memory file (finding 8) -----


def overwrite_keeping_the_timestamp(path: Path, new: Path) -> None:
    """What `cp -p new path` does: truncate and rewrite the same file (same inode), then put the times back."""
    st = os.stat(path)
    shutil.copyfile(new, path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns


def _saved_memory(tmp_path: Path, fp8: bool) -> tuple[Path, list[int]]:
    rows = [300, 200]
    g = torch.Generator().manual_seed(8)
    values = [torch.randn(n, 256, generator=g) for n in rows]
    path = tmp_path / f"memory_{'fp8' if fp8 else 'bf16'}.safetensors"
    if fp8:
        pairs = [ue8m0.quantize_rows(v) for v in values]
        write_table_file(path, [q for q, _ in pairs], [s for _, s in pairs])
    else:
        write_table_file(path, [v.to(torch.bfloat16) for v in values])
    return path, rows


def _indices(rows: list[int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(9)
    ids = torch.stack([torch.randint(0, n, (7, 4), generator=g) for n in rows]).to(torch.int32)
    ids[:, 0, 0] = -1  # an unused entry reads as a zero row, as always
    return ids


def _check_nan_refused(exc: BaseException, path: Path) -> None:
    message = str(exc)
    assert isinstance(exc, TableFileError), f"{type(exc).__name__}: {message}"
    assert str(path) in message and "NaN" in message and "layer 0" in message, message


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_host_memory_file_overwritten_in_place_with_nan_rows_is_an_error_naming_the_file(tmp_path, fp8):
    path, rows = _saved_memory(tmp_path, fp8)
    store = HostRowStore.from_table_file(path)
    ids = _indices(rows)
    good = store.fetch_rows(ids)
    assert all(bool(torch.isfinite(t).all()) for t in good)
    nan_rows_copy(path, tmp_path / "nan.safetensors")
    overwrite_keeping_the_timestamp(path, tmp_path / "nan.safetensors")
    store.table.check_source()  # same size, same timestamp: the file looks unchanged
    with pytest.raises(Exception) as info:
        store.fetch_rows(ids)
    _check_nan_refused(info.value, path)
    with pytest.raises(Exception) as info:  # Memorize and Train read rows too
        store.read_rows(0, torch.tensor([1, 2]))
    _check_nan_refused(info.value, path)
    store.close()


@pytest.mark.parametrize("ranks", [1, 2], ids=["one_process", "cpu_ranks"])
def test_device_memory_reloaded_from_a_nan_file_is_an_error_naming_the_file(tmp_path, ranks):
    path, rows = _saved_memory(tmp_path, fp8=True)
    store = LocalRowStore(rows, 256, torch.float8_e4m3fn) if ranks == 1 else EngramGroup(rows, 256, torch.float8_e4m3fn, num_ranks=2, device="cpu")
    try:
        store.load_table_file(str(path))
        ids = _indices(rows)
        assert all(bool(torch.isfinite(t).all()) for t in store.fetch_rows(ids))
        nan_rows_copy(path, tmp_path / "nan.safetensors")
        shutil.copyfile(tmp_path / "nan.safetensors", path)  # a new timestamp: Load Engram Memory reloads it
        store.load_table_file(str(path))
        with pytest.raises(Exception) as info:
            store.fetch_rows(ids)
        _check_nan_refused(info.value, path.resolve())
        with pytest.raises(Exception) as info:
            store.read_rows(0, torch.tensor([5]))
        _check_nan_refused(info.value, path.resolve())
    finally:
        store.close()


def test_finite_rows_whose_sum_overflows_are_served(tmp_path):
    """The check sums the fetched rows first; a sum that overflows float32 is looked at row by row."""
    big = torch.full((4, 256), 3.0e38).to(torch.bfloat16)
    path = tmp_path / "big_values.safetensors"
    write_table_file(path, [big])
    store = LocalRowStore([4], 256)
    store.load_table_file(str(path))
    got = store.fetch_rows(torch.tensor([[[0, 1, 2, 3]]], dtype=torch.int32))[0]
    assert bool(torch.isfinite(got).all()) and not bool(torch.isfinite(got.sum()))


# ----- saving into a read-only folder (finding 9) -----


def test_saving_into_a_read_only_folder_names_the_destination_and_what_to_do(tmp_path):
    """Root ignores permission bits, so the folder is made read-only for real: a read-only bind mount in
    a child's own mount namespace (where that is impossible, a non-root child would be needed: skipped)."""
    folder = tmp_path / "engram"
    folder.mkdir()
    (folder / "kept.safetensors").write_bytes(b"old")
    code = f"""
    import torch
    from fp8_engram.engram.table_file import TableFileWriteError, write_table_file
    for name in ("new.safetensors", "kept.safetensors"):
        try:
            write_table_file({str(folder)!r} + "/" + name, [torch.zeros(4, 8, dtype=torch.bfloat16)])
        except TableFileWriteError as e:
            print("REFUSED", type(e).__name__, e.errno, e.strerror, flush=True)
        except OSError as e:
            print("BARE", type(e).__name__, e, flush=True)
    """
    reason = namespace_unavailable()
    if reason is not None:
        missing_prerequisite(reason)
    script = f"import sys\nsys.path[:0] = [{str(ROOT / '.host' / 'pkg')!r}]\n" + textwrap.dedent(code)
    inner = 'mount --bind "$2" "$2" && mount -o remount,bind,ro "$2" && exec "$0" -c "$1"'
    done = subprocess.run(["unshare", "-m", "sh", "-c", inner, sys.executable, script, str(folder)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("REFUSED") for line in lines), out[-3000:]
    for line, name in zip(lines, ("new", "kept")):
        assert str(folder / f"{name}.safetensors") in line and "read-only" in line and "make it writable" in line, line
        assert ".tmp-" not in line, line  # the destination is named, not the temporary file
    assert "nothing was written" in lines[0] and "unchanged" in lines[1], lines
    assert sorted(os.listdir(folder)) == ["kept.safetensors"] and (folder / "kept.safetensors").read_bytes() == b"old"
