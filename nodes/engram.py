"""Engram memory nodes: make, load, save, write, train and apply an n-gram memory of conditioning.

The ENGRAM_MEMORY socket carries an `engram.memory.EngramMemory` (its tables may live in worker
processes). Writes (Memorize, Train) change the memory in place: tables can be too large to copy.
How long a memory lives, and what a dead worker turns into, is nodes/engram_live.py's.
"""

from __future__ import annotations

import json
import logging
import os
import time

import torch

import comfy.model_management
import comfy.utils
import folder_paths
from comfy_api.latest import io

from ..engram.group import CPU_TEMPLATE_BYTES, CPU_WORKER_BYTES
from ..engram.host_tier import HostRowStore
from ..engram.memory import EngramMemory, EngramMemoryError, config_from_table_file, make_config
from ..engram.placement import PLACEMENTS, make_store, placement_text, resolve_tier
from ..engram.table_file import TableFileError, TableFileWriteError  # noqa: F401 - loaded here so that plain_error_names() renames its errors
from ..engram.pairs import read_pairs
from . import CATEGORY, NODE_ID_PREFIX
from .engram_clip import bind, clip_layout, clip_tokenizers, encode, hit_report, tokenize
from .engram_images import heat_map, loss_curve_image
from .engram_inputs import FOLDER, device_free_bytes, engram_files, finite_conditioning, finite_input, inside_input, plain_error_names, worker_pids
from .engram_live import LIVE, SAVE_ADVICE, current_node_id, problem, serving

logger = logging.getLogger(__name__)

plain_error_names()  # after the imports above: every error class of the pack is loaded by now

ENGRAM_CATEGORY = f"{CATEGORY}/engram"
EngramMemoryType = io.Custom("ENGRAM_MEMORY")
MEMORY_TOOLTIP = "An engram memory (from New Engram Memory or Load Engram Memory)."
# The widget ranges of the float inputs, which the nodes also enforce (see engram_inputs.finite_input).
STRENGTH_RANGE = (-10.0, 10.0)
LEARNING_RATE_RANGE = (1e-5, 10.0)

_GPU_RANKS_TOOLTIP = ("CUDA processes holding the shards when devices = auto finds a GPU. 0: one per GPU. N: N processes "
                      "spread round-robin over the GPUs (rank r on GPU r mod GPU count), so several can share one GPU. "
                      "Not used on the CPU.")
_CPU_RANKS_TOOLTIP = ("CPU processes holding the shards when no GPU is used (1 = in the ComfyUI process). Each further rank "
                      f"is a worker process of about {CPU_WORKER_BYTES >> 20} MB of private memory, forked from one template "
                      f"process (about {CPU_TEMPLATE_BYTES >> 20} MB, while any worker runs); the tables are shared memory, "
                      "counted once. A count that the machine's available memory cannot hold is refused.")
_DEVICES_TOOLTIP = ("auto: shards on the GPUs (gpu_ranks processes; one per GPU by default), or cpu_ranks CPU processes "
                    "when there is no GPU; cpu: cpu_ranks CPU processes.")
_PLACEMENT_TOOLTIP = ("Where the rows live. device: on the devices chosen by `devices` (GPU memory, or CPU processes). "
                      "host: in host memory, one copy per machine (a loaded table file is memory-mapped and shared by every "
                      "process that loads it, and only fetched rows are read), fetched while the text encoder runs; for "
                      "memories bigger than the GPUs. auto: the device when the tables take at most half of its free memory, "
                      "else host.")


