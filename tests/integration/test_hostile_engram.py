"""Hostile use of the engram nodes through the real server: files outside input/, runaway pairs files,
CPU ranks the machine cannot hold, odd names, frozen workers and mismatched text encoders.

Each case must end in an error that names the input (or a right answer) quickly, and the server must
keep serving.
"""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest
from comfyhost import WorkflowError
from helpers.graphs import TINY_CLIP_L

from helpers.ws_watch import PromptWatch, executing
from integration.test_engram_faults import (  # noqa: F401 - pairs_file is a fixture the kill below needs
    assert_worker_error, clip_node, engram_workers, interrupt, interrupted_node, kill_before_lookup, load_memory,
    memory_graph, new_memory, node_text, pairs_file, similarity, wait_until,
)

pytestmark = pytest.mark.integration

_serial = iter(range(10**6))


def train_graph(pairs_file: str, steps: int = 3, rows_per_head: int = 1051) -> dict:
    return {"2": clip_node(), "30": new_memory(rows_per_head, ranks=1),
            "31": {"class_type": "FP8Engram.EngramTrain", "inputs": {
                "memory": ["30", 0], "clip": ["2", 0], "pairs_file": pairs_file, "steps": steps,
                "learning_rate": 0.05, "batch_size": 4, "seed": next(_serial)}},
            "45": {"class_type": "PreviewImage", "inputs": {"images": ["31", 1]}}}


def error_message(exc: WorkflowError) -> str:
    for kind, data in exc.details.get("status", {}).get("messages", []):
        if kind == "execution_error":
            return f"{data['exception_type']}: {data['exception_message']}"
    return str(exc)


def run_error(comfy, graph: dict, timeout: float = 120.0) -> str:
    with pytest.raises(WorkflowError) as info:
        comfy.run(graph, timeout=timeout)
    return error_message(info.value)


def watched_error(comfy, graph: dict, timeout: float = 120.0) -> tuple[str, PromptWatch]:
    """run_error with the prompt's messages kept, to time a node from them."""
    watch = PromptWatch(comfy, timeout)
    _, exc = watch.run(graph)
    assert exc is not None, "the prompt must fail"
    return error_message(exc), watch


# ----- Engram Train: pairs_file -----

@pytest.mark.parametrize("name", ["/etc/passwd", "../../../../../etc/passwd", "/proc/self/environ", "linked_passwd.jsonl",
                                  "linked_dir/passwd", "[output]/../../../etc/passwd", "x [output]"])
def test_train_opens_nothing_outside_the_input_folder(comfy, comfy_server, name):
    input_dir = comfy_server.base_dir / "input"
    input_dir.mkdir(exist_ok=True)
    for link, target in (("linked_passwd.jsonl", "/etc/passwd"), ("linked_dir", "/etc")):
        if not os.path.lexists(input_dir / link):
            os.symlink(target, input_dir / link)
    message = run_error(comfy, train_graph(name))
    assert "input folder" in message, message
    assert "line" not in message and "root" not in message, message  # nothing of the file was read back


def test_train_target_conditioning_outside_the_input_folder_is_refused(comfy, comfy_server):
    (comfy_server.base_dir / "input" / "cond_escape.jsonl").write_text(
        json.dumps({"prompt": "a red apple", "target_conditioning": "../../../../etc/passwd"}) + "\n")
    message = run_error(comfy, train_graph("cond_escape.jsonl"))
    assert "line 1" in message and "input folder" in message, message


def test_train_pairs_file_in_a_subfolder_of_input_works(comfy, comfy_server):
    folder = comfy_server.base_dir / "input" / "pairs_sub"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ok.jsonl").write_text(json.dumps({"prompt": "a glowing crystal apple", "target": "a rusty old bicycle"}) + "\n")
    history = comfy.run(train_graph("pairs_sub/ok.jsonl", steps=2))
    assert len(history["outputs"]["31"]["losses"]) == 2


# ----- Engram Train: runaway and broken pairs files -----

def server_rss(comfy_server) -> int:
    return psutil.Process(comfy_server.process.pid).memory_info().rss


