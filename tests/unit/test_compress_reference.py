"""Tokenizer compression against DeepSeek's reference rule (issue 27, finding 1).

The reference (`CompressedTokenizer` in deepseek-ai/Engram) is written here independently of the pack,
with the `tokenizers` library's own normalizers: a token whose decoded text holds U+FFFD is keyed by
its raw token string, any other by its normalized text, or by the text itself when normalization
leaves nothing. The pack must put CLIP-L's and T5's ids into the same classes (two ids share a
compressed id exactly when they share a reference key), and multilingual prompts must keep distinct
texts apart. The legacy rule (`text-v1`) is measured too, to show the comparison can fail: it merges
every U+FFFD fragment (on CLIP-L '猫' and '犬' share rows).
"""

from __future__ import annotations

import collections
import logging

import pytest

from fp8_engram.engram.compress import RULE_TEXT_V1, compressed_vocab, normalize_key

pytestmark = pytest.mark.unit

logger = logging.getLogger(__name__)

PROMPTS = [
    "一只猫坐在窗台上", "一只犬坐在窗台上", "猫", "犬", "東京の夜景、ネオンの光", "水墨画の山と川",
    "고양이가 창가에 앉아 있다", "강아지가 창가에 앉아 있다", "서울의 밤거리",
    "แมวนั่งอยู่บนขอบหน้าต่าง", "สุนัขนั่งอยู่บนขอบหน้าต่าง", "ตลาดน้ำยามเช้า",
    "a cat 🐱 and a dog 🐶", "red heart ❤️ on snow ❄️", "family 👨‍👩‍👧 at the beach 🏖️", "🦩🪿🫎 rare emoji",
    "Ελληνικό ΦΩΣ", "café crème brûlée", "नमस्ते दुनिया",
]


@pytest.fixture(scope="module")
def reference_normalizer():
    tokenizers = pytest.importorskip("tokenizers")
    normalizers, regex = tokenizers.normalizers, tokenizers.Regex
    sentinel = "\ue000"
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(regex(r"[ \t\r\n]+"), " "), normalizers.Replace(regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " "),
    ])


