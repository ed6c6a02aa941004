"""Engram nodes on the real server: memorize -> encode -> sample with the real CLIP tokenizer (random
CLIP-L weights) and the tiny SD3; bit-identical output without the phrase, movement toward the target
with it, save/load, zero and random tables, training, and bad input. Dead workers, interrupts and
releasing memory: test_engram_faults.py."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from comfyhost import WorkflowError, comfyui_root
from helpers.graphs import TINY_CLIP_L, sd3_txt2img
from safetensors.torch import load_file

logger = logging.getLogger(__name__)

PHRASE = "glowing crystal apple"  # 3 CLIP tokens
TARGET_PHRASE = "rusty old bicycle"  # 3 CLIP tokens, so rows line up
# The phrase opens the prompt, as when it was memorized: CLIP is causal, so the target's rows of the
# phrase are then exactly the memorized target rows, and the later rows differ only by context.
WITH_PHRASE = f"{PHRASE} on a wooden table"
TARGET = WITH_PHRASE.replace(PHRASE, TARGET_PHRASE)  # what WITH_PHRASE should come to read like
IN_CONTEXT = f"a photo of a {PHRASE} on a table"  # the phrase inside a sentence
WITHOUT_PHRASE = "a photo of a green pear on a table"
PHRASE_ROWS = (2, 2)  # first row, count: "crystal apple" (BOS, glowing, crystal, apple)


def new_memory(ranks: int = 2, rows_per_head: int = 4099) -> dict:
    return {"class_type": "FP8Engram.NewEngramMemory", "inputs": {
        "clip": ["2", 0], "max_order": 3, "heads": 8, "rows_per_head": rows_per_head, "dtype": "bf16",
        "devices": "cpu", "cpu_ranks": ranks, "context_gate": False, "seed": 0}}


def memorize(memory_ref: list, text: str = PHRASE, target: str = TARGET_PHRASE) -> dict:
    return {"class_type": "FP8Engram.EngramMemorize", "inputs": {"memory": memory_ref, "clip": ["2", 0], "text": text, "target_text": target}}


def encode(memory_ref: list, text: str, strength: float = 1.0) -> dict:
    return {"class_type": "FP8Engram.EngramTextEncode", "inputs": {"clip": ["2", 0], "text": text, "memory": memory_ref, "strength": strength}}


def similarity(a: list, b: list, first_row: int = 0, rows: int = 0) -> dict:
    return {"class_type": "FP8Engram.ConditioningSimilarity", "inputs": {"a": a, "b": b, "first_row": first_row, "rows": rows}}


def sim_result(history: dict, node: str) -> dict:
    return json.loads(history["outputs"][node]["text"][0])


def latest_latent(output_dir: Path, prefix: str) -> torch.Tensor:
    files = sorted((output_dir / "latents").glob(f"{prefix}_*.latent"), key=os.path.getmtime)
    assert files, f"no latent saved with prefix {prefix}"
    return load_file(str(files[-1]))["latent_tensor"]


def graph_with_memory(prompt: str, prefix: str, *, memorized: bool = True, seed: int = 3) -> dict:
    """txt2img whose positive conditioning is Engram Text Encode, plus similarity probes:
    "42": engram vs target text, "43": plain vs target text, "44": engram vs plain, "45"/"46": like
    42/43 over the phrase rows only."""
    graph = sd3_txt2img(prompt, save="latent", prefix=prefix, seed=seed)
    graph["30"] = new_memory()
    memory_ref = ["30", 0]
    if memorized:
        graph["31"] = memorize(["30", 0])
        memory_ref = ["31", 0]
    graph["3"] = encode(memory_ref, prompt)
    graph["40"] = {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": prompt}}
    graph["41"] = {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": TARGET}}
    graph["42"] = similarity(["3", 0], ["41", 0])
    graph["43"] = similarity(["40", 0], ["41", 0])
    graph["44"] = similarity(["3", 0], ["40", 0])
    graph["45"] = similarity(["3", 0], ["41", 0], *PHRASE_ROWS)
    graph["46"] = similarity(["40", 0], ["41", 0], *PHRASE_ROWS)
    return graph


def test_engram_nodes_registered_with_tooltips(comfy):
    info = comfy.object_info()
    names = ["NewEngramMemory", "LoadEngramMemory", "SaveEngramMemory", "EngramTextEncode", "EngramApply",
             "EngramMemorize", "EngramTrain", "EngramInspect", "ConditioningSimilarity"]
    for name in names:
        spec = info[f"FP8Engram.{name}"]
        assert spec["category"] == "fp8-engram/engram" and spec["description"]
        for group in ("required", "optional"):
            for input_name, (_, options) in spec["input"].get(group, {}).items():
                assert options.get("tooltip"), f"{name}.{input_name} has no tooltip"
        assert all(spec["output_tooltips"]), name
    assert info["FP8Engram.NewEngramMemory"]["output"] == ["ENGRAM_MEMORY"]


def test_prompt_without_phrase_is_bit_identical_and_samples_match(comfy, output_dir):
    engram = comfy.run(graph_with_memory(WITHOUT_PHRASE, "engram_without"))
    assert sim_result(engram, "44")["identical"] is True
    assert engram["outputs"]["3"]["text"] == ["no stored n-gram in this prompt"]
    comfy.run(sd3_txt2img(WITHOUT_PHRASE, save="latent", prefix="plain_without", seed=3))
    assert torch.equal(latest_latent(output_dir, "engram_without"), latest_latent(output_dir, "plain_without"))


def hit_words(history: dict, node_id: str) -> list[str]:
    """The words a node's UI report marks as hitting the memory, in prompt order."""
    return [t["text"] for entry in history["outputs"][node_id]["engram_hits"] for t in entry["tokens"] if t["hit"]]


