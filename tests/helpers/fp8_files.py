"""Build safetensors files in every published FP8 format from a float state dict (for the tests).

The quantization math here is written independently of `fp8_engram.quant` on purpose: a reader bug
cannot hide behind the same bug in the writer. Every builder returns the values the file encodes
(`expected[weight_key]` = float32 `fp8 * expand(scale)`), so tests compare the reader's dequantized
weights with what is really on disk.

Formats (FORMATS): plain casts, ComfyUI legacy scaled fp8 (with and without fp8 matmul, and a text
encoder prefixed marker), ComfyUI `_quantization_metadata`, ComfyUI per-layer `.comfy_quant`, musubi
`fp8_scaled` (block 64 along the input dim, per channel, per tensor), modelopt / compressed-tensors
`.weight_scale` (per tensor with `.input_scale`, per channel) and DeepSeek block-wise
`.weight_scale_inv` (128x128). BAD_KINDS: corruptions for the error tests.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch
from safetensors.torch import save_file

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2

FORMATS = (
    "plain_e4m3fn",
    "plain_e5m2",
    "comfy_scaled_fp8",
    "comfy_scaled_fp8_no_mm",
    "comfy_quant_metadata",
    "comfy_quant_per_layer",
    "musubi_block64",
    "musubi_channel",
    "musubi_tensor",
    "modelopt_tensor",
    "modelopt_channel",
    "blockwise_scale_inv",
)

# What fp8_engram.quant.formats must call each of them.
DETECTED_AS = {
    "plain_e4m3fn": "plain_fp8",
    "plain_e5m2": "plain_fp8",
    "comfy_scaled_fp8": "comfy_scaled_fp8",
    "comfy_scaled_fp8_no_mm": "comfy_scaled_fp8",
    "comfy_quant_metadata": "comfy_quant_metadata",
    "comfy_quant_per_layer": "comfy_quant_per_layer",
    "musubi_block64": "musubi_fp8_scaled",
    "musubi_channel": "musubi_fp8_scaled",
    "musubi_tensor": "musubi_fp8_scaled",
    "modelopt_tensor": "weight_scale",
    "modelopt_channel": "weight_scale",
    "blockwise_scale_inv": "blockwise_scale_inv",
}

# Formats whose scales stock ComfyUI 0.3.75 applies (per-tensor, and e4m3fn for the metadata form).
STOCK_READABLE = ("plain_e4m3fn", "plain_e5m2", "comfy_scaled_fp8", "comfy_scaled_fp8_no_mm", "comfy_quant_metadata")

BAD_KINDS = (
    "truncated",
    "header_lies",
    "missing_scale",
    "nan_scale",
    "zero_scale",
    "scale_shape",
    "metadata_not_json",
    "metadata_string_entry",
)


SMALL_LINEAR_KEYS = ["blocks.0.attn.qkv.weight", "blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc2.weight"]


def small_float_sd(seed: int = 0, *, with_conv: bool = False) -> dict[str, torch.Tensor]:
    """A small bf16 state dict shaped like a transformer block: three linears (one whose input size is
    not a multiple of 64, where musubi falls back to per-channel scales), a bias, a norm, and
    optionally a conv weight (which stays as it is)."""
    g = torch.Generator().manual_seed(seed)
    sd = {
        "blocks.0.attn.qkv.weight": torch.randn(384, 128, generator=g),
        "blocks.0.attn.qkv.bias": torch.randn(384, generator=g) * 0.1,
        "blocks.0.mlp.fc1.weight": torch.randn(256, 128, generator=g),
        "blocks.0.mlp.fc2.weight": torch.randn(128, 96, generator=g),
        "blocks.0.norm.weight": torch.ones(128),
    }
    if with_conv:
        sd["embed.proj.weight"] = torch.randn(128, 16, 2, 2, generator=g)
    return {k: v.to(torch.bfloat16) for k, v in sd.items()}


def default_quantize(key: str, tensor: torch.Tensor) -> bool:
    """Which tensors the builders quantize: every 2-D `.weight` (linear layers)."""
    return key.endswith(".weight") and tensor.dim() == 2 and tensor.is_floating_point()


def _fmax(dtype) -> float:
    return float(torch.finfo(dtype).max)


def _cast(w: torch.Tensor, scale_full: torch.Tensor, dtype) -> torch.Tensor:
    m = _fmax(dtype)
    return (w.double() / scale_full.double()).clamp(-m, m).to(dtype)


def _expand_block(scale: torch.Tensor, shape, r: int, c: int) -> torch.Tensor:
    out, inp = shape
    return scale.repeat_interleave(r, 0)[:out].repeat_interleave(c, 1)[:, :inp]


def quant_tensor(w: torch.Tensor, dtype=E4M3):
    scale = (w.double().abs().max() / _fmax(dtype)).clamp_min(1e-12).float()
    q = _cast(w, scale, dtype)
    return q, scale, q.double() * scale.double()


def quant_row(w: torch.Tensor, dtype=E4M3):
    scale = (w.double().abs().amax(dim=1, keepdim=True) / _fmax(dtype)).clamp_min(1e-12).float()
    q = _cast(w, scale, dtype)
    return q, scale, q.double() * scale.double()


def quant_block(w: torch.Tensor, r: int, c: int, dtype=E4M3, scale_dtype=torch.float32):
    out, inp = w.shape
    ro, co = -(-out // r), -(-inp // c)
    pad = torch.zeros(ro * r, co * c, dtype=torch.float64)
    pad[:out, :inp] = w.double().abs()
    amax = pad.reshape(ro, r, co, c).amax(dim=(1, 3))
    scale = (amax / _fmax(dtype)).clamp_min(1e-12).to(scale_dtype)
    full = _expand_block(scale.double(), w.shape, r, c)
    q = _cast(w, full, dtype)
    return q, scale, q.double() * full


def write_format(sd: dict[str, torch.Tensor], path, fmt: str, *, quantize=default_quantize,
                 prefix_marker: str = "") -> dict[str, torch.Tensor]:
    """Write `sd` as format `fmt` to `path`; returns {weight key: float64 values the file encodes}."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown test format {fmt!r}; one of {FORMATS}")
    out: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    meta_layers: dict[str, dict] = {}
    dtype = E5M2 if fmt == "plain_e5m2" else E4M3
    for key, t in sd.items():
        if not quantize(key, t):
            out[key] = t
            continue
        name = key[: -len(".weight")]
        if fmt.startswith("plain"):
            q = t.to(dtype)
            out[key] = q
            expected[key] = q.double()
        elif fmt.startswith("comfy_scaled_fp8"):
            q, s, dq = quant_tensor(t)
            out[key], out[name + ".scale_weight"], expected[key] = q, s, dq
            if name + ".bias" in sd:  # what 0.3.75 writes: the bias cast to fp8 without a scale
                out[name + ".bias"] = sd[name + ".bias"].to(E4M3)
        elif fmt in ("comfy_quant_metadata", "comfy_quant_per_layer"):
            q, s, dq = quant_tensor(t)
            out[key], out[name + ".weight_scale"], expected[key] = q, s, dq
            if fmt == "comfy_quant_metadata":
                meta_layers[name] = {"format": "float8_e4m3fn"}
            else:
                blob = json.dumps({"format": "float8_e4m3fn", "full_precision_matrix_mult": False}).encode()
                out[name + ".comfy_quant"] = torch.tensor(list(blob), dtype=torch.uint8)
        elif fmt == "musubi_block64":
            if t.shape[1] % 64 == 0:
                q, s, dq = quant_block(t, 1, 64, scale_dtype=t.dtype)
                s = s.reshape(t.shape[0], -1, 1)
            else:  # musubi falls back to per channel when the input size is not a multiple
                q, s, _ = quant_row(t)
                s = s.to(t.dtype)
                dq = q.double() * s.double()
            out[key], out[name + ".scale_weight"], expected[key] = q, s, dq
        elif fmt == "musubi_channel":
            q, s, _ = quant_row(t)
            s = s.to(t.dtype)
            out[key], out[name + ".scale_weight"], expected[key] = q, s, q.double() * s.double()
        elif fmt == "musubi_tensor":
            q, s, _ = quant_tensor(t)
            s = s.reshape(1).to(t.dtype)
            out[key], out[name + ".scale_weight"], expected[key] = q, s, q.double() * s.double()
        elif fmt == "modelopt_tensor":
            q, s, dq = quant_tensor(t)
            out[key], out[name + ".weight_scale"], expected[key] = q, s, dq
            out[name + ".input_scale"] = torch.tensor(0.05, dtype=torch.float32)
        elif fmt == "modelopt_channel":
            q, s, dq = quant_row(t)
            out[key], out[name + ".weight_scale"], expected[key] = q, s.reshape(-1), dq
        elif fmt == "blockwise_scale_inv":
            q, s, dq = quant_block(t, 128, 128)
            out[key], out[name + ".weight_scale_inv"], expected[key] = q, s, dq
    if fmt.startswith("comfy_scaled_fp8"):
        n = 0 if fmt == "comfy_scaled_fp8" else 2
        out[prefix_marker + "scaled_fp8"] = torch.zeros(n, dtype=E4M3)
    if fmt == "comfy_quant_metadata":
        metadata["_quantization_metadata"] = json.dumps({"format_version": "1.0", "layers": meta_layers})
    if fmt == "blockwise_scale_inv":
        metadata["quantization_config"] = json.dumps({"quant_method": "fp8", "weight_block_size": [128, 128]})
    _save(out, path, metadata)
    return expected


