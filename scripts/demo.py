"""The demo: a real ComfyUI with this pack draws the tiny world, in bf16 and in FP8, and an engram memory
teaches it a word.

    python scripts/demo.py [--serve] [--port 8188] [--out out/demo] [--seed 3]

Makes the tiny random models (scripts/tiny_models.py: the CLIP-L is the one the world was trained with),
unpacks the tiny world's trained models on the first run (scripts/tiny_world_cache.py, from their
committed weights; it trains them, about ten minutes, only when those are stale; later runs load them
from .host/tiny-world/), converts the MMDiT to FP8 with the pack's converter, starts ComfyUI with
the pack in custom_nodes/ and runs one workflow: every prompt of the world ("a red circle", ...) with
the bf16 model (stock Load Diffusion Model) and the FP8 one (Load FP8 Diffusion Model) at the same seed;
and "a lighthouse", a word the model never saw, without and with an engram memory (New Engram Memory on
2 CPU worker processes -> Engram Memorize "a lighthouse" -> "blue triangle" -> Engram Text Encode).
It prints what the judge (scripts/tiny_world.py) reads in every picture and the pixel PSNR of FP8
against bf16, and saves them side by side in one picture (out/demo/output/tiny_world_demo.png).
With --serve the server stays up so a person can open the UI.
"""

from __future__ import annotations

import argparse
import io
import logging
import math
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from comfyhost import ROOT, ComfyServer  # noqa: E402
from example_graphs import PHRASE, PROMPT, TARGET, TARGET_CLASS, prepare_inputs, world_comparison  # noqa: E402
import tiny_world as world  # noqa: E402

logger = logging.getLogger("demo")
PICTURE = "tiny_world_demo.png"