def test_prompt_with_phrase_moves_toward_target(comfy, output_dir):
    history = comfy.run(graph_with_memory(WITH_PHRASE, "engram_with"))
    assert sim_result(history, "44")["identical"] is False
    before, after = sim_result(history, "43")["cosine"], sim_result(history, "42")["cosine"]
    rows_before, rows_after = sim_result(history, "46")["cosine"], sim_result(history, "45")["cosine"]
    # Stated figures. Only the phrase rows after its first token move (CLIP is causal: the target's
    # later rows also differ, and the memory leaves them alone), so the whole-tensor rise is small.
    logger.info(f"cosine to target: whole {before:.4f} -> {after:.4f}; phrase rows {rows_before:.4f} -> {rows_after:.4f}")
    assert after > before + 0.001
    assert rows_after > 0.99 and rows_after > rows_before + 0.05
    assert hit_words(history, "3") == ["crystal", "apple"]  # "glowing" opens the phrase: no n-gram inside it ends there
    comfy.run(sd3_txt2img(WITH_PHRASE, save="latent", prefix="plain_with", seed=3))
    assert not torch.equal(latest_latent(output_dir, "engram_with"), latest_latent(output_dir, "plain_with"))


def test_phrase_inside_a_sentence_changes_only_its_rows(comfy):
    graph = graph_with_memory(IN_CONTEXT, "engram_in_context", seed=10)
    graph["47"] = similarity(["3", 0], ["40", 0], 0, 6)  # BOS .. "glowing": untouched
    graph["48"] = similarity(["3", 0], ["40", 0], 8, 69)  # after the phrase: untouched
    graph["49"] = similarity(["3", 0], ["40", 0], 6, 2)  # "crystal apple": moved
    history = comfy.run(graph)
    assert sim_result(history, "47")["cosine"] == pytest.approx(1.0, abs=1e-12)
    assert sim_result(history, "48")["cosine"] == pytest.approx(1.0, abs=1e-12)
    assert sim_result(history, "49")["cosine"] < 0.9999
    assert hit_words(history, "3") == ["crystal", "apple"]


def test_zero_table_has_no_effect(comfy):
    history = comfy.run(graph_with_memory(WITH_PHRASE, "engram_zero", memorized=False, seed=4))
    assert sim_result(history, "44")["identical"] is True


