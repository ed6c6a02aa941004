"""Read every published FP8 checkpoint format from a safetensors file, lazily.

Contract:
- `read_header(path)` parses and validates the safetensors header only (no tensor data is read).
- `detect_format(path)` works out, per quantized layer, which format wrote it and which layout its
  scale describes; it reads only the small tensors (scales, markers, `.comfy_quant` JSON).
- `load_file(path)` returns `(state_dict, FormatReport)`: every quantized linear weight becomes a
  `QuantizedTensor` built with `QuantizedTensor.from_parts` over the file's FP8 bytes (no
  full-precision copy is made), scale/marker keys are consumed, and every other tensor passes through
  in its stored dtype. Tensors are read into the process's own memory with plain file reads, never
  left mapped to the file, so a file replaced or truncated while its model is in use cannot crash
  the process (`mmap=True` maps them instead, for scripts that know the file stays put).

Formats (see DESIGN.md):

| name                   | recognised by                                                          |
|------------------------|------------------------------------------------------------------------|
| `plain_fp8`            | 2-D `.weight` stored as float8, no scale anywhere                      |
| `comfy_scaled_fp8`     | marker `<prefix>scaled_fp8` (0 or 2 elements) + `.scale_weight` scalar |
| `comfy_quant_metadata` | header metadata `_quantization_metadata` + `.weight_scale`             |
| `comfy_quant_per_layer`| `<layer>.comfy_quant` uint8 JSON + `.weight_scale`                     |
| `musubi_fp8_scaled`    | `.scale_weight` without a marker, or shaped `[out, n, 1]` / `[out, 1]` |
| `weight_scale`         | `.weight_scale` (+ `.input_scale`) without ComfyUI metadata: modelopt, |
|                        | diffusers, compressed-tensors                                          |
| `blockwise_scale_inv`  | `.weight_scale_inv` per block (DeepSeek style, 128x128)                |
| (per layer) nvfp4      | `.comfy_quant` `{"format": "nvfp4"}`: packed e2m1 `.weight` (uint8),   |
|                        | e4m3 `.weight_scale` (tiled), `.weight_scale_2` (quant/nvfp4.py)       |

Every scale multiplies: `w = fp8 * expand(scale)`. Block scales are read only with the block sizes of
`KNOWN_BLOCKS` or the one the file declares, and scales that would overflow the compute dtype are
refused (an NVFP4 layer's tensor scale times its largest block scale and e2m1 value included). Sizes a
file declares (ConvRot groups, tiled NVFP4 / MXFP8 scale grids, group sizes) are checked against the
tensors beside them before anything is built. Anything unknown or inconsistent raises `FormatError`, whose message names the file, the key
and what was expected.
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

logger = logging.getLogger(__name__)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_BY_NAME = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
# ComfyUI 0.29's "mxfp8": e4m3fn data, one UE8M0 scale per 32 inputs (quant/mxfp8.py); data dtype per format
MXFP8_FORMAT = "mxfp8"
COMFY_FORMATS = {**FP8_BY_NAME, MXFP8_FORMAT: torch.float8_e4m3fn}

# safetensors dtype strings -> torch dtypes (the ones a checkpoint can hold)
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E8M0", "float8_e8m0fnu")):
    if hasattr(torch, _attr):
        ST_DTYPES[_name] = getattr(torch, _attr)
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}

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

MARKER = "scaled_fp8"
QUANT_METADATA_KEY = "_quantization_metadata"
# Bounds on what a file may make the reader parse or allocate before any tensor is touched.
# safetensors itself allows 100 MB, but parsing a hostile 100 MB JSON header costs Python up to ~1 GB;
# real headers (thousands of tensors, training metadata, embedded workflows) stay far below 32 MiB.
MAX_HEADER_BYTES = 32 * 1024 * 1024
MAX_METADATA_JSON_BYTES = 16 * 1024 * 1024  # one JSON value of the header metadata
MAX_COMFY_QUANT_BYTES = 64 * 1024  # one `.comfy_quant` tensor (a few dozen bytes of JSON in practice)
MAX_DIMS = 8
MAX_DIM = 1 << 40

_SCALE_SUFFIXES = (".scale_weight", ".weight_scale_inv", ".weight_scale")
_INPUT_SCALE_SUFFIXES = (".input_scale", ".scale_input")
# Keys of quantization schemes this pack does not read (int4, zero points, NVFP4 outside ComfyUI's form):
# refused clearly, each with what the pack reads instead. NVFP4 tensor scales are read on layers marked
# as ComfyUI's NVFP4 form (`_detect_nvfp4`), nowhere else.
_UNSUPPORTED_SUFFIXES = (".weight_scale_2", ".weight_zero_point", ".weight_global_scale", ".weight_packed",
                         ".weight_shape", ".qweight", ".qzeros", ".scales", ".absmax", ".quant_map")
_NVFP4_LIKE_SUFFIXES = (".weight_scale_2", ".weight_global_scale")


class FormatError(ValueError):
    """A file this pack cannot read as it claims to be; the message names file, key and expectation."""


def _err(path, key, problem: str, expected: str | None = None) -> FormatError:
    where = f"{os.fspath(path)}" + (f", key '{key}'" if key else "")
    msg = f"{where}: {problem}"
    if expected:
        msg += f"; expected {expected}"
    return FormatError(msg)


# --------------------------------------------------------------------------------------------------
# Header
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # offsets inside the data section
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class SafetensorsHeader:
    path: str
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int
    file_size: int


def _read_header_bytes(path: str, f) -> tuple[int, int, bytes]:
    """(file size, header length, header bytes) of an open file, with the checks that need no parsing."""
    file_size = os.fstat(f.fileno()).st_size
    f.seek(0)
    head = f.read(8)
    if len(head) < 8:
        raise _err(path, None, f"file is {file_size} bytes long, too short to be safetensors",
                   "an 8-byte header length followed by a JSON header")
    (n,) = struct.unpack("<Q", head)
    if n > file_size - 8:
        raise _err(path, None, _not_a_header(path, head, n, file_size),
                   f"a header length of at most {min(MAX_HEADER_BYTES, file_size - 8)}")
    if n > MAX_HEADER_BYTES:
        raise _err(path, None, f"the JSON header is {n:,} bytes long, more than this reader accepts",
                   f"at most {MAX_HEADER_BYTES:,} bytes (real checkpoints use well under 1 MB)")
    raw = f.read(n)
    if len(raw) < n:
        raise _err(path, None, f"the file ended inside its {n:,}-byte header (it shrank while being read)",
                   "a complete safetensors file")
    return file_size, n, raw


def _not_a_header(path: str, head: bytes, n: int, file_size: int) -> str:
    """Why a header length field that points past the end of the file is wrong, in words a user can act on."""
    link = ""
    if os.path.islink(path):
        link = f" (a link to {os.path.realpath(path)})"
    if head.startswith(b"PK\x03\x04"):
        kind = "a zip archive (a PyTorch .ckpt/.pt pickle?), not safetensors"
    elif head.startswith((b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")):
        kind = "a Python pickle (.ckpt/.pt), not safetensors"
    elif head.startswith(b"GGUF"):
        kind = "a GGUF file, not safetensors"
    elif all(32 <= c < 127 or c in (9, 10, 13) for c in head):
        kind = f"text (it begins {head.decode('ascii')!r}), not a safetensors file"
    else:
        return (f"header length field says {n} bytes but the file{link} has {file_size - 8} bytes after it "
                "(truncated file, or not a safetensors file)")
    return f"the file{link} is {kind}"


def read_header(path, *, file=None) -> SafetensorsHeader:
    """Parse and check a safetensors header: every tensor's dtype, shape and byte range must agree.

    `file`: the file already open (binary, seekable); its header is read from it, so that the tensors
    read later through the same file belong to this header even if the name is replaced meanwhile."""
    path = os.fspath(path)
    try:
        if file is None:
            with open(path, "rb") as f:
                file_size, n, raw = _read_header_bytes(path, f)
        else:
            file_size, n, raw = _read_header_bytes(path, file)
    except OSError as exc:
        raise FormatError(f"{path}: cannot read the file ({exc})") from exc
    header = _loads(path, None, raw, "a safetensors JSON header")
    if not isinstance(header, dict):
        raise _err(path, None, "the header is not a JSON object", "a safetensors JSON header")

    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _err(path, "__metadata__", "metadata is not a map of strings", "{name: string}")
    data_start = 8 + n
    data_size = file_size - data_start
    tensors: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if not isinstance(info, dict):
            raise _err(path, name, "header entry is not an object", "{dtype, shape, data_offsets}")
        dtype = ST_DTYPES.get(info.get("dtype")) if isinstance(info.get("dtype"), str) else None
        if dtype is None:
            raise _err(path, name, f"unsupported tensor dtype {_short(info.get('dtype'))}",
                       "one of " + ", ".join(sorted(ST_DTYPES)))
        shape = info.get("shape")
        offsets = info.get("data_offsets")
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_int(s) and 0 <= s <= MAX_DIM for s in shape)
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(_is_int(o) and o >= 0 for o in offsets) or offsets[1] < offsets[0]):
            raise _err(path, name, f"malformed shape {_short(shape)} or data_offsets {_short(offsets)}",
                       f"a list of at most {MAX_DIMS} non-negative ints and [begin, end] with begin <= end")
        entry = TensorEntry(name, dtype, tuple(shape), offsets[0], offsets[1])
        itemsize = torch.empty((), dtype=dtype).element_size()
        want = entry.numel * itemsize
        if entry.nbytes != want:
            raise _err(path, name, f"header says shape {list(shape)} of {info['dtype']} ({want} bytes) but its "
                       f"data_offsets span {entry.nbytes} bytes (the header lies about sizes)",
                       f"data_offsets spanning exactly {want} bytes")
        if entry.end > data_size:
            raise _err(path, name, f"tensor data ends at byte {entry.end} of the data section, which has only "
                       f"{data_size} bytes (truncated file)", f"a file of at least {data_start + entry.end} bytes")
        tensors[name] = entry
    # Like safetensors itself: tensors tile the data section exactly, without gaps or overlaps.
    end = 0
    for entry in sorted(tensors.values(), key=lambda e: (e.start, e.end)):
        if entry.start != end:
            what = "overlaps the tensor before it" if entry.start < end else f"leaves a gap of {entry.start - end} bytes"
            raise _err(path, entry.name, f"data_offsets {[entry.start, entry.end]} {what}",
                       f"tensors stored back to back (this one starting at byte {end})")
        end = entry.end
    if end != data_size:
        raise _err(path, None, f"{data_size - end} bytes follow the last tensor's data",
                   "a file that ends with the last tensor (safetensors refuses trailing data)")
    return SafetensorsHeader(path, tensors, dict(metadata), data_start, file_size)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _short(value, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _loads(path, key, raw, expected: str):
    """json.loads that turns every way a hostile text can fail (bad UTF-8, bad JSON, nesting deeper
    than Python's recursion limit, integers too long to convert) into a FormatError."""
    try:
        if isinstance(raw, bytes):
            raw = raw.decode("utf-8")
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _err(path, key, f"not valid JSON ({exc})", expected) from exc
    except RecursionError:
        raise _err(path, key, "JSON nested too deeply", expected) from None
    except ValueError as exc:  # e.g. an integer literal beyond Python's digit limit
        raise _err(path, key, f"unreadable JSON ({str(exc)[:200]})", expected) from None


class _FileReader:
    """Reads tensors with ordinary file reads into memory this process owns.

    Nothing stays mapped to the file: a model file that is replaced, rewritten or truncated while the
    model is in use (a download tool rewriting it in place) cannot take the process down with SIGBUS
    on a mapped page, as a memory-mapped tensor would at its next use. Everything is read through one
    open file, the one the header was read from; `close()` when done."""

    def __init__(self, path: str, device: str = "cpu", header: SafetensorsHeader | None = None):
        self.path = path
        self.device = device
        self.header = header
        self._file = None

    def open(self):
        if self._file is None:
            try:
                self._file = open(self.path, "rb", buffering=0)
            except OSError as exc:
                raise FormatError(f"{self.path}: cannot read the file ({exc})") from exc
        return self._file

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def get(self, key: str) -> torch.Tensor:
        if self.header is None:
            self.header = read_header(self.path, file=self.open())
        entry = self.header.tensors[key]
        buf = torch.empty(entry.nbytes, dtype=torch.uint8)
        if entry.nbytes:
            f = self.open()
            view = memoryview(buf.numpy()).cast("B")
            pos, done = self.header.data_start + entry.start, 0
            try:
                f.seek(pos)
                while done < entry.nbytes:
                    n = f.readinto(view[done:])  # one read returns at most ~2 GiB on Linux
                    if not n:
                        raise _err(self.path, key, f"the file ended at byte {pos + done:,} while reading this tensor "
                                   "(it was truncated or rewritten while loading)",
                                   f"a file of at least {self.header.data_start + entry.end:,} bytes")
                    done += n
            except OSError as exc:
                raise _err(self.path, key, f"reading this tensor failed ({exc})") from exc
        t = buf.view(entry.dtype).reshape(entry.shape)
        return t if self.device == "cpu" else t.to(self.device)


class _MappedReader:
    """Opens the file with safetensors (memory-mapped) on first use; wraps its errors with the path.

    Tensors stay mapped to the file: pages are read when first touched and the kernel may drop them
    again, so this suits a file that nobody changes while it is open (a conversion script), not a
    server that keeps a model for hours."""

    def __init__(self, path: str, device: str = "cpu"):
        self.path = path
        self.device = device
        self._handle = None

    def get(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        try:
            if self._handle is None:
                self._handle = safe_open(self.path, framework="pt", device=self.device)
            return self._handle.get_tensor(key)
        except FormatError:
            raise
        except Exception as exc:  # safetensors raises its own error types
            raise _err(self.path, key, f"safetensors could not read this tensor ({exc})",
                       "a complete, valid safetensors file") from exc

    def close(self) -> None:
        self._handle = None  # the mapping lives as long as the tensors made from it


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


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# Block shapes (rows x cols of an [out, in] weight) that published formats use, and how each format fits
# its blocks to a weight: "ceil" lets the last block of a row or column be partial ([ceil(out/r),
# ceil(in/c)] scales), "exact" needs the block to divide the weight. A scale grid is read as block-wise
# only with one of these, or with the block size the file itself declares (quantization_config
# `weight_block_size`, `.comfy_quant` `block_size`; the pack's own row/block files do). Any other grid is
# refused rather than guessed: a shape alone fits many wrong blocks ([3, 7] on [128, 128] "fits" 43x19).
# A new format with its own block adds its line here.
KNOWN_BLOCKS: dict[tuple[int, int], tuple[str, str]] = {
    (128, 128): ("ceil", "DeepSeek-style .weight_scale_inv, compressed-tensors block"),
    (1, 16): ("exact", "NVFP4 groups, musubi-tuner"),
    (1, 32): ("ceil", "MXFP8, musubi-tuner"),
    (1, 64): ("exact", "musubi-tuner fp8_scaled (its default)"),
    (1, 128): ("exact", "musubi-tuner, compressed-tensors group"),
    (1, 256): ("exact", "musubi-tuner"),
    (1, 512): ("exact", "musubi-tuner"),
    (1, 1024): ("exact", "musubi-tuner"),
}


def block_grid(weight_shape, block: tuple[int, int], edges: str = "ceil") -> tuple[int, int] | None:
    """The scale grid of `block` over an [out, in] weight, or None where `edges` "exact" does not divide it."""
    (out, inp), (r, c) = weight_shape, block
    if edges == "exact" and (out % r or inp % c):
        return None
    return _ceil_div(out, r), _ceil_div(inp, c)


def infer_layout(path, scale_key: str, weight_shape, scale_shape, source: str,
                 block_hint: tuple[int, int] | None = None) -> tuple[str, tuple[int, int] | None, tuple[int, ...]]:
    """Map a scale shape to (granularity, block, normalized scale shape) for a weight [out, in].

    Block-wise only with a block of KNOWN_BLOCKS or `block_hint` (the block size the file declares)."""
    out, inp = weight_shape
    sshape = tuple(scale_shape)
    numel = math.prod(sshape)
    if numel == 1 and len(sshape) <= 2:
        return "tensor", None, ()
    if sshape in ((out,), (out, 1)):
        return "row", None, (out, 1)
    declared = {tuple(block_hint): "ceil"} if block_hint is not None else {}
    # the declared block first: where two blocks give the same grid, the file's word decides
    accepted = {**declared, **{b: edges for b, (edges, _) in KNOWN_BLOCKS.items() if b not in declared}}
    grid = None
    if len(sshape) == 3 and sshape[0] == out and sshape[2] == 1 and sshape[1] > 0:
        # musubi-tuner: [out, n_blocks, 1], blocks of 1 x (in / n_blocks) along the input dim
        nb = sshape[1]
        if inp % nb == 0 and (1, inp // nb) in accepted:
            return "block", (1, inp // nb), (out, nb)
        grid = (out, nb)
    elif len(sshape) == 2 and all(s > 0 for s in sshape):
        for block, edges in accepted.items():
            if block_grid(weight_shape, block, edges) == sshape:
                return "block", block, sshape
        grid = sshape
    why = ""
    if grid is not None:
        r, c = (f"{w // g}" if w % g == 0 else f"about {_ceil_div(w, g)}" for w, g in zip((out, inp), grid))
        why = f" (as blocks they would be {r} x {c}, a size no published format uses and the file does not declare)"
    known = ", ".join(f"{r}x{c}" for r, c in KNOWN_BLOCKS)
    raise _err(path, scale_key, f"scale shape {list(sshape)} fits no layout for weight shape [{out}, {inp}]{why}",
               f"[] or [1] (per tensor), [{out}] or [{out}, 1] (per row), or block scales "
               f"[ceil(out/r), ceil(in/c)] ([{out}, n, 1] for musubi) with a block r x c of {known}"
               + (f" or the declared {block_hint[0]}x{block_hint[1]}" if block_hint is not None else
                  ", or one the file declares in quantization_config weight_block_size"))


def _check_scale_values(path, key: str, t: torch.Tensor) -> torch.Tensor:
    if t.dtype not in FLOAT_DTYPES:
        raise _err(path, key, f"scale has dtype {str(t.dtype).removeprefix('torch.')}",
                   "a float32, float16 or bfloat16 scale")
    t = t.to(torch.float32)
    if t.numel() == 0:
        raise _err(path, key, "scale is empty", "at least one element")
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        raise _err(path, key, f"scale holds {int(bad.sum())} non-finite value(s) (NaN or inf)", "finite scales > 0")
    nonpos = t <= 0
    if bool(nonpos.any()):
        raise _err(path, key, f"scale holds {int(nonpos.sum())} zero or negative value(s)", "finite scales > 0")
    return t


def check_scale_range(path, key: str, scale: torch.Tensor, fp8_dtype: torch.dtype,
                      compute_dtype: torch.dtype | None = None) -> None:
    """Refuse a weight scale whose product with the largest `fp8_dtype` value overflows `compute_dtype`
    (None: float32; bfloat16 has the same range): dequantized, that layer would hold inf and every
    output after it NaN. Real scales are near the weights' absolute maximum / the FP8 maximum."""
    dtype = compute_dtype or torch.float32
    limit = float(torch.finfo(dtype).max)
    fmax = float(torch.finfo(fp8_dtype).max)
    top = float(scale.detach().abs().max()) if scale.numel() else 0.0
    if top * fmax > limit:
        raise _err(path, key, f"scale {top:.4g} times {_fp8_name(fp8_dtype)}'s largest value {fmax:g} is "
                   f"{top * fmax:.4g}, beyond {_fp8_name(dtype)}'s range ({limit:.4g}): the weights would "
                   "dequantize to inf and every output to NaN",
                   f"scales of at most {limit / fmax:.4g} for {_fp8_name(dtype)} (a weight's absolute maximum "
                   f"divided by {fmax:g})")


def _parse_json_metadata(path, key: str, text: str, what: str):
    if len(text) > MAX_METADATA_JSON_BYTES:
        raise _err(path, key, f"metadata value is {len(text):,} characters long",
                   f"at most {MAX_METADATA_JSON_BYTES:,} ({what})")
    return _loads(path, key, text, what)


def _layer_name(weight_key: str) -> str:
    return weight_key[: -len(".weight")]


def _fp8_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def detect_format(path, *, device: str = "cpu", orig_dtype: torch.dtype | None = None,
                  header: SafetensorsHeader | None = None, reader=None,
                  compute_dtype: torch.dtype | None = None) -> DetectedFormat:
    """Work out the format of every quantized layer of a safetensors file (reads small tensors only).

    `compute_dtype`: the dtype the weights will be dequantized into; a scale whose product with the
    largest FP8 value overflows it is refused (None: float32, whose range bfloat16 shares)."""
    path = os.fspath(path)
    if reader is not None:
        return _detect(path, device, orig_dtype, header or read_header(path), reader, compute_dtype)
    rd = _FileReader(path, device)
    try:
        rd.header = header or read_header(path, file=rd.open())
        return _detect(path, device, orig_dtype, rd.header, rd, compute_dtype)
    finally:
        rd.close()


def _detect(path: str, device: str, orig_dtype, hdr: SafetensorsHeader, rd, compute_dtype) -> DetectedFormat:
    T = hdr.tensors
    consumed: set[str] = set()

    nv_layers = _detect_nvfp4(path, hdr, rd, compute_dtype)  # ComfyUI's NVFP4 layers (own keys and checks)
    for key in T:
        for suf in _UNSUPPORTED_SUFFIXES:
            if key.endswith(suf) and key[: -len(suf)] + ".weight" not in nv_layers:
                raise _unsupported_key(path, key, suf)

    # ---- markers of ComfyUI's legacy scaled fp8 format: "<prefix>scaled_fp8"
    markers: dict[str, bool] = {}  # prefix -> fp8 matmul allowed
    for key, e in T.items():
        if key == MARKER or key.endswith("." + MARKER):
            if e.numel not in (0, 2):
                raise _err(path, key, f"scaled_fp8 marker has {e.numel} elements",
                           "0 elements (fp8 matmul allowed) or 2 (not allowed)")
            markers[key[: -len(MARKER)]] = e.numel == 0
            consumed.add(key)

    def marker_for(name: str):
        best = None
        for prefix in markers:
            if name.startswith(prefix) and (best is None or len(prefix) > len(best)):
                best = prefix
        return best

    # ---- ComfyUI mixed precision header metadata
    meta_layers: dict[str, dict] | None = None
    if QUANT_METADATA_KEY in hdr.metadata:
        mk = f"__metadata__.{QUANT_METADATA_KEY}"
        expected = '{"format_version": "1.0", "layers": {name: {"format": "float8_e4m3fn"}}}'
        qm = _parse_json_metadata(path, mk, hdr.metadata[QUANT_METADATA_KEY], expected)
        if not isinstance(qm, dict) or not isinstance(qm.get("layers"), dict):
            raise _err(path, mk, "quantization metadata has no 'layers' object", expected)
        meta_layers = {}
        for name, entry in qm["layers"].items():
            if not isinstance(entry, dict):
                raise _err(path, f"{mk}.layers.{name}", f"layer entry is {type(entry).__name__} {entry!r}, not an object",
                           '{"format": "float8_e4m3fn"} (the plain-string form crashes ComfyUI 0.3.75)')
            if entry.get("format") == "nvfp4" and name + ".weight" in nv_layers:
                continue  # read above, with its own checks
            if not isinstance(entry.get("format"), str) or entry.get("format") not in COMFY_FORMATS:
                raise _err(path, f"{mk}.layers.{name}", f"unsupported layer format {_short(entry.get('format'))}",
                           "'float8_e4m3fn', 'float8_e5m2' or 'mxfp8'")
            meta_layers[name] = entry

    block_hint = None
    if "quantization_config" in hdr.metadata:
        qc = _parse_json_metadata(path, "__metadata__.quantization_config", hdr.metadata["quantization_config"],
                                  "a JSON quantization_config")
        if not isinstance(qc, dict):
            raise _err(path, "__metadata__.quantization_config", "quantization_config is not a JSON object",
                       "a JSON object")
        method = str(qc.get("quant_method", qc.get("quant_algo", "fp8"))).lower()
        if "fp8" not in method and method not in ("compressed-tensors", "modelopt", "fbgemm_fp8"):
            raise _err(path, "__metadata__.quantization_config", f"quantization method {method!r} is not FP8",
                       "an FP8 quantization_config")
        wbs = qc.get("weight_block_size")
        if isinstance(wbs, list) and len(wbs) == 2 and all(_is_int(v) and 0 < v <= MAX_DIM for v in wbs):
            block_hint = (wbs[0], wbs[1])

    # ---- orphan scales / comfy_quant entries
    weight_keys = {k for k in T if k.endswith(".weight")}
    for key in T:
        for suf in _SCALE_SUFFIXES + _INPUT_SCALE_SUFFIXES + (".comfy_quant",):
            if key.endswith(suf):
                wk = key[: -len(suf)] + ".weight"
                if wk not in T:
                    raise _err(path, key, f"'{suf}' entry without a weight", f"a tensor '{wk}'")
                break

    layers: dict[str, LayerInfo] = {wk: info for wk, (info, _) in nv_layers.items()}
    scales: dict[str, torch.Tensor] = {wk: scale for wk, (_, scale) in nv_layers.items()}
    input_scales: dict[str, torch.Tensor] = {}
    for info in layers.values():
        consumed.update((info.scale_key,) + info.consumed)

    for wk in sorted(weight_keys - set(nv_layers)):
        e = T[wk]
        name = _layer_name(wk)
        present = [s for s in _SCALE_SUFFIXES if name + s in T]
        cq_key = name + ".comfy_quant"
        has_cq = cq_key in T
        in_meta = meta_layers is not None and name in meta_layers
        is_fp8 = e.dtype in FP8_DTYPES
        if not (present or has_cq or in_meta):
            continue  # plain tensors and plain casts are decided below
        if has_cq and e.dtype == torch.int8:  # ComfyUI 0.33's int8 formats: quant/comfy_int8.py
            layers[wk], scales[wk] = _comfy_int8_layer(path, name, T, rd)
            consumed.update((layers[wk].scale_key,) + layers[wk].consumed)
            continue
        if len(present) > 1:
            raise _err(path, name + present[1], f"layer has several scale keys {present}",
                       "exactly one of .scale_weight, .weight_scale, .weight_scale_inv")
        if not is_fp8:
            raise _err(path, wk, f"weight has dtype {_fp8_name(e.dtype)} but the file gives it a quantization scale",
                       "a float8_e4m3fn or float8_e5m2 weight")
        if len(e.shape) != 2:
            raise _err(path, wk, f"quantized weight has shape {list(e.shape)}", "a 2-D linear weight [out, in]")
        full_precision_mm = False
        comfy_format = None
        extra: list[str] = []
        hint = block_hint
        if has_cq:
            source = COMFY_METADATA if in_meta else COMFY_PER_LAYER  # files may carry both forms
            expected = 'uint8 bytes of a JSON object like {"format": "float8_e4m3fn"}'
            ce = T[cq_key]
            if ce.dtype != torch.uint8 or len(ce.shape) != 1:
                raise _err(path, cq_key, f"comfy_quant tensor has dtype {_fp8_name(ce.dtype)} and shape {list(ce.shape)}",
                           expected)
            if ce.nbytes > MAX_COMFY_QUANT_BYTES:
                raise _err(path, cq_key, f"comfy_quant tensor holds {ce.nbytes:,} bytes",
                           f"at most {MAX_COMFY_QUANT_BYTES:,} bytes of JSON")
            raw = rd.get(cq_key)
            cq = _loads(path, cq_key, raw.numpy().tobytes(), expected)
            if not isinstance(cq, dict) or not isinstance(cq.get("format"), str) or cq["format"] not in COMFY_FORMATS:
                raise _err(path, cq_key, f"comfy_quant says {_short(cq)}",
                           "an object with format 'float8_e4m3fn', 'float8_e5m2' or 'mxfp8'")
            comfy_format = cq["format"]
            if COMFY_FORMATS[cq["format"]] != e.dtype:
                raise _err(path, cq_key, f"comfy_quant format {cq['format']} but the weight is {_fp8_name(e.dtype)}",
                           "the format to match the weight's dtype")
            full_precision_mm = bool(cq.get("full_precision_matrix_mult", False))
            bs = cq.get("block_size")
            if bs is not None:
                if not (isinstance(bs, list) and len(bs) == 2 and all(_is_int(v) and 0 < v <= MAX_DIM for v in bs)):
                    raise _err(path, cq_key, f"comfy_quant block_size is {_short(bs)}", "[rows, cols] of positive ints")
                hint = (bs[0], bs[1])
            extra.append(cq_key)
            if ".weight_scale" not in present:
                raise _err(path, name + ".weight_scale", "missing scale for a quantized weight (comfy_quant present)",
                           f"a tensor '{name}.weight_scale'")
        if in_meta:
            source = COMFY_METADATA
            fmt = meta_layers[name]["format"]
            comfy_format = comfy_format or fmt
            if COMFY_FORMATS[fmt] != e.dtype:
                raise _err(path, f"__metadata__.{QUANT_METADATA_KEY}.layers.{name}",
                           f"metadata says {fmt} but the weight is {_fp8_name(e.dtype)}", "matching dtypes")
            full_precision_mm = full_precision_mm or bool(meta_layers[name].get("full_precision_matrix_mult", False))
            if ".weight_scale" not in present:
                raise _err(path, name + ".weight_scale", "missing scale for a quantized weight listed in "
                           "_quantization_metadata", f"a tensor '{name}.weight_scale'")
        elif has_cq:
            pass
        elif ".scale_weight" in present:
            prefix = marker_for(name)
            source = COMFY_SCALED if prefix is not None else MUSUBI
            if prefix is not None and not markers[prefix]:
                full_precision_mm = True
        elif ".weight_scale_inv" in present:
            source = BLOCKWISE_INV
        else:
            source = WEIGHT_SCALE
        suffix = present[0]
        scale_key = name + suffix
        se = T[scale_key]
        if comfy_format == MXFP8_FORMAT:
            from .layouts import QuantizationError
            from .mxfp8 import BLOCK, scales_from_file

            if has_cq:
                _check_declared_group(path, cq_key, cq, MXFP8_FORMAT, BLOCK)
            if in_meta:
                _check_declared_group(path, f"__metadata__.{QUANT_METADATA_KEY}.layers.{name}", meta_layers[name],
                                      MXFP8_FORMAT, BLOCK)

            gran, block = "mxfp8", None
            try:
                scale = scales_from_file(rd.get(scale_key), e.shape)
            except QuantizationError as exc:
                raise _err(path, scale_key, f"bad MXFP8 block scales ({exc})",
                           "UE8M0 bytes in cuBLAS's 128x4 tiled order, one per row and 32 inputs") from exc
        else:
            gran, block, norm_shape = infer_layout(path, scale_key, e.shape, se.shape, source, hint)
            if source == COMFY_SCALED and gran != "tensor":
                source = MUSUBI  # a marker with non-scalar scales: musubi writes those
            scale = _check_scale_values(path, scale_key, rd.get(scale_key)).reshape(norm_shape)
        check_scale_range(path, scale_key, scale, e.dtype, compute_dtype)
        in_key = None
        for s in _INPUT_SCALE_SUFFIXES:
            if name + s in T:
                in_key = name + s
                ist = _check_scale_values(path, in_key, rd.get(in_key))
                if ist.numel() != 1:
                    raise _err(path, in_key, f"input scale has shape {list(ist.shape)}", "a scalar ([] or [1])")
                input_scales[wk] = ist.reshape(())
                consumed.add(in_key)
        consumed.add(scale_key)
        consumed.update(extra)
        scales[wk] = scale
        layers[wk] = LayerInfo(name, source, gran, block, e.dtype, tuple(e.shape), wk, scale_key, in_key,
                               full_precision_mm, tuple(extra))

    if meta_layers is not None:
        for name in meta_layers:
            if name + ".weight" not in T:
                raise _err(path, f"__metadata__.{QUANT_METADATA_KEY}.layers.{name}",
                           "metadata lists a layer the file does not hold", f"a tensor '{name}.weight'")

    uses_scales = bool(layers)
    # ---- fp8 2-D weights without any scale
    for wk in sorted(weight_keys - set(layers)):
        e = T[wk]
        if e.dtype not in FP8_DTYPES or len(e.shape) != 2:
            continue
        name = _layer_name(wk)
        if meta_layers is not None:
            raise _err(path, wk, "float8 weight not listed in _quantization_metadata",
                       f"an entry for '{name}' in the metadata and a '{name}.weight_scale' tensor")
        if uses_scales or markers:
            # In a scaled file an fp8 matrix without a scale is a missing scale, not a plain cast.
            suffixes = [l.scale_key[len(l.name):] for l in layers.values()] or [".scale_weight"]
            expected_suffix = max(set(suffixes), key=suffixes.count)
            raise _err(path, name + expected_suffix, "missing scale for a quantized weight",
                       f"a tensor '{name}{expected_suffix}' (every float8 matrix of this file has a scale)")
        layers[wk] = LayerInfo(name, PLAIN, "tensor", None, e.dtype, tuple(e.shape), wk, None, None, False)
        scales[wk] = torch.ones((), dtype=torch.float32)

    # ---- logical dtype of the quantized weights
    if orig_dtype is None:
        counts: dict[torch.dtype, int] = {}
        for k, e in T.items():
            if k not in consumed and e.dtype in (torch.float16, torch.bfloat16, torch.float32):
                counts[e.dtype] = counts.get(e.dtype, 0) + e.numel
        orig_dtype = max(counts, key=counts.get) if counts else torch.bfloat16

    report = _make_report(hdr, layers, consumed, markers)
    return DetectedFormat(hdr, layers, consumed, input_scales, scales, orig_dtype, report)


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
        if k.endswith(".weight") and len(e.shape) == 2:
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
    if any(i.granularity == "nvfp4" for i in layers.values()):
        notes.append("nvfp4 layers (ComfyUI's own form): stock ComfyUI 0.29 and newer read them, older ones "
                     "cannot; this pack runs them weight-only")
    elif any(i.granularity == "mxfp8" for i in layers.values()):
        notes.append("mxfp8 layers (ComfyUI 0.29's own form): stock ComfyUI 0.29 and newer read them, 0.3.75 cannot "
                     "(for it, quantize per tensor)")
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
        fp8_dtypes=sorted({"e2m1" if i.granularity == "nvfp4" else _fp8_name(i.fp8_dtype) for i in layers.values()}),
        granularities=grans,
        fp8_matmul_allowed=fp8_mm, layers=sorted(layers.values(), key=lambda i: i.name), notes=notes,
        stock_comfy_readable=stock,
    )


def _unsupported_key(path, key: str, suf: str) -> FormatError:
    """Why a key of a quantization scheme outside the ones this pack reads is refused, and what to do."""
    if suf in _NVFP4_LIKE_SUFFIXES:
        layer = key[: -len(suf)]
        return _err(path, key, f"'{suf}' is an NVFP4 tensor scale, but the layer '{layer}' is not marked as "
                    "NVFP4: this pack reads NVFP4 in ComfyUI's form only and does not read other NVFP4 layouts "
                    "(modelopt's, compressed-tensors')",
                    f"a '{layer}.comfy_quant' JSON (or a _quantization_metadata entry) saying "
                    '{"format": "nvfp4"}, with a uint8 packed \'.weight\', e4m3 \'.weight_scale\' and float32 '
                    "'.weight_scale_2' (the form ComfyUI 0.33 writes; this pack's Quantize Model to FP8 node "
                    "with granularity nvfp4 and Save FP8 Model write it too from the bf16 model), or an FP8 "
                    "checkpoint")
    return _err(path, key, f"'{suf}' keys belong to an int4 / GPTQ / AWQ / bitsandbytes style quantization "
                "(packed integers with zero points or lookup tables), which this pack does not read",
                "an FP8 checkpoint (float8 weights with float scales), ComfyUI's int8 / mxfp8 / nvfp4 "
                "per-layer forms, or the model in bf16/fp16 to convert with this pack")


def _check_declared_group(path, key: str, conf: dict, fmt: str, group: int) -> None:
    """A layer's JSON may repeat the group size of its format (`group_size`, or a `block_size` of
    [1, group]); any other value describes data this reader would misread, so it is refused."""
    params = conf.get("params") if isinstance(conf.get("params"), dict) else {}
    for name in ("group_size", "block_size"):
        value = conf.get(name, params.get(name))
        if value is None:
            continue
        if name == "group_size":
            ok = _is_int(value) and value == group
        else:
            ok = (_is_int(value) and value == group) or (isinstance(value, list) and len(value) == 2
                                                         and all(_is_int(v) for v in value) and value == [1, group])
        if not ok:
            raise _err(path, key, f"the layer's {fmt} JSON says {name} {_short(value)}, but {fmt} has one scale "
                       f"per {group} inputs and no other group size",
                       f"{name} {group if name == 'group_size' else [1, group]}, or no {name}")


def check_nvfp4_range(path, key: str, block: torch.Tensor, tensor_scale: float,
                      compute_dtype: torch.dtype | None = None) -> None:
    """Refuse an NVFP4 tensor scale whose product with the largest block scale and e2m1's largest value
    (6) overflows `compute_dtype` (None: float32; bfloat16 has its range): the weight would dequantize
    to inf and every output to NaN. comfy-kitchen converts the tensor scale itself to that dtype first,
    so it must fit too. Real tensor scales are a weight's absolute maximum / (448 * 6)."""
    from .nvfp4 import E2M1_MAX

    dtype = compute_dtype or torch.float32
    limit = float(torch.finfo(dtype).max)
    bmax = float(block.detach().to(torch.float32).abs().max()) if block.numel() else 0.0
    top = tensor_scale * bmax * E2M1_MAX  # Python floats: no overflow here
    if tensor_scale > limit or top > limit:
        raise _err(path, key, f"NVFP4 tensor scale {tensor_scale:.4g} times the largest block scale {bmax:g} times "
                   f"e2m1's largest value {E2M1_MAX:g} is {top:.4g}, beyond {_fp8_name(dtype)}'s range "
                   f"({limit:.4g}): the weights would dequantize to inf and every output to NaN",
                   f"a tensor scale of at most {limit / (max(bmax, 1.0) * E2M1_MAX):.4g} with these block scales "
                   "(a weight's absolute maximum divided by 448 * 6)")


def _detect_nvfp4(path, hdr: SafetensorsHeader, rd: _LazyReader, compute_dtype=None) -> dict:
    """The layers of a file in ComfyUI's NVFP4 form (see quant/nvfp4.py): a `.comfy_quant` or an entry of
    `_quantization_metadata` (which ComfyUI turns into `.comfy_quant`) says "nvfp4". Returns
    {weight key: (LayerInfo, the QuantizedTensor's scale bytes)}; reads only scales and JSON."""
    from .layouts import QuantizationError
    from .nvfp4 import GROUP, scales_from_file, split_scales

    T = hdr.tensors
    confs: dict[str, tuple[dict, str, str]] = {}  # layer -> (its JSON, format name, the JSON's key)
    qm_text = hdr.metadata.get(QUANT_METADATA_KEY, "")
    if "nvfp4" in qm_text:
        qm = _parse_json_metadata(path, f"__metadata__.{QUANT_METADATA_KEY}", qm_text, "quantization metadata JSON")
        layers = qm.get("layers") if isinstance(qm, dict) else None
        for name, entry in (layers.items() if isinstance(layers, dict) else ()):
            if isinstance(entry, dict) and entry.get("format") == "nvfp4":
                confs[name] = (entry, COMFY_METADATA, f"__metadata__.{QUANT_METADATA_KEY}.layers.{name}")
    for cq_key, ce in T.items():
        if not cq_key.endswith(".comfy_quant") or ce.dtype != torch.uint8 or len(ce.shape) != 1 \
                or ce.nbytes > MAX_COMFY_QUANT_BYTES:
            continue  # anything malformed is reported by the general reader
        raw = rd.get(cq_key).numpy().tobytes()
        if b"nvfp4" not in raw:
            continue
        cq = _loads(path, cq_key, raw, 'uint8 bytes of a JSON object like {"format": "nvfp4"}')
        if isinstance(cq, dict) and cq.get("format") == "nvfp4":
            name = cq_key[: -len(".comfy_quant")]
            confs[name] = (cq, COMFY_METADATA if name in confs else COMFY_PER_LAYER, cq_key)

    found = {}
    for name, (cq, source, conf_key) in sorted(confs.items()):
        cq_key = name + ".comfy_quant"
        _check_declared_group(path, conf_key, cq, "nvfp4", GROUP)
        wk, sk, s2k = name + ".weight", name + ".weight_scale", name + ".weight_scale_2"
        for key in (wk, sk, s2k):
            if key not in T:
                raise _err(path, key, "missing tensor of an NVFP4 layer (the file says the layer is nvfp4)",
                           f"'{wk}' (uint8 packed e2m1), '{sk}' (e4m3 block scales) and '{s2k}' (float32 scale)")
        if name + ".pre_quant_scale" in T:
            raise _err(path, name + ".pre_quant_scale", "NVFP4 layers with a pre-quantization input scale (AWQ "
                       "smoothing) are not supported", "an NVFP4 layer without '.pre_quant_scale'")
        e = T[wk]
        if e.dtype != torch.uint8 or len(e.shape) != 2 or e.shape[0] % GROUP or (2 * e.shape[1]) % GROUP:
            raise _err(path, wk, f"NVFP4 weight has dtype {_fp8_name(e.dtype)} and shape {list(e.shape)}",
                       f"uint8 [R, C / 2] with R and C multiples of {GROUP}")
        try:
            layout, scale = scales_from_file(rd.get(sk), rd.get(s2k), e.shape)
        except QuantizationError as exc:
            raise _err(path, sk, f"bad NVFP4 scales ({exc})",
                       "e4m3 block scales in cuBLAS's 128x4 tiled order and one finite float32 scale > 0") from exc
        block, ts = split_scales(scale, layout)
        check_nvfp4_range(path, s2k, block, float(ts), compute_dtype)
        extra = [s2k] + [k for k in [cq_key] + [name + s for s in _INPUT_SCALE_SUFFIXES] if k in T]
        shape = (int(e.shape[0]), int(e.shape[1]) * 2)
        info = LayerInfo(name, source, "nvfp4", None, torch.uint8, shape, wk, sk, None,
                         bool(cq.get("full_precision_matrix_mult", False)), tuple(extra))
        found[wk] = (info, scale)
    return found


def inspect_file(path) -> FormatReport:
    """Format summary of a file without building any weight (for `convert --info`)."""
    return detect_format(path).report


ProgressFn = Callable[[int, int], None]


def load_file(path, *, device: str = "cpu", orig_dtype: torch.dtype | None = None, config=None,
              progress: ProgressFn | None = None, keys: Iterable[str] | None = None,
              mmap: bool = False) -> tuple[dict, FormatReport]:
    """Normalized state dict + report. Quantized weights are `QuantizedTensor`s over the file's FP8 bytes.

    Tensors are read into memory this process owns (`mmap=False`), so nothing depends on the file once
    this returns: replacing or truncating it later cannot crash the process. `mmap=True` maps them
    instead (read lazily, no private copy), for callers that know the file stays as it is.
    `config` (a ComputeConfig or None) is attached to every quantized weight; a scale that would
    overflow its compute dtype (float32's range when it has none) is refused. `progress(done, total)`
    is called per tensor; it may raise to cancel. `keys`, when given, limits the tensors returned.
    """
    from .layouts import QuantizationError
    from .tensor import QuantizedTensor

    path = os.fspath(path)
    compute_dtype = getattr(config, "compute_dtype", None)
    if mmap:
        hdr = read_header(path)
        rd = _MappedReader(path, device)
    else:
        rd = _FileReader(path, device)
        hdr = None
    try:
        if hdr is None:
            hdr = rd.header = read_header(path, file=rd.open())
        det = detect_format(path, device=device, orig_dtype=orig_dtype, header=hdr, reader=rd,
                            compute_dtype=compute_dtype)
        wanted = list(hdr.tensors) if keys is None else [k for k in keys if k in hdr.tensors]
        out: dict[str, torch.Tensor] = {}
        total = len(wanted)
        for i, key in enumerate(wanted):
            if key in det.consumed:
                pass
            elif key in det.layers:
                info = det.layers[key]
                qdata = rd.get(key)
                if info.decode is not None:
                    qdata = info.decode(qdata)
                layout = make_layout(info)
                try:
                    qt = QuantizedTensor.from_parts(qdata, det.scales[key].to(qdata.device), layout,
                                                    orig_dtype=det.orig_dtype, input_scale=det.input_scales.get(key),
                                                    config=config)
                except QuantizationError as exc:
                    raise _err(path, key, f"cannot build the quantized weight ({exc})") from exc
                out[key] = qt
            else:
                out[key] = rd.get(key)
            if progress is not None:
                progress(i + 1, total)
    finally:
        rd.close()
    return out, det.report


def _comfy_int8_layer(path, name: str, T: dict, rd: "_LazyReader"):
    """LayerInfo and scale of a layer in one of ComfyUI's int8 formats (int8_tensorwise, convrot_w4a4,
    asym_w4a8_int8)."""
    from .comfy_int8 import INT8_FORMATS, plan_layer

    cq_key = name + ".comfy_quant"
    ce = T[cq_key]
    expected = 'uint8 bytes of a JSON object like {"format": "int8_tensorwise"}'
    if ce.dtype != torch.uint8 or len(ce.shape) != 1 or ce.nbytes > MAX_COMFY_QUANT_BYTES:
        raise _err(path, cq_key, f"comfy_quant tensor has dtype {_fp8_name(ce.dtype)} and shape {list(ce.shape)}",
                   expected)
    cq = _loads(path, cq_key, rd.get(cq_key).numpy().tobytes(), expected)
    if not isinstance(cq, dict) or cq.get("format") not in INT8_FORMATS:
        raise _err(path, cq_key, f"comfy_quant says {_short(cq)} for an int8 weight",
                   "format " + ", ".join(repr(f) for f in INT8_FORMATS))
    layout, shape, scale, scale_key, extra, decode = plan_layer(
        lambda key, problem, want: _err(path, key, problem, want), name, cq, T, rd.get)
    info = LayerInfo(name, COMFY_PER_LAYER, cq["format"], None, torch.int8, shape, name + ".weight", scale_key,
                     None, bool(cq.get("full_precision_matrix_mult", False)), extra, layout, decode)
    return info, scale


def make_layout(info: LayerInfo):
    from .layouts import Block, PerRow, PerTensor

    if info.layout is not None:
        return info.layout
    if info.granularity == "mxfp8":
        from .mxfp8 import MXFP8

        return MXFP8()
    if info.granularity == "nvfp4":  # the stored (padded) shape; the model's Linear gives the true one
        from .nvfp4 import NVFP4

        return NVFP4(*info.shape)
    if info.granularity == "tensor":
        return PerTensor()
    if info.granularity == "row":
        return PerRow()
    return Block(*info.block)


__all__ = [
    "FormatError", "FormatReport", "LayerInfo", "DetectedFormat", "SafetensorsHeader", "TensorEntry",
    "read_header", "detect_format", "inspect_file", "load_file", "infer_layout", "make_layout",
    "KNOWN_BLOCKS", "block_grid", "check_scale_range", "check_nvfp4_range",
    "PLAIN", "COMFY_SCALED", "COMFY_METADATA", "COMFY_PER_LAYER", "MUSUBI", "WEIGHT_SCALE", "BLOCKWISE_INV",
    "UNQUANTIZED", "FP8_DTYPES", "FP8_BY_NAME", "ST_DTYPES", "ST_NAMES",
]
