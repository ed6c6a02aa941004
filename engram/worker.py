"""Engram worker process: one rank of an EngramGroup (started by group.py, never by hand).

Started as `python <pack>/engram/worker.py --config <json>` with `sys.executable`, NOT through
multiprocessing spawn (inside ComfyUI that would re-run ComfyUI's main.py). Run as a script, this file
registers a synthetic package for the engram folder (without executing the pack's `__init__.py`, which
imports ComfyUI) and re-imports itself from it, so the relative imports below work.

The worker joins the process group over loopback (gloo), allocates its shard (on CUDA: on its GPU, shared
with the other ranks through CUDA IPC), reports "ready" on the control
connection (a socket inherited from the host), then serves commands: ("load", path), ("ping",),
("shutdown",). It never outlives the host: PR_SET_PDEATHSIG, a parent-pid watchdog and EOF on the
control connection each end it.

CPU workers are not started as fresh interpreters: a fresh Python with torch imported holds about 280 MB
of private memory (mostly the relocated pages of torch's libraries). `--template` starts one template
process per host instead, which imports torch and this package once and then forks a worker per CPU
rank on request; a forked worker shares the template's pages and owns only what it changes (a few MB).
The template forks from its only thread, reaps its children and reports each one's exit code to the
host; it dies with the host (PR_SET_PDEATHSIG, a parent-pid check, EOF on its connection), and its
workers die with it.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:
    import importlib
    import os as _os
    import sys as _sys
    import types as _types

    _engram_dir = _os.path.dirname(_os.path.abspath(__file__))
    for _name, _path in (("_fp8_engram_worker_pack", _os.path.dirname(_engram_dir)), ("_fp8_engram_worker_pack.engram", _engram_dir)):
        _module = _types.ModuleType(_name)
        _module.__path__ = [_path]
        _module.__package__ = _name
        _sys.modules[_name] = _module
    _sys.exit(importlib.import_module("_fp8_engram_worker_pack.engram.worker").main(_sys.argv[1:]))

import argparse
import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from multiprocessing.connection import Connection

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_WATCHDOG_PERIOD_S = 0.5
_TEMPLATE_POLL_S = 0.05  # how soon the template reports an ended worker


def _die_with_parent(parent_pid: int) -> None:
    """End this process when the host dies, however it dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the watchdog below still works
        pass
    if os.getppid() != parent_pid:  # the host died before prctl took effect
        os._exit(3)

    def watchdog() -> None:
        while True:
            time.sleep(_WATCHDOG_PERIOD_S)
            if os.getppid() != parent_pid:
                os._exit(3)

    threading.Thread(target=watchdog, name="engram-parent-watchdog", daemon=True).start()


def make_process_group(config: dict, rank: int):
    """Join the group of `config` (TCP store on loopback); returns (group, store)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=float(config["timeout"]))
    world = int(config["num_ranks"])
    store = dist.TCPStore("127.0.0.1", int(config["port"]), world, is_master=False, timeout=timeout)
    if config["device"] == "cuda":
        import torch

        torch.cuda.set_device(int(config["devices"][rank]))
    return gloo_group(store, rank, world, timeout), store


def rank_device(config: dict, rank: int):
    import torch

    return torch.device("cuda", int(config["devices"][rank])) if config["device"] == "cuda" else torch.device("cpu")


def gloo_group(store, rank: int, world: int, timeout: timedelta):
    """A gloo group on loopback that does not touch torch.distributed's global state."""
    from torch.distributed import ProcessGroupGloo

    options = ProcessGroupGloo._Options()
    options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = timeout
    options._threads = 2
    return ProcessGroupGloo(store, rank, world, options)


def load_own_rows(buffer, rank: int, path: str) -> list[list[int]]:
    """Copy this rank's row ranges of every layer from a table file; returns the [layer, start, stop] read."""
    import torch

    from .table_file import TableFile

    ranges = []
    with TableFile(path) as f:
        for layer, n in enumerate(buffer.num_entries_per_layer):
            start, stop = rank * n, (rank + 1) * n
            data, sf = f.read_rows(layer, start, stop)
            table, sf_view = buffer.shard(rank, layer)
            table.view(torch.uint8).copy_(data.view(torch.uint8))
            if sf_view is not None:
                sf_view.copy_(sf.view(sf_view.dtype))
            ranges.append([layer, start, min(stop, f.rows_per_layer[layer])])
    if buffer.device.type == "cuda":
        torch.cuda.synchronize(buffer.device)
    return ranges


def serve(conn: Connection, buffer, rank: int) -> int:
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return 3  # the host is gone
        command = message[0]
        try:
            if command == "shutdown":
                conn.send(("ok", None))
                return 0
            if command == "ping":
                conn.send(("ok", os.getpid()))
            elif command == "load":
                conn.send(("ok", load_own_rows(buffer, rank, message[1])))
            else:
                conn.send(("error", ValueError(f"unknown engram worker command {command!r}")))
        except Exception as e:  # noqa: BLE001 - reported to the host, which raises it
            logger.exception("engram worker %d: command %r failed", rank, command)
            try:
                conn.send(("error", e))
            except Exception:  # noqa: BLE001 - an unpicklable exception still reaches the host as text
                conn.send(("error", RuntimeError(f"{type(e).__name__}: {e}")))


