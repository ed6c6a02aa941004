"""The host tier through the real server: New/Load Engram Memory with `placement` = host give the same
conditioning as the same memory on the device (CPU ranks), the nodes' summaries say where the rows are,
a saved host memory loads back mapped (no worker processes), and Engram Apply agrees with Engram Text
Encode on a host memory."""

from __future__ import annotations

import json
import os

import pytest
from helpers.engram_tables import nan_rows_copy

pytestmark = pytest.mark.integration

PHRASE = "glowing crystal apple"
TARGET_PHRASE = "rusty old bicycle"
PROMPT = f"{PHRASE} on a wooden table"


def clip() -> dict:
    return {"class_type": "CLIPLoader", "inputs": {"clip_name": "tiny_clip_l.safetensors", "type": "sd3"}}


def new_memory(placement: str, ranks: int = 1) -> dict:
    return {"class_type": "FP8Engram.NewEngramMemory", "inputs": {
        "clip": ["2", 0], "max_order": 3, "heads": 8, "rows_per_head": 4099, "dtype": "fp8_e4m3fn",
        "devices": "cpu", "cpu_ranks": ranks, "context_gate": False, "seed": 0, "placement": placement}}


def memorize(memory: list) -> dict:
    return {"class_type": "FP8Engram.EngramMemorize", "inputs": {"memory": memory, "clip": ["2", 0], "text": PHRASE, "target_text": TARGET_PHRASE}}


def encode(memory: list, text: str = PROMPT) -> dict:
    return {"class_type": "FP8Engram.EngramTextEncode", "inputs": {"clip": ["2", 0], "text": text, "memory": memory, "strength": 1.0}}


def similarity(a: list, b: list) -> dict:
    return {"class_type": "FP8Engram.ConditioningSimilarity", "inputs": {"a": a, "b": b, "first_row": 0, "rows": 0}}


def identical(history: dict, node: str) -> bool:
    return json.loads(history["outputs"][node]["text"][0])["identical"]


def test_placement_is_offered_with_a_tooltip(comfy):
    info = comfy.object_info()
    for name in ("NewEngramMemory", "LoadEngramMemory"):
        kind, options = info[f"FP8Engram.{name}"]["input"]["optional"]["placement"]
        assert kind == ["device", "host", "auto"] or options.get("options") == ["device", "host", "auto"]
        assert options["default"] == "auto" and "host" in options["tooltip"]


def test_host_memory_encodes_like_a_device_memory_and_loads_back_mapped(comfy):
    graph = {
        "2": clip(),
        "30": new_memory("host"),
        "31": memorize(["30", 0]),
        "3": encode(["31", 0]),
        "60": new_memory("device", ranks=2),
        "61": memorize(["60", 0]),
        "62": encode(["61", 0]),
        "63": similarity(["3", 0], ["62", 0]),
        "64": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": PROMPT}},
        "65": similarity(["3", 0], ["64", 0]),
        "50": {"class_type": "FP8Engram.SaveEngramMemory", "inputs": {"memory": ["31", 0], "name": "host_round_trip"}},
    }
    history = comfy.run(graph)
    assert identical(history, "63") is True, "the host memory and the device memory disagree"
    assert identical(history, "65") is False, "the memorized phrase did not change the conditioning"
    summary = history["outputs"]["30"]["text"][0]
    assert "placement: host" in summary and "shared-memory segment" in summary
    assert history["outputs"]["30"]["worker_pids"] == []
    assert "placement: device" in history["outputs"]["60"]["text"][0]
    hits = [t["text"] for e in history["outputs"]["3"]["engram_hits"] for t in e["tokens"] if t["hit"]]
    assert hits == ["crystal", "apple"]

    graph2 = {
        "2": clip(),
        "60": new_memory("device", ranks=2),
        "61": memorize(["60", 0]),
        "62": encode(["61", 0]),
        "51": {"class_type": "FP8Engram.LoadEngramMemory", "inputs": {
            "memory_name": "host_round_trip.safetensors", "devices": "cpu", "cpu_ranks": 1, "placement": "host"}},
        "52": encode(["51", 0]),
        "53": similarity(["52", 0], ["62", 0]),
        "54": {"class_type": "FP8Engram.EngramApply", "inputs": {
            "conditioning": ["64", 0], "text": PROMPT, "memory": ["51", 0], "strength": 1.0, "clip": ["2", 0]}},
        "64": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": PROMPT}},
        "55": similarity(["54", 0], ["52", 0]),
    }
    history = comfy.run(graph2)
    assert identical(history, "53") is True, "the loaded host memory differs from the memory it was saved from"
    assert identical(history, "55") is True, "Engram Apply and Engram Text Encode disagree on a host memory"
    summary = history["outputs"]["51"]["text"][0]
    assert "placement: host" in summary and "host_round_trip.safetensors" in summary and "mapped" in summary
    assert history["outputs"]["51"]["worker_pids"] == []


