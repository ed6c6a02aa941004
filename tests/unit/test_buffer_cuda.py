"""LocalEngramBuffer and EngramGroup on CUDA ranks (several ranks may share one GPU).

Each multi-rank case runs this file as a script that spawns the ranks. Every rank joins a private gloo
group (what EngramGroup uses; CUDA shards travel through CUDA IPC), writes its own shards, fetches, and checks
every hook against an independent gather from the full tables computed on the CPU. On CUDA it also
checks that fetch never synchronizes the host (sync debug mode "error") and that a fetch captured in a
CUDA graph, replayed after new indices are copied into the captured input, gives the right rows.

The same rank code runs on CPU ranks with the CUDA gathers forced: the one-pass Triton kernel (in
Triton's interpreter, over the same table of shard addresses) and the fixed-shape fallback, so the
checking code and both gathers are exercised on machines without a GPU too. No environment variable
is set for ranks that share a GPU (none is needed). Every rank reports how many checks it ran; the test
fails unless each ran them all.
"""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.unit

HIDDEN = 256
ROWS = [40, 24]  # per rank
ENTRIES = 3
MAX_TOKENS = 64
TOKEN_COUNTS = (1, 5, 7, 64)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GROUP_DEVICE = "cuda"  # of the EngramGroup tests (a scratch run may set "cpu" to exercise the test code itself)


def _pkg_parent() -> str:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.join(root, ".host", "pkg")


def _tables(world: int, fp8: bool):
    """Full tables (every rank's rows) and, for FP8, their scales; the same on every rank (seeded)."""
    from helpers.engram_tables import seeded_tables

    return seeded_tables([world * n for n in ROWS], HIDDEN, fp8, seed=4321)


def _indices(world: int, tokens: int, seed: int) -> torch.Tensor:
    from helpers.engram_tables import seeded_indices

    return seeded_indices([world * n for n in ROWS], ENTRIES, tokens, seed)


