"""The tiny world's trained models, ready to load: committed weights unpacked, or trained when they are stale.

    python scripts/tiny_world_cache.py [--seed 0]        make sure the cache holds the models (prints their folder)
    python scripts/tiny_world_cache.py --train           train them here instead (about 10 minutes on one thread)
    python scripts/tiny_world_cache.py --commit          pack the cache's trained files into scripts/tiny_world_weights/

The models are what scripts/train_tiny.py trains (612 s on this project's 2-core machine). So that the
first demo on a fresh clone does not spend those ten minutes, the weights of seed 0 are committed in
scripts/tiny_world_weights/ (3.5 MB): each tensor cropped to the box that holds its non-zero values (the
VAE's unused TAESD blocks and zero padding, the MMDiT's context columns that CLIP-L never fills), with
its full shape and the SHA-256 of its full bytes beside it. Unpacking rebuilds the files training writes,
tensor for tensor (the hashes are checked), and makes the random CLIP-L from its seed as training does.

They are used only when their `key` equals `cache_key()`: a hash of the code that makes the weights
(train_tiny.py, tiny_world.py, tiny_models.py) and the recipe. Change any of those and the next run
trains; `tests/unit/test_tiny_world_weights.py` fails until `--train --commit` brings them up to date.
Everything lands in `.host/tiny-world/seed<seed>-<key>/`.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import logging
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
sys.path.insert(0, str(SCRIPTS))
import train_tiny  # noqa: E402  (the training: Recipe and the file names; imports no torch at module level)

logger = logging.getLogger("tiny_world_cache")

CACHE = ROOT / ".host" / "tiny-world"
COMMITTED = SCRIPTS / "tiny_world_weights"
TRAINED_FILES = (train_tiny.UNET, train_tiny.VAE)  # the two trained files, committed cropped under these names
HASHED = ("train_tiny.py", "tiny_world.py", "tiny_models.py")


def cache_key(recipe: train_tiny.Recipe) -> str:
    h = hashlib.sha256()
    for name in HASHED:
        h.update((SCRIPTS / name).read_bytes())
    h.update(json.dumps(asdict(recipe), sort_keys=True).encode())
    return h.hexdigest()[:16]


def folder(seed: int = 0, cache: Path = CACHE) -> Path:
    return Path(cache) / f"seed{seed}-{cache_key(train_tiny.Recipe(seed=seed))}"


def committed_report(seed: int, committed: Path = COMMITTED) -> dict | None:
    """The committed training report when the committed weights are this code's seed `seed`, else None."""
    path = committed / train_tiny.REPORT
    if not path.exists():
        return None
    report = json.loads(path.read_text())
    if report.get("seed") != seed or report.get("key") != cache_key(train_tiny.Recipe(seed=seed)):
        return None
    return report


def ensure(seed: int = 0, cache: Path = CACHE, python: str | None = None, quiet: bool = False,
           committed: Path = COMMITTED) -> dict:
    """The trained models of `seed`, in the cache: unpacked from the committed weights when they are this
    code's (seconds), else trained (minutes), in a child process of the ComfyUI tree's python. Returns the
    training report with `unet`, `vae`, `clip` and `folder` paths and `source` ("committed" or "trained")
    added. Safe to call from several processes at once (the second waits for the first)."""
    out = folder(seed, cache)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / train_tiny.REPORT).exists():
            if python is None:
                from comfyhost import comfyui_python

                python = str(comfyui_python())
            if committed_report(seed, committed) is not None:
                cmd = [python, str(Path(__file__)), "--unpack", "--seed", str(seed), "--out", str(out), "--committed", str(committed)]
            else:
                logger.info("no committed weights for seed %d of this training code: training (about 10 minutes)", seed)
                cmd = [python, str(SCRIPTS / "train_tiny.py"), "--seed", str(seed), "--out", str(out)]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL if quiet else None)
        report = json.loads((out / train_tiny.REPORT).read_text())
    report.update(unet=str(out / train_tiny.UNET), vae=str(out / train_tiny.VAE), clip=str(out / train_tiny.CLIP_L), folder=str(out))
    report.setdefault("source", "trained")
    return report


# ----- cropping: a tensor as the box that holds its non-zero values -----

