"""CLIP adaptation for the engram nodes (the only place that knows ComfyUI's tokenizer objects): a CLIP's
family and stream layout (learned once per CLIP object), its tokenizers, tokenizing and encoding,
binding a memory to the CLIP it is used with, and the per-word hit report its tokenizers spell out."""

from __future__ import annotations

import weakref

from ..engram.memory import EngramMemory, EngramMemoryError
from ..engram.streams import StreamLayout, family_layout
from .engram_live import LIVE

_TOKENIZER_ATTRS = {"l": "clip_l", "g": "clip_g", "t5xxl": "t5xxl"}
_FAMILY_BY_KEYS = {
    frozenset({"l"}): "sd1",
    frozenset({"l", "g"}): "sdxl",
    frozenset({"l", "g", "t5xxl"}): "sd3",
    frozenset({"l", "t5xxl"}): "flux",
}
# CLIP object -> its stream layout: the family is learned by tokenizing once, not on every prompt.
_layouts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def clip_tokenizers(clip) -> dict:
    """token key -> the transformers tokenizer inside ComfyUI's SDTokenizer."""
    out = {}
    for key, attr in _TOKENIZER_ATTRS.items():
        sd_tokenizer = getattr(clip.tokenizer, attr, None)
        inner = getattr(sd_tokenizer, "tokenizer", None)
        if inner is not None:
            out[key] = inner
    return out


def clip_layout(clip) -> StreamLayout:
    """The stream layout of a CLIP's conditioning (family, encoders present, widths), learned once per CLIP
    object (a CLIP that cannot be weakly referenced is looked at each time)."""
    try:
        layout = _layouts.get(clip)
    except TypeError:
        return _learn_layout(clip)
    if layout is None:
        layout = _layouts[clip] = _learn_layout(clip)
    return layout


def _learn_layout(clip) -> StreamLayout:
    keys = frozenset(clip.tokenize("a").keys())
    family = _FAMILY_BY_KEYS.get(keys)
    if family is None:
        raise EngramMemoryError(
            f"this CLIP's tokenizers {sorted(keys)} are not an SD1, SDXL, SD3 or Flux text encoder; engram memory supports those"
        )
    model = clip.cond_stage_model
    names = family_layout(family).names
    present = [n for n in names if getattr(model, n, None) is not None]
    if not present:
        raise EngramMemoryError(f"this {family} CLIP has none of the text encoders {names} loaded")
    widths = {}
    for name in present:
        try:
            widths[name] = int(getattr(model, name).transformer.get_input_embeddings().weight.shape[1])
        except Exception:  # unknown encoder internals: keep ComfyUI's standard width
            pass
    return family_layout(family, encoders=present, widths=widths)


def tokenize(clip, text: str) -> dict:
    return clip.tokenize(text, return_word_ids=True)


def _strip_word_ids(tokens: dict) -> dict:
    return {k: [[tuple(item[:2]) for item in chunk] for chunk in v] for k, v in tokens.items()}


def encode(clip, tokens: dict) -> list:
    return clip.encode_from_tokens_scheduled(_strip_word_ids(tokens))


def check_clip_type(memory: EngramMemory, clip) -> None:
    """Refuse a CLIP of another type than the memory's (its tokenizers may be the same, e.g. CLIP-L in
    SD1 and SD3, yet its conditioning is laid out otherwise), or one without an encoder the memory needs."""
    layout = clip_layout(clip)
    want = memory.config.layout
    if layout.family != want.family:
        raise EngramMemoryError(f"this memory was made for {want.family.upper()} text encoders, but the CLIP given is "
                                f"{layout.family.upper()}; use the CLIP the memory was made with (or a memory made for this one)")
    have = {s.name: s.width for s in layout.streams}
    missing = [s.name for s in want.streams if s.name not in have]
    if missing:
        raise EngramMemoryError(f"this memory needs the text encoder(s) {missing}, which this {layout.family.upper()} CLIP has not loaded")
    wrong = [f"{s.name} ({have[s.name]} wide, the memory's is {s.width})" for s in want.streams if have[s.name] != s.width]
    if wrong:
        raise EngramMemoryError(f"this CLIP's encoders differ from the memory's: {', '.join(wrong)}")


def bind(memory: EngramMemory, clip) -> None:
    """Check `clip` against the memory and bind its tokenizers; remembered as the memory's CLIP for nodes
    given none (Engram Apply): the last CLIP this memory was used with in this session."""
    check_clip_type(memory, clip)
    memory.bind_tokenizers(clip_tokenizers(clip))
    LIVE.notes(memory).clip = clip


def hit_report(memory: EngramMemory, tokens: dict, clip=None, looked_up: tuple | None = None) -> dict:
    """UI data for the frontend: per stream, every word of the prompt, whether it hit written rows, and
    how strongly (norm of the memory value added to it):
    `engram_hits = [{stream, tokens: [{text, hit, strength, entries_hit, entries, row}]}]`."""
    decoders = clip_tokenizers(clip) if clip is not None else {}
    token_key = {s.name: s.token_key for s in memory.config.layout.streams}
    streams: dict[str, list[dict]] = {}
    for h in memory.hits(tokens, looked_up):
        tok = decoders.get(token_key[h.stream])
        text = tok.decode([h.token_id]).strip() if tok is not None else str(h.token_id)
        streams.setdefault(h.stream, []).append({
            "text": text, "hit": h.entries_hit > 0, "strength": round(h.norm, 4),
            "entries_hit": h.entries_hit, "entries": h.entries, "row": h.row,
        })
    hit_words = [t for entries in streams.values() for t in entries if t["hit"]]
    summary = ", ".join(f"{t['text']} ({t['entries_hit']}/{t['entries']})" for t in hit_words)
    return {
        "engram_hits": [{"stream": name, "tokens": entries} for name, entries in streams.items()],
        "text": [summary or "no stored n-gram in this prompt"],
    }
