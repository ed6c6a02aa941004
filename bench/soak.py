"""Soak: many prompts in a row through a real ComfyUI server with this pack, and nothing may grow.

    python bench/soak.py [--prompts 120] [--short] [--seed 0] [--keep DIR]

Boots ComfyUI (scripts/comfyhost.py, its own base directory, loopback only) on the tiny random models
(scripts/tiny_models.py) and queues a fixed cycle of prompts, repeated until --prompts are done:

  fp8        Load FP8 Diffusion Model on one of several FP8 formats (the format changes every time, so
             ComfyUI unloads and reloads models) -> KSampler -> Save Latent
  fp8_te     Load FP8 Text Encoder (CLIP-L converted by the pack) + an FP8 model -> sample (the CLIP
             is swapped there and back every cycle)
  quantize   UNETLoader -> Quantize Model to FP8 (granularity rotates) -> Save FP8 Model, and sample it
  memorize   New Engram Memory (2 CPU ranks) -> Engram Memorize -> Engram Text Encode -> sample, and
             Save Engram Memory (the same file every time, so its loader reloads it)
  load       Load Engram Memory (2 CPU ranks) of that file -> Engram Apply -> sample, Engram Inspect
  train      New Engram Memory -> Engram Train (12 steps) -> Engram Apply -> sample
  cancel     POST /interrupt while a node runs: in turn during a long Engram Train, during Load Engram
             Memory (3 or 4 CPU ranks, a group of its own) and during Load FP8 Diffusion Model
  both       New and Load Engram Memory in one graph (the cycle ends here, so the measurements at the
             end of each cycle see the same cached memories)
--short runs the cycle without fp8_te and train (the test suite's version).

Measured: time per prompt; the server's RSS, open file descriptors and threads, and the engram worker
processes alive, each after the first cycle (warm-up) and after the last. Every prompt must succeed,
except the cancelled ones, which must end as interrupted (or succeed when the cancel came too late).
Targets: RSS growth after warm-up <= 5 %; worker processes and descriptors back to their warm-up
counts; zero unexpected errors. Prints a table and, as its last line, one JSON object; exits 1 when a
target is missed.

Measured on the 2-core CPU machine (2026-11-30, --prompts 104, 13 cycles, about 7.5 min of prompts):
ComfyUI 0.3.75: RSS 1310.2 -> 1325.1 MB (+1.1 %), 42 -> 42 descriptors, 17 -> 17 threads, 2 -> 2
engram workers, 13 of 13 cancels interrupted, 0 unexpected errors, median 2.1 s per prompt.
ComfyUI 0.29.0: RSS 1370.1 -> 1402.6 MB (+2.4 %), 43 -> 43 descriptors, 17 -> 17 threads, 2 -> 2
workers, 13 of 13 cancels interrupted, 0 unexpected errors, median 3.2 s per prompt.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT / ".host" / "pkg", ROOT / "scripts", ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

_pkg_link = ROOT / ".host" / "pkg" / "fp8_engram"  # `import fp8_engram`, as tests/conftest.py sets it up
if not _pkg_link.exists():
    _pkg_link.parent.mkdir(parents=True, exist_ok=True)
    _pkg_link.symlink_to(ROOT, target_is_directory=True)

from helpers.graphs import TINY_CLIP_L, TINY_UNET, fp8_loader  # noqa: E402 (tests/ on sys.path above): the tiny models' names

logger = logging.getLogger("soak")

CYCLE = ("fp8", "memorize", "quantize", "load", "fp8_te", "train", "cancel", "both")
# The suite's short soak: the same nodes and cancels, without the costly CLIP swaps and training runs.
SHORT_CYCLE = ("fp8", "memorize", "quantize", "load", "cancel", "both")
FP8_FORMATS = ("comfy_quant_per_layer", "musubi_block64", "comfy_scaled_fp8", "modelopt_channel",
               "blockwise_scale_inv", "plain_e5m2", "comfy_quant_metadata", "musubi_channel")
GRANULARITIES = ("tensor", "row", "block")
CANCELS = ("train", "engram_load", "fp8_load")
RSS_GROWTH_MAX = 0.05
PHRASE, TARGET_PHRASE = "glowing crystal apple", "rusty old bicycle"
WITH_PHRASE = f"{PHRASE} on a wooden table"
MEMORY_FILE = "soak_memory"
NEW_MEMORY = {"max_order": 3, "heads": 4, "rows_per_head": 1021, "dtype": "bf16", "devices": "cpu",
              "cpu_ranks": 2, "context_gate": False, "seed": 0}


# ----- files -----

def prepare_models(base: Path) -> dict:
    """Tiny models (cached per machine), FP8 files in several formats, an FP8 CLIP-L, training pairs."""
    from comfyhost import prepare_base_dir
    from helpers import fp8_files
    from safetensors.torch import load_file

    cache = ROOT / ".host" / "cache" / "models"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "tiny_models.py"), str(cache)], check=True,
                   stdout=subprocess.DEVNULL)
    prepare_base_dir(base)
    models = base / "models"
    for src in cache.rglob("*.safetensors"):
        dst = models / src.relative_to(cache)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not dst.exists():
            dst.symlink_to(src)
    unet = load_file(str(models / "diffusion_models" / TINY_UNET))
    formats = []
    for fmt in FP8_FORMATS:
        path = models / "diffusion_models" / f"soak_{fmt}.safetensors"
        if not path.exists():
            fp8_files.write_format(unet, path, fmt)
        formats.append(path.name)
    from fp8_engram.quant.convert import convert_file

    clip = models / "text_encoders" / "soak_clip_l_fp8.safetensors"
    if not clip.exists():
        convert_file(models / "text_encoders" / TINY_CLIP_L, clip)
    pairs = [{"prompt": f"{s} with a {PHRASE}", "target": f"{s} with a {TARGET_PHRASE}"} for s in ("a cat", "a robot")]
    (base / "input" / "soak_pairs.jsonl").write_text("\n".join(json.dumps(p) for p in pairs) + "\n")
    return {"fp8": formats, "clip_fp8": clip.name}


# ----- graphs -----

def _sample(graph: dict, positive: list, seed: int, model: list | None = None) -> dict:
    graph.setdefault("1", {"class_type": "UNETLoader", "inputs": {"unet_name": TINY_UNET, "weight_dtype": "default"}})
    graph.setdefault("2", {"class_type": "CLIPLoader", "inputs": {"clip_name": TINY_CLIP_L, "type": "sd3"}})
    graph["4"] = {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": ""}}
    graph["5"] = {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}
    graph["6"] = {"class_type": "KSampler", "inputs": {
        "model": model or ["1", 0], "positive": positive, "negative": ["4", 0], "latent_image": ["5", 0],
        "seed": seed, "steps": 2, "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}}
    graph["10"] = {"class_type": "SaveLatent", "inputs": {"samples": ["6", 0], "filename_prefix": "soak/latent"}}
    return graph


def _clip_encode(text: str) -> dict:
    return {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": text}}


def _new_memory() -> dict:
    return {"class_type": "FP8Engram.NewEngramMemory", "inputs": {"clip": ["2", 0], **NEW_MEMORY}}


def _load_memory(node_ranks: int = 2) -> dict:
    return {"class_type": "FP8Engram.LoadEngramMemory", "inputs": {
        "memory_name": f"{MEMORY_FILE}.safetensors", "devices": "cpu", "cpu_ranks": node_ranks}}


def _engram_encode(memory: list, text: str) -> dict:
    return {"class_type": "FP8Engram.EngramTextEncode", "inputs": {"clip": ["2", 0], "text": text, "memory": memory, "strength": 1.0}}


def _engram_apply(memory: list, strength: float) -> dict:
    """The memory added to node 40's cached CLIP Text Encode of WITH_PHRASE: a fetch without a CLIP run."""
    return {"class_type": "FP8Engram.EngramApply", "inputs": {
        "conditioning": ["40", 0], "text": WITH_PHRASE, "memory": memory, "strength": strength, "clip": ["2", 0]}}


