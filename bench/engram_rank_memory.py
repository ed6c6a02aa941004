"""What one CPU rank of an engram group costs in host memory.

    python bench/engram_rank_memory.py [--ranks 1 2 4] [--rows 1021]

Starts an EngramGroup of each rank count in turn (a tiny table, so the shards are negligible and the
figures are the cost of a worker itself), and measures:
- per worker: private memory (USS = Private_Clean + Private_Dirty) and PSS, from /proc/<pid>/smaps_rollup,
  and the USS of the template process CPU workers are forked from (0 where workers are started otherwise);
- the machine: MemAvailable before the group and with it up, divided by the workers added.
MemAvailable moves with everything else the machine runs, so the per-rank drop is noisy on a shared
machine; USS is the process's own figure. Prints a table and, last, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / ".host" / "pkg"))


def smaps_rollup(pid: int) -> dict[str, int]:
    """Fields of /proc/<pid>/smaps_rollup in bytes."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[1])


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rows", type=int, default=1021)
    parser.add_argument("--settle", type=float, default=1.0, help="seconds to wait before measuring")
    args = parser.parse_args()
    import torch

    from fp8_engram.engram.group import EngramGroup

    mib = 1 << 20
    results = []
    for ranks in args.ranks:
        time.sleep(args.settle)
        before = mem_available()
        started = time.monotonic()
        group = EngramGroup([args.rows] * 2, 64, torch.bfloat16, num_ranks=ranks, device="cpu")
        start_s = time.monotonic() - started
        try:
            time.sleep(args.settle)
            after = mem_available()
            rollups = [smaps_rollup(pid) for pid in group.worker_pids]
            parents = {parent_pid(pid) for pid in group.worker_pids} - {os.getpid()}
            template = [smaps_rollup(pid) for pid in parents]  # the process CPU workers are forked from
            uss = [r["Private_Clean"] + r["Private_Dirty"] for r in rollups]
            pss = [r["Pss"] for r in rollups]
            row = {
                "ranks": ranks,
                "workers": len(rollups),
                "start_s": round(start_s, 2),
                "uss_mib_mean": round(sum(uss) / len(uss) / mib, 1) if uss else 0.0,
                "pss_mib_mean": round(sum(pss) / len(pss) / mib, 1) if pss else 0.0,
                "pss_total_mib": round((sum(pss) + sum(r["Pss"] for r in template)) / mib, 1),
                "template_uss_mib": round(sum(r["Private_Clean"] + r["Private_Dirty"] for r in template) / mib, 1),
                "available_drop_mib": round((before - after) / mib, 1),
                "available_drop_mib_per_worker": round((before - after) / max(len(rollups), 1) / mib, 1),
            }
        finally:
            group.close()
        results.append(row)
        print(f"{ranks:3d} ranks: start {row['start_s']:6.2f} s, per worker USS {row['uss_mib_mean']:7.1f} MiB, "
              f"PSS {row['pss_mib_mean']:7.1f} MiB (workers + template: {row['pss_total_mib']:7.1f} MiB); template USS {row['template_uss_mib']:6.1f} MiB; MemAvailable drop "
              f"{row['available_drop_mib']:7.1f} MiB in all, {row['available_drop_mib_per_worker']:7.1f} MiB per worker", flush=True)
    print(json.dumps({"bench": "engram_rank_memory", "pid": os.getpid(), "results": results}))


if __name__ == "__main__":
    main()