def test_random_table_does_not_produce_the_effect(comfy, models_dir):
    transformers = pytest.importorskip("transformers")
    from fp8_engram.engram.memory import EngramMemory, make_config
    from fp8_engram.engram.store import LocalRowStore
    from fp8_engram.engram.streams import family_layout

    tok = transformers.CLIPTokenizer.from_pretrained(str(comfyui_root() / "comfy" / "sd1_tokenizer"))
    config, vocabs = make_config(family_layout("sd3", encoders=["clip_l"]), {"l": tok}, rows_per_head=4099, seed=0)
    memory = EngramMemory(config, LocalRowStore(config.rows_per_layer(2), config.hidden), vocabs)
    gen = torch.Generator().manual_seed(0)
    rows = memory.store.rows_per_layer[0]
    memory.store.write_rows(0, torch.arange(rows), torch.randn(rows, config.hidden, generator=gen) * 0.05)
    (models_dir / "engram").mkdir(exist_ok=True)
    memory.save(str(models_dir / "engram" / "random_table.safetensors"))

    graph = graph_with_memory(WITH_PHRASE, "engram_random", memorized=False, seed=5)
    graph["30"] = {"class_type": "FP8Engram.LoadEngramMemory", "inputs": {"memory_name": "random_table.safetensors", "devices": "cpu", "cpu_ranks": 2, "clip": ["2", 0]}}
    history = comfy.run(graph)
    before, after = sim_result(history, "43")["cosine"], sim_result(history, "42")["cosine"]
    logger.info(f"random table: cosine to target {before:.4f} -> {after:.4f}")
    assert sim_result(history, "44")["identical"] is False  # the random rows are there ...
    rows_before, rows_after = sim_result(history, "46")["cosine"], sim_result(history, "45")["cosine"]
    logger.info(f"random table: phrase rows {rows_before:.4f} -> {rows_after:.4f}")
    assert after < before + 0.001 and rows_after < rows_before + 0.01  # ... but do not pull toward the target


def test_save_load_round_trip(comfy):
    graph = graph_with_memory(WITH_PHRASE, "engram_save", seed=6)
    graph["50"] = {"class_type": "FP8Engram.SaveEngramMemory", "inputs": {"memory": ["31", 0], "name": "round_trip"}}
    graph["51"] = {"class_type": "FP8Engram.LoadEngramMemory", "inputs": {"memory_name": "round_trip.safetensors", "devices": "cpu", "cpu_ranks": 1}}
    comfy.run(graph)
    # second run: load the saved file (1 rank, no CLIP on the loader) and compare encodings
    graph2 = graph_with_memory(WITH_PHRASE, "engram_load", seed=6)
    graph2["51"] = {"class_type": "FP8Engram.LoadEngramMemory", "inputs": {"memory_name": "round_trip.safetensors", "devices": "cpu", "cpu_ranks": 1}}
    graph2["52"] = encode(["51", 0], WITH_PHRASE)
    graph2["53"] = similarity(["52", 0], ["3", 0])
    history = comfy.run(graph2)
    assert sim_result(history, "53")["identical"] is True


