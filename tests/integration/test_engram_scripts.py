"""Engram on the real server keeps scripts apart (issue 27, finding 1): a memory memorized for the prompt
'猫' (cat) is not read by the prompt '犬' (dog). CLIP splits both characters into
byte-level tokens that decode to U+FFFD; the legacy compression keyed them all alike, so the '犬'
prompt hit every row the '猫' prompt wrote."""

from __future__ import annotations

import json

from helpers.graphs import sd3_txt2img

# The prompts are the character alone: every n-gram of them holds one of its byte tokens, so none may hit
# (in a longer prompt the n-grams of the shared words hit both, rightly).
CAT = "猫"
DOG = "犬"
TARGET = "a rusty old bicycle on a wooden table"


def similarity(a: list, b: list) -> dict:
    return {"class_type": "FP8Engram.ConditioningSimilarity", "inputs": {"a": a, "b": b, "first_row": 0, "rows": 0}}


def test_memory_of_cat_prompt_is_not_read_by_dog_prompt(comfy):
    graph = {"2": sd3_txt2img(CAT, save="latent", prefix="engram_scripts", seed=1)["2"]}  # the CLIP only: no sampling
    graph["30"] = {"class_type": "FP8Engram.NewEngramMemory", "inputs": {
        "clip": ["2", 0], "max_order": 3, "heads": 8, "rows_per_head": 4099, "dtype": "bf16",
        "devices": "cpu", "cpu_ranks": 1, "context_gate": False, "seed": 0}}
    graph["31"] = {"class_type": "FP8Engram.EngramMemorize", "inputs": {"memory": ["30", 0], "clip": ["2", 0], "text": CAT, "target_text": TARGET}}
    for node, text in (("3", CAT), ("4", DOG)):  # Engram Text Encode "3"/"4", plain "13"/"14", similarity "23"/"24"
        graph[node] = {"class_type": "FP8Engram.EngramTextEncode", "inputs": {"clip": ["2", 0], "text": text, "memory": ["31", 0], "strength": 1.0}}
        graph[f"1{node}"] = {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": text}}
        graph[f"2{node}"] = similarity([node, 0], [f"1{node}", 0])
    history = comfy.run(graph)
    result = {node: json.loads(history["outputs"][f"2{node}"]["text"][0]) for node in ("3", "4")}
    hits = {node: history["outputs"][node]["text"][0] for node in ("3", "4")}
    assert result["3"]["identical"] is False, f"the memorized prompt is not read: {hits['3']}"
    assert hits["4"] == "no stored n-gram in this prompt", f"the '犬' prompt reads the '猫' memory: {hits['4']}"
    assert result["4"]["identical"] is True
