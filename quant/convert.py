"""Command-line FP8 converter and format inspector.

    python -m fp8_engram.quant.convert IN OUT [--granularity tensor|row|block|'int8 tensor'|'int8 row convrot'|'awq w4a16'] [--block 128x128]
                                       [--dtype e4m3fn|e5m2] [--keep PATTERN ...] [--no-default-keep]
                                       [--stochastic-rounding SEED] [--overwrite]
    python -m fp8_engram.quant.convert --info FILE [--layers]

IN may be any file this pack reads (full precision or any FP8 format). Linear weights that are not
kept are quantized (already-quantized ones are dequantized and quantized again into the requested
layout); the output is streamed tensor by tensor, so memory stays near one layer. Per-tensor e4m3fn
output loads in stock ComfyUI unchanged; row/block output needs this pack (the tool says so).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys

import torch

from . import formats, save
from .tensor import QuantizedTensor
from .layouts import unfit_reason
from .quantize_model import DEFAULT_KEEP, GRANULARITIES, fit_layout, fp8_dtype_from_name, keep_patterns, keep_reason, make_layout, sqnr_db

logger = logging.getLogger(__name__)


def _say(text: str, stream=None) -> None:
    """The converter's own output (its product, not logging): results to stdout, errors to stderr."""
    (stream or sys.stdout).write(f"{text}\n")


def parse_block(text: str) -> tuple[int, int]:
    try:
        r, c = (int(v) for v in text.lower().split("x"))
        if r < 1 or c < 1:
            raise ValueError
        return r, c
    except ValueError:
        raise argparse.ArgumentTypeError(f"block size {text!r}: expected ROWSxCOLS, e.g. 128x128 or 1x64") from None


