"""Example workflows open in the real editor and run; FP8 summaries, quantization quality and engram
highlights appear on the nodes after a run; long operations report progress to the page."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers.browser import screenshot_node, wait_for_node_output

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES_DIR = ROOT / "example_workflows"
sys.path.insert(0, str(ROOT / "scripts"))
from example_graphs import EXAMPLES, PHRASE, PROMPT, prepare_inputs  # noqa: E402

EXAMPLE_NAMES = sorted(p.stem for p in EXAMPLES_DIR.glob("*.json"))


@pytest.fixture(scope="module")
def example_inputs(comfy_server):
    prepare_inputs(comfy_server.base_dir)


@pytest.fixture(scope="module")
def progress_log(page):
    """Every `progress` event the page receives from the server, as (node id, value, max)."""
    page.evaluate(
        """() => {
            window.__fp8Progress = [];
            window.app.api.addEventListener('progress', (e) => {
                window.__fp8Progress.push([String(e.detail.node), e.detail.value, e.detail.max]);
            });
        }"""
    )
    return lambda: page.evaluate("() => window.__fp8Progress")


def load_example(page, name: str) -> dict:
    """Open an example workflow in the editor; returns the API graph the editor makes of it."""
    workflow = json.loads((EXAMPLES_DIR / f"{name}.json").read_text())
    missing = page.evaluate(
        "(wf) => wf.nodes.map(n => n.type).filter(t => !window.LiteGraph.registered_node_types[t])", workflow
    )
    assert missing == [], f"{name}: node types unknown to the frontend: {missing}"
    graph = page.evaluate(
        """async (wf) => {
            await window.app.loadGraphData(wf, true, true, 'example');
            const prompt = await window.app.graphToPrompt();
            return prompt.output;
        }""",
        workflow,
    )
    # The frontend validates a workflow it opens and raises an alert when the file breaks its schema.
    alert = page.get_by_text("Invalid workflow against zod schema")
    assert alert.count() == 0, f"{name}: {alert.first.text_content()[:500]}"
    return graph


def test_every_example_is_generated_from_example_graphs():
    assert EXAMPLE_NAMES == sorted(EXAMPLES)
    for name in EXAMPLE_NAMES:
        workflow = json.loads((EXAMPLES_DIR / f"{name}.json").read_text())
        assert sorted(n["type"] for n in workflow["nodes"]) == sorted(n["class_type"] for n in EXAMPLES[name][0].values()), name


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_example_workflow_opens_and_runs(page, comfy, example_inputs, name):
    graph = load_example(page, name)
    info = comfy.object_info()
    for node_id, node in graph.items():
        assert node["class_type"] in info, f"{name}: node {node_id} {node['class_type']} unknown to the server"
    history = comfy.run(graph, timeout=600)
    saved = [img for out in history["outputs"].values() for img in out.get("images", []) if img.get("type") == "output"]
    assert saved, f"{name}: the workflow saved no image"


def queue_from_page(page) -> None:
    page.evaluate("async () => { await window.app.queuePrompt(0, 1); }")


def test_fp8_loader_summary_is_drawn_on_the_node(page, example_inputs, artifacts_dir):
    load_example(page, "fp8_load_and_sample")
    queue_from_page(page)
    output = wait_for_node_output(page, "FP8Engram.LoadFP8DiffusionModel")
    summary = output["fp8_summary"][0]
    assert summary["layers_quantized"] > 0 and summary["bytes_on_disk"] < summary["bytes_bf16"]
    box = page.locator(".fp8-engram-summary").first
    box.wait_for(state="attached")
    text = box.text_content()
    assert f"{summary['layers_quantized']}/{summary['layers_total']} layers FP8" in text
    assert "compute:" in text and "bf16" in text
    screenshot_node(page, "FP8Engram.LoadFP8DiffusionModel", artifacts_dir / "fp8_loader_summary.png")


def test_quantize_quality_is_drawn_and_progress_reported(page, example_inputs, progress_log, artifacts_dir):
    graph = load_example(page, "fp8_quantize_and_save")
    quantize_id = next(i for i, n in graph.items() if n["class_type"] == "FP8Engram.QuantizeModelToFP8")
    queue_from_page(page)
    output = wait_for_node_output(page, "FP8Engram.QuantizeModelToFP8")
    quality = output["fp8_quality"][0]
    box = page.locator(".fp8-engram-quality").first
    box.wait_for(state="attached")
    assert f"SQNR mean {quality['mean_sqnr_db']:.1f} dB" in box.text_content()
    # ComfyUI's progress mechanism carried the quantizer's progress to the page, up to completion.
    wait_for_node_output(page, "FP8Engram.SaveFP8Model")
    events = [e for e in progress_log() if e[0] == str(quantize_id)]
    assert events and events[-1][1] == events[-1][2], events
    screenshot_node(page, "FP8Engram.QuantizeModelToFP8", artifacts_dir / "quantize_quality.png")


def test_engram_hits_are_highlighted_in_the_prompt(page, example_inputs, artifacts_dir):
    # a word of the prompt the memory does not hold (the memorized phrase's first word has no n-gram of its own)
    unheld = next(w for w in PROMPT.lower().split() if w != PHRASE.lower().split()[-1])
    load_example(page, "engram_memorize_and_use")
    queue_from_page(page)
    for node_type in ("FP8Engram.EngramTextEncode", "FP8Engram.EngramInspect"):
        output = wait_for_node_output(page, node_type)
        tokens = [t for entry in output["engram_hits"] for t in entry["tokens"]]
        hit_words = {t["text"].strip().lower() for t in tokens if t["hit"]}
        assert "lighthouse" in hit_words, (node_type, tokens)
        assert unheld not in hit_words
    hits = page.locator(".fp8-engram-hit")
    hits.first.wait_for(state="attached")
    texts = [t.strip().lower() for t in hits.all_text_contents()]
    assert "lighthouse" in texts
    assert all(float(s) > 0 for s in hits.evaluate_all("els => els.map(e => e.dataset.strength)"))
    # The rest of the prompt is shown too, not highlighted.
    plain = [t.strip().lower() for t in page.locator(".fp8-engram-token:not(.fp8-engram-hit)").all_text_contents()]
    assert unheld in plain
    assert PHRASE.split()[-1] in texts
    screenshot_node(page, "FP8Engram.EngramTextEncode", artifacts_dir / "engram_highlights.png")
