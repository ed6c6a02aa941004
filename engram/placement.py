"""Where a memory's tables live and why: the placement policy, and the store it makes.

A memory lives on the device tier (its rows sharded over CUDA ranks, or over CPU ranks, or in this one
process) or on the host tier (one copy per machine: a shared-memory segment, or a table file mapped).
`make_store` builds the store the policy picks and hands it back with its `Placement` in
`store.placement`; when device ranks cannot share their shards (a failed start check or CUDA IPC
exchange) the memory goes to the host tier instead, and the placement says so. Nothing here reads
ComfyUI: what the device has free is passed in.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..common.sizes import size_text
from .allocators import ShardSharingError
from .cuda_ipc import CudaIpcError
from .errors import EngramWorkerError
from . import group  # read at call time: tests stand in a group of their own
from .host_tier import HostRowStore
from .rows import table_bytes
from .store import LocalRowStore

logger = logging.getLogger(__name__)

PLACEMENTS = ("device", "host", "auto")


@dataclass(frozen=True)
class Placement:
    """Where a store's rows live. `tier`: "device" or "host". `kind`: "CUDA" or "CPU" ranks on the device
    tier (None on the host tier); `ranks`: how many (0 on the host tier). `reason`: why this tier was
    chosen. `fell_back_from`: the device ranks that were asked for and could not share their shards, and
    the error (None when the memory is where it was asked to be)."""

    tier: str
    kind: str | None
    ranks: int
    reason: str
    fell_back_from: str | None = None


def cuda_rank_devices(gpu_ranks: int, device_count: int) -> list[int]:
    """The GPU of every CUDA rank: `gpu_ranks` = 0 gives one rank per GPU; N > 0 gives N ranks spread
    round-robin over the GPUs (rank r on GPU r % device_count, as EngramGroup places them), so several
    ranks may share one GPU."""
    if device_count < 1:
        raise ValueError("no CUDA GPU to place engram ranks on")
    if isinstance(gpu_ranks, bool) or not isinstance(gpu_ranks, int) or gpu_ranks < 0:
        raise ValueError(f"gpu_ranks must be 0 (one rank per GPU) or a positive number of ranks, got {gpu_ranks!r}")
    count = gpu_ranks if gpu_ranks > 0 else device_count
    return [r % device_count for r in range(count)]


def choose_placement(placement: str, num_bytes: int, free_bytes: int | None) -> str:
    """"device" or "host" for a memory of `num_bytes`: `auto` picks the device when the table takes at
    most half of the device memory that is free (`free_bytes`; None = unknown, which counts as fitting)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if placement != "auto":
        return placement
    return "device" if free_bytes is None or num_bytes <= free_bytes // 2 else "host"


def resolve_tier(requested: str, rows_per_layer: Sequence[int], hidden: int, dtype: torch.dtype,
                 free_bytes: Callable[[], int | None]) -> tuple[str, str]:
    """(tier, why) for `requested` ("device", "host" or "auto"): auto takes the device when the tables take
    at most half of its free memory (`free_bytes()`, asked only for auto; None = unknown, which fits)."""
    if requested != "auto":
        return choose_placement(requested, 0, None), "asked for"
    size, free = table_bytes(rows_per_layer, hidden, dtype), free_bytes()
    tier = choose_placement("auto", size, free)
    if free is None:
        return tier, f"auto: {size_text(size)} of tables, the device's free memory unknown"
    fits = "fit" if tier == "device" else "do not fit"
    return tier, f"auto: {size_text(size)} of tables {fits} in half of the device's {size_text(free)} free"


