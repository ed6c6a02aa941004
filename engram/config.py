"""A memory's settings (MemoryConfig): stream layout, hashing, row width, gate, tokenizer fingerprints
and compression rule; how they are made for a text encoder's tokenizers (`make_config`) and read back,
bounded, from a table file's metadata (`config_from_table_file`)."""

from __future__ import annotations

import reprlib
from dataclasses import dataclass, field
from typing import Any, Mapping

from .compress import CURRENT_RULE, LEGACY_RULE, RULES, CompressedVocab, compressed_vocab
from .errors import EngramMemoryError
from .hashing import HashConfig, NgramHasher
from .streams import StreamLayout

MEMORY_FORMAT = "fp8-engram-memory"
# Version 2 records the tokenizer compression rule (hashing.compression). A version-1 file records none:
# it was hashed under the legacy rule (compress.LEGACY_RULE, "text-v1") and is read with that rule, never
# re-hashed under the current one.
MEMORY_FORMAT_VERSION = 2


# Bounds of the stream metadata a table file may carry (the hashing's are HASH_LIMITS in hashing.py).
MAX_HIDDEN = 1 << 16  # row width; T5-XXL's 4096 is the widest in use
MAX_STREAMS = 8
MAX_COLUMN = 1 << 20


def _shown(value: Any) -> str:
    """A short printable form of a metadata value of any size."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"a {value.bit_length()}-bit integer"
    text = _SHORT.repr(value)  # bounded: never the whole of a 100000-item list
    text = text if len(text) <= 60 else text[:57] + "..."
    if isinstance(value, (list, tuple, dict)) and len(value) > _SHORT.maxlist:
        text += f" ({len(value)} items)"
    return text


_SHORT = reprlib.Repr()
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = 4
_SHORT.maxstring = _SHORT.maxother = 40
_SHORT.maxlevel = 3


def _layout_from_metadata(streams: Mapping[str, Any]) -> StreamLayout:
    """StreamLayout.from_dict with every value checked first (ValueError naming the key)."""
    items = streams["streams"]
    if not isinstance(items, list) or not 1 <= len(items) <= MAX_STREAMS:
        raise ValueError(f"streams.streams must be a list of 1..{MAX_STREAMS} streams, got {_shown(items)}")
    if not isinstance(streams["family"], str):
        raise ValueError(f"streams.family must be a string, got {_shown(streams['family'])}")
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise ValueError(f"streams.streams[{i}] must be an object, got {_shown(item)}")
        for key in ("name", "token_key"):
            if not isinstance(item[key], str):
                raise ValueError(f"streams.streams[{i}].{key} must be a string, got {_shown(item[key])}")
        for key, low, high in (("col_start", 0, MAX_COLUMN), ("width", 1, MAX_HIDDEN)):
            value = item[key]
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"streams.streams[{i}].{key} must be an integer in {low}..{high}, got {_shown(value)}")
    return StreamLayout.from_dict(streams)


@dataclass(frozen=True)
class MemoryConfig:
    layout: StreamLayout
    hashing: HashConfig
    hidden: int
    fingerprints: dict[str, str] = field(default_factory=dict)  # token_key -> vocab fingerprint
    gate: bool = False
    compression: str = CURRENT_RULE  # the tokenizer compression rule (compress.RULES) the rows were hashed under

    def __post_init__(self) -> None:
        if self.compression not in RULES:
            raise EngramMemoryError(f"unknown tokenizer compression rule {self.compression!r}; this pack knows {', '.join(RULES)}")
        if self.hashing.num_layers != len(self.layout.streams):
            raise EngramMemoryError(
                f"hashing has {self.hashing.num_layers} layers but the layout has {len(self.layout.streams)} streams"
            )
        for s in self.layout.streams:
            if s.width > self.hidden:
                raise EngramMemoryError(f"stream {s.name} is {s.width} wide, wider than the memory rows ({self.hidden})")

    def to_metadata(self) -> tuple[dict, dict]:
        """(hashing, streams) JSON objects for the table file."""
        hashing = {
            "format": MEMORY_FORMAT,
            "format_version": MEMORY_FORMAT_VERSION,
            **self.hashing.to_dict(),
            "hidden": self.hidden,
            "gate": self.gate,
            "fingerprints": dict(self.fingerprints),
            "compression": self.compression,
        }
        return hashing, self.layout.to_dict()

    @property
    def legacy_compression(self) -> bool:
        """Whether the memory was hashed under the legacy compression rule (CJK, Hangul, Thai and emoji
        byte fragments share one compressed id there)."""
        return self.compression == LEGACY_RULE

    @classmethod
    def from_metadata(cls, hashing: Mapping[str, Any] | None, streams: Mapping[str, Any] | None, source: str = "table file") -> "MemoryConfig":
        """The config stored in a table file's metadata. Every value is type- and range-checked before
        anything is computed from it; a bad one raises EngramMemoryError naming `source` and the key."""
        if not isinstance(hashing, Mapping) or hashing.get("format") != MEMORY_FORMAT:
            raise EngramMemoryError(f"{source}: no engram memory metadata (expected hashing.format = {MEMORY_FORMAT!r})")
        version = hashing.get("format_version", -1)
        if isinstance(version, bool) or not isinstance(version, int):
            raise EngramMemoryError(f"{source}: bad engram memory metadata: hashing.format_version must be an integer, got {_shown(version)}")
        if version > MEMORY_FORMAT_VERSION:
            raise EngramMemoryError(f"{source}: memory format version (hashing.format_version) {_shown(version)} is newer than this pack reads")
        if not isinstance(streams, Mapping):
            raise EngramMemoryError(f"{source}: no stream layout in the metadata")
        compression = _compression_from_metadata(hashing, version, source)
        try:
            hash_config = HashConfig.from_dict(hashing)
        except KeyError as exc:
            raise EngramMemoryError(f"{source}: bad engram memory metadata: hashing.{exc.args[0]} is missing") from exc
        except (TypeError, ValueError) as exc:
            raise EngramMemoryError(f"{source}: bad engram memory metadata: hashing.{exc}") from exc
        hidden = hashing.get("hidden")
        if isinstance(hidden, bool) or not isinstance(hidden, int) or not 1 <= hidden <= MAX_HIDDEN:
            raise EngramMemoryError(f"{source}: bad engram memory metadata: hashing.hidden must be an integer in 1..{MAX_HIDDEN}, got {_shown(hidden)}")
        fingerprints = hashing.get("fingerprints", {})
        if not isinstance(fingerprints, Mapping) or len(fingerprints) > MAX_STREAMS:
            raise EngramMemoryError(f"{source}: bad engram memory metadata: hashing.fingerprints must be an object of at most "
                                    f"{MAX_STREAMS} entries, got {_shown(fingerprints)}")
        try:
            layout = _layout_from_metadata(streams)
            return cls(
                layout=layout,
                hashing=hash_config,
                hidden=hidden,
                fingerprints={str(k): str(v) for k, v in fingerprints.items()},
                gate=bool(hashing.get("gate", False)),
                compression=compression,
            )
        except KeyError as exc:
            raise EngramMemoryError(f"{source}: bad engram memory metadata: streams: {exc.args[0]} is missing") from exc
        except (TypeError, ValueError) as exc:
            raise EngramMemoryError(f"{source}: bad engram memory metadata: {exc}") from exc

    def rows_per_layer(self, num_ranks: int = 1) -> list[int]:
        """Global rows per layer: what the hashing needs, rounded up to a multiple of num_ranks."""
        needed = NgramHasher(self.hashing).rows_needed
        return [-(-n // num_ranks) * num_ranks for n in needed]


def _compression_from_metadata(hashing: Mapping[str, Any], version: int, source: str) -> str:
    """The compression rule a memory's metadata records: a version-1 file (none recorded) is the legacy
    rule's; a rule this pack does not know is refused (the file is never re-hashed under another rule)."""
    if "compression" not in hashing:
        if version >= 2:
            raise EngramMemoryError(f"{source}: bad engram memory metadata: hashing.compression is missing "
                                    f"(a format-version-{version} memory records its tokenizer compression rule)")
        return LEGACY_RULE
    rule = hashing["compression"]
    if rule not in RULES:
        raise EngramMemoryError(f"{source}: the memory was hashed under tokenizer compression rule "
                                f"(hashing.compression) {_shown(rule)}, which this pack does not know (it knows "
                                f"{', '.join(RULES)}); load it with the pack version that wrote it")
    return rule