def tiny_sd3_per_tensor_folder(tiny_models_cache, folder, name: str) -> Path:
    """The suite's tiny SD3 as a per-tensor e4m3fn file in ComfyUI's mixed-precision form (stock-readable), written
    as ``folder/name`` and ``folder`` added to ComfyUI's diffusion_models paths (needs ComfyUI imported)."""
    import folder_paths
    from safetensors.torch import load_file

    folder = Path(folder)
    sd = load_file(str(Path(tiny_models_cache) / "diffusion_models" / "tiny_sd3.safetensors"))
    write_format(sd, folder / name, "comfy_quant_metadata")
    folder_paths.add_model_folder_path("diffusion_models", str(folder))
    return folder / name


def _save(tensors: dict[str, torch.Tensor], path, metadata: dict[str, str] | None = None) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata or None)


def write_all(sd: dict[str, torch.Tensor], folder, stem: str = "tiny") -> dict[str, tuple[Path, dict]]:
    """Every format of FORMATS in `folder` as `<stem>_<fmt>.safetensors`; -> {fmt: (path, expected)}."""
    folder = Path(folder)
    result = {}
    for fmt in FORMATS:
        path = folder / f"{stem}_{fmt}.safetensors"
        result[fmt] = (path, write_format(sd, path, fmt))
    return result


