"""Shard memory for LocalEngramBuffer: one flat byte buffer per rank, mapped by every rank.

* CPU (gloo): every rank creates a POSIX shared-memory file under /dev/shm, the names travel through
  the group, and every rank maps all files back to back into ONE reserved virtual address range, so a
  fetch can gather every requested row with a single `index_select` over all shards (`unified`). Each
  creator unlinks its file as soon as every rank has mapped it: from then on nothing is left behind,
  whichever process dies (a worker that ended before, the host unlinks for it: `remove_segments`; a file
  older than any start, the next CPU group's start removes: `STALE_SEGMENT_S`). Every file's pages
  are reserved (`posix_fallocate`) before any is mapped, and the ranks agree on it: a /dev/shm without
  room is a SharedMemoryFullError with the figures on every rank, never a SIGBUS at a later write.
  One-rank groups use plain memory.
* CUDA (default, `cuda_ipc_allocator`): each rank allocates its shard from the CUDA driver and hands
  every peer a CUDA IPC handle of it through one all-gather of the group (any backend; EngramGroup uses
  a private gloo group, so ranks may share one GPU). Why not torch's symmetric memory, which the engine
  used first: its rendezvous keeps one process-wide exchange counter that every rendezvous in the
  process advances, so a second group's fresh workers start at 0 while the host is ahead and the
  rendezvous hangs (pytorch issue 196082). Why not torch.multiprocessing's CUDA sharing: ComfyUI runs
  torch's cudaMallocAsync allocator backend, which cannot export memory. An exchange of our own
  (cuda_ipc.py) has no state outside the group, so groups of any size and rank count may come and go
  in one process, several at once, and ranks sharing a GPU need no environment variable. The one-pass
  gather (gather_triton.py) needs only each shard's address in the fetching process, which IPC gives.

An allocator is `(group, num_bytes, device) -> ShardMemory`. Collectives are issued on the process
group object itself (`group.allgather(...)`), so a group made without `init_process_group` works too.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import logging
import mmap
import os
import pickle
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ..common.sizes import size_text

logger = logging.getLogger(__name__)

PAGE_SIZE = mmap.PAGESIZE
_SHM_DIR = "/dev/shm"
SHM_PREFIX = "fp8engram-"
_COLLECTIVE_TIMEOUT = timedelta(seconds=120)


@dataclass
class ShardMemory:
    """Every rank's shard buffer as seen from this rank.

    `peers[r]` is rank r's flat uint8 buffer (`peers[rank] is local` memory); when all shards sit in one
    virtual range, `unified` is a uint8 tensor of `num_ranks * stride` bytes with `peers[r]` at
    `r * stride`. `keepalive` holds whatever must live as long as the views. `release()` gives the
    memory back; `release(between=fn)` runs `fn` after this rank's mappings of its peers are gone and
    before its own shard is freed (a host waiting for its workers to exit). For CUDA IPC shards
    release is collective: every rank of the group calls it (see `cuda_ipc_allocator`); it then
    sets `held_peers` (peers whose shards this rank still maps through views kept past release) and
    `held_by` (peers that still map this rank's shard), and calls `on_peer_unmapped(rank)` when a
    held peer's shard is finally unmapped here (its owner may then exit).
    """

    local: torch.Tensor
    peers: list[torch.Tensor]
    unified: torch.Tensor | None = None
    stride: int = 0
    keepalive: object = None
    _release: Callable[[Callable[[], None] | None], None] | None = field(default=None, repr=False)
    held_peers: list[int] = field(default_factory=list)
    held_by: list[int] = field(default_factory=list)
    on_peer_unmapped: Callable[[int], None] | None = field(default=None, repr=False)

    def release(self, between: Callable[[], None] | None = None) -> None:
        release, self._release = self._release, None
        self.local = self.unified = None  # type: ignore[assignment]
        self.peers = []
        self.keepalive = None
        if release is not None:
            release(between)
        elif between is not None:
            between()


ShardAllocator = Callable[[dist.ProcessGroup, int, torch.device], ShardMemory]


# ----- collectives on a bare process group -----


def collective_device(group: dist.ProcessGroup, device: torch.device) -> torch.device:
    """Where collective tensors live: CUDA for NCCL groups, CPU otherwise."""
    if device.type == "cuda":
        try:
            if group._get_backend(device).name() == "nccl":  # noqa: SLF001 - no public way to ask
                return device
        except (RuntimeError, AttributeError):
            pass
    return torch.device("cpu")


def all_gather_int64(group: dist.ProcessGroup, values: list[int], device: torch.device,
                     timeout: timedelta = _COLLECTIVE_TIMEOUT) -> list[list[int]]:
    """Gather one equally long int64 vector per rank."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(group.size())]
    group.allgather([out], [mine]).wait(timeout)
    return [t.tolist() for t in out]


def all_gather_object(group: dist.ProcessGroup, obj: object, device: torch.device) -> list[object]:
    """Gather one picklable object per rank (bytes padded to the longest)."""
    payload = pickle.dumps(obj)
    lengths = [n[0] for n in all_gather_int64(group, [len(payload)], device)]
    size = max(lengths)
    mine = torch.zeros(size, dtype=torch.uint8, device=device)
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    out = [torch.empty_like(mine) for _ in range(group.size())]
    group.allgather([out], [mine]).wait(_COLLECTIVE_TIMEOUT)
    return [pickle.loads(bytes(t[:n].cpu().numpy())) for t, n in zip(out, lengths)]


def barrier(group: dist.ProcessGroup, device: torch.device, data_device: torch.device | None = None) -> None:
    """A barrier that works on gloo and NCCL groups (an all-reduce of one element).

    `data_device`: a CUDA device whose queued work (writes into shards) must be finished and visible to
    every rank before any rank passes the barrier; synchronized before and after. The collective itself
    runs on `device` (CPU for gloo groups, which is how EngramGroup runs CUDA ranks).
    """
    cuda_devices = {d for d in (torch.device(device), torch.device(data_device) if data_device is not None else None) if d is not None and d.type == "cuda"}
    for d in cuda_devices:
        torch.cuda.synchronize(d)
    token = torch.zeros(1, dtype=torch.int32, device=device)
    group.allreduce([token]).wait(_COLLECTIVE_TIMEOUT)
    for d in cuda_devices:
        torch.cuda.synchronize(d)


# ----- CPU: POSIX shared memory mapped into one range -----


class ShardSharingError(RuntimeError):
    """The ranks' shards are not shared as they must be: a peer's shard could not be exported or opened
    (CUDA IPC), or a rank reads other rows of a peer's shard than the peer wrote, through the gather its
    fetch uses (LocalEngramBuffer's check at start). The message names the ranks; the memory cannot serve rows."""


class SharedMemoryFullError(MemoryError):
    """The shared-memory filesystem (/dev/shm) has no room for a segment the engram tables need; the
    message gives the bytes asked and the bytes free there."""


def shm_space(folder: str = _SHM_DIR) -> tuple[int, int] | None:
    """(bytes free, bytes in all) of the filesystem holding `folder`; None where it cannot be asked."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def shm_full_error(what: str, num_bytes: int, folder: str = _SHM_DIR, total_bytes: int | None = None) -> SharedMemoryFullError:
    """The error for `what` needing `num_bytes` (of `total_bytes` asked in all) of shared memory in `folder`."""
    space = shm_space(folder)
    free = f"{size_text(space[0], mib_digits=1)} of its {size_text(space[1], mib_digits=1)} are free" if space else "its free space is unknown"
    asked = f"{size_text(num_bytes, mib_digits=1)} ({num_bytes:,} bytes)"
    if total_bytes is not None and total_bytes != num_bytes:
        asked += f", {size_text(total_bytes, mib_digits=1)} in all"
    return SharedMemoryFullError(
        f"{what} needs {asked} of shared memory in {folder}, but {free}: free space there (files other programs "
        f"left in {folder}), give the machine or container a larger {folder} (docker: --shm-size), or make the "
        "tables smaller (fewer rows_per_head, heads or max_order, or fp8_e4m3fn)")


def check_shm_room(what: str, num_bytes: int, folder: str = _SHM_DIR) -> None:
    """Raise SharedMemoryFullError, with the figures, when `folder`'s filesystem has fewer than
    `num_bytes` free (a check before anything is started; `reserve_segment` is what holds the pages)."""
    space = shm_space(folder)
    if space is not None and space[0] < num_bytes:
        raise shm_full_error(what, num_bytes, folder)


def reserve_segment(fd: int, num_bytes: int, what: str, folder: str = _SHM_DIR) -> None:
    """Back every page of a new shared-memory file now, so that a full /dev/shm is this error here
    rather than SIGBUS at the first write of a page that cannot be had (tmpfs allocates pages on
    touch). Where the filesystem cannot reserve (no fallocate), its free space is checked instead."""
    try:
        os.posix_fallocate(fd, 0, num_bytes)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise shm_full_error(what, num_bytes, folder) from e
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            check_shm_room(what, num_bytes, folder)
            return
        raise


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    return libc


_MAP_SHARED = 0x01
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE


def _map_fixed(libc: ctypes.CDLL, address: int, length: int, fd: int) -> None:
    got = libc.mmap(address, length, _PROT_RW, _MAP_SHARED | _MAP_FIXED, fd, 0)
    if got is None or got != address:
        err = ctypes.get_errno()
        raise OSError(err, f"mapping a shard at {address:#x} failed: {os.strerror(err)}")


def shared_memory_allocator(group: dist.ProcessGroup, num_bytes: int, device: torch.device) -> ShardMemory:
    """CPU shard buffers in /dev/shm, all mapped back to back into one range on every rank."""
    if torch.device(device).type != "cpu":
        raise ValueError(f"the shared-memory allocator serves CPU buffers, not {device}")
    rank, num_ranks = group.rank(), group.size()
    if num_ranks == 1:
        local = torch.zeros(num_bytes, dtype=torch.uint8)
        return ShardMemory(local=local, peers=[local], unified=local, stride=num_bytes)
    if not os.path.isdir(_SHM_DIR):
        raise RuntimeError(f"CPU engram groups need POSIX shared memory ({_SHM_DIR} is missing on this system)")
    if num_bytes % PAGE_SIZE:
        raise ValueError(f"shard size {num_bytes} must be a multiple of the page size {PAGE_SIZE}")
    cpu = torch.device("cpu")

    name = f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}-r{rank}"
    path = os.path.join(_SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    unlinked = False
    try:
        os.ftruncate(fd, num_bytes)
        # Every rank backs its shard before any is used, and all agree: a full /dev/shm fails the start on
        # every rank with the figures instead of a SIGBUS at some later write.
        try:
            reserve_segment(fd, num_bytes, f"the engram shard of CPU rank {rank} of {num_ranks}")
            failure = None
        except SharedMemoryFullError as e:
            failure = str(e)
        os.close(fd)
        fd = -1
        gathered = all_gather_object(group, (name, failure), cpu)
        failed = [(r, text) for r, (_, text) in enumerate(gathered) if text]
        if failed:
            raise SharedMemoryFullError(f"{num_ranks} CPU ranks x {size_text(num_bytes, mib_digits=1)} of engram shards do not fit in "
                                        f"{_SHM_DIR}: {failed[0][1]}")
        names = [n for n, _ in gathered]
        # Reserve one range for all shards, then map each shard file over its slot. The Python mmap object
        # owns the range: when the last tensor view dies it unmaps everything at once.
        region = mmap.mmap(-1, num_ranks * num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, prot=_PROT_RW)
        anchor = ctypes.c_char.from_buffer(region)
        base = ctypes.addressof(anchor)
        del anchor
        libc = _libc()
        for peer, peer_name in enumerate(names):
            peer_fd = os.open(os.path.join(_SHM_DIR, peer_name), os.O_RDWR)
            try:
                if os.fstat(peer_fd).st_size < num_bytes:
                    raise RuntimeError(f"shared-memory shard {peer_name} of rank {peer} is smaller than {num_bytes} bytes")
                _map_fixed(libc, base + peer * num_bytes, num_bytes, peer_fd)
            finally:
                os.close(peer_fd)
        # Every rank has mapped every file: the names are no longer needed.
        barrier(group, cpu)
        os.unlink(path)
        unlinked = True
    finally:
        if fd >= 0:
            os.close(fd)
        if not unlinked:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    unified = torch.frombuffer(region, dtype=torch.uint8)
    peers = [unified[r * num_bytes : (r + 1) * num_bytes] for r in range(num_ranks)]
    return ShardMemory(local=peers[rank], peers=peers, unified=unified, stride=num_bytes, keepalive=region)


# ----- CUDA: driver-allocated memory shared through CUDA IPC (the default) -----


def _cuda_device(device: torch.device | str, allocator: str) -> torch.device:
    """`device` as a CUDA device with an index (the current one when it names none); ValueError otherwise."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"{allocator} serves CUDA buffers, not {device}")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def cuda_ipc_allocator(group: dist.ProcessGroup, num_bytes: int, device: torch.device) -> ShardMemory:
    """CUDA shard buffers from the driver (cuda_ipc.py), every peer's buffer opened through CUDA IPC.

    Each rank allocates its shard on its own GPU and exports an IPC handle; the handles travel through
    one all-gather of the group (any backend), and each rank opens every peer's handle onto its own
    device. No state outside the group, and no dependence on torch's allocator backend (ComfyUI's
    cudaMallocAsync cannot share memory between processes).

    Release is collective and ordered, because CUDA leaves freeing memory that another process still
    maps undefined: every rank unmaps its peers' shards, the ranks all-gather which shards each still
    maps (a view kept past close keeps its mapping), then each owner frees its shard unless a peer
    still maps it (then it is left to the process exit, logged). Views own their mappings
    (cuda_ipc.Mapping), so a view kept after close reads valid memory, never freed memory.
    """
    device = _cuda_device(device, "the CUDA IPC allocator")
    return _ipc_shards(group, num_bytes, device, device)


TEARDOWN_TIMEOUT = timedelta(seconds=10)


def _ipc_shards(group: dist.ProcessGroup, num_bytes: int, device: torch.device,
                view_device: torch.device) -> ShardMemory:
    """`cuda_ipc_allocator` with the views placed on `view_device` (the device itself; tests with a
    stand-in driver whose "device memory" is host memory put them on the CPU)."""
    from . import cuda_ipc

    rank, num_ranks = group.rank(), group.size()
    own = cuda_ipc.Mapping.allocate(num_bytes, device, view_device)
    opened: dict[int, cuda_ipc.Mapping] = {}
    coll = collective_device(group, device)
    box: list[ShardMemory] = []
    held: set[int] = set()

    def unmapped_later(peer: int) -> None:
        if peer in held and box and box[0].on_peer_unmapped is not None:
            box[0].on_peer_unmapped(peer)

    def release(between: Callable[[], None] | None) -> None:
        gc.collect()  # views held only by reference cycles (a traceback's frames) are not kept
        for peer, mapping in opened.items():
            mapping.on_release = (lambda p=peer: unmapped_later(p))
            mapping.permit_release()
        still = [int(r in opened and not opened[r].released) for r in range(num_ranks)]
        held.update(r for r in range(num_ranks) if still[r])
        agreed, reports = num_ranks == 1, []  # one rank: nobody else to ask, nobody else maps it
        if not agreed:
            try:
                reports = all_gather_int64(group, still, coll, TEARDOWN_TIMEOUT)
                agreed = True
            except Exception as e:  # noqa: BLE001 - a peer died or left: decided below
                reports = []
                logger.warning("engram: rank %d could not agree with its peers on releasing CUDA shards (%s: %s)",
                               rank, type(e).__name__, e)
        if any(still):
            logger.warning("engram: rank %d still holds views of the CUDA shards of ranks %s after close; "
                           "those mappings stay until the views are gone", rank, [r for r in range(num_ranks) if still[r]])
        holders = [r for r, report in enumerate(reports) if r != rank and report[rank]]
        if box:
            box[0].held_peers = sorted(held)
            box[0].held_by = holders
        if between is not None:
            between()
        if agreed and holders:
            logger.warning("engram: rank %d leaves its CUDA shard (%d MiB) to the process exit: ranks %s still map it",
                           rank, num_bytes >> 20, holders)
            return
        if not agreed and between is None:
            return  # peers may still map it: the process exit frees it
        # agreed that nobody maps it, or `between` saw every peer process end
        own.permit_release()  # now, or once this rank's own views are gone

    try:
        local = own.view()
        if num_ranks == 1:
            box.append(ShardMemory(local=local, peers=[local], unified=local, stride=num_bytes, _release=release))
            return box[0]
        try:
            handle = cuda_ipc.export_handle(own.address, device)
        except cuda_ipc.CudaIpcError as e:
            raise ShardSharingError(f"rank {rank} could not export its CUDA shard for CUDA IPC: {e}") from e
        gathered = all_gather_object(group, handle, coll)
        peers: list[torch.Tensor] = []
        for peer, peer_handle in enumerate(gathered):
            if peer == rank:
                peers.append(local)
                continue
            try:
                opened[peer] = cuda_ipc.Mapping.open(peer_handle, num_bytes, device, view_device)
            except Exception as e:
                raise ShardSharingError(f"rank {rank} could not open the CUDA shard of rank {peer} through CUDA IPC: {e}") from e
            peers.append(opened[peer].view())
    except BaseException:
        local = peers = None  # type: ignore[assignment]
        for mapping in opened.values():
            mapping.permit_release()
        own.permit_release()  # a failed start: the host stops every worker of the group
        raise
    box.append(ShardMemory(local=local, peers=peers, unified=None, stride=0, _release=release))
    return box[0]


def default_allocator(device: torch.device) -> ShardAllocator:
    return cuda_ipc_allocator if torch.device(device).type == "cuda" else shared_memory_allocator


# Every engram file in /dev/shm is unlinked by its owner as soon as every rank has mapped it (a host-memory table's at
# once): one older than any start could last was left by a process killed in between (or by a version of this pack
# whose host did not remove its ended workers' files), and its reserved pages stay taken until the machine restarts.
STALE_SEGMENT_S = 3600.0


def remove_segments(pid: int | None = None, older_than_s: float | None = None) -> list[tuple[str, int]]:
    """Unlink engram files in /dev/shm: those of ``pid``, a process that has ended (a worker killed before its start
    unlinked its own), or with ``older_than_s`` every one last modified longer ago than that; another user's are left
    alone. A file no process maps holds its reserved pages until the machine restarts. ``(name, bytes)`` of each."""
    now = time.time()
    removed = []
    for name in leftover_segments(pid):
        path = os.path.join(_SHM_DIR, name)
        try:
            st = os.stat(path)
            if older_than_s is not None and now - st.st_mtime <= older_than_s:
                continue
            os.unlink(path)
        except (FileNotFoundError, PermissionError):
            continue
        removed.append((name, st.st_size))
    return removed


def leftover_segments(pid: int | None = None) -> list[str]:
    """Shared-memory shard files still present (of one creator pid, or all); for tests and cleanup."""
    if not os.path.isdir(_SHM_DIR):
        return []
    prefix = SHM_PREFIX if pid is None else f"{SHM_PREFIX}{pid}-"
    return sorted(n for n in os.listdir(_SHM_DIR) if n.startswith(prefix))