def config_from_table_file(path: str) -> tuple[MemoryConfig, dict]:
    """(memory config, geometry) of a table file; raises TableFileError/EngramMemoryError naming the file."""
    from .table_file import TableFile

    with TableFile(path) as f:
        meta = f.metadata
        rows_in_file = list(f.rows_per_layer)  # checked against the file's size by TableFile
    config = MemoryConfig.from_metadata(meta.get("hashing"), meta.get("streams"), source=str(path))
    geometry = meta.get("geometry") or {}
    if int(geometry.get("hidden", config.hidden)) != config.hidden:
        raise EngramMemoryError(f"{path}: rows are {geometry.get('hidden')} wide but the memory metadata says {config.hidden}")
    # The hashing decides how many rows the tables get; the file must hold them (its geometry is checked
    # against its size by TableFile), so a file cannot make a loader allocate more than it stores.
    if len(rows_in_file) != config.hashing.num_layers:
        raise EngramMemoryError(f"{path}: the memory metadata (hashing.num_layers) says {config.hashing.num_layers} layers, "
                                f"the file's tables have {len(rows_in_file)}")
    try:
        needed = NgramHasher(config.hashing).rows_needed
    except ValueError as exc:  # the primes took the row count past int32
        raise EngramMemoryError(f"{path}: bad engram memory metadata (hashing.rows_per_head, heads, max_order): {exc}") from exc
    for layer, (n_have, n_need) in enumerate(zip(rows_in_file, needed)):
        if n_have < n_need:
            raise EngramMemoryError(
                f"{path}: the memory metadata (hashing.rows_per_head, heads, max_order) needs {n_need} rows in "
                f"layer {layer}, but the file's tables hold {n_have}"
            )
    return config, geometry


