"""A group's ranks prove at start that they read each other's shards: every rank writes a pattern into
its own shard and reads every peer's back through the mapping fetch uses (LocalEngramBuffer).

Shared memory here never maps the wrong pages, so the broken case is made in the host process (rank 0):
its view of rank 1's shard is a private copy taken before rank 1 wrote, which is what a mapping of other
memory reads. The workers run unchanged; the CUDA IPC form (a driver that opens other memory) is in
test_group_cuda_ipc.py.
"""

import os

import pytest
import torch

from fp8_engram.engram import buffer as buffer_module
from fp8_engram.engram.allocators import ShardSharingError, leftover_segments, shared_memory_allocator
from fp8_engram.engram.buffer import PROBE_BYTES
from fp8_engram.engram.group import EngramGroup
from helpers.procs import process_ended

pytestmark = pytest.mark.unit

ROWS = [96, 40]
HIDDEN = 64


def stale_view_of_rank_1(group, num_bytes, device):
    """Shared-memory shards, except that this rank's view of rank 1's is a copy taken now (zeros)."""
    memory = shared_memory_allocator(group, num_bytes, device)
    memory.unified = None  # read through the per-peer views
    if group.rank() != 1:
        memory.peers[1] = memory.peers[1].clone()
    return memory


@pytest.fixture
def broken_host_view():
    buffer_module.set_shard_allocator(stale_view_of_rank_1)
    yield
    buffer_module.set_shard_allocator(None)


def test_a_peer_read_wrong_is_refused_on_start(broken_host_view):
    before = set(leftover_segments(os.getpid()))
    with pytest.raises(ShardSharingError, match=rf"rank 0 read \d+ of {2 * PROBE_BYTES} bytes of rank 1's shard wrong") as info:
        EngramGroup(ROWS, HIDDEN, torch.bfloat16, num_ranks=2, device="cpu", timeout=60)
    assert "rank 1 read" not in str(info.value), "the worker reads its own shard and the host's correctly"
    assert "not shared correctly between the 2 ranks" in str(info.value)
    assert set(leftover_segments(os.getpid())) <= before, "a refused group left shared memory behind"


def test_ranks_that_read_each_other_start_and_leave_no_pattern():
    """Three real CPU ranks pass the check; the probe bytes are put back, so the first and last rows of
    every rank's tables read zero until written, and rows written afterwards read back."""
    with EngramGroup(ROWS, HIDDEN, torch.bfloat16, num_ranks=3, device="cpu", timeout=60) as group:
        memory = group.buffer._memory
        for rank, shard in enumerate(memory.peers):
            assert int(shard[:PROBE_BYTES].count_nonzero()) == 0, f"rank {rank}'s first probe bytes were not put back"
            end = group.buffer.num_bytes
            assert int(shard[end - PROBE_BYTES:end].count_nonzero()) == 0, f"rank {rank}'s last probe bytes were not put back"
        edges = torch.tensor([0, group.rows_per_layer[0] - 1])
        assert int(group.read_rows(0, edges).count_nonzero()) == 0
        values = torch.randn(2, HIDDEN)
        group.write_rows(0, edges, values)
        assert torch.equal(group.read_rows(0, edges), values.bfloat16().float())
        pids = group.worker_pids
    assert all(process_ended(pid) for pid in pids)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (two ranks share it through CUDA IPC)")
def test_cuda_ranks_read_each_other_through_ipc():
    """Two CUDA ranks (on one GPU, or two) pass the start check through real CUDA IPC mappings, leave no
    pattern behind, and serve rows written by either."""
    with EngramGroup(ROWS, HIDDEN, torch.bfloat16, num_ranks=2, device="cuda", timeout=120) as group:
        end = group.buffer.num_bytes
        for rank, shard in enumerate(group.buffer._memory.peers):
            assert int(shard[:PROBE_BYTES].count_nonzero()) == 0 and int(shard[end - PROBE_BYTES:end].count_nonzero()) == 0, rank
        rows = torch.tensor([0, group.rows_per_layer[0] - 1])  # on rank 0 and on rank 1
        values = torch.randn(2, HIDDEN)
        group.write_rows(0, rows, values)
        assert torch.equal(group.read_rows(0, rows).cpu(), values.bfloat16().float())
