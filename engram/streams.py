"""Where each tokenizer's tokens land in a ComfyUI CONDITIONING tensor ("injection streams").

A CONDITIONING tensor is [batch, rows, columns]. ComfyUI's text encoders fill it as follows
(ComfyUI 0.3.75: comfy/sd1_clip.py, comfy/sdxl_clip.py, comfy/text_encoders/sd3_clip.py, flux.py):

- Every CLIP tokenizer produces chunks of 77 tokens ([BOS, up to 75 tokens, EOS, PAD...]); the
  encoder outputs one 77-row block per chunk, concatenated along the rows. Token j of chunk k is
  row 77*k + j. CLIP-L pads with its EOS id, CLIP-G with id 0 (which is also "!"), so padding is
  recognised by word id 0, never by token id.
- SD1.x: CLIP-L only, columns [0, 768).
- SDXL: CLIP-L columns [0, 768) and CLIP-G columns [768, 2048), both over the same rows (the row
  count is cut to the shorter of the two).
- SD3: the CLIP-L/CLIP-G block as in SDXL, zero-padded to 4096 columns (CLIP-G keeps columns
  [768, 2048) even without CLIP-L), then the T5-XXL tokens appended as further rows over all 4096
  columns. T5 has no BOS, ends with EOS, is padded to at least 77 tokens and never chunked.
  Encoders that are not loaded contribute nothing (no rows for T5, zero columns for a CLIP).
- Flux: only T5-XXL rows (padded to at least 256 tokens) over all columns; CLIP-L feeds the pooled
  output only, so it is no stream.

Each stream is one engram layer. Tokens come in the format of ComfyUI's `tokenize(text,
return_word_ids=True)`: per tokenizer key, a list of chunks, each a list of (token, weight, word_id).
A token is live when it is an int with word id != 0; BOS/EOS/PAD (word id 0) and textual-inversion
embeddings (tensors or dicts instead of ints) are dead. Without word ids (2-tuples), ids listed in
`dead_ids` are dead.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch

CLIP_L_WIDTH = 768
CLIP_G_WIDTH = 1280
T5XXL_WIDTH = 4096
SD3_CLIP_PADDED_WIDTH = 4096


@dataclass(frozen=True)
class Stream:
    """One injection stream: the tokens of tokenizer `token_key` land on columns
    [col_start, col_start + width) of a block of rows starting at a row offset that depends on the
    token counts (see `StreamLayout.row_starts`)."""

    name: str
    token_key: str
    col_start: int
    width: int

    def to_dict(self) -> dict:
        return {"name": self.name, "token_key": self.token_key, "col_start": self.col_start, "width": self.width}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Stream":
        return cls(str(data["name"]), str(data["token_key"]), int(data["col_start"]), int(data["width"]))


FAMILIES = ("sd1", "sdxl", "sd3", "flux")


@dataclass(frozen=True)
class StreamLayout:
    """The streams of one text-encoder family, and how their row blocks follow each other."""

    family: str
    streams: tuple[Stream, ...]

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown text-encoder family {self.family!r}; expected one of {FAMILIES}")
        if not self.streams:
            raise ValueError(f"a {self.family} stream layout needs at least one stream")

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.streams]

    def to_dict(self) -> dict:
        return {"family": self.family, "streams": [s.to_dict() for s in self.streams]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StreamLayout":
        return cls(str(data["family"]), tuple(Stream.from_dict(s) for s in data["streams"]))

    @property
    def conditioning_width(self) -> int:
        """Columns of the CONDITIONING this family's text encoders make: the end of the last stream's
        columns, and in SD3 at least 4096 when a CLIP is loaded (ComfyUI pads the CLIP block to 4096)."""
        width = max(s.col_start + s.width for s in self.streams)
        if self.family == "sd3" and any(s.token_key in ("l", "g") for s in self.streams):
            width = max(width, SD3_CLIP_PADDED_WIDTH)
        return width

    def row_starts(self, token_counts: Mapping[str, int]) -> dict[str, int]:
        """First CONDITIONING row of every stream, given the number of tokens (rows) each stream's
        tokenizer produced. CLIP streams share rows starting at 0; a T5 stream follows the CLIP block
        in SD3 and starts at 0 in Flux."""
        clip_rows = [token_counts[s.name] for s in self.streams if s.token_key in ("l", "g")]
        clip_block = min(clip_rows) if clip_rows else 0
        starts = {}
        for s in self.streams:
            starts[s.name] = clip_block if s.token_key == "t5xxl" else 0
        return starts


def family_layout(family: str, encoders: Iterable[str] | None = None, widths: Mapping[str, int] | None = None) -> StreamLayout:
    """The stream layout of a text-encoder family.

    `encoders` names the loaded encoders ("clip_l", "clip_g", "t5xxl"); None means all the family
    has. `widths` overrides output widths (for example a small T5 in tests); CLIP-G's column offset
    stays 768 as ComfyUI pads it so."""
    widths = dict(widths or {})
    w_l = widths.get("clip_l", CLIP_L_WIDTH)
    w_g = widths.get("clip_g", CLIP_G_WIDTH)
    w_t5 = widths.get("t5xxl", T5XXL_WIDTH)
    available = {
        "sd1": [Stream("clip_l", "l", 0, w_l)],
        "sdxl": [Stream("clip_l", "l", 0, w_l), Stream("clip_g", "g", CLIP_L_WIDTH, w_g)],
        "sd3": [Stream("clip_l", "l", 0, w_l), Stream("clip_g", "g", CLIP_L_WIDTH, w_g), Stream("t5xxl", "t5xxl", 0, w_t5)],
        "flux": [Stream("t5xxl", "t5xxl", 0, w_t5)],
    }
    if family not in available:
        raise ValueError(f"unknown text-encoder family {family!r}; expected one of {FAMILIES}")
    streams = available[family]
    if encoders is not None:
        wanted = set(encoders)
        unknown = wanted - {s.name for s in streams}
        if unknown:
            raise ValueError(f"the {family} family has no encoder(s) {sorted(unknown)}; it has {[s.name for s in streams]}")
        streams = [s for s in streams if s.name in wanted]
    return StreamLayout(family, tuple(streams))


def live_token_ids(chunks: Sequence[Sequence[Sequence[Any]]], dead_ids: Iterable[int] = ()) -> torch.Tensor:
    """Flatten one tokenizer's chunks into int64 [rows]: the token id where live, -1 where dead
    (see module docstring)."""
    dead = set(int(d) for d in dead_ids)
    out: list[int] = []
    for chunk in chunks:
        for item in chunk:
            token = item[0]
            if not isinstance(token, numbers.Integral) or isinstance(token, bool):
                out.append(-1)
                continue
            if len(item) >= 3:
                out.append(int(token) if int(item[2]) != 0 else -1)
            else:
                out.append(-1 if int(token) in dead else int(token))
    return torch.tensor(out, dtype=torch.int64)


@dataclass(frozen=True)
class StreamTokens:
    """One stream's tokens in one prompt: token ids (int64 [n], -1 dead) starting at CONDITIONING
    row `row_start`."""

    stream: Stream
    token_ids: torch.Tensor
    row_start: int

    @property
    def rows(self) -> slice:
        return slice(self.row_start, self.row_start + int(self.token_ids.numel()))

    @property
    def cols(self) -> slice:
        return slice(self.stream.col_start, self.stream.col_start + self.stream.width)


def place_tokens(layout: StreamLayout, tokens: Mapping[str, Any], dead_ids: Mapping[str, Iterable[int]] | None = None) -> list[StreamTokens]:
    """Per stream of `layout`, its live token ids and first row, from a ComfyUI tokens dict."""
    dead_ids = dead_ids or {}
    ids = {}
    for s in layout.streams:
        if s.token_key not in tokens:
            raise ValueError(
                f"the tokens have no {s.token_key!r} entry (they have {sorted(tokens)}); "
                f"this memory's {layout.family} streams need a matching text encoder"
            )
        ids[s.name] = live_token_ids(tokens[s.token_key], dead_ids.get(s.token_key, ()))
    counts = {name: int(t.numel()) for name, t in ids.items()}
    # ComfyUI cuts the shared CLIP block to the shorter of CLIP-L and CLIP-G.
    clip_names = [s.name for s in layout.streams if s.token_key in ("l", "g")]
    if clip_names:
        cut = min(counts[n] for n in clip_names)
        for n in clip_names:
            ids[n] = ids[n][:cut]
    starts = layout.row_starts(counts)
    return [StreamTokens(s, ids[s.name], starts[s.name]) for s in layout.streams]


def total_rows(placed: Sequence[StreamTokens]) -> int:
    """Rows the CONDITIONING tensor of these tokens has (end of the last stream's block)."""
    return max(p.row_start + int(p.token_ids.numel()) for p in placed)
