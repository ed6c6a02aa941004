"""Tokenizer compression: map every token id of a tokenizer to a smaller set of "compressed" ids.

Engram hashes n-grams of *compressed* ids so that surface variants of one word ("Apple", " apple",
"APPLE", "apple</w>") fall into the same memory rows. Each token id gets a key; distinct keys are
numbered in order of first appearance over the ids 0, 1, 2, ... Two rules exist (`RULES`); a memory
records the one it was made with (memory.py) and is always read with that rule.

`deepseek-v2` (RULE_DEEPSEEK, what new memories use) is the rule of DeepSeek's Engram reference
(`CompressedTokenizer` in deepseek-ai/Engram):
- a token whose decoded text contains U+FFFD (a byte-level fragment of a CJK, Hangul or Thai
  character or of an emoji, which does not decode on its own) is keyed by its raw token string
  (`convert_ids_to_tokens`), so two different fragments never share a key;
- any other token is keyed by its decoded text normalized as the `tokenizers` library's normalizer
  sequence NFKC, NFD, StripAccents, Lowercase, "[ \\t\\r\\n]+" -> " ", Strip (a text that is exactly
  one space after the collapse stays " "). That library's StripAccents drops every character of
  Unicode category M (Mn, Mc, Me: so U+FE0F and Thai vowel signs too), its Lowercase lowers each
  character on its own (no final-sigma rule) and its Strip trims Unicode White_Space (Python's
  `str.isspace` also counts U+001C..U+001F); `normalize_key` reproduces that in plain Python, with
  Python's Unicode tables (`unicodedata`): every character assigned by Unicode 3.2 normalizes as
  the library does; of the characters assigned since, the two sets of tables disagree on a few
  hundred (443 with Python 3.11 and tokenizers 0.23: recent marks and letters), none of which is in
  CLIP's or T5's vocabulary;
- a token that normalizes to nothing (a lone combining mark, a control byte) is keyed by its raw
  decoded text, so such tokens stay apart from each other.
Raw token strings and normalized texts share one key space, as in the reference.

`text-v1` (RULE_TEXT_V1, the legacy rule of memories written before the compression was versioned)
keys every token by its normalized decoded text alone: NFKC, NFD, drop what `unicodedata.combining`
calls combining, lowercase, collapse every whitespace run, strip; an empty key of a whitespace token
(or of sentencepiece's lone U+2581, decoded to nothing) is " ". It merges all U+FFFD fragments into
one id (on CLIP-L 444 ids: '猫' and '犬' share rows) and is kept only so that such memories load and
answer as they did; see `legacy_key`.

Where the pack differs from the reference on purpose (outside this module's keys): the compressed
pad id is a fresh id, `num_compressed`, distinct from every token's (the reference pads with the
compressed id of the tokenizer's pad token); dead tokens (negative ids) are skipped by the hashing
rather than hashed; and the multipliers come from SplitMix64 (hashing.py), not numpy's generator.

This module never imports a tokenizer library. It takes a `Vocabulary` (decoded texts and raw token
strings), a list of decoded texts (enough when no text contains U+FFFD), or any tokenizer-like object
with `decode(list_of_ids)` and `convert_ids_to_tokens(list_of_ids)` (transformers tokenizers,
ComfyUI's `SDTokenizer.tokenizer`), from which `vocabulary` reads both.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import unicodedata
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

logger = logging.getLogger(__name__)

RULE_TEXT_V1 = "text-v1"
RULE_DEEPSEEK = "deepseek-v2"
RULES = (RULE_TEXT_V1, RULE_DEEPSEEK)
CURRENT_RULE = RULE_DEEPSEEK
LEGACY_RULE = RULE_TEXT_V1  # the rule of a memory file that records none

REPLACEMENT_CHAR = "\ufffd"
_SENTINEL = "\ue000"

_WHITESPACE_RUN = re.compile(r"\s+")
_REFERENCE_SPACE_RUN = re.compile(r"[ \t\r\n]+")
# Unicode White_Space, what Rust's char::is_whitespace (the `tokenizers` Strip) trims.
_WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"
# Markers that tokenizers use for "a space here" inside their raw token strings: sentencepiece's
# U+2581 and byte-level BPE's U+0120 (GPT-2 style). Only the legacy rule uses them.
_SPACE_MARKERS = ("\u2581", "\u0120")


def _check_rule(rule: str) -> str:
    if rule not in RULES:
        raise ValueError(f"unknown tokenizer compression rule {rule!r}; this pack knows {', '.join(RULES)}")
    return rule


def normalize_key(text: str) -> str:
    """The reference's normalization of one decoded text (may be empty; see the module docstring)."""
    key = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    key = "".join(ch.lower() for ch in key if not unicodedata.category(ch).startswith("M"))
    key = _REFERENCE_SPACE_RUN.sub(" ", key)
    # The reference guards a lone space from Strip with the private-use character U+E000 and turns every
    # U+E000 into a space afterwards, the ones the text held included; so does this.
    key = _SENTINEL if key == " " else key
    return key.strip(_WHITE_SPACE).replace(_SENTINEL, " ")