def psnr(a, b) -> float:
    import numpy as np

    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def read_image(client, history: dict, node_id: str):
    import numpy as np
    from PIL import Image

    image = history["outputs"][node_id]["images"][0]
    data = client.view(image["filename"], image.get("subfolder", ""), image.get("type", "output"))
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def compose(rows: list[tuple[str, list[tuple[object, str, bool | None]]]], path: Path, scale: int = 3) -> None:
    """One picture: per row a title and tiles (image, caption, judged right?) side by side."""
    from PIL import Image, ImageDraw

    tile = world.SIZE * scale
    pad, title_h, caption_h = 8, 16, 28
    cols = max(len(tiles) for _, tiles in rows)
    width = pad + cols * (tile + pad)
    height = pad + len(rows) * (title_h + tile + caption_h + pad)
    canvas = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    y = pad
    for title, tiles in rows:
        draw.text((pad, y), title, fill=(0, 0, 0))
        y += title_h
        for i, (image, caption, right) in enumerate(tiles):
            x = pad + i * (tile + pad)
            canvas.paste(Image.fromarray(image).resize((tile, tile), Image.NEAREST), (x, y))
            colour = (0, 110, 0) if right else (170, 0, 0) if right is False else (60, 60, 60)
            for j, line in enumerate(caption.split("\n")[:2]):
                draw.text((x, y + tile + 2 + 12 * j), line, fill=colour)
        y += tile + caption_h + pad
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help="keep the server running after the demo (Ctrl-C stops it)")
    parser.add_argument("--port", type=int, default=8188, help="port of the ComfyUI server (default 8188; 0 = any free)")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "demo", help="base directory of the demo's ComfyUI")
    parser.add_argument("--seed", type=int, default=3, help="sampling seed of every picture")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[demo] %(message)s")

    base = args.out.resolve()
    subprocess.run([sys.executable, str(ROOT / "scripts" / "tiny_models.py"), str(base / "models")], check=True)
    started = time.monotonic()
    report = prepare_inputs(base)
    logger.info("tiny world models ready in %.0f s (%s): trained in %.0f s (autoencoder %.0f s, reconstruction %.1f dB; "
                "diffusion %.0f s, final loss %.4f)", time.monotonic() - started, report["folder"], report["seconds"],
                report["autoencoder_seconds"], report["autoencoder_psnr_db"], report["diffusion_seconds"], report["diffusion_final_loss"])
    prompts = [world.prompt(c, s) for c, s in world.CLASSES]
    graph, saves = world_comparison(prompts, [args.seed], steer_seeds=[args.seed])

    server = ComfyServer(base_dir=base, port=args.port)
    server.start()
    try:
        client = server.client()
        logger.info("ComfyUI is up at %s (log: %s)", server.url, server.log_path)
        started = time.monotonic()
        history = client.run(graph)
        logger.info("the workflow (%d pictures) finished in %.1f s", len(saves), time.monotonic() - started)
        for node_id, output in history["outputs"].items():
            for summary in output.get("fp8_summary", []):
                logger.info(
                    "%s loaded %s: %s, %d/%d layers FP8, %.2f MiB on disk vs %.2f MiB as bf16, compute: %s",
                    node_id, summary.get("file"), summary["format"], summary["layers_quantized"], summary["layers_total"],
                    summary["bytes_on_disk"] / 2**20, summary["bytes_bf16"] / 2**20, summary["compute_path"],
                )
            for entry in output.get("engram_hits", []):
                hits = [f"{t['text']}({t['strength']:.2f})" for t in entry.get("tokens", []) if t.get("hit")]
                logger.info("%s: words of %r that hit the memory in %s: %s", node_id, PROMPT, entry.get("stream"), ", ".join(hits) or "none")
            for text in output.get("text", []):
                logger.info("%s reported: %s", node_id, text)

        images = {key: read_image(client, history, node_id) for key, node_id in saves.items()}
        rows = []
        right = {"bf16": 0, "fp8": 0}
        agree = 0
        print(f"\n{'prompt':<20} {'bf16 reads':<18} {'FP8 reads':<18} PSNR FP8 vs bf16")
        tiles = []
        for prompt in prompts:
            asked = world.parse_prompt(prompt)
            a, b = images[("bf16", prompt, args.seed)], images[("fp8", prompt, args.seed)]
            va, vb = world.judge(a), world.judge(b)
            right["bf16"] += va.reads(*asked)
            right["fp8"] += vb.reads(*asked)
            agree += va.label == vb.label
            db = psnr(a, b)
            print(f"{prompt:<20} {va.label:<18} {vb.label:<18} {db:.1f} dB")
            tiles.append((a, f"{prompt}\nbf16: {va.label}", va.reads(*asked)))
            tiles.append((b, f"FP8, PSNR {db:.1f} dB\nFP8: {vb.label}", vb.reads(*asked)))
        n = len(prompts)
        print(f"judge: bf16 drew {right['bf16']}/{n} prompts right, FP8 {right['fp8']}/{n}; FP8 drew bf16's class in {agree}/{n}")
        for start in range(0, len(tiles), 6):
            rows.append((f"bf16 (Load Diffusion Model) | FP8 (Load FP8 Diffusion Model), same prompt and seed {args.seed}; "
                         "caption: what the judge reads (green: what the prompt asks)" if start == 0 else "", tiles[start:start + 6]))

        plain, steered = images[("plain", PROMPT, args.seed)], images[("memory", PROMPT, args.seed)]
        vp, vs = world.judge(plain), world.judge(steered)
        print(f"\n{PROMPT!r} (a word the model never saw) without a memory: {vp.label}")
        print(f"{PROMPT!r} after Engram Memorize {PHRASE!r} -> {TARGET!r}: {vs.label}"
              f" ({'the memory steered it' if vs.reads(*TARGET_CLASS) else 'not steered'})")
        rows.append((f"{PROMPT!r}, a word the model never saw: without a memory | after Engram Memorize {PHRASE!r} -> {TARGET!r}", [
            (plain, f"{PROMPT}, no memory\nreads: {vp.label}", None),
            (steered, f"{PROMPT}, with the memory\nreads: {vs.label}", vs.reads(*TARGET_CLASS)),
        ]))
        picture = base / "output" / PICTURE
        compose(rows, picture)
        print(f"\nside by side: {picture}")
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
