"""Helpers for browser tests: drive the real frontend page (Playwright) the way a user would."""

from __future__ import annotations


def run_api_graph(page, graph: dict) -> None:
    """Load an API-format graph into the editor and queue it from the page, as a user's click would."""
    page.evaluate("async (graph) => { await window.app.loadApiJson(graph, 'test'); }", graph)
    page.evaluate("async () => { await window.app.queuePrompt(0, 1); }")


def wait_for_node_output(page, node_type: str, timeout_ms: int = 180_000):
    """Wait until the frontend received a run's `ui` payload for a node of this type; returns it."""
    page.wait_for_function(
        "(type) => window.app.graph._nodes.some(n => n.type === type && n.fp8EngramLastOutput)",
        arg=node_type,
        timeout=timeout_ms,
    )
    return page.evaluate(
        "(type) => window.app.graph._nodes.find(n => n.type === type && n.fp8EngramLastOutput).fp8EngramLastOutput",
        node_type,
    )


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