def tensor_digest(t) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes (its values, whatever the file around it)."""
    import torch

    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def crop(t):
    """The smallest leading box of `t` outside which every value is +0.0 (None when all are). Bits, not
    values, decide: a -0.0 stays inside, so uncrop gives back the same bytes."""
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    nonzero = t.detach().contiguous().view(ints).ne(0)
    if not bool(nonzero.any()):
        return None
    if t.ndim == 0:
        return t
    box = tuple(int(i) + 1 for i in nonzero.nonzero().amax(dim=0))
    return t[tuple(slice(0, n) for n in box)].contiguous()


def uncrop(part, shape, dtype):
    import torch

    full = torch.zeros(shape, dtype=dtype)
    if part is not None:
        if full.ndim == 0:
            full.copy_(part)
        else:
            full[tuple(slice(0, n) for n in part.shape)] = part
    return full


def pack(src: Path, dst: Path) -> dict:
    """Write `src`'s tensors cropped to `dst` (temporary file renamed into place); returns the table of
    full shapes, dtypes and digests kept in its metadata."""
    from safetensors.torch import load_file, save_file

    table, parts = {}, {}
    for name, t in load_file(str(src)).items():
        part = crop(t)
        table[name] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "sha256": tensor_digest(t),
                       "stored": part is not None}
        if part is not None:
            parts[name] = part
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    try:
        # one metadata entry: safetensors writes several in no fixed order, and the file should not change
        # when the same weights are committed again
        save_file(parts, str(tmp), metadata={"fp8_engram_cropped": json.dumps({"source": src.name, "tensors": table}, sort_keys=True)})
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return table


def unpack(src: Path) -> dict:
    """The full tensors of a cropped file, each checked against its recorded digest."""
    import torch
    from safetensors import safe_open

    with safe_open(str(src), "pt") as f:
        table = json.loads((f.metadata() or {}).get("fp8_engram_cropped", "{}")).get("tensors")
        if not isinstance(table, dict):
            raise ValueError(f"{src}: not a cropped weights file (no 'tensors' table in its metadata)")
        stored = set(f.keys())
        out = {}
        for name, entry in table.items():
            if entry["stored"] and name not in stored:
                raise ValueError(f"{src}: tensor {name} is listed but not stored")
            part = f.get_tensor(name) if entry["stored"] else None
            full = uncrop(part, entry["shape"], getattr(torch, entry["dtype"]))
            if tensor_digest(full) != entry["sha256"]:
                raise ValueError(f"{src}: tensor {name} does not rebuild to the recorded bytes (damaged file?)")
            out[name] = full
    return out


def unpack_into(out: Path, seed: int, committed: Path = COMMITTED) -> dict:
    """Write the cache folder from the committed weights: the two trained files, the random CLIP-L (made
    from its seed, as training makes it), the report last (its presence marks the folder complete)."""
    import torch

    import tiny_models

    report = committed_report(seed, committed)
    if report is None:
        raise ValueError(f"{committed}: no weights of seed {seed} made by this training code (key {cache_key(train_tiny.Recipe(seed=seed))})")
    out.mkdir(parents=True, exist_ok=True)
    comfy, _, _ = tiny_models.import_comfy(tiny_models.comfyui_path(None))
    tiny_models.save(tiny_models.make_clip_l(comfy, torch), out / train_tiny.CLIP_L)
    for name in TRAINED_FILES:
        tiny_models.save(unpack(committed / name), out / name)
    report = dict(report, source="committed")
    (out / train_tiny.REPORT).write_text(json.dumps(report, indent=1) + "\n")
    return report


def commit(seed: int = 0, cache: Path = CACHE, committed: Path = COMMITTED) -> dict:
    """Pack the cache's trained files of `seed` (trained by this code) into `committed`."""
    src = folder(seed, cache)
    report = json.loads((src / train_tiny.REPORT).read_text())
    if report.get("source", "trained") != "trained":
        raise ValueError(f"{src} was unpacked from committed weights, not trained: run --train first")
    committed.mkdir(parents=True, exist_ok=True)
    for name in TRAINED_FILES:
        pack(src / name, committed / name)
    report["key"] = cache_key(train_tiny.Recipe(seed=seed))
    tmp = committed / f".{train_tiny.REPORT}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, committed / train_tiny.REPORT)
    logger.info("committed weights of seed %d (key %s): %.2f MB", seed, report["key"],
                sum((committed / n).stat().st_size for n in TRAINED_FILES) / 1e6)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--train", action="store_true", help="train into the cache even when committed weights fit")
    parser.add_argument("--commit", action="store_true", help="then pack the cache's trained files into scripts/tiny_world_weights/")
    parser.add_argument("--unpack", action="store_true", help=argparse.SUPPRESS)  # ensure()'s child
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--committed", type=Path, default=COMMITTED, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[tiny_world] %(message)s")
    if args.unpack:
        unpack_into(args.out, args.seed, args.committed)
        return 0
    if args.train:
        out = folder(args.seed, args.cache)
        if not (out / train_tiny.REPORT).exists() or json.loads((out / train_tiny.REPORT).read_text()).get("source") == "committed":
            (out / train_tiny.REPORT).unlink(missing_ok=True)
            train_tiny.main(["--seed", str(args.seed), "--out", str(out)])
    report = ensure(args.seed, args.cache)
    if args.commit:
        commit(args.seed, args.cache)
    logger.info("%s (%s)", report["folder"], report["source"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
