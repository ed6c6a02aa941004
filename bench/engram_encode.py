"""Engram Text Encode vs plain CLIP text encoding, measured side by side in one run.

Loads ComfyUI's CLIP-L (the random tiny_clip_l test file, or any CLIP-L given with --clip) as an SD3
text encoder, builds an engram memory of at least 2^22 rows on N CPU ranks (EngramGroup), memorizes a
phrase, and times, interleaved:
  plain  = tokenize + encode_from_tokens_scheduled            (what CLIPTextEncode does)
  engram = tokenize (word ids) + encode + hash + fetch + inject (what Engram Text Encode does)
Prints a table and, as the last line, one JSON object with the figures. Target: engram/plain <= 1.1.

With `--placement host` the memory is on the host tier instead: a table file of at least `--table-gib`
GiB (default 4) of random rows is written to `--dir` (dropped from the page cache, so rows come from
the disk the first time), loaded as Load Engram Memory with placement host does (mapped, nothing read),
and Engram Text Encode runs as the node runs it: the lookup on a thread while the encoder runs. Every
round encodes another prompt (other rows), side by side:
  plain   = CLIP encode
  engram  = Engram Text Encode (lookup beside the encoder)
  serial  = encode, then the lookup (what hiding the lookup saves)
  control = plain, with an empty task on the lookup's thread (on a loaded machine, merely having a second
            thread changes how the encoder is scheduled; engram/control shows the lookup's own cost)
Target with a 4 GiB host table: engram/plain <= 1.05. The table file is deleted at the end.

Usage: python bench/engram_encode.py [--ranks 2] [--rows-per-head 262144] [--dtype fp8|bf16] [--repeats 20]
       python bench/engram_encode.py --placement host [--table-gib 4] [--dir /tmp] [--encoder-threads N]
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
    parser.add_argument("--placement", choices=["device", "host"], default="device", help="CPU ranks, or the host tier (a mapped table file)")
    parser.add_argument("--table-gib", type=float, default=4.0, help="host tier: table size in GiB (at least)")
    parser.add_argument("--dir", type=Path, default=None, help="host tier: where the table file is written (default: the temp folder)")
    parser.add_argument("--encoder-threads", type=int, default=None,
                        help="host tier: torch intra-op threads (default: torch's, one per core); fewer than the cores leaves one free for the lookup")
    parser.add_argument("--clip", type=Path, default=ROOT / ".host" / "cache" / "models" / "text_encoders" / "tiny_clip_l.safetensors")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(ROOT / "scripts"))
    sys.path.insert(0, str(ROOT / ".host" / "pkg"))
    from comfyhost import comfyui_root

    sys.path.insert(0, str(comfyui_root()))
    if args.placement == "host":
        return host_main(args)
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


ADJECTIVES = ["red", "old", "tiny", "shiny", "broken", "wooden", "golden", "quiet", "rusty", "frozen", "bright", "dusty",
              "gentle", "heavy", "hollow", "misty", "round", "sharp", "soft", "wild"]
NOUNS = ["table", "chair", "window", "river", "mountain", "garden", "street", "castle", "forest", "harbor", "bridge", "tower",
         "meadow", "cabin", "desert", "island", "valley", "market", "library", "station"]


def host_main(args) -> int:
    import os
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    import torch

    if args.encoder_threads:
        torch.set_num_threads(args.encoder_threads)
    import comfy.sd
    from fp8_engram.engram.host_tier import HostRowStore
    from fp8_engram.engram.rows import table_bytes
    from fp8_engram.engram.memory import EngramMemory, config_from_table_file, make_config
    from fp8_engram.engram.streams import family_layout

    sys.path.insert(0, str(ROOT / "bench"))
    from _engram_tables import drop_from_page_cache, write_random_table_file

    if not args.clip.exists():
        print(f"no CLIP file at {args.clip}: run scripts/tiny_models.py (or pass --clip)", file=sys.stderr)
        return 2
    clip = comfy.sd.load_clip(ckpt_paths=[str(args.clip)], clip_type=comfy.sd.CLIPType.SD3)
    tokenizers = {"l": clip.tokenizer.clip_l.tokenizer}
    layout = family_layout("sd3", encoders=["clip_l"])
    dtype = torch.float8_e4m3fn if args.dtype == "fp8" else torch.bfloat16
    probe, _ = make_config(layout, tokenizers, heads=args.heads, rows_per_head=16)
    row_bytes = table_bytes([1], probe.hidden, dtype)
    rows_per_head = -(-int(args.table_gib * 2**30) // (row_bytes * probe.hashing.entries))
    config, vocabs = make_config(layout, tokenizers, heads=args.heads, rows_per_head=rows_per_head)
    hashing, streams = config.to_metadata()
    folder = str(args.dir) if args.dir else tempfile.gettempdir()
    path = os.path.join(folder, f"engram_encode_host_{os.getpid()}.safetensors")
    memory = None
    try:
        start = time.perf_counter()
        size = write_random_table_file(path, config.rows_per_layer(1), config.hidden, dtype, hashing=hashing, streams=streams)
        write_s = time.perf_counter() - start
        drop_from_page_cache(path)
        start = time.perf_counter()
        loaded, _ = config_from_table_file(path)  # what Load Engram Memory does with placement host
        memory = EngramMemory(loaded, HostRowStore.from_table_file(path), vocabs)
        load_s = time.perf_counter() - start

        def word_tokens(text):
            return clip.tokenize(text, return_word_ids=True)

        def strip(tokens):
            return {k: [[tuple(i[:2]) for i in chunk] for chunk in v] for k, v in tokens.items()}

        phrase, target = "glowing crystal apple", "rusty old bicycle"
        with torch.inference_mode():
            base = clip.encode_from_tokens_scheduled(strip(word_tokens(phrase)))[0][0]
            goal = clip.encode_from_tokens_scheduled(strip(word_tokens(target)))[0][0]
            memory.memorize(word_tokens(phrase), base, goal)

        def prompt(i: int) -> str:
            return f"a photo of a glowing crystal apple on a {ADJECTIVES[i % 20]} {NOUNS[(7 * i) % 20]}, {ADJECTIVES[(3 * i + 5) % 20]} light"

        def plain(text):
            return clip.encode_from_tokens_scheduled(clip.tokenize(text))

        def engram(text):  # Engram Text Encode's own path
            tokens = word_tokens(text)
            conds, looked_up = memory.lookup_beside(tokens, lambda: clip.encode_from_tokens_scheduled(strip(tokens)))
            return [[memory.apply(c, tokens, looked_up=looked_up), d] for c, d in conds]

        def serial(text):
            tokens = word_tokens(text)
            conds = clip.encode_from_tokens_scheduled(strip(tokens))
            looked_up = memory.values(tokens)
            return [[memory.apply(c, tokens, looked_up=looked_up), d] for c, d in conds]

        side = ThreadPoolExecutor(max_workers=1)

        def control(text):
            pending = side.submit(lambda: None)
            out = plain(text)
            pending.result()
            return out

        fns = {"plain": plain, "engram": engram, "serial": serial, "control": control}
        times = {name: [] for name in fns}
        lookups = []
        with torch.inference_mode():
            for name, fn in fns.items():
                fn(prompt(10_000))  # warm up (the encoder, the thread)
            for i in range(args.repeats):
                text = prompt(i)
                order = list(fns)[i % len(fns):] + list(fns)[:i % len(fns)]
                for name in order:
                    start = time.perf_counter()
                    fn_out = fns[name](text)
                    times[name].append(time.perf_counter() - start)
                start = time.perf_counter()
                memory.values(word_tokens(prompt(i + 1000)))  # the lookup alone, on rows not yet read
                lookups.append(time.perf_counter() - start)
            moved = not torch.equal(engram(prompt(0))[0][0], plain(prompt(0))[0][0])
        del fn_out
        med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
        lookup_ms = statistics.median(lookups) * 1e3
        # Per round (same prompt, back to back): robust to the machine's load drifting between rounds.
        paired = statistics.median(e / p for e, p in zip(times["engram"], times["plain"]))
        paired_control = statistics.median(e / c for e, c in zip(times["engram"], times["control"]))
        rows = sum(memory.store.rows_per_layer)
        print(f"{'path':<10}{'median ms':>12}")
        for name in fns:
            print(f"{name:<10}{med[name]:>12.2f}")
        print(f"{'lookup':<10}{lookup_ms:>12.2f}  (alone, cold rows)")
        print(f"host table: {rows} rows x {config.hidden} {args.dtype} = {size / 2**30:.2f} GiB file (written in {write_s:.1f} s); "
              f"Load Engram Memory (placement host) took {load_s * 1e3:.1f} ms")
        print(f"engram/plain {med['engram'] / med['plain']:.4f} (target <= 1.05); serial/plain {med['serial'] / med['plain']:.4f}; "
              f"engram/control {med['engram'] / med['control']:.4f}; per-round medians: engram/plain {paired:.4f}, "
              f"engram/control {paired_control:.4f}; lookup alone / plain {lookup_ms / med['plain']:.4f}; "
              f"memory changed the prompt: {moved}")
        print(json.dumps({
            "bench": "engram_encode", "placement": "host", "rows": rows, "hidden": config.hidden, "dtype": args.dtype,
            "table_gib": round(size / 2**30, 3), "entries": config.hashing.entries, "load_ms": round(load_s * 1e3, 2),
            "plain_ms": round(med["plain"], 3), "engram_ms": round(med["engram"], 3), "serial_ms": round(med["serial"], 3),
            "lookup_ms": round(lookup_ms, 3), "ratio": round(med["engram"] / med["plain"], 4),
            "serial_ratio": round(med["serial"] / med["plain"], 4), "control_ms": round(med["control"], 3),
            "engram_over_control": round(med["engram"] / med["control"], 4), "paired_ratio": round(paired, 4),
            "paired_over_control": round(paired_control, 4), "lookup_over_plain": round(lookup_ms / med["plain"], 5), "target_ratio": 1.05,
            "repeats": args.repeats, "threads": torch.get_num_threads(), "cores": os.cpu_count(), "moved": moved,
        }))
    finally:
        if memory is not None:
            memory.close()
        if os.path.exists(path):
            os.unlink(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
