"""A group's ranks prove at start that they read each other's shards: every rank writes probe rows (the
first, middle and last rows of every layer and a few seeded ones) into its own shard, and every rank
reads every rank's probe rows back through the gather its fetch uses (LocalEngramBuffer), with the
fetch's own views or pointer table.

Shared memory here never maps the wrong pages, so the broken cases are made in the host process (rank 0):
its view of rank 1's shard is a private copy taken before rank 1 wrote; the middle pages of its mapping
of rank 1's shard are other memory (first and last pages right); its Triton gather's shard table (run in
Triton's interpreter) points a few rows off into rank 1's shard while its views are right. The workers
run unchanged; the CUDA IPC form (a driver that opens other memory) is in test_group_cuda_ipc.py.
"""

import ctypes
import mmap
import os

import pytest
import torch

from fp8_engram.engram import buffer as buffer_module
from fp8_engram.engram import group as group_module
from fp8_engram.engram.allocators import PAGE_SIZE, ShardSharingError, leftover_segments, shared_memory_allocator
from fp8_engram.engram.buffer import LocalEngramBuffer
from fp8_engram.engram.group import EngramGroup
from helpers.procs import process_ended

pytestmark = pytest.mark.unit

ROWS = [96, 40]
HIDDEN = 64
REFUSED = r"rank 0 read \d+ of \d+ probe rows of rank 1's shard wrong \(the first: layer \d+, row \d+\)"


def stale_view_of_rank_1(group, num_bytes, device):
    """Shared-memory shards, except that this rank's view of rank 1's is a copy taken now (zeros)."""
    memory = shared_memory_allocator(group, num_bytes, device)
    memory.unified = None  # read through the per-peer views
    if group.rank() != 1:
        memory.peers[1] = memory.peers[1].clone()
    return memory


