"""The real ComfyUI server boots with the pack, runs workflows, and answers bad input with node errors."""

from __future__ import annotations

import io

import numpy as np
import pytest
from comfyhost import WorkflowError
from helpers.graphs import output_images, sd3_txt2img
from PIL import Image


def test_pack_nodes_are_registered(comfy):
    info = comfy.object_info()
    ours = {name: spec for name, spec in info.items() if name.startswith("FP8Engram.")}
    assert "FP8Engram.WeightReport" in ours
    for name, spec in ours.items():
        assert spec["category"].startswith("fp8-engram"), name
        assert spec["python_module"].startswith("custom_nodes."), name


def test_txt2img_runs_end_to_end_with_a_pack_node(comfy):
    graph = sd3_txt2img(prefix="harness", seed=1)
    graph["20"] = {"class_type": "FP8Engram.WeightReport", "inputs": {"model": ["1", 0]}}
    history = comfy.run(graph)

    images = output_images(history, "9")
    assert len(images) == 1
    png = Image.open(io.BytesIO(comfy.view(**{k: images[0][k] for k in ("filename", "subfolder")}, folder_type="output")))
    assert png.size == (64, 64)
    pixels = np.asarray(png, dtype=np.float32)
    assert pixels.std() > 1.0, "a random model still draws a non-constant image"

    report = history["outputs"]["20"]["text"][0]
    # The tiny SD3 file is bf16: the loader keeps its weights in a float dtype and the report says so.
    assert "total" in report and "as bf16" in report
    assert any(dtype in report for dtype in ("bfloat16", "float32", "float16"))


def test_unknown_model_file_is_a_node_error(comfy):
    graph = sd3_txt2img()
    graph["1"]["inputs"]["unet_name"] = "does_not_exist.safetensors"
    response = comfy.submit(graph)
    assert response.status_code == 400
    body = response.json()
    assert "1" in body["node_errors"]
    messages = " ".join(e["message"] + " " + e.get("details", "") for e in body["node_errors"]["1"]["errors"])
    assert "does_not_exist.safetensors" in messages


def _clip_into_weight_report() -> dict:
    """A graph whose only output gets a CLIP where it needs a MODEL."""
    graph = sd3_txt2img()
    return {"2": graph["2"], "20": {"class_type": "FP8Engram.WeightReport", "inputs": {"model": ["2", 0]}}}


def test_wrong_input_type_is_a_node_error(comfy):
    response = comfy.submit(_clip_into_weight_report())
    assert response.status_code == 400
    errors = response.json()["node_errors"]["20"]["errors"]
    assert any(e["type"] == "return_type_mismatch" for e in errors), errors


def test_server_keeps_serving_after_a_failed_workflow(comfy, models_dir):
    with pytest.raises(WorkflowError, match="return_type_mismatch|MODEL"):
        comfy.run(_clip_into_weight_report())
    (models_dir / "diffusion_models" / "garbage.safetensors").write_bytes(b"\x10\x00not a safetensors file")
    broken = sd3_txt2img(seed=3)
    broken["1"]["inputs"]["unet_name"] = "garbage.safetensors"
    with pytest.raises(WorkflowError, match="UNETLoader"):
        comfy.run(broken)
    history = comfy.run(sd3_txt2img(seed=5, steps=1))
    assert output_images(history, "9")


def test_every_pack_node_is_documented_for_the_ui(comfy):
    """Descriptions, tooltips on every input and output, and the pack's category: what node search shows."""
    ours = {name: spec for name, spec in comfy.object_info().items() if name.startswith("FP8Engram.")}
    assert len(ours) >= 14
    for name, spec in ours.items():
        assert spec["description"].strip(), f"{name} has no description"
        assert spec["display_name"] and not spec["display_name"].startswith("FP8Engram."), name
        assert spec["category"].startswith("fp8-engram"), name
        for group in ("required", "optional"):
            for input_name, input_spec in spec["input"].get(group, {}).items():
                options = input_spec[1] if len(input_spec) > 1 else {}
                assert options.get("tooltip"), f"{name}.{input_name} has no tooltip"
        tooltips = spec.get("output_tooltips") or []
        assert len(tooltips) == len(spec["output"]) and all(tooltips), f"{name} outputs lack tooltips"