def check_results(results: list, indices: torch.Tensor, full: list, sfs: list | None, tma: bool) -> int:
    """Assert that fetched hook results equal the reference for `indices` (CPU); returns checks made."""
    from helpers.engram_tables import expected_rows

    fp8 = sfs is not None
    tokens = indices.shape[1]
    checks = 0
    assert len(results) == len(ROWS)
    for layer, result in enumerate(results):
        data, sf = result if fp8 else (result, None)
        assert data.shape == (tokens, ENTRIES * HIDDEN) and data.is_contiguous(), (layer, tuple(data.shape))
        assert data.dtype == (torch.float8_e4m3fn if fp8 else torch.bfloat16), data.dtype
        got = (data.view(torch.uint8) if fp8 else data).cpu().reshape(-1, HIDDEN)
        want = expected_rows(full[layer], indices[layer])
        assert torch.equal(got, want), f"data of layer {layer} differs from the reference"
        checks += 1
        if fp8:
            width = ENTRIES * sfs[0].shape[1]
            assert sf.dtype == torch.int32 and sf.shape == (tokens, width), (sf.dtype, tuple(sf.shape))
            if tma:
                mn = -(-tokens // 4) * 4
                assert sf.stride() == (1, mn) and sf.storage_offset() == layer * width * mn, (sf.stride(), sf.storage_offset())
            else:
                assert sf.stride() == (width, 1), sf.stride()
            want_sf = expected_rows(sfs[layer], indices[layer]).reshape(tokens, width)
            assert torch.equal(sf.cpu().contiguous(), want_sf), f"scales of layer {layer} differ from the reference"
            checks += 1
    return checks


def _fetch_no_sync(buffer, indices: torch.Tensor, tma: bool) -> list:
    """Fetch with the host-sync detector set to raise; results are read after it is reset."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        results = [hook() for hook in buffer.fetch(indices, use_tma_aligned_col_major_sf=tma)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return results


def _fetch_in_graph(buffer, first: torch.Tensor, second: torch.Tensor, tma: bool) -> list:
    """Capture a fetch of `first` in a CUDA graph, copy `second` into its input, replay; the outputs."""
    static = first.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture, as torch recommends
        buffer.fetch(static, use_tma_aligned_col_major_sf=tma)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        results = [hook() for hook in buffer.fetch(static, use_tma_aligned_col_major_sf=tma)]
    static.copy_(second)
    graph.replay()
    torch.cuda.synchronize()
    graph_keepalive.append(graph)
    return results


graph_keepalive: list = []


def _rank_main(rank: int, world: int, port: int, out_dir: str, device_kind: str, gather: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    sys.path.insert(0, os.environ["ENGRAM_TEST_PKG"])
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
    from fp8_engram.engram import ue8m0
    from fp8_engram.engram.buffer import LocalEngramBuffer
    from fp8_engram.engram.allocators import barrier
    from fp8_engram.engram.worker import gloo_group

    if device_kind == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    timeout = timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timeout)
    group = gloo_group(store, rank, world, timeout)
    checks = 0
    for fp8 in (False, True):
        dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        packs = ue8m0.num_sf_packs(HIDDEN) if fp8 else 0
        buffer = LocalEngramBuffer(group, ROWS, HIDDEN, MAX_TOKENS, ENTRIES, dtype, packs, device=device, gather=None if gather == "auto" else gather)
        assert buffer.gather_mode == ("triton" if gather == "auto" else gather), buffer.gather_mode
        full, sfs = _tables(world, fp8)
        mine = [t[rank * n : (rank + 1) * n].contiguous() for t, n in zip(full, ROWS)]
        if fp8:
            own = [s[rank * n : (rank + 1) * n].contiguous() for s, n in zip(sfs, ROWS)]
            buffer.write(mine, own if rank == 0 else [s.contiguous() for s in sfs])
        else:
            buffer.write(mine)
        for tokens in TOKEN_COUNTS:
            for tma in (True, False):
                indices = _indices(world, tokens, seed=tokens * 10 + int(tma) + 100 * int(fp8))
                results = [hook() for hook in buffer.fetch(indices.to(device), use_tma_aligned_col_major_sf=tma)]
                checks += check_results(results, indices, full, sfs, tma)
                if device.type == "cuda":
                    checks += check_results(_fetch_no_sync(buffer, indices.to(device), tma), indices, full, sfs, tma)
                    second = _indices(world, tokens, seed=tokens * 10 + int(tma) + 100 * int(fp8) + 5000)
                    checks += check_results(_fetch_in_graph(buffer, indices.to(device), second.to(device), tma), second, full, sfs, tma)
        graph_keepalive.clear()
        barrier(group, torch.device("cpu"), device)  # no rank still reads a shard that its owner frees
        buffer.destroy()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"checks": checks, "device": str(device)}, f)
    # Skip interpreter teardown: a gloo group whose peers already left can block in its destructor.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def expected_checks(device_kind: str) -> int:
    per_fetch = len(ROWS) + 2 * len(ROWS)  # BF16: data per layer; FP8: data and scales per layer
    per_case = 3 if device_kind == "cuda" else 1  # plain fetch; on CUDA also no-sync and graph replay
    return per_fetch * per_case * len(TOKEN_COUNTS) * 2  # x both scale layouts


def _run_ranks(world: int, device_kind: str, gather: str, tmp_path) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, ENGRAM_TEST_PKG=_pkg_parent(), OMP_NUM_THREADS="1")
    env.pop("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", None)  # ranks sharing a GPU need nothing set
    proc = subprocess.run(
        [sys.executable, __file__, str(world), str(port), str(tmp_path), device_kind, gather], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for r, report in enumerate(reports):
        assert report["checks"] == expected_checks(device_kind), f"rank {r} ran {report['checks']} checks: {report}"
    return reports


@pytest.mark.parametrize("gather", ["triton", "fixed_shape"])
@pytest.mark.parametrize("world", [1, 2])
def test_cuda_gathers_match_reference_on_cpu_ranks(world, gather, tmp_path):
    """The CUDA gathers (forced; the Triton kernel interpreted) on CPU ranks: same checks, no GPU needed."""
    if gather == "triton":
        pytest.importorskip("triton")
    _run_ranks(world, "cpu", gather, tmp_path)


@needs_cuda
@pytest.mark.parametrize("world", [1, 2])
def test_cuda_fetch_matches_reference_without_host_sync_and_in_cuda_graphs(world, tmp_path):
    reports = _run_ranks(world, "cuda", "auto", tmp_path)
    assert all(r["device"].startswith("cuda") for r in reports)


def _filled_group_and_local_store(dtype):
    from fp8_engram.engram.group import EngramGroup
    from fp8_engram.engram.store import LocalRowStore

    group = EngramGroup([1001, 333], HIDDEN, dtype, num_ranks=2, device=GROUP_DEVICE, num_entries_per_token=4, num_max_tokens=32)
    try:
        assert group.device.type == GROUP_DEVICE
        if GROUP_DEVICE == "cuda":
            assert group.buffer.gather_mode == "triton"
        assert len(group.ping()) == 1
        local = LocalRowStore(group.rows_per_layer, HIDDEN, dtype)
        g = torch.Generator().manual_seed(7)
        for layer, n in enumerate(group.rows_per_layer):
            ids = torch.randint(0, n, (300,), generator=g)  # repeats: the last value wins in both
            values = torch.randn(300, HIDDEN, generator=g)
            group.write_rows(layer, ids, values)
            local.write_rows(layer, ids, values)
    except BaseException:
        group.close()
        raise
    return group, local


def _assert_same_fetch(group, local, indices: torch.Tensor) -> None:
    for layer, (a, b) in enumerate(zip(group.fetch_rows(indices), local.fetch_rows(indices))):
        assert a.shape == b.shape == (indices.shape[1], indices.shape[2], HIDDEN)
        assert torch.equal(a.cpu(), b), f"fetch_rows of layer {layer} differs from LocalRowStore"
        assert float(b.abs().sum()) > 0, "the reference is all zero: the check would prove nothing"


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_engram_group_on_cuda_matches_local_store(dtype):
    group, local = _filled_group_and_local_store(dtype)
    try:
        g = torch.Generator().manual_seed(8)
        _assert_same_fetch(group, local, torch.randint(-2, 1100, (2, 5, 4), generator=g, dtype=torch.int32))
        for layer, n in enumerate(group.rows_per_layer):
            rows = torch.randint(0, n, (50,), generator=g)
            assert torch.equal(group.read_rows(layer, rows).cpu(), local.read_rows(layer, rows)), f"read_rows of layer {layer}"
        # The DeepEP-style fetch of the host's buffer agrees byte for byte with the local tables.
        indices = torch.randint(-2, 1100, (2, 5, 4), generator=g, dtype=torch.int32)
        hooks = group.buffer.fetch(indices.to(group.device))
        for layer in (1, 0):
            result = hooks[layer]()
            data = result[0] if isinstance(result, tuple) else result
            got = data.view(torch.uint8).cpu().reshape(-1, local.tables[layer].view(torch.uint8).shape[1])
            ids = indices[layer].reshape(-1).long()
            valid = (ids >= 0) & (ids < group.rows_per_layer[layer])
            assert torch.equal(got[valid], local.tables[layer].view(torch.uint8)[ids[valid]]) and torch.all(got[~valid] == 0)
    finally:
        group.close()
        local.close()


@needs_cuda
def test_engram_group_on_cuda_table_file_round_trip(tmp_path):
    """Save, clear, load: the worker reads its own row ranges into its shard on the GPU."""
    group, local = _filled_group_and_local_store(torch.float8_e4m3fn)
    try:
        indices = torch.randint(-2, 1100, (2, 9, 4), generator=torch.Generator().manual_seed(9), dtype=torch.int32)
        path = tmp_path / "table.safetensors"
        group.save_table_file(str(path))
        for layer, n in enumerate(group.rows_per_layer):
            group.write_rows(layer, torch.arange(n), torch.zeros(n, HIDDEN))
        group.load_table_file(str(path))
        _assert_same_fetch(group, local, indices)
        per_rank = group.rows_per_rank
        for layer in range(group.num_layers):
            ranges = sorted(tuple(group.last_load_ranges[r][layer][1:]) for r in range(group.num_ranks))
            assert ranges == [(r * per_rank[layer], (r + 1) * per_rank[layer]) for r in range(group.num_ranks)]
    finally:
        group.close()
        local.close()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    world, port, out_dir, device_kind, gather = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    mp.spawn(_rank_main, args=(world, port, out_dir, device_kind, gather), nprocs=world)
