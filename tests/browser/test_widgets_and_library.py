"""The pack's nodes as a user meets them in the frontend: listed in the node library under the pack's
categories, and every widget the server declares is on the node, with its default and choices, and a
value changed on the node is the value the queued prompt carries."""

from __future__ import annotations

import pytest

WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN")


def declared_widgets(node_info: dict) -> dict[str, dict]:
    """The inputs of one node (object_info) that the frontend shows as widgets: name -> {kind, default,
    options, min, max, step}. Sockets (models, conditioning, forceInput) are left out."""
    out = {}
    for section in ("required", "optional"):
        for name, spec in (node_info["input"].get(section) or {}).items():
            kind, extra = spec[0], (spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {})
            if extra.get("forceInput"):
                continue
            if isinstance(kind, list):
                out[name] = {"kind": "COMBO", "options": kind, **extra}
            elif kind == "COMBO":
                out[name] = {"kind": "COMBO", **extra}
            elif kind in WIDGET_TYPES:
                out[name] = {"kind": kind, **extra}
    return out


# The node's widgets as the frontend made them (combo choices may be a list or a function). Each node
# gets a new id: the frontend keeps widget values per node id, so a node made after a clear() under a
# reused id would start with the last node's values.
NODE_WIDGETS = """(type) => {
    const node = window.LiteGraph.createNode(type);
    window.app.graph.add(node);
    const values = (w) => { const v = w.options?.values; return typeof v === 'function' ? v(w, node) : v; };
    return { id: node.id, widgets: (node.widgets || []).map((w) => ({ name: w.name, value: w.value, options: values(w) ?? null })) };
}"""

SET_AND_QUEUE = """async ([id, changes]) => {
    const node = window.app.graph.getNodeById(id);
    for (const [name, value] of Object.entries(changes)) {
        const widget = node.widgets.find((w) => w.name === name);
        widget.value = value;
        widget.callback?.(value, window.app.canvas, node);
    }
    const prompt = await window.app.graphToPrompt();
    window.app.graph.remove(node);
    return prompt.output[String(id)].inputs;
}"""


def another_value(spec: dict, current):
    """A valid value for a widget other than its current one (None: the widget has a single choice)."""
    kind = spec["kind"]
    if kind == "COMBO":
        others = [o for o in spec.get("options", []) if o != current]
        return others[0] if others else None
    if kind == "BOOLEAN":
        return not current
    if kind == "STRING":
        return f"{current} changed" if current else "changed"
    step = spec.get("step", 1 if kind == "INT" else 0.01) or 1
    up = current + step
    value = up if up <= spec.get("max", float("inf")) else current - step
    return int(value) if kind == "INT" else round(value, 6)


@pytest.fixture(scope="module")
def pack_nodes(page, comfy) -> dict[str, dict]:
    """The server's definitions of the pack's nodes, after the page reloaded its own (as the user's
    Refresh does), so files the tests before this one wrote are listed on both sides."""
    page.evaluate("async () => { await window.app.refreshComboInNodes(); }")
    return {name: info for name, info in comfy.object_info().items() if name.startswith("FP8Engram.")}


def test_every_declared_widget_is_on_the_node_and_its_value_reaches_the_prompt(page, pack_nodes):
    wrong = []
    checked = 0
    for node_type, info in sorted(pack_nodes.items()):
        declared = declared_widgets(info)
        made = page.evaluate(NODE_WIDGETS, node_type)
        widgets = {w["name"]: w for w in made["widgets"]}
        changes = {}
        for name, spec in declared.items():
            widget = widgets.get(name)
            if widget is None:
                wrong.append(f"{node_type}: no widget for input {name!r} ({spec['kind']})")
                continue
            if spec["kind"] == "COMBO":
                if widget["options"] != spec.get("options"):
                    wrong.append(f"{node_type}.{name}: choices {widget['options']} on the node, {spec.get('options')} declared")
                default = spec.get("default", (spec.get("options") or [None])[0])
            else:
                default = spec.get("default")
            if default is not None and widget["value"] != default:
                wrong.append(f"{node_type}.{name}: starts at {widget['value']!r}, declared default {default!r}")
            value = another_value(spec, widget["value"])
            if value is not None:
                changes[name] = value
        inputs = page.evaluate(SET_AND_QUEUE, [made["id"], changes])
        for name, value in changes.items():
            checked += 1
            if inputs.get(name) != value:
                wrong.append(f"{node_type}.{name}: set to {value!r} on the node, the prompt carries {inputs.get(name)!r}")
    assert checked >= len(pack_nodes), f"only {checked} widget values checked over {len(pack_nodes)} nodes"
    assert not wrong, "\n".join(wrong)


def test_the_check_catches_a_widget_that_does_not_reach_the_prompt(page, pack_nodes):
    """The comparison above is able to fail: a widget whose value the node does not serialize is found."""
    node_type = "FP8Engram.LoadFP8DiffusionModel"
    made = page.evaluate(NODE_WIDGETS, node_type)
    name = "compute_path"
    spec = declared_widgets(pack_nodes[node_type])[name]
    value = another_value(spec, next(w["value"] for w in made["widgets"] if w["name"] == name))
    page.evaluate("(id) => { window.app.graph.getNodeById(id).widgets.find(w => w.name === 'compute_path').serializeValue = () => 'tampered'; }", made["id"])
    inputs = page.evaluate(SET_AND_QUEUE, [made["id"], {name: value}])
    assert inputs[name] != value


def test_the_node_library_lists_the_pack_nodes_under_its_categories(page, pack_nodes, artifacts_dir):
    """Browsing the node library sidebar: the pack's top category opens to its sub-categories and nodes."""
    page.keyboard.press("Escape")
    page.evaluate("async () => { await window.app.extensionManager.command.execute('Workspace.ToggleSidebarTab.node-library'); }")
    try:
        categories = sorted({info["category"] for info in pack_nodes.values()})
        top = categories[0].split("/")[0]
        assert all(c.split("/")[0] == top for c in categories), categories
        library = page.locator(".side-bar-panel, .sidebar-content-container, [role='tabpanel']").first
        library.wait_for(state="visible")
        library.get_by_text(top, exact=True).first.click()
        for category in sorted((c for c in categories if "/" in c), key=lambda c: c.count("/")):
            library.get_by_text(category.split("/")[-1], exact=True).first.click()
        wanted = sorted(info["display_name"] for info in pack_nodes.values())
        missing = []
        for name in wanted:
            try:
                library.get_by_text(name, exact=True).first.wait_for(state="visible", timeout=5_000)
            except Exception:  # noqa: BLE001 - a Playwright timeout: the node is not listed
                missing.append(name)
        page.screenshot(path=str(artifacts_dir / "node_library.png"))
        assert not missing, f"not listed in the node library: {missing}"
    finally:
        page.evaluate("async () => { await window.app.extensionManager.command.execute('Workspace.ToggleSidebarTab.node-library'); }")
