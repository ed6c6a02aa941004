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
- MXFP8 (`quant.layouts.mxfp8.MXFP8`): ComfyUI 0.29's own per-layer "mxfp8" form, which 0.29 loads as it
  loads its own files: `.weight` (e4m3fn, zero-padded to multiples of 32 both ways), `.weight_scale`
  (UE8M0 bytes, F8_E8M0, in cuBLAS's 128x4 tiled order), `.comfy_quant` `{"format": "mxfp8"}`. Per-tensor
  layers in the same file get their `.comfy_quant` too, so 0.29 reads every layer. ComfyUI 0.3.75 has
  no MXFP8: a file for it must be quantized per tensor (the notes say so).
- NVFP4 (`quant.layouts.nvfp4.NVFP4`): ComfyUI's own per-layer "nvfp4" form: `.weight` (uint8, packed e2m1,
  padded to multiples of 16), `.weight_scale` (e4m3 block scales, tiled), `.weight_scale_2` (f32 []),
  `.comfy_quant` `{"format": "nvfp4"}`; 0.29 and newer read it.
- AWQ W4A16 (`quant.layouts.awq.AWQW4A16`): comfy-kitchen 0.2.40's form: `.weight` (int8 `[N, K/2]`, two
  unsigned codes per byte), `.weight_scale` and `.weight_zeros` (`[K/G, N]` in their stored float dtype),
  `.comfy_quant` `{"format": "awq_w4a16", "group_size": G}`; a loaded layer's tensors are written byte for byte.
- SVDQuant W4A4 (`quant.layouts.svdquant.SVDQuantW4A4`): the spec's tile-packed form: `.weight`, `.weight_scale`,
  `.smooth_factor`, `.proj_down`, `.proj_up` as they were read, `.comfy_quant` as the file gave it; an
  `act_unsigned` layer is refused (its bias holds the constant the loader folded in).
Other tensors are written as they are. Writes stream tensor by tensor into a temporary file in the
target folder, then move into place; an existing file is never replaced unless `overwrite=True`.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import shutil
import struct
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..common.files import new_temp_file
from .layouts import awq, is_layout, mxfp8, nvfp4, svdquant
from .layouts import comfy_int8
from .safetensors_file import ST_NAMES

logger = logging.getLogger(__name__)

ProgressFn = Callable[[int, int], None]


def is_quantized(t) -> bool:
    return isinstance(t, torch.Tensor) and isinstance(getattr(t, "qdata", None), torch.Tensor) and hasattr(t, "layout")


def layout_kind(layout) -> tuple[str, tuple[int, int] | None]:
    """(kind, block) of a layout as files and reports name it: "tensor", "row", "block" (with its block),
    "mxfp8" (0.29's own form), "nvfp4" (ComfyUI's form), "int8" (0.33's int8_tensorwise form)."""
    if not is_layout(layout):
        raise ValueError(f"unknown QuantizedTensor layout {layout!r}; expected PerTensor, PerRow, Block or MXFP8")
    kind = _KIND_BY_NAME.get(layout.name, layout.name)
    return kind, ((int(layout.rows), int(layout.cols)) if kind == "block" else None)


# layout names -> the kinds a file's summary uses (the others are the same word)
_KIND_BY_NAME = {"per_tensor": "tensor", "per_row": "row"}


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


class SaveError(OSError):
    """Writing a file failed (disk full, permissions, I/O error). The message names the file and says
    that nothing was left under its name; `errno` is the operating system's error number."""


# What a saved file's name adds to the user's name: "_00001_.safetensors" (ComfyUI's counter), "_00001"
# (unique_path's counter when that name is taken), and the temporary file's "." + ".<16 hex>.tmp".
NAME_SUFFIX_BYTES = len("_00001_.safetensors") + len("_00001") + len("..0123456789abcdef.tmp")


def _name_max(folder: str) -> int:
    """The longest file name (bytes) the file system of `folder` allows (255 where it cannot be asked)."""
    try:
        return int(os.pathconf(folder, "PC_NAME_MAX"))
    except (AttributeError, OSError, ValueError):
        return 255


