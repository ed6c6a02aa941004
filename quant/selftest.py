"""Proves every fast path of this device on the linear shapes of Flux, Wan and SD3, and prints the verdicts.

    python -m fp8_engram.quant.selftest [--device cuda:0] [--json] [--tokens 256,4608] [--models flux,wan,sd3]
                                        [--cache FILE]

For each model's linear shapes, token count and weight layout (FP8 per row, per tensor, 128x128 blocks;
int8 per channel, and per tensor with ComfyUI's ConvRot, where comfy-kitchen's int8 is a candidate too
when it is installed; NVFP4 on CUDA), the product runs once through ``linear`` under "auto" (and, on the CPU, forced fp8 and
int8 too), so every candidate path is proven against its twin and timed against the plain path exactly
as a model's first use would (``compute/prove.py``); the table lists each verdict with its figures.
This is the one thing to attach to a bug report about speed or wrong images. Without ``--cache`` nothing
is read or written: every path is proven anew. Never imports ComfyUI.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import torch

from .compute import int8 as int8_path
from .compute.book import Book, Verdict, describe, stack_facts
from .compute.linear import linear
from .config import ComputeConfig
from .layouts import NVFP4, Block, Int8, PerRow, PerTensor
from .tensor import QuantizedTensor

# (out features, in features) of the linears that repeat in each model's blocks
SHAPES = {
    "flux": ((9216, 3072), (3072, 3072), (12288, 3072), (3072, 12288)),
    "wan": ((5120, 5120), (13824, 5120), (5120, 13824)),
    "sd3": ((4608, 1536), (1536, 1536), (6144, 1536), (1536, 6144)),
}
DEFAULT_TOKENS = {"cuda": (256, 4608), "cpu": (16, 256)}


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")


def _weights(n: int, k: int, device) -> dict:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * 7 + k)) * (k ** -0.5)
    out = {"fp8 per row": QuantizedTensor.from_float(w, PerRow()),
           "fp8 per tensor": QuantizedTensor.from_float(w, PerTensor())}
    if n % 128 == 0 and k % 128 == 0:
        out["fp8 block 128"] = QuantizedTensor.from_float(w, Block(128, 128))
    out["int8 per channel"] = int8_path.to_int8(out["fp8 per row"])
    if k % 256 == 0:  # as ComfyUI's int8 files come (one scale, ConvRot 256): comfy-kitchen's too, where present
        out["int8 ConvRot"] = QuantizedTensor.from_float(w, Int8(False, 256, True), fp8_dtype=torch.int8)
    if torch.device(device).type == "cuda":  # the NVFP4 GEMM (the CPU runs NVFP4 weight-only, no choice)
        out["nvfp4"] = QuantizedTensor.from_float(w, NVFP4.for_shape((n, k)))
    return {name: QuantizedTensor.from_parts(q.qdata.to(device), q.scale.to(device), q.layout,
                                             orig_dtype=torch.bfloat16) for name, q in out.items()}


def run(device, models, tokens, cache=None) -> dict:
    """Prove every path on ``models``' shapes at ``tokens`` (products of every size; verdicts read from and
    added to the file ``cache`` where given); returns the report (stack, verdicts, seconds)."""
    device = torch.device(device)
    started = time.perf_counter()
    book = Book(cache, every_size=True)
    configs = [ComputeConfig(book=book)]  # "auto"
    if device.type == "cpu":  # the forced paths, which "auto" does not try on a CPU
        configs += [ComputeConfig(path="fp8", book=book), ComputeConfig(path="int8", book=book)]
    for model in models:
        for n, k in SHAPES[model]:
            weights = _weights(n, k, device)
            for m in tokens:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device=device,
                                                                                    dtype=torch.bfloat16)
                for cfg in configs:
                    for name, w in weights.items():
                        if cfg.path != "auto" and name != "fp8 per row":
                            continue  # a forced path on one FP8 layout is enough
                        with torch.no_grad():
                            linear(x, w, None, cfg)
    found = book.verdicts(device)
    return {"stack": stack_facts(device)[1], "seconds": round(time.perf_counter() - started, 2),
            "verdicts": [dict(key=v.key.as_json(), **v.as_dict()) for v in found]}


def table(report: dict) -> str:
    lines = [f"device: {report['stack'].get('device')} ({report['stack'].get('device_type')}, "
             f"torch {report['stack'].get('torch')}, triton {report['stack'].get('triton')})"]
    lines.append(f"{'kind':<22}{'asked':<20}{'shape class':<48}{'chosen':<13}why")
    for v in report["verdicts"]:
        key = v["key"]
        shape = (f"m class {key['m_class']} n<={key['n_class']} k<={key['k_class']} "
                 f"{key['x_dtype']}>{key['out_dtype']}")
        told = describe(Verdict(key=None, chosen=v["chosen"], why=v["why"], proofs=v["proofs"]))
        lines.append(f"{v['kind']:<22}{key['mode']:<20}{shape:<48}{v['chosen']:<13}{told}")
    lines.append(f"{len(report['verdicts'])} verdicts in {report['seconds']} s")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fp8_engram.quant.selftest", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    ap.add_argument("--tokens", default=None, help="comma-separated token counts (default: by device)")
    ap.add_argument("--models", default="flux,wan,sd3", help=f"any of {','.join(SHAPES)}")
    ap.add_argument("--cache", default=None, help="a verdict file to read and add to (default: none)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        ap.error(f"--device {args.device!r}: {exc}")
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        ap.error(f"--device {args.device}: torch sees {torch.cuda.device_count() if torch.cuda.is_available() else 'no'} "
                 f"CUDA GPU(s) here")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in SHAPES]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from {list(SHAPES)}")
    try:
        tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else DEFAULT_TOKENS.get(
            device.type, DEFAULT_TOKENS["cuda"])
    except ValueError:
        ap.error(f"--tokens must be comma-separated integers, got {args.tokens!r}")
    report = run(device, models, tokens, args.cache)
    _say(json.dumps(report, indent=1) if args.json else table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
