"""Engram groups come and go in one process: several at once, one after another, any size and rank count.

Every fetch is checked against an independent implementation: LocalRowStore (plain tensors, one select)
filled with the same writes, compared bit for bit, and the DeepEP-style `buffer.fetch` against row-by-row
lookups in those tables (rows and scale factors, both layouts, invalid ids). On CUDA the groups also
fetch without synchronizing the host, replay a captured CUDA graph with new indices, leave no torch
allocation behind, and hand their shards' GPU memory back to the driver on close.
"""

import gc
import os

import pytest
import torch

from fp8_engram.engram.allocators import leftover_segments
from fp8_engram.engram.group import EngramGroup, EngramWorkerError
from fp8_engram.engram.store import LocalRowStore
from helpers.procs import process_ended

pytestmark = pytest.mark.unit

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ENTRIES = 4
MAX_TOKENS = 16


def _fill(group: EngramGroup, seed: int) -> LocalRowStore:
    """Write the same random rows into the group and into a LocalRowStore; returns the latter.

    Every row is written (the two start with different scale words in unwritten FP8 rows), a third of
    them twice: the last value wins in both.
    """
    local = LocalRowStore(group.rows_per_layer, group.hidden, group.table_dtype)
    g = torch.Generator().manual_seed(seed)
    for layer, n in enumerate(group.rows_per_layer):
        ids = torch.cat([torch.randperm(n, generator=g), torch.randint(0, n, (n // 3,), generator=g)])
        values = torch.randn(ids.numel(), group.hidden, generator=g)
        group.write_rows(layer, ids, values)
        local.write_rows(layer, ids, values)
    return local


def _indices(group: EngramGroup, tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    top = max(group.rows_per_layer)
    idx = torch.randint(-3, top + 4, (group.num_layers, tokens, ENTRIES), generator=g, dtype=torch.int32)
    idx[0, 0, 0] = -1
    idx[-1, -1, -1] = group.rows_per_layer[-1]  # first id past the table
    return idx


def _expected(local: LocalRowStore, layer: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Row bytes (and scale rows) of each id looked up one by one; zeros for invalid ids."""
    table = local.tables[layer].view(torch.uint8)
    rows = torch.zeros(ids.numel(), table.shape[1], dtype=torch.uint8)
    sfs = torch.zeros(ids.numel(), local.scales[layer].shape[1], dtype=torch.int32) if local.scales is not None else None
    for i, g in enumerate(ids.reshape(-1).tolist()):
        if 0 <= g < table.shape[0]:
            rows[i] = table[g]
            if sfs is not None:
                sfs[i] = local.scales[layer][g]
    return rows, sfs


def check_hooks(results: list, local: LocalRowStore, indices: torch.Tensor, tma: bool) -> int:
    """The DeepEP-style fetch results against row-by-row lookups; returns how many tensors were compared."""
    tokens = indices.shape[1]
    checks = 0
    for layer, result in enumerate(results):
        data, sf = result if local.scales is not None else (result, None)
        want_rows, want_sfs = _expected(local, layer, indices[layer])
        assert torch.equal(data.view(torch.uint8).cpu().reshape(want_rows.shape), want_rows), f"rows of layer {layer}"
        checks += 1
        if sf is not None:
            width = want_sfs.shape[1] * ENTRIES
            if tma:
                assert sf.stride() == (1, -(-tokens // 4) * 4), sf.stride()
            else:
                assert sf.stride() == (width, 1), sf.stride()
            assert torch.equal(sf.cpu().contiguous(), want_sfs.reshape(tokens, width)), f"scales of layer {layer} (tma={tma})"
            checks += 1
    return checks


def check_group(group: EngramGroup, local: LocalRowStore, seed: int) -> None:
    """fetch_rows == LocalRowStore bit for bit; buffer.fetch == row-by-row lookups (both scale layouts)."""
    indices = _indices(group, 7, seed)
    for layer, (a, b) in enumerate(zip(group.fetch_rows(indices), local.fetch_rows(indices))):
        assert torch.equal(a.cpu(), b), f"fetch_rows of layer {layer} differs from LocalRowStore ({group})"
        assert float(b.abs().sum()) > 0, "the reference is all zero: the check would prove nothing"
    for tma in (True, False):
        hooks = group.buffer.fetch(indices.to(group.device), use_tma_aligned_col_major_sf=tma)
        assert check_hooks([h() for h in hooks], local, indices, tma) == group.num_layers * (2 if local.scales is not None else 1)


def test_three_cpu_groups_in_one_process_two_alive_at_once():
    first = EngramGroup([500, 130], 256, torch.bfloat16, num_ranks=2, device="cpu", num_entries_per_token=ENTRIES, num_max_tokens=MAX_TOKENS)
    second = None
    third = None
    try:
        first_local = _fill(first, 1)
        second = EngramGroup([301], 512, torch.float8_e4m3fn, num_ranks=3, device="cpu", num_entries_per_token=ENTRIES, num_max_tokens=MAX_TOKENS)
        second_local = _fill(second, 2)
        assert first.alive and second.alive
        check_group(first, first_local, 10)
        check_group(second, second_local, 11)
        pids = first.worker_pids
        first.close()
        first.close()  # idempotent
        assert not first.alive and all(process_ended(p) for p in pids)
        with pytest.raises(RuntimeError, match="closed"):
            first.check()
        # A third group, of another size and rank count, while the second lives on.
        third = EngramGroup([64, 64, 96], 256, torch.bfloat16, num_ranks=1, device="cpu", num_entries_per_token=ENTRIES, num_max_tokens=MAX_TOKENS)
        third_local = _fill(third, 3)
        check_group(third, third_local, 12)
        check_group(second, second_local, 13)
        second.check()
        third.check()
    finally:
        for g in (first, second, third):
            if g is not None:
                g.close()
    assert not leftover_segments(os.getpid())


def test_the_worker_template_outlives_its_last_group_for_a_rebuild(monkeypatch):
    """A memory rebuilt with other settings closes its group, then makes a new one: the template the
    workers fork from stays up TEMPLATE_LINGER_S for it (no 5-10 s restart), and goes once unused that
    long or when asked (ComfyUI's "free model memory")."""
    import time

    from fp8_engram.engram import processes as group_mod  # the template and its linger time live there

    def make(rows):
        g = EngramGroup([rows], 256, torch.bfloat16, num_ranks=2, device="cpu", num_entries_per_token=ENTRIES, num_max_tokens=MAX_TOKENS)
        check_group(g, _fill(g, rows), 1)
        return g

    monkeypatch.setattr(group_mod, "TEMPLATE_LINGER_S", 1.5)
    first = make(200)
    template = group_mod._template
    assert template is not None and template.alive
    first.close()
    assert group_mod.template_running(), "the template stopped with its last group"
    second = make(300)  # forked from the same template
    assert group_mod._template is template
    second.close()
    deadline = time.monotonic() + 30
    while not process_ended(template.process.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not group_mod.template_running() and process_ended(template.process.pid), "the idle template was not stopped"

    monkeypatch.setattr(group_mod, "TEMPLATE_LINGER_S", 600.0)
    third = make(100)
    third_template = group_mod._template
    third.close()
    assert group_mod.template_running()
    assert group_mod.stop_idle_template() and not group_mod.template_running()
    assert process_ended(third_template.process.pid)
    assert not group_mod.stop_idle_template()  # none left to stop


def test_health_check_names_the_dead_rank():
    import signal
    import time

    group = EngramGroup([64], 256, num_ranks=3, device="cpu")
    try:
        assert group.alive
        group.check()
        pid = group.worker_pids[1]  # rank 2
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while group.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not group.alive
        with pytest.raises(EngramWorkerError, match="rank 2") as info:
            group.check()
        assert info.value.rank == 2
    finally:
        group.close()


# ----- CUDA -----


def _fetch_without_host_sync(group: EngramGroup, indices: torch.Tensor, tma: bool) -> list:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return [h() for h in group.buffer.fetch(indices, use_tma_aligned_col_major_sf=tma)]
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _fetch_in_graph(group: EngramGroup, first: torch.Tensor, second: torch.Tensor, tma: bool) -> tuple[list, object]:
    static = first.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        group.buffer.fetch(static, use_tma_aligned_col_major_sf=tma)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        results = [h() for h in group.buffer.fetch(static, use_tma_aligned_col_major_sf=tma)]
    static.copy_(second)
    graph.replay()
    torch.cuda.synchronize()
    return results, graph


def _exercise_cuda_group(group: EngramGroup, seed: int) -> None:
    assert group.buffer.gather_mode == "triton", group.buffer.gather_mode
    local = _fill(group, seed)
    try:
        check_group(group, local, seed + 100)
        for tma in (True, False):
            indices = _indices(group, 9, seed + 200 + tma)
            check_hooks(_fetch_without_host_sync(group, indices.to(group.device), tma), local, indices, tma)
            second = _indices(group, 9, seed + 300 + tma)
            results, graph = _fetch_in_graph(group, indices.to(group.device), second.to(group.device), tma)
            check_hooks(results, local, second, tma)
            del results, graph
    finally:
        local.close()


def _allocated(device: torch.device) -> int:
    gc.collect()
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def _free_on_device(device: torch.device) -> int:
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


@needs_cuda
def test_cuda_groups_of_1_2_4_ranks_one_after_another():
    device = torch.device("cuda", 0)
    for ranks, dtype in ((1, torch.float8_e4m3fn), (2, torch.bfloat16), (4, torch.float8_e4m3fn)):
        before = _allocated(device)
        group = EngramGroup([1000, 257], 256, dtype, num_ranks=ranks, device="cuda", num_entries_per_token=ENTRIES, num_max_tokens=MAX_TOKENS)
        try:
            _exercise_cuda_group(group, seed=ranks)
        finally:
            pids = group.worker_pids
            group.close()
        assert all(process_ended(p) for p in pids), f"a worker of the {ranks}-rank group outlived close()"
        after = _allocated(device)
        assert after == before, f"{ranks}-rank group: {after - before} bytes of torch-allocated GPU memory left after close()"


@needs_cuda
def test_cuda_group_gives_its_gpu_memory_back_on_close():
    """Shards come from the driver: the device's free memory drops by every shard and comes back on close."""
    import time

    device = torch.device("cuda", 0)
    ranks = 2
    rows_per_rank = 1 << 19  # 256 MiB of BF16 rows (hidden 256) per rank, all on this GPU
    shard_bytes = rows_per_rank * 256 * 2
    slack = 128 << 20  # kernel modules, worker contexts still being torn down
    free_before = _free_on_device(device)
    group = EngramGroup([ranks * rows_per_rank], 256, torch.bfloat16, num_ranks=ranks, device="cuda")
    try:
        used = free_before - _free_on_device(device)
        assert used >= ranks * shard_bytes, f"{ranks} rank(s) took {used} bytes, less than their shards ({ranks * shard_bytes})"
    finally:
        group.close()
    deadline = time.monotonic() + 5.0
    while _free_on_device(device) < free_before - slack and time.monotonic() < deadline:
        time.sleep(0.1)
    missing = free_before - _free_on_device(device)
    assert missing <= slack, f"{missing} bytes of GPU memory still missing after close() of a {ranks}-rank group"


@needs_cuda
def test_two_cuda_groups_alive_at_once():
    first = EngramGroup([300], 256, torch.bfloat16, num_ranks=2, device="cuda", num_entries_per_token=ENTRIES, num_max_tokens=MAX_TOKENS)
    second = None
    try:
        second = EngramGroup([200, 90], 512, torch.float8_e4m3fn, num_ranks=3, device="cuda", num_entries_per_token=ENTRIES, num_max_tokens=MAX_TOKENS)
        _exercise_cuda_group(first, seed=21)
        _exercise_cuda_group(second, seed=22)
        first.close()
        _exercise_cuda_group(second, seed=23)
    finally:
        first.close()
        if second is not None:
            second.close()


@needs_cuda
def test_cuda_shard_view_kept_after_close_stays_valid_then_frees():
    """A view taken from shard() and kept past close() owns its mapping: it still reads the rows
    (not freed memory), and the GPU memory comes back once it is dropped."""
    import time

    device = torch.device("cuda", 0)
    rows_per_rank = 1 << 18  # 128 MiB of BF16 rows per rank
    shard_bytes = rows_per_rank * 256 * 2
    slack = 128 << 20
    free_before = _free_on_device(device)
    group = EngramGroup([2 * rows_per_rank], 256, torch.bfloat16, num_ranks=2, device="cuda")
    rows = torch.tensor([0, 5, rows_per_rank + 3])
    values = torch.randn(3, 256).to(torch.bfloat16)
    group.write_rows(0, rows, values)
    kept = group.buffer.shard(1, 0)[0][3:4]  # rank 1's row 3 = global row rows_per_rank + 3
    group.close()
    assert torch.equal(kept.cpu(), values[2:3]), "a view kept past close() lost its rows"
    assert free_before - _free_on_device(device) >= shard_bytes, "rank 1's shard was freed under a live view"
    del kept
    deadline = time.monotonic() + 5.0
    while _free_on_device(device) < free_before - slack and time.monotonic() < deadline:
        time.sleep(0.1)
    assert free_before - _free_on_device(device) <= slack, "the shard was not freed after its last view"
