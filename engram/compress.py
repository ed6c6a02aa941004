"""Tokenizer compression: map every token id of a tokenizer to a smaller set of "compressed" ids.

Engram hashes n-grams of *compressed* ids so that surface variants of one word ("Apple", " apple",
"APPLE", "apple</w>") fall into the same memory rows. The key of a token is its decoded text,
normalized as: NFKC, NFD, drop combining marks (accents), lowercase, collapse runs of whitespace into
one space, strip. A key that becomes empty although the token was whitespace is kept as a lone space
(so a whitespace token stays distinguishable from a token that decodes to nothing). Distinct keys are
numbered in order of first appearance over the ids 0, 1, 2, ...

This module never imports a tokenizer library: it takes the decoded vocabulary as a list of strings,
or any tokenizer-like object with a `decode(list_of_ids)` method (transformers tokenizers, ComfyUI's
`SDTokenizer.tokenizer`), from which `decoded_vocab` builds that list.
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

_WHITESPACE_RUN = re.compile(r"\s+")
# Markers that tokenizers use for "a space here" inside their raw token strings: sentencepiece's
# U+2581 and byte-level BPE's U+0120 (GPT-2 style). Only used to recognise whitespace tokens whose
# decoded text came back empty.
_SPACE_MARKERS = ("\u2581", "\u0120")


def normalize_key(text: str) -> str:
    """The compression key of one decoded token (see the module docstring for the rules)."""
    key = unicodedata.normalize("NFKC", text)
    key = unicodedata.normalize("NFD", key)
    key = "".join(ch for ch in key if not unicodedata.combining(ch))
    key = key.lower()
    key = _WHITESPACE_RUN.sub(" ", key).strip()
    if not key and text and (text.isspace() or all(ch in _SPACE_MARKERS or ch.isspace() for ch in text)):
        return " "
    return key


def vocab_fingerprint(vocab: Sequence[str]) -> str:
    """A stable hex digest of a decoded vocabulary (order matters): identifies the tokenizer."""
    digest = hashlib.sha256()
    digest.update(str(len(vocab)).encode())
    for text in vocab:
        digest.update(b"\x00")
        digest.update(text.encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


@dataclass(frozen=True)
class CompressedVocab:
    """The compression table of one tokenizer.

    `table[id]` is the compressed id (int64 tensor, shape [vocab_size]); `num_compressed` the number
    of distinct keys; `pad_id` (= num_compressed) is the id used for positions before the start of a
    sequence, distinct from every real compressed id; `fingerprint` identifies the decoded vocabulary.
    """

    table: torch.Tensor
    num_compressed: int
    fingerprint: str
    keys: tuple[str, ...] = field(repr=False)

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


def build_compressed_vocab(vocab: Sequence[str]) -> CompressedVocab:
    """Compression table from a decoded vocabulary (`vocab[i]` is the text of token id i)."""
    if len(vocab) == 0:
        raise ValueError("cannot build a compressed vocabulary from an empty vocabulary")
    index: dict[str, int] = {}
    table = torch.empty(len(vocab), dtype=torch.int64)
    for token_id, text in enumerate(vocab):
        if not isinstance(text, str):
            raise TypeError(f"vocabulary entry {token_id} is {type(text).__name__}, expected the decoded str")
        key = normalize_key(text)
        table[token_id] = index.setdefault(key, len(index))
    return CompressedVocab(table=table, num_compressed=len(index), fingerprint=vocab_fingerprint(vocab), keys=tuple(index))


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


def decoded_vocab(tokenizer: Any) -> list[str]:
    """Decode every id of a tokenizer-like object (needs `decode(ids)`; size from `len()`,
    `get_vocab()` or `vocab_size`). Tokens that decode to nothing but whose raw form is a space marker
    (sentencepiece's '▁') come back as ' ' so that they stay whitespace tokens."""
    if not callable(getattr(tokenizer, "decode", None)):
        raise TypeError(f"{type(tokenizer).__name__} has no decode(ids) method; pass the decoded vocabulary instead")
    size = _vocab_size_of(tokenizer)
    raw = None
    if callable(getattr(tokenizer, "convert_ids_to_tokens", None)):
        raw = tokenizer.convert_ids_to_tokens(list(range(size)))
    texts: list[str] = []
    for token_id in range(size):
        text = tokenizer.decode([token_id])
        if not text and raw is not None and raw[token_id] and all(ch in _SPACE_MARKERS or ch.isspace() for ch in raw[token_id]):
            text = " "
        texts.append(text)
    return texts


_cache_lock = threading.Lock()
_by_fingerprint: dict[str, CompressedVocab] = {}
_by_tokenizer: "weakref.WeakKeyDictionary[Any, CompressedVocab]" = weakref.WeakKeyDictionary()


def compressed_vocab(source: Any) -> CompressedVocab:
    """The (cached) compression table of a tokenizer-like object or of a decoded vocabulary list.

    Tables are cached by vocabulary fingerprint, and tokenizer objects additionally by identity, so
    each tokenizer is decoded once per process."""
    is_vocab = isinstance(source, (list, tuple)) and all(isinstance(t, str) for t in source)
    if not is_vocab:
        with _cache_lock:
            try:
                hit = _by_tokenizer.get(source)
            except TypeError:  # not weak-referenceable
                hit = None
        if hit is not None:
            return hit
        vocab = decoded_vocab(source)
    else:
        vocab = list(source)
    fingerprint = vocab_fingerprint(vocab)
    with _cache_lock:
        result = _by_fingerprint.get(fingerprint)
    if result is None:
        result = build_compressed_vocab(vocab)
        logger.debug("compressed a vocabulary of %d ids into %d keys", len(vocab), result.num_compressed)
        with _cache_lock:
            result = _by_fingerprint.setdefault(fingerprint, result)
    if not is_vocab:
        with _cache_lock:
            try:
                _by_tokenizer[source] = result
            except TypeError:
                pass
    return result