def torn_middle_of_rank_1(group, num_bytes, device):
    """Shared-memory shards in one range (what fetch gathers from on the CPU), except that on this rank
    every page of rank 1's shard but its first and last is replaced by private anonymous memory: the
    shard's first and last bytes are right, its middle rows are other memory."""
    memory = shared_memory_allocator(group, num_bytes, device)
    if group.rank() != 1:
        pages = num_bytes // PAGE_SIZE
        assert pages >= 3, "the test needs a shard of at least three pages"
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        start = memory.unified.data_ptr() + memory.stride + PAGE_SIZE
        length = (pages - 2) * PAGE_SIZE
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x10  # MAP_FIXED: over the middle of the shard's mapping
        got = libc.mmap(start, length, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
        assert got == start, os.strerror(ctypes.get_errno())
    return memory


@pytest.fixture
def shard_allocator():
    yield buffer_module.set_shard_allocator
    buffer_module.set_shard_allocator(None)


def start_refused(num_ranks=2, dtype=torch.bfloat16):
    before = set(leftover_segments(os.getpid()))
    with pytest.raises(ShardSharingError, match=REFUSED) as info:
        EngramGroup(ROWS, HIDDEN if dtype == torch.bfloat16 else 128, dtype, num_ranks=num_ranks, device="cpu", timeout=60)
    assert "rank 1 read" not in str(info.value), "the worker reads its own shard and the host's correctly"
    assert f"not shared correctly between the {num_ranks} ranks" in str(info.value)
    assert set(leftover_segments(os.getpid())) <= before, "a refused group left shared memory behind"
    return str(info.value)


def test_a_peer_read_wrong_is_refused_on_start(shard_allocator):
    shard_allocator(stale_view_of_rank_1)
    start_refused()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_a_mapping_wrong_in_the_middle_of_a_shard_is_refused_on_start(shard_allocator, dtype):
    """The first and last bytes of every shard read right through the host's mapping; the middle rows,
    which fetch also reads, do not. The probe rows include each layer's middle row, which lies there."""
    shard_allocator(torn_middle_of_rank_1)
    message = start_refused(dtype=dtype)
    assert "rank 2" not in message


class KernelTableOffByRows(LocalEngramBuffer):
    """The host's buffer with the Triton gather forced (interpreted on the CPU) and its shard table's
    entry for rank 1 three rows past where rank 1's shard starts; its views of the shards are right."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, gather="triton", **kwargs)

    def _build_kernel_tables(self):
        super()._build_kernel_tables()
        self._bases[1] += 3 * self.layout.row_bytes // 4


def test_a_wrong_entry_of_the_gathers_shard_table_is_refused_on_start(monkeypatch):
    """The views (what the old start check read) are right, the pointer table the Triton gather reads
    through is not: the start check reads through the kernel and refuses."""
    pytest.importorskip("triton")
    monkeypatch.setattr(group_module, "LocalEngramBuffer", KernelTableOffByRows)
    start_refused()


class KernelScaleTableOffByOneWord(LocalEngramBuffer):
    """The host's buffer with the Triton gather forced (interpreted) and layer 1's scale offset in the
    kernel's table one 4-byte word off: its table rows are right, its scale factors are not."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, gather="triton", **kwargs)

    def _build_kernel_tables(self):
        super()._build_kernel_tables()
        self._meta[1, 2] += 1


def test_a_wrong_scale_offset_of_the_gathers_table_is_refused_on_start(monkeypatch):
    """FP8 tables: the probe rows carry scale factors too, read back through the kernel's scale offsets."""
    pytest.importorskip("triton")
    monkeypatch.setattr(group_module, "LocalEngramBuffer", KernelScaleTableOffByOneWord)
    assert "layer 1," in start_refused(dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_ranks_that_read_each_other_start_and_leave_no_pattern(dtype):
    """Three real CPU ranks pass the check; the probe rows are put back, so every rank's shard is all
    zero until written, and rows written afterwards (first, middle and last) read back."""
    hidden = HIDDEN if dtype == torch.bfloat16 else 128
    with EngramGroup(ROWS, hidden, dtype, num_ranks=3, device="cpu", timeout=60) as group:
        memory = group.buffer._memory
        for rank, shard in enumerate(memory.peers):
            assert int(shard[: group.buffer.num_bytes].count_nonzero()) == 0, f"rank {rank}'s probe rows were not put back"
        edges = torch.tensor([0, group.rows_per_layer[0] // 2, group.rows_per_layer[0] - 1])
        assert int(group.read_rows(0, edges).count_nonzero()) == 0
        values = torch.randn(3, hidden)
        group.write_rows(0, edges, values)
        assert torch.allclose(group.read_rows(0, edges), values, rtol=0.07, atol=0)
        pids = group.worker_pids
    assert all(process_ended(pid) for pid in pids)


def test_the_triton_gather_passes_the_start_check_and_puts_the_rows_back(monkeypatch):
    """The host's buffer with the Triton gather (interpreted) and a right table starts, and fetches rows
    written on every rank."""
    pytest.importorskip("triton")

    class Triton(LocalEngramBuffer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, gather="triton", **kwargs)

    monkeypatch.setattr(group_module, "LocalEngramBuffer", Triton)
    with EngramGroup(ROWS, HIDDEN, torch.bfloat16, num_ranks=2, device="cpu", timeout=60) as group:
        assert group.buffer.gather_mode == "triton"
        assert int(group.buffer._memory.unified.count_nonzero()) == 0
        half = group.rows_per_rank[0]
        rows = torch.tensor([0, half - 1, half, ROWS[0] - 1])  # first and last of rank 0's rows, then of rank 1's
        values = torch.randn(4, HIDDEN)
        group.write_rows(0, rows, values)
        assert torch.equal(group.read_rows(0, rows), values.bfloat16().float())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (two ranks share it through CUDA IPC)")
def test_cuda_ranks_read_each_other_through_ipc():
    """Two CUDA ranks (on one GPU, or two) pass the start check through real CUDA IPC mappings and the
    Triton gather, leave no pattern behind, and serve rows written by either."""
    with EngramGroup(ROWS, HIDDEN, torch.bfloat16, num_ranks=2, device="cuda", timeout=120) as group:
        end = group.buffer.num_bytes
        for rank, shard in enumerate(group.buffer._memory.peers):
            assert int(shard[:end].count_nonzero()) == 0, rank
        rows = torch.tensor([0, group.rows_per_layer[0] // 2, group.rows_per_layer[0] - 1])  # on rank 0, rank 0, rank 1
        values = torch.randn(3, HIDDEN)
        group.write_rows(0, rows, values)
        assert torch.equal(group.read_rows(0, rows).cpu(), values.bfloat16().float())