# ----- a memory file overwritten in place with NaN rows (issue 27, finding 8) -----


def _error_text(comfy, graph: dict) -> str:
    from comfyhost import WorkflowError

    with pytest.raises(WorkflowError) as info:
        comfy.run(graph)
    return str(info.value)


@pytest.mark.parametrize("placement", ["host", "device"])
def test_memory_file_overwritten_with_nan_rows_is_an_error_naming_the_file(comfy, models_dir, tmp_path, placement):
    """`cp -p nan.safetensors memory.safetensors` (same size, timestamp put back) under a loaded memory:
    the next prompt is an error naming the file, not NaN conditioning; with a new timestamp the reload
    is refused alike. Host placement maps the file (it reads the new bytes); device placement read it
    at load (it keeps serving what it read until the file's timestamp says it changed)."""
    import os
    import shutil

    name = f"nan_target_{placement}"
    comfy.run({"2": clip(), "30": new_memory("host"), "31": memorize(["30", 0]),
               "50": {"class_type": "FP8Engram.SaveEngramMemory", "inputs": {"memory": ["31", 0], "name": name}}})
    path = models_dir / "engram" / f"{name}.safetensors"

    def load_and_encode(text: str) -> dict:
        return {"2": clip(), "64": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": text}},
                "51": {"class_type": "FP8Engram.LoadEngramMemory", "inputs": {
                    "memory_name": path.name, "devices": "cpu", "cpu_ranks": 1, "placement": placement}},
                "52": encode(["51", 0], text), "55": similarity(["52", 0], ["64", 0])}

    history = comfy.run(load_and_encode(PROMPT))
    assert identical(history, "55") is False  # the memory answers before the file is touched

    nan_rows_copy(path, tmp_path / "nan.safetensors")
    st = os.stat(path)
    shutil.copyfile(tmp_path / "nan.safetensors", path)  # cp -p: the same file truncated and rewritten ...
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # ... and its times put back
    later = f"{PHRASE} under a lamp"  # a new prompt text, so the encode runs again on the live memory
    if placement == "host":
        message = _error_text(comfy, load_and_encode(later))
        assert str(path) in message and "NaN" in message, message
    else:  # what was read at load is served, and it is finite
        history = comfy.run(load_and_encode(later))
        assert identical(history, "55") is False

    os.utime(path)  # a new timestamp: Load Engram Memory loads the file again
    message = _error_text(comfy, load_and_encode(f"{PHRASE} in the rain"))
    assert str(path) in message and "NaN" in message, message
    path.unlink()