def test_train_on_one_huge_line_refuses_it_quickly_in_bounded_memory(comfy, comfy_server):
    path = comfy_server.base_dir / "input" / "huge_line.jsonl"
    with open(path, "w") as f:  # one valid pair whose prompt is 50 MB
        f.write('{"prompt": "')
        chunk = "a red apple " * 10000
        for _ in range(50_000_000 // len(chunk)):
            f.write(chunk)
        f.write('", "target": "a rusty old bicycle"}\n')
        f.write(json.dumps({"prompt": "a cat", "target": "a dog"}) + "\n")
    before = server_rss(comfy_server)
    message, watch = watched_error(comfy, train_graph("huge_line.jsonl"), timeout=90)
    took = watch.took("31")  # Engram Train's own run, from its start to its error
    grew = server_rss(comfy_server) - before
    print(f"huge line refused in {took:.2f} s, server RSS grew {grew / 2**20:.1f} MiB")
    assert "huge_line.jsonl" in message and "line 1" in message and "KiB" in message, message
    assert took < 30  # the overlong line is skipped in bounded pieces, never parsed
    assert grew < 100 * 2**20  # the line was never held whole


def test_train_invalid_utf8_names_the_file_and_line(comfy, comfy_server):
    (comfy_server.base_dir / "input" / "latin1.jsonl").write_bytes(
        b'{"prompt": "a cat", "target": "a dog"}\n{"prompt": "caf\xe9", "target": "a dog"}\n')
    message = run_error(comfy, train_graph("latin1.jsonl"))
    assert "UnicodeDecodeError" not in message, message
    assert "latin1.jsonl" in message and "line 2" in message and "UTF-8" in message, message


def server_cpu_s(comfy_server) -> float:
    times = psutil.Process(comfy_server.process.pid).cpu_times()
    return times.user + times.system


# CPU time the server spends in Engram Train before the interrupt is sent: reading the 1500 lines takes
# a few milliseconds of it, encoding the 1500 pairs many seconds. Work done, not time waited: a loaded
# machine stretches both alike.
ENCODING_CPU_S = 1.0


def test_train_interrupt_while_encoding_many_pairs_lands_at_once(comfy, comfy_server):
    """An interrupt while Engram Train encodes its pairs (before any step) stops it within seconds."""
    words = "a quiet harbor at dawn with fishing boats and gulls over calm grey water " * 3
    lines = [json.dumps({"prompt": f"{i} {words}", "target": f"{words} {i}"}) for i in range(1500)]
    (comfy_server.base_dir / "input" / "many_pairs.jsonl").write_text("\n".join(lines) + "\n")
    graph = train_graph("many_pairs.jsonl", steps=5)
    sent = {}

    def send(message):
        cpu = server_cpu_s(comfy_server)
        wait_until(lambda: server_cpu_s(comfy_server) - cpu >= ENCODING_CPU_S, timeout=300,
                   what=f"the server spending {ENCODING_CPU_S} s of CPU in Engram Train")
        sent["at"] = time.monotonic()
        interrupt(comfy)

    watch = PromptWatch(comfy)
    fired = watch.on(executing("31"), send)
    _, exc = watch.run(graph)
    assert fired.ran and interrupted_node(exc) == "31", exc
    assert not watch.progress("31"), "the interrupt must land while the pairs are encoded, before any step"
    stopped = watch.first(lambda m: m.kind == "execution_interrupted")
    print(f"interrupt landed {stopped.at - sent['at']:.2f} s after it was sent")
    assert stopped.at - sent["at"] < 15  # from the interrupt to the node's end: a pair's encoding, not the rest


# ----- New Engram Memory: CPU ranks and memory -----

def uss(pid: int) -> int:
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return fields["Private_Clean"] + fields["Private_Dirty"]


def test_cpu_rank_workers_cost_little_private_memory(comfy, comfy_server):
    graph = memory_graph(new_memory(1021, ranks=3), memorize=False)
    history = comfy.run(graph)
    pids = history["outputs"]["30"]["worker_pids"]
    assert len(pids) == 2
    private = [uss(pid) for pid in pids]
    print(f"private memory per CPU worker: {[round(p / 2**20, 1) for p in private]} MiB")
    assert all(p < 48 * 2**20 for p in private), private  # a whole Python + torch process is ~280 MB
    assert similarity(history)["identical"] is True  # and the memory works
    tooltip = comfy.object_info()["FP8Engram.NewEngramMemory"]["input"]["required"]["cpu_ranks"][1]["tooltip"]
    assert "MB" in tooltip and "refused" in tooltip, tooltip


def test_rank_count_the_memory_cannot_hold_is_refused_with_figures_before_any_worker_starts(comfy, comfy_server):
    before = engram_workers(comfy_server)
    graph = memory_graph(new_memory(1 << 26, ranks=64), memorize=False)  # 1.6 G rows of 768 columns: terabytes
    graph["30"]["inputs"].update({"heads": 6, "max_order": 5, "placement": "device"})
    message, watch = watched_error(comfy, graph, timeout=60)
    assert watch.took("30") < 30  # the node's own run: it refuses from figures, it allocates nothing
    assert "NotEnoughMemoryError" in message and "64 CPU rank(s) need about" in message and "available" in message, message
    assert engram_workers(comfy_server) <= before  # nothing was started
    # placement auto sends a table this big to the host tier, whose shared-memory segment is RAM too
    graph["30"]["inputs"]["placement"] = "auto"
    message = run_error(comfy, graph, timeout=60)
    assert "NotEnoughMemoryError" in message and "host-memory table" in message and "available" in message, message
    assert engram_workers(comfy_server) <= before


# ----- Save Engram Memory -----

def test_save_name_with_a_nul_byte_is_a_named_error(comfy):
    graph = memory_graph(new_memory(1061, ranks=1), memorize=False)
    graph["50"] = {"class_type": "FP8Engram.SaveEngramMemory", "inputs": {"memory": ["30", 0], "name": "bad\x00name"}}
    message = run_error(comfy, graph)
    assert "Save Engram Memory" in message and "NUL" in message, message


# ----- a memory of one CLIP type used with another -----

def test_memory_of_one_clip_type_on_another_types_conditioning_is_refused(comfy):
    graph = memory_graph(new_memory(1063, ranks=1))
    graph["2"] = {"class_type": "CLIPLoader", "inputs": {"clip_name": TINY_CLIP_L, "type": "stable_diffusion"}}  # SD1
    graph["60"] = {"class_type": "CLIPLoader", "inputs": {"clip_name": TINY_CLIP_L, "type": "sd3"}}
    graph["61"] = {"class_type": "CLIPTextEncode", "inputs": {"clip": ["60", 0], "text": "glowing crystal apple on a table"}}
    graph["62"] = {"class_type": "FP8Engram.EngramApply", "inputs": {
        "conditioning": ["61", 0], "text": "glowing crystal apple on a table", "memory": ["31", 0], "strength": 1.0}}
    graph["64"] = {"class_type": "FP8Engram.ConditioningSimilarity", "inputs": {"a": ["62", 0], "b": ["61", 0], "first_row": 0, "rows": 0}}
    message = run_error(comfy, graph)
    assert "SD1" in message and ("4096" in message or "SD3" in message), message
    graph["62"]["inputs"]["clip"] = ["60", 0]  # the other CLIP connected too
    message = run_error(comfy, graph)
    assert "SD1" in message and "SD3" in message, message
    del graph["62"]
    graph["63"] = {"class_type": "FP8Engram.EngramTextEncode", "inputs": {
        "clip": ["60", 0], "text": "glowing crystal apple", "memory": ["31", 0], "strength": 1.0}}
    graph["64"]["inputs"]["a"] = ["63", 0]
    message = run_error(comfy, graph)
    assert "SD1" in message and "SD3" in message, message


# ----- a frozen worker -----

def log_size(comfy_server) -> int:
    return comfy_server.log_path.stat().st_size


def log_since(comfy_server, offset: int) -> str:
    with open(comfy_server.log_path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def test_frozen_worker_on_reload_is_named_frozen_and_replaced_in_seconds(comfy, comfy_server, models_dir):
    graph = memory_graph(new_memory(1069, ranks=1))
    graph["50"] = {"class_type": "FP8Engram.SaveEngramMemory", "inputs": {"memory": ["31", 0], "name": "frozen_source"}}
    comfy.run(graph)
    graph = memory_graph(load_memory("frozen_source.safetensors", ranks=2))  # Memorize writes: the next run reloads
    first = comfy.run(graph)
    pid = first["outputs"]["30"]["worker_pids"][0]
    offset = log_size(comfy_server)
    os.kill(pid, signal.SIGSTOP)
    try:
        graph["3"]["inputs"]["strength"] = 0.97
        watch = PromptWatch(comfy, timeout=120)
        history, exc = watch.run(graph)
        if exc is not None:
            raise exc
        # from the prompt's start (where the memory node's fingerprint looks at its workers) to the end
        # of the memory node, which met the frozen worker and rebuilt the memory
        took = watch.until_end_of("30")
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    text = node_text(history, "30")
    log = log_since(comfy_server, offset)
    print(f"reload with a frozen worker took {took:.1f} s; node said: {text.splitlines()[0]}")
    assert took < 50  # waiting out the command timeout alone took 60 s
    assert "frozen" in text and "died" not in text, text
    assert "frozen" in log and "died" not in log and "Close this group" not in log, log
    wait_until(lambda: pid not in engram_workers(comfy_server), what="the frozen worker ending")
    assert similarity(history)["identical"] is False  # the rebuilt memory works


def test_no_log_line_tells_the_user_to_close_a_group(comfy, comfy_server, pairs_file):
    graph = memory_graph(new_memory(1087, ranks=2), memorize=False)
    pid = comfy.run(graph)["outputs"]["30"]["worker_pids"][0]
    offset = log_size(comfy_server)
    exc = kill_before_lookup(comfy, graph, pid)  # Engram Text Encode runs again and meets the dead worker
    assert assert_worker_error(exc, "New Engram Memory (node 30)")["node_id"] == "3"
    graph["3"]["inputs"]["text"] += " again"  # the next prompt rebuilds the memory (and logs that)
    graph["40"]["inputs"]["text"] += " again"
    comfy.run(graph)
    log = log_since(comfy_server, offset)
    assert "worker rank 1" in log, log
    assert "Close this group" not in log, log