def reference_key(text: str, token: str | None) -> str:
    """The `deepseek-v2` key of a token from its decoded text and raw token string (needed only when
    the text holds U+FFFD)."""
    if REPLACEMENT_CHAR in text:
        if token is None:
            raise ValueError(f"a token decodes to {text!r}, which holds U+FFFD: its raw token string is needed "
                             "(pass a tokenizer with convert_ids_to_tokens, or a Vocabulary with tokens)")
        return token
    return normalize_key(text) or text


def _is_space_token(text: str) -> bool:
    return all(ch in _SPACE_MARKERS or ch.isspace() for ch in text)


def legacy_key(text: str) -> str:
    """The `text-v1` key of one decoded text (legacy memories only)."""
    key = unicodedata.normalize("NFKC", text)
    key = unicodedata.normalize("NFD", key)
    key = "".join(ch for ch in key if not unicodedata.combining(ch))
    key = key.lower()
    key = _WHITESPACE_RUN.sub(" ", key).strip()
    if not key and text and (text.isspace() or _is_space_token(text)):
        return " "
    return key


@dataclass(frozen=True)
class Vocabulary:
    """What compression reads of a tokenizer: `texts[i]` = decode([i]), `tokens[i]` = the raw token
    string of id i (None when the source gave no raw strings)."""

    texts: tuple[str, ...]
    tokens: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.tokens is not None and len(self.tokens) != len(self.texts):
            raise ValueError(f"a vocabulary of {len(self.texts)} decoded texts has {len(self.tokens)} raw tokens")
        for name, items in (("decoded text", self.texts), ("raw token", self.tokens or ())):
            for token_id, item in enumerate(items):
                if not isinstance(item, str):
                    raise TypeError(f"{name} of vocabulary entry {token_id} is {type(item).__name__}, expected str")

    def legacy_texts(self) -> list[str]:
        """The texts the `text-v1` rule keyed: a token that decodes to nothing but whose raw form is a
        space marker (sentencepiece's lone '▁') counts as ' ', as `decoded_vocab` always gave it."""
        if self.tokens is None:
            return list(self.texts)
        return [" " if not text and token and _is_space_token(token) else text for text, token in zip(self.texts, self.tokens)]


