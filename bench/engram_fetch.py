"""Engram fetch on CPU or CUDA ranks: LocalEngramBuffer.fetch vs the local index_select floor and the reference gather.

For each (ranks, table dtype, hidden, rows per rank, tokens) it starts an EngramGroup (real worker
processes; CPU: gloo + shared memory; CUDA: shards shared through CUDA IPC, rank r on GPU
r % device_count, so with one GPU the ranks share it), each case in its own group, all in this one
process; fills the shards with random rows (FP8: random bytes and UE8M0 scale words) and times, side
by side:

  floor  one local `index_select` of the same rows from a single plain tensor holding the whole table
         (FP8: plus one of their scale rows); on CUDA the faster of a select of table rows and of
         int64 words
  ours   `group.buffer.fetch(indices)` in the host (reads every peer's shard directly; on CUDA the
         one-pass Triton gather, FP8 scales in the MN-major TMA-aligned layout)
  ref    a re-implementation of the reference's gather: one masked full-width pass per peer
         (`index_select` of all ids from each peer with foreign ids redirected to row 0, then `where`)

Host tier (`--tier host` or `all`): the table written to a table file in a temp folder and memory-mapped
(HostRowStore / HostEngramBuffer, one copy per machine), every row paged in once before timing, and timed
side by side with `floor`: one `index_select` of the same rows (and scales) from a plain in-memory copy.
On CUDA the host tier gathers on the host and copies asynchronously: both it and its floor (a host
select into pinned memory, then the copy) are timed on the wall clock up to a synchronize. Target on the
CPU: host/floor <= 1.2. The temp files are deleted at the end.

Before timing, every case checks the fetch bit for bit against an independent gather (rows and scale
factors; ~1% dead ids and a few past the table). CPU cases: BF16 as before; CUDA cases: 1, 2, 4 and 8
ranks on hidden 1024 BF16 and hidden 7168 FP8 + UE8M0. On CUDA every function is captured in a CUDA
graph (the fetch never synchronizes the host, so it can be) and replays are timed with CUDA events:
GPU time, without the host's launch overhead, for the floor and ours alike. GB/s counts the bytes
written (rows + scale factors).
Prints a table and, last, one JSON line with every ratio.
Run: `python bench/engram_fetch.py [--device cpu|cuda] [--quick] [--tier ranks|host|all]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".host", "pkg"))

from fp8_engram.engram.group import EngramGroup  # noqa: E402
from fp8_engram.engram.host_tier import HostRowStore  # noqa: E402

from _engram_tables import write_random_table_file  # noqa: E402

ENTRIES = 16


def timed_side_by_side(fns: dict, repeats: int, device: str = "cpu") -> dict:
    """Median seconds per call of each function, calls interleaved round-robin so that load on the machine hits all alike.

    On CUDA each function is captured `GRAPH_CALLS` times in a CUDA graph and the replay is timed with
    CUDA events: GPU time alone, as in a captured model step (a per-call event pair would also count the
    host's launch overhead whenever the GPU waits for it). A function that cannot be captured is timed
    eagerly, and the result says so.
    """
    for fn in fns.values():
        fn()
        fn()
    cuda = device == "cuda"
    runners = {name: fn for name, fn in fns.items()}
    calls = {name: 1 for name in fns}
    eager: list[str] = []
    if cuda:
        torch.cuda.synchronize()
        for name, fn in fns.items():
            try:
                runners[name] = _graphed(fn, GRAPH_CALLS)
                calls[name] = GRAPH_CALLS
            except RuntimeError as e:
                print(f"# {name}: not capturable in a CUDA graph ({e}); timed eagerly", flush=True)
                eager.append(name)
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, run in runners.items():
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                samples[name].append(start.elapsed_time(end) / 1e3 / calls[name])
            else:
                start = time.perf_counter()
                run()
                samples[name].append(time.perf_counter() - start)
    result = {name: statistics.median(v) for name, v in samples.items()}
    result["_eager"] = eager
    return result


GRAPH_CALLS = 5


def _graphed(fn, calls: int):
    """`fn` captured `calls` times in one CUDA graph; returns the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


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


def _words(t: torch.Tensor) -> torch.Tensor:
    """A [rows, bytes] table as int64 (or int32) words, the widest elements a plain select can move."""
    raw = t.view(torch.uint8)
    return raw.view(torch.int64) if raw.shape[1] % 8 == 0 else raw.view(torch.int32)


def run_case(ranks: int, hidden: int, fp8: bool, rows_per_rank: int, tokens: int, repeats: int, device: str = "cpu") -> dict:
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    group = EngramGroup(
        [ranks * rows_per_rank], hidden, dtype, num_ranks=ranks, device=device, num_entries_per_token=ENTRIES, num_max_tokens=tokens
    )
    try:
        buffer = group.buffer
        dev = buffer.device
        pairs = [buffer.shard(r, 0) for r in range(ranks)]  # on CUDA: peers' shards mapped into this process
        shards = [table for table, _ in pairs]
        scales = [sf for _, sf in pairs] if fp8 else None
        g = torch.Generator(device=dev).manual_seed(0)
        for shard in shards:
            if fp8:
                shard.view(torch.uint8).random_(0, 256, generator=g)
            else:
                shard.uniform_(-1, 1, generator=g)
        for sf in scales or []:
            sf.random_(-(2**31), 2**31 - 1, generator=g)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        # The same rows in one plain local tensor: what the floor selects from.
        floor_table = torch.cat([s.view(torch.uint8) for s in shards]).view(dtype) if fp8 else torch.cat(shards)
        floor_sf = torch.cat(scales) if fp8 else None
        total = ranks * rows_per_rank
        indices = torch.randint(0, total, (1, tokens, ENTRIES), generator=g, dtype=torch.int32, device=dev)
        indices.view(-1)[::97] = -1  # ~1% dead tokens
        indices.view(-1)[5::997] = total  # and a few ids past the table
        flat = indices.view(-1)
        valid = (flat >= 0) & (flat < total)
        floor_ids = torch.where(valid, flat, 0).to(torch.int64)
        word_tables = [_words(s) for s in shards]
        floor_words = _words(floor_table)

        def ours():
            return buffer.fetch(indices)[0]()

        # Correctness against an independent gather (one select from the plain copy, zeroed where invalid).
        expect = floor_words.index_select(0, floor_ids)
        expect[~valid] = 0
        result = ours()
        got = result[0] if fp8 else result
        assert torch.equal(_words(got.view(-1, hidden)), expect), "fetched rows differ from the independent gather"
        if fp8:
            expect_sf = floor_sf.index_select(0, floor_ids)
            expect_sf[~valid] = 0
            assert torch.equal(result[1].contiguous().view(-1, expect_sf.shape[1]), expect_sf), "fetched scale factors differ"
        ref_out = reference_gather(word_tables, flat, rows_per_rank)
        assert torch.equal(ref_out, expect), "the reference gather differs"

        floor_fns = {"floor_words": lambda: floor_words.index_select(0, floor_ids)}
        if not fp8:
            floor_fns["floor_rows"] = lambda: floor_table.index_select(0, floor_ids)
        if fp8:
            for key, fn in list(floor_fns.items()):
                floor_fns[key] = lambda fn=fn: (fn(), floor_sf.index_select(0, floor_ids))
        if dev.type == "cpu":  # today's CPU floor: a select of table rows
            floor_fns = {"floor_rows": floor_fns.get("floor_rows", floor_fns["floor_words"])}

        def ref():
            data = reference_gather(word_tables, flat, rows_per_rank)
            return (data, reference_gather(scales, flat, rows_per_rank)) if fp8 else data

        times = timed_side_by_side({**floor_fns, "ours": ours, "ref": ref}, repeats, dev.type)
        eager = times.pop("_eager")
        t_floor = min(times[k] for k in floor_fns)  # the fastest plain select is the floor
        t_ours, t_ref = times["ours"], times["ref"]
        moved = tokens * ENTRIES * (hidden * dtype.itemsize + (buffer.num_sf_packs * 4 if fp8 else 0))
        return {
            "ranks": ranks,
            "gather": buffer.gather_mode,
            "dtype": "fp8+ue8m0" if fp8 else "bf16",
            "hidden": hidden,
            "rows_per_rank": rows_per_rank,
            "tokens": tokens,
            "floor_ms": t_floor * 1e3,
            "ours_ms": t_ours * 1e3,
            "ref_ms": t_ref * 1e3,
            "ours_over_floor": t_ours / t_floor,
            "ref_over_ours": t_ref / t_ours,
            "floor_gbps": moved / t_floor / 1e9,
            "ours_gbps": moved / t_ours / 1e9,
            "timing": "cpu wall" if dev.type == "cpu" else ("cuda graph" if not eager else f"cuda graph; eager: {','.join(eager)}"),
        }
    finally:
        group.close()


def run_host_case(hidden: int, fp8: bool, rows: int, tokens: int, repeats: int, device: str, folder: str) -> dict:
    """The host tier (a mapped table file) vs one index_select from a plain in-memory copy."""
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    path = os.path.join(folder, f"host_{hidden}_{int(fp8)}_{rows}.safetensors")
    write_random_table_file(path, [rows], hidden, dtype, seed=hidden + rows)
    store = HostRowStore.from_table_file(path)
    try:
        buffer = store.buffer(num_max_tokens=tokens, num_entries_per_token=ENTRIES, device=device)
        table = store.table
        g = torch.Generator().manual_seed(1)
        # Page every row in (steady state: a served table is resident) and take the floor's plain copy.
        floor_words = table.table_words[0].clone()
        floor_sf = table.sf_words[0].clone() if fp8 else None
        indices = torch.randint(0, rows, (1, tokens, ENTRIES), generator=g, dtype=torch.int32)
        indices.view(-1)[::97] = -1  # ~1% dead tokens
        indices.view(-1)[5::997] = rows  # and a few ids past the table
        flat = indices.view(-1)
        valid = (flat >= 0) & (flat < rows)
        floor_ids = torch.where(valid, flat, 0).to(torch.int64)
        cuda = device == "cuda"
        expect = floor_words.index_select(0, floor_ids)
        expect[~valid] = 0
        result = buffer.fetch(indices)[0]()
        got = result[0] if fp8 else result
        assert torch.equal(got.cpu().view(torch.uint8).view(-1, expect.shape[1] * expect.element_size()), expect.view(torch.uint8)), "host-tier rows differ from the independent gather"
        if fp8:
            expect_sf = floor_sf.index_select(0, floor_ids)
            expect_sf[~valid] = 0
            assert torch.equal(result[1].cpu().contiguous().view(torch.uint8).view(expect_sf.shape[0], -1), expect_sf.view(torch.uint8)), "host-tier scales differ"
        pinned = {}

        def floor():
            data = floor_words.index_select(0, floor_ids)
            sf = floor_sf.index_select(0, floor_ids) if fp8 else None
            if cuda:  # the same bytes to the GPU from pinned memory
                if "data" not in pinned:
                    pinned["data"] = torch.empty_like(data).pin_memory()
                    pinned["sf"] = torch.empty_like(sf).pin_memory() if fp8 else None
                torch.index_select(floor_words, 0, floor_ids, out=pinned["data"])
                out = pinned["data"].to(device, non_blocking=True)
                if fp8:
                    torch.index_select(floor_sf, 0, floor_ids, out=pinned["sf"])
                    out = (out, pinned["sf"].to(device, non_blocking=True))
                torch.cuda.synchronize()
                return out
            return data, sf

        def host():
            out = buffer.fetch(indices)[0]()
            if cuda:
                torch.cuda.synchronize()
            return out

        times = timed_side_by_side({"floor": floor, "host": host}, repeats, "cpu")
        times.pop("_eager")
        moved = tokens * ENTRIES * (hidden * dtype.itemsize + (table.num_sf_packs * 4 if fp8 else 0))
        return {
            "tier": "host",
            "device": device,
            "dtype": "fp8+ue8m0" if fp8 else "bf16",
            "hidden": hidden,
            "rows": rows,
            "table_mib": round(table.num_bytes / 2**20, 1),
            "tokens": tokens,
            "floor_ms": times["floor"] * 1e3,
            "host_ms": times["host"] * 1e3,
            "host_over_floor": times["host"] / times["floor"],
            "floor_gbps": moved / times["floor"] / 1e9,
            "host_gbps": moved / times["host"] / 1e9,
        }
    finally:
        store.close()
        os.unlink(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="CPU ranks, or CUDA ranks (sharing the GPU if there is one)")
    parser.add_argument("--quick", action="store_true", help="small sizes only (a smoke run)")
    parser.add_argument("--ranks", default=None, help="comma-separated rank counts (default 1,2,4 on the CPU, 1,2,4,8 on CUDA)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 9 on the CPU, 25 on CUDA)")
    parser.add_argument("--tier", choices=["ranks", "host", "all"], default="all", help="device ranks (EngramGroup), the host tier, or both")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's); 1 keeps a loaded machine's thread stalls out of small ops")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU")
    cuda = args.device == "cuda"
    repeats = args.repeats or (25 if cuda else 9)
    ranks_list = [int(r) for r in (args.ranks or ("1,2,4,8" if cuda else "1,2,4")).split(",")]
    # (hidden, fp8, rows per rank, tokens); the largest CPU case holds 4 x 512 MiB of shards + a 2 GiB floor copy.
    cases = [(256, False, 1 << 20, 4096), (1024, False, 1 << 18, 2048), (2048, False, 1 << 16, 512), (2048, False, 1 << 16, 4096)]
    if cuda:
        # The issue's BF16 case (1 GiB of rows per rank) and DeepSeek-V3's FP8 + UE8M0 rows; one group
        # per case, all in this process (a CUDA context per worker: two cases keep the run short).
        cases = [(1024, False, 1 << 19, 4096), (7168, True, 1 << 16, 4096)]
    if args.quick:
        cases = [(256, False, 1 << 16, 512), (2048, False, 1 << 14, 512)]
        if cuda:
            cases.append((7168, True, 1 << 12, 512))
    results = []
    host_results = []
    if args.tier in ("host", "all"):
        # (hidden, fp8, rows, tokens): 512 MiB tables (plus the floor's 512 MiB copy) and DeepSeek's FP8 rows.
        host_cases = [(256, False, 1 << 20, 4096), (1024, False, 1 << 18, 2048), (2048, True, 1 << 18, 4096), (7168, True, 1 << 16, 4096)]
        if args.quick:
            host_cases = [(256, False, 1 << 16, 512), (2048, True, 1 << 13, 512)]
        header = f"{'tier':>5} {'dtype':>9} {'hidden':>6} {'rows':>8} {'MiB':>7} {'tokens':>6} {'floor ms':>9} {'host ms':>8} {'host/floor':>10} {'floor GB/s':>10} {'host GB/s':>9}"
        print(header)
        print("-" * len(header))
        with tempfile.TemporaryDirectory(prefix="engram_fetch_host_", dir=os.environ.get("ENGRAM_BENCH_DIR")) as folder:
            for hidden, fp8, rows, tokens in host_cases:
                r = run_host_case(hidden, fp8, rows, tokens, repeats, args.device, folder)
                host_results.append(r)
                print(
                    f"{'host':>5} {r['dtype']:>9} {r['hidden']:>6} {r['rows']:>8} {r['table_mib']:>7} {r['tokens']:>6} {r['floor_ms']:>9.3f} "
                    f"{r['host_ms']:>8.3f} {r['host_over_floor']:>10.3f} {r['floor_gbps']:>10.1f} {r['host_gbps']:>9.1f}",
                    flush=True,
                )
        print()
    if args.tier == "host":
        ranks_list = []
    header = (
        f"{'ranks':>5} {'dtype':>9} {'hidden':>6} {'rows/rank':>9} {'tokens':>6} {'floor ms':>9} {'ours ms':>8} {'ref ms':>8} "
        f"{'ours/floor':>10} {'ref/ours':>8} {'floor GB/s':>10} {'ours GB/s':>9}"
    )
    print(header)
    print("-" * len(header))
    for ranks in ranks_list:
        for hidden, fp8, rows, tokens in cases:
            r = run_case(ranks, hidden, fp8, rows, tokens, repeats, args.device)
            results.append(r)
            print(
                f"{r['ranks']:>5} {r['dtype']:>9} {r['hidden']:>6} {r['rows_per_rank']:>9} {r['tokens']:>6} {r['floor_ms']:>9.3f} {r['ours_ms']:>8.3f} "
                f"{r['ref_ms']:>8.3f} {r['ours_over_floor']:>10.2f} {r['ref_over_ours']:>8.2f} {r['floor_gbps']:>10.1f} {r['ours_gbps']:>9.1f}",
                flush=True,
            )
    summary = {
        "bench": "engram_fetch",
        "tier": args.tier,
        "device": args.device,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "entries_per_token": ENTRIES,
        "target_ours_over_floor": 1.3 if cuda else None,
        "max_ours_over_floor": max((r["ours_over_floor"] for r in results), default=None),
        "max_ours_over_floor_by_ranks": {str(k): max(r["ours_over_floor"] for r in results if r["ranks"] == k) for k in ranks_list},
        "min_ref_over_ours_at_4_ranks": min((r["ref_over_ours"] for r in results if r["ranks"] == 4), default=None),
        "target_host_over_floor": 1.2 if not cuda else None,
        "max_host_over_floor": max((r["host_over_floor"] for r in host_results), default=None),
        "cases": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in results],
        "host_cases": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in host_results],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
