"""After a real run, the text the pack draws on its nodes (Quantize Model to FP8, Save FP8 Model, Engram
Inspect, the loaders, Engram Text Encode) stays inside each node: the panel's box lies inside the
node's box, nothing overflows sideways, and what is taller than the panel scrolls inside it. Long
reports are folded on the node (the full report stays in the text output). Checked in both node
designs the frontend offers: the classic canvas nodes and the "Nodes 2.0" DOM nodes (Comfy.VueNodes.
Enabled), whose box is their own element's. Screenshots of every node go to
test-artifacts/node_text_<node>.png (node_text_<node>_nodes2.png for Nodes 2.0).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from example_graphs import prepare_inputs  # scripts/ is on sys.path (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]

TOLERANCE_PX = 2
MAX_TEXT_LINES = 8  # web/fp8_engram.js folds text reports longer than this
TIGHT_PANEL_HEIGHT = 36  # web/fp8_engram.js: the least a panel gets, even where a neighbour is close

# Boxes in page pixels: the node (title bar included) from LiteGraph's own geometry, or a Nodes 2.0
# node's own element, the panel from the DOM, and the farthest right/bottom any line of the panel reaches.
MEASURE = """(nodeId) => {
    const node = window.app.graph.getNodeById(nodeId);
    const canvas = window.app.canvas;
    const rect = canvas.canvas.getBoundingClientRect();
    const ds = canvas.ds;
    const title = window.LiteGraph.NODE_TITLE_HEIGHT;
    const x = (gx) => rect.left + (gx + ds.offset[0]) * ds.scale;
    const y = (gy) => rect.top + (gy + ds.offset[1]) * ds.scale;
    const holder = document.querySelector(`.fp8-engram-holder[data-node-id="${node.id}"]`);
    if (!holder) return { missing: true, type: node.type };
    const h = holder.getBoundingClientRect();
    const dom = document.querySelector(`.lg-node[data-node-id="${node.id}"]`)?.getBoundingClientRect();
    const parts = [...holder.querySelectorAll('.fp8-engram-line, pre, .fp8-engram-token, .fp8-engram-more, .fp8-engram-stream')];
    const style = getComputedStyle(holder);
    return {
        type: node.type, id: node.id,
        node: dom ? { l: dom.left, t: dom.top, r: dom.right, b: dom.bottom }
            : { l: x(node.pos[0]), t: y(node.pos[1] - title), r: x(node.pos[0] + node.size[0]), b: y(node.pos[1] + node.size[1]) },
        panel: { l: h.left, t: h.top, r: h.right, b: h.bottom },
        scrollW: holder.scrollWidth, clientW: holder.clientWidth, scrollH: holder.scrollHeight, clientH: holder.clientHeight,
        overflowY: style.overflowY, overflowX: style.overflowX,
        partsRight: parts.length ? Math.max(...parts.map((e) => e.getBoundingClientRect().right)) : h.right,
        text: holder.innerText,
    };
}"""


def problems(m: dict) -> list[str]:
    """What is wrong with one node's measurement (empty: the text fits)."""
    if m.get("missing"):
        return [f"{m['type']}: no panel drawn"]
    out = []
    n, p = m["node"], m["panel"]
    for side, bad in (("left", p["l"] < n["l"] - TOLERANCE_PX), ("top", p["t"] < n["t"] - TOLERANCE_PX),
                      ("right", p["r"] > n["r"] + TOLERANCE_PX), ("bottom", p["b"] > n["b"] + TOLERANCE_PX)):
        if bad:
            out.append(f"{m['type']}: panel crosses the node's {side} edge (panel {p}, node {n})")
    if m["scrollW"] > m["clientW"] + 1 or m["partsRight"] > p["r"] + TOLERANCE_PX:
        out.append(f"{m['type']}: text runs past the panel's right edge ({m['scrollW']} > {m['clientW']} px)")
    if m["scrollH"] > m["clientH"] + 1 and m["overflowY"] not in ("auto", "scroll"):
        out.append(f"{m['type']}: {m['scrollH']} px of text in a {m['clientH']} px panel that does not scroll")
    return out


def load_example(page, name: str) -> None:
    workflow = json.loads((ROOT / "example_workflows" / f"{name}.json").read_text())
    page.evaluate("async (wf) => { await window.app.loadGraphData(wf, true, true, 'example'); }", workflow)