def test_training_lowers_held_out_error(comfy, comfy_server):
    pairs = [{"prompt": f"{subject} with a {PHRASE}", "target": f"{subject} with a {TARGET_PHRASE}"}
             for subject in ["a child", "a cat", "an old man", "a robot", "a dancer", "a farmer", "a knight", "a queen"]]
    input_dir = comfy_server.base_dir / "input"
    (input_dir / "engram_pairs.jsonl").write_text("\n".join(json.dumps(p) for p in pairs) + "\n")
    held_out_prompt, held_out_target = f"a sailor with a {PHRASE}", f"a sailor with a {TARGET_PHRASE}"
    graph = sd3_txt2img(held_out_prompt, save="latent", prefix="train", seed=7)
    graph["30"] = new_memory(rows_per_head=4093)
    graph["31"] = {"class_type": "FP8Engram.EngramTrain", "inputs": {
        "memory": ["30", 0], "clip": ["2", 0], "pairs_file": "engram_pairs.jsonl", "steps": 60,
        "learning_rate": 0.05, "batch_size": 8, "seed": 0}}
    graph["3"] = encode(["31", 0], held_out_prompt)
    graph["40"] = {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": held_out_prompt}}
    graph["41"] = {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": held_out_target}}
    graph["42"] = similarity(["3", 0], ["41", 0])
    graph["43"] = similarity(["40", 0], ["41", 0])
    graph["45"] = {"class_type": "PreviewImage", "inputs": {"images": ["31", 1]}}
    history = comfy.run(graph)
    losses = history["outputs"]["31"]["losses"]
    assert losses[-1] < 0.5 * losses[0]
    before, after = sim_result(history, "43")["cosine"], sim_result(history, "42")["cosine"]
    logger.info(f"held-out cosine to target: zero table {before:.4f} -> trained {after:.4f}")
    assert after > before


def test_broken_jsonl_lines_are_reported(comfy, comfy_server):
    (comfy_server.base_dir / "input" / "broken_pairs.jsonl").write_text(
        '{"prompt": "a", "target": "b"}\nnot json\n{"prompt": 3}\n')
    graph = {"2": sd3_txt2img()["2"], "30": new_memory(ranks=1),
             "31": {"class_type": "FP8Engram.EngramTrain", "inputs": {
                 "memory": ["30", 0], "clip": ["2", 0], "pairs_file": "broken_pairs.jsonl", "steps": 5,
                 "learning_rate": 0.05, "batch_size": 8, "seed": 0}},
             "32": {"class_type": "FP8Engram.SaveEngramMemory", "inputs": {"memory": ["31", 0], "name": "never"}}}
    with pytest.raises(WorkflowError, match="line 2.*line 3"):
        comfy.run(graph)


def test_corrupt_table_file_is_a_clear_error(comfy, models_dir):
    (models_dir / "engram").mkdir(exist_ok=True)
    (models_dir / "engram" / "corrupt.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    graph = graph_with_memory(WITH_PHRASE, "engram_corrupt", memorized=False)
    graph["30"] = {"class_type": "FP8Engram.LoadEngramMemory", "inputs": {"memory_name": "corrupt.safetensors", "devices": "cpu", "cpu_ranks": 1}}
    with pytest.raises(WorkflowError, match="corrupt.safetensors"):
        comfy.run(graph)
    comfy.run(graph_with_memory(WITHOUT_PHRASE, "after_corrupt", seed=8))  # the server keeps serving


def test_engram_apply_on_existing_conditioning_equals_text_encode(comfy):
    """Engram Apply adds the memory to a stock CLIPTextEncode output: same result as Engram Text Encode,
    and its report names the hit words even without its optional CLIP input."""
    graph = graph_with_memory(WITH_PHRASE, "engram_apply", seed=12)
    graph["50"] = {"class_type": "FP8Engram.EngramApply", "inputs": {
        "conditioning": ["40", 0], "text": WITH_PHRASE, "memory": ["31", 0], "strength": 1.0}}
    graph["51"] = similarity(["50", 0], ["3", 0])
    graph["52"] = similarity(["50", 0], ["40", 0])
    history = comfy.run(graph)
    assert sim_result(history, "51")["identical"] is True
    assert sim_result(history, "52")["identical"] is False
    assert hit_words(history, "50") == ["crystal", "apple"]


def test_gpu_ranks_input_is_offered_with_a_tooltip(comfy):
    """New and Load Engram Memory take `gpu_ranks` (0 = one CUDA rank per GPU, N = N ranks sharing the GPUs),
    optional so that graphs saved before it still run."""
    info = comfy.object_info()
    for name in ("NewEngramMemory", "LoadEngramMemory"):
        spec = info[f"FP8Engram.{name}"]["input"]
        assert "gpu_ranks" not in spec["required"], name
        kind, options = spec["optional"]["gpu_ranks"]
        assert kind == "INT" and options["default"] == 0 and options["min"] == 0 and options["max"] >= 4, (name, options)
        assert "round-robin" in options["tooltip"] and "0: one per GPU" in options["tooltip"], options["tooltip"]
        assert "gpu_ranks" in spec["required"]["devices"][1]["tooltip"], name


def test_cuda_rank_placement():
    from helpers.host import comfy_in_process

    comfy_in_process()
    from fp8_engram.engram.placement import cuda_rank_devices

    assert cuda_rank_devices(0, 1) == [0]  # the default: one rank per GPU, as before
    assert cuda_rank_devices(0, 3) == [0, 1, 2]
    assert cuda_rank_devices(4, 1) == [0, 0, 0, 0]  # four ranks sharing the one GPU
    assert cuda_rank_devices(5, 2) == [0, 1, 0, 1, 0]  # round-robin, as EngramGroup places rank r
    assert cuda_rank_devices(1, 8) == [0]
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="gpu_ranks"):
            cuda_rank_devices(bad, 1)
    with pytest.raises(ValueError, match="no CUDA GPU"):
        cuda_rank_devices(2, 0)


def test_gpu_ranks_leave_cpu_memories_alone_and_a_change_rebuilds(comfy, comfy_server):
    """Without a GPU, gpu_ranks changes nothing about the memory (cpu_ranks decides); changing it still makes
    a new memory (its own setting), and the same settings again serve the same workers."""
    if torch.cuda.is_available():
        pytest.skip("checks the CPU behaviour: the server would put the ranks on the GPU here")

    def run(**extra) -> dict:
        graph = {"2": {"class_type": "CLIPLoader", "inputs": {"clip_name": TINY_CLIP_L, "type": "sd3"}}}
        graph["30"] = new_memory(ranks=2, rows_per_head=1031)
        graph["30"]["inputs"].update(devices="auto", **extra)
        graph["31"] = encode(["30", 0], WITH_PHRASE)
        graph["32"] = {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": WITH_PHRASE}}
        graph["33"] = similarity(["31", 0], ["32", 0])  # an output node, so the graph runs
        return comfy.run(graph)["outputs"].get("30", {})

    plain = run()
    shared = run(gpu_ranks=4)
    assert len(plain["worker_pids"]) == len(shared["worker_pids"]) >= 1  # 2 CPU ranks both times
    assert shared["worker_pids"] != plain["worker_pids"]  # a changed setting made a new memory
    assert shared["text"][0].split("version=")[0] == plain["text"][0].split("version=")[0]
    again = run(gpu_ranks=4)
    # Unchanged settings: ComfyUI's cache keeps New Engram Memory from running again (so it reports nothing
    # this time), and the workers the memory started are the ones still serving.
    from integration.test_engram_faults import engram_workers

    assert "worker_pids" not in again or again["worker_pids"] == shared["worker_pids"], again
    assert set(shared["worker_pids"]) <= engram_workers(comfy_server)


def test_host_placed_memory_file_changed_in_place_is_reloaded_or_refused(comfy, models_dir):
    """A memory placed on the host tier maps its file. Copying another memory over it in place (what `cp`
    does: truncate, then write) makes the next prompt load the new contents; a file left truncated is a
    named error, and the server keeps serving."""
    graph = graph_with_memory(WITH_PHRASE, "engram_host_src", seed=6)
    graph["50"] = {"class_type": "FP8Engram.SaveEngramMemory", "inputs": {"memory": ["31", 0], "name": "host_memorized"}}
    graph["51"] = {"class_type": "FP8Engram.SaveEngramMemory", "inputs": {"memory": ["30", 0], "name": "host_empty"}}
    comfy.run(graph)  # the memory as saved before Memorize ran (node 30's output) is all zero
    folder = models_dir / "engram"
    live = folder / "host_live.safetensors"
    live.write_bytes((folder / "host_memorized.safetensors").read_bytes())

    def probe(strength: float) -> dict:
        g = {"2": sd3_txt2img()["2"],
             "30": {"class_type": "FP8Engram.LoadEngramMemory", "inputs": {
                 "memory_name": live.name, "devices": "cpu", "cpu_ranks": 1, "placement": "host"}},
             "3": encode(["30", 0], WITH_PHRASE, strength),
             "40": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": WITH_PHRASE}},
             "44": similarity(["3", 0], ["40", 0])}
        return comfy.run(g)

    first = probe(1.0)
    assert sim_result(first, "44")["identical"] is False  # the memorized phrase moves the conditioning
    assert "host" in "\n".join(first["outputs"]["30"]["text"])
    with open(folder / "host_empty.safetensors", "rb") as src, open(live, "r+b") as dst:  # in place, as cp does
        dst.truncate(0)
        dst.write(src.read())
    assert sim_result(probe(0.9), "44")["identical"] is True  # reloaded: the empty memory's zero rows
    os.truncate(live, live.stat().st_size // 2)
    with pytest.raises(WorkflowError, match="host_live.safetensors"):
        probe(0.8)
    live.unlink()
    comfy.run(graph_with_memory(WITHOUT_PHRASE, "after_host_change", seed=8))  # the server keeps serving


def test_memory_saved_on_three_ranks_loads_on_one_and_two(comfy):
    """Tables are padded to a multiple of the rank count (rows_per_head 4099 addresses 66692 rows: 66693 on 3
    ranks): a memory saved on 3 CPU ranks (or a 3-GPU machine) loads with any other count and encodes the
    same."""
    graph = graph_with_memory(WITH_PHRASE, "engram_three", seed=6)
    graph["30"] = new_memory(ranks=3)
    graph["50"] = {"class_type": "FP8Engram.SaveEngramMemory", "inputs": {"memory": ["31", 0], "name": "three_ranks"}}
    for ranks, node in ((1, "51"), (2, "52")):
        graph[node] = {"class_type": "FP8Engram.LoadEngramMemory", "inputs": {
            "memory_name": "three_ranks.safetensors", "devices": "cpu", "cpu_ranks": ranks}}
    comfy.run({k: v for k, v in graph.items() if k not in ("51", "52")})
    graph["53"], graph["54"] = encode(["51", 0], WITH_PHRASE), encode(["52", 0], WITH_PHRASE)
    graph["55"], graph["56"] = similarity(["53", 0], ["3", 0]), similarity(["54", 0], ["3", 0])
    history = comfy.run(graph)
    assert sim_result(history, "55")["identical"] is True and sim_result(history, "56")["identical"] is True
    assert sim_result(history, "44")["identical"] is False  # the memory does move the prompt
