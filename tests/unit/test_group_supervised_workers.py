"""EngramGroup: worker processes serve a RowStore from the host; supervision and cleanup."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from fp8_engram.engram.allocators import leftover_segments
from fp8_engram.engram.group import EngramGroup, EngramWorkerError
from fp8_engram.engram.store import LocalRowStore, RowStore
from helpers.procs import process_ended
from helpers.numerics import sqnr

pytestmark = pytest.mark.unit

HIDDEN = 256


@pytest.fixture(scope="module", params=[(1, torch.bfloat16), (2, torch.bfloat16), (4, torch.float8_e4m3fn)], ids=["1rank-bf16", "2rank-bf16", "4rank-fp8"])
def group(request):
    ranks, dtype = request.param
    g = EngramGroup([1001, 333], HIDDEN, dtype, num_ranks=ranks, device="cpu", num_entries_per_token=4, num_max_tokens=32)
    yield g
    pids = g.worker_pids
    g.close()
    assert all(process_ended(p) for p in pids), "a worker outlived close()"


def test_group_is_a_rowstore_padded_to_the_rank_count(group):
    assert isinstance(group, RowStore)
    assert group.rows_per_layer == [-(-1001 // group.num_ranks) * group.num_ranks, -(-333 // group.num_ranks) * group.num_ranks]
    assert len(group.ping()) == group.num_ranks - 1


def test_fetch_rows_matches_float64_reference(group):
    g = torch.Generator().manual_seed(group.num_ranks)
    ref = [torch.zeros(n, HIDDEN, dtype=torch.float64) for n in group.rows_per_layer]
    for layer, n in enumerate(group.rows_per_layer):
        ids = torch.randperm(n, generator=g)[:200]
        values = torch.randn(200, HIDDEN, generator=g, dtype=torch.float64)
        group.write_rows(layer, ids, values.float())
        ref[layer][ids] = values
    indices = torch.randint(-4, 1100, (2, 7, 16), generator=g, dtype=torch.int32)
    out = group.fetch_rows(indices)
    threshold = 40.0 if group.table_dtype == torch.bfloat16 else 25.0
    for layer, n in enumerate(group.rows_per_layer):
        ids = indices[layer].reshape(-1).long()
        valid = (ids >= 0) & (ids < n)
        got = out[layer].reshape(-1, HIDDEN)
        assert out[layer].shape == (7, 16, HIDDEN) and out[layer].dtype == torch.float32
        assert torch.all(got[~valid] == 0)
        assert sqnr(ref[layer][ids[valid]], got[valid]) > threshold
        assert torch.equal(group.read_rows(layer, ids[valid]), got[valid])


def _clear(group) -> None:
    for layer, n in enumerate(group.rows_per_layer):
        group.write_rows(layer, torch.arange(n), torch.zeros(n, HIDDEN))


def test_group_agrees_bit_for_bit_with_local_store_and_the_deepep_fetch(group):
    _clear(group)
    local = LocalRowStore(group.rows_per_layer, HIDDEN, group.table_dtype)
    g = torch.Generator().manual_seed(99)
    for layer, n in enumerate(group.rows_per_layer):
        ids = torch.randint(0, n, (300,), generator=g)  # repeats: the last value wins in both
        values = torch.randn(300, HIDDEN, generator=g)
        group.write_rows(layer, ids, values)
        local.write_rows(layer, ids, values)
    indices = torch.randint(-2, 1100, (2, 5, 4), generator=g, dtype=torch.int32)
    for a, b in zip(group.fetch_rows(indices), local.fetch_rows(indices)):
        assert torch.equal(a, b)
    hooks = group.buffer.fetch(indices)
    for layer in (1, 0):
        result = hooks[layer]()
        data = result[0] if isinstance(result, tuple) else result
        assert data.shape == (5, 4 * HIDDEN)
        want = local.tables[layer].view(torch.uint8)
        ids = indices[layer].reshape(-1).long()
        valid = (ids >= 0) & (ids < group.rows_per_layer[layer])
        got = data.view(torch.uint8).reshape(-1, want.shape[1])
        assert torch.equal(got[valid], want[ids[valid]]) and torch.all(got[~valid] == 0)


def test_write_and_fetch_validation_errors(group):
    with pytest.raises(IndexError, match="row ids must lie"):
        group.write_rows(0, torch.tensor([group.rows_per_layer[0]]), torch.zeros(1, HIDDEN))
    with pytest.raises(ValueError, match="shape"):
        group.write_rows(0, torch.tensor([0, 1]), torch.zeros(1, HIDDEN))
    with pytest.raises(IndexError, match="layer"):
        group.write_rows(2, torch.tensor([0]), torch.zeros(1, HIDDEN))
    with pytest.raises(ValueError, match="int32"):
        group.fetch_rows(torch.zeros(2, 1, 1, dtype=torch.int64))


def test_table_file_round_trip_and_workers_read_only_their_ranges(group, tmp_path):
    g = torch.Generator().manual_seed(5)
    for layer, n in enumerate(group.rows_per_layer):
        group.write_rows(layer, torch.arange(n), torch.randn(n, HIDDEN, generator=g))
    path = tmp_path / "table.safetensors"
    group.save_table_file(str(path), hashing={"seed": 3, "primes": [7, 11]}, streams=["clip_l"])
    indices = torch.randint(-1, 1100, (2, 9, 4), generator=g, dtype=torch.int32)
    before = group.fetch_rows(indices)
    _clear(group)
    meta = group.load_table_file(str(path))
    assert meta["hashing"] == {"seed": 3, "primes": [7, 11]} and meta["streams"] == ["clip_l"]
    for a, b in zip(before, group.fetch_rows(indices)):
        assert torch.equal(a, b)
    # Each rank read exactly its own contiguous slice of every layer.
    for layer, per_rank in enumerate(group.rows_per_rank):
        ranges = sorted(tuple(group.last_load_ranges[r][layer][1:]) for r in range(group.num_ranks))
        assert ranges == [(r * per_rank, (r + 1) * per_rank) for r in range(group.num_ranks)]


def test_killed_worker_gives_clear_error_within_seconds():
    g = EngramGroup([64], HIDDEN, num_ranks=2, device="cpu")
    try:
        pid = g.worker_pids[0]
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        while True:
            try:
                g.fetch_rows(torch.zeros(1, 1, 1, dtype=torch.int32))
            except EngramWorkerError as e:
                assert e.rank == 1 and e.exitcode == -signal.SIGKILL
                assert "rank 1" in str(e) and "signal 9" in str(e)
                break
            assert time.monotonic() - start < 5.0, "no error 5 s after the worker died"
            time.sleep(0.05)
        with pytest.raises(EngramWorkerError):
            g.ping()
    finally:
        g.close()
    assert not leftover_segments(os.getpid())


def test_workers_die_with_a_sigkilled_host(tmp_path):
    pkg = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), ".host", "pkg")
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {pkg!r})
        from fp8_engram.engram.group import EngramGroup
        g = EngramGroup([64], 256, num_ranks=3, device="cpu")
        print(" ".join(map(str, g.worker_pids)), flush=True)
        time.sleep(120)
        """
    )
    host = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in host.stdout.readline().split()]
        assert len(pids) == 2 and not any(process_ended(p) for p in pids)
        host.kill()
        host.wait()
        deadline = time.monotonic() + 5.0
        while not all(process_ended(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(process_ended(p) for p in pids), "workers outlived their SIGKILLed host"
    finally:
        if host.poll() is None:
            host.kill()
    assert not leftover_segments(host.pid)


def test_a_start_that_fails_on_the_host_leaves_no_worker_shard_file(monkeypatch):
    """The host's own shard fails to allocate while its worker has made its /dev/shm file and waits for the host in
    the name exchange: the worker is ended by the failed start before it could unlink the file, which would hold the
    shard's memory until the machine restarts. The host removes it."""
    from fp8_engram.engram import buffer as buffer_module
    from fp8_engram.engram import group as group_module

    started, made = [], []
    fork = group_module.EngramGroup._fork_worker

    def recorded(self, template, rank, config):
        worker = fork(self, template, rank, config)
        started.append(worker.process.pid)
        return worker

    def host_fails(group, num_bytes, device):
        if group.rank() == 0:
            deadline = time.monotonic() + 30  # the worker's file exists before the host fails
            while not any(leftover_segments(pid) for pid in started) and time.monotonic() < deadline:
                time.sleep(0.01)
            made.append(any(leftover_segments(pid) for pid in started))
            raise OSError("the host's shard could not be allocated")
        raise AssertionError("the worker process uses its own allocator")

    monkeypatch.setattr(group_module.EngramGroup, "_fork_worker", recorded)
    buffer_module.set_shard_allocator(host_fails)
    try:
        with pytest.raises(Exception, match="could not be allocated"):
            EngramGroup([64], HIDDEN, num_ranks=2, device="cpu", timeout=30)
    finally:
        buffer_module.set_shard_allocator(None)
    assert made == [True], "the worker made no shard file before the host failed"
    assert len(started) == 1 and process_ended(started[0])
    assert not leftover_segments(started[0]), "the failed start left the worker's shard file in /dev/shm"


def test_a_cpu_group_start_removes_engram_files_left_in_dev_shm_long_ago(caplog):
    """Files of ended processes (pids beyond any pid_max): one last written two hours ago, older than any start could
    last, is removed by the next CPU group's start, with a warning saying how much it held; one written now (a start
    of another process may still be exchanging it) stays."""
    from fp8_engram.engram.allocators import STALE_SEGMENT_S

    names = {"stale": "fp8engram-4999999-0123456789ab-r1", "recent": "fp8engram-4999998-0123456789ab-r1"}
    paths = {k: os.path.join("/dev/shm", n) for k, n in names.items()}
    if not os.path.isdir("/dev/shm"):
        pytest.skip("needs POSIX shared memory in /dev/shm (CPU engram groups need it)")
    for path in paths.values():
        with open(path, "wb") as f:
            f.truncate(3 << 20)  # the size a shard's file has (tmpfs gives it no pages until they are written)
    old = time.time() - 2 * STALE_SEGMENT_S
    os.utime(paths["stale"], (old, old))
    try:
        with caplog.at_level("WARNING", logger="fp8_engram.engram.group"):
            EngramGroup([64], HIDDEN, num_ranks=2, device="cpu").close()
        assert not os.path.exists(paths["stale"]), "a file left two hours ago is still in /dev/shm"
        assert os.path.exists(paths["recent"]), "a file written now was removed"
        assert any(names["stale"] in r.getMessage() and "3.0 MiB" in r.getMessage() for r in caplog.records), \
            [r.getMessage() for r in caplog.records]
    finally:
        for path in paths.values():
            if os.path.exists(path):
                os.unlink(path)
