"""EngramGroup: engram tables sharded over worker processes, served in the host process (a RowStore).

The host process (ComfyUI's) is rank 0. It starts one worker per further rank with `sys.executable`
running engram/worker.py (never multiprocessing spawn), forms a private process group on loopback
(gloo, never torch.distributed's default group, which stays free for ComfyUI or other packs), and
every rank allocates its shard in memory every rank maps (shared memory on the CPU; on CUDA plain device
memory opened by every peer through CUDA IPC, see allocators.py). CUDA rank r runs on GPU
r % device_count; ranks sharing a GPU need no setting. Fetches, reads and writes then run in the host
alone, touching peers' shards directly: no collective and no message per call (on CUDA one Triton
kernel per fetch, see gather_triton.py). Workers only hold their memory and load their own row ranges
of table files.

Any number of groups may live in one process, one after another or at once, of any size, rank count
and device: each has its own workers, store and gloo group, and its shard exchange keeps no state
outside the group (unlike torch's symmetric memory, whose process-wide exchange counter made a second
CUDA group's rendezvous hang).

Supervision: every call first checks that each worker is alive; a dead worker raises EngramWorkerError
(rank and exit code), and every command to workers waits with a deadline while watching the process,
so nothing hangs. `alive` and `check()` are the cheap health checks (a poll of each worker process).
Workers die with the host (PR_SET_PDEATHSIG, a parent-pid watchdog, EOF on their control socket).
`close()` tells the workers to stop, releases the host's views of the shards (on CUDA every rank
unmaps its peers and the ranks agree before any owner frees its shard), waits for the workers, then
hands the host's own shard back (GPU memory included); it also runs when the group is collected and
at interpreter exit.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from ..common.proc import process_state
from ..common.sizes import size_text
from . import ue8m0
from .errors import EngramWorkerError
from .allocators import STALE_SEGMENT_S, ShardSharingError, SharedMemoryFullError, check_shm_room, remove_segments
from .buffer import LocalEngramBuffer
from .processes import (  # noqa: F401 - NotEnoughMemoryError, the CPU costs and the template's state are re-exported
    _POLL_S,
    _SHUTDOWN_WAIT_S,
    _WORKER_SCRIPT,
    CPU_TEMPLATE_BYTES,
    CPU_WORKER_BYTES,
    NotEnoughMemoryError,
    _acquire_template,
    _launch,
    _Template,
    check_cpu_memory,
    cpu_group_cost,
    stop_idle_template,
    template_running,
)
from .rows import check_fetch_indices, check_layer, check_rows, check_table_geometry, check_values, decode_checked, encode_rows, last_occurrence
from .worker import gloo_group

logger = logging.getLogger(__name__)

_STOPPED_STATES = ("T", "t")  # /proc/<pid>/stat: stopped by a signal, stopped by a tracer
_STOPPED_GRACE_S = 2.0  # a worker stopped this long while it is waited for is reported as frozen




class _Worker:
    def __init__(self, rank: int, process: subprocess.Popen, conn: Connection) -> None:
        self.rank = rank
        self.process = process
        self.conn = conn


def _last_words(worker: _Worker) -> BaseException | None:
    """The error a worker that has exited sent before it went (a failed start says why), if any."""
    try:
        if worker.conn.poll(0):
            status, value = worker.conn.recv()
            if status == "sharing_error":
                return ShardSharingError(value)
            if status == "error" and isinstance(value, BaseException):
                return value
    except (EOFError, OSError, ValueError, TypeError):
        pass
    return None


def _release_group(workers: list[_Worker], holder: list, templates: list | None = None) -> None:
    """Release in the order CUDA IPC wants: the workers are told to stop (each unmaps its peers, joins
    the group's release exchange, frees its own shard, exits), the host unmaps its peers and joins the
    same exchange, waits for the workers to exit, then frees its own shard."""
    buffer = holder.pop() if holder else None
    try:
        memory = getattr(buffer, "_memory", None)
        if memory is not None:
            by_rank = {w.rank: w for w in workers}
            # a view of worker r's shard kept past close: r stays alive until that view is gone
            memory.on_peer_unmapped = lambda rank: _let_worker_go(by_rank.get(rank))
        _ask_workers_to_stop(workers)
        if buffer is not None:
            held = lambda: set(getattr(memory, "held_peers", ()))  # noqa: E731 - known after the exchange
            buffer.destroy(between=lambda: _wait_for_workers([w for w in workers if w.rank not in held()]))
        else:
            _wait_for_workers(workers)
    finally:
        _remove_ended_workers_segments(workers)
        while templates:
            templates.pop().release()


def _remove_stale_segments() -> None:
    removed = remove_segments(older_than_s=STALE_SEGMENT_S)
    if removed:
        logger.warning("removed %d engram shared-memory file(s) that ended processes left in /dev/shm (%s in all): %s",
                       len(removed), size_text(sum(size for _, size in removed), mib_digits=1),
                       ", ".join(name for name, _ in removed))


def _remove_ended_workers_segments(workers: list[_Worker]) -> None:
    """A worker ended (killed, or ended by a failed start) before it unlinked its shard file: the host removes it."""
    for worker in workers:
        if worker.process.poll() is None:
            continue  # still running: kept alive for a view of its shard, its file long unlinked
        removed = remove_segments(worker.process.pid)
        if removed:
            logger.info("engram worker rank %d ended before unlinking its shard file; removed %s", worker.rank,
                        ", ".join(name for name, _ in removed))


def _let_worker_go(worker: _Worker | None) -> None:
    """Tell a worker kept alive for a view of its shard that the view is gone (it then exits).
    Runs where that view's storage is freed: it only writes to the worker's socket."""
    if worker is None:
        return
    try:
        worker.conn.send(("released",))
        worker.conn.close()
    except (OSError, ValueError):  # the worker or its socket is already gone
        pass


def _ask_workers_to_stop(workers: list[_Worker]) -> None:
    for worker in workers:
        if worker.process.poll() is None:
            if process_state(worker.process.pid) in _STOPPED_STATES:
                worker.process.kill()  # frozen: it would never read the request
                continue
            try:
                worker.conn.send(("shutdown",))
            except OSError:
                pass


def _wait_for_workers(workers: list[_Worker]) -> None:
    deadline = time.monotonic() + _SHUTDOWN_WAIT_S
    for worker in workers:
        try:
            worker.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("engram worker %d did not stop within %.0f s; killing it", worker.rank, _SHUTDOWN_WAIT_S)
            worker.process.kill()
            worker.process.wait()
        worker.conn.close()


class EngramGroup:
    """Engram tables over `num_ranks` processes (this one is rank 0); implements RowStore.

    `rows_per_layer` are the GLOBAL rows each layer needs; every layer is padded up to a multiple of
    `num_ranks`, and `self.rows_per_layer` reports the padded counts (rows past what was asked stay zero).
    `device` is "cpu" (gloo, shared memory; `num_ranks` CPU ranks) or "cuda" (driver memory shared by CUDA IPC; rank r on
    GPU r % device_count, so several ranks may share a GPU). `num_entries_per_token` and `num_max_tokens` configure the DeepEP-style `fetch` of
    `self.buffer`; `fetch_rows` accepts any entry and token count.
    """

    def __init__(
        self,
        rows_per_layer: Sequence[int],
        hidden: int,
        table_dtype: torch.dtype = torch.bfloat16,
        *,
        num_ranks: int = 1,
        device: str = "cpu",
        num_entries_per_token: int = 16,
        num_max_tokens: int = 4096,
        timeout: float = 60.0,
        worker_threads: int = 1,
    ) -> None:
        requested = check_table_geometry(rows_per_layer, hidden, table_dtype)
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
        if device == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("EngramGroup(device='cuda') needs a CUDA GPU; use device='cpu'")
            count = torch.cuda.device_count()
            self.rank_devices = [r % count for r in range(num_ranks)]
        else:
            self.rank_devices = [-1] * num_ranks
        self.num_ranks = num_ranks
        self.device = torch.device("cuda", self.rank_devices[0]) if device == "cuda" else torch.device("cpu")
        self.hidden = hidden
        self.table_dtype = table_dtype
        self.num_layers = len(requested)
        self.requested_rows_per_layer = requested
        self.rows_per_rank = [-(-n // num_ranks) for n in requested]
        self.rows_per_layer = [r * num_ranks for r in self.rows_per_rank]
        self.num_sf_packs = ue8m0.num_sf_packs(hidden) if table_dtype == torch.float8_e4m3fn else 0
        self.timeout = float(timeout)
        # where the rows live and why (a placement.Placement), set by placement.make_store; None when made directly
        self.placement = None
        if device == "cpu":
            if num_ranks > 1:  # files an ended process left in /dev/shm take memory both checks count as used
                _remove_stale_segments()
            check_cpu_memory(num_ranks, self.table_bytes(self.rows_per_layer, hidden, table_dtype))
            if num_ranks > 1:  # the shards are /dev/shm files: refused before any worker starts when it has no room
                check_shm_room(f"{num_ranks} CPU ranks' engram shards", self.table_bytes(self.rows_per_layer, hidden, table_dtype))
        self._workers: list[_Worker] = []
        self._templates: list[_Template] = []
        self._failure: EngramWorkerError | None = None
        self.last_load_ranges: dict[int, list[list[int]]] = {}
        self.source: str | None = None  # the table file last loaded
        self._closed = False
        self.buffer: LocalEngramBuffer | None = None
        self._holder: list[LocalEngramBuffer] = []
        self._group = None
        self._store = None
        # Releases everything when the group is closed, collected, or at interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(self, _release_group, self._workers, self._holder, self._templates)
        try:
            self._start(device, num_entries_per_token, num_max_tokens, worker_threads)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def table_bytes(rows_per_layer: Sequence[int], hidden: int, table_dtype: torch.dtype) -> int:
        """Bytes of tables (scale factors included) `rows_per_layer` rows of `hidden` take."""
        row = hidden * torch.empty((), dtype=table_dtype).element_size()
        if table_dtype == torch.float8_e4m3fn:
            row += 4 * ue8m0.num_sf_packs(hidden)
        return sum(int(n) for n in rows_per_layer) * row

    def __repr__(self) -> str:
        return f"EngramGroup(num_ranks={self.num_ranks}, rows_per_layer={self.rows_per_layer}, hidden={self.hidden}, table_dtype={self.table_dtype}, device={self.device})"

    # ----- startup -----

    def _start(self, device: str, entries: int, max_tokens: int, worker_threads: int) -> None:
        timeout = timedelta(seconds=self.timeout)
        if self.num_ranks > 1:
            self._store = dist.TCPStore("127.0.0.1", 0, self.num_ranks, is_master=True, timeout=timeout, wait_for_workers=False)
            port = self._store.port
        else:
            self._store = dist.HashStore()
            port = 0
        config = {
            "devices": self.rank_devices,
            "num_ranks": self.num_ranks,
            "port": port,
            "timeout": self.timeout,
            "device": device,
            "rows_per_rank": self.rows_per_rank,
            "hidden": self.hidden,
            "dtype": str(self.table_dtype).removeprefix("torch."),
            "num_sf_packs": self.num_sf_packs,
            "num_entries_per_token": entries,
            "num_max_tokens": max_tokens,
            "threads": worker_threads,
        }
        if device == "cpu" and self.num_ranks > 1:
            self._templates.append(_acquire_template())
        for rank in range(1, self.num_ranks):
            if self._templates:
                self._workers.append(self._fork_worker(self._templates[0], rank, config))
            else:
                self._workers.append(_launch(lambda rank=rank: self._spawn_worker(rank, config)))

        def build() -> LocalEngramBuffer:
            # No torch.cuda.set_device here: the host's current device is ComfyUI's business (the
            # buffer names its device everywhere).
            self._group = gloo_group(self._store, 0, self.num_ranks, timeout)
            buffer = LocalEngramBuffer(
                self._group, self.rows_per_rank, self.hidden, max_tokens, entries, self.table_dtype, self.num_sf_packs, device=self.device
            )
            self._holder.append(buffer)
            return buffer

        self.buffer = self._run_watched(build, "start the engram group")
        for worker in self._workers:
            status, value = self._receive(worker, time.monotonic() + self.timeout, "start")
            if status == "sharing_error":
                raise ShardSharingError(value)
            if status != "ready":
                raise EngramWorkerError(f"engram worker rank {worker.rank} failed to start: {value}", worker.rank)
        logger.info("engram group up: %d %s rank(s), %s", self.num_ranks, device, self.rows_per_layer)

    def _spawn_worker(self, rank: int, config: dict) -> _Worker:
        host_end, worker_end = socket.socketpair()
        try:
            env = dict(os.environ)
            env.setdefault("OMP_NUM_THREADS", str(config["threads"]))
            process = subprocess.Popen(
                [
                    sys.executable,
                    _WORKER_SCRIPT,
                    "--rank",
                    str(rank),
                    "--control-fd",
                    str(worker_end.fileno()),
                    "--parent-pid",
                    str(os.getpid()),
                    "--config",
                    json.dumps(config),
                ],
                pass_fds=[worker_end.fileno()],
                stdin=subprocess.DEVNULL,
                env=env,
                close_fds=True,
            )
        finally:
            worker_end.close()
        return _Worker(rank, process, Connection(host_end.detach()))

    def _fork_worker(self, template: _Template, rank: int, config: dict) -> _Worker:
        host_end, worker_end = socket.socketpair()
        try:
            process = template.fork(rank, config, worker_end.fileno())
        except BaseException:
            host_end.close()
            raise
        finally:
            worker_end.close()
        return _Worker(rank, process, Connection(host_end.detach()))

    def _run_watched(self, fn, what: str):
        """Run a blocking collective step in a thread while watching the workers (never hang on a dead one)."""
        box: list = []

        def target() -> None:
            try:
                box.append(("ok", fn()))
            except BaseException as e:  # noqa: BLE001
                box.append(("error", e))

        thread = threading.Thread(target=target, name="engram-collective", daemon=True)
        thread.start()
        deadline = time.monotonic() + self.timeout
        stopped: dict[int, float] = {}
        while thread.is_alive():
            self._check_workers(what)
            for worker in self._workers:
                self._check_not_frozen(worker, stopped, what)
            if time.monotonic() > deadline:
                ranks = [w.rank for w in self._workers]
                raise EngramWorkerError(f"could not {what} within {self.timeout:.0f} s: worker rank(s) {ranks} did not take part (stuck?)", ranks[0] if len(ranks) == 1 else None)
            thread.join(_POLL_S)
        status, value = box[0]
        if status == "error":
            if not isinstance(value, (SharedMemoryFullError, ShardSharingError)):  # every rank failed alike: the figures, not "a worker died"
                self._check_workers(what)
            raise value
        return value

    # ----- supervision -----

    def _check_workers(self, what: str = "serve the call") -> None:
        if self._failure is not None:
            raise self._failure
        for worker in self._workers:
            code = worker.process.poll()
            if code is not None:
                how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                said = _last_words(worker)
                self._failure = EngramWorkerError(
                    f"engram worker rank {worker.rank} (pid {worker.process.pid}) died ({how}); cannot {what}"
                    + (f" ({said})" if said is not None else ""),
                    worker.rank,
                    code,
                )
                raise self._failure from said

    def _check_not_frozen(self, worker: _Worker, stopped: dict[int, float], what: str) -> None:
        """Raise when `worker`, which is being waited for, has been stopped (SIGSTOP, a debugger) for
        _STOPPED_GRACE_S: it cannot answer until someone resumes it, so waiting out the timeout helps nobody.
        `stopped` keeps, per rank, since when it was seen stopped."""
        if process_state(worker.process.pid) not in _STOPPED_STATES:
            stopped.pop(worker.rank, None)
            return
        since = stopped.setdefault(worker.rank, time.monotonic())
        if time.monotonic() - since >= _STOPPED_GRACE_S:
            self._failure = EngramWorkerError(
                f"engram worker rank {worker.rank} (pid {worker.process.pid}) is stopped (frozen by SIGSTOP or a "
                f"debugger) and cannot {what}",
                worker.rank,
                state="stopped",
            )
            raise self._failure

    def _receive(self, worker: _Worker, deadline: float, what: str) -> tuple[str, Any]:
        stopped: dict[int, float] = {}
        while True:
            try:
                if worker.conn.poll(_POLL_S):
                    return worker.conn.recv()
            except (EOFError, OSError):
                time.sleep(_POLL_S)  # the process is going away; let poll() see it
            self._check_workers(what)
            self._check_not_frozen(worker, stopped, what)
            if time.monotonic() > deadline:
                raise EngramWorkerError(f"engram worker rank {worker.rank} did not answer within {self.timeout:.0f} s ({what})",
                                        worker.rank, state="unresponsive")

    def _command(self, message: tuple, what: str) -> list[Any]:
        """Send a command to every worker and collect the replies (raising the first failure)."""
        for worker in self._workers:
            try:
                worker.conn.send(message)
            except OSError:
                self._check_workers(what)
                raise
        replies = []
        deadline = time.monotonic() + self.timeout
        for worker in self._workers:
            status, value = self._receive(worker, deadline, what)
            if status == "error":
                raise value
            replies.append(value)
        return replies

    def _ready(self, what: str) -> LocalEngramBuffer:
        if self._closed:
            raise RuntimeError("this EngramGroup is closed")
        self._check_workers(what)
        return self.buffer

    @property
    def alive(self) -> bool:
        """True while the group is open and every worker process runs (a cheap poll, no message)."""
        if self._closed or self._failure is not None:
            return False
        return all(worker.process.poll() is None for worker in self._workers)

    def check(self) -> None:
        """Raise EngramWorkerError naming the rank if a worker died, RuntimeError if the group is closed."""
        self._ready("serve the call")

    @property
    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    def ping(self) -> list[int]:
        """Round trip to every worker; returns their pids."""
        self._ready("ping")
        return self._command(("ping",), "ping")

    # ----- RowStore -----

    def fetch_rows(self, indices: torch.Tensor) -> list[torch.Tensor]:
        buffer = self._ready("fetch rows")
        check_fetch_indices(indices, self.num_layers)
        _, tokens, entries = indices.shape
        flat = indices.reshape(self.num_layers, tokens * entries)
        data, sf = buffer.gather_layers(flat)  # every layer's rows in one pass
        return [decode_checked(data[layer], sf[layer] if sf is not None else None, flat[layer], layer, self.source)
                .view(tokens, entries, self.hidden) for layer in range(self.num_layers)]

    def read_rows(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        buffer = self._ready("read rows")
        layer = check_layer(layer, self.num_layers)
        rows = check_rows(rows, self.rows_per_layer[layer], layer)
        return decode_checked(*buffer.read_global_rows(layer, rows), rows, layer, self.source)

    def write_rows(self, layer: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        buffer = self._ready("write rows")
        layer = check_layer(layer, self.num_layers)
        rows = check_rows(rows, self.rows_per_layer[layer], layer)
        values = check_values(values, rows.numel(), self.hidden, layer)
        rows, values = last_occurrence(rows, values)
        data, sf = encode_rows(values.float(), self.table_dtype)
        buffer.write_global_rows(layer, rows, data, sf)

    # ----- table files -----

    def save_table_file(self, path: str, *, hashing: Any = None, streams: Any = None) -> None:
        """Write every row (padding included, so nothing written is lost) to a table file, shard by shard."""
        from .table_file import write_table_file

        buffer = self._ready("save a table file")
        shards = [[buffer.shard(rank, layer) for rank in range(self.num_ranks)] for layer in range(self.num_layers)]
        tables = [[table for table, _ in layer] for layer in shards]
        scales = [[sf for _, sf in layer] for layer in shards] if self.num_sf_packs else None
        write_table_file(path, tables, scales, hashing=hashing, streams=streams)

    def load_table_file(self, path: str, *, rows_needed: Sequence[int] | None = None) -> dict:
        """Load a table file: every rank reads only its own row ranges. Returns the file's metadata.

        The file's layers may have fewer rows than this group's (padding); rows it lacks become zero. With
        `rows_needed` they may also have more (padding for another rank count, not read): see
        TableFile.check_geometry.
        """
        from .table_file import TableFile
        from .worker import load_own_rows

        buffer = self._ready("load a table file")
        path = os.path.abspath(path)
        with TableFile(path) as f:
            f.check_geometry(self.rows_per_layer, self.hidden, self.table_dtype, allow_fewer_rows=True, rows_needed=rows_needed)
            metadata = f.metadata
        self.last_load_ranges = {0: load_own_rows(buffer, 0, path)}
        for worker, ranges in zip(self._workers, self._command(("load", path), f"load {path}")):
            self.last_load_ranges[worker.rank] = ranges
        self.source = path  # named when its rows are not finite
        return metadata

    @classmethod
    def from_table_file(cls, path: str, *, num_ranks: int = 1, device: str = "cpu", **kwargs: Any) -> EngramGroup:
        """A group with a table file's geometry, loaded from it."""
        from .table_file import TableFile

        with TableFile(path) as f:
            geometry = (f.rows_per_layer, f.hidden, f.table_dtype)
        group = cls(*geometry, num_ranks=num_ranks, device=device, **kwargs)
        try:
            group.load_table_file(path)
        except BaseException:
            group.close()
            raise
        return group

    # ----- shutdown -----

    def close(self) -> None:
        """Release the shards and shut the workers down (waiting for them); GPU memory comes back. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.buffer = None
        self._finalizer()
        self._group = None
        self._store = None

    def __enter__(self) -> EngramGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
