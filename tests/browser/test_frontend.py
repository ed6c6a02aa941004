"""The real ComfyUI frontend, in headless Chromium, loads the pack's web extension and its nodes."""

from __future__ import annotations

import os
import re

from helpers.browser import run_api_graph, screenshot_node, wait_for_node_output
from helpers.graphs import sd3_txt2img


def test_the_page_runs_the_frontend_this_run_asks_for(page, comfyui_tree):
    """FP8_ENGRAM_FRONTEND's release when set (CI's newest-frontend leg), else the one the tree pins:
    a leg that meant to test a frontend and served another would pass for the wrong reason."""
    wanted = os.environ.get("FP8_ENGRAM_FRONTEND", "").strip()
    if not wanted:
        pin = re.search(r"^comfyui-frontend-package==(\S+)", (comfyui_tree / "requirements.txt").read_text(), re.M)
        assert pin, f"{comfyui_tree}/requirements.txt pins no comfyui-frontend-package"
        wanted = pin.group(1)
    assert page.evaluate("() => window.__COMFYUI_FRONTEND_VERSION__") == wanted


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


def test_weight_report_is_shown_on_the_node_after_a_run(page, artifacts_dir):
    graph = sd3_txt2img(seed=11, steps=1)
    graph["20"] = {"class_type": "FP8Engram.WeightReport", "inputs": {"model": ["1", 0]}}
    run_api_graph(page, graph)
    output = wait_for_node_output(page, "FP8Engram.WeightReport")
    assert "as bf16" in output["text"][0]
    panel = page.locator(".fp8-engram-panel pre.fp8-engram-text").first
    panel.wait_for(state="attached")
    assert "as bf16" in panel.text_content()
    screenshot_node(page, "FP8Engram.WeightReport", artifacts_dir / "weight_report.png")


def test_node_search_finds_the_pack_nodes(page, artifacts_dir):
    """A user double-clicks the canvas and types: the pack's loaders are among the first results."""
    page.keyboard.press("Escape")
    search = page.get_by_role("combobox").or_(page.locator(".comfy-vue-node-search-container input")).first
    for attempt in range(4):
        if search.is_visible():  # a box that opened late, after the last wait gave up
            break
        x, y = _empty_canvas_point(page)
        page.mouse.dblclick(x, y)
        try:
            search.wait_for(state="visible", timeout=15_000)
            break
        except Exception:
            # A double-click can be taken as two clicks while the page is busy (a loaded machine): the user
            # would double-click again. Nothing is dismissed in between: an Escape here could close a box
            # that opens just after the wait.
            continue
    search.wait_for(state="visible", timeout=10_000)
    search.fill("fp8 load")
    results = page.locator(".comfy-vue-node-search-container, .p-autocomplete-overlay, [role='listbox']").first
    results.wait_for(state="visible")
    page.wait_for_timeout(500)
    text = results.text_content()
    page.screenshot(path=str(artifacts_dir / "node_search.png"))
    page.keyboard.press("Escape")
    assert "Load FP8 Diffusion Model" in text
    assert "Load FP8 Checkpoint" in text


def _empty_canvas_point(page) -> tuple[float, float]:
    """A point of the page where the canvas itself is under the pointer: no node (the session's earlier
    tests leave nodes and their DOM panels on the canvas, wherever the last screenshot centred it)."""
    point = page.evaluate(
        """() => {
            const el = document.getElementById('graph-canvas');
            const box = el.getBoundingClientRect();
            const canvas = window.app.canvas;
            for (let fy = 0.9; fy >= 0.1; fy -= 0.1) {
                for (let fx = 0.1; fx <= 0.9; fx += 0.1) {
                    const x = box.left + box.width * fx, y = box.top + box.height * fy;
                    if (document.elementFromPoint(x, y) !== el) continue;
                    const pos = canvas.ds.convertCanvasToOffset([x - box.left, y - box.top]);
                    if (window.app.graph.getNodeOnPos(pos[0], pos[1], window.app.graph._nodes, 10)) continue;
                    return [x, y];
                }
            }
            return null;
        }"""
    )
    assert point, "no empty spot on the canvas to double-click (every probe hit a node or an overlay)"
    return point[0], point[1]
