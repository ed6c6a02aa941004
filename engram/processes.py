"""The processes behind an EngramGroup: the launcher thread workers are started from, the worker
template CPU workers are forked from, and what CPU ranks cost in memory (refused before anything starts
when the machine cannot hold them).

PR_SET_PDEATHSIG fires when the THREAD that started a child ends, so every worker and the template are
started from one long-lived launcher thread. A fresh Python with torch imported holds about 280 MB of
private memory, so CPU workers are forked from one template process per host (see worker.py), which
lingers TEMPLATE_LINGER_S after its last group so that a rebuild reuses it.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

from ..common.proc import kib_fields, process_state
from ..common.sizes import size_text
from .errors import EngramWorkerError

logger = logging.getLogger(__name__)

_WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
_POLL_S = 0.05
_SHUTDOWN_WAIT_S = 5.0


class NotEnoughMemoryError(MemoryError):
    """A CPU group whose tables and worker processes the machine's available memory cannot hold."""


# PR_SET_PDEATHSIG fires when the THREAD that started the child ends, so workers are started from one
# long-lived thread rather than from whichever thread (e.g. ComfyUI's prompt worker) built the group.
_launch_queue: queue.Queue | None = None
_launch_lock = threading.Lock()


def _launcher_loop(q: queue.Queue) -> None:
    while True:
        fn, box, done = q.get()
        try:
            box.append(("ok", fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box.append(("error", e))
        done.set()


def _launch(fn):
    global _launch_queue
    with _launch_lock:
        if _launch_queue is None:
            _launch_queue = queue.Queue()
            threading.Thread(target=_launcher_loop, args=(_launch_queue,), name="engram-launcher", daemon=True).start()
    box: list = []
    done = threading.Event()
    _launch_queue.put((fn, box, done))
    done.wait()
    status, value = box[0]
    if status == "error":
        raise value
    return value


# ----- the worker template (CPU workers are forked from it) -----

_TEMPLATE_START_S = 120.0  # importing torch on a loaded machine
TEMPLATE_LINGER_S = 60.0  # how long the template outlives its last group (a rebuild reuses it)


class _ForkedProcess:
    """A worker forked by the template: not a child of this process, so its exit code comes from the
    template (which reaps it). Quacks like the subprocess.Popen parts the group uses."""

    def __init__(self, template: "_Template", pid: int) -> None:
        self.template = template
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.template.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"engram worker {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class _Template:
    """The host's connection to its worker template process (see worker.py). One at a time per host
    process, shared by every CPU group; it ends when the last group using it is released."""

    def __init__(self) -> None:
        host_end, template_end = socket.socketpair()
        try:
            self.process = subprocess.Popen(
                [sys.executable, _WORKER_SCRIPT, "--template", "--control-fd", str(template_end.fileno()), "--parent-pid", str(os.getpid())],
                pass_fds=[template_end.fileno()],
                stdin=subprocess.DEVNULL,
                env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")),
                close_fds=True,
            )
        finally:
            template_end.close()
        self.conn = Connection(host_end.detach())
        self.users = 0
        self.lock = threading.Lock()  # one fork request at a time
        self.replies: queue.Queue = queue.Queue()
        self.exits: dict[int, int] = {}
        self.ended = False
        self.stopped = False
        threading.Thread(target=self._read, name="engram-template-reader", daemon=True).start()
        try:
            self._reply("start the engram worker template", _TEMPLATE_START_S)
        except BaseException:
            self.stop()
            raise

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "exit":
                self.exits[message[1]] = message[2]
            else:
                self.replies.put(message)
        self.ended = True
        self.replies.put(("ended", None))

    def _reply(self, what: str, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            try:
                kind, value = self.replies.get(timeout=_POLL_S)
            except queue.Empty:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise EngramWorkerError(f"could not {what}: the engram worker template "
                                            f"{'ended (exit code ' + str(self.process.returncode) + ')' if self.process.poll() is not None else 'did not answer'}") from None
                continue
            if kind == "ended":
                raise EngramWorkerError(f"could not {what}: the engram worker template ended")
            return value

    @property
    def alive(self) -> bool:
        return not self.ended and self.process.poll() is None

    def fork(self, rank: int, config: dict, fd: int) -> _ForkedProcess:
        from multiprocessing.reduction import send_handle

        with self.lock:
            self.conn.send(("fork", rank, config))
            send_handle(self.conn, fd, self.process.pid)
            pid = self._reply(f"start engram worker rank {rank}", 30.0)
        return _ForkedProcess(self, int(pid))

    def exit_code(self, pid: int) -> int | None:
        code = self.exits.pop(pid, None)
        if code is None and self.ended and process_state(pid) in (None, "Z"):
            code = -signal.SIGKILL  # the template ended and took its workers with it (PR_SET_PDEATHSIG)
        return code

    def release(self) -> None:
        with _template_lock:
            self.users -= 1
            if self.users > 0:
                return
            linger = TEMPLATE_LINGER_S if _template is self and self.alive else 0.0
        if linger <= 0:
            _stop_if_unused(self)
            return
        # A memory rebuilt with new settings closes its old group, then starts a new one: keep the
        # template (a Python with torch imported, 5-10 s to start) that long rather than restart it.
        timer = threading.Timer(linger, _stop_if_unused, args=(self,))
        timer.name, timer.daemon = "engram-template-linger", True
        timer.start()

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        try:
            self.conn.send(("stop",))
        except OSError:
            pass
        try:
            self.process.wait(_SHUTDOWN_WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.conn.close()


_template: _Template | None = None
_template_lock = threading.Lock()


def _stop_if_unused(template: _Template) -> None:
    global _template
    with _template_lock:
        if template.users > 0:
            return
        if _template is template:
            _template = None
    template.stop()


def stop_idle_template() -> bool:
    """Stop the worker template now if no group uses it (it otherwise lingers TEMPLATE_LINGER_S after its
    last group); for "free memory" requests. True when one was stopped."""
    with _template_lock:
        template = _template
    if template is None or template.users > 0:
        return False
    _stop_if_unused(template)
    return not template.alive


def _acquire_template() -> _Template:
    """The running template (started through the launcher thread when there is none), with one more user."""
    global _template
    with _template_lock:
        if _template is None or not _template.alive:
            _template = _launch(_Template)
        _template.users += 1
        return _template


def template_running() -> bool:
    with _template_lock:
        return _template is not None and _template.alive


# ----- what CPU ranks cost in memory -----

# Private memory (USS) of one forked CPU worker once its group is up, and of the template it is forked
# from (a Python with torch imported), measured with bench/engram_rank_memory.py on the 2-core CPU
# machine (torch 2.14.1: about 5 MB and 283 MB), rounded up. The tables are shared memory, counted once whatever the ranks.
CPU_WORKER_BYTES = 16 << 20
CPU_TEMPLATE_BYTES = 300 << 20
# What a CPU group must leave available for everything else (ComfyUI's models above all).
MEMORY_RESERVE_FRACTION = 0.10
MEMORY_RESERVE_MIN_BYTES = 1 << 30


def _meminfo() -> dict[str, int] | None:
    return kib_fields("/proc/meminfo")


_gib = size_text


def cpu_group_cost(num_ranks: int, table_bytes: int, template_up: bool | None = None) -> int:
    """Bytes of host memory a CPU group of `num_ranks` ranks holding `table_bytes` of tables adds."""
    workers = max(num_ranks - 1, 0)
    if template_up is None:
        template_up = template_running()
    return table_bytes + workers * CPU_WORKER_BYTES + (CPU_TEMPLATE_BYTES if workers and not template_up else 0)


def check_cpu_memory(num_ranks: int, table_bytes: int, meminfo: dict[str, int] | None = None, template_up: bool | None = None,
                     subject: str | None = None) -> None:
    """Raise NotEnoughMemoryError, with the figures, when the machine's available memory (MemAvailable)
    minus a reserve (10 % of its memory, at least 1 GiB) cannot hold the tables and worker processes of
    a CPU group of `num_ranks` ranks. Does nothing where /proc/meminfo cannot be read. `subject` names
    what needs the memory in the message when it is not a CPU group (e.g. a host-tier table)."""
    info = _meminfo() if meminfo is None else meminfo
    if not info or "MemAvailable" not in info:
        return
    if template_up is None:
        template_up = template_running()
    available = info["MemAvailable"]
    reserve = max(int(info.get("MemTotal", 0) * MEMORY_RESERVE_FRACTION), MEMORY_RESERVE_MIN_BYTES)
    need = cpu_group_cost(num_ranks, table_bytes, template_up)
    room = available - reserve
    if need <= room:
        return
    workers = num_ranks - 1
    parts = [f"{_gib(table_bytes)} of tables"]
    if workers:
        parts.append(f"{workers} worker process(es) x {_gib(CPU_WORKER_BYTES)}")
        if not template_up:
            parts.append(f"{_gib(CPU_TEMPLATE_BYTES)} for the process they are forked from")
    fits = 0
    for ranks in range(num_ranks - 1, 0, -1):
        if cpu_group_cost(ranks, table_bytes, template_up) <= room:
            fits = ranks
            break
    advice = (f"use at most {fits} CPU rank(s)" if fits else "make the tables smaller (fewer rows_per_head, heads or max_order, or fp8_e4m3fn)")
    who = f"{num_ranks} CPU rank(s) need" if subject is None else f"{subject} needs"
    raise NotEnoughMemoryError(
        f"{who} about {_gib(need)} ({' + '.join(parts)}), but this machine has "
        f"{_gib(available)} available and {_gib(reserve)} of it stays free for ComfyUI and its models; {advice}")