def _read_raw(path):
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    return header, data[8 + n :]


def _write_raw(path, header: dict, body: bytes) -> None:
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def write_bad(sd: dict[str, torch.Tensor], path, kind: str) -> str:
    """Write a broken file of kind `kind` (BAD_KINDS); returns a word the error message must contain."""
    path = Path(path)
    if kind == "truncated":
        write_format(sd, path, "comfy_quant_metadata")
        data = path.read_bytes()
        path.write_bytes(data[: len(data) - max(1, len(data) // 3)])
        return "truncated"
    if kind == "header_lies":
        write_format(sd, path, "comfy_quant_metadata")
        header, body = _read_raw(path)
        key = next(k for k in header if k.endswith(".weight") and len(header[k]["shape"]) == 2)
        header[key]["shape"] = [header[key]["shape"][0] * 2, header[key]["shape"][1]]
        _write_raw(path, header, body)
        return "lies"
    if kind == "metadata_not_json":
        write_format(sd, path, "comfy_quant_metadata")
        header, body = _read_raw(path)
        header["__metadata__"]["_quantization_metadata"] = "{layers: not json"
        _write_raw(path, header, body)
        return "JSON"
    if kind == "metadata_string_entry":
        write_format(sd, path, "comfy_quant_metadata")
        header, body = _read_raw(path)
        qm = json.loads(header["__metadata__"]["_quantization_metadata"])
        qm["layers"] = {k: "float8_e4m3fn" for k in qm["layers"]}  # the QUANTIZATION.md string form
        header["__metadata__"]["_quantization_metadata"] = json.dumps(qm)
        _write_raw(path, header, body)
        return "object"
    # The rest edit tensors of a per-tensor metadata file.
    tmp = path.with_name(path.name + ".src")
    write_format(sd, tmp, "comfy_quant_metadata")
    from safetensors import safe_open

    with safe_open(str(tmp), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata()
    os.unlink(tmp)
    scale_key = sorted(k for k in tensors if k.endswith(".weight_scale"))[0]
    if kind == "missing_scale":
        del tensors[scale_key]
        word = "missing scale"
    elif kind == "nan_scale":
        tensors[scale_key] = torch.tensor(float("nan"))
        word = "non-finite"
    elif kind == "zero_scale":
        tensors[scale_key] = torch.tensor(0.0)
        word = "zero"
    elif kind == "scale_shape":
        w = tensors[scale_key[: -len("_scale")]]
        tensors[scale_key] = torch.ones(w.shape[0] + 3, 7)
        word = "fits no layout"
    else:
        raise ValueError(f"unknown bad kind {kind!r}; one of {BAD_KINDS}")
    _save(tensors, path, metadata)
    return word
