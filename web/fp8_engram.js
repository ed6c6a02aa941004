// fp8-engram frontend extension: shows what the pack's nodes report after they run.
// Loaded by the ComfyUI frontend from /extensions/<pack folder>/fp8_engram.js.
import { app } from "../../scripts/app.js";

const NODE_PREFIX = "FP8Engram.";

app.registerExtension({
  name: "fp8_engram.core",

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!nodeData?.name?.startsWith(NODE_PREFIX)) return;
    // Keep what the node reported on its last run, so tests and the UI can read it back.
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      this.fp8EngramLastOutput = message;
    };
  },
});