def sharing_failed(error: BaseException, cuda: bool) -> bool:
    """Whether a device group failed to start because its ranks could not share their shards: a failed
    start check or IPC exchange (ShardSharingError) anywhere in the error's chain (a worker whose shard
    could not be shared reports it as one, see engram/worker.py); for CUDA ranks also a failed driver call
    for the shard memory (CudaIpcError). A worker that crashed, froze, timed out or failed otherwise is
    no sharing failure, on CUDA as on the CPU: its error stands."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, ShardSharingError) or (cuda and isinstance(error, CudaIpcError)):
            return True
        error = error.__cause__ or error.__context__
    return False


def new_host_store(rows_per_layer_fn, hidden: int, dtype: torch.dtype) -> HostRowStore:
    """Empty host-tier tables: a shared-memory segment, refused like CPU ranks when the machine's memory
    cannot hold it (its pages would be allocated by the first writes, and a full segment kills the process)."""
    group.check_cpu_memory(1, table_bytes(rows_per_layer_fn(1), hidden, dtype), subject="a host-memory table (shared-memory segment)")
    return HostRowStore.new(rows_per_layer_fn(1), hidden, dtype)


def _group_or_host(start, ranks: int, kind: str, host, name: str | None, reason: str):
    """`start()`'s device group; when its ranks could not share their shards, the host tier (`host()`)
    instead, its placement saying why, so the prompt goes on. A worker that failed otherwise fails with an
    EngramWorkerError naming the memory (`name`) and the rank."""
    try:
        store = start()
    except Exception as e:
        if not sharing_failed(e, kind == "CUDA"):
            if isinstance(e, EngramWorkerError) and name is not None:
                raise EngramWorkerError(f"{name} could not start its {ranks} {kind} rank(s): {e}", e.rank, e.exitcode, e.state) from e
            raise
        fell_back_from = f"{ranks} {kind} rank(s): {e}"
        logger.warning("engram: the memory could not be sharded over %s; it is on the host tier instead", fell_back_from)
        store = host()
        store.placement = Placement("host", None, 0, "its device ranks could not share their shards", fell_back_from)
        return store
    store.placement = Placement("device", kind, ranks, reason)
    return store


def make_store(rows_per_layer_fn, hidden: int, dtype: torch.dtype, devices: str, cpu_ranks: int, gpu_ranks: int = 0,
               placement: str = "device", host=None, name: str | None = None, reason: str = "asked for"):
    """The memory's RowStore, its `Placement` in `store.placement`. `rows_per_layer_fn(ranks)`: the rows
    per layer at a rank count. `placement`: the tier ("device" or "host", already resolved). `host`: the
    host-tier store, for `placement` = "host" and for a group whose ranks cannot share their shards (a new
    shared-memory segment by default; Load passes the table file mapped). `name`: the memory, as errors
    name it; `reason`: why this tier (resolve_tier's)."""
    host = host or (lambda: new_host_store(rows_per_layer_fn, hidden, dtype))
    if placement == "host":
        store = host()
        store.placement = Placement("host", None, 0, reason)
        return store
    if devices == "auto" and torch.cuda.is_available():
        ranks = len(cuda_rank_devices(gpu_ranks, torch.cuda.device_count()))
        return _group_or_host(lambda: group.EngramGroup(rows_per_layer_fn(ranks), hidden, dtype, num_ranks=ranks, device="cuda"),
                              ranks, "CUDA", host, name, reason)
    # Refused, with the figures, before anything is allocated or started (EngramGroup checks too).
    group.check_cpu_memory(cpu_ranks, group.EngramGroup.table_bytes(rows_per_layer_fn(cpu_ranks), hidden, dtype))
    if cpu_ranks == 1:
        store = LocalRowStore(rows_per_layer_fn(1), hidden, dtype)
        store.placement = Placement("device", "CPU", 1, reason)
        return store
    return _group_or_host(lambda: group.EngramGroup(rows_per_layer_fn(cpu_ranks), hidden, dtype, num_ranks=cpu_ranks, device="cpu"),
                          cpu_ranks, "CPU", host, name, reason)


def placement_text(store) -> str:
    """One line for a node's summary: where the store's rows live (and what it fell back from)."""
    size = table_bytes(store.rows_per_layer, store.hidden, store.table_dtype) / 2**30
    placed: Placement | None = store.placement
    if isinstance(store, HostRowStore):
        where = (f"the table file mapped read-only ({os.path.basename(store.source)}), shared by every process that loads it"
                 if store.source else "a shared-memory segment")
        text = f"placement: host ({size:.2f} GiB in {where}; fetched rows are paged in)"
        fell_back = placed.fell_back_from if placed is not None else None
        return f"{text}\n  instead of {fell_back}" if fell_back else text
    ranks = getattr(store, "num_ranks", 1)
    device = getattr(store, "device", "cpu")
    return f"placement: device ({size:.2f} GiB over {ranks} {str(device).split(':')[0].upper()} rank(s))"
