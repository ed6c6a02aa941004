"""Two processes serving one host-tier table file: how much memory they add together, and how fast each
starts serving.

Writes a table file of `--table-gib` GiB (default 4) of random FP8 + UE8M0 rows to `--dir`, drops it from
the page cache, then starts two processes that each, like Load Engram Memory with placement host:
map the file (HostRowStore), fetch one prompt's rows (77 tokens x 16 entries, read from the disk) and
report the seconds from the start of the load to the fetched rows (`serve_s`, target < 1 s); then
fetch EVERY row of the table (the worst case: the whole table resident in both) and wait. With both
processes holding the whole table this script reads:
  map_pss   each process's PSS of the file's mapping (shared pages count half to each), summed
  pss       each process's whole PSS, summed (the interpreter and torch included)
  free_drop MemFree before the processes started minus MemFree now (page cache included; other work on
            the machine moves it too)
  avail_drop the same for MemAvailable (which counts clean page cache as available)
Target: map_pss <= 1.1 x the file's size. Prints a table and, last, one JSON line. The file is deleted.

Run: `python bench/engram_host_share.py [--table-gib 4] [--dir /tmp] [--processes 2]`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), ".host", "pkg"))
sys.path.insert(0, HERE)

HIDDEN = 2048
ENTRIES = 16
TOKENS = 77


def mapping_kib(path: str, pid: int | str = "self") -> dict[str, int]:
    """Rss and Pss (KiB) of the mappings of `path` in a process."""
    totals = {"Rss": 0, "Pss": 0}
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
                inside = len(fields) >= 6 and fields[5] == path
            elif inside and fields[0].rstrip(":") in totals:
                totals[fields[0].rstrip(":")] += int(fields[1])
    return totals


def meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/meminfo")


def child(path: str) -> None:
    """One serving process: load, fetch one prompt's rows (timed), then page every row in and wait."""
    import torch

    from fp8_engram.engram.host_tier import HostRowStore

    start = time.perf_counter()
    store = HostRowStore.from_table_file(path)
    buffer = store.buffer(num_max_tokens=4096, num_entries_per_token=ENTRIES)
    rows = store.rows_per_layer[0]
    ids = torch.randint(0, rows, (1, TOKENS, ENTRIES), dtype=torch.int32, generator=torch.Generator().manual_seed(os.getpid()))
    data, sf = buffer.fetch(ids)[0]()
    serve_s = time.perf_counter() - start
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)  # read the file ahead in big requests; the fetches below then map every page
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    os.close(fd)
    step = 4096 * ENTRIES
    for first in range(0, rows, step):
        chunk = torch.arange(first, min(rows, first + step), dtype=torch.int32)
        chunk = torch.nn.functional.pad(chunk, (0, step - chunk.numel()), value=-1).view(1, 4096, ENTRIES)
        buffer.fetch(chunk)[0]()
    touch_s = time.perf_counter() - start
    print(json.dumps({"pid": os.getpid(), "serve_s": serve_s, "touch_s": touch_s, "load_first_fetch_bytes": data.numel() + sf.numel() * 4}), flush=True)
    sys.stdin.readline()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table-gib", type=float, default=4.0)
    parser.add_argument("--dir", default=None, help="where the table file is written (default: the temp folder)")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return 0

    import torch

    from _engram_tables import drop_from_page_cache, write_random_table_file
    from fp8_engram.engram.rows import table_bytes

    row_bytes = table_bytes([1], HIDDEN, torch.float8_e4m3fn)
    rows = -(-int(args.table_gib * 2**30) // row_bytes)
    path = os.path.join(args.dir or tempfile.gettempdir(), f"engram_host_share_{os.getpid()}.safetensors")
    procs: list[subprocess.Popen] = []
    try:
        start = time.perf_counter()
        size = write_random_table_file(path, [rows], HIDDEN, torch.float8_e4m3fn)
        print(f"wrote {path}: {size / 2**30:.3f} GiB in {time.perf_counter() - start:.1f} s", flush=True)
        drop_from_page_cache(path)
        time.sleep(1.0)
        free0, avail0 = meminfo("MemFree"), meminfo("MemAvailable")
        reports = []
        for _ in range(args.processes):
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            procs.append(proc)
        for proc in procs:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"serving process {proc.pid} ended early (exit code {proc.wait()})")
            reports.append(json.loads(line))
        maps = [mapping_kib(path, p.pid) for p in procs]
        whole = []
        for p in procs:
            with open(f"/proc/{p.pid}/smaps_rollup") as f:
                whole.append(next(int(line.split()[1]) for line in f if line.startswith("Pss:")) * 1024)
        free_drop, avail_drop = free0 - meminfo("MemFree"), avail0 - meminfo("MemAvailable")
        map_pss = sum(m["Pss"] for m in maps) * 1024
        map_rss = [m["Rss"] * 1024 for m in maps]
        print(f"{'process':>8} {'serve s':>8} {'touch s':>8} {'map RSS GiB':>12} {'map PSS GiB':>12} {'PSS GiB':>8}")
        for r, m, w in zip(reports, maps, whole):
            print(f"{r['pid']:>8} {r['serve_s']:>8.3f} {r['touch_s']:>8.1f} {m['Rss'] / 2**20:>12.3f} {m['Pss'] / 2**20:>12.3f} {w / 2**30:>8.3f}")
        print(f"file {size / 2**30:.3f} GiB; together: map PSS {map_pss / 2**30:.3f} GiB = {map_pss / size:.3f} x the file (target <= 1.1); "
              f"whole PSS {sum(whole) / 2**30:.3f} GiB; MemFree dropped {free_drop / 2**30:.3f} GiB, MemAvailable {avail_drop / 2**30:.3f} GiB")
        print(json.dumps({
            "bench": "engram_host_share", "processes": args.processes, "file_gib": round(size / 2**30, 4),
            "serve_s": [round(r["serve_s"], 4) for r in reports], "touch_s": [round(r["touch_s"], 2) for r in reports],
            "map_rss_gib": [round(x / 2**30, 4) for x in map_rss], "map_pss_over_file": round(map_pss / size, 4),
            "whole_pss_gib": round(sum(whole) / 2**30, 4), "free_drop_over_file": round(free_drop / size, 4),
            "avail_drop_over_file": round(avail_drop / size, 4), "target_map_pss_over_file": 1.1, "target_serve_s": 1.0,
        }))
    finally:
        for proc in procs:
            if proc.poll() is None:
                try:
                    proc.stdin.close()
                    proc.wait(timeout=30)
                except (OSError, subprocess.TimeoutExpired):
                    proc.kill()
                    proc.wait()
        if os.path.exists(path):
            os.unlink(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
