"""Keep patterns of quantization (quant/quantize_model.py): each glob is translated once and matches as
fnmatch does; a pattern longer than MAX_KEEP_PATTERN_CHARS (fnmatch's translation is quadratic in its
brackets: 20,000 '[' took seconds) or more than MAX_KEEP_PATTERNS of them is a ValueError naming the
input they came from, raised before anything is translated."""

import fnmatch

import pytest

from fp8_engram.quant.quantize_model import (DEFAULT_KEEP, MAX_KEEP_PATTERN_CHARS, MAX_KEEP_PATTERNS, keep_patterns,
                                             keep_reason)

pytestmark = pytest.mark.unit

NAMES = ["x_embedder.proj", "joint_blocks.0.x_block.attn.qkv", "final_layer.linear", "t_embedder.mlp.0",
         "blocks.[1].ff", "norm_out.linear", "a*b"]
PATTERNS = list(DEFAULT_KEEP) + ["*[0-9].x_block.*", "blocks.[[]1[]].*", "?_embedder.*", "a[*]b", "[!j]*", "*qkv.weight"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_translated_pattern_matches_as_fnmatch_does(pattern):
    compiled = keep_patterns([pattern])
    for name in NAMES:
        expected = pattern if fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name + ".weight", pattern) else None
        assert keep_reason(name, compiled) == expected, (name, pattern)
        assert keep_reason(name, [pattern]) == expected, (name, pattern)


def test_a_pattern_too_long_is_refused_naming_the_input():
    with pytest.raises(ValueError, match=rf"input 'keep': pattern 2 .* has 20000 characters; .* at most {MAX_KEEP_PATTERN_CHARS}"):
        keep_patterns(["*embed*", "[" * 20000], "input 'keep'")
    assert len(keep_patterns(["[" * MAX_KEEP_PATTERN_CHARS])) == 1


def test_too_many_patterns_are_refused_naming_the_input():
    with pytest.raises(ValueError, match=rf"--keep: more than {MAX_KEEP_PATTERNS} patterns"):
        keep_patterns(iter(["*embed*"] * (MAX_KEEP_PATTERNS + 1)), "--keep")
    assert len(keep_patterns(["*embed*"] * MAX_KEEP_PATTERNS)) == MAX_KEEP_PATTERNS