# Every node's box in graph units (a Nodes 2.0 node's from its element, taken back through the canvas
# transform).
BOXES = """() => {
    const t = window.LiteGraph.NODE_TITLE_HEIGHT;
    const canvas = window.app.canvas;
    const rect = canvas.canvas.getBoundingClientRect();
    const ds = canvas.ds;
    const gx = (px) => (px - rect.left) / ds.scale - ds.offset[0];
    const gy = (py) => (py - rect.top) / ds.scale - ds.offset[1];
    return Object.fromEntries(window.app.graph._nodes.map((n) => {
        const dom = document.querySelector(`.lg-node[data-node-id="${n.id}"]`)?.getBoundingClientRect();
        if (dom) return [n.id, [gx(dom.left), gy(dom.top), gx(dom.right), gy(dom.bottom)]];
        return [n.id, [n.pos[0], n.pos[1] - t, n.pos[0] + n.size[0], n.pos[1] + n.size[1]]];
    }));
}"""


def new_overlaps(before: dict, after: dict, ids: list[int]) -> list[str]:
    """Pairs (pack node, other node) whose boxes overlap after the run but did not before it."""
    def hit(a, b):
        return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]

    out = []
    for i in map(str, ids):
        for j in after:
            if j != i and hit(after[i], after[j]) and not hit(before[i], before[j]):
                out.append(f"node {i} now covers node {j} ({after[i]} over {after[j]})")
    return out


def run_and_wait(page, name: str, node_types: list[str]) -> list[int]:
    load_example(page, name)
    if page.evaluate(NODES_2_ON):  # the DOM nodes are mounted after the graph is loaded
        page.wait_for_function("(n) => document.querySelectorAll('.lg-node[data-node-id]').length >= n",
                               arg=page.evaluate("() => window.app.graph._nodes.length"))
    page.wait_for_timeout(300)
    page.evaluate("() => { window.__fp8BoxesBefore = (%s)(); }" % BOXES)
    page.evaluate("async () => { await window.app.queuePrompt(0, 1); }")
    page.wait_for_function(
        "(types) => types.every(t => window.app.graph._nodes.some(n => n.type === t && n.fp8EngramLastOutput))",
        arg=node_types, timeout=600_000)
    page.wait_for_timeout(800)  # the panel is measured and the node resized over the next frames
    return page.evaluate(
        "() => window.app.graph._nodes.filter(n => n.type.startsWith('FP8Engram.') && n.fp8EngramLastOutput).map(n => n.id)")


def look_at(page, node_id: int) -> None:
    """Show the node at 100% zoom in the middle of the canvas, as a user looking at it."""
    page.evaluate(
        """(id) => {
            const node = window.app.graph.getNodeById(id);
            const canvas = window.app.canvas;
            canvas.ds.scale = 1;
            canvas.centerOnNode(node);
            canvas.setDirty(true, true);
        }""", node_id)
    page.wait_for_timeout(400)


def screenshot(page, m: dict, path: Path) -> None:
    n = m["node"]
    margin = 24
    clip = {"x": max(0, n["l"] - margin), "y": max(0, n["t"] - margin)}
    clip["width"] = min(1400 - clip["x"], n["r"] - n["l"] + 2 * margin)
    clip["height"] = min(900 - clip["y"], n["b"] - n["t"] + 2 * margin)
    page.screenshot(path=str(path), clip=clip)


@pytest.fixture(scope="module")
def example_inputs(comfy_server):
    prepare_inputs(comfy_server.base_dir)


NODES_2 = "Comfy.VueNodes.Enabled"
NODES_2_ON = "() => !!window.app.extensionManager.setting.get('%s')" % NODES_2


@pytest.fixture(params=["classic", "nodes2"])
def node_design(request, page):
    """The node design a user picked in the settings: classic canvas nodes, or Nodes 2.0 (DOM nodes)."""
    on = request.param == "nodes2"
    set_ = "async (v) => { await window.app.extensionManager.setting.set('%s', v); }" % NODES_2
    page.evaluate(set_, on)
    assert page.evaluate(NODES_2_ON) == on
    yield request.param
    page.evaluate(set_, False)


