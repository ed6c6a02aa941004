"""Write example_workflows/*.json (the editor's workflow format) from the API graphs in example_graphs.py.

The frontend itself does the conversion: a real ComfyUI with the pack is started, each API graph is
loaded into the editor in headless Chromium (`app.loadApiJson`), laid out, and serialized
(`app.graph.serialize()`), so the files carry exactly what the frontend would save.

    .venv/bin/python scripts/make_example_workflows.py
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from comfyhost import ROOT, ComfyServer  # noqa: E402
from example_graphs import EXAMPLES, prepare_inputs  # noqa: E402

logger = logging.getLogger("examples")
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]


def drop_nulls(value):
    """`graph.serialize()` leaves nulls (e.g. `floatingLinks`, `slot_index`) that the frontend's own
    workflow schema rejects when the file is opened again; absent keys are what it expects."""
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="[examples] %(message)s")
    from playwright.sync_api import sync_playwright

    out_dir = ROOT / "example_workflows"
    out_dir.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        subprocess.run([sys.executable, str(ROOT / "scripts" / "tiny_models.py"), str(base / "models")], check=True)
        prepare_inputs(base)
        server = ComfyServer(base_dir=base).start()
        try:
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=CHROMIUM_ARGS)
                page = browser.new_page()
                page.goto(server.url)
                page.wait_for_function("() => window.app && window.app.graph && window.LiteGraph")
                for name, (graph, _description) in EXAMPLES.items():
                    workflow = page.evaluate(
                        """async (graph) => {
                            await window.app.loadApiJson(graph, 'example');
                            window.app.graph.arrange?.(80);
                            return window.app.graph.serialize();
                        }""",
                        graph,
                    )
                    workflow = drop_nulls(workflow)
                    path = out_dir / f"{name}.json"
                    tmp_path = path.with_suffix(".json.tmp")
                    tmp_path.write_text(json.dumps(workflow, indent=1) + "\n")
                    os.replace(tmp_path, path)
                    logger.info("wrote %s (%d nodes)", path, len(workflow["nodes"]))
                browser.close()
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