def reference_ids(tokenizer, normalizer) -> list[int]:
    """The reference's compressed id of every token id (keys numbered in order of first appearance)."""
    index: dict[str, int] = {}
    out = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.convert_ids_to_tokens(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        out.append(index.setdefault(key, len(index)))
    return out


def ids_in_another_class(ours: list[int], reference: list[int]) -> list[int]:
    """Token ids whose class (the ids sharing its compressed id) differs between the two tables."""
    ours_n, ref_n, both_n = collections.Counter(ours), collections.Counter(reference), collections.Counter(zip(ours, reference))
    return [i for i, (a, b) in enumerate(zip(ours, reference)) if not ours_n[a] == ref_n[b] == both_n[(a, b)]]


@pytest.fixture(scope="module")
def tables(clip_tokenizer, t5_tokenizer, reference_normalizer):
    out = {}
    for name, tok in (("clip_l", clip_tokenizer), ("t5", t5_tokenizer)):
        out[name] = (tok, reference_ids(tok, reference_normalizer), compressed_vocab(tok), compressed_vocab(tok, RULE_TEXT_V1))
    return out


@pytest.mark.parametrize("name", ["clip_l", "t5"])
def test_whole_vocabulary_classes_match_the_reference(tables, name, record_property):
    tok, reference, current, legacy = tables[name]
    assert current.vocab_size == len(reference) == len(tok)
    differ = ids_in_another_class(current.table.tolist(), reference)
    differ_legacy = ids_in_another_class(legacy.table.tolist(), reference)
    record_property(f"{name}_ids_in_another_class", len(differ))
    record_property(f"{name}_ids_in_another_class_legacy", len(differ_legacy))
    logger.info("%s: %d of %d ids in another class than the reference's (legacy rule: %d)", name, len(differ), len(reference), len(differ_legacy))
    shown = [(i, tok.convert_ids_to_tokens(i), tok.decode([i])) for i in differ[:8]]
    assert not differ, f"{len(differ)} {name} ids are in another class than the reference's, e.g. {shown}"
    assert current.num_compressed == max(reference) + 1


def test_legacy_rule_is_measured_apart_from_the_reference(tables):
    # the comparison can fail: the legacy rule merges CLIP-L's U+FFFD fragments and differs on CLIP-L
    tok, reference, _, legacy = tables["clip_l"]
    assert ids_in_another_class(legacy.table.tolist(), reference)
    cat, dog = (tok("猫")["input_ids"][1:-1], tok("犬")["input_ids"][1:-1])
    assert cat != dog and legacy.compress(cat).tolist() == legacy.compress(dog).tolist()


@pytest.mark.parametrize("name", ["clip_l", "t5"])
def test_multilingual_prompts_keep_distinct_texts_apart(tables, name, record_property):
    tok, reference, current, _ = tables[name]
    pairs = set()
    ids_seen = set()
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        ids_seen.update(ids)
        pairs.update(zip(current.compress(ids).tolist(), (reference[i] for i in ids)))
    # a bijection between the pack's and the reference's compressed ids over every position of the set
    ours = collections.Counter(a for a, _ in pairs)
    theirs = collections.Counter(b for _, b in pairs)
    merged = sorted(a for a, n in ours.items() if n > 1)
    split = sorted(b for b, n in theirs.items() if n > 1)
    record_property(f"{name}_prompt_ids", len(ids_seen))
    assert not merged and not split, f"{name}: pack ids {merged[:5]} merge reference ids; reference ids {split[:5]} are split"
    # two prompts one character apart stay apart wherever the tokenizer itself tells them apart (T5 has
    # no CJK pieces: both are <unk> there, for the reference too)
    for a, b in (("一只猫坐在窗台上", "一只犬坐在窗台上"), ("고양이가 창가에 앉아 있다", "강아지가 창가에 앉아 있다"),
                 ("แมวนั่งอยู่บนขอบหน้าต่าง", "สุนัขนั่งอยู่บนขอบหน้าต่าง"), ("a cat 🐱 and a dog 🐶", "a cat 🐶 and a dog 🐱")):
        ids_a, ids_b = tok(a)["input_ids"], tok(b)["input_ids"]
        if ids_a != ids_b:
            assert current.compress(ids_a).tolist() != current.compress(ids_b).tolist(), (a, b)
    if name == "clip_l":
        assert tok("猫")["input_ids"] != tok("犬")["input_ids"]
        assert current.compress(tok("猫")["input_ids"]).tolist() != current.compress(tok("犬")["input_ids"]).tolist()


def test_normalize_key_matches_the_tokenizers_normalizer(reference_normalizer, record_property):
    # Every character assigned by Unicode 3.2, on its own, between letters and with a combining mark
    # after it: the plain-Python normalization must be the library's. Characters assigned since are
    # counted, not asserted: Python's Unicode tables and the library's are of other versions (the
    # vocabulary tests above show that CLIP-L and T5 hold none of those that differ).
    import unicodedata

    old, newer = [], 0
    for code in range(0x110000):
        ch = chr(code)
        if 0xD800 <= code < 0xE000:
            continue
        stable = unicodedata.ucd_3_2_0.category(ch) != "Cn"
        for text in ((ch, f"A{ch}b", f" {ch}\u0301 ") if stable else (f"A{ch}b",)):
            if normalize_key(text) != reference_normalizer.normalize_str(text):
                if stable:
                    old.append(text)
                else:
                    newer += 1
    record_property("newer_characters_normalized_otherwise", newer)
    logger.info("characters assigned after Unicode 3.2 that normalize otherwise than the library: %d", newer)
    assert not old, f"{len(old)} texts normalize otherwise than the tokenizers library, e.g. {old[:8]!r}"
    for text in ("", " ", "  \t", "\u0301", "\ufe0f", "ΑΣ", "İ", "\x1ca\x1c", "a\ue000b", "\ue000"):
        assert normalize_key(text) == reference_normalizer.normalize_str(text), repr(text)
