"""EngramMemory with the real CLIP tokenizer: stream placement per text-encoder family, memorize moves
phrases toward a target and nothing else, tokenizer checks, table-file round trip."""

import math

import pytest
import torch

from fp8_engram.engram.memory import EngramMemory, EngramMemoryError, MemoryConfig, config_from_table_file, make_config
from fp8_engram.engram.store import LocalRowStore
from fp8_engram.engram.streams import family_layout, live_token_ids, place_tokens, total_rows

pytestmark = pytest.mark.unit

@pytest.fixture(scope="module")
def clip(clip_tokenizer):
    return clip_tokenizer


def clip_chunks(tok, text, pad_id):
    """ComfyUI's SDTokenizer output for a short text: [BOS, tokens, EOS, PAD...] (77), word ids."""
    ids = tok(text)["input_ids"][1:-1]
    chunk = [(49406, 1.0, 0)] + [(t, 1.0, 1 + i) for i, t in enumerate(ids)] + [(49407, 1.0, 0)]
    return [chunk + [(pad_id, 1.0, 0)] * (77 - len(chunk))]


def sd1_tokens(tok, text):
    return {"l": clip_chunks(tok, text, 49407)}


def cosine(a, b):
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def test_live_token_ids_use_word_ids_not_token_ids():
    # CLIP-G pads with id 0, which is also the token "!": only word ids tell them apart
    chunk = [(49406, 1.0, 0), (0, 1.0, 1), (320, 1.0, 2), (49407, 1.0, 0), (0, 1.0, 0), (torch.zeros(4), 1.0, 3)]
    assert live_token_ids([chunk]).tolist() == [-1, 0, 320, -1, -1, -1]
    assert live_token_ids([[(49406, 1.0), (5, 1.0), (49407, 1.0)]], dead_ids={49406, 49407}).tolist() == [-1, 5, -1]


def test_family_layouts_match_comfyui():
    sdxl = family_layout("sdxl")
    assert [(s.name, s.token_key, s.col_start, s.width) for s in sdxl.streams] == [("clip_l", "l", 0, 768), ("clip_g", "g", 768, 1280)]
    sd3 = family_layout("sd3")
    two_chunks = [[(1, 1.0, 1)] * 77, [(1, 1.0, 1)] * 77]
    t5 = [[(5, 1.0, 1)] * 10 + [(1, 1.0, 0)] + [(0, 1.0, 0)] * 66]
    placed = place_tokens(sd3, {"l": two_chunks, "g": two_chunks, "t5xxl": t5})
    assert [(p.stream.name, p.row_start, p.token_ids.numel()) for p in placed] == [("clip_l", 0, 154), ("clip_g", 0, 154), ("t5xxl", 154, 77)]
    assert total_rows(placed) == 231
    # SD3 with only CLIP-L loaded: the block is CLIP-L columns over the CLIP rows, no T5 rows
    only_l = family_layout("sd3", encoders=["clip_l"])
    assert [p.row_start for p in place_tokens(only_l, {"l": two_chunks, "g": two_chunks, "t5xxl": t5})] == [0]
    flux = place_tokens(family_layout("flux"), {"l": two_chunks, "t5xxl": t5})
    assert [(p.stream.name, p.row_start, p.stream.width) for p in flux] == [("t5xxl", 0, 4096)]
    with pytest.raises(ValueError, match="no 'g' entry"):
        place_tokens(sdxl, {"l": two_chunks})
    with pytest.raises(ValueError, match="unknown text-encoder family"):
        family_layout("sd9")


