"""The real ComfyUI frontend, in headless Chromium, loads the pack's web extension and its nodes."""

from __future__ import annotations

import os
import shutil

import pytest
import requests
from helpers.graphs import sd3_txt2img

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]


@pytest.fixture(scope="module")
def page(comfy_server, tmp_path_factory, artifacts_dir):
    if not os.path.exists(CHROMIUM):
        if os.environ.get("CI"):
            pytest.fail("Chromium is missing: scripts/setup.sh --browser installs it")
        pytest.skip("Chromium is not installed (run scripts/setup.sh --browser)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (scripts/setup.sh --browser)")
    # A returning user's settings: no first-run templates dialog over the canvas.
    for key in ("Comfy.TutorialCompleted",):
        requests.post(f"{comfy_server.url}/settings/{key}", json=True, timeout=30).raise_for_status()
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 900}
        )
        page = context.new_page()
        page.set_default_timeout(60_000)
        page.goto(comfy_server.url)
        page.wait_for_function("() => window.app && window.app.graph && window.LiteGraph")
        yield page
        context.close()


def test_pack_extension_and_nodes_are_loaded(page, artifacts_dir):
    page.wait_for_function("() => (window.app.extensions || []).some(e => e.name === 'fp8_engram.core')")
    registered = page.evaluate(
        "() => Object.keys(window.LiteGraph.registered_node_types).filter(n => n.startsWith('FP8Engram.'))"
    )
    assert "FP8Engram.WeightReport" in registered
    page.screenshot(path=str(artifacts_dir / "frontend_loaded.png"))


def test_pack_node_can_be_added_to_the_graph(page):
    title = page.evaluate(
        """() => {
            const node = window.LiteGraph.createNode('FP8Engram.WeightReport');
            window.app.graph.add(node);
            return node.title;
        }"""
    )
    assert title == "Model Weight Report"


def run_api_graph(page, graph: dict, timeout_ms: int = 120_000) -> None:
    """Load an API-format graph into the editor and queue it from the page, as a user's click would."""
    page.evaluate("async (graph) => { await window.app.loadApiJson(graph, 'test'); }", graph)
    page.evaluate("async () => { await window.app.queuePrompt(0, 1); }")


def screenshot_node(page, node_type: str, path) -> None:
    """Center the canvas on the first node of a type and save a screenshot (a test artifact)."""
    page.evaluate(
        """(type) => {
            const node = window.app.graph._nodes.find(n => n.type === type);
            window.app.canvas.centerOnNode?.(node);
            window.app.canvas.setDirty(true, true);
        }""",
        node_type,
    )
    page.wait_for_timeout(300)
    page.screenshot(path=str(path))


def test_weight_report_is_shown_on_the_node_after_a_run(page, artifacts_dir):
    graph = sd3_txt2img(seed=11, steps=1)
    graph["20"] = {"class_type": "FP8Engram.WeightReport", "inputs": {"model": ["1", 0]}}
    run_api_graph(page, graph)
    page.wait_for_function(
        "() => window.app.graph._nodes.some(n => n.type === 'FP8Engram.WeightReport' && n.fp8EngramLastOutput)",
        timeout=120_000,
    )
    panel = page.locator(".fp8-engram-panel pre.fp8-engram-text").first
    panel.wait_for(state="attached")
    assert "as bf16" in panel.text_content()
    screenshot_node(page, "FP8Engram.WeightReport", artifacts_dir / "weight_report.png")
