"""A memory file written before the tokenizer compression was versioned still loads and answers as it did.

The file is made here as the writer of that time made it: metadata format version 1 with no
compression rule, row ids hashed under the old rule (every token keyed by its normalized decoded
text), written out in this test independently of the pack. After the change the pack must read it
with that rule (the same rows for the same prompt, '猫' and '犬' still sharing rows there, as they did),
never re-hash it under the new one, say in its summary that the rule is the legacy one, and keep
the rule when the memory is saved again. New memories record the new rule; a rule the pack does not
know, or a version-2 file without one, is refused naming hashing.compression.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata

import pytest
import torch

from fp8_engram.engram.hashing import HashConfig, NgramHasher
from fp8_engram.engram.memory import EngramMemory, EngramMemoryError, config_from_table_file, make_config
from fp8_engram.engram.store import LocalRowStore
from fp8_engram.engram.streams import family_layout
from fp8_engram.engram.table_file import write_table_file

pytestmark = pytest.mark.unit

WIDTH = 32


def old_rule(tok) -> tuple[list[int], str]:
    """(compressed id of every token id, vocabulary fingerprint) as the pack computed them before the
    compression rule was recorded (commit b2efe3f)."""
    raw = tok.convert_ids_to_tokens(list(range(len(tok))))
    spaceish = lambda s: all(ch in "\u2581\u0120" or ch.isspace() for ch in s)  # noqa: E731
    texts = []
    for token_id in range(len(tok)):
        text = tok.decode([token_id])
        texts.append(" " if not text and raw[token_id] and spaceish(raw[token_id]) else text)
    index: dict[str, int] = {}
    table = []
    for text in texts:
        key = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
        key = "".join(ch for ch in key if not unicodedata.combining(ch)).lower()
        key = re.sub(r"\s+", " ", key).strip()
        if not key and text and (text.isspace() or spaceish(text)):
            key = " "
        table.append(index.setdefault(key, len(index)))
    digest = hashlib.sha256(str(len(texts)).encode())
    for text in texts:
        digest.update(b"\x00" + text.encode("utf-8", "surrogatepass"))
    return table, digest.hexdigest()


def sd1_tokens(tok, text):
    ids = tok(text)["input_ids"][1:-1]
    chunk = [(49406, 1.0, 0)] + [(t, 1.0, 1 + i) for i, t in enumerate(ids)] + [(49407, 1.0, 0)]
    return {"l": [chunk + [(49407, 1.0, 0)] * (77 - len(chunk))]}


@pytest.fixture(scope="module")
def old_file(clip_tokenizer, tmp_path_factory):
    """(path, old compression table, hash config, tables) of a memory file as the old writer wrote it."""
    table, fingerprint = old_rule(clip_tokenizer)
    hashing = HashConfig(num_layers=1, vocab_sizes=(max(table) + 1,), max_order=3, heads=4, rows_per_head=1021, seed=5)
    metadata = {"format": "fp8-engram-memory", "format_version": 1, **hashing.to_dict(),
                "hidden": WIDTH, "gate": False, "fingerprints": {"l": fingerprint}}
    streams = {"family": "sd1", "streams": [{"name": "clip_l", "token_key": "l", "col_start": 0, "width": WIDTH}]}
    generator = torch.Generator().manual_seed(27)
    tables = [torch.randn(NgramHasher(hashing).rows_needed[0], WIDTH, generator=generator).to(torch.bfloat16)]
    path = tmp_path_factory.mktemp("legacy") / "old_memory.safetensors"
    write_table_file(path, tables, hashing=metadata, streams=streams)
    return path, table, hashing, tables


def expected_rows(tok, table, hashing, text) -> torch.Tensor:
    """int32 [77, entries]: the rows the old code addressed for `text` (BOS, EOS and padding dead)."""
    ids = [t for t, _, _ in sd1_tokens(tok, text)["l"][0]]
    words = [w for _, _, w in sd1_tokens(tok, text)["l"][0]]
    compressed = torch.tensor([table[t] if w else -1 for t, w in zip(ids, words)])
    return NgramHasher(hashing).hash_layer(0, compressed)


def load(path, tok) -> EngramMemory:
    config, _ = config_from_table_file(str(path))
    memory = EngramMemory(config, LocalRowStore.from_table_file(str(path)))
    memory.bind_tokenizers({"l": tok})
    return memory


@pytest.mark.parametrize("text", ["一只猫坐在窗台上", "一只犬坐在窗台上", "a glowing crystal apple", "고양이 🐱 แมว"])
def test_old_memory_file_answers_as_before(old_file, clip_tokenizer, text):
    path, table, hashing, tables = old_file
    memory = load(path, clip_tokenizer)
    tokens = sd1_tokens(clip_tokenizer, text)
    want = expected_rows(clip_tokenizer, table, hashing, text)
    got = memory.indices(memory.place(tokens))[0]
    assert torch.equal(got, want), f"{text!r}: the old memory is addressed at other rows than the old code addressed"
    _, values, fetched = memory.values(tokens)
    live = want >= 0
    rows = torch.zeros(*want.shape, WIDTH)
    rows[live] = tables[0][want[live].long()].float()
    assert torch.equal(fetched[0], rows)


def test_old_memory_keeps_its_rule_and_says_so(old_file, clip_tokenizer, tmp_path):
    path, table, hashing, _ = old_file
    memory = load(path, clip_tokenizer)
    assert memory.config.compression == "text-v1" and memory.config.legacy_compression
    assert "compression=text-v1 (legacy rule" in repr(memory)  # Load Engram Memory's summary shows the repr
    # the old rule's merge is kept for this memory: '猫' and '犬' share rows in it, as they always did
    cat = memory.indices(memory.place(sd1_tokens(clip_tokenizer, "猫")))
    dog = memory.indices(memory.place(sd1_tokens(clip_tokenizer, "犬")))
    assert torch.equal(cat, dog)
    # saved again, it records its rule and stays on it
    again = tmp_path / "again.safetensors"
    memory.save(str(again))
    from fp8_engram.engram.table_file import TableFile

    with TableFile(str(again)) as f:
        assert f.metadata["hashing"]["compression"] == "text-v1"
    reloaded = load(again, clip_tokenizer)
    text = "一只猫坐在窗台上"
    assert torch.equal(reloaded.indices(reloaded.place(sd1_tokens(clip_tokenizer, text)))[0],
                       expected_rows(clip_tokenizer, table, hashing, text))


def test_new_memory_records_the_new_rule_and_keeps_scripts_apart(clip_tokenizer, tmp_path):
    config, vocabs = make_config(family_layout("sd1", widths={"clip_l": WIDTH}), {"l": clip_tokenizer}, heads=4, rows_per_head=1021, seed=5)
    assert config.compression == "deepseek-v2"
    hashing, _ = config.to_metadata()
    assert hashing["compression"] == "deepseek-v2" and hashing["format_version"] == 2
    memory = EngramMemory(config, LocalRowStore(config.rows_per_layer(), WIDTH), vocabs)
    assert "legacy" not in repr(memory)
    cat = memory.indices(memory.place(sd1_tokens(clip_tokenizer, "猫")))
    dog = memory.indices(memory.place(sd1_tokens(clip_tokenizer, "犬")))
    assert not torch.equal(cat, dog)
    path = tmp_path / "new.safetensors"
    memory.save(str(path))
    assert config_from_table_file(str(path))[0].compression == "deepseek-v2"


@pytest.mark.parametrize("change, words", [
    ({"format_version": 2, "compression": "text-v9"}, "text-v9"),
    ({"format_version": 2, "compression": ["deepseek-v2"]}, "hashing.compression"),
    ({"format_version": 2}, "hashing.compression is missing"),
])
def test_unknown_or_missing_rule_is_refused(old_file, tmp_path, change, words):
    path, _, _, tables = old_file
    from fp8_engram.engram.table_file import TableFile

    with TableFile(str(path)) as f:
        metadata, streams = dict(f.metadata["hashing"]), f.metadata["streams"]
    bad = tmp_path / "bad.safetensors"
    write_table_file(bad, tables, hashing={**metadata, **change}, streams=streams)
    with pytest.raises(EngramMemoryError, match=re.escape(words)) as info:
        config_from_table_file(str(bad))
    assert str(bad) in str(info.value)
