// fp8-engram frontend extension.
//
// After one of the pack's nodes runs, ComfyUI hands the node's `ui` payload to `onExecuted`. This
// extension draws it on the node itself, in one panel per node:
//   ui.fp8_summary  [{format, layers_quantized, layers_total, bytes_on_disk, bytes_bf16, compute_path, fast_paths, int8?}]
//   ui.fp8_quality  [{granularity, dtype, layers, kept, mean_sqnr_db, min_sqnr_db, worst_layer}]
//   ui.engram_hits  [{stream, tokens: [{text, strength, hit}]}]   the prompt, hit words highlighted
//   ui.text         [string]                                       plain text reports
// The last payload also stays on the node as `node.fp8EngramLastOutput` (read by the browser tests).
//
// The panel stays inside its node: text wraps at the node's width, the node grows to the panel's
// height (up to MAX_PANEL_HEIGHT), and a longer panel scrolls inside the node. Text reports longer
// than MAX_TEXT_LINES are folded to their first lines (lines with hits first, for Engram Inspect);
// the whole report stays in the node's text output. With Nodes 2.0 (the frontend's DOM nodes, setting
// Comfy.VueNodes.Enabled) a node is an element that grows to its content, so there the panel itself is
// held above the nearest node below it and scrolls past that.
import { app } from "../../scripts/app.js";

const NODE_PREFIX = "FP8Engram.";
const PANEL = "fp8_engram_panel";
const MIN_PANEL_WIDTH = 360;
const MAX_PANEL_HEIGHT = 320;
const MAX_TEXT_LINES = 8;
const WRAP = "white-space: pre-wrap; overflow-wrap: anywhere; word-break: break-word;";

