"""Engram memory nodes: make, load, save, write, train and apply an n-gram memory of conditioning.

The ENGRAM_MEMORY socket carries an `engram.memory.EngramMemory` (its tables may live in worker
processes). Writes (Memorize, Train) change the memory in place: tables can be too large to copy.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import weakref

import torch

import comfy.model_management
import comfy.utils
import folder_paths
from comfy_api.latest import io

from ..engram.memory import EngramMemory, EngramMemoryError, config_from_table_file, make_config
from ..engram.store import LocalRowStore
from ..engram.streams import family_layout
from . import CATEGORY, NODE_ID_PREFIX

logger = logging.getLogger(__name__)

ENGRAM_CATEGORY = f"{CATEGORY}/engram"
EngramMemoryType = io.Custom("ENGRAM_MEMORY")
FOLDER = "engram"

folder_paths.add_model_folder_path(FOLDER, os.path.join(folder_paths.models_dir, FOLDER), is_default=True)
_paths, _exts = folder_paths.folder_names_and_paths[FOLDER]
folder_paths.folder_names_and_paths[FOLDER] = (_paths, set(_exts) | {".safetensors"})

MEMORY_TOOLTIP = "An engram memory (from New Engram Memory or Load Engram Memory)."

# ----- CLIP adaptation (the only place that knows ComfyUI's tokenizer objects) -----

_TOKENIZER_ATTRS = {"l": "clip_l", "g": "clip_g", "t5xxl": "t5xxl"}
_FAMILY_BY_KEYS = {
    frozenset({"l"}): "sd1",
    frozenset({"l", "g"}): "sdxl",
    frozenset({"l", "g", "t5xxl"}): "sd3",
    frozenset({"l", "t5xxl"}): "flux",
}


def _clip_tokenizers(clip) -> dict:
    """token key -> the transformers tokenizer inside ComfyUI's SDTokenizer."""
    out = {}
    for key, attr in _TOKENIZER_ATTRS.items():
        sd_tokenizer = getattr(clip.tokenizer, attr, None)
        inner = getattr(sd_tokenizer, "tokenizer", None)
        if inner is not None:
            out[key] = inner
    return out


def _clip_layout(clip):
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


def _tokenize(clip, text: str) -> dict:
    return clip.tokenize(text, return_word_ids=True)


def _strip_word_ids(tokens: dict) -> dict:
    return {k: [[tuple(item[:2]) for item in chunk] for chunk in v] for k, v in tokens.items()}


def _encode(clip, tokens: dict) -> list:
    return clip.encode_from_tokens_scheduled(_strip_word_ids(tokens))


def _bind(memory: EngramMemory, clip) -> None:
    memory.bind_tokenizers(_clip_tokenizers(clip))
    # For nodes given no CLIP (Engram Apply): the last CLIP this memory was used with in this session.
    memory.host_clip = clip
    memory.host_clip_tokenize = lambda text: _tokenize(clip, text)


# ----- memory lifetime: one live memory per New/Load node, reused while its settings stay the same -----

_live_lock = threading.Lock()
_live: dict[str, tuple[tuple, EngramMemory]] = {}


def _replace_live(node_id: str | None, key: tuple, make, reuse) -> EngramMemory:
    with _live_lock:
        old = _live.get(node_id) if node_id is not None else None
        if old is not None and old[0] == key:
            try:
                reuse(old[1])
                return old[1]
            except Exception:
                logger.warning("engram: the previous memory of node %s could not be reused; making a new one", node_id, exc_info=True)
        if old is not None:
            _live.pop(node_id, None)
            try:
                old[1].close()  # frees its worker processes
            except Exception:
                logger.warning("engram: closing the previous memory of node %s failed", node_id, exc_info=True)
        memory = make()
        if node_id is not None:
            _live[node_id] = (key, memory)
        return memory