def check_output_prefix(filename_prefix: str, output_dir) -> tuple[str, str]:
    """Validate a user's `folder/name` prefix for a file inside `output_dir`.

    Returns (the prefix as a clean relative `folder/name`, the absolute folder it names). Raises
    ValueError for prefixes that try to leave the folder: absolute paths, drive letters, `..`
    components, NUL bytes, or a folder that resolves (through symlinks) outside `output_dir`; and for
    names longer than the file system allows (the file name with what saving adds to it).
    """
    text = str(filename_prefix).strip()
    shown = repr(text) if len(text) <= 200 else repr(text[:200] + "...")
    if "\0" in text:
        raise ValueError(f"filename_prefix {shown} contains a NUL byte")
    if text.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", text) or os.path.isabs(text):
        raise ValueError(f"filename_prefix {shown} is an absolute path; it must stay inside the output folder "
                         "(give a relative name such as 'fp8/model')")
    parts = [p for p in re.split(r"[\\/]+", text) if p not in ("", ".")]
    if ".." in parts:
        raise ValueError(f"filename_prefix {shown} uses '..'; it must stay inside the output folder "
                         "(give a relative name such as 'fp8/model')")
    if not parts or re.split(r"[\\/]+", text)[-1] in ("", "."):
        raise ValueError(f"filename_prefix {shown} has no file name; expected e.g. 'fp8/model'")
    root = os.path.realpath(os.fspath(output_dir))
    name_max = _name_max(root)
    for i, part in enumerate(parts):
        size = len(part.encode("utf-8", "surrogatepass"))
        room = name_max - (NAME_SUFFIX_BYTES if i == len(parts) - 1 else 0)
        if size > room and i == len(parts) - 1:
            raise ValueError(f"filename_prefix {shown}: its file name is {size} bytes long, more than the {room} this "
                             f"file system leaves for it ({name_max} bytes per name, less {NAME_SUFFIX_BYTES} for the "
                             "counter, extension and temporary suffix that saving adds): shorten it")
        if size > room:
            raise ValueError(f"filename_prefix {shown}: folder name {part[:40]!r}... is {size} bytes long, more than "
                             f"the {name_max} this file system allows per name: shorten it")
    folder = os.path.join(root, *parts[:-1])
    real = os.path.realpath(folder)
    if os.path.commonpath([root, real]) != root:
        raise ValueError(f"filename_prefix {shown} leads outside the output folder (through a link to {real})")
    return "/".join(parts), folder


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_failed(path: str, exc: OSError, written: int, total: int, existed: bool) -> SaveError:
    why = exc.strerror or str(exc)
    if exc.errno == errno.ENOSPC:
        why += " (the disk is full)"
    before = "the file that was there is unchanged" if existed else "no file was created"
    return SaveError(exc.errno or errno.EIO,
                     f"{path}: writing failed after {written:,} of {total:,} bytes: {why}; the partial "
                     f"temporary file was removed and {before}")


