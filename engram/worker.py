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


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="fp8-engram engram worker (started by EngramGroup)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--config", required=True, help="JSON geometry and rendezvous settings")
    args = parser.parse_args(argv)
    _die_with_parent(args.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the host, which shuts us down
    logging.basicConfig(level=logging.WARNING, format=f"[engram worker {args.rank}] %(levelname)s %(message)s", stream=sys.stderr)
    config = json.loads(args.config)
    conn = Connection(args.control_fd)

    import torch

    torch.set_num_threads(max(1, int(config.get("threads", 1))))
    from .buffer import LocalEngramBuffer

    try:
        group, _store = make_process_group(config, args.rank)
        device = rank_device(config, args.rank)
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
        logger.exception("engram worker %d failed to start", args.rank)
        try:
            conn.send(("error", RuntimeError(f"engram worker {args.rank} failed to start: {type(e).__name__}: {e}")))
        except OSError:
            pass
        os._exit(2)
    conn.send(("ready", os.getpid()))
    code = serve(conn, buffer, args.rank)
    buffer.destroy()
    sys.stderr.flush()
    # Skip interpreter teardown: destructors of a process group whose peers are gone can block.
    os._exit(code)
