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


# ----- Engram Train: pairs lines that broke the JSON reader -----


def train_graph(pairs_file: str) -> dict:
    return {"2": clip_node(), "30": new_memory(1051, ranks=1),
            "31": {"class_type": "FP8Engram.EngramTrain", "inputs": {
                "memory": ["30", 0], "clip": ["2", 0], "pairs_file": pairs_file, "steps": 2,
                "learning_rate": 0.05, "batch_size": 1, "seed": 0}},
            "45": {"class_type": "PreviewImage", "inputs": {"images": ["31", 1]}}}


@pytest.mark.parametrize("case", ["nested", "huge_integer"])
def test_a_pairs_line_json_cannot_read_names_the_file_and_line(comfy, comfy_server, case):
    good = json.dumps({"prompt": "a red apple", "target": "a blue pear"})
    if case == "nested":
        bad = '{"prompt": "a red apple", "target": "a blue pear", "x": ' + "[" * 30000 + "]" * 30000 + "}"
        assert len(bad) < 64 * 1024  # under the line limit: the JSON reader itself meets it
    else:
        bad = '{"prompt": "a red apple", "target": "a blue pear", "n": ' + "7" * 5000 + "}"
    name = f"round4_{case}.jsonl"
    (comfy_server.base_dir / "input" / name).write_text(good + "\n" + bad + "\n")
    message = error_of(comfy, train_graph(name))
    assert f"{name}: 1 broken line(s): line 2:" in message, message
    assert "RecursionError" not in message and "Traceback" not in message.split("line 2:")[0], message


# ----- NaN target conditioning -----


def test_a_nan_target_of_memorize_names_the_node_and_input(comfy):
    """ConditioningAverage with a raw NaN strength makes an all-NaN conditioning for Memorize's `target`."""
    graph = memory_graph(new_memory(1051, ranks=1))
    graph["60"] = {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": TARGET_PHRASE}}
    graph["61"] = {"class_type": "ConditioningAverage", "inputs": {
        "conditioning_to": ["60", 0], "conditioning_from": ["40", 0], "conditioning_to_strength": float("nan")}}
    graph["31"]["inputs"]["target"] = ["61", 0]
    message = run_raw_error(comfy, graph)
    assert message.startswith("FP8Engram.EngramMemorize"), message
    assert "input 'target'" in message and "NaN" in message, message


def test_a_nan_target_conditioning_file_of_train_names_the_file_line_and_key(comfy, comfy_server):
    input_dir = comfy_server.base_dir / "input"
    save_file({"cond": torch.full((1, 77, 4096), float("nan"))}, str(input_dir / "round4_nan_cond.safetensors"))
    (input_dir / "round4_nan_cond.jsonl").write_text(
        json.dumps({"prompt": "a red apple", "target_conditioning": "round4_nan_cond.safetensors"}) + "\n")
    message = error_of(comfy, train_graph("round4_nan_cond.jsonl"))
    assert "round4_nan_cond.jsonl line 1: target_conditioning" in message, message
    assert "round4_nan_cond.safetensors" in message and "NaN" in message, message


# ----- an NVFP4 tensor scale just under the overflow edge, on the int8 path -----


def test_nvfp4_scale_just_under_the_edge_on_the_int8_path_names_the_file_and_layer(comfy, models_dir):
    """Every layer's tensor scale at 99 % of the largest the load check lets through (its product with the
    largest block scale and 6 is 1 % under float32's range); the int8 path converts the weights at load."""
    sd = load_file(str(models_dir / "diffusion_models" / TINY_UNET))
    out, layers = {}, []
    for key, w in sd.items():
        if not fp8_files.default_quantize(key, w) or "embedder" in key:
            out[key] = w
            continue
        layer = key[: -len(".weight")]
        qt = QuantizedTensor.from_float(w.float(), NVFP4.for_shape(w.shape))
        parts = nvfp4.file_tensors(qt)
        block, _ = nvfp4.split_scales(qt.scale, qt.layout)
        edge = float(torch.finfo(torch.float32).max) / (float(block.float().max()) * 6)
        parts["weight_scale_2"] = torch.tensor(0.99 * edge, dtype=torch.float32)
        assert math.isfinite(float(parts["weight_scale_2"]))
        out.update({layer + "." + k: v for k, v in parts.items()})
        out[layer + ".comfy_quant"] = comfy_int8.comfy_quant_bytes({"format": "nvfp4"})
        layers.append(layer)
    name = "round4_nvfp4_edge.safetensors"
    save_file({k: v.contiguous() for k, v in out.items()}, str(models_dir / "diffusion_models" / name))
    try:
        message = error_of(comfy, sd3_txt2img(model=fp8_loader(name, compute_path="int8"), save="latent", steps=1,
                                              prefix="round4_nv_edge"))
    finally:
        (models_dir / "diffusion_models" / name).unlink()
    assert f"diffusion_models/{name}" in message, message
    assert any(f"{layer}'" in message for layer in layers), message  # the layer, as the model names it
    assert "QuantizationError" in message and "weight-only" in message, message


# ----- Quantize Model: keep_patterns -----


@pytest.mark.parametrize("patterns", ["[" * 20000, ", ".join(["*embed*"] * 300)])
def test_keep_patterns_beyond_the_bounds_are_refused_naming_the_input(comfy, patterns):
    graph = sd3_txt2img(save="latent", steps=1, prefix="round4_keep")
    graph["20"] = {"class_type": "FP8Engram.QuantizeModelToFP8",
                   "inputs": {"model": ["1", 0], "granularity": "tensor", "fp8_dtype": "e4m3fn", "keep_patterns": patterns}}
    graph["6"]["inputs"]["model"] = ["20", 0]
    message = error_of(comfy, graph)
    assert "QuantizeModelToFP8" in message and "input 'keep_patterns'" in message, message