def vocab_fingerprint(vocab: Sequence[str]) -> str:
    """A stable hex digest of a decoded vocabulary (order matters): identifies the tokenizer. The
    `text-v1` fingerprint (of `Vocabulary.legacy_texts`)."""
    digest = hashlib.sha256()
    digest.update(str(len(vocab)).encode())
    for text in vocab:
        digest.update(b"\x00")
        digest.update(text.encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def reference_fingerprint(vocab: Vocabulary) -> str:
    """The `deepseek-v2` fingerprint: a digest of exactly what that rule reads, every decoded text and
    the raw token string of each text holding U+FFFD."""
    digest = hashlib.sha256()
    digest.update(f"{RULE_DEEPSEEK}:{len(vocab.texts)}".encode())
    for token_id, text in enumerate(vocab.texts):
        digest.update(b"\x00")
        digest.update(text.encode("utf-8", "surrogatepass"))
        if REPLACEMENT_CHAR in text and vocab.tokens is not None:
            digest.update(b"\x01")
            digest.update(vocab.tokens[token_id].encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


@dataclass(frozen=True)
class CompressedVocab:
    """The compression table of one tokenizer under one rule.

    `table[id]` is the compressed id (int64 tensor, shape [vocab_size]); `num_compressed` the number
    of distinct keys; `pad_id` (= num_compressed) is the id used for positions before the start of a
    sequence, distinct from every real compressed id; `fingerprint` identifies the vocabulary (as the
    rule reads it); `rule` is the compression rule.
    """

    table: torch.Tensor
    num_compressed: int
    fingerprint: str
    keys: tuple[str, ...] = field(repr=False)
    rule: str = CURRENT_RULE

    @property
    def vocab_size(self) -> int:
        return int(self.table.shape[0])

    @property
    def pad_id(self) -> int:
        return self.num_compressed

    def compress(self, ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Compressed ids of `ids` (int64). Negative ids stay -1 (dead); ids outside the vocabulary
        raise, naming the first offending id."""
        ids = torch.as_tensor(ids, dtype=torch.int64)
        if ids.numel() and int(ids.max()) >= self.vocab_size:
            raise ValueError(
                f"token id {int(ids.max())} is outside this tokenizer's vocabulary of {self.vocab_size} ids; "
                "the memory was built for another tokenizer"
            )
        out = self.table[ids.clamp(min=0)]
        return torch.where(ids < 0, torch.full_like(out, -1), out)


def _as_vocabulary(vocab: Vocabulary | Sequence[str]) -> Vocabulary:
    if isinstance(vocab, Vocabulary):
        return vocab
    for token_id, text in enumerate(vocab):
        if not isinstance(text, str):
            raise TypeError(f"vocabulary entry {token_id} is {type(text).__name__}, expected the decoded str")
    return Vocabulary(tuple(vocab))


def _fingerprint(vocab: Vocabulary, rule: str) -> str:
    return vocab_fingerprint(vocab.legacy_texts()) if rule == RULE_TEXT_V1 else reference_fingerprint(vocab)


def build_compressed_vocab(vocab: Vocabulary | Sequence[str], rule: str = CURRENT_RULE) -> CompressedVocab:
    """Compression table of a vocabulary (a `Vocabulary`, or the decoded texts: `vocab[i]` is the
    text of token id i) under `rule`."""
    _check_rule(rule)
    vocab = _as_vocabulary(vocab)
    if len(vocab.texts) == 0:
        raise ValueError("cannot build a compressed vocabulary from an empty vocabulary")
    if rule == RULE_TEXT_V1:
        keys = [legacy_key(text) for text in vocab.legacy_texts()]
    else:
        tokens = vocab.tokens if vocab.tokens is not None else (None,) * len(vocab.texts)
        keys = []
        for token_id, (text, token) in enumerate(zip(vocab.texts, tokens)):
            try:
                keys.append(reference_key(text, token))
            except ValueError as exc:
                raise ValueError(f"vocabulary entry {token_id}: {exc}") from None
    index: dict[str, int] = {}
    table = torch.empty(len(keys), dtype=torch.int64)
    for token_id, key in enumerate(keys):
        table[token_id] = index.setdefault(key, len(index))
    return CompressedVocab(table=table, num_compressed=len(index), fingerprint=_fingerprint(vocab, rule), keys=tuple(index), rule=rule)


def _vocab_size_of(tokenizer: Any) -> int:
    try:
        return len(tokenizer)
    except TypeError:
        pass
    if hasattr(tokenizer, "get_vocab"):
        vocab = tokenizer.get_vocab()
        return max(vocab.values()) + 1
    if hasattr(tokenizer, "vocab_size"):
        return int(tokenizer.vocab_size)
    raise TypeError(f"cannot tell the vocabulary size of {type(tokenizer).__name__}: it has no len(), get_vocab() or vocab_size")


def vocabulary(tokenizer: Any) -> Vocabulary:
    """Decoded texts and raw token strings of every id of a tokenizer-like object (needs `decode(ids)`;
    raw strings from `convert_ids_to_tokens(ids)` when it has one; size from `len()`, `get_vocab()`
    or `vocab_size`)."""
    if not callable(getattr(tokenizer, "decode", None)):
        raise TypeError(f"{type(tokenizer).__name__} has no decode(ids) method; pass the decoded vocabulary instead")
    size = _vocab_size_of(tokenizer)
    tokens = None
    if callable(getattr(tokenizer, "convert_ids_to_tokens", None)):
        tokens = tuple(tokenizer.convert_ids_to_tokens(list(range(size))))
    return Vocabulary(tuple(tokenizer.decode([token_id]) for token_id in range(size)), tokens)


def decoded_vocab(tokenizer: Any) -> list[str]:
    """The decoded texts the `text-v1` rule keys (see `Vocabulary.legacy_texts`)."""
    return vocabulary(tokenizer).legacy_texts()


_cache_lock = threading.Lock()
_by_fingerprint: dict[tuple[str, str], CompressedVocab] = {}
_by_tokenizer: "weakref.WeakKeyDictionary[Any, dict[str, CompressedVocab]]" = weakref.WeakKeyDictionary()
_vocab_of_tokenizer: "weakref.WeakKeyDictionary[Any, Vocabulary]" = weakref.WeakKeyDictionary()


def _tokenizer_cache(source: Any) -> tuple[dict[str, CompressedVocab] | None, Vocabulary | None]:
    with _cache_lock:
        try:
            return _by_tokenizer.get(source), _vocab_of_tokenizer.get(source)
        except TypeError:  # not weak-referenceable
            return None, None


def compressed_vocab(source: Any, rule: str = CURRENT_RULE) -> CompressedVocab:
    """The (cached) compression table under `rule` of a tokenizer-like object, a `Vocabulary` or a
    list of decoded texts.

    Tables are cached by (rule, fingerprint), and tokenizer objects additionally by identity, so each
    tokenizer is decoded once per process."""
    _check_rule(rule)
    is_vocab = isinstance(source, Vocabulary) or (isinstance(source, (list, tuple)) and all(isinstance(t, str) for t in source))
    if is_vocab:
        vocab = _as_vocabulary(source)
    else:
        by_rule, vocab = _tokenizer_cache(source)
        if by_rule is not None and rule in by_rule:
            return by_rule[rule]
        if vocab is None:
            vocab = vocabulary(source)
    fingerprint = _fingerprint(vocab, rule)
    with _cache_lock:
        result = _by_fingerprint.get((rule, fingerprint))
    if result is None:
        result = build_compressed_vocab(vocab, rule)
        logger.debug("compressed a vocabulary of %d ids into %d keys (rule %s)", len(vocab.texts), result.num_compressed, rule)
        with _cache_lock:
            result = _by_fingerprint.setdefault((rule, fingerprint), result)
    if not is_vocab:
        with _cache_lock:
            try:
                _vocab_of_tokenizer[source] = vocab
                _by_tokenizer.setdefault(source, {})[rule] = result
            except TypeError:
                pass
    return result
