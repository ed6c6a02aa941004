"""Write FP8 state dicts as safetensors files that stock ComfyUI (0.3.75) loads unchanged where it can.

Encoding of a `QuantizedTensor` weight `<layer>.weight`:
- per tensor, float8_e4m3fn: `.weight` (fp8), `.weight_scale` (f32 []), optional `.input_scale`
  (f32 []), the layer listed in the header metadata `_quantization_metadata` as
  `{"format": "float8_e4m3fn"}` (an object: the string form crashes 0.3.75), and the newest per-layer
  marker `<layer>.comfy_quant` (uint8 JSON bytes; 0.3.75 ignores it as an unexpected key).
- per tensor, float8_e5m2 (0.3.75's metadata path knows only e4m3fn): ComfyUI's legacy form, marker
  `scaled_fp8` (dtype e5m2, 0 elements) + `.scale_weight` / `.scale_input`, which 0.3.75 reads.
- per row / block-wise: `.weight` + `.weight_scale` shaped `[out, 1]` or `[ceil(out/r), ceil(in/c)]`
  and `quantization_config` metadata with the block size. Stock ComfyUI cannot apply these scales
  (`SaveResult.stock_comfy_readable` is False); this pack's reader (`formats.load_file`) can.
Other tensors are written as they are. Writes stream tensor by tensor into a temporary file in the
target folder, then move into place; an existing file is never replaced unless `overwrite=True`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from .formats import ST_NAMES

logger = logging.getLogger(__name__)

ProgressFn = Callable[[int, int], None]


def is_quantized(t) -> bool:
    return isinstance(t, torch.Tensor) and isinstance(getattr(t, "qdata", None), torch.Tensor) and hasattr(t, "layout")


def layout_kind(layout) -> tuple[str, tuple[int, int] | None]:
    name = type(layout).__name__
    if name == "PerTensor":
        return "tensor", None
    if name == "PerRow":
        return "row", None
    if name == "Block":
        return "block", (int(layout.rows), int(layout.cols))
    raise ValueError(f"unknown QuantizedTensor layout {layout!r}; expected PerTensor, PerRow or Block")


@dataclass
class SaveResult:
    path: str
    bytes_written: int
    layers_quantized: int
    granularities: dict[str, int] = field(default_factory=dict)
    stock_comfy_readable: bool = True
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        return {
            "file": os.path.basename(self.path), "bytes": self.bytes_written, "layers_quantized": self.layers_quantized,
            "granularity": self.granularities, "stock_comfyui_reads_it": self.stock_comfy_readable, "notes": self.notes,
        }


def unique_path(path) -> str:
    """`path` if free, else `<stem>_00001<ext>`, `<stem>_00002<ext>`, ... (the first that is free)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        return path
    stem, ext = os.path.splitext(path)
    for i in range(1, 100000):
        cand = f"{stem}_{i:05d}{ext}"
        if not os.path.exists(cand):
            return cand
    raise FileExistsError(f"{path}: no free name with a counter suffix")


def _as_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def write_safetensors(path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], get: Callable[[str], torch.Tensor],
                      metadata: dict[str, str] | None = None, *, overwrite: bool = False,
                      progress: ProgressFn | None = None) -> int:
    """Stream tensors into a safetensors file. `entries` fixes names, dtypes and shapes up front (the
    header comes first); `get(name)` produces each tensor when its turn comes, so only one tensor at a
    time needs to exist in memory. Returns the file size."""
    path = os.fspath(path)
    if not overwrite and os.path.exists(path):
        raise FileExistsError(f"{path}: file exists; refusing to overwrite it (choose another name)")
    header: dict = {}
    offset = 0
    for name, dtype, shape in entries:
        if dtype not in ST_NAMES:
            raise ValueError(f"{path}: tensor '{name}' has dtype {dtype}, which safetensors cannot store")
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for i, (name, dtype, shape) in enumerate(entries):
                t = get(name)
                if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                    raise ValueError(f"{path}: tensor '{name}' is {t.dtype} {list(t.shape)}, planned {dtype} {list(shape)}")
                if t.numel():
                    f.write(_as_bytes(t))
                if progress is not None:
                    progress(i + 1, len(entries))
            f.flush()
            os.fsync(f.fileno())
        if overwrite:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # fails if a file appeared meanwhile: never replace silently
            os.unlink(tmp)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return os.path.getsize(path)


@dataclass
class PendingQuantized:
    """A quantized weight that is made only when the writer reaches it (streaming conversion)."""

    shape: tuple[int, ...]
    fp8_dtype: torch.dtype
    layout: object
    has_input_scale: bool
    make: Callable[[], torch.Tensor]  # -> QuantizedTensor


def _qinfo(value):
    if isinstance(value, PendingQuantized):
        return value.fp8_dtype, tuple(value.shape), value.layout, value.has_input_scale
    return value.qdata.dtype, tuple(value.shape), value.layout, getattr(value, "input_scale", None) is not None