@pytest.mark.parametrize("example, node_types", [
    ("fp8_quantize_and_save", ["FP8Engram.QuantizeModelToFP8", "FP8Engram.SaveFP8Model"]),
    ("engram_memorize_and_use", ["FP8Engram.EngramInspect", "FP8Engram.EngramTextEncode"]),
])
def test_node_text_stays_inside_its_node_after_a_run(page, example_inputs, artifacts_dir, node_design, example, node_types):
    ids = run_and_wait(page, example, node_types)
    suffix = "_nodes2" if node_design == "nodes2" else ""
    found = []
    wrong = []
    measured = []
    for node_id in ids:
        look_at(page, node_id)
        m = page.evaluate(MEASURE, node_id)
        measured.append(m)
        found.append(m["type"])
        wrong += problems(m)
        if not m.get("missing"):
            screenshot(page, m, artifacts_dir / f"node_text_{m['type'].split('.')[-1]}{suffix}.png")
    assert set(node_types) <= set(found), found
    overlaps = new_overlaps(page.evaluate("() => window.__fp8BoxesBefore"), page.evaluate(BOXES), ids)
    if node_design == "nodes2":
        # Nodes 2.0 nodes are taller than the classic ones the examples were laid out for: where less
        # than two lines are left above the node below, the panel is held at two lines (scrolling) and
        # the node may reach over its neighbour by that much. A panel left taller than that may not.
        tight = {str(m["id"]) for m in measured if not m.get("missing") and m["clientH"] <= TIGHT_PANEL_HEIGHT + 1}
        overlaps = [o for o in overlaps if o.split()[1] not in tight]
    wrong += overlaps
    assert not wrong, "\n".join(wrong)


def test_long_reports_are_folded_on_the_node(page, example_inputs):
    """Engram Inspect's per-token report is folded to its hits, with the count of lines left out."""
    ids = page.evaluate("() => window.app.graph._nodes.filter(n => n.type === 'FP8Engram.EngramInspect').map(n => n.id)")
    if not ids:
        run_and_wait(page, "engram_memorize_and_use", ["FP8Engram.EngramInspect"])
        ids = page.evaluate("() => window.app.graph._nodes.filter(n => n.type === 'FP8Engram.EngramInspect').map(n => n.id)")
    output = page.evaluate("(id) => window.app.graph.getNodeById(id).fp8EngramLastOutput", ids[0])
    full = output["text"][0].split("\n")
    look_at(page, ids[0])
    shown = page.evaluate(MEASURE, ids[0])["text"]
    # the example's per-token report is longer than the fold, so the folding is what is checked here
    assert len(full) > MAX_TEXT_LINES, f"Engram Inspect's report has {len(full)} lines, too few to be folded: {full}"
    hits = [line for line in full[1:] if not re.search(r"\b0/\d+ entries", line)]
    kept = min(len(hits) or len(full) - 1, MAX_TEXT_LINES - 1)
    assert f"{len(full) - 1 - kept} more lines in the node's text output" in shown, shown
    assert "lighthouse" in shown.lower()  # the hit lines are the ones kept
    assert not any(line.strip() and line.strip() in shown for line in full[1:] if line not in hits[:kept])


def test_the_check_catches_text_that_overflows(page, example_inputs):
    """The measurement above is able to fail: a panel made to overflow (no wrapping, no scrolling,
    taller than its node) is reported."""
    ran = "() => window.app.graph._nodes.filter(n => n.type.startsWith('FP8Engram.') && n.fp8EngramLastOutput).map(n => n.id)"
    ids = page.evaluate(ran)
    if not ids:  # run alone (-k): make a node with a panel first
        run_and_wait(page, "engram_memorize_and_use", ["FP8Engram.EngramInspect"])
        ids = page.evaluate(ran)
    assert ids
    look_at(page, ids[0])
    page.evaluate(
        """(id) => {
            const holder = document.querySelector(`.fp8-engram-holder[data-node-id="${id}"]`);
            holder.style.overflow = 'visible';
            holder.style.height = '2000px';
            const pre = document.createElement('pre');
            pre.style.whiteSpace = 'pre';
            pre.textContent = 'x'.repeat(400) + '\\n'.repeat(200);
            holder.firstElementChild.append(pre);
        }""", ids[0])
    page.wait_for_timeout(200)
    found = problems(page.evaluate(MEASURE, ids[0]))
    assert any("right edge" in p for p in found) and any("bottom" in p for p in found), found