def test_a_group_whose_ranks_cannot_read_each_other_falls_back_to_the_host_tier(tmp_path):
    """In process (the fault is made in this process, which a server would not let a test reach): the
    nodes' store factory, asked for 2 CPU ranks whose start check fails (rank 0's view of rank 1's shard
    is a stale copy), serves the memory from the host tier instead, says why in the summary line, and the
    memory works; Load's fallback maps the table file. An error that is not about sharing still fails."""
    import torch
    from helpers.host import comfy_in_process

    comfy_in_process()
    from fp8_engram.engram import buffer as buffer_module
    from fp8_engram.engram.allocators import shared_memory_allocator
    from fp8_engram.engram.host_tier import HostRowStore
    from fp8_engram.engram.placement import make_store as _make_store, placement_text

    def stale(group, num_bytes, device):
        memory = shared_memory_allocator(group, num_bytes, device)
        memory.unified = None
        memory.peers[1] = memory.peers[1].clone()
        return memory

    rows = lambda ranks: [-(-n // ranks) * ranks for n in (300, 120)]  # noqa: E731 - as MemoryConfig pads them
    buffer_module.set_shard_allocator(stale)
    try:
        store = _make_store(rows, 64, torch.bfloat16, "cpu", 2)
    finally:
        buffer_module.set_shard_allocator(None)
    try:
        assert isinstance(store, HostRowStore), store
        assert store.rows_per_layer == rows(1)
        text = placement_text(store)
        assert text.startswith("placement: host"), text
        assert "instead of 2 CPU rank(s): the engram shards are not shared correctly" in text, text
        assert "rank 0 read" in text and "rank 1's shard wrong" in text, text
        values = torch.randn(3, 64)
        store.write_rows(1, torch.tensor([0, 5, 119]), values)
        assert torch.equal(store.read_rows(1, torch.tensor([0, 5, 119])), values.bfloat16().float())
        path = str(tmp_path / "memory.safetensors")
        store.save_table_file(path)
    finally:
        store.close()

    buffer_module.set_shard_allocator(stale)
    try:
        loaded = _make_store(rows, 64, torch.bfloat16, "cpu", 2, host=lambda: HostRowStore.from_table_file(path))
    finally:
        buffer_module.set_shard_allocator(None)
    try:
        assert isinstance(loaded, HostRowStore) and loaded.source == path, loaded
        assert torch.equal(loaded.read_rows(1, torch.tensor([0, 5, 119])), values.bfloat16().float())
    finally:
        loaded.close()

    def broken(group, num_bytes, device):
        raise OSError("not a sharing problem")

    buffer_module.set_shard_allocator(broken)
    try:
        with pytest.raises(Exception, match="not a sharing problem"):
            _make_store(rows, 64, torch.bfloat16, "cpu", 2)
    finally:
        buffer_module.set_shard_allocator(None)


def test_a_crashed_cuda_worker_fails_the_node_naming_the_memory_and_the_rank(monkeypatch):
    """In process, without a GPU, through the nodes' own store factory with CUDA reported present: the
    group of 2 CUDA ranks it starts loses its worker (a real CPU group whose worker is killed with
    SIGKILL, so the group's supervision raises the EngramWorkerError a CUDA group raises). A crash is no
    sharing failure: the memory is not put on the host tier, the error names the memory and rank 1.
    The policy fed the real exception types: a worker that failed because its shard could not be shared
    (ShardSharingError in its chain) and a CUDA driver call (CudaIpcError) still fall back."""
    import signal
    import time

    import torch
    from helpers.host import comfy_in_process

    comfy_in_process()
    from fp8_engram.engram import group as group_module
    from fp8_engram.engram.allocators import ShardSharingError
    from fp8_engram.engram.cuda_ipc import CudaIpcError
    from fp8_engram.engram.group import EngramWorkerError
    from fp8_engram.engram.placement import make_store as _make_store, sharing_failed

    real_group = group_module.EngramGroup
    started = []

    def group_whose_worker_crashes(rows, hidden, dtype, *, num_ranks, device):
        assert device == "cuda", device
        group = real_group(rows, hidden, dtype, num_ranks=num_ranks, device="cpu", timeout=60)
        try:
            pid = group.worker_pids[0]
            started.append(pid)
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while group.alive and time.monotonic() < deadline:
                time.sleep(0.05)
            group.check()  # raises the supervision's EngramWorkerError (rank 1, killed by signal 9)
        finally:
            group.close()
        return group

    host_used = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(group_module, "EngramGroup", group_whose_worker_crashes)
    rows = lambda ranks: [-(-n // ranks) * ranks for n in (300, 120)]  # noqa: E731 - as MemoryConfig pads them
    name = "the memory of New Engram Memory (node 7)"
    with pytest.raises(EngramWorkerError) as info:
        _make_store(rows, 64, torch.bfloat16, "auto", 1, 2, host=lambda: host_used.append(1), name=name)
    assert started, "the store factory did not start a CUDA group"
    assert not host_used, "a crashed worker was taken for a sharing failure and the memory put on the host tier"
    message = str(info.value)
    assert message.startswith(f"{name} could not start its 2 CUDA rank(s)"), message
    assert "engram worker rank 1" in message and "killed by signal 9" in message, message
    assert info.value.rank == 1 and info.value.exitcode == -signal.SIGKILL

    crashed = EngramWorkerError("engram worker rank 1 (pid 5) died (killed by signal 11); cannot fetch rows", 1, -11)
    frozen = EngramWorkerError("engram worker rank 2 did not answer within 60 s (start)", 2, state="unresponsive")
    failed = EngramWorkerError("engram worker rank 1 failed to start: RuntimeError: CUDA error: out of memory", 1)
    for error in (crashed, frozen, failed):
        assert not sharing_failed(error, cuda=True), error
    try:
        try:
            raise ShardSharingError("engram worker 1 failed to start: rank 1 could not open the CUDA shard of rank 0")
        except ShardSharingError as why:
            raise EngramWorkerError("engram worker rank 1 (pid 5) died (exit code 2); cannot start the engram group", 1, 2) from why
    except EngramWorkerError as died_of_sharing:
        assert sharing_failed(died_of_sharing, cuda=True)
    assert sharing_failed(CudaIpcError("cuIpcOpenMemHandle failed: invalid handle"), cuda=True)
    assert not sharing_failed(CudaIpcError("cuIpcOpenMemHandle failed"), cuda=False)