def plan_tensors(state_dict: dict, *, comfy_quant: bool = True):
    """Split a state dict with QuantizedTensor (or PendingQuantized) weights into the keys a file holds.

    Returns (entries, producers, metadata, info); producers maps key -> zero-arg callable. The tensors
    of one quantized layer are produced in a row, so a one-slot cache makes each pending layer once.
    """
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    producers: dict[str, Callable[[], torch.Tensor]] = {}
    meta_layers: dict[str, dict] = {}
    grans: dict[str, int] = {}
    quantized = {k: v for k, v in state_dict.items() if isinstance(v, PendingQuantized) or is_quantized(v)}
    infos = {k: _qinfo(v) for k, v in quantized.items()}
    kinds = {k: layout_kind(infos[k][2]) for k in quantized}
    all_tensor = all(kinds[k][0] == "tensor" for k in quantized)
    legacy_dtype = None
    if quantized and all_tensor and all(infos[k][0] == torch.float8_e5m2 for k in quantized):
        legacy_dtype = torch.float8_e5m2
    stock = all_tensor and (legacy_dtype is not None or all(infos[k][0] == torch.float8_e4m3fn for k in quantized))
    blocks = {kinds[k][1] for k in quantized if kinds[k][0] == "block"}
    slot: dict = {}

    def qt_of(key):
        if slot.get("key") != key:
            value = state_dict[key]
            slot["key"] = key
            slot["qt"] = value.make() if isinstance(value, PendingQuantized) else value
        return slot["qt"]

    def add(name, tensor_fn, dtype, shape):
        entries.append((name, dtype, tuple(shape)))
        producers[name] = tensor_fn

    for key, value in state_dict.items():
        if key not in quantized:
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"state dict entry '{key}' is a {type(value).__name__}, not a tensor")
            add(key, (lambda v=value: v), value.dtype, value.shape)
            continue
        if not key.endswith(".weight"):
            raise ValueError(f"quantized tensor '{key}' is not a '.weight'; only linear weights can be stored quantized")
        layer = key[: -len(".weight")]
        fp8, shape, layout, has_in = infos[key]
        kind, block = kinds[key]
        g = kind if block is None else f"block {block[0]}x{block[1]}"
        grans[g] = grans.get(g, 0) + 1
        add(key, (lambda k=key: qt_of(k).qdata), fp8, shape)
        if legacy_dtype is not None:
            add(layer + ".scale_weight", (lambda k=key: qt_of(k).scale.float().reshape(())), torch.float32, ())
            if has_in:
                add(layer + ".scale_input", (lambda k=key: qt_of(k).input_scale.float().reshape(())), torch.float32, ())
            continue
        sshape = () if kind == "tensor" else tuple(layout.scale_shape(shape))
        add(layer + ".weight_scale", (lambda k=key, s=sshape: qt_of(k).scale.float().reshape(s)), torch.float32, sshape)
        if has_in:
            add(layer + ".input_scale", (lambda k=key: qt_of(k).input_scale.float().reshape(())), torch.float32, ())
        if kind == "tensor" and stock:
            fmt = str(fp8).removeprefix("torch.")
            meta_layers[layer] = {"format": fmt}
            if comfy_quant:
                blob = json.dumps({"format": fmt}).encode("utf-8")
                add(layer + ".comfy_quant", (lambda b=blob: torch.tensor(list(b), dtype=torch.uint8)), torch.uint8, (len(blob),))
    metadata: dict[str, str] = {}
    notes = []
    if legacy_dtype is not None:
        entries.append(("scaled_fp8", legacy_dtype, (0,)))
        producers["scaled_fp8"] = lambda: torch.zeros(0, dtype=legacy_dtype)
        notes.append("float8_e5m2 per-tensor: written in ComfyUI's legacy scaled_fp8 form, which 0.3.75 reads")
    elif meta_layers:
        metadata["_quantization_metadata"] = json.dumps({"format_version": "1.0", "layers": meta_layers})
    if len(blocks) == 1:
        r, c = next(iter(blocks))
        metadata["quantization_config"] = json.dumps({"quant_method": "fp8", "weight_block_size": [r, c]})
    if quantized and not stock:
        notes.append("stock ComfyUI cannot apply row-wise or block-wise scales (or mixed e4m3fn/e5m2 layers): "
                     "load this file with this pack's loaders")
    metadata["fp8_engram"] = json.dumps({"version": 1, "granularity": grans})
    info = {"layers": len(quantized), "granularities": grans, "stock": stock, "notes": notes}
    return entries, producers, metadata, info


def save_state_dict(state_dict: dict[str, torch.Tensor], path, *, metadata: dict[str, str] | None = None,
                    overwrite: bool = False, comfy_quant: bool = True, progress: ProgressFn | None = None) -> SaveResult:
    """Save a state dict whose quantized weights are QuantizedTensors (see the module docstring)."""
    entries, producers, meta, info = plan_tensors(state_dict, comfy_quant=comfy_quant)
    if metadata:
        meta = {**metadata, **meta}
    size = write_safetensors(path, entries, lambda name: producers[name](), meta, overwrite=overwrite, progress=progress)
    return SaveResult(os.fspath(path), size, info["layers"], info["granularities"], info["stock"], info["notes"])


__all__ = ["PendingQuantized", "SaveResult", "save_state_dict", "write_safetensors", "plan_tensors", "unique_path", "is_quantized", "layout_kind"]
