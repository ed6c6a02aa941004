"""The engram nodes learn a CLIP's family (which tokenizers it has) once per CLIP object, not by
tokenizing on every prompt; another CLIP object is looked at anew. In process (no server needed)."""

from __future__ import annotations

import types

import pytest


class CountingClip:
    """What the nodes read of a ComfyUI CLIP: `tokenize` (counted) and `cond_stage_model`."""

    def __init__(self, keys):
        self.keys = keys
        self.tokenized = 0
        self.cond_stage_model = types.SimpleNamespace(clip_l=object(), clip_g=object())
        self.tokenizer = types.SimpleNamespace()

    def tokenize(self, text, return_word_ids=False):
        self.tokenized += 1
        return {k: [[(1, 1.0)]] for k in self.keys}


@pytest.fixture()
def engram_clip():
    from helpers.host import comfy_in_process

    comfy_in_process()
    from fp8_engram.nodes import engram_clip

    return engram_clip


def test_the_family_is_learned_once_per_clip_object(engram_clip):
    sdxl = CountingClip(["l", "g"])
    first = engram_clip.clip_layout(sdxl)
    assert first.family == "sdxl"
    for _ in range(5):
        assert engram_clip.clip_layout(sdxl) is first
    assert sdxl.tokenized == 1

    sd1 = CountingClip(["l"])
    assert engram_clip.clip_layout(sd1).family == "sd1" and sd1.tokenized == 1


def test_an_unknown_family_is_refused_every_time(engram_clip):
    from fp8_engram.engram.memory import EngramMemoryError

    odd = CountingClip(["x"])
    for _ in range(2):
        with pytest.raises(EngramMemoryError, match="not an SD1, SDXL, SD3 or Flux"):
            engram_clip.clip_layout(odd)
    assert odd.tokenized == 2  # a refusal is not remembered as a family
