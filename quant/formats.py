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
|                        | e4m3 `.weight_scale` (tiled), `.weight_scale_2` (quant/layouts/nvfp4.py)       |
| `nvfp4_without_metadata` / `mxfp8_without_metadata` | the same forms with no JSON: recognised by the     |
|                        | tensors (uint8 weight + 2-D e4m3 scales + f32 `.weight_scale_2`; e4m3fn weight + UE8M0) |
| (per layer) awq_w4a16  | int8 `.weight` [N, K/2] + `.weight_scale`, `.weight_zeros` (or `_zero`) [K/G, N]   |
|                        | (quant/layouts/awq.py)                                                 |
| (per layer) svdquant_w4a4 | tiled int8 `.weight` + `.weight_scale`, `.smooth_factor`, `.proj_down`, `.proj_up` |
|                        | (quant/layouts/svdquant.py; read as its effective weight)              |

Every scale multiplies: `w = fp8 * expand(scale)`. Block scales are read only with the block sizes of
`KNOWN_BLOCKS` or the one the file declares, and scales that would overflow the compute dtype are
refused (an NVFP4 layer's tensor scale times its largest block scale and e2m1 value included). Sizes a
file declares (ConvRot groups, tiled NVFP4 / MXFP8 scale grids, group sizes) are checked against the
tensors beside them before anything is built. Anything unknown or inconsistent raises `FormatError`, whose message names the file, the key
and what was expected.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Iterable

import torch

from .errors import FormatError, QuantizationError
from .layouts import awq, layout_for, mxfp8, svdquant
from .layouts.comfy_int8 import INT8_FORMATS, plan_layer
from .layouts.expert import nvfp4_file_scales
from .layouts.nvfp4 import GROUP as NVFP4_GROUP, split_scales
from .tensor import QuantizedTensor
from .format_report import (  # noqa: F401 - format names and report types are part of this module's API
    BLOCKWISE_INV, COMFY_FORMATS, COMFY_METADATA, COMFY_PER_LAYER, COMFY_SCALED, FLOAT_DTYPES, FP8_BY_NAME,
    FP8_DTYPES, MUSUBI, MXFP8_FORMAT, MXFP8_BY_TENSORS, NVFP4_BY_TENSORS, PLAIN, UNQUANTIZED, WEIGHT_SCALE, DetectedFormat, FormatReport, LayerInfo,
    _fp8_name, _make_report)
from .format_scales import (  # noqa: F401
    KNOWN_BLOCKS, _check_declared_group, _check_scale_values, block_grid, check_nvfp4_range, check_scale_range,
    infer_bank_layout, infer_layout, nvfp4_by_tensors)
from .safetensors_file import (  # noqa: F401
    MAX_COMFY_QUANT_BYTES, MAX_DIM, MAX_DIMS, MAX_HEADER_BYTES, MAX_METADATA_JSON_BYTES, ST_DTYPES, ST_NAMES,
    SafetensorsHeader, TensorEntry, _err, _FileReader, _is_int, _loads, _MappedReader,
    _parse_json_metadata, _short, read_header)

logger = logging.getLogger(__name__)

MARKER = "scaled_fp8"
QUANT_METADATA_KEY = "_quantization_metadata"

_SCALE_SUFFIXES = (".scale_weight", ".weight_scale_inv", ".weight_scale")
_INPUT_SCALE_SUFFIXES = (".input_scale", ".scale_input")
# Keys of quantization schemes this pack does not read (int4, zero points, NVFP4 outside ComfyUI's form):
# refused clearly, each with what the pack reads instead. NVFP4 tensor scales are read on layers marked
# as ComfyUI's NVFP4 form (`_detect_nvfp4`), nowhere else.
_UNSUPPORTED_SUFFIXES = (".weight_scale_2", ".weight_zero_point", ".weight_global_scale", ".weight_packed",
                         ".weight_shape", ".qweight", ".qzeros", ".scales", ".absmax", ".quant_map")
_NVFP4_LIKE_SUFFIXES = (".weight_scale_2", ".weight_global_scale")
# how UE8M0 (MXFP8) scales are stored: safetensors' F8_E8M0 where torch has it, else their bytes
_E8M0_DTYPES = tuple(d for d in (getattr(torch, "float8_e8m0fnu", None), torch.uint8) if d is not None)


def _layer_name(weight_key: str) -> str:
    return weight_key[: -len(".weight")]


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

    # ComfyUI's NVFP4 layers (own keys and checks); every `.comfy_quant`'s JSON bytes, read once for both passes
    nv_layers = _detect_nvfp4(path, hdr, rd, compute_dtype, cq_raw := {})
    for key in (k for k in T if k.endswith(_UNSUPPORTED_SUFFIXES)):
        for suf in _UNSUPPORTED_SUFFIXES:
            if key.endswith(suf) and key[: -len(suf)] + ".weight" not in nv_layers:
                why = nvfp4_by_tensors(T, key[: -len(suf)]) if suf == ".weight_scale_2" else ""
                raise _unsupported_key(path, key, suf, why or "")

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
    meta_own: dict[str, dict] = {}  # layers in a per-layer form of their own (AWQ, SVDQuant) listed in the metadata
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
            if entry.get("format") in (awq.FORMAT, svdquant.FORMAT):
                meta_own[name] = entry  # read with the layer below (ComfyUI turns it into a .comfy_quant)
                continue
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
    orphan_suffixes = _SCALE_SUFFIXES + _INPUT_SCALE_SUFFIXES + (".comfy_quant",)
    for key in (k for k in T if k.endswith(orphan_suffixes)):
        for suf in orphan_suffixes:
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
        if (has_cq or name in meta_own) and e.dtype in (torch.int8, torch.uint8):
            # ComfyUI 0.33's int8 formats (layouts/comfy_int8.py), kitchen 0.2.40's AWQ and SVDQuant (awq.py, svdquant.py)
            layers[wk], scales[wk] = _integer_layer(path, name, T, rd, meta_own.get(name))
            consumed.update((layers[wk].scale_key,) + layers[wk].consumed)
            continue
        if len(present) > 1:
            raise _err(path, name + present[1], f"layer has several scale keys {present}",
                       "exactly one of .scale_weight, .weight_scale, .weight_scale_inv")
        if not is_fp8:
            raise _err(path, wk, f"weight has dtype {_fp8_name(e.dtype)} but the file gives it a quantization scale",
                       "a float8_e4m3fn or float8_e5m2 weight")
        if len(e.shape) not in (2, 3):
            raise _err(path, wk, f"quantized weight has shape {list(e.shape)}",
                       "a 2-D linear weight [out, in] or a 3-D expert bank [experts, rows, cols]")
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
            raw = cq_raw[cq_key] if cq_key in cq_raw else rd.get(cq_key).numpy().tobytes()
            cq = _loads(path, cq_key, raw, expected)
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
        elif e.dtype == torch.float8_e4m3fn and T[name + ".weight_scale"].dtype in _E8M0_DTYPES \
                and len(T[name + ".weight_scale"].shape) == 2:
            # ComfyUI's MXFP8 form without its JSON: power-of-two UE8M0 scales say what it is
            source, comfy_format = MXFP8_BY_TENSORS, MXFP8_FORMAT
        else:
            source = WEIGHT_SCALE
        suffix = present[0]
        scale_key = name + suffix
        se = T[scale_key]
        bank_layout = None
        if len(e.shape) == 3:  # a mixture-of-experts bank: one scale, or one per expert
            gran, block, norm_shape, bank_layout = infer_bank_layout(path, scale_key, e.shape, se.shape, comfy_format)
            scale = _check_scale_values(path, scale_key, rd.get(scale_key)).reshape(norm_shape)
        elif comfy_format == MXFP8_FORMAT:

            if has_cq:
                _check_declared_group(path, cq_key, cq, MXFP8_FORMAT, mxfp8.BLOCK)
            if in_meta:
                _check_declared_group(path, f"__metadata__.{QUANT_METADATA_KEY}.layers.{name}", meta_layers[name],
                                      MXFP8_FORMAT, mxfp8.BLOCK)

            gran, block = "mxfp8", None
            try:
                scale = mxfp8.scales_from_file(rd.get(scale_key), e.shape)
            except QuantizationError as exc:
                unmarked = ("; the layer has no comfy_quant, so its e4m3fn weight and UE8M0 scales were taken for "
                            "ComfyUI's MXFP8 form") if source == MXFP8_BY_TENSORS else ""
                raise _err(path, scale_key, f"bad MXFP8 block scales ({exc}){unmarked}",
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
                               full_precision_mm, tuple(extra), layout=bank_layout)

    for name in meta_own:
        if name + ".weight" not in T:
            raise _err(path, f"__metadata__.{QUANT_METADATA_KEY}.layers.{name}",
                       "metadata lists a layer the file does not hold", f"a tensor '{name}.weight'")
    if meta_layers is not None:
        for name in meta_layers:
            if name + ".weight" not in T:
                raise _err(path, f"__metadata__.{QUANT_METADATA_KEY}.layers.{name}",
                           "metadata lists a layer the file does not hold", f"a tensor '{name}.weight'")

    uses_scales = bool(layers)
    # ---- fp8 2-D weights without any scale (a 3-D one may as well be a Conv1d kernel as an expert bank: it
    # stays a plain tensor, as before)
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


def _unsupported_key(path, key: str, suf: str, why: str = "") -> FormatError:
    """Why a key of a quantization scheme outside the ones this pack reads is refused, and what to do. `why`:
    for an NVFP4 tensor scale, what kept its layer from being read as NVFP4 by its tensors."""
    if suf in _NVFP4_LIKE_SUFFIXES:
        layer = key[: -len(suf)]
        return _err(path, key, f"'{suf}' is an NVFP4 tensor scale, but the layer '{layer}' is not marked as "
                    f"NVFP4{' and ' + why if why else ''}: this pack reads NVFP4 in ComfyUI's form only and does "
                    "not read other NVFP4 layouts (modelopt's, compressed-tensors')",
                    f"a '{layer}.comfy_quant' JSON (or a _quantization_metadata entry) saying "
                    '{"format": "nvfp4"}, with a uint8 packed \'.weight\', e4m3 \'.weight_scale\' and float32 '
                    "'.weight_scale_2' (the form ComfyUI 0.33 writes; this pack's Quantize Model to FP8 node "
                    "with granularity nvfp4 and Save FP8 Model write it too from the bf16 model), or an FP8 "
                    "checkpoint")
    return _err(path, key, f"'{suf}' keys belong to an int4 / GPTQ / AWQ / bitsandbytes style quantization "
                "(packed integers with zero points or lookup tables), which this pack does not read",
                "an FP8 checkpoint (float8 weights with float scales), ComfyUI's int8 / mxfp8 / nvfp4 "
                "per-layer forms, or the model in bf16/fp16 to convert with this pack")


def _detect_nvfp4(path, hdr: SafetensorsHeader, rd: _LazyReader, compute_dtype, cq_raw: dict) -> dict:
    """The layers of a file in ComfyUI's NVFP4 form (see quant/layouts/nvfp4.py): a `.comfy_quant` or an entry of
    `_quantization_metadata` (which ComfyUI turns into `.comfy_quant`) says "nvfp4". Returns
    {weight key: (LayerInfo, the QuantizedTensor's scale bytes)}; reads only scales and JSON (into ``cq_raw``)."""

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
        raw = cq_raw[cq_key] = rd.get(cq_key).numpy().tobytes()
        if b"nvfp4" not in raw:
            continue
        cq = _loads(path, cq_key, raw, 'uint8 bytes of a JSON object like {"format": "nvfp4"}')
        if isinstance(cq, dict) and cq.get("format") == "nvfp4":
            name = cq_key[: -len(".comfy_quant")]
            confs[name] = (cq, COMFY_METADATA if name in confs else COMFY_PER_LAYER, cq_key)

    # ComfyUI's form without its JSON (ComfyUI issue #15511: stock loads such files unquantized and fails):
    # recognised by the tensors alone, where every one of them has the form's dtype and rank
    listed = set()
    if QUANT_METADATA_KEY in hdr.metadata:
        qm = _parse_json_metadata(path, f"__metadata__.{QUANT_METADATA_KEY}", hdr.metadata[QUANT_METADATA_KEY],
                                  "quantization metadata JSON")
        if isinstance(qm, dict) and isinstance(qm.get("layers"), dict):
            listed = set(qm["layers"])
    for s2k in T:
        if not s2k.endswith(".weight_scale_2"):
            continue
        name = s2k[: -len(".weight_scale_2")]
        if name in confs or name in listed or name + ".comfy_quant" in T or nvfp4_by_tensors(T, name) is not None:
            continue  # marked otherwise, or not this form: refused by the general reader, saying why
        confs[name] = ({"format": "nvfp4"}, NVFP4_BY_TENSORS, s2k)

    found = {}
    for name, (cq, source, conf_key) in sorted(confs.items()):
        cq_key = name + ".comfy_quant"
        _check_declared_group(path, conf_key, cq, "nvfp4", NVFP4_GROUP)
        wk, sk, s2k = name + ".weight", name + ".weight_scale", name + ".weight_scale_2"
        for key in (wk, sk, s2k):
            if key not in T:
                raise _err(path, key, "missing tensor of an NVFP4 layer (the file says the layer is nvfp4)",
                           f"'{wk}' (uint8 packed e2m1), '{sk}' (e4m3 block scales) and '{s2k}' (float32 scale)")
        if name + ".pre_quant_scale" in T:
            raise _err(path, name + ".pre_quant_scale", "NVFP4 layers with a pre-quantization input scale (AWQ "
                       "smoothing) are not supported", "an NVFP4 layer without '.pre_quant_scale'")
        e = T[wk]
        if e.dtype != torch.uint8 or len(e.shape) not in (2, 3) or e.shape[-2] % NVFP4_GROUP \
                or (2 * e.shape[-1]) % NVFP4_GROUP:
            raise _err(path, wk, f"NVFP4 weight has dtype {_fp8_name(e.dtype)} and shape {list(e.shape)}",
                       f"uint8 [R, C / 2] (an expert bank: [E, R, C / 2]) with R and C multiples of {NVFP4_GROUP}")
        try:
            layout, scale, pieces = nvfp4_file_scales(rd.get(sk), rd.get(s2k), e.shape)
        except QuantizationError as exc:
            unmarked = ("; the layer has no comfy_quant, so it was taken for ComfyUI's NVFP4 form by its tensors, "
                        "but its block scales are not laid out as that form lays them out (modelopt and "
                        "compressed-tensors keep them [out, in / 16] in plain order, which this pack does not "
                        "read)") if source == NVFP4_BY_TENSORS else ""
            raise _err(path, sk, f"bad NVFP4 scales ({exc}){unmarked}",
                       "e4m3 block scales in cuBLAS's 128x4 tiled order and one finite float32 scale > 0") from exc
        for lay, piece in pieces:  # one 2-D layer, or each expert of a bank
            block, ts = split_scales(piece, lay)
            check_nvfp4_range(path, s2k, block, float(ts), compute_dtype)
        extra = [s2k] + [k for k in [cq_key] + [name + s for s in _INPUT_SCALE_SUFFIXES] if k in T]
        shape = (*(int(v) for v in e.shape[:-1]), int(e.shape[-1]) * 2)
        info = LayerInfo(name, source, "nvfp4", None, torch.uint8, shape, wk, sk, None,
                         bool(cq.get("full_precision_matrix_mult", False)), tuple(extra),
                         layout=layout if len(e.shape) == 3 else None)
        found[wk] = (info, scale)
    return found


def inspect_file(path) -> FormatReport:
    """Format summary of a file without building any weight (for `convert --info`)."""
    return detect_format(path).report


ProgressFn = Callable[[int, int], None]


def load_file(path, *, device: str = "cpu", orig_dtype: torch.dtype | None = None, config=None,
              progress: ProgressFn | None = None, keys: Iterable[str] | None = None,
              mmap: bool = False, defer: bool = False) -> tuple[dict, FormatReport]:
    """Normalized state dict + report. Quantized weights are `QuantizedTensor`s over the file's FP8 bytes.

    Tensors are read into memory this process owns (`mmap=False`), so nothing depends on the file once
    this returns: replacing or truncating it later cannot crash the process. `mmap=True` maps them
    instead (read lazily, no private copy), for callers that know the file stays as it is. `defer=True` reads
    FP8 layers' codes after this returns (``safetensors_file.DeferredReads``: each weight waits for its own).
    `config` (a ComputeConfig or None) is attached to every quantized weight; a scale that would
    overflow its compute dtype (float32's range when it has none) is refused. `progress(done, total)`
    is called per tensor; it may raise to cancel. `keys`, when given, limits the tensors returned.
    """

    path = os.fspath(path)
    compute_dtype = getattr(config, "compute_dtype", None)
    if mmap:
        hdr = read_header(path)
        rd = _MappedReader(path, device)
    else:
        rd = _FileReader(path, device, defer=defer)
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
                layout = make_layout(info)
                qdata, fill = rd.later(key) if info.decode is None and layout.family == "fp8" else (rd.get(key), None)
                if info.decode is not None:
                    qdata = info.decode(qdata)
                try:
                    qt = QuantizedTensor.from_parts(qdata, det.scales[key].to(qdata.device), layout,
                                                    orig_dtype=det.orig_dtype, input_scale=det.input_scales.get(key),
                                                    config=config)
                except QuantizationError as exc:
                    raise _err(path, key, f"cannot build the quantized weight ({exc})") from exc
                out[key] = qt if fill is None else qt.defer_codes(*fill)
            else:
                out[key] = rd.get(key)
            if progress is not None:
                progress(i + 1, total)
        rd.start_later()
    finally:
        rd.close()  # (a load that failed: its reads never start, and nothing returned waits for them)
    _fold_unsigned_shifts(out, det, None if keys is None else set(wanted))
    return out, det.report


def _fold_unsigned_shifts(out: dict, det: DetectedFormat, wanted: set | None) -> None:
    """An act_unsigned SVDQuant layer's product adds a constant per output (kitchen shifts its activation by
    0.171875 before the 4-bit branch); the compute floor multiplies the effective weight only, so the constant
    goes into the layer's bias (made in the file's dtype where the file has none)."""
    for key, info in det.layers.items():
        w = out.get(key)
        if info.granularity != svdquant.FORMAT or w is None:
            continue
        c = svdquant.unsigned_shift_bias(w)
        if c is None:
            continue
        bias_key = info.name + ".bias"
        if wanted is not None and bias_key not in wanted and bias_key in det.header.tensors:
            continue  # the caller did not ask for this layer's bias (it gets the weight alone)
        bias = out.get(bias_key)
        out[bias_key] = (c if bias is None else bias.float() + c).to(det.orig_dtype if bias is None else bias.dtype)


def _integer_layer(path, name: str, T: dict, rd: "_LazyReader", meta_conf: dict | None):
    """LayerInfo and scale of a layer with an integer weight and a format of its own: one of ComfyUI's int8
    formats (int8_tensorwise, convrot_w4a4, asym_w4a8_int8) or comfy-kitchen's awq_w4a16 / svdquant_w4a4. Its JSON comes from
    `<layer>.comfy_quant`, or from the `_quantization_metadata` entry (`meta_conf`) where the file has no such
    tensor."""
    cq_key = name + ".comfy_quant"
    formats_known = INT8_FORMATS + (awq.FORMAT, svdquant.FORMAT)
    expected = 'uint8 bytes of a JSON object like {"format": "int8_tensorwise"}'
    if cq_key in T:
        ce = T[cq_key]
        if ce.dtype != torch.uint8 or len(ce.shape) != 1 or ce.nbytes > MAX_COMFY_QUANT_BYTES:
            raise _err(path, cq_key, f"comfy_quant tensor has dtype {_fp8_name(ce.dtype)} and shape {list(ce.shape)}",
                       expected)
        cq = _loads(path, cq_key, rd.get(cq_key).numpy().tobytes(), expected)
        conf_key = cq_key
    else:
        cq, conf_key = meta_conf, f"__metadata__.{QUANT_METADATA_KEY}.layers.{name}"
    if not isinstance(cq, dict) or cq.get("format") not in formats_known:
        raise _err(path, conf_key, f"comfy_quant says {_short(cq)} for an integer ({_fp8_name(T[name + '.weight'].dtype)}) "
                   "weight", "format " + ", ".join(repr(f) for f in formats_known))

    def err(key, problem, want):
        return _err(path, key, problem, want)

    source = COMFY_PER_LAYER if cq_key in T else COMFY_METADATA
    if cq["format"] in (awq.FORMAT, svdquant.FORMAT):
        plan = awq.plan_layer if cq["format"] == awq.FORMAT else svdquant.plan_layer
        layout, scale, scale_key, extra, decode = plan(err, name, cq, T, rd.get)
        extra = tuple(k for k in extra if k in T)
        info = LayerInfo(name, source, cq["format"], None, torch.int8, layout.shape, name + ".weight", scale_key,
                         None, bool(cq.get("full_precision_matrix_mult", False)), extra, layout, decode)
        return info, scale
    if T[name + ".weight"].dtype != torch.int8:
        raise _err(path, name + ".weight", f"a {cq['format']} weight of dtype {_fp8_name(T[name + '.weight'].dtype)}",
                   "int8 (ComfyUI 0.33's int8 formats)")
    layout, shape, scale, scale_key, extra, decode = plan_layer(err, name, cq, T, rd.get)
    extra = tuple(k for k in extra if k in T)
    info = LayerInfo(name, source, cq["format"], None, torch.int8, shape, name + ".weight", scale_key,
                     None, bool(cq.get("full_precision_matrix_mult", False)), extra, layout, decode)
    return info, scale


def make_layout(info: LayerInfo):
    """The layout a layer plan describes (NVFP4 at the stored, padded shape: the model's Linear gives the
    true one)."""
    if info.layout is not None:
        return info.layout
    shape = info.shape if info.granularity == "nvfp4" else None
    return layout_for(info.granularity, info.block, shape)


__all__ = [
    "FormatError", "FormatReport", "LayerInfo", "DetectedFormat", "SafetensorsHeader", "TensorEntry",
    "read_header", "detect_format", "inspect_file", "load_file", "infer_layout", "make_layout",
    "KNOWN_BLOCKS", "block_grid", "check_scale_range", "check_nvfp4_range",
    "PLAIN", "COMFY_SCALED", "COMFY_METADATA", "COMFY_PER_LAYER", "MUSUBI", "WEIGHT_SCALE", "BLOCKWISE_INV",
    "UNQUANTIZED", "FP8_DTYPES", "FP8_BY_NAME", "ST_DTYPES", "ST_NAMES"]
