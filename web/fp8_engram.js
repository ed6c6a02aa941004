// fp8-engram frontend extension.
//
// After one of the pack's nodes runs, ComfyUI hands the node's `ui` payload to `onExecuted`. This
// extension draws it on the node itself, in one panel per node:
//   ui.fp8_summary  [{format, layers_quantized, layers_total, bytes_on_disk, bytes_bf16, compute_path}]
//   ui.fp8_quality  [{granularity, dtype, layers, kept, mean_sqnr_db, min_sqnr_db, worst_layer}]
//   ui.engram_hits  [{stream, tokens: [{text, strength, hit}]}]   the prompt, hit words highlighted
//   ui.text         [string]                                       plain text reports
// The last payload also stays on the node as `node.fp8EngramLastOutput` (read by the browser tests).
import { app } from "../../scripts/app.js";

const NODE_PREFIX = "FP8Engram.";
const PANEL = "fp8_engram_panel";
const MIN_PANEL_WIDTH = 360;
const MAX_PANEL_HEIGHT = 320;

function mib(bytes) {
  return `${(bytes / 2 ** 20).toFixed(bytes < 2 ** 24 ? 2 : 0)} MiB`;
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function renderSummary(summary) {
  const box = el("div", "fp8-engram-summary");
  const ratio = summary.bytes_bf16 ? summary.bytes_on_disk / summary.bytes_bf16 : 0;
  const lines = [
    `${summary.format}`,
    `${summary.layers_quantized}/${summary.layers_total} layers FP8`,
    `${mib(summary.bytes_on_disk)} on disk vs ${mib(summary.bytes_bf16)} bf16 (${(ratio * 100).toFixed(0)}%)`,
    `compute: ${summary.compute_path}`,
  ];
  for (const line of lines) box.append(el("div", "fp8-engram-line", line));
  return box;
}

function renderQuality(quality) {
  const box = el("div", "fp8-engram-quality");
  box.append(
    el("div", "fp8-engram-line", `${quality.granularity} ${quality.dtype}: ${quality.layers} layers quantized, ${quality.kept} kept`),
    el("div", "fp8-engram-line", `SQNR mean ${Number(quality.mean_sqnr_db).toFixed(1)} dB, min ${Number(quality.min_sqnr_db).toFixed(1)} dB`),
  );
  if (quality.worst_layer) box.append(el("div", "fp8-engram-line", `worst: ${quality.worst_layer}`));
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
  root.style.cssText = "font: 11px monospace; color: var(--input-text, #ddd); padding: 4px; overflow: auto; white-space: normal;";
  for (const summary of message.fp8_summary || []) root.append(renderSummary(summary));
  for (const quality of message.fp8_quality || []) root.append(renderQuality(quality));
  const hits = message.engram_hits || [];
  const maxStrength = Math.max(0, ...hits.flatMap((h) => (h.tokens || []).map((t) => t.strength || 0)));
  for (const entry of hits) root.append(renderHits(entry, maxStrength));
  for (const text of message.text || []) {
    const pre = el("pre", "fp8-engram-text", String(text));
    pre.style.cssText = "margin: 0; white-space: pre;";
    root.append(pre);
  }
  return root;
}

function showPanel(node, message) {
  const content = render(message);
  let widget = node.widgets?.find((w) => w.name === PANEL);
  if (!widget) {
    const holder = el("div", "fp8-engram-holder");
    widget = node.addDOMWidget(PANEL, "fp8_engram_panel", holder, {
      serialize: false,
      hideOnZoom: false,
      getMinHeight: () => Math.min(MAX_PANEL_HEIGHT, holder.scrollHeight + 8),
    });
    widget.fp8Holder = holder;
  }
  widget.fp8Holder.replaceChildren(content);
  widget.fp8Holder.dataset.nodeId = String(node.id);
  // Grow the node so the panel is readable without scrolling (never shrink what the user sized).
  const wanted = node.computeSize?.() ?? node.size;
  node.setSize?.([Math.max(node.size[0], MIN_PANEL_WIDTH, wanted[0]), Math.max(node.size[1], wanted[1])]);
  node.setDirtyCanvas?.(true, true);
}

app.registerExtension({
  name: "fp8_engram.core",

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