_HEALTH_PERIOD_S = 0.25  # how often a long node (Engram Train) looks at its memory's workers
_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3fn": torch.float8_e4m3fn}


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
            "stream), sharded over the GPUs (devices = auto: one process per GPU, or gpu_ranks processes sharing them) "
            "or over N CPU processes. Re-running with the same "
            "settings reuses the tables and workers and empties them. If a worker process dies, the next run "
            "makes a new memory (what was written is lost unless saved with Save Engram Memory).",
            inputs=[
                io.Clip.Input("clip", tooltip="The text encoder the memory will read prompts of (its tokenizers and widths)."),
                io.Int.Input("max_order", default=3, min=2, max=6, tooltip="Longest n-gram hashed (orders 2..N)."),
                io.Int.Input("heads", default=8, min=1, max=32, tooltip="Hash heads per n-gram order (more heads: fewer harmful collisions, more rows)."),
                io.Int.Input("rows_per_head", default=65536, min=16, max=1 << 26, tooltip="Table rows per hash head (rounded up to a prime)."),
                io.Combo.Input("dtype", options=list(_DTYPES), default="bf16", tooltip="Table storage: bf16, or FP8 E4M3 with per-128 UE8M0 scales (half the memory)."),
                io.Combo.Input("devices", options=["auto", "cpu"], default="auto", tooltip=_DEVICES_TOOLTIP),
                io.Int.Input("cpu_ranks", default=1, min=1, max=64, tooltip=_CPU_RANKS_TOOLTIP),
                io.Boolean.Input("context_gate", default=False, tooltip="Scale each token's memory value by how well it agrees with the token's conditioning."),
                io.Int.Input("seed", default=0, min=0, max=2**31 - 1, control_after_generate=False, tooltip="Seed of the hash multipliers (a memory is only valid with its seed)."),
                io.Int.Input("gpu_ranks", default=0, min=0, max=64, optional=True, tooltip=_GPU_RANKS_TOOLTIP),
                io.Combo.Input("placement", options=list(PLACEMENTS), default="auto", optional=True, tooltip=_PLACEMENT_TOOLTIP),
            ],
            outputs=[EngramMemoryType.Output(display_name="memory", tooltip="The empty engram memory.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def fingerprint_inputs(cls, max_order, heads, rows_per_head, dtype, devices, cpu_ranks, context_gate, seed, gpu_ranks=0, placement="auto", **kwargs):
        # A memory this node made and that was written since (Memorize, Train) is no longer the empty
        # memory this node promises: run again (reusing and clearing its tables) so the graph's result
        # does not depend on what earlier runs wrote. A memory that was closed or lost a worker must not
        # be served from ComfyUI's cache either: run again to build a new one.
        gpu_ranks = gpu_ranks or 0  # absent (a graph saved before the input existed) is the default
        settings = _settings(max_order, heads, rows_per_head, dtype, devices, cpu_ranks, context_gate, seed, gpu_ranks, placement or "auto")
        memory = LIVE.made_with(current_node_id(), settings)
        if memory is None:
            return "clean"
        if problem(memory) is not None:
            return f"rebuild {memory.uid}"
        if LIVE.written_since_made(memory):
            return f"written {memory.uid} {memory.version}"
        return "clean"

    @classmethod
    def execute(cls, clip, max_order, heads, rows_per_head, dtype, devices, cpu_ranks, context_gate, seed, gpu_ranks=0, placement="auto") -> io.NodeOutput:
        node_id = cls.hidden.unique_id
        gpu_ranks = gpu_ranks or 0
        requested = placement or "auto"
        layout = clip_layout(clip)
        tokenizers = clip_tokenizers(clip)
        config, vocabs = make_config(layout, tokenizers, max_order=max_order, heads=heads, rows_per_head=rows_per_head, seed=seed, gate=context_gate)
        placement, why = resolve_tier(requested, config.rows_per_layer(1), config.hidden, _DTYPES[dtype],
                                      lambda: device_free_bytes(devices))
        key = ("new", config.to_metadata().__repr__(), dtype, devices, cpu_ranks, gpu_ranks, placement)

        def wrap(store, state=None):
            memory = EngramMemory(config, store, vocabs)
            if state is not None:  # tables taken back from a parked memory, with what was written into them
                memory.state = state
            memory.name = f"the memory of New Engram Memory (node {node_id})"
            return LIVE.adopt(memory, node_id, key)

        def make():
            store = make_store(config.rows_per_layer, config.hidden, _DTYPES[dtype], devices, cpu_ranks, gpu_ranks, placement,
                               name=f"the memory of New Engram Memory (node {node_id})", reason=why)
            try:
                # A cancel that arrived while the tables were built: drop them (below) rather than hand them on.
                comfy.model_management.throw_exception_if_processing_interrupted()
                return wrap(store)
            except BaseException:
                store.close()
                raise

        def reuse(m):
            m.clear()

        memory, lost = LIVE.replace(node_id, key, make, reuse, wrap)
        LIVE.notes(memory).clean_version = memory.version
        LIVE.remember_settings(node_id, _settings(max_order, heads, rows_per_head, dtype, devices, cpu_ranks, context_gate, seed, gpu_ranks, requested), memory)
        bind(memory, clip)
        text = f"{memory!r}\n{placement_text(memory.store)}"
        if lost is not None and lost.startswith("lost"):
            logger.warning("engram: the memory of New Engram Memory (node %s) was %s; made a new empty one", node_id, lost)
            text = (f"The previous memory of this node was {lost}; this is a new empty memory, and what was written "
                    f"into the old one is gone. {SAVE_ADVICE}\n{text}")
        elif lost is not None:
            text = f"Made again (the previous memory was {lost}).\n{text}"
        return io.NodeOutput(memory, ui={"text": [text], "worker_pids": worker_pids(memory)})


class LoadEngramMemory(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID_PREFIX + "LoadEngramMemory",
            display_name="Load Engram Memory",
            category=ENGRAM_CATEGORY,
            description="Loads an engram table file from models/engram; each worker reads only its own rows. "
            "Runs again (reloading the file) when the memory was written since (Memorize, Train), and rebuilds "
            "it from the file when a worker process died.",
            inputs=[
                io.Combo.Input("memory_name", options=engram_files(), tooltip="A table file in models/engram (written by Save Engram Memory)."),
                io.Combo.Input("devices", options=["auto", "cpu"], default="auto", tooltip=_DEVICES_TOOLTIP),
                io.Int.Input("cpu_ranks", default=1, min=1, max=64, tooltip=_CPU_RANKS_TOOLTIP),
                io.Int.Input("gpu_ranks", default=0, min=0, max=64, optional=True, tooltip=_GPU_RANKS_TOOLTIP),
                io.Clip.Input("clip", optional=True, tooltip="Optional: the CLIP the memory was made with (checked now instead of at first use)."),
                io.Combo.Input("placement", options=list(PLACEMENTS), default="auto", optional=True, tooltip=_PLACEMENT_TOOLTIP),
            ],
            outputs=[EngramMemoryType.Output(display_name="memory", tooltip="The loaded engram memory.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def fingerprint_inputs(cls, memory_name, devices="auto", cpu_ranks=1, gpu_ranks=0, placement="auto", **kwargs):
        path = folder_paths.get_full_path(FOLDER, memory_name)
        if not path or not os.path.exists(path):
            return float("nan")
        mtime = os.path.getmtime(path)
        live = LIVE.memory_of(current_node_id())
        settings = (path, mtime, devices, cpu_ranks, gpu_ranks or 0, placement or "auto")
        memory = live if live is not None and LIVE.notes(live).load_settings == settings else None
        if memory is None:
            return mtime
        if problem(memory) is not None:
            return f"{mtime} rebuild {memory.uid}"
        if LIVE.written_since_made(memory):
            return f"{mtime} written {memory.uid} {memory.version}"  # reload: the file, not what was written since
        return mtime

    @classmethod
    def execute(cls, memory_name, devices, cpu_ranks, clip=None, gpu_ranks=0, placement="auto") -> io.NodeOutput:
        node_id = cls.hidden.unique_id
        gpu_ranks = gpu_ranks or 0
        requested = placement or "auto"
        path = folder_paths.get_full_path_or_raise(FOLDER, memory_name)
        config, geometry = config_from_table_file(path)
        dtype = torch.float8_e4m3fn if geometry.get("dtype") == "float8_e4m3fn" else torch.bfloat16
        needed = config.rows_per_layer(1)  # the rows the hashing addresses (a file may be padded past them)
        rows = [int(n) for n in geometry.get("rows_per_layer") or needed]
        placement, why = resolve_tier(requested, rows, config.hidden, dtype, lambda: device_free_bytes(devices))
        mtime = os.path.getmtime(path)
        key = ("load", path, mtime, devices, cpu_ranks, gpu_ranks, placement)

        def wrap(store, state=None):
            memory = EngramMemory(config, store)
            if state is not None:
                memory.state = state
            memory.mark_untracked()
            memory.name = f"the memory {memory_name}"
            memory.source = path
            LIVE.notes(memory).load_settings = (path, mtime, devices, cpu_ranks, gpu_ranks, requested)
            return LIVE.adopt(memory, node_id, key)

        def make():
            # on the host tier the file is mapped, not read: the store is ready at once
            store = make_store(config.rows_per_layer, config.hidden, dtype, devices, cpu_ranks, gpu_ranks, placement,
                               host=lambda: HostRowStore.from_table_file(path), name=f"the memory {memory_name}", reason=why)
            try:
                # A cancel before or during the load: drop the tables (below) rather than hand them on.
                comfy.model_management.throw_exception_if_processing_interrupted()
                if not isinstance(store, HostRowStore):  # a file saved at another rank count loads too (its padding rows differ)
                    store.load_table_file(path, rows_needed=needed)
                comfy.model_management.throw_exception_if_processing_interrupted()
                return wrap(store)
            except BaseException:
                store.close()
                raise

        def reload(memory):
            comfy.model_management.throw_exception_if_processing_interrupted()
            memory.store.load_table_file(path, rows_needed=needed)
            memory.mark_untracked()
            memory.version += 1
            comfy.model_management.throw_exception_if_processing_interrupted()

        memory, lost = LIVE.replace(node_id, key, make, reload, wrap)
        LIVE.notes(memory).clean_version = memory.version
        LIVE.notes(memory).load_settings = (path, mtime, devices, cpu_ranks, gpu_ranks, requested)
        if clip is not None:
            with serving("Load Engram Memory", memory):
                bind(memory, clip)
        text = f"{memory_name}: {memory!r}\n{placement_text(memory.store)}"
        if lost is not None and lost.startswith("lost"):
            logger.warning("engram: the memory from %s was %s; rebuilt it from the file", memory_name, lost)
            text = f"Rebuilt from {memory_name}: the previous memory was {lost}.\n{text}"
        elif lost is not None:
            text = f"Loaded again from {memory_name} (the previous memory was {lost}).\n{text}"
        return io.NodeOutput(memory, ui={"text": [text], "worker_pids": worker_pids(memory)})


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
        if any(ord(c) < 32 or ord(c) == 127 for c in name):
            raise ValueError(f"Save Engram Memory: name {name!r} holds a control character (such as a NUL byte); use printable characters")
        if not name.endswith(".safetensors"):
            name += ".safetensors"
        if len(os.fsencode(name)) > 255:
            raise ValueError(f"Save Engram Memory: name {name[:40]!r}... is {len(os.fsencode(name))} bytes long with its "
                             ".safetensors extension; a file name may hold at most 255")
        folder = folder_paths.get_folder_paths(FOLDER)[0]
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, name)
        try:
            with serving("Save Engram Memory", memory):
                memory.save(path)
        except TableFileWriteError as exc:  # a read-only folder, a full disk: the input and the file named
            raise TableFileWriteError(exc.errno, f"Save Engram Memory: name {name!r} could not be saved: {exc.strerror}") from exc
        return io.NodeOutput(memory, ui={"text": [f"saved {path} (version {memory.version})"]})


def _apply_to_conditioning(conditioning: list, memory: EngramMemory, tokens: dict, strength: float, looked_up: tuple | None = None) -> list:
    out = []
    for cond, extra in conditioning:
        out.append([memory.apply(cond, tokens, strength, looked_up=looked_up), dict(extra)])
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
                io.Float.Input("strength", default=1.0, min=STRENGTH_RANGE[0], max=STRENGTH_RANGE[1], step=0.05, tooltip="How much of the memory to add (1 = exactly what was memorized)."),
            ],
            outputs=[io.Conditioning.Output(display_name="CONDITIONING", tooltip="The prompt's conditioning with the memory added.")],
        )

    @classmethod
    def execute(cls, clip, text, memory, strength) -> io.NodeOutput:
        strength = finite_input("Engram Text Encode", "strength", strength, *STRENGTH_RANGE)
        with serving("Engram Text Encode", memory):
            bind(memory, clip)
            tokens = tokenize(clip, text)
            # The rows each token reads follow from its id alone: look them up while the encoder runs.
            conditioning, looked_up = memory.lookup_beside(tokens, lambda: encode(clip, tokens))
            out = _apply_to_conditioning(conditioning, memory, tokens, strength, looked_up)
            ui = hit_report(memory, tokens, clip, looked_up)
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
                io.Float.Input("strength", default=1.0, min=STRENGTH_RANGE[0], max=STRENGTH_RANGE[1], step=0.05, tooltip="How much of the memory to add."),
                io.Clip.Input("clip", optional=True, tooltip="The text encoder, for its tokenizer (optional when the memory was made or used with it in this session)."),
            ],
            outputs=[io.Conditioning.Output(display_name="CONDITIONING", tooltip="The conditioning with the memory added.")],
        )

    @classmethod
    def execute(cls, conditioning, text, memory, strength, clip=None) -> io.NodeOutput:
        strength = finite_input("Engram Apply", "strength", strength, *STRENGTH_RANGE)
        with serving("Engram Apply", memory):
            if clip is not None:
                bind(memory, clip)
            host_clip = LIVE.notes(memory).clip
            if host_clip is None:
                raise EngramMemoryError("connect the CLIP: this memory has not met its tokenizer yet")
            tokens = tokenize(host_clip, text)
            # The conditioning was encoded upstream (nothing left to hide the lookup behind): look up once,
            # for the injection and the hit report alike.
            looked_up = memory.values(tokens)
            out = _apply_to_conditioning(conditioning, memory, tokens, strength, looked_up)
            ui = hit_report(memory, tokens, clip if clip is not None else host_clip, looked_up)
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
        with serving("Engram Memorize", memory):
            bind(memory, clip)
            tokens = tokenize(clip, text)
            base = finite_conditioning(encode(clip, tokens)[0][0], "Engram Memorize: the conditioning `clip` makes of input 'text'")
            if target is not None:
                target_cond = finite_conditioning(target[0][0], "Engram Memorize: input 'target' (the target conditioning)")
            elif target_text.strip():
                target_cond = finite_conditioning(encode(clip, tokenize(clip, target_text))[0][0],
                                                   "Engram Memorize: the conditioning `clip` makes of input 'target_text'")
            else:
                raise EngramMemoryError("give a target: connect a target CONDITIONING or write a target_text")
            written = memory.memorize(tokens, base, target_cond)
        if not written:
            raise EngramMemoryError(f"Engram Memorize: {text!r} has no n-gram to store; use a phrase of at least two tokens")
        summary = f"memorized {text!r}: {sum(written.values())} rows in {len(written)} stream(s), version {memory.version}"
        return io.NodeOutput(memory, ui={"text": [summary]})


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
                io.String.Input("pairs_file", default="engram_pairs.jsonl", tooltip="JSONL file in ComfyUI's input folder (its name there; files elsewhere are refused). One pair per line, each text at most 4096 characters."),
                io.Int.Input("steps", default=200, min=1, max=100000, tooltip="Optimizer steps."),
                io.Float.Input("learning_rate", default=0.05, min=LEARNING_RATE_RANGE[0], max=LEARNING_RATE_RANGE[1], step=0.001, tooltip="Adam learning rate."),
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
        learning_rate = finite_input("Engram Train", "learning_rate", learning_rate, *LEARNING_RATE_RANGE)
        path = inside_input(pairs_file, "Engram Train: pairs_file")
        cancel = comfy.model_management.throw_exception_if_processing_interrupted
        try:
            pairs = read_pairs(path, cancel)
        except ValueError as exc:
            raise ValueError(f"Engram Train: {exc}") from exc
        with serving("Engram Train", memory):
            return cls._train(memory, clip, path, pairs, steps, learning_rate, batch_size, seed)

    @classmethod
    def _train(cls, memory, clip, path, pairs, steps, learning_rate, batch_size, seed) -> io.NodeOutput:
        bind(memory, clip)
        name = os.path.basename(path)
        examples = []
        for item in pairs:
            comfy.model_management.throw_exception_if_processing_interrupted()
            line = f"Engram Train: {name} line {item['line']}"
            tokens = tokenize(clip, item["prompt"])
            base = finite_conditioning(encode(clip, tokens)[0][0], f"{line}: the conditioning of \"prompt\"")
            if isinstance(item.get("target"), str):
                target = finite_conditioning(encode(clip, tokenize(clip, item["target"]))[0][0], f"{line}: the conditioning of \"target\"")
            else:
                where = f"{line}: target_conditioning"
                cond_path = inside_input(item["target_conditioning"], where, relative_to=os.path.dirname(path))
                try:
                    target = comfy.utils.load_torch_file(cond_path, safe_load=True)["cond"]
                except Exception as exc:
                    raise ValueError(f"{where}: cannot read key 'cond' of {item['target_conditioning']}: {exc}") from exc
                if target.dim() == 2:
                    target = target.unsqueeze(0)
                finite_conditioning(target, f"{where} {item['target_conditioning']!r} (key 'cond')")
            # Each pair becomes its examples at once (only its streams' columns), so the whole CONDITIONING
            # of every pair is never held together.
            examples.extend(memory.examples([(tokens, base, target)]))
        bar = comfy.utils.ProgressBar(steps)

        def progress(step, total, loss):
            bar.update_absolute(step, total)

        checked = [time.monotonic()]

        def should_stop():
            comfy.model_management.throw_exception_if_processing_interrupted()
            # Steps run on the host's copy of the touched rows; notice a dead worker now, not at write-back.
            if time.monotonic() - checked[0] > _HEALTH_PERIOD_S:
                memory.check()
                checked[0] = time.monotonic()
            return False

        result = memory.fit(examples, steps=steps, lr=learning_rate, batch_size=batch_size, seed=seed, progress=progress,
                            should_stop=should_stop, cancel=comfy.model_management.throw_exception_if_processing_interrupted)
        summary = f"trained {result.steps} steps on {len(pairs)} pairs: loss {result.losses[0]:.5g} -> {result.losses[-1]:.5g}" if result.losses else "nothing to train"
        return io.NodeOutput(memory, loss_curve_image(result.losses), ui={"text": [summary], "losses": result.losses})


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
        with serving("Engram Inspect", memory):
            bind(memory, clip)
            tokens = tokenize(clip, text)
            hits = memory.hits(tokens)
            ui = hit_report(memory, tokens, clip)
        tokenizers = clip_tokenizers(clip)
        by_stream = {s.name: s.token_key for s in memory.config.layout.streams}
        lines = [f"{memory!r}"]
        for h in hits:
            word = tokenizers[by_stream[h.stream]].decode([h.token_id]).strip() if by_stream[h.stream] in tokenizers else str(h.token_id)
            lines.append(f"{h.stream} row {h.row:4d} {word!r:>16}: {h.entries_hit}/{h.entries} entries, |v| = {h.norm:.4g}")
        report = "\n".join(lines)
        ui["text"] = [report]
        return io.NodeOutput(heat_map(hits), report, ui=ui)


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
