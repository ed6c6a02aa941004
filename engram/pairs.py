"""Training pairs files (JSONL, one pair per line), read streaming and bounded: each line a
{"prompt": str, "target": str} or {"prompt": str, "target_conditioning": file}. A broken line is named by
its number and why; nothing of a file with a broken line is used."""

from __future__ import annotations

import json
import os

# What one line of a pairs file may hold. Prompts are text-encoder prompts: a few hundred characters
# in practice; the bound keeps a runaway line (a whole book on one line) from being read, tokenized and
# encoded whole, which would hold the server for minutes at gigabytes of memory.
MAX_PAIR_TEXT_CHARS = 4096
MAX_PAIR_LINE_BYTES = 64 * 1024
_READ_CHECK_LINES = 256  # lines read between two calls of `cancel` (the caller's cancel check)


def pair_lines(f, cancel):
    """(line number, bytes or None when the line is longer than MAX_PAIR_LINE_BYTES) for every line of
    the binary file `f`; an overlong line is skipped in bounded pieces, never held whole."""
    number = 0
    while True:
        line = f.readline(MAX_PAIR_LINE_BYTES + 1)
        if not line:
            return
        number += 1
        if number % _READ_CHECK_LINES == 0:
            cancel()
        if len(line) > MAX_PAIR_LINE_BYTES and not line.endswith(b"\n"):
            while line and not line.endswith(b"\n"):  # the rest of the line, piece by piece
                line = f.readline(1 << 20)
                cancel()
            yield number, None
            continue
        yield number, line


def read_pairs(path: str, cancel=lambda: None) -> list[dict]:
    """Lines of a JSONL file: {"prompt": str, "target": str} or {"prompt": str, "target_conditioning": file}.
    Streams the file; `cancel()` is called as it goes (it raises to stop)."""
    pairs, errors, broken = [], [], 0

    def broken_line(message: str) -> None:
        nonlocal broken
        broken += 1
        if len(errors) < 20:
            errors.append(message)

    with open(path, "rb") as f:
        for number, raw in pair_lines(f, cancel):
            if raw is None:
                broken_line(f"line {number}: longer than {MAX_PAIR_LINE_BYTES // 1024} KiB (a pair's texts may hold "
                            f"{MAX_PAIR_TEXT_CHARS} characters each)")
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                broken_line(f"line {number}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})")
                continue
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                broken_line(f"line {number}: not JSON ({exc.msg})")
                continue
            except RecursionError:
                broken_line(f"line {number}: JSON nested too deeply to read (a pair is one flat object)")
                continue
            except ValueError as exc:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
                broken_line(f"line {number}: JSON this reader cannot take ({str(exc).split(';')[0]})")
                continue
            if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
                broken_line(f"line {number}: needs a string \"prompt\"")
                continue
            if not isinstance(item.get("target"), str) and not isinstance(item.get("target_conditioning"), str):
                broken_line(f"line {number}: needs a string \"target\" or \"target_conditioning\" (a .safetensors file with key \"cond\")")
                continue
            long = [k for k in ("prompt", "target") if isinstance(item.get(k), str) and len(item[k]) > MAX_PAIR_TEXT_CHARS]
            if long:
                broken_line(f"line {number}: \"{long[0]}\" has {len(item[long[0]])} characters, more than the "
                            f"{MAX_PAIR_TEXT_CHARS} a pair may hold")
                continue
            item["line"] = number
            pairs.append(item)
    name = os.path.basename(path)
    if broken:
        more = f"; and {broken - len(errors)} more" if broken > len(errors) else ""
        raise ValueError(f"{name}: {broken} broken line(s): " + "; ".join(errors) + more)
    if not pairs:
        raise ValueError(f"{name}: no training pairs")
    return pairs