def _make_store(rows_per_layer_fn, hidden: int, dtype: torch.dtype, devices: str, cpu_ranks: int):
    if devices == "auto" and torch.cuda.is_available():
        from ..engram.group import EngramGroup

        ranks = torch.cuda.device_count()
        return EngramGroup(rows_per_layer_fn(ranks), hidden, dtype, num_ranks=ranks, device="cuda")
    if cpu_ranks == 1:
        return LocalRowStore(rows_per_layer_fn(1), hidden, dtype)
    from ..engram.group import EngramGroup

    return EngramGroup(rows_per_layer_fn(cpu_ranks), hidden, dtype, num_ranks=cpu_ranks, device="cpu")


_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3fn": torch.float8_e4m3fn}
_by_settings: "weakref.WeakValueDictionary[tuple, EngramMemory]" = weakref.WeakValueDictionary()


def _settings(*values) -> tuple:
    return tuple(values)


class NewEngramMemory(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID_PREFIX + "NewEngramMemory",
            display_name="New Engram Memory",
            category=ENGRAM_CATEGORY,
            description="Makes an empty n-gram memory for this CLIP's text encoders (one table per encoder "
            "stream), sharded over every GPU (devices = auto) or over N CPU processes. Re-running with the same "
            "settings reuses the tables and workers and empties them.",
            inputs=[
                io.Clip.Input("clip", tooltip="The text encoder the memory will read prompts of (its tokenizers and widths)."),
                io.Int.Input("max_order", default=3, min=2, max=6, tooltip="Longest n-gram hashed (orders 2..N)."),
                io.Int.Input("heads", default=8, min=1, max=32, tooltip="Hash heads per n-gram order (more heads: fewer harmful collisions, more rows)."),
                io.Int.Input("rows_per_head", default=65536, min=16, max=1 << 26, tooltip="Table rows per hash head (rounded up to a prime)."),
                io.Combo.Input("dtype", options=list(_DTYPES), default="bf16", tooltip="Table storage: bf16, or FP8 E4M3 with per-128 UE8M0 scales (half the memory)."),
                io.Combo.Input("devices", options=["auto", "cpu"], default="auto", tooltip="auto: one shard per GPU (CPU processes when there is no GPU); cpu: cpu_ranks CPU processes."),
                io.Int.Input("cpu_ranks", default=1, min=1, max=64, tooltip="CPU processes holding the shards when no GPU is used (1 = in the ComfyUI process)."),
                io.Boolean.Input("context_gate", default=False, tooltip="Scale each token's memory value by how well it agrees with the token's conditioning."),
                io.Int.Input("seed", default=0, min=0, max=2**31 - 1, control_after_generate=False, tooltip="Seed of the hash multipliers (a memory is only valid with its seed)."),
            ],
            outputs=[EngramMemoryType.Output(display_name="memory", tooltip="The empty engram memory.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def fingerprint_inputs(cls, max_order, heads, rows_per_head, dtype, devices, cpu_ranks, context_gate, seed, **kwargs):
        # A memory this node made and that was written since (Memorize, Train) is no longer the empty
        # memory this node promises: run again (reusing and clearing its tables) so the graph's result
        # does not depend on what earlier runs wrote.
        memory = _by_settings.get(_settings(max_order, heads, rows_per_head, dtype, devices, cpu_ranks, context_gate, seed))
        if memory is None or memory.version == getattr(memory, "clean_version", memory.version):
            return "clean"
        return f"written {memory.uid} {memory.version}"

    @classmethod
    def execute(cls, clip, max_order, heads, rows_per_head, dtype, devices, cpu_ranks, context_gate, seed) -> io.NodeOutput:
        layout = _clip_layout(clip)
        tokenizers = _clip_tokenizers(clip)
        config, vocabs = make_config(layout, tokenizers, max_order=max_order, heads=heads, rows_per_head=rows_per_head, seed=seed, gate=context_gate)
        key = ("new", config.to_metadata().__repr__(), dtype, devices, cpu_ranks)

        def make():
            store = _make_store(config.rows_per_layer, config.hidden, _DTYPES[dtype], devices, cpu_ranks)
            try:
                return EngramMemory(config, store, vocabs)
            except BaseException:
                store.close()
                raise

        def reuse(m):
            m.clear()

        memory = _replace_live(cls.hidden.unique_id, key, make, reuse)
        memory.clean_version = memory.version
        _by_settings[_settings(max_order, heads, rows_per_head, dtype, devices, cpu_ranks, context_gate, seed)] = memory
        _bind(memory, clip)
        return io.NodeOutput(memory, ui={"text": [repr(memory)], "worker_pids": _worker_pids(memory)})


def _worker_pids(memory: EngramMemory) -> list[int]:
    pids = getattr(memory.store, "worker_pids", None)  # EngramGroup: a property
    if callable(pids):
        pids = pids()
    return [int(p) for p in pids] if pids else []


def _engram_files() -> list[str]:
    return folder_paths.get_filename_list(FOLDER)


class LoadEngramMemory(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID_PREFIX + "LoadEngramMemory",
            display_name="Load Engram Memory",
            category=ENGRAM_CATEGORY,
            description="Loads an engram table file from models/engram; each worker reads only its own rows.",
            inputs=[
                io.Combo.Input("memory_name", options=_engram_files(), tooltip="A table file in models/engram (written by Save Engram Memory)."),
                io.Combo.Input("devices", options=["auto", "cpu"], default="auto", tooltip="auto: one shard per GPU (CPU processes when there is no GPU); cpu: cpu_ranks CPU processes."),
                io.Int.Input("cpu_ranks", default=1, min=1, max=64, tooltip="CPU processes holding the shards when no GPU is used (1 = in the ComfyUI process)."),
                io.Clip.Input("clip", optional=True, tooltip="Optional: the CLIP the memory was made with (checked now instead of at first use)."),
            ],
            outputs=[EngramMemoryType.Output(display_name="memory", tooltip="The loaded engram memory.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def fingerprint_inputs(cls, memory_name, **kwargs):
        path = folder_paths.get_full_path(FOLDER, memory_name)
        return os.path.getmtime(path) if path and os.path.exists(path) else float("nan")

    @classmethod
    def execute(cls, memory_name, devices, cpu_ranks, clip=None) -> io.NodeOutput:
        path = folder_paths.get_full_path_or_raise(FOLDER, memory_name)
        config, geometry = config_from_table_file(path)
        dtype = torch.float8_e4m3fn if geometry.get("dtype") == "float8_e4m3fn" else torch.bfloat16
        key = ("load", path, os.path.getmtime(path), devices, cpu_ranks)

        def make():
            store = _make_store(config.rows_per_layer, config.hidden, dtype, devices, cpu_ranks)
            try:
                store.load_table_file(path)
                memory = EngramMemory(config, store)
            except BaseException:
                store.close()
                raise
            memory.mark_untracked()
            return memory

        def reload(memory):
            memory.store.load_table_file(path)
            memory.mark_untracked()
            memory.version += 1

        memory = _replace_live(cls.hidden.unique_id, key, make, reload)
        if clip is not None:
            _bind(memory, clip)
        return io.NodeOutput(memory, ui={"text": [f"{memory_name}: {memory!r}"]})


class SaveEngramMemory(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID_PREFIX + "SaveEngramMemory",
            display_name="Save Engram Memory",
            category=ENGRAM_CATEGORY,
            description="Writes the memory's tables and settings to models/engram/<name>.safetensors (to a "
            "temporary file first, then renamed into place, so a failed save loses nothing).",
            inputs=[
                EngramMemoryType.Input("memory", tooltip=MEMORY_TOOLTIP),
                io.String.Input("name", default="engram_memory", tooltip="File name (without extension) inside models/engram."),
            ],
            outputs=[EngramMemoryType.Output(display_name="memory", tooltip="The same memory, for chaining.")],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, memory, name) -> io.NodeOutput:
        name = name.strip()
        if not name or os.path.basename(name) != name or name.startswith("."):
            raise ValueError(f"Save Engram Memory: name {name!r} must be a plain file name (no folders)")
        if not name.endswith(".safetensors"):
            name += ".safetensors"
        folder = folder_paths.get_folder_paths(FOLDER)[0]
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, name)
        memory.save(path)
        return io.NodeOutput(memory, ui={"text": [f"saved {path} (version {memory.version})"]})


def _hit_report(memory: EngramMemory, tokens: dict, clip=None) -> dict:
    """UI data for the frontend: per stream, every word of the prompt, whether it hit written rows, and
    how strongly (norm of the memory value added to it):
    `engram_hits = [{stream, tokens: [{text, hit, strength, entries_hit, entries, row}]}]`."""
    decoders = _clip_tokenizers(clip) if clip is not None else {}
    token_key = {s.name: s.token_key for s in memory.config.layout.streams}
    streams: dict[str, list[dict]] = {}
    for h in memory.hits(tokens):
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


def _apply_to_conditioning(conditioning: list, memory: EngramMemory, tokens: dict, strength: float) -> list:
    out = []
    for cond, extra in conditioning:
        out.append([memory.apply(cond, tokens, strength), dict(extra)])
    return out


class EngramTextEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID_PREFIX + "EngramTextEncode",
            display_name="Engram Text Encode",
            category=ENGRAM_CATEGORY,
            description="Encodes a prompt like CLIP Text Encode, then adds what the memory stores for the prompt's "
            "n-grams. Tokens the memory knows nothing about keep their exact values; the pooled output is untouched.",
            inputs=[
                io.Clip.Input("clip", tooltip="The text encoder (the one the memory was made with)."),
                io.String.Input("text", multiline=True, dynamic_prompts=True, tooltip="The prompt."),
                EngramMemoryType.Input("memory", tooltip=MEMORY_TOOLTIP),
                io.Float.Input("strength", default=1.0, min=-10.0, max=10.0, step=0.05, tooltip="How much of the memory to add (1 = exactly what was memorized)."),
            ],
            outputs=[io.Conditioning.Output(display_name="CONDITIONING", tooltip="The prompt's conditioning with the memory added.")],
        )

    @classmethod
    def execute(cls, clip, text, memory, strength) -> io.NodeOutput:
        try:
            _bind(memory, clip)
            tokens = _tokenize(clip, text)
            conditioning = _encode(clip, tokens)
            out = _apply_to_conditioning(conditioning, memory, tokens, strength)
            ui = _hit_report(memory, tokens, clip)
        except EngramMemoryError as exc:
            raise EngramMemoryError(f"Engram Text Encode: {exc}") from exc
        return io.NodeOutput(out, ui=ui)


class EngramApply(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID_PREFIX + "EngramApply",
            display_name="Engram Apply",
            category=ENGRAM_CATEGORY,
            description="Adds the memory to an existing CONDITIONING made from `text` (by the same text encoder).",
            inputs=[
                io.Conditioning.Input("conditioning", tooltip="Conditioning made from `text` by the memory's text encoder."),
                io.String.Input("text", multiline=True, tooltip="The prompt the conditioning was made from."),
                EngramMemoryType.Input("memory", tooltip=MEMORY_TOOLTIP),
                io.Float.Input("strength", default=1.0, min=-10.0, max=10.0, step=0.05, tooltip="How much of the memory to add."),
                io.Clip.Input("clip", optional=True, tooltip="The text encoder, for its tokenizer (optional when the memory was made or used with it in this session)."),
            ],
            outputs=[io.Conditioning.Output(display_name="CONDITIONING", tooltip="The conditioning with the memory added.")],
        )

    @classmethod
    def execute(cls, conditioning, text, memory, strength, clip=None) -> io.NodeOutput:
        try:
            if clip is not None:
                _bind(memory, clip)
            tokenize = getattr(memory, "host_clip_tokenize", None)
            if tokenize is None:
                raise EngramMemoryError("connect the CLIP: this memory has not met its tokenizer yet")
            tokens = tokenize(text)
            out = _apply_to_conditioning(conditioning, memory, tokens, strength)
            ui = _hit_report(memory, tokens, clip if clip is not None else getattr(memory, "host_clip", None))
        except EngramMemoryError as exc:
            raise EngramMemoryError(f"Engram Apply: {exc}") from exc
        return io.NodeOutput(out, ui=ui)


class EngramMemorize(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID_PREFIX + "EngramMemorize",
            display_name="Engram Memorize",
            category=ENGRAM_CATEGORY,
            description="Writes the memory so that the phrase `text` reads like the target (a CONDITIONING, or "
            "the conditioning of `target_text`), wherever the phrase appears in a prompt. Changes the memory in "
            "place under a new version; only the phrase's rows change.",
            inputs=[
                EngramMemoryType.Input("memory", tooltip=MEMORY_TOOLTIP),
                io.Clip.Input("clip", tooltip="The text encoder the memory was made with."),
                io.String.Input("text", multiline=True, tooltip="The phrase to memorize (at least two tokens)."),
                io.String.Input("target_text", multiline=True, default="", tooltip="What the phrase should read like (used when no target conditioning is connected)."),
                io.Conditioning.Input("target", optional=True, tooltip="Target conditioning (same text encoder); wins over target_text."),
            ],
            outputs=[EngramMemoryType.Output(display_name="memory", tooltip="The memory, written.")],
        )

    @classmethod
    def execute(cls, memory, clip, text, target_text, target=None) -> io.NodeOutput:
        try:
            _bind(memory, clip)
            tokens = _tokenize(clip, text)
            base = _encode(clip, tokens)[0][0]
            if target is not None:
                target_cond = target[0][0]
            elif target_text.strip():
                target_cond = _encode(clip, _tokenize(clip, target_text))[0][0]
            else:
                raise EngramMemoryError("give a target: connect a target CONDITIONING or write a target_text")
            written = memory.memorize(tokens, base, target_cond)
        except EngramMemoryError as exc:
            raise EngramMemoryError(f"Engram Memorize: {exc}") from exc
        if not written:
            raise EngramMemoryError(f"Engram Memorize: {text!r} has no n-gram to store; use a phrase of at least two tokens")
        summary = f"memorized {text!r}: {sum(written.values())} rows in {len(written)} stream(s), version {memory.version}"
        return io.NodeOutput(memory, ui={"text": [summary]})


def _read_pairs(path: str) -> list[dict]:
    """Lines of a JSONL file: {"prompt": str, "target": str} or {"prompt": str, "target_conditioning": file}."""
    pairs, errors = [], []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                errors.append(f"line {number}: not JSON ({exc.msg})")
                continue
            if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
                errors.append(f"line {number}: needs a string \"prompt\"")
                continue
            if not isinstance(item.get("target"), str) and not isinstance(item.get("target_conditioning"), str):
                errors.append(f"line {number}: needs a string \"target\" or \"target_conditioning\" (a .safetensors file with key \"cond\")")
                continue
            item["line"] = number
            pairs.append(item)
    if errors:
        raise ValueError(f"{path}: {len(errors)} broken line(s): " + "; ".join(errors[:20]))
    if not pairs:
        raise ValueError(f"{path}: no training pairs")
    return pairs


def _loss_curve_image(losses: list[float], width: int = 512, height: int = 256) -> torch.Tensor:
    """A plain line plot of log10(loss) per step as a ComfyUI IMAGE [1, H, W, 3]."""
    image = torch.full((height, width, 3), 0.08)
    if not losses:
        return image.unsqueeze(0)
    values = torch.tensor([math.log10(max(v, 1e-30)) for v in losses], dtype=torch.float64)
    lo, hi = float(values.min()), float(values.max())
    span = hi - lo if hi > lo else 1.0
    margin = 12
    xs = torch.linspace(margin, width - margin - 1, len(losses))
    ys = (height - margin - 1) - (values - lo) / span * (height - 2 * margin - 1)
    image[margin:height - margin, margin] = 0.5  # axes
    image[height - margin - 1, margin:width - margin] = 0.5
    for i in range(len(losses) - 1):  # draw segments densely enough to be continuous
        n = max(2, int(abs(float(xs[i + 1] - xs[i])) + abs(float(ys[i + 1] - ys[i]))) + 1)
        t = torch.linspace(0, 1, n, dtype=torch.float64)
        px = (xs[i] + (xs[i + 1] - xs[i]) * t).round().long().clamp(0, width - 1)
        py = (ys[i] + (ys[i + 1] - ys[i]) * t).round().long().clamp(0, height - 1)
        image[py, px] = torch.tensor([0.95, 0.6, 0.1])
    return image.unsqueeze(0)


class EngramTrain(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID_PREFIX + "EngramTrain",
            display_name="Engram Train",
            category=ENGRAM_CATEGORY,
            description="Fits the memory on a JSONL file of pairs, one per line: {\"prompt\": ..., \"target\": "
            "\"target prompt\"} or {\"prompt\": ..., \"target_conditioning\": \"file.safetensors\"} (key \"cond\"). "
            "Only rows the prompts touch change (row-sparse Adam, no weight decay). Cancel stops without writing.",
            inputs=[
                EngramMemoryType.Input("memory", tooltip=MEMORY_TOOLTIP),
                io.Clip.Input("clip", tooltip="The text encoder the memory was made with."),
                io.String.Input("pairs_file", default="engram_pairs.jsonl", tooltip="JSONL file: an absolute path, or a path inside ComfyUI's input folder."),
                io.Int.Input("steps", default=200, min=1, max=100000, tooltip="Optimizer steps."),
                io.Float.Input("learning_rate", default=0.05, min=1e-5, max=10.0, step=0.001, tooltip="Adam learning rate."),
                io.Int.Input("batch_size", default=16, min=1, max=4096, tooltip="Pairs per step."),
                io.Int.Input("seed", default=0, min=0, max=2**31 - 1, control_after_generate=False, tooltip="Seed of the pair order."),
            ],
            outputs=[
                EngramMemoryType.Output(display_name="memory", tooltip="The trained memory."),
                io.Image.Output(display_name="loss_curve", tooltip="log10 of the training loss per step."),
            ],
        )

    @classmethod
    def execute(cls, memory, clip, pairs_file, steps, learning_rate, batch_size, seed) -> io.NodeOutput:
        path = pairs_file if os.path.isabs(pairs_file) else os.path.join(folder_paths.get_input_directory(), pairs_file)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"Engram Train: pairs file {path} does not exist")
        pairs = _read_pairs(path)
        _bind(memory, clip)
        triples = []
        for item in pairs:
            tokens = _tokenize(clip, item["prompt"])
            base = _encode(clip, tokens)[0][0]
            if isinstance(item.get("target"), str):
                target = _encode(clip, _tokenize(clip, item["target"]))[0][0]
            else:
                cond_path = item["target_conditioning"]
                if not os.path.isabs(cond_path):
                    cond_path = os.path.join(os.path.dirname(path), cond_path)
                try:
                    target = comfy.utils.load_torch_file(cond_path, safe_load=True)["cond"]
                except Exception as exc:
                    raise ValueError(f"Engram Train: {path} line {item['line']}: cannot read key 'cond' of {cond_path}: {exc}") from exc
                if target.dim() == 2:
                    target = target.unsqueeze(0)
            triples.append((tokens, base, target))
        examples = memory.examples(triples)
        bar = comfy.utils.ProgressBar(steps)

        def progress(step, total, loss):
            bar.update_absolute(step, total)

        def should_stop():
            comfy.model_management.throw_exception_if_processing_interrupted()
            return False

        result = memory.fit(examples, steps=steps, lr=learning_rate, batch_size=batch_size, seed=seed, progress=progress, should_stop=should_stop)
        summary = f"trained {result.steps} steps on {len(pairs)} pairs: loss {result.losses[0]:.5g} -> {result.losses[-1]:.5g}" if result.losses else "nothing to train"
        return io.NodeOutput(memory, _loss_curve_image(result.losses), ui={"text": [summary], "losses": result.losses})


def _heat_map(hits, cell: int = 16) -> torch.Tensor:
    streams = sorted({h.stream for h in hits})
    if not hits:
        return torch.zeros(1, cell, cell, 3)
    rows = {s: [h for h in hits if h.stream == s] for s in streams}
    width = max(len(v) for v in rows.values())
    peak = max((h.norm for h in hits), default=0.0) or 1.0
    image = torch.zeros(len(streams) * cell, width * cell, 3)
    for r, s in enumerate(streams):
        for c, h in enumerate(rows[s]):
            level = h.norm / peak
            image[r * cell + 1:(r + 1) * cell - 1, c * cell + 1:(c + 1) * cell - 1] = torch.tensor([level, 0.3 * level, 1.0 - level]) * (0.3 + 0.7 * h.entries_hit / max(h.entries, 1))
    return image.unsqueeze(0)


class EngramInspect(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID_PREFIX + "EngramInspect",
            display_name="Engram Inspect",
            category=ENGRAM_CATEGORY,
            description="Shows which tokens of a prompt hit written memory rows and how strongly: a heat map "
            "(one row per stream, one cell per token; brighter = larger memory value) and a text report.",
            inputs=[
                EngramMemoryType.Input("memory", tooltip=MEMORY_TOOLTIP),
                io.Clip.Input("clip", tooltip="The text encoder the memory was made with."),
                io.String.Input("text", multiline=True, tooltip="The prompt to inspect."),
            ],
            outputs=[
                io.Image.Output(display_name="heat_map", tooltip="Per token memory strength (streams as rows)."),
                io.String.Output(display_name="report", tooltip="Per token: hit entries / entries and the memory value's norm."),
            ],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, memory, clip, text) -> io.NodeOutput:
        _bind(memory, clip)
        tokens = _tokenize(clip, text)
        hits = memory.hits(tokens)
        tokenizers = _clip_tokenizers(clip)
        by_stream = {s.name: s.token_key for s in memory.config.layout.streams}
        lines = [f"{memory!r}"]
        for h in hits:
            word = tokenizers[by_stream[h.stream]].decode([h.token_id]).strip() if by_stream[h.stream] in tokenizers else str(h.token_id)
            lines.append(f"{h.stream} row {h.row:4d} {word!r:>16}: {h.entries_hit}/{h.entries} entries, |v| = {h.norm:.4g}")
        report = "\n".join(lines)
        ui = _hit_report(memory, tokens, clip)
        ui["text"] = [report]
        return io.NodeOutput(_heat_map(hits), report, ui=ui)


class ConditioningSimilarity(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID_PREFIX + "ConditioningSimilarity",
            display_name="Conditioning Similarity",
            category=ENGRAM_CATEGORY,
            description="Cosine similarity of two CONDITIONINGs over their common rows and columns, and whether "
            "they are bit-identical: shows how far a memory moved a prompt toward a target.",
            inputs=[
                io.Conditioning.Input("a", tooltip="First conditioning."),
                io.Conditioning.Input("b", tooltip="Second conditioning."),
                io.Int.Input("first_row", default=0, min=0, max=1 << 20, tooltip="First token row compared (0 = from the start)."),
                io.Int.Input("rows", default=0, min=0, max=1 << 20, tooltip="Number of token rows compared (0 = all common rows)."),
            ],
            outputs=[io.Float.Output(display_name="cosine", tooltip="Cosine similarity in [-1, 1].")],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, a, b, first_row=0, rows=0) -> io.NodeOutput:
        x, y = a[0][0], b[0][0]
        end, cols = min(x.shape[1], y.shape[1]), min(x.shape[2], y.shape[2])
        if rows:
            end = min(end, first_row + rows)
        if first_row >= end:
            raise ValueError(f"Conditioning Similarity: first_row {first_row} is past the {end} common rows")
        xs, ys = x[:, first_row:end, :cols].double().flatten(), y[:, first_row:end, :cols].double().flatten()
        cosine = float(torch.nn.functional.cosine_similarity(xs, ys, dim=0))
        identical = x.shape == y.shape and bool(torch.equal(x, y))
        return io.NodeOutput(cosine, ui={"text": [json.dumps({"cosine": cosine, "identical": identical})]})


NODES = [
    NewEngramMemory,
    LoadEngramMemory,
    SaveEngramMemory,
    EngramTextEncode,
    EngramApply,
    EngramMemorize,
    EngramTrain,
    EngramInspect,
    ConditioningSimilarity,
]