def write_safetensors(path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], get: Callable[[str], torch.Tensor],
                      metadata: dict[str, str] | None = None, *, overwrite: bool = False,
                      progress: ProgressFn | None = None) -> int:
    """Stream tensors into a safetensors file. `entries` fixes names, dtypes and shapes up front (the
    header comes first); `get(name)` produces each tensor when its turn comes, so only one tensor at a
    time needs to exist in memory. Returns the file size.

    The bytes go to a temporary file in the target folder, which is renamed into place only when
    complete and flushed to disk. Without `overwrite` an existing file is never replaced. A failing
    write (disk full, I/O error) raises `SaveError` naming the file; the temporary file is removed
    and whatever was under the final name before is untouched.
    """
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
    total = 8 + len(raw) + offset
    folder = os.path.dirname(os.path.abspath(path))
    existed = os.path.exists(path)
    try:
        os.makedirs(folder, exist_ok=True)
        free = shutil.disk_usage(folder).free
    except OSError as exc:
        raise _write_failed(path, exc, 0, total, existed) from exc
    if free < total:
        raise SaveError(errno.ENOSPC, f"{path}: the file needs {total / 2**20:,.2f} MiB but only {free / 2**20:,.2f} MiB "
                        f"are free in {folder}; nothing was written")
    try:
        fd, tmp = new_temp_file(folder, f".{os.path.basename(path)}.", ".tmp")
    except OSError as exc:  # e.g. a name too long for the file system
        raise _write_failed(path, exc, 0, total, existed) from exc
    written = 0
    try:
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(struct.pack("<Q", len(raw)))
                f.write(raw)
                written = 8 + len(raw)
                for i, (name, dtype, shape) in enumerate(entries):
                    t = get(name)
                    if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                        raise ValueError(f"{path}: tensor '{name}' is {t.dtype} {list(t.shape)}, planned {dtype} {list(shape)}")
                    if t.numel():
                        written += f.write(_as_bytes(t))
                    if progress is not None:
                        progress(i + 1, len(entries))
                f.flush()
                os.fsync(f.fileno())
            if overwrite:
                os.replace(tmp, path)
            else:
                try:
                    os.link(tmp, path)  # fails if a file appeared meanwhile: never replace silently
                except FileExistsError:
                    raise
                except OSError:  # a filesystem without hard links
                    if os.path.exists(path):
                        raise FileExistsError(f"{path}: file exists; refusing to overwrite it") from None
                    os.replace(tmp, path)
        except OSError as exc:
            if isinstance(exc, (FileExistsError, SaveError)):
                raise
            raise _write_failed(path, exc, written, total, existed) from exc
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
    _fsync_dir(folder)
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


