"""The demo: a real ComfyUI with this pack runs the demo workflow on small models made here.

    python scripts/demo.py [--serve] [--port 8188] [--out out/demo]

Makes the tiny models (scripts/tiny_models.py), starts ComfyUI with the pack in custom_nodes/, runs
the demo workflow end to end (the tiny SD3 converted to FP8 by the pack's converter and loaded as FP8
-> an engram memory on 2 CPU worker processes memorizes a phrase -> the prompt is encoded with it ->
sample -> decode -> save image), and prints where the outputs are. With --serve the server stays up so a person can open the UI.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from comfyhost import ROOT, ComfyServer  # noqa: E402
from example_graphs import PROMPT, engram_memorize_and_use, prepare_inputs  # noqa: E402

logger = logging.getLogger("demo")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help="keep the server running after the demo (Ctrl-C stops it)")
    parser.add_argument("--port", type=int, default=8188, help="port of the ComfyUI server (default 8188; 0 = any free)")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "demo", help="base directory of the demo's ComfyUI")
    parser.add_argument("--prompt", default=PROMPT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[demo] %(message)s")

    base = args.out.resolve()
    subprocess.run([sys.executable, str(ROOT / "scripts" / "tiny_models.py"), str(base / "models")], check=True)
    prepare_inputs(base)
    server = ComfyServer(base_dir=base, port=args.port)
    server.start()
    try:
        client = server.client()
        logger.info("ComfyUI is up at %s (log: %s)", server.url, server.log_path)
        started = time.monotonic()
        history = client.run(engram_memorize_and_use(args.prompt))
        logger.info("demo workflow finished in %.1f s", time.monotonic() - started)
        for node_id, output in history["outputs"].items():
            for image in output.get("images", []):
                folder = base / image.get("type", "output") / image.get("subfolder", "")
                logger.info("%s image: %s", "saved" if image.get("type") == "output" else "preview", folder / image["filename"])
            for text in output.get("text", []):
                logger.info("node %s reported:\n%s", node_id, text)
            for summary in output.get("fp8_summary", []):
                logger.info(
                    "node %s loaded %s: %s, %d/%d layers FP8, %.2f MiB on disk vs %.2f MiB as bf16, compute: %s",
                    node_id, summary.get("file"), summary["format"], summary["layers_quantized"], summary["layers_total"],
                    summary["bytes_on_disk"] / 2**20, summary["bytes_bf16"] / 2**20, summary["compute_path"],
                )
            for entry in output.get("engram_hits", []):
                hits = [f"{t['text']}({t['strength']:.2f})" for t in entry.get("tokens", []) if t.get("hit")]
                logger.info("node %s: words that hit the memory in %s: %s", node_id, entry.get("stream"), ", ".join(hits) or "none")
        if args.serve:
            logger.info("serving at %s - open it in a browser; Ctrl-C stops the server", server.url)
            while server.process.poll() is None:
                time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
