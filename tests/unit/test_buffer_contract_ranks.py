"""LocalEngramBuffer keeps DeepEP's EngramBuffer contract on 1, 2 and 4 real CPU ranks (gloo; buffers on
the CPU even where a GPU exists).

Each case runs this file as a script that spawns the ranks; every rank writes its own shards with
`write()`, fetches, and checks every hook against an independent gather from the full tables.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.unit

HIDDEN = 256
ROWS = [40, 24]  # per rank
ENTRIES = 3


def _tables(world: int, fp8: bool):
    from helpers.engram_tables import seeded_tables

    return seeded_tables([world * n for n in ROWS], HIDDEN, fp8, seed=1234)


def _check_case(buffer, world: int, fp8: bool, tokens: int, tma: bool, order: list[int]) -> None:
    from helpers.engram_tables import check_fetch, seeded_indices

    full, sfs = _tables(world, fp8)
    indices = seeded_indices([world * n for n in ROWS], ENTRIES, tokens, seed=tokens * 7 + int(tma))
    check_fetch(buffer, full, sfs, indices, tma, order)


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    sys.path.insert(0, os.environ["ENGRAM_TEST_PKG"])
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
    from fp8_engram.engram import ue8m0
    from fp8_engram.engram.allocators import shared_memory_allocator
    from fp8_engram.engram.buffer import LocalEngramBuffer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.group.WORLD
    report = {"errors": {}}

    def grouped_allocator(g, num_bytes, device):  # the per-peer path (no single address range)
        memory = shared_memory_allocator(g, num_bytes, device)
        memory.unified = None
        return memory

    for fp8 in (False, True):
        for allocator in (None, grouped_allocator):
            dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
            packs = ue8m0.num_sf_packs(HIDDEN) if fp8 else 0
            buffer = LocalEngramBuffer(group, ROWS, HIDDEN, 64, ENTRIES, dtype, packs, device="cpu", allocator=allocator)
            full, sfs = _tables(world, fp8)
            mine = [t[rank * n : (rank + 1) * n].contiguous() for t, n in zip(full, ROWS)]
            if fp8:
                # rank 0 passes its own scale rows, the others the group-wide table (both are allowed)
                own = [s[rank * n : (rank + 1) * n].contiguous() for s, n in zip(sfs, ROWS)]
                buffer.write(mine, own if rank == 0 else [s.contiguous() for s in sfs])
            else:
                buffer.write(mine)
            for tokens in (1, 5, 7, 64):
                for tma in (True, False):
                    _check_case(buffer, world, fp8, tokens, tma, order=[1, 0] if tokens % 2 else [0, 1])
            if allocator is None and fp8:
                # write() validation, all ranks alike (write is collective: every rank fails before copying)
                cases = {
                    "layers": lambda: buffer.write(mine[:1], sfs),
                    "shape": lambda: buffer.write([m[:-1] for m in mine], sfs),
                    "dtype": lambda: buffer.write([m.view(torch.uint8) for m in mine], sfs),
                    "missing_sf": lambda: buffer.write(mine),
                    "sf_rows": lambda: buffer.write(mine, [s[:3] for s in sfs]),
                }
                for name, call in cases.items():
                    try:
                        call()
                    except ValueError as e:
                        report["errors"][name] = str(e)
                for name, call in {
                    "idx_dtype": lambda: buffer.fetch(torch.zeros(2, 1, ENTRIES, dtype=torch.int64)),
                    "idx_entries": lambda: buffer.fetch(torch.zeros(2, 1, ENTRIES + 1, dtype=torch.int32)),
                    "idx_tokens": lambda: buffer.fetch(torch.zeros(2, 65, ENTRIES, dtype=torch.int32)),
                }.items():
                    try:
                        call()
                    except ValueError as e:
                        report["errors"][name] = str(e)
            buffer.destroy()
    # A configuration that differs across ranks is refused on every rank.
    try:
        LocalEngramBuffer(group, [ROWS[0] + (rank == world - 1)], HIDDEN, 64, ENTRIES, device="cpu")
        report["mismatch"] = None if world > 1 else "single rank"
    except RuntimeError as e:
        report["mismatch"] = str(e)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fetch_matches_independent_gather_on_cpu_ranks(world, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pkg = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pkg_parent = os.path.join(pkg, ".host", "pkg")
    env = dict(os.environ, ENGRAM_TEST_PKG=pkg_parent, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__, str(world), str(port), str(tmp_path)], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(world):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        errors = report["errors"]
        assert set(errors) == {"layers", "shape", "dtype", "missing_sf", "sf_rows", "idx_dtype", "idx_entries", "idx_tokens"}, errors
        assert "expected 2 storages" in errors["layers"]
        assert "storage shape" in errors["shape"]
        assert "scale rows" in errors["sf_rows"]
        assert "num_max_tokens" in errors["idx_tokens"]
        if world > 1:
            assert report["mismatch"] and "differs across ranks" in report["mismatch"]


def test_single_rank_preconditions_match_deepep():
    import torch.distributed as dist

    from fp8_engram.engram.buffer import LocalEngramBuffer
    from fp8_engram.engram.worker import gloo_group
    from datetime import timedelta

    group = gloo_group(dist.HashStore(), 0, 1, timedelta(seconds=10))
    with pytest.raises(ValueError, match="num_sf_packs"):
        LocalEngramBuffer(group, [8], 256, 4, 2, torch.float8_e4m3fn, 0, device="cpu")
    with pytest.raises(ValueError, match="unsupported"):
        LocalEngramBuffer(group, [8], 256, 4, 2, torch.float16, device="cpu")
    with pytest.raises(ValueError, match="multiple of 64"):
        LocalEngramBuffer(group, [8], 16, 4, 2, device="cpu")
    with pytest.raises(ValueError, match="num_entries_per_layer"):
        LocalEngramBuffer(group, [], 256, 4, 2, device="cpu")
    buffer = LocalEngramBuffer(group, [8], 256, 4, 2, device="cpu")
    with pytest.raises(ValueError, match="no scale factors"):
        buffer.write([torch.zeros(8, 256, dtype=torch.bfloat16)], [torch.zeros(8, 1, dtype=torch.int32)])
    buffer.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        buffer.fetch(torch.zeros(1, 1, 2, dtype=torch.int32))


if __name__ == "__main__":
    import torch.multiprocessing as mp

    world, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    mp.spawn(_rank_main, args=(world, port, out_dir), nprocs=world)