def make_sd1_memory(clip, dtype=torch.bfloat16, width=64, ranks=1):
    config, vocabs = make_config(family_layout("sd1", widths={"clip_l": width}), {"l": clip}, rows_per_head=16381, seed=1)
    return EngramMemory(config, LocalRowStore(config.rows_per_layer(ranks), config.hidden, dtype), vocabs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_memorize_moves_phrase_toward_target_and_nothing_else(clip, dtype):
    memory = make_sd1_memory(clip, dtype)
    torch.manual_seed(0)
    base_phrase, target = torch.randn(1, 77, 64), torch.randn(1, 77, 64)
    memory.memorize(sd1_tokens(clip, "a glowing crystal apple"), base_phrase, target)
    assert memory.version == 1
    # a prompt holding the phrase: its tokens after the first move toward the target
    tokens = sd1_tokens(clip, "photo of A Glowing Crystal Apple on a table")
    cond = torch.randn(1, 77, 64)
    out = memory.apply(cond, tokens)
    rows = slice(4, 7)  # glowing crystal apple (after BOS, "photo of a"): phrase tokens 2..4
    delta_target = target[0, 2:5] - base_phrase[0, 2:5]
    moved = out[0, rows] - cond[0, rows]
    assert cosine(moved, delta_target) > (0.999 if dtype == torch.bfloat16 else 0.99)
    unchanged = torch.ones(77, dtype=torch.bool)
    unchanged[rows] = False
    assert torch.equal(out[0, unchanged], cond[0, unchanged])
    # prompts without the phrase are bit-identical
    for text in ["a red apple", "crystal glowing apple", "the glowing lamp"]:
        c = torch.randn(1, 77, 64)
        assert torch.equal(memory.apply(c, sd1_tokens(clip, text)), c), text
    hits = {h.row: h for h in memory.hits(tokens)}
    assert [r for r, h in sorted(hits.items()) if h.entries_hit] == [4, 5, 6]
    assert hits[5].entries_hit == 16 and hits[4].entries_hit == 8  # "glowing": bigram only


def test_memorize_cosine_to_target_rises(clip):
    memory = make_sd1_memory(clip)
    torch.manual_seed(2)
    base, target = torch.randn(1, 77, 64), torch.randn(1, 77, 64)
    tokens = sd1_tokens(clip, "zorblax fizzwick quantum teapot")
    before = cosine(base[0, 2:5], target[0, 2:5])
    memory.memorize(tokens, base, target)
    after = cosine(memory.apply(base, tokens)[0, 2:5], target[0, 2:5])
    assert before < 0.2 and after > 0.999


def test_other_tokenizer_or_width_is_refused(clip):
    memory = make_sd1_memory(clip)
    with pytest.raises(EngramMemoryError, match="another 'l' tokenizer"):
        memory.bind_tokenizers({"l": [f"tok{i}" for i in range(len(clip))]})
    with pytest.raises(EngramMemoryError, match="CONDITIONING is"):
        memory.apply(torch.randn(1, 77, 32), sd1_tokens(clip, "a glowing apple"))
    config, _ = make_config(family_layout("sd1", widths={"clip_l": 64}), {"l": clip}, rows_per_head=509)
    with pytest.raises(EngramMemoryError, match="rows"):
        EngramMemory(config, LocalRowStore([10], 64))
    with pytest.raises(EngramMemoryError, match="wide"):
        EngramMemory(config, LocalRowStore(config.rows_per_layer(), 32))
    unbound = EngramMemory(config, LocalRowStore(config.rows_per_layer(), 64))
    with pytest.raises(EngramMemoryError, match="no tokenizer bound"):
        unbound.apply(torch.randn(1, 77, 64), sd1_tokens(clip, "a glowing apple"))


def test_table_file_round_trip(clip, tmp_path):
    memory = make_sd1_memory(clip, ranks=2)
    torch.manual_seed(3)
    tokens = sd1_tokens(clip, "a glowing crystal apple")
    base, target = torch.randn(1, 77, 64), torch.randn(1, 77, 64)
    memory.memorize(tokens, base, target)
    path = tmp_path / "mem.safetensors"
    memory.save(str(path))
    config, geometry = config_from_table_file(str(path))
    assert config == memory.config and geometry["rows_per_layer"] == memory.store.rows_per_layer
    loaded = EngramMemory(config, LocalRowStore.from_table_file(str(path)))
    loaded.bind_tokenizers({"l": clip})
    assert torch.equal(loaded.apply(base, tokens), memory.apply(base, tokens))
    with pytest.raises(EngramMemoryError, match="no engram memory metadata"):
        MemoryConfig.from_metadata({"format": "something"}, {}, source="x.safetensors")


def test_sdxl_memory_writes_both_streams(clip):
    config, vocabs = make_config(family_layout("sdxl", widths={"clip_l": 32, "clip_g": 48}), {"l": clip, "g": clip}, rows_per_head=257)
    memory = EngramMemory(config, LocalRowStore(config.rows_per_layer(), config.hidden), vocabs)
    text = "a glowing crystal apple"
    tokens = {"l": clip_chunks(clip, text, 49407), "g": clip_chunks(clip, text, 0)}
    torch.manual_seed(4)
    base, target = torch.randn(1, 77, 768 + 48), torch.randn(1, 77, 768 + 48)
    written = memory.memorize(tokens, base, target)
    assert set(written) == {0, 1}
    out = memory.apply(base, tokens)
    assert cosine(out[0, 2:5, 0:32], target[0, 2:5, 0:32]) > 0.999
    assert cosine(out[0, 2:5, 768:816], target[0, 2:5, 768:816]) > 0.999
    assert torch.equal(out[0, :, 32:768], base[0, :, 32:768])  # columns no stream owns


def test_clear_zeroes_written_rows(clip):
    memory = make_sd1_memory(clip)
    tokens = sd1_tokens(clip, "a glowing crystal apple")
    base, target = torch.randn(1, 77, 64), torch.randn(1, 77, 64)
    memory.memorize(tokens, base, target)
    assert not torch.equal(memory.apply(base, tokens), base)
    memory.clear()
    assert memory.version == 2 and torch.equal(memory.apply(base, tokens), base)
    assert not bool(memory.store.tables[0].float().any())
    memory.memorize(tokens, base, target)
    memory.mark_untracked()
    memory.clear()
    assert not bool(memory.store.tables[0].float().any())