def plan_tensors(state_dict: dict, *, comfy_quant: bool = True, dtypes: dict[str, torch.dtype] | None = None):
    """Split a state dict with QuantizedTensor (or PendingQuantized) weights into the keys a file holds.

    `dtypes` maps keys of plain (not quantized) tensors to the dtype they are written in (cast one
    tensor at a time while writing); keys not in it keep their dtype.

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
    has_mx = any(kinds[k][0] == "mxfp8" for k in quantized)
    has_nv = any(kinds[k][0] == "nvfp4" for k in quantized)
    # every layer in a form ComfyUI 0.29 and newer read per layer (per-tensor e4m3fn/e5m2, MXFP8, NVFP4)
    kitchen = (has_mx or has_nv) and all(kinds[k][0] in ("tensor", "mxfp8", "nvfp4") for k in quantized)
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
            want = (dtypes or {}).get(key, value.dtype)
            if want != value.dtype:
                add(key, (lambda v=value, d=want: v.detach().to(d)), want, value.shape)
            else:
                add(key, (lambda v=value: v), value.dtype, value.shape)
            continue
        if not key.endswith(".weight"):
            raise ValueError(f"quantized tensor '{key}' is not a '.weight'; only linear weights can be stored quantized")
        layer = key[: -len(".weight")]
        fp8, shape, layout, has_in = infos[key]
        kind, block = kinds[key]
        g = kind if block is None else f"block {block[0]}x{block[1]}"
        grans[g] = grans.get(g, 0) + 1
        own_form = _OWN_FORMS.get(kind)
        if own_form is not None:  # a layout written in a per-layer form of its own
            own_form(add, layer, key, qt_of, shape, layout, has_in)
            continue
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
        if kind == "tensor" and (stock or kitchen):
            fmt = str(fp8).removeprefix("torch.")
            if stock:
                meta_layers[layer] = {"format": fmt}
            if comfy_quant or kitchen:
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
    if has_nv:
        notes.append("nvfp4 layers: written in ComfyUI's own per-layer form, which 0.29 and newer load; older "
                     "ComfyUI cannot read them")
    if has_mx:
        notes.append("mxfp8 layers: written in ComfyUI 0.29's own per-layer form, which 0.29 and newer load; "
                     "ComfyUI 0.3.75 (and any ComfyUI without MXFP8) cannot read them: for those, quantize the "
                     "model per tensor" + ("" if kitchen else "; row-wise and block-wise layers of this file "
                                            "need this pack's loaders"))
    elif "int8" in grans:
        notes.append("int8 layers: written in ComfyUI 0.33's int8_tensorwise form, which 0.33 and newer load; "
                     "older ComfyUI cannot, and this pack's loaders read them everywhere")
    elif svdquant.FORMAT in grans or awq.FORMAT in grans:
        notes.append("int4 layers (comfy-kitchen 0.2.40's " + " and ".join(f for f in (awq.FORMAT, svdquant.FORMAT)
                                                                     if f in grans) + " forms; a loaded layer's bytes as read); "
                     "ComfyUI 0.33 and older cannot read them, this pack's loaders can")
    elif quantized and not stock and not has_nv:
        notes.append("stock ComfyUI cannot apply row-wise or block-wise scales (or mixed e4m3fn/e5m2 layers): "
                     "load this file with this pack's loaders")
    metadata["fp8_engram"] = json.dumps({"version": 1, "granularity": grans})
    info = {"layers": len(quantized), "granularities": grans, "stock": stock, "notes": notes}
    return entries, producers, metadata, info


def _add_mxfp8(add, layer: str, key: str, qt_of, shape, layout, has_in: bool) -> None:
    """The entries of one MXFP8 layer in 0.29's form (see the module docstring)."""
    BLOCK, file_tensors, padded_shape = mxfp8.BLOCK, mxfp8.file_tensors, mxfp8.padded_shape
    padded_weight_shape, scales_for_file = mxfp8.padded_weight_shape, mxfp8.scales_for_file
    if len(shape) != 2:
        raise ValueError(f"MXFP8 weight '{key}' has shape {list(shape)}; expected [out, in]")
    wshape = padded_weight_shape(shape)
    sshape = padded_shape(shape[0], math.ceil(shape[1] / BLOCK))
    e8m0 = getattr(torch, "float8_e8m0fnu", torch.uint8)

    def weight(k=key):
        qt = qt_of(k)
        return file_tensors(qt.qdata, qt.scale)[0]

    def scale(k=key):
        return scales_for_file(qt_of(k).scale)

    add(key, weight, torch.float8_e4m3fn, wshape)
    add(layer + ".weight_scale", scale, e8m0, sshape)
    if has_in:
        add(layer + ".input_scale", (lambda k=key: qt_of(k).input_scale.float().reshape(())), torch.float32, ())
    blob = json.dumps({"format": "mxfp8"}).encode("utf-8")
    add(layer + ".comfy_quant", (lambda b=blob: torch.tensor(list(b), dtype=torch.uint8)), torch.uint8, (len(blob),))


def _add_int8(add, layer: str, key: str, qt_of, shape, layout, has_in: bool) -> None:
    """The entries of one Int8 layer in ComfyUI 0.33's int8_tensorwise form (`comfy_int8.file_tensors`)."""
    comfy_quant_bytes, file_form, file_tensors = comfy_int8.comfy_quant_bytes, comfy_int8.file_form, comfy_int8.file_tensors
    if len(shape) != 2:
        raise ValueError(f"int8 weight '{key}' has shape {list(shape)}; expected [out, in]")
    _, conf, sshape = file_form(layout, shape)
    blob = comfy_quant_bytes(conf)
    memo: dict = {}

    def parts(k=key):
        qt = qt_of(k)
        if memo.get("qt") is not qt:
            memo.clear()
            memo.update(qt=qt, parts=file_tensors(qt))
        return memo["parts"]

    add(key, (lambda: parts()[0]), torch.int8, shape)
    add(layer + ".weight_scale", (lambda: parts()[1].float()), torch.float32, sshape)
    add(layer + ".comfy_quant", (lambda b=blob: b.clone()), torch.uint8, (blob.numel(),))


