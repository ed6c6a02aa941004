"""Engram fetch on CPU or CUDA ranks: LocalEngramBuffer.fetch vs the local index_select floor and the reference gather.

For each (ranks, hidden, rows per rank, tokens) it starts an EngramGroup (real worker processes; CPU:
gloo + shared memory; CUDA: symmetric memory, rank r on GPU r % device_count, so with one GPU the ranks
share it), fills the shards with random BF16 rows and times, side by side:

  floor  one local `index_select` of the same rows from a single plain tensor holding the whole table
  ours   `group.buffer.fetch(indices)` in the host (reads every peer's shard directly)
  ref    a re-implementation of the reference's gather: one masked full-width pass per peer
         (`index_select` of all ids from each peer with foreign ids redirected to row 0, then `where`)

On CUDA each call is timed with CUDA events (the fetch never synchronizes the host).
Prints a table and, last, one JSON line with every ratio.
Run: `python bench/engram_fetch.py [--device cpu|cuda] [--quick]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".host", "pkg"))

from fp8_engram.engram.group import EngramGroup  # noqa: E402

ENTRIES = 16


def timed_side_by_side(fns: dict, repeats: int, device: str = "cpu") -> dict:
    """Median seconds per function, calls interleaved round-robin so that load on the machine hits all alike."""
    for fn in fns.values():
        fn()
        fn()
    samples = {name: [] for name in fns}
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
    for _ in range(repeats):
        for name, fn in fns.items():
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples[name].append(start.elapsed_time(end) / 1e3)
            else:
                start = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(v) for name, v in samples.items()}


def reference_gather(peer_tables: list[torch.Tensor], ids: torch.Tensor, rows_per_rank: int) -> torch.Tensor:
    """The reference's fetch of one layer: per peer, a full-width select and a masked merge."""
    ids = ids.to(torch.int64)
    valid = (ids >= 0) & (ids < len(peer_tables) * rows_per_rank)
    owner = torch.where(valid, torch.div(ids, rows_per_rank, rounding_mode="floor"), -1)
    local = torch.where(valid, ids - owner * rows_per_rank, 0)
    out = torch.zeros((ids.numel(), peer_tables[0].shape[1]), dtype=peer_tables[0].dtype, device=ids.device)
    for peer, table in enumerate(peer_tables):
        mine = owner == peer
        rows = table.index_select(0, torch.where(mine, local, 0))
        out = torch.where(mine.unsqueeze(1), rows, out)
    return out


def run_case(ranks: int, hidden: int, rows_per_rank: int, tokens: int, repeats: int, device: str = "cpu") -> dict:
    group = EngramGroup(
        [ranks * rows_per_rank], hidden, torch.bfloat16, num_ranks=ranks, device=device, num_entries_per_token=ENTRIES, num_max_tokens=tokens
    )
    try:
        buffer = group.buffer
        dev = buffer.device
        shards = [buffer.shard(r, 0)[0] for r in range(ranks)]  # on CUDA: peers' shards mapped into this process
        g = torch.Generator(device=dev).manual_seed(0)
        for shard in shards:
            shard.uniform_(-1, 1, generator=g)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        floor_table = torch.cat(shards)  # the same rows in one plain local tensor
        total = ranks * rows_per_rank
        indices = torch.randint(0, total, (1, tokens, ENTRIES), generator=g, dtype=torch.int32, device=dev)
        indices.view(-1)[:: 97] = -1  # ~1% dead tokens
        flat = indices.view(-1)
        floor_ids = flat.clamp(min=0).to(torch.int64)
        word_tables = [s.view(torch.int64) for s in shards]

        def ours():
            return buffer.fetch(indices)[0]()

        # Correctness side by side before timing.
        expect = floor_table.index_select(0, floor_ids)
        expect[flat < 0] = 0
        got = ours().view(-1, hidden)
        ref_out = reference_gather(word_tables, flat, rows_per_rank).view(torch.bfloat16)
        assert torch.equal(got, expect) and torch.equal(ref_out, expect), "fetch results differ"

        times = timed_side_by_side(
            {
                "floor": lambda: floor_table.index_select(0, floor_ids),
                "ours": ours,
                "ref": lambda: reference_gather(word_tables, flat, rows_per_rank),
            },
            repeats,
            dev.type,
        )
        t_floor, t_ours, t_ref = times["floor"], times["ours"], times["ref"]
        moved = tokens * ENTRIES * hidden * 2
        return {
            "ranks": ranks,
            "gather": buffer.gather_mode,
            "hidden": hidden,
            "rows_per_rank": rows_per_rank,
            "tokens": tokens,
            "floor_ms": t_floor * 1e3,
            "ours_ms": t_ours * 1e3,
            "ref_ms": t_ref * 1e3,
            "ours_over_floor": t_ours / t_floor,
            "ref_over_ours": t_ref / t_ours,
            "ours_gbps": moved / t_ours / 1e9,
        }
    finally:
        group.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="CPU ranks, or CUDA ranks (sharing the GPU if there is one)")
    parser.add_argument("--quick", action="store_true", help="small sizes only (a smoke run)")
    parser.add_argument("--ranks", default="1,2,4", help="comma-separated rank counts (8 fits small sizes on the CPU)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 9 on the CPU, 25 on CUDA)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU")
    repeats = args.repeats or (25 if args.device == "cuda" else 9)
    ranks_list = [int(r) for r in args.ranks.split(",")]
    # (hidden, rows per rank, tokens); the largest case holds 4 x 512 MiB of shards + a 2 GiB floor copy.
    cases = [(256, 1 << 20, 4096), (1024, 1 << 18, 2048), (2048, 1 << 16, 512), (2048, 1 << 16, 4096)]
    if args.device == "cuda":
        # Every case starts a group (a CUDA context per worker): three cases keep the run short.
        cases = [(256, 1 << 20, 4096), (768, 1 << 18, 512), (2048, 1 << 16, 4096)]
    if args.quick:
        cases = [(256, 1 << 16, 512), (2048, 1 << 14, 512)]
    results = []
    header = f"{'ranks':>5} {'hidden':>6} {'rows/rank':>9} {'tokens':>6} {'floor ms':>9} {'ours ms':>8} {'ref ms':>8} {'ours/floor':>10} {'ref/ours':>8} {'GB/s':>6}"
    print(header)
    print("-" * len(header))
    for ranks in ranks_list:
        for hidden, rows, tokens in cases:
            r = run_case(ranks, hidden, rows, tokens, repeats, args.device)
            results.append(r)
            print(
                f"{r['ranks']:>5} {r['hidden']:>6} {r['rows_per_rank']:>9} {r['tokens']:>6} {r['floor_ms']:>9.2f} {r['ours_ms']:>8.2f} "
                f"{r['ref_ms']:>8.2f} {r['ours_over_floor']:>10.2f} {r['ref_over_ours']:>8.2f} {r['ours_gbps']:>6.2f}",
                flush=True,
            )
    summary = {
        "bench": "engram_fetch",
        "device": args.device,
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "entries_per_token": ENTRIES,
        "max_ours_over_floor": max(r["ours_over_floor"] for r in results),
        "min_ref_over_ours_at_4_ranks": min((r["ref_over_ours"] for r in results if r["ranks"] == 4), default=None),
        "cases": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in results],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
