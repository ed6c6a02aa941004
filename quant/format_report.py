"""What a checkpoint holds, as the loaders report it: one plan per quantized layer and the file's summary.

Floor 6 (file I/O): ``formats.py`` fills these in; the nodes and ``convert --info`` show them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import math
import os

import torch

from .safetensors_file import SafetensorsHeader

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_BY_NAME = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
# ComfyUI 0.29's "mxfp8": e4m3fn data, one UE8M0 scale per 32 inputs (quant/layouts/mxfp8.py); data dtype per format
MXFP8_FORMAT = "mxfp8"
COMFY_FORMATS = {**FP8_BY_NAME, MXFP8_FORMAT: torch.float8_e4m3fn}


# packed formats whose data is not what the stored dtype says: the name reports give their values
AWQ_FORMAT = "awq_w4a16"
SVDQUANT_FORMAT = "svdquant_w4a4"
_DATA_NAMES = {"nvfp4": "e2m1", AWQ_FORMAT: "uint4", SVDQUANT_FORMAT: "int4"}

FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)

# Format names (FormatReport.format, LayerInfo.source)
PLAIN = "plain_fp8"
COMFY_SCALED = "comfy_scaled_fp8"
COMFY_METADATA = "comfy_quant_metadata"
COMFY_PER_LAYER = "comfy_quant_per_layer"
MUSUBI = "musubi_fp8_scaled"
WEIGHT_SCALE = "weight_scale"
BLOCKWISE_INV = "blockwise_scale_inv"
UNQUANTIZED = "unquantized"
# ComfyUI's NVFP4 form without its comfy_quant JSON or metadata entry, recognised by its tensors alone
NVFP4_BY_TENSORS = "nvfp4_without_metadata"
MXFP8_BY_TENSORS = "mxfp8_without_metadata"  # the same for MXFP8 (e4m3fn weight, UE8M0 block scales)


def _fp8_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------------------------------
# Layer plans
# --------------------------------------------------------------------------------------------------
@dataclass
class LayerInfo:
    """How one quantized linear layer is stored."""

    name: str  # layer prefix, e.g. "joint_blocks.0.x_block.attn.qkv"
    source: str  # format name that wrote it
    granularity: str  # "tensor" | "row" | "block"
    block: tuple[int, int] | None  # (rows, cols) for block-wise
    fp8_dtype: torch.dtype
    shape: tuple[int, int]
    weight_key: str
    scale_key: str | None
    input_scale_key: str | None = None
    full_precision_mm: bool = False  # the file says: do not run fp8 x fp8 on this layer
    consumed: tuple[str, ...] = ()  # keys (besides weight/scale/input scale) that belong to this layer
    layout: object = None  # the layout itself where the granularity does not say it (ComfyUI int8 formats)
    decode: object = None  # stored weight -> the layout's data (ComfyUI's packed 4-bit formats)

    def describe(self) -> str:
        lay = self.granularity if self.block is None else f"block {self.block[0]}x{self.block[1]}"
        return f"{self.name}: {list(self.shape)} {str(self.fp8_dtype).removeprefix('torch.')} {lay} ({self.source})"


@dataclass
class FormatReport:
    path: str
    format: str  # main format name, or "a+b" when a file mixes formats (e.g. checkpoint with a TE)
    formats: dict[str, int]  # format -> number of layers
    layers_quantized: int
    linear_weights: int  # 2-D `.weight` tensors in the file (quantized or not)
    bytes_on_disk: int
    bytes_bf16: int  # the same weights stored as bf16 (scales and markers dropped)
    fp8_dtypes: list[str]
    granularities: dict[str, int]
    fp8_matmul_allowed: bool
    layers: list[LayerInfo] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    stock_comfy_readable: bool = True  # whether stock ComfyUI 0.3.75 reads the scales of this file
    # the header the file was read with (its metadata, every tensor's dtype): a loader needs no second read
    header: object = field(default=None, repr=False, compare=False)

    def summary(self) -> dict:
        """JSON-able summary (what nodes show in the UI)."""
        return {
            "file": os.path.basename(self.path),
            "format": self.format,
            "layers_quantized": self.layers_quantized,
            "linear_weights": self.linear_weights,
            "fp8_dtypes": self.fp8_dtypes,
            "granularity": self.granularities,
            "bytes_on_disk": self.bytes_on_disk,
            "bytes_bf16": self.bytes_bf16,
            "ratio_vs_bf16": round(self.bytes_on_disk / self.bytes_bf16, 4) if self.bytes_bf16 else None,
            "fp8_matmul_allowed": self.fp8_matmul_allowed,
            "stock_comfyui_reads_scales": self.stock_comfy_readable,
            "notes": list(self.notes),
        }

    def text(self, per_layer: bool = False) -> str:
        s = self.summary()
        lines = [
            f"file:             {self.path}",
            f"format:           {self.format}",
            f"layers quantized: {self.layers_quantized} of {self.linear_weights} linear weights",
            f"fp8 dtypes:       {', '.join(self.fp8_dtypes) or '-'}",
            f"granularity:      {', '.join(f'{k}: {v}' for k, v in self.granularities.items()) or '-'}",
            f"bytes on disk:    {self.bytes_on_disk:,} ({self.bytes_on_disk / 2**20:.2f} MiB)",
            f"as bf16:          {self.bytes_bf16:,} ({self.bytes_bf16 / 2**20:.2f} MiB), ratio {s['ratio_vs_bf16']}",
            f"fp8 matmul:       {'allowed' if self.fp8_matmul_allowed else 'not allowed by the file'}",
            f"stock ComfyUI:    {'reads its scales' if self.stock_comfy_readable else 'cannot read its scales'}",
        ]
        lines += [f"note:             {n}" for n in self.notes]
        if per_layer:
            lines.append("layers:")
            lines += [f"  {info.describe()}" for info in self.layers]
        return "\n".join(lines)


@dataclass
class DetectedFormat:
    header: SafetensorsHeader
    layers: dict[str, LayerInfo]  # by weight key
    consumed: set[str]  # every key that is not part of the normalized state dict
    input_scales: dict[str, torch.Tensor]  # weight key -> float32 []
    scales: dict[str, torch.Tensor]  # weight key -> float32 scale in the layout's shape
    orig_dtype: torch.dtype
    report: FormatReport


def _make_report(hdr: SafetensorsHeader, layers: dict[str, LayerInfo], consumed: set[str], markers) -> FormatReport:
    formats: dict[str, int] = {}
    grans: dict[str, int] = {}
    for info in layers.values():
        formats[info.source] = formats.get(info.source, 0) + 1
        g = info.granularity if info.block is None else f"block {info.block[0]}x{info.block[1]}"
        grans[g] = grans.get(g, 0) + 1
    name = "+".join(sorted(formats, key=lambda f: -formats[f])) if formats else UNQUANTIZED
    bf16 = 0
    linear = 0
    for k, e in hdr.tensors.items():
        if k in consumed:
            continue
        if k.endswith(".weight") and (len(e.shape) == 2 or k in layers):  # tiled 4-bit data is 4-D
            linear += 1
        if k in layers and layers[k].granularity == "nvfp4":
            bf16 += e.numel * 4  # two 4-bit values per byte
        elif e.dtype in FLOAT_DTYPES or e.dtype in FP8_DTYPES:
            bf16 += e.numel * 2
        elif k in layers:  # an int8 (or packed 4-bit) weight: its logical size in bf16
            bf16 += math.prod(layers[k].shape) * 2
        else:
            bf16 += e.nbytes
    stock = all(i.granularity == "tensor" and i.source in (PLAIN, COMFY_SCALED, COMFY_METADATA) and
                (i.source != COMFY_METADATA or i.fp8_dtype == torch.float8_e4m3fn) for i in layers.values())
    notes = []
    unmarked = sum(1 for i in layers.values() if i.source == NVFP4_BY_TENSORS)
    if unmarked:
        notes.append(f"{unmarked} layer(s) without comfy_quant metadata recognised as NVFP4 by their tensors (packed "
                     "uint8 weight, float8_e4m3fn block scales in ComfyUI's tiled order, float32 weight_scale_2); "
                     "stock ComfyUI loads such files unquantized and fails (its issue #15511)")
    unmarked = sum(1 for i in layers.values() if i.source == MXFP8_BY_TENSORS)
    if unmarked:
        notes.append(f"{unmarked} layer(s) without comfy_quant metadata recognised as MXFP8 by their tensors "
                     "(float8_e4m3fn weight, UE8M0 block scales in ComfyUI's tiled order)")
    svd = [i for i in layers.values() if i.granularity == SVDQUANT_FORMAT]
    if svd:
        shifted = sum(1 for i in svd if i.layout.act_unsigned)
        notes.append(f"{len(svd)} svdquant_w4a4 layer(s) (comfy-kitchen 0.2.40's SVDQuant W4A4): run weight-only on "
                     "their effective weight (4-bit weight and smoothing with the low-rank branch folded in); "
                     "kitchen's W4A4 product also rounds the activation to 4 bits, which the pack does not"
                     + (f"; {shifted} act_unsigned layer(s): the constant their activation shift adds is folded "
                        "into the bias" if shifted else ""))
    if any(i.granularity == "nvfp4" for i in layers.values()):
        notes.append("nvfp4 layers (ComfyUI's own form): stock ComfyUI 0.29 and newer read them, older ones "
                     "cannot; this pack runs them weight-only")
    elif any(i.granularity == "mxfp8" for i in layers.values()):
        notes.append("mxfp8 layers (ComfyUI 0.29's own form): stock ComfyUI 0.29 and newer read them, 0.3.75 cannot "
                     "(for it, quantize per tensor)")
    elif any(i.granularity == AWQ_FORMAT for i in layers.values()):
        notes.append("awq_w4a16 layers (comfy-kitchen 0.2.40's AWQ W4A16: 4-bit codes, a scale and a zero point "
                     "per group): ComfyUI 0.33 and older cannot read them; this pack runs them weight-only "
                     "(dequantized as kitchen's eager code does, then multiplied)")
    elif svd:
        pass  # said above
    elif any(i.layout is not None for i in layers.values()):
        notes.append("int8 layers in ComfyUI 0.33's own form (int8_tensorwise / convrot_w4a4 / asym_w4a8_int8): "
                     "stock ComfyUI 0.33 reads them, 0.3.75 cannot")
    elif not stock:
        notes.append("stock ComfyUI 0.3.75 ignores the scales of this file's row/block/per-layer formats; load it with this pack")
    fp8_mm = not any(i.full_precision_mm for i in layers.values())
    if not fp8_mm:
        notes.append("the file asks for full-precision matrix multiplication on some layers")
    return FormatReport(
        path=hdr.path, format=name, formats=formats, layers_quantized=len(layers), linear_weights=linear,
        bytes_on_disk=hdr.file_size, bytes_bf16=bf16,
        fp8_dtypes=sorted({_DATA_NAMES.get(i.granularity) or _fp8_name(i.fp8_dtype) for i in layers.values()}),
        granularities=grans,
        fp8_matmul_allowed=fp8_mm, layers=sorted(layers.values(), key=lambda i: i.name), notes=notes,
        stock_comfy_readable=stock, header=hdr,
    )
