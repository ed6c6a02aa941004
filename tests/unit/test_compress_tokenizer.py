"""Tokenizer compression: surface variants of a word share one compressed id (real CLIP tokenizer)."""


import pytest
import torch

from fp8_engram.engram.compress import (RULE_TEXT_V1, Vocabulary, build_compressed_vocab, compressed_vocab, decoded_vocab,
                                        legacy_key, normalize_key, reference_key, vocabulary)

pytestmark = pytest.mark.unit



def test_normalize_key_rules():
    assert normalize_key("Apple") == "apple"
    assert normalize_key(" APPLE\t") == "apple"
    assert normalize_key("Café") == "cafe"  # accent stripped
    assert normalize_key("ﬁsh") == "fish"  # NFKC ligature
    assert normalize_key("Ａｐｐｌｅ") == "apple"  # full-width forms
    assert normalize_key("new \n  york") == "new york"  # whitespace runs collapse
    assert normalize_key("   ") == " "  # whitespace token keeps a lone space
    assert normalize_key("") == ""
    assert normalize_key("\u0301") == ""  # a lone combining mark is not whitespace
    assert legacy_key("\u0301") == "" and legacy_key("   ") == " " and legacy_key("Café") == "cafe"


def test_reference_key_rules():
    assert reference_key("\u0301", None) == "\u0301"  # normalization leaves nothing: the raw decoded text
    assert reference_key("\x00", None) == "\x00"
    assert reference_key("\ufe0f", None) == "\ufe0f" and normalize_key("a\ufe0f") == "a"  # category Mn is stripped
    assert reference_key("\ufffd", "çĮ«") == "çĮ«"  # a byte fragment: its raw token string
    assert reference_key("\ufffd", "çĬ¬") != reference_key("\ufffd", "çĮ«")
    with pytest.raises(ValueError, match="raw token string"):
        reference_key("\ufffd", None)


def test_ids_numbered_in_order_of_first_appearance():
    vocab = ["b", "A", "a", " B", "c", "  ", "\t"]
    cv = build_compressed_vocab(vocab)
    assert cv.table.tolist() == [0, 1, 1, 0, 2, 3, 3]
    assert cv.num_compressed == 4
    assert cv.keys == ("b", "a", "c", " ")
    assert cv.pad_id == 4
    assert cv.compress([3, -1, 4]).tolist() == [0, -1, 2]
    with pytest.raises(ValueError, match="outside this tokenizer's vocabulary"):
        cv.compress([7])


def test_clip_variants_share_an_id(clip_tokenizer):
    cv = compressed_vocab(clip_tokenizer)
    assert cv.vocab_size == len(clip_tokenizer)
    assert cv.num_compressed < cv.vocab_size  # "apple" (end of word) and "apple" (prefix) merge, among others
    ids = {text: clip_tokenizer(text)["input_ids"][1:-1] for text in ["Apple", " apple", "APPLE", "apple"]}
    assert all(len(v) == 1 for v in ids.values())
    compressed = {text: int(cv.compress(v)[0]) for text, v in ids.items()}
    assert len(set(compressed.values())) == 1, compressed
    # the end-of-word form and the word-piece form of the same letters share an id
    vocab = clip_tokenizer.get_vocab()
    assert cv.table[vocab["apple</w>"]] == cv.table[vocab["apple"]]
    assert cv.table[vocab["apple</w>"]] != cv.table[vocab["pear</w>"]]


def test_t5_case_variants_share_an_id(t5_tokenizer):
    cv = compressed_vocab(t5_tokenizer)
    apple = t5_tokenizer("Apple")["input_ids"][0]
    apple_lower = t5_tokenizer("apple")["input_ids"][0]
    assert apple != apple_lower
    assert cv.table[apple] == cv.table[apple_lower]
    # the lone "▁" piece decodes to nothing but stays a whitespace token
    space_piece = t5_tokenizer.convert_tokens_to_ids("\u2581")
    legacy = compressed_vocab(t5_tokenizer, RULE_TEXT_V1)
    assert legacy.keys[int(legacy.table[space_piece])] == " "
    # under the reference's rule it is keyed by its decoded text (nothing), a class of its own
    assert cv.keys[int(cv.table[space_piece])] == "" and int((cv.table == cv.table[space_piece]).sum()) == 1


def test_cache_by_tokenizer_and_by_fingerprint(clip_tokenizer):
    first = compressed_vocab(clip_tokenizer)
    assert compressed_vocab(clip_tokenizer) is first
    from_list = compressed_vocab(vocabulary(clip_tokenizer))
    assert from_list is first
    # decoded texts alone cannot tell CLIP's byte fragments apart under the reference's rule; the legacy
    # rule keys only the decoded texts, as it always did
    with pytest.raises(ValueError, match="U\\+FFFD"):
        compressed_vocab(decoded_vocab(clip_tokenizer))
    assert compressed_vocab(decoded_vocab(clip_tokenizer), RULE_TEXT_V1) is compressed_vocab(clip_tokenizer, RULE_TEXT_V1)
    other = compressed_vocab(["x", "y"])
    assert other.fingerprint != first.fingerprint
    assert torch.equal(first.table, from_list.table)


def test_object_without_decode_is_refused():
    with pytest.raises(TypeError, match="decode"):
        compressed_vocab(object())
    with pytest.raises(ValueError, match="unknown tokenizer compression rule"):
        compressed_vocab(["a"], "text-v9")
    with pytest.raises(ValueError, match="raw tokens"):
        Vocabulary(("a", "b"), ("a",))