def make_config(
    layout: StreamLayout,
    tokenizers: Mapping[str, Any],
    *,
    max_order: int = 3,
    heads: int = 8,
    rows_per_head: int = 1 << 16,
    seed: int = 0,
    hidden: int | None = None,
    gate: bool = False,
    compression: str = CURRENT_RULE,
) -> tuple[MemoryConfig, dict[str, CompressedVocab]]:
    """A memory configuration for `layout`, given every stream's tokenizer (by token key: "l", "g",
    "t5xxl"; a tokenizer-like object with decode() and convert_ids_to_tokens(), a compress.Vocabulary,
    or its decoded vocabulary), hashed under the tokenizer compression rule `compression`."""
    if compression not in RULES:
        raise EngramMemoryError(f"unknown tokenizer compression rule {compression!r}; this pack knows {', '.join(RULES)}")
    vocabs = {}
    for s in layout.streams:
        if s.token_key not in tokenizers:
            raise EngramMemoryError(f"no tokenizer given for stream {s.name} (token key {s.token_key!r})")
        vocabs[s.token_key] = compressed_vocab(tokenizers[s.token_key], compression)
    hashing = HashConfig(
        num_layers=len(layout.streams),
        vocab_sizes=tuple(vocabs[s.token_key].num_compressed for s in layout.streams),
        max_order=max_order,
        heads=heads,
        rows_per_head=rows_per_head,
        seed=seed,
    )
    config = MemoryConfig(
        layout=layout,
        hashing=hashing,
        hidden=hidden if hidden is not None else max(s.width for s in layout.streams),
        fingerprints={k: v.fingerprint for k, v in vocabs.items()},
        gate=gate,
        compression=compression,
    )
    return config, vocabs