def _memorize(memory: list) -> dict:
    return {"class_type": "FP8Engram.EngramMemorize", "inputs": {
        "memory": memory, "clip": ["2", 0], "text": PHRASE, "target_text": "", "target": ["41", 0]}}


def _with_texts(graph: dict) -> dict:
    """Nodes 40/41: CLIP Text Encode of constant texts (cached by ComfyUI while the CLIP stays)."""
    graph["40"] = _clip_encode(WITH_PHRASE)
    graph["41"] = _clip_encode(TARGET_PHRASE)
    return graph


def _train(memory: list, steps: int) -> dict:
    return {"class_type": "FP8Engram.EngramTrain", "inputs": {
        "memory": memory, "clip": ["2", 0], "pairs_file": "soak_pairs.jsonl", "steps": steps,
        "learning_rate": 0.05, "batch_size": 2, "seed": 0}}


class Plan:
    """The prompt for step i of the soak: (kind, graph, cancel trigger or None)."""

    def __init__(self, files: dict, seed: int, cycle: tuple[str, ...] = CYCLE) -> None:
        self.files = files
        self.cycle = cycle
        self.rng = random.Random(seed)
        self.count = {kind: 0 for kind in cycle}

    def prompt(self, i: int) -> tuple[str, dict, tuple | None]:
        kind = self.cycle[i % len(self.cycle)]
        n = self.count[kind]
        self.count[kind] += 1
        seed = i + 1
        strength = round(0.5 + self.rng.random(), 4)  # new every prompt: the memory's users run again
        text = f"{PHRASE} on a wooden table, picture {i}"
        formats = self.files["fp8"]
        if kind == "fp8":
            graph = _with_texts({"1": fp8_loader(formats[(2 * n) % len(formats)])})
            return kind, _sample(graph, ["40", 0], seed), None
        if kind == "fp8_te":
            graph = {"1": fp8_loader(formats[(2 * n + 1) % len(formats)], "weight-only"),
                     "2": {"class_type": "FP8Engram.LoadFP8TextEncoder", "inputs": {
                         "clip_name": self.files["clip_fp8"], "type": "sd3", "compute_path": "auto",
                         "activation_scaling": "static", "compute_dtype": "auto"}},
                     "3": _clip_encode(text)}
            return kind, _sample(graph, ["3", 0], seed), None
        if kind == "quantize":
            graph = _with_texts({
                "20": {"class_type": "FP8Engram.QuantizeModelToFP8", "inputs": {
                    "model": ["1", 0], "granularity": GRANULARITIES[n % len(GRANULARITIES)],
                    "fp8_dtype": "e4m3fn" if n % 4 else "e5m2", "keep_patterns": "x_embedder.*, final_layer.*"}},
                "21": {"class_type": "FP8Engram.SaveFP8Model", "inputs": {"model": ["20", 0], "filename_prefix": "soak/fp8"}}})
            return kind, _sample(graph, ["40", 0], seed, model=["20", 0]), None
        if kind == "memorize":
            graph = _with_texts({"30": _new_memory(), "31": _memorize(["30", 0]), "3": _engram_encode(["31", 0], text),
                                 "32": {"class_type": "FP8Engram.SaveEngramMemory", "inputs": {"memory": ["31", 0], "name": MEMORY_FILE}}})
            return kind, _sample(graph, ["3", 0], seed), None
        if kind == "load":
            graph = _with_texts({"35": _load_memory(), "3": _engram_apply(["35", 0], strength),
                                 "36": {"class_type": "FP8Engram.EngramInspect", "inputs": {"memory": ["35", 0], "clip": ["2", 0], "text": text}}})
            return kind, _sample(graph, ["3", 0], seed), None
        if kind == "train":
            graph = _with_texts({"30": _new_memory(), "33": _train(["30", 0], 12), "3": _engram_apply(["33", 0], strength)})
            return kind, _sample(graph, ["3", 0], seed), None
        if kind == "cancel":
            what = CANCELS[n % len(CANCELS)]
            if what == "train":
                graph = _with_texts({"30": _new_memory(), "33": _train(["30", 0], 100000), "3": _engram_apply(["33", 0], strength)})
                return f"cancel_{what}", _sample(graph, ["3", 0], seed), ("progress", "33")
            if what == "engram_load":
                graph = _with_texts({"37": _load_memory(3), "3": _engram_apply(["37", 0], strength)})
                graph["37"]["inputs"]["cpu_ranks"] = 3 + (n // len(CANCELS)) % 2  # a new group each time
                return f"cancel_{what}", _sample(graph, ["3", 0], seed), ("executing", "37")
            graph = _with_texts({"1": fp8_loader(formats[n % len(formats)], "weight-only")})
            graph["1"]["inputs"]["compute_dtype"] = ("bfloat16", "float32")[(n // len(CANCELS)) % 2]  # a fresh load
            return f"cancel_{what}", _sample(graph, ["40", 0], seed), ("executing", "1")
        # "both": the cycle's last prompt, so every cycle ends with the same memories cached
        graph = _with_texts({"30": _new_memory(), "31": _memorize(["30", 0]), "3": _engram_apply(["31", 0], strength),
                             "35": _load_memory(), "39": _engram_apply(["35", 0], strength)})
        graph["38"] = {"class_type": "FP8Engram.ConditioningSimilarity", "inputs": {"a": ["3", 0], "b": ["39", 0], "first_row": 0, "rows": 0}}
        return kind, _sample(graph, ["3", 0], seed), None


# ----- running prompts -----

class Runner:
    """Queues prompts on one server, sends /interrupt when a websocket message matches a trigger."""

    def __init__(self, client) -> None:
        import websocket

        self.client = client
        self.ws = websocket.create_connection(f"{client.url.replace('http', 'ws', 1)}/ws?clientId={client.client_id}", timeout=0.5)
        self.ws_timeout = websocket.WebSocketTimeoutException

    def close(self) -> None:
        self.ws.close()

    def run(self, graph: dict, trigger: tuple | None, timeout: float = 600.0) -> tuple[str, str, float]:
        """(outcome: ok | interrupted | error, detail, seconds)."""
        import requests

        started = time.monotonic()
        prompt_id = self.client.queue(graph)
        fired = threading.Event()
        deadline = started + timeout
        while time.monotonic() < deadline:  # bounded: each recv waits at most 0.5 s
            try:
                raw = self.ws.recv()
            except self.ws_timeout:
                continue
            if not isinstance(raw, str):
                continue
            message = json.loads(raw)
            kind, data = message.get("type"), message.get("data") or {}
            if data.get("prompt_id") != prompt_id:
                continue
            if trigger and not fired.is_set() and kind == trigger[0] and data.get("node") == trigger[1]:
                requests.post(self.client.url + "/interrupt", json={}, timeout=10)
                fired.set()
            if kind == "execution_success" or (kind == "executing" and data.get("node") is None):
                break
            if kind in ("execution_error", "execution_interrupted"):
                break
        from comfyhost import WorkflowError

        try:
            self.client.wait(prompt_id, timeout=max(1.0, deadline - time.monotonic()))
            return "ok", "", time.monotonic() - started
        except WorkflowError as exc:
            messages = exc.details.get("status", {}).get("messages", [])
            if any(kind == "execution_interrupted" for kind, _ in messages):
                node = next(data.get("node_type") for kind, data in messages if kind == "execution_interrupted")
                return "interrupted", node, time.monotonic() - started
            return "error", str(exc)[:500], time.monotonic() - started


# ----- measurements -----

def engram_workers(server_pid: int) -> int:
    import psutil

    count = 0
    for child in psutil.Process(server_pid).children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "engram" in " ".join(child.cmdline()) and "worker" in " ".join(child.cmdline()):
                count += 1
        except psutil.NoSuchProcess:
            pass
    return count


def snapshot(server_pid: int, settle_s: float = 15.0) -> dict:
    """The server's RSS, descriptors, threads and engram workers, once the worker count is steady
    (parked memories are released just after a prompt ends)."""
    import psutil

    deadline = time.monotonic() + settle_s
    last, steady_since = engram_workers(server_pid), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - steady_since < 1.5:
        time.sleep(0.25)
        now = engram_workers(server_pid)
        if now != last:
            last, steady_since = now, time.monotonic()
    process = psutil.Process(server_pid)
    return {"rss_mb": process.memory_info().rss / 2**20, "fds": process.num_fds(), "threads": process.num_threads(), "workers": last}


# ----- main -----

def soak(prompts: int, seed: int, base: Path, cycle: tuple[str, ...] = CYCLE) -> dict:
    from comfyhost import ComfyServer

    files = prepare_models(base)
    server = ComfyServer(base_dir=base)
    server.start()
    runner = None
    records = []
    try:
        runner = Runner(server.client())
        plan = Plan(files, seed, cycle)
        cycles = max(2, -(-prompts // len(cycle)))
        warm = None
        for i in range(cycles * len(cycle)):
            kind, graph, trigger = plan.prompt(i)
            outcome, detail, seconds = runner.run(graph, trigger)
            records.append({"i": i, "kind": kind, "outcome": outcome, "detail": detail, "s": seconds})
            logger.info("%3d %-18s %-11s %6.2f s %s", i, kind, outcome, seconds, detail)
            if i == len(cycle) - 1:
                warm = snapshot(server.process.pid)
        end = snapshot(server.process.pid)
    finally:
        if runner is not None:
            runner.close()
        log_tail = server.log_tail(60)
        server.stop()
    unexpected = [r for r in records if r["outcome"] == "error" or (r["outcome"] == "interrupted" and not r["kind"].startswith("cancel"))]
    if unexpected:
        logger.error("server log tail:\n%s", log_tail)
    return {"records": records, "warm": warm, "end": end, "unexpected": unexpected}


def report(result: dict) -> dict:
    records, warm, end = result["records"], result["warm"], result["end"]
    by_kind: dict[str, list] = {}
    for r in records:
        by_kind.setdefault(r["kind"], []).append(r)
    print(f"{'kind':<18} {'n':>4} {'ok':>4} {'intr':>5} {'err':>4} {'median s':>9} {'max s':>7}")
    for kind, rs in by_kind.items():
        times = [r["s"] for r in rs]
        print(f"{kind:<18} {len(rs):>4} {sum(r['outcome'] == 'ok' for r in rs):>4} "
              f"{sum(r['outcome'] == 'interrupted' for r in rs):>5} {sum(r['outcome'] == 'error' for r in rs):>4} "
              f"{statistics.median(times):>9.2f} {max(times):>7.2f}")
    print()
    print(f"{'after':<10} {'RSS MB':>9} {'fds':>5} {'threads':>8} {'workers':>8}")
    for name, snap in (("warm-up", warm), ("end", end)):
        print(f"{name:<10} {snap['rss_mb']:>9.1f} {snap['fds']:>5} {snap['threads']:>8} {snap['workers']:>8}")
    growth = end["rss_mb"] / warm["rss_mb"] - 1.0
    cancels = [r for r in records if r["kind"].startswith("cancel")]
    for r in result["unexpected"]:
        print(f"UNEXPECTED prompt {r['i']} ({r['kind']}): {r['outcome']} {r['detail']}")
    figures = {
        "bench": "soak",
        "cycle": sorted({r["kind"] for r in records}),
        "prompts": len(records),
        "seconds_total": round(sum(r["s"] for r in records), 1),
        "seconds_per_prompt_median": round(statistics.median(r["s"] for r in records), 3),
        "rss_mb_warm": round(warm["rss_mb"], 1),
        "rss_mb_end": round(end["rss_mb"], 1),
        "rss_growth": round(growth, 4),
        "fds_warm": warm["fds"], "fds_end": end["fds"],
        "threads_warm": warm["threads"], "threads_end": end["threads"],
        "workers_warm": warm["workers"], "workers_end": end["workers"],
        "cancels": len(cancels),
        "cancels_interrupted": sum(r["outcome"] == "interrupted" for r in cancels),
        "unexpected_errors": len(result["unexpected"]),
        "per_kind_median_s": {k: round(statistics.median(r["s"] for r in rs), 3) for k, rs in by_kind.items()},
    }
    figures["passed"] = bool(growth <= RSS_GROWTH_MAX and end["fds"] <= warm["fds"] and end["workers"] == warm["workers"]
                             and not result["unexpected"])
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=120, help="at least this many prompts (whole cycles of %d)" % len(CYCLE))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--short", action="store_true", help="the suite's cycle: %s" % ", ".join(SHORT_CYCLE))
    parser.add_argument("--keep", type=Path, default=None, help="use this base directory and keep it (default: a temporary one)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[soak] %(message)s", stream=sys.stderr)
    base = args.keep or Path(tempfile.mkdtemp(prefix="fp8engram-soak-"))
    try:
        figures = report(soak(args.prompts, args.seed, base, SHORT_CYCLE if args.short else CYCLE))
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(figures))
    return 0 if figures["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
