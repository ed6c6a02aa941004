"""A raw JSON NaN in a float input of the engram nodes, through the real server.

ComfyUI's validation compares a FLOAT input with the widget's min and max; every comparison with NaN is
false, so `"strength": NaN` passes validation (HTTP 200) and reaches the node. Before the nodes checked,
Engram Text Encode and Engram Apply returned NaN conditioning with no error. Each case must be an
execution error of the node itself that names the input, and the server must serve the next prompt.
"""

from __future__ import annotations

import json

import pytest
import requests

from integration.test_engram_faults import PROMPT, clip_node, memory_graph, new_memory, similarity

pytestmark = pytest.mark.integration


def _run_raw(comfy, graph: dict, timeout: float = 120.0) -> dict:
    """Queue `graph` serialized with NaN kept as the JSON token `NaN` (which `requests`' json= refuses to
    write), wait for it, and return its history entry."""
    body = json.dumps({"prompt": graph, "client_id": comfy.client_id}, allow_nan=True)
    assert "NaN" in body
    response = requests.post(comfy.url + "/prompt", data=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert response.status_code == 200, f"ComfyUI refused the prompt at validation: {response.text[:500]}"
    prompt_id = response.json()["prompt_id"]
    try:
        return comfy.wait(prompt_id, timeout)
    except Exception as exc:  # WorkflowError carries the history entry
        return getattr(exc, "details", {}) or {"error": str(exc)}


def _execution_error(entry: dict) -> dict:
    for kind, data in entry.get("status", {}).get("messages", []):
        if kind == "execution_error":
            return data
    pytest.fail(f"the prompt did not fail at a node: {json.dumps(entry)[:1500]}")


def _apply_graph(strength) -> dict:
    graph = memory_graph(new_memory(1051, ranks=1), memorize=False)
    graph["3"] = {"class_type": "FP8Engram.EngramApply", "inputs": {
        "conditioning": ["40", 0], "text": PROMPT, "memory": ["30", 0], "strength": strength, "clip": ["2", 0]}}
    return graph


def _train_graph(comfy_server, learning_rate) -> dict:
    input_dir = comfy_server.base_dir / "input"
    input_dir.mkdir(exist_ok=True)
    (input_dir / "nan_lr_pairs.jsonl").write_text(json.dumps({"prompt": "a red apple", "target": "a blue pear"}) + "\n")
    return {"2": clip_node(), "30": new_memory(1051, ranks=1),
            "31": {"class_type": "FP8Engram.EngramTrain", "inputs": {
                "memory": ["30", 0], "clip": ["2", 0], "pairs_file": "nan_lr_pairs.jsonl", "steps": 2,
                "learning_rate": learning_rate, "batch_size": 1, "seed": 0}},
            "45": {"class_type": "PreviewImage", "inputs": {"images": ["31", 1]}}}


@pytest.mark.parametrize("case", ["text_encode", "apply", "train"])
def test_a_nan_float_input_is_refused_by_name_and_the_server_serves_on(comfy, comfy_server, case):
    if case == "text_encode":
        graph, node, name, ok = memory_graph(new_memory(1051, ranks=1), memorize=False, strength=float("nan")), "3", "strength", 1.0
    elif case == "apply":
        graph, node, name, ok = _apply_graph(float("nan")), "3", "strength", 1.0
    else:
        graph, node, name, ok = _train_graph(comfy_server, float("nan")), "31", "learning_rate", 0.05
    error = _execution_error(_run_raw(comfy, graph))
    assert error["node_id"] == node, error
    message = error["exception_message"]
    assert f"input '{name}'" in message and "nan" in message and "finite" in message, message

    # The same graph with a finite value runs (and for the encoders gives finite conditioning).
    if case == "train":
        graph["31"]["inputs"]["learning_rate"] = ok
        history = comfy.run(graph)
        assert len(history["outputs"]["31"]["losses"]) == 2
    else:
        graph["3"]["inputs"]["strength"] = ok
        sim = similarity(comfy.run(graph))
        assert sim["identical"] is True, sim  # an empty memory leaves every value's bits
