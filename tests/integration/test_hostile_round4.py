"""Hostile round 4, through the real server: inputs that passed every check and still gave NaN
conditioning, or failed with messages that named nothing.

- a BF16 memory file whose table rows are overwritten with 0x7F7F (bf16's largest finite value): each row
  is finite, their sum (the combined engram value) is not; Engram Text Encode gave `cosine: nan` and an
  all-NaN conditioning. Now an error naming the file and the layer;
- an Engram Train pairs line of deeply nested JSON (a bare RecursionError) or with a 5000-digit integer (a
  bare ValueError): now the file and the line;
- a NaN target conditioning ("layer 0: values hold inf or NaN"): now the node and its input;
- an NVFP4 file whose tensor scale is 1 % under the overflow edge, on the int8 compute path (its rotated
  weight overflows at the conversion): a QuantizationError naming neither file nor layer, now both;
- Quantize Model's keep_patterns of 20,000 '[' (6.7 s of fnmatch, not interruptible): now refused at
  once, naming the input.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import requests
import torch
from comfyhost import WorkflowError
from safetensors.torch import load_file, save_file

from fp8_engram.quant import NVFP4, QuantizedTensor
from fp8_engram.quant.layouts import comfy_int8, nvfp4
from helpers import fp8_files
from helpers.graphs import TINY_UNET, fp8_loader, sd3_txt2img
from integration.test_engram_faults import PHRASE, PROMPT, TARGET_PHRASE, clip_node, memory_graph, new_memory

pytestmark = pytest.mark.integration


def error_of(comfy, graph: dict, timeout: float = 180.0) -> str:
    with pytest.raises(WorkflowError) as info:
        comfy.run(graph, timeout=timeout)
    return str(info.value)


def run_raw_error(comfy, graph: dict, timeout: float = 180.0) -> str:
    """Queue `graph` with NaN kept as the JSON token NaN (ComfyUI's FLOAT validation lets it through);
    the prompt must fail at a node: returns its exception type and message."""
    body = json.dumps({"prompt": graph, "client_id": comfy.client_id}, allow_nan=True)
    response = requests.post(comfy.url + "/prompt", data=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert response.status_code == 200, response.text[:500]
    try:
        history = comfy.wait(response.json()["prompt_id"], timeout)
    except WorkflowError as exc:
        history = exc.details
    for kind, data in history.get("status", {}).get("messages", []):
        if kind == "execution_error":
            return f"{data['node_type']}: {data['exception_type']}: {data['exception_message']}"
    pytest.fail(f"the prompt did not fail at a node: {json.dumps(history)[:1500]}")


# ----- a BF16 memory whose rows are bf16's largest finite value -----


def largest_finite_rows_copy(path: Path, out: Path) -> None:
    """`path` with every byte of every table row 0x7F: BF16 0x7F7F = 3.39e38, finite, so each row
    passes a per-row check; a sum of two of them is inf."""
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    rows = [v for k, v in header.items() if k.endswith(".rows")]
    assert rows and all(v["dtype"] == "BF16" for v in rows), header.keys()
    for value in rows:
        start, end = (8 + n + o for o in value["data_offsets"])
        raw[start:end] = b"\x7f" * (end - start)
    out.write_bytes(bytes(raw))


@pytest.mark.parametrize("placement", ["host", "device"])
def test_rows_whose_sum_overflows_are_an_error_naming_the_file_and_layer(comfy, models_dir, placement):
    name = f"round4_max_rows_{placement}"
    saved = memory_graph(new_memory(1051, ranks=1))
    saved["50"] = {"class_type": "FP8Engram.SaveEngramMemory", "inputs": {"memory": ["31", 0], "name": name}}
    comfy.run(saved)
    path = models_dir / "engram" / f"{name}.safetensors"
    damaged = models_dir / "engram" / f"{name}_max.safetensors"
    largest_finite_rows_copy(path, damaged)
    graph = memory_graph({"class_type": "FP8Engram.LoadEngramMemory", "inputs": {
        "memory_name": damaged.name, "devices": "cpu", "cpu_ranks": 1, "placement": placement}}, memorize=False)
    try:
        message = error_of(comfy, graph)
    finally:
        damaged.unlink()
        path.unlink()
    assert damaged.name in message, message
    assert "layer 0" in message and "not finite" in message, message
    assert "EngramTextEncode" in message, message
