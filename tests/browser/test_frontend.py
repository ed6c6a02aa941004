"""The real ComfyUI frontend, in headless Chromium, loads the pack's web extension and its nodes."""

from __future__ import annotations

import os
import shutil

import pytest

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
