"""Headless Chromium on the real ComfyUI page, shared by the browser tests of one session."""

from __future__ import annotations

import os
import shutil

import pytest
import requests

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]


@pytest.fixture(scope="session")
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
