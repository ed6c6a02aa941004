"""Engram Text Encode vs plain CLIP text encoding, measured side by side in one run.

Loads ComfyUI's CLIP-L (the random tiny_clip_l test file, or any CLIP-L given with --clip) as an SD3
text encoder, builds an engram memory of at least 2^22 rows on N CPU ranks (EngramGroup), memorizes a
phrase, and times, interleaved:
  plain  = tokenize + encode_from_tokens_scheduled            (what CLIPTextEncode does)
  engram = tokenize (word ids) + encode + hash + fetch + inject (what Engram Text Encode does)
Prints a table and, as the last line, one JSON object with the figures. Target: engram/plain <= 1.1.

Usage: python bench/engram_encode.py [--ranks 2] [--rows-per-head 262144] [--dtype fp8|bf16] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rows-per-head", type=int, default=1 << 18)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--clip", type=Path, default=ROOT / ".host" / "cache" / "models" / "text_encoders" / "tiny_clip_l.safetensors")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(ROOT / "scripts"))
    sys.path.insert(0, str(ROOT / ".host" / "pkg"))
    from comfyhost import comfyui_root

    sys.path.insert(0, str(comfyui_root()))
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    import torch

    import comfy.sd
    from fp8_engram.engram.group import EngramGroup
    from fp8_engram.engram.memory import EngramMemory, make_config
    from fp8_engram.engram.streams import family_layout

    if not args.clip.exists():
        print(f"no CLIP file at {args.clip}: run scripts/tiny_models.py (or pass --clip)", file=sys.stderr)
        return 2
    clip = comfy.sd.load_clip(ckpt_paths=[str(args.clip)], clip_type=comfy.sd.CLIPType.SD3)
    tokenizers = {"l": clip.tokenizer.clip_l.tokenizer}
    layout = family_layout("sd3", encoders=["clip_l"])
    config, vocabs = make_config(layout, tokenizers, heads=args.heads, rows_per_head=args.rows_per_head)
    dtype = torch.float8_e4m3fn if args.dtype == "fp8" else torch.bfloat16
    store = EngramGroup(config.rows_per_layer(args.ranks), config.hidden, dtype, num_ranks=args.ranks, device="cpu")
    memory = EngramMemory(config, store, vocabs)
    try:
        def word_tokens(text):
            return clip.tokenize(text, return_word_ids=True)

        def strip(tokens):
            return {k: [[tuple(i[:2]) for i in chunk] for chunk in v] for k, v in tokens.items()}

        phrase, target = "glowing crystal apple", "rusty old bicycle"
        with torch.inference_mode():
            base = clip.encode_from_tokens_scheduled(strip(word_tokens(phrase)))[0][0]
            goal = clip.encode_from_tokens_scheduled(strip(word_tokens(target)))[0][0]
            memory.memorize(word_tokens(phrase), base, goal)

        prompt = "a photo of a glowing crystal apple on a wooden table, soft light, detailed"

        def plain():
            return clip.encode_from_tokens_scheduled(clip.tokenize(prompt))

        def engram():
            tokens = word_tokens(prompt)
            conds = clip.encode_from_tokens_scheduled(strip(tokens))
            return [[memory.apply(c, tokens), d] for c, d in conds]

        times = {"plain": [], "engram": []}
        with torch.inference_mode():
            plain(), engram()  # warm up
            for _ in range(args.repeats):
                for name, fn in (("plain", plain), ("engram", engram)):
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            moved = not torch.equal(engram()[0][0], plain()[0][0])
        plain_ms = statistics.median(times["plain"]) * 1e3
        engram_ms = statistics.median(times["engram"]) * 1e3
        rows = sum(store.rows_per_layer)
        table_mib = rows * config.hidden * dtype.itemsize / 2**20
        print(f"{'path':<10}{'median ms':>12}")
        print(f"{'plain':<10}{plain_ms:>12.2f}")
        print(f"{'engram':<10}{engram_ms:>12.2f}")
        print(f"table: {rows} rows x {config.hidden} {args.dtype} ({table_mib:.0f} MiB) on {args.ranks} CPU ranks; "
              f"ratio engram/plain {engram_ms / plain_ms:.3f} (target <= 1.1); memory changed the prompt: {moved}")
        print(json.dumps({
            "bench": "engram_encode", "ranks": args.ranks, "rows": rows, "hidden": config.hidden, "dtype": args.dtype,
            "entries": config.hashing.entries, "plain_ms": round(plain_ms, 3), "engram_ms": round(engram_ms, 3),
            "ratio": round(engram_ms / plain_ms, 4), "moved": moved,
        }))
    finally:
        memory.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