def _add_nvfp4(add, layer: str, key: str, qt_of, shape, layout, has_in: bool) -> None:
    """The entries of one NVFP4 layer in ComfyUI's form (see the module docstring and layouts/nvfp4.py)."""
    padded_shape, file_tensors = mxfp8.padded_shape, nvfp4.file_tensors
    def part(name, k=key):
        return file_tensors(qt_of(k))[name]

    add(key, (lambda: part("weight")), torch.uint8, layout.storage_shape)
    add(layer + ".weight_scale", (lambda: part("weight_scale")), torch.float8_e4m3fn,
        padded_shape(layout.padded[0], layout.blocks))
    add(layer + ".weight_scale_2", (lambda: part("weight_scale_2")), torch.float32, ())
    blob = json.dumps({"format": "nvfp4"}).encode("utf-8")
    add(layer + ".comfy_quant", (lambda b=blob: torch.tensor(list(b), dtype=torch.uint8)), torch.uint8, (len(blob),))


def _add_awq(add, layer: str, key: str, qt_of, shape, layout, has_in: bool) -> None:
    """The entries of one AWQ W4A16 layer in comfy-kitchen's form (layouts/awq.py): the stored bytes, scales
    and zero points as they are (a loaded layer is written back bit for bit)."""
    def part(name, k=key):
        return awq.file_tensors(qt_of(k))[name]

    conf = json.dumps(awq.comfy_quant_conf(layout)).encode("utf-8")
    add(key, (lambda: part("weight")), torch.int8, (layout.rows, layout.cols // 2))
    add(layer + ".weight_scale", (lambda: part("weight_scale")), layout.scale_dtype, (layout.groups, layout.rows))
    add(layer + ".weight_zeros", (lambda: part("weight_zeros")), layout.scale_dtype, (layout.groups, layout.rows))
    add(layer + ".comfy_quant", (lambda b=conf: torch.tensor(list(b), dtype=torch.uint8)), torch.uint8, (len(conf),))


def _add_svdquant(add, layer: str, key: str, qt_of, shape, layout, has_in: bool) -> None:
    """The entries of one SVDQuant W4A4 layer in the spec's form (layouts/svdquant.py), bytes as they were read.
    An act_unsigned layer is refused: its loaded bias holds the constant of its activation shift (the loader
    folds it in for the weight-only product), which the file's bias must not."""
    if layout.act_unsigned:
        raise ValueError(f"SVDQuant layer '{layer}' is act_unsigned: its bias was changed at load (the constant of "
                         "its activation shift, folded in for the weight-only product), so it cannot be written back "
                         "in its own form; save the model from its original file, or quantize it to another format")

    def part(name, k=key):
        return svdquant.file_tensors(qt_of(k))[name]

    add(key, (lambda: part("weight")), torch.int8,
        layout.storage_shape if layout.tiled else (layout.rows, layout.cols // 2))
    for name, dtype, pshape in layout.parts:
        add(f"{layer}.{name}", (lambda n=name: part(n)), dtype, pshape)
    conf = layout.conf.encode("utf-8")
    add(layer + ".comfy_quant", (lambda b=conf: torch.tensor(list(b), dtype=torch.uint8)), torch.uint8, (len(conf),))


# kinds written in a per-layer form of their own (the others: data, `.weight_scale`, `.input_scale`)
_OWN_FORMS = {"mxfp8": _add_mxfp8, "int8": _add_int8, "nvfp4": _add_nvfp4, awq.FORMAT: _add_awq,
              svdquant.FORMAT: _add_svdquant}

_SOURCE_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "model.")
_FLOAT_WRITE_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def plain_dtypes(state_dict: dict, choice: torch.dtype | None = None, source: dict[str, torch.dtype] | None = None,
                 unknown: torch.dtype | None = None) -> tuple[dict[str, torch.dtype], str]:
    """Which dtype each plain (not quantized) floating tensor of `state_dict` is written in.

    `choice` a float dtype: every plain floating tensor in it (float8 tensors without a scale stay as
    they are). `choice` None ("as loaded"): each tensor's dtype in `source`, the dtypes of the file the
    model was loaded from (keys matched with or without a `model.diffusion_model.` style prefix); a key
    the file does not have takes the file's most common float dtype. Without a source, float32/float64
    tensors are written as `unknown` when given (the caller knows the host upcast them, as ComfyUI
    does on the CPU), else every tensor keeps its in-memory dtype. A float8 source dtype is used only
    when the values fit it.
    Returns ({key: dtype}, a short description for the user).
    """
    plain = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor) and not is_quantized(v)
             and v.dtype in _FLOAT_WRITE_DTYPES}
    if choice is not None:
        if choice not in _FLOAT_WRITE_DTYPES:
            raise ValueError(f"cannot write plain tensors as {choice}; expected one of {_FLOAT_WRITE_DTYPES}")
        if choice == torch.float16:
            fmax = torch.finfo(torch.float16).max
            for k, v in plain.items():
                if v.numel() and float(v.detach().abs().amax()) > fmax:
                    raise ValueError(f"tensor '{k}' holds values beyond float16's range ({fmax:g}); "
                                     "save it as bfloat16 or float32")
        return {k: choice for k in plain}, f"non-FP8 tensors written as {str(choice).removeprefix('torch.')}"
    if not source:
        if unknown is not None:
            out = {k: unknown for k, v in plain.items() if v.dtype in (torch.float32, torch.float64)}
            out.update({k: v.dtype for k, v in plain.items() if k not in out})
            names = sorted({str(d).removeprefix("torch.") for d in out.values()})
            return out, (f"non-FP8 tensors written as {', '.join(names) or '-'} (source dtypes unknown: "
                         "pick weight_dtype to choose)")
        names = sorted({str(v.dtype).removeprefix("torch.") for v in plain.values()})
        return {}, (f"non-FP8 tensors written as in memory ({', '.join(names) or '-'}; source dtypes unknown: "
                    "pick weight_dtype to choose)")
    lookup: dict[str, torch.dtype] = {}
    for key, dtype in source.items():
        lookup.setdefault(key, dtype)
        for prefix in _SOURCE_PREFIXES:
            if key.startswith(prefix):
                lookup.setdefault(key[len(prefix):], dtype)
    counts: dict[torch.dtype, int] = {}
    for dtype in source.values():
        if dtype in _FLOAT_WRITE_DTYPES:
            counts[dtype] = counts.get(dtype, 0) + 1
    common = max(counts, key=counts.get) if counts else None
    out: dict[str, torch.dtype] = {}
    for k, v in plain.items():
        want = lookup.get(k, common)
        if want is None:
            continue
        if want in (torch.float8_e4m3fn, torch.float8_e5m2):
            fits = v.numel() == 0 or float(v.detach().abs().amax()) <= torch.finfo(want).max
            want = want if fits else (common or v.dtype)
        out[k] = want
    names = sorted({str(d).removeprefix("torch.") for d in out.values()})
    return out, f"non-FP8 tensors written as loaded ({', '.join(names) or '-'})"


def save_state_dict(state_dict: dict[str, torch.Tensor], path, *, metadata: dict[str, str] | None = None,
                    overwrite: bool = False, comfy_quant: bool = True, progress: ProgressFn | None = None,
                    dtypes: dict[str, torch.dtype] | None = None) -> SaveResult:
    """Save a state dict whose quantized weights are QuantizedTensors (see the module docstring).
    `dtypes`: the dtype to write each plain tensor in (see `plan_tensors`)."""
    entries, producers, meta, info = plan_tensors(state_dict, comfy_quant=comfy_quant, dtypes=dtypes)
    if metadata:
        meta = {**metadata, **meta}
    size = write_safetensors(path, entries, lambda name: producers[name](), meta, overwrite=overwrite, progress=progress)
    return SaveResult(os.fspath(path), size, info["layers"], info["granularities"], info["stock"], info["notes"])


__all__ = ["PendingQuantized", "SaveError", "SaveResult", "check_output_prefix", "plain_dtypes", "save_state_dict", "write_safetensors", "plan_tensors", "unique_path", "is_quantized", "layout_kind"]