def run_worker(rank: int, conn: Connection, config: dict) -> int:
    """Join the group, allocate this rank's shard, report "ready", serve commands; returns the exit code."""
    import torch

    torch.set_num_threads(max(1, int(config.get("threads", 1))))
    from .allocators import ShardSharingError
    from .buffer import LocalEngramBuffer
    from .cuda_ipc import CudaIpcError

    try:
        group, _store = make_process_group(config, rank)
        device = rank_device(config, rank)
        buffer = LocalEngramBuffer(
            group,
            config["rows_per_rank"],
            int(config["hidden"]),
            int(config["num_max_tokens"]),
            int(config["num_entries_per_token"]),
            getattr(torch, config["dtype"]),
            int(config["num_sf_packs"]),
            device=device,
            # Workers never fetch (the host does): skip the kernel's setup (and importing Triton).
            gather="fixed_shape" if device.type == "cuda" else None,
        )
    except Exception as e:  # noqa: BLE001 - the host shows it
        logger.exception("engram worker %d failed to start", rank)
        try:
            text = f"engram worker {rank} failed to start: {type(e).__name__}: {e}"
            # Plain types only: this module runs under a package name the host does not have. A shard
            # that could not be shared (or whose CUDA driver calls for shard memory failed) gets its own
            # status: the host raises ShardSharingError for it, which the nodes serve from the host tier.
            sharing = isinstance(e, (ShardSharingError, CudaIpcError))
            conn.send(("sharing_error", text) if sharing else ("error", RuntimeError(text)))
        except OSError:
            pass
        return 2
    conn.send(("ready", os.getpid()))
    code = serve(conn, buffer, rank)
    memory = buffer._memory
    buffer.destroy()  # CUDA: collective with the host and the other workers
    if code == 0 and memory is not None and memory.held_by:
        # the host still maps this rank's shard through a view kept past close: this process (which
        # owns the memory) stays until the host says the view is gone, or the host ends
        try:
            conn.recv()
        except (EOFError, OSError):
            pass
    return code


def _log_to_stderr(name: str) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    logging.basicConfig(level=logging.WARNING, format=f"[{name}] %(levelname)s %(message)s", stream=sys.stderr)


def _forked_worker(rank: int, fd: int, template_pid: int, config: dict) -> int:
    """The body of a worker forked by the template (runs in the child, never returns to the template)."""
    _die_with_parent(template_pid)  # its watchdog thread is safe to start here: the fork is done
    _log_to_stderr(f"engram worker {rank}")
    return run_worker(rank, Connection(fd), config)


def template_main(conn: Connection, parent_pid: int) -> int:
    """Import what a worker needs, then fork workers on request until the host goes away.

    Requests: ("fork", rank, config) followed by the worker's control socket (SCM_RIGHTS), answered by
    ("forked", pid); ("stop",). Unasked: ("exit", pid, exit code) when a worker ends. No thread is
    started here: a process that forks must have only the forking thread."""
    import gc
    from multiprocessing.reduction import recv_handle

    import torch  # noqa: F401 - imported once here, shared by every forked worker
    import torch.distributed  # noqa: F401

    from . import allocators, buffer, store, table_file  # noqa: F401
    from torch.distributed import ProcessGroupGloo  # noqa: F401

    gc.collect()
    gc.freeze()  # keep the collector from writing to (and so copying) the shared objects in the workers
    conn.send(("ready", os.getpid()))
    me = os.getpid()
    while True:
        try:
            ready = conn.poll(_TEMPLATE_POLL_S)
        except (EOFError, OSError):
            return 3
        if os.getppid() != parent_pid:
            return 3
        if ready:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return 3
            if message[0] == "stop":
                return 0
            if message[0] == "fork":
                _, rank, config = message
                fd = recv_handle(conn)
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        conn.close()
                        code = _forked_worker(rank, fd, me, config)
                    except BaseException:  # noqa: BLE001 - a child must never return into the template's loop
                        logger.exception("engram worker %d failed", rank)
                    finally:
                        sys.stderr.flush()
                        os._exit(code)
                os.close(fd)
                conn.send(("forked", pid))
        while True:  # reap ended workers and tell the host how they ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            try:
                conn.send(("exit", pid, os.waitstatus_to_exitcode(status)))
            except OSError:
                return 3


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="fp8-engram engram worker (started by EngramGroup)")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--template", action="store_true", help="fork CPU workers on request instead of being one")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--config", help="JSON geometry and rendezvous settings")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the host, which shuts us down
    conn = Connection(args.control_fd)
    if args.template:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # not Linux: the parent-pid check of the loop still works
            pass
        if os.getppid() != args.parent_pid:
            os._exit(3)
        _log_to_stderr("engram worker template")
        code = template_main(conn, args.parent_pid)
    else:
        _die_with_parent(args.parent_pid)
        _log_to_stderr(f"engram worker {args.rank}")
        code = run_worker(args.rank, conn, json.loads(args.config))
    sys.stderr.flush()
    # Skip interpreter teardown: destructors of a process group whose peers are gone can block.
    os._exit(code)
