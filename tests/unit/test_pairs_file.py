"""engram/pairs.py: a training pairs file is read whole or refused, naming each broken line."""

from __future__ import annotations

import json

import pytest

from fp8_engram.engram.pairs import MAX_PAIR_LINE_BYTES, MAX_PAIR_TEXT_CHARS, read_pairs

pytestmark = pytest.mark.unit


def test_good_pairs_are_read_with_their_line_numbers(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "a cat", "target": "a dog"}) + "\n\n"
                    + json.dumps({"prompt": "a bird", "target_conditioning": "bird.safetensors"}) + "\n")
    pairs = read_pairs(str(path))
    assert [p["line"] for p in pairs] == [1, 3]
    assert pairs[1]["target_conditioning"] == "bird.safetensors"


def test_broken_lines_are_named_and_nothing_is_used(tmp_path):
    path = tmp_path / "pairs.jsonl"
    lines = [json.dumps({"prompt": "ok", "target": "ok"}), "{not json", json.dumps({"prompt": 3, "target": "x"}),
             json.dumps({"prompt": "x" * (MAX_PAIR_TEXT_CHARS + 1), "target": "y"}), "z" * (MAX_PAIR_LINE_BYTES + 10)]
    path.write_bytes("\n".join(lines).encode() + b"\n\xff\xfe\n")
    with pytest.raises(ValueError) as info:
        read_pairs(str(path))
    message = str(info.value)
    assert message.startswith("pairs.jsonl: 5 broken line(s)"), message
    for expected in ("line 2: not JSON", "line 3: needs a string \"prompt\"", f"line 4: \"prompt\" has {MAX_PAIR_TEXT_CHARS + 1}",
                     "line 5: longer than 64 KiB", "line 6: not UTF-8"):
        assert expected in message, (expected, message)


def test_an_empty_file_has_no_pairs_and_cancel_is_asked(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n" * 600)
    asked = []
    with pytest.raises(ValueError, match="empty.jsonl: no training pairs"):
        read_pairs(str(path), cancel=lambda: asked.append(1))
    assert len(asked) == 2  # every 256 lines
