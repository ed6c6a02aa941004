"""How a CPU group decides whether the machine's available memory can hold it, and how it says no."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import torch

from fp8_engram.engram import group as group_module
from fp8_engram.engram.group import CPU_TEMPLATE_BYTES, CPU_WORKER_BYTES, EngramGroup, EngramWorkerError, NotEnoughMemoryError, check_cpu_memory

GIB = 1 << 30


def meminfo(available_gib: float, total_gib: float = 24.0) -> dict:
    return {"MemAvailable": int(available_gib * GIB), "MemTotal": int(total_gib * GIB)}


def test_rank_count_that_fits_is_accepted():
    check_cpu_memory(64, 1 * GIB, meminfo(8.0), template_up=False)  # 1 GiB + 63 workers + template < 8 - 2.4


def test_rank_count_that_does_not_fit_is_refused_with_the_figures_and_the_largest_count():
    tables = int(4.5 * GIB)
    room = 8 * GIB - int(0.1 * 24 * GIB)
    fits = (room - tables - CPU_TEMPLATE_BYTES) // CPU_WORKER_BYTES + 1
    assert 1 < fits < 64
    with pytest.raises(NotEnoughMemoryError) as info:
        check_cpu_memory(64, tables, meminfo(8.0), template_up=False)
    message = str(info.value)
    assert "64 CPU rank(s) need about" in message and "4.50 GiB of tables" in message and "63 worker process(es)" in message
    assert "8.00 GiB available" in message and "2.40 GiB" in message and f"use at most {fits} CPU rank(s)" in message
    check_cpu_memory(int(fits), tables, meminfo(8.0), template_up=False)


def test_tables_alone_too_big_ask_for_smaller_tables():
    with pytest.raises(NotEnoughMemoryError, match="make the tables smaller"):
        check_cpu_memory(1, 100 * GIB, meminfo(8.0))


def live_descendants() -> set[int]:
    """Pids of this process's descendants that still run (the worker template and workers forked from it)."""
    out = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                out.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_group_refuses_before_starting_a_worker(monkeypatch):
    started = []
    real_start, real_acquire = EngramGroup._start, group_module._acquire_template

    def start(self, *args, **kwargs):  # what starts the template and the workers
        started.append("workers")
        return real_start(self, *args, **kwargs)

    def acquire():
        started.append("template")
        return real_acquire()

    monkeypatch.setattr(EngramGroup, "_start", start)
    monkeypatch.setattr(group_module, "_acquire_template", acquire)
    before = live_descendants()
    with pytest.raises(NotEnoughMemoryError):
        EngramGroup([1 << 30], 4096, torch.bfloat16, num_ranks=4, device="cpu")  # 8 TiB
    assert started == [], f"the group started {started} before refusing"
    assert live_descendants() <= before, "a process was started (and is still running)"


def test_stopped_worker_is_reported_frozen_within_seconds(tmp_path):
    with EngramGroup([1021], 64, torch.bfloat16, num_ranks=2, device="cpu") as group:
        path = str(tmp_path / "t.safetensors")
        group.save_table_file(path)
        pid = group.worker_pids[0]
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(EngramWorkerError, match="stopped") as info:
                group.load_table_file(path)
            assert info.value.state == "stopped" and info.value.rank == 1
            assert time.monotonic() - started < 10  # not the 60 s command timeout
        finally:
            group.close()  # kills the frozen worker at once
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] == "Z"