def convert_file(src, dst, *, granularity: str = "tensor", fp8_dtype="e4m3fn", keep=DEFAULT_KEEP,
                 block: tuple[int, int] = (128, 128), stochastic_rounding: int | None = None,
                 overwrite: bool = False, progress=None) -> tuple[save.SaveResult, dict[str, float]]:
    """Convert `src` into `dst`. Returns (save result, {layer: SQNR dB vs. the source's values})."""
    fp8 = fp8_dtype_from_name(fp8_dtype)
    layout = make_layout(granularity, block)
    keep = keep_patterns(keep, "--keep")
    if not overwrite and os.path.exists(dst):
        raise FileExistsError(f"{dst}: file exists; pass --overwrite or choose another name")
    sd, report = formats.load_file(src, mmap=True)  # a script: the file stays put, and big models need not fit in RAM
    sqnr: dict[str, float] = {}
    plan: dict = {}
    for key, t in sd.items():
        is_q = save.is_quantized(t)
        if key.endswith(".weight") and t.dim() == 2 and (is_q or (t.is_floating_point() and t.dtype not in formats.FP8_DTYPES)):
            name = key[: -len(".weight")]
            if keep_reason(name, keep) is not None or unfit_reason(granularity, t.shape) is not None:
                plan[key] = t
                continue

            lay, data_dtype = fit_layout(layout or make_layout(granularity, block, t.shape), tuple(t.shape), fp8)  # int8 layouts store int8

            def make(key=key, t=t, name=name, lay=lay, data_dtype=data_dtype):
                src_w = t.dequantize(torch.float32) if save.is_quantized(t) else t
                qt = QuantizedTensor.from_float(src_w, lay, fp8_dtype=data_dtype, stochastic_rounding=stochastic_rounding)
                orig = t.orig_dtype if save.is_quantized(t) else t.dtype
                qt = QuantizedTensor.from_parts(qt.qdata, qt.scale, qt.layout, orig_dtype=orig,
                                                input_scale=getattr(t, "input_scale", None))
                sqnr[name] = sqnr_db(src_w, qt.dequantize(torch.float32))
                return qt

            plan[key] = save.PendingQuantized(tuple(t.shape), data_dtype, lay, getattr(t, "input_scale", None) is not None,
                                              make)
        else:
            plan[key] = t
    meta = {"fp8_engram_source": os.path.basename(os.fspath(src)), "fp8_engram_source_format": report.format}
    entries, producers, metadata, info = save.plan_tensors(plan)
    size = save.write_safetensors(dst, entries, lambda n: producers[n](), {**meta, **metadata}, overwrite=overwrite,
                                  progress=progress)
    result = save.SaveResult(os.fspath(dst), size, info["layers"], info["granularities"], info["stock"], info["notes"])
    return result, sqnr


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fp8_engram.quant.convert",
                                description="Convert safetensors models to FP8, or print a file's FP8 format summary.")
    p.add_argument("input", nargs="?", help="source .safetensors (any format this pack reads)")
    p.add_argument("output", nargs="?", help="destination .safetensors (never overwritten without --overwrite)")
    p.add_argument("--info", metavar="FILE", help="print the format summary of FILE and exit")
    p.add_argument("--layers", action="store_true", help="with --info: list every quantized layer")
    p.add_argument("--granularity", choices=GRANULARITIES, default="tensor",
                   help="scale granularity (tensor: stock ComfyUI reads it; row/block: better quality, this pack only; "
                   "mxfp8 / nvfp4: ComfyUI's own forms (0.29 and newer), e4m3fn data / 4-bit e2m1 data; "
                   "'int8 tensor' / 'int8 row convrot': int8 weights in ComfyUI 0.33's int8_tensorwise form; "
                   "'awq w4a16': 4-bit codes with a scale and zero point per 64 inputs, comfy-kitchen 0.2.40's form, "
                   "this pack only)")
    p.add_argument("--block", type=parse_block, default=(128, 128), help="block size for --granularity block (ROWSxCOLS)")
    p.add_argument("--dtype", choices=("e4m3fn", "e5m2"), default="e4m3fn", help="FP8 element type")
    p.add_argument("--keep", nargs="*", default=[], metavar="PATTERN",
                   help="glob patterns of layers to keep in full precision (added to the defaults)")
    p.add_argument("--no-default-keep", action="store_true", help="do not keep embeddings/norms/first/last layers by default")
    p.add_argument("--stochastic-rounding", type=int, default=None, metavar="SEED", help="round stochastically with this seed")
    p.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    if args.info:
        try:
            _say(formats.inspect_file(args.info).text(per_layer=args.layers))
        except formats.FormatError as exc:
            _say(f"error: {exc}", sys.stderr)
            return 2
        return 0
    if not args.input or not args.output:
        p.error("give IN and OUT, or --info FILE")
    keep = (() if args.no_default_keep else DEFAULT_KEEP) + tuple(args.keep)
    from tqdm import tqdm

    bar = tqdm(total=None, unit="tensor", desc="converting")

    def progress(done, total):
        if bar.total != total:
            bar.total = total
        bar.update(done - bar.n)

    try:
        result, sqnr = convert_file(args.input, args.output, granularity=args.granularity, fp8_dtype=args.dtype,
                                    keep=keep, block=args.block, stochastic_rounding=args.stochastic_rounding,
                                    overwrite=args.overwrite, progress=progress)
    except (formats.FormatError, ValueError, OSError) as exc:  # OSError: FileExistsError, SaveError (disk full)
        bar.close()
        _say(f"error: {exc}", sys.stderr)
        return 2
    bar.close()
    finite = [v for v in sqnr.values() if math.isfinite(v)]
    _say(f"wrote {result.path}: {result.bytes_written / 2**20:.2f} MiB, {result.layers_quantized} layers quantized "
          f"({', '.join(f'{k}: {v}' for k, v in result.granularities.items())})")
    if finite:
        worst = min(sqnr, key=sqnr.get)
        _say(f"SQNR: mean {sum(finite) / len(finite):.2f} dB, min {sqnr[worst]:.2f} dB ({worst})")
    _say("stock ComfyUI: " + ("loads it unchanged" if result.stock_comfy_readable else
                               "cannot apply its scales; load it with this pack's FP8 loaders"))
    for note in result.notes:
        _say(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