function mib(bytes) {
  return `${(bytes / 2 ** 20).toFixed(bytes < 2 ** 24 ? 2 : 0)} MiB`;
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// Engram Inspect writes one line per token ("... 0/16 entries ..." for a miss): show hits first.
const MISS_LINE = /\b0\/\d+ entries\b/;

function foldText(text) {
  const lines = String(text).split("\n");
  if (lines.length <= MAX_TEXT_LINES) return { shown: lines.join("\n"), hidden: 0 };
  const [head, ...rest] = lines;
  const hits = rest.filter((line) => !MISS_LINE.test(line));
  const pick = (hits.length ? hits : rest).slice(0, MAX_TEXT_LINES - 1);
  return { shown: [head, ...pick].join("\n"), hidden: lines.length - 1 - pick.length };
}

function renderSummary(summary) {
  const box = el("div", "fp8-engram-summary");
  const ratio = summary.bytes_bf16 ? summary.bytes_on_disk / summary.bytes_bf16 : 0;
  const lines = [
    `${summary.format}`,
    `${summary.layers_quantized}/${summary.layers_total} layers FP8`,
    `${mib(summary.bytes_on_disk)} on disk vs ${mib(summary.bytes_bf16)} bf16 (${(ratio * 100).toFixed(0)}%)`,
  ];
  if (summary.compute_path && summary.compute_path !== "-") lines.push(`compute: ${summary.compute_path}`);
  for (const line of summary.fast_paths || []) lines.push(`proven: ${line}`);
  if (summary.int8) lines.push(`int8: ${summary.int8.layers} layers, SQNR mean ${Number(summary.int8.mean_sqnr_db).toFixed(1)} dB, min ${Number(summary.int8.min_sqnr_db).toFixed(1)} dB`);
  for (const line of lines) box.append(el("div", "fp8-engram-line", line));
  return box;
}

function renderQuality(quality, withWorst = true) {
  const box = el("div", "fp8-engram-quality");
  box.append(
    el("div", "fp8-engram-line", `${quality.granularity} ${quality.dtype}: ${quality.layers} layers quantized, ${quality.kept} kept`),
    el("div", "fp8-engram-line", `SQNR mean ${Number(quality.mean_sqnr_db).toFixed(1)} dB, min ${Number(quality.min_sqnr_db).toFixed(1)} dB`),
  );
  if (withWorst && quality.worst_layer) box.append(el("div", "fp8-engram-line", `worst: ${quality.worst_layer}`));
  return box;
}

function renderHits(entry, maxStrength) {
  const box = el("div", "fp8-engram-prompt");
  if (entry.stream) box.append(el("div", "fp8-engram-stream", entry.stream));
  const line = el("div", "fp8-engram-tokens");
  for (const token of entry.tokens || []) {
    const span = el("span", token.hit ? "fp8-engram-token fp8-engram-hit" : "fp8-engram-token", token.text);
    if (token.hit) {
      const alpha = 0.25 + 0.75 * Math.min(1, token.strength / (maxStrength || 1));
      span.style.background = `rgba(255, 166, 0, ${alpha.toFixed(2)})`;
      span.style.color = "#111";
      span.title = `memory strength ${Number(token.strength).toFixed(3)}`;
      span.dataset.strength = String(token.strength);
    }
    line.append(span, document.createTextNode(" "));
  }
  box.append(line);
  return box;
}

function render(message) {
  const root = el("div", "fp8-engram-panel");
  root.style.cssText = `font: 11px monospace; color: var(--input-text, #ddd); padding: 4px; box-sizing: border-box; ${WRAP}`;
  for (const summary of message.fp8_summary || []) root.append(renderSummary(summary));
  // With a text report (the worst layers listed), the quality block leaves out its own "worst:" line.
  for (const quality of message.fp8_quality || []) root.append(renderQuality(quality, !message.text));
  const hits = message.engram_hits || [];
  const maxStrength = Math.max(0, ...hits.flatMap((h) => (h.tokens || []).map((t) => t.strength || 0)));
  for (const entry of hits) root.append(renderHits(entry, maxStrength));
  for (const text of message.text || []) {
    const { shown, hidden } = foldText(text);
    const pre = el("pre", "fp8-engram-text", shown);
    pre.style.cssText = `margin: 0; font: inherit; ${WRAP}`;
    root.append(pre);
    if (hidden > 0) {
      const more = el("div", "fp8-engram-more", `… ${hidden} more lines in the node's text output`);
      more.style.cssText = "opacity: 0.7; font-style: italic;";
      root.append(more);
    }
  }
  return root;
}

const MIN_PANEL_HEIGHT = 60;
const TIGHT_PANEL_HEIGHT = 36; // two lines: the least a panel gets, even where a neighbour is close
const GAP = 10;

function contentHeight(widget) {
  const content = widget.fp8Holder.firstElementChild;
  return Math.min(MAX_PANEL_HEIGHT, content ? content.scrollHeight + 8 : 0);
}

function titleHeight() {
  return globalThis.LiteGraph?.NODE_TITLE_HEIGHT ?? 30;
}

// How far the node may extend (graph units from its top-left) before it would cover a node that now
// lies entirely below it / to its right. Nodes it already overlaps are left out: that was the layout.
function room(node) {
  const t = titleHeight();
  const [x0, y0] = node.pos;
  const [x1, y1] = [x0 + node.size[0], y0 + node.size[1]];
  let down = Infinity;
  let right = Infinity;
  for (const other of node.graph?._nodes ?? []) {
    if (other === node) continue;
    const [ox0, oy0] = [other.pos[0], other.pos[1] - t];
    const [ox1, oy1] = [other.pos[0] + other.size[0], other.pos[1] + other.size[1]];
    if (ox0 < x1 && ox1 > x0 && oy0 >= y1) down = Math.min(down, oy0 - GAP - y0);
    if (oy0 < y1 && oy1 > y0 - t && ox0 >= x1) right = Math.min(right, ox0 - GAP - x0);
  }
  return { down, right };
}

function nodes2() {
  return app.extensionManager?.setting?.get?.("Comfy.VueNodes.Enabled") === true;
}

// Nodes 2.0: the node's element takes the panel's whole height, whatever size the node is given, so
// cap the panel where the node would reach a node below it (page pixels back to graph units).
// The cap is a CSS variable that only a Nodes 2.0 node applies (STYLE), so a panel capped there is
// whole again when the user switches back to the classic nodes.
const STYLE = ".lg-node .fp8-engram-holder { max-height: var(--fp8-engram-max-height, none); }";

function holdPanel(node, widget) {
  const holder = widget.fp8Holder;
  holder.style.removeProperty("--fp8-engram-max-height");
  const own = nodes2() && document.querySelector(`.lg-node[data-node-id="${node.id}"]`);
  if (!own) return;
  const scale = app.canvas?.ds?.scale || 1;
  const box = own.getBoundingClientRect();
  const panel = holder.getBoundingClientRect();
  let below = Infinity;
  for (const other of document.querySelectorAll(".lg-node[data-node-id]")) {
    if (other === own) continue;
    const o = other.getBoundingClientRect();
    if (o.left < box.right && o.right > box.left && o.top >= panel.top) below = Math.min(below, o.top);
  }
  if (below === Infinity) return;
  const underPanel = box.bottom - panel.bottom; // what the node draws below the panel
  const room = (below - GAP * scale - underPanel - panel.top) / scale;
  holder.style.setProperty("--fp8-engram-max-height", `${Math.max(TIGHT_PANEL_HEIGHT, Math.floor(room))}px`);
}

// Size the node to its panel: wider to MIN_PANEL_WIDTH and taller to the panel's whole height, but
// never over a neighbour below or to the right (the panel then scrolls) and never smaller than the
// user made it. Measured after the frontend has laid the panel out at the node's width.
function fitNode(node, widget) {
  const width = Math.max(node.size[0], Math.min(MIN_PANEL_WIDTH, room(node).right));
  if (width !== node.size[0]) node.setSize?.([width, node.size[1]]);
  requestAnimationFrame(() =>
    requestAnimationFrame(() => {
      const full = contentHeight(widget);
      widget.fp8Full = full;
      widget.fp8Min = undefined;
      const smallest = Math.min(full, MIN_PANEL_HEIGHT);
      const others = (node.computeSize?.() ?? node.size)[1] - smallest; // everything but the panel
      const down = room(node).down;
      // Squeeze the panel (down to TIGHT_PANEL_HEIGHT, scrolling) before covering the node below.
      widget.fp8Min = Math.max(Math.min(smallest, TIGHT_PANEL_HEIGHT), Math.min(smallest, down - others));
      const height = Math.max(node.size[1], Math.min(others + full, Math.max(others + widget.fp8Min, down)));
      node.setSize?.([node.size[0], height]);
      node.setDirtyCanvas?.(true, true);
      holdPanel(node, widget);
    }),
  );
}

function showPanel(node, message) {
  const content = render(message);
  let widget = node.widgets?.find((w) => w.name === PANEL);
  if (!widget) {
    const holder = el("div", "fp8-engram-holder");
    // The frontend sizes this element to the widget's share of the node; what does not fit scrolls.
    holder.style.cssText = "overflow-x: hidden; overflow-y: auto; box-sizing: border-box; width: 100%; height: 100%;";
    widget = node.addDOMWidget(PANEL, "fp8_engram_panel", holder, {
      serialize: false,
      hideOnZoom: false,
      getMinHeight: () => widget.fp8Min ?? Math.min(widget.fp8Full ?? MIN_PANEL_HEIGHT, MIN_PANEL_HEIGHT),
      getMaxHeight: () => widget.fp8Full ?? MAX_PANEL_HEIGHT,
    });
    widget.fp8Holder = holder;
  }
  widget.fp8Holder.replaceChildren(content);
  widget.fp8Holder.dataset.nodeId = String(node.id);
  widget.fp8Full = undefined;
  widget.fp8Min = undefined;
  fitNode(node, widget);
}

app.registerExtension({
  name: "fp8_engram.core",

  setup() {
    document.head.append(el("style", "", STYLE));
  },

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!nodeData?.name?.startsWith(NODE_PREFIX)) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      this.fp8EngramLastOutput = message;
      if (message && (message.fp8_summary || message.fp8_quality || message.engram_hits || message.text)) {
        showPanel(this, message);
      }
    };
  },
});
