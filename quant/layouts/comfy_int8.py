"""ComfyUI's own INT8 layer formats (ComfyUI 0.33, per-layer ``<layer>.comfy_quant``), read and written.

What a file holds per layer, and the rule ComfyUI 0.33 dequantizes it by (``comfy/ops.py`` and
comfy-kitchen's eager backend); every format maps onto the pack's ``Int8`` layout (one scale per
tensor or output channel, optional regular-Hadamard ConvRot rotation), so each runs through the
INT8 path, and its weight-only dequantization gives ComfyUI's bits:

``int8_tensorwise``  ``.weight`` int8 ``[N, K]``; ``.weight_scale`` float, one value (or one per
                     output channel); JSON ``convrot: true`` (+ ``convrot_groupsize``, default 256;
                     also accepted under ``params``) means the weight is stored rotated and the scale
                     is per channel. Rule: ``q.float() * scale``, rotated back by
                     ``matmul(w.reshape(N, K/g, g), H.T)`` when convrot, then the cast.
``convrot_w4a4``     ``.weight`` int8 ``[N, K/2]``: two signed 4-bit values per byte (column 2j in
                     the low nibble); ``.weight_scale`` float32 per output channel; ConvRot group
                     ``convrot_groupsize`` (256). The same rule on the unpacked values.
``asym_w4a8_int8``   ``.weight_s_rel`` float8_e4m3fn (or its bytes) ``[N, K/group_size]``, one per output
                     channel and ``group_size`` inputs, so ``K = s_rel.shape[1] * group_size``;
                     ``.weight_s_channel`` float32 per output channel. ``.weight`` int8, and its row
                     width gives the bit depth (comfy-kitchen's rule): ``K/2`` bytes is the 4-bit form,
                     two unsigned codes per byte (low nibble first), optional ``.weight_codebook``
                     float32 ``[16]``; ``3K/4`` bytes is the 6-bit form of comfy-kitchen 0.2.36+
                     ("W6A8"): the same ``K/2``-byte nibble plane holding each code's low four bits,
                     then a ``K/4``-byte plane of its top two (column c in byte c//4 at bits
                     2*(c%4)), uniform (no codebook), K a multiple of 32, group_size of 16. Decoded
                     once to the int8 grid ComfyUI's GEMM uses: ``round(value(code) * s_rel)`` clamped
                     to +-127 with ``value = codebook[code]``, ``code - 8`` (4-bit) or ``code - 32``
                     (6-bit); then ``* s_channel``, cast to the compute dtype, and rotated back in that
                     dtype (``Int8(cast_first=True)``).

Writing: ``file_tensors`` gives a weight's tensors and its ``comfy_quant`` JSON in the
``int8_tensorwise`` form ComfyUI 0.33 reads (per-tensor, or per-channel with ConvRot 256).
Pure torch; never imports ComfyUI.
"""

from __future__ import annotations

import json

import torch

from ..errors import QuantizationError
from .int8 import Int8, check_block, hadamard_bytes

__all__ = ["INT8_FORMATS", "plan_layer", "unpack_int4", "pack_int4", "unpack_int6", "decode_asym_w4a8", "file_tensors",
           "file_form", "comfy_quant_bytes"]

INT8_FORMATS = ("int8_tensorwise", "convrot_w4a4", "asym_w4a8_int8")
DEFAULT_CONVROT = 256


def unpack_int4(packed: torch.Tensor, signed: bool) -> torch.Tensor:
    """``[N, K/2]`` bytes -> ``[N, K]`` int8: column 2j from the low nibble, 2j+1 from the high one."""
    b = packed.view(torch.uint8).to(torch.int16)
    lo, hi = b & 0xF, (b >> 4) & 0xF
    if signed:
        lo, hi = torch.where(lo >= 8, lo - 16, lo), torch.where(hi >= 8, hi - 16, hi)
    return torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1).to(torch.int8)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`unpack_int4` for values in -8..15 (either signedness): ``[N, K]`` -> ``[N, K/2]``."""
    v = values.to(torch.int16) & 0xF
    return (v[:, 0::2] | (v[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)


def unpack_int6(packed: torch.Tensor, k: int) -> torch.Tensor:
    """``[N, 3K/4]`` bytes (comfy-kitchen's 6-bit rows) -> ``[N, K]`` unsigned codes 0..63 as int16: the low
    four bits of column c from the leading ``K/2``-byte nibble plane (as :func:`unpack_int4`), the top two
    from the ``K/4``-byte plane after it (byte c//4, bits 2*(c%4) and 2*(c%4)+1)."""
    n = packed.shape[0]
    low = unpack_int4(packed[:, : k // 2], signed=False).to(torch.int16)
    top = packed[:, k // 2:].view(torch.uint8).to(torch.int16)
    shifts = torch.arange(0, 8, 2, dtype=torch.int16, device=packed.device)
    top = ((top.unsqueeze(-1) >> shifts) & 0x3).reshape(n, k)
    return low | (top << 4)


def decode_asym_w4a8(packed, s_rel, codebook, group_size: int) -> torch.Tensor:
    """asym_w4a8_int8 storage -> the int8 ``[N, K]`` grid (before ``s_channel``), as ComfyUI decodes it.
    ``K = s_rel.shape[1] * group_size``; rows of ``3K/4`` bytes are the 6-bit form, else the 4-bit one."""
    n, k = packed.shape[0], s_rel.shape[1] * group_size
    if packed.shape[1] * 4 == k * 3:
        codes, zero = unpack_int6(packed, k).to(torch.int64), 32.0
    else:
        codes, zero = unpack_int4(packed, signed=False).to(torch.int64), 8.0
    values = codebook.to(torch.float32)[codes] if codebook is not None else codes.float() - zero
    values = values.view(n, k // group_size, group_size) * s_rel.float().unsqueeze(-1)
    return values.view(n, k).round().clamp_(-127, 127).to(torch.int8)


def _conf(cq: dict, key: str, default):
    params = cq.get("params") if isinstance(cq.get("params"), dict) else {}
    return cq.get(key, params.get(key, default))


def _int(path_err, key, value, what: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise path_err(key, f"{what} is {value!r}", "a positive integer")
    return value


def plan_layer(err, name: str, cq: dict, tensors: dict, get):
    """How to build one ComfyUI INT8 layer: ``(layout, logical shape, scale float32, scale key,
    extra keys consumed, decode(qdata) -> int8 [N, K])``. ``tensors``: the header's entries;
    ``get(key)``: reads a (small) tensor; ``err(key, problem, expected)`` makes the FormatError."""
    fmt = cq["format"]
    wk = name + ".weight"
    e = tensors[wk]
    if e.dtype != torch.int8 or len(e.shape) != 2:
        raise err(wk, f"a {fmt} weight must be a 2-D int8 tensor, got {e.dtype} {list(e.shape)}", "int8 [out, in]")
    n, stored_k = e.shape
    cq_key = name + ".comfy_quant"

    def need(suffix):
        key = name + suffix
        if key not in tensors:
            raise err(key, f"missing for a {fmt} layer", f"a tensor '{key}'")
        return key, get(key)

    def float_scale(key, t, shape_ok, expected):
        if not t.dtype.is_floating_point or t.dtype.itemsize < 2:
            raise err(key, f"scale has dtype {t.dtype}", "a float32/bfloat16/float16 scale")
        t = t.to(torch.float32)
        if not shape_ok(t) or not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
            raise err(key, f"scale of shape {list(t.shape)} (finite and > 0 everywhere: "
                      f"{bool(torch.isfinite(t).all()) and bool((t > 0).all())})", expected)
        return t

    if fmt == "int8_tensorwise":
        skey, s = need(".weight_scale")
        convrot = bool(_conf(cq, "convrot", False))
        gs = _int(err, cq_key, _conf(cq, "convrot_groupsize", DEFAULT_CONVROT), "convrot_groupsize") if convrot else 0
        # per-channel scales are [N, 1]: ComfyUI multiplies q [N, K] by the scale as stored
        s = float_scale(skey, s, lambda t: t.numel() == 1 or tuple(t.shape) == (n, 1),
                        f"one value, or one per output channel as [{n}, 1]")
        per_row = s.dim() == 2 and s.numel() > 1 or (convrot and s.dim() == 2)
        layout = _layout(err, cq_key, per_row, gs, stored_k, n * stored_k)
        return layout, (n, stored_k), s.reshape(n, 1) if per_row else s.reshape(()), skey, (cq_key,), None
    if fmt == "asym_w4a8_int8":  # K comes from the group scales, the bit depth from the row width
        return _plan_asym_w4a8(err, name, cq, tensors, need, float_scale, n, stored_k)
    k = stored_k * 2
    gs = _int(err, cq_key, _conf(cq, "convrot_groupsize", DEFAULT_CONVROT), "convrot_groupsize")
    layout = _layout(err, cq_key, True, gs, k, n * stored_k)
    if fmt == "convrot_w4a4":
        skey, s = need(".weight_scale")
        s = float_scale(skey, s, lambda t: t.numel() == n, f"one value per output channel ({n})")
        return layout, (n, k), s.reshape(n, 1), skey, (cq_key,), lambda q: unpack_int4(q, signed=True)


def _plan_asym_w4a8(err, name: str, cq: dict, tensors: dict, need, float_scale, n: int, cols: int):
    """:func:`plan_layer` for asym_w4a8_int8, 4-bit (rows of K/2 bytes) or 6-bit (3K/4 bytes), where
    ``K = s_rel.shape[1] * group_size`` (comfy-kitchen reads the bit depth from the width the same way)."""
    cq_key = name + ".comfy_quant"
    group = _int(err, cq_key, _conf(cq, "group_size", 16), "group_size", 4)
    rkey, s_rel = need(".weight_s_rel")
    if s_rel.dtype == torch.uint8:
        s_rel = s_rel.view(torch.float8_e4m3fn)
    if s_rel.dim() != 2 or s_rel.shape[0] != n or s_rel.shape[1] < 1 or not s_rel.dtype.is_floating_point:
        raise err(rkey, f"group scales of dtype {s_rel.dtype} and shape {list(s_rel.shape)}",
                  f"float8_e4m3fn (or its bytes) of shape [{n}, in_features / group_size ({group})]")
    k = s_rel.shape[1] * group
    if cols * 2 == k:
        bits = 4
    elif cols * 4 == k * 3:
        bits = 6
    else:
        raise err(name + ".weight", f"packed rows are {cols} bytes wide, but the group scales "
                  f"{list(s_rel.shape)} with group_size {group} make K={k} inputs, whose rows are {k // 2} bytes "
                  f"at 4 bits and {k * 3 / 4:g} at 6 bits; the file is damaged or its group_size is wrong",
                  "rows of K/2 (4-bit) or 3K/4 (6-bit) bytes")
    if bits == 4 and (k % 16 or (16 % group and group % 16)):
        raise err(cq_key, f"group_size {group} does not fit K={k}", "a size that divides K and 16 (or a multiple of 16)")
    if bits == 6 and (k % 32 or group % 16):
        raise err(cq_key, f"6-bit rows (3K/4 bytes) with K={k} and group_size {group}",
                  "K a multiple of 32 and group_size a multiple of 16, as comfy-kitchen's 6-bit form has")
    gs = _int(err, cq_key, _conf(cq, "convrot_groupsize", DEFAULT_CONVROT), "convrot_groupsize")
    _layout(err, cq_key, True, gs, k, n * cols)  # the ConvRot group, checked as for the other formats
    ckey, s_ch = need(".weight_s_channel")
    s_ch = float_scale(ckey, s_ch, lambda t: t.numel() == n, f"one value per output channel ({n})")
    extra = [cq_key, rkey]
    codebook = None
    if name + ".weight_codebook" in tensors:
        bkey, codebook = need(".weight_codebook")
        if codebook.numel() != 16 or not codebook.dtype.is_floating_point:
            raise err(bkey, f"codebook of dtype {codebook.dtype} and shape {list(codebook.shape)}", "16 float values")
        if bits == 6:
            raise err(bkey, "a codebook with 6-bit rows (3K/4 bytes): comfy-kitchen's 6-bit form is uniform",
                      "no weight_codebook for 6-bit rows")
        extra.append(bkey)
    layout = Int8(True, gs, True, cast_first=True)
    return layout, (n, k), s_ch.reshape(n, 1), ckey, tuple(extra), \
        lambda q: decode_asym_w4a8(q, s_rel, codebook, group)


def _layout(err, key, per_row, gs: int, k: int, weight_bytes: int = 0):
    """The Int8 layout of a ConvRot group ``gs`` (0: none) over ``k`` inputs, the group checked against
    the layer before anything is built: it must divide ``k``, be a power of 4, and its ``gs x gs``
    float32 rotation matrix may not cost more than the layer's ``weight_bytes`` of weights (groups up to
    ComfyUI's default 256, a 256 KiB matrix, are always allowed)."""
    if gs:
        if k % gs:
            raise err(key, f"ConvRot group size {gs} does not divide in_features {k}",
                      "a divisor of in_features, a power of 4 such as 256")
        try:
            check_block(gs, regular=True)
        except QuantizationError as exc:
            raise err(key, f"ConvRot group size {gs}: {exc}", "a power of 4 such as 256") from None
        cost, allowed = hadamard_bytes(gs), max(weight_bytes, hadamard_bytes(DEFAULT_CONVROT))
        if cost > allowed:
            raise err(key, f"ConvRot group size {gs} needs a {gs} x {gs} rotation matrix of {cost:,} bytes, more "
                      f"than the layer's own {weight_bytes:,} bytes of weights",
                      f"a group whose matrix fits the layer (at most {_largest_group(allowed)}; ComfyUI writes 256)")
    return Int8(per_row, gs, bool(gs))


def _largest_group(budget: int) -> int:
    g = DEFAULT_CONVROT
    while hadamard_bytes(g * 4) <= budget:
        g *= 4
    return g


def comfy_quant_bytes(conf: dict) -> torch.Tensor:
    """A ``comfy_quant`` entry: the JSON as a uint8 tensor, as ComfyUI writes it."""
    return torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)


def file_form(layout, shape) -> tuple[Int8 | None, dict, tuple]:
    """How an Int8 weight of ``shape`` [out, in] is written in ComfyUI's ``int8_tensorwise`` form:
    ``(layout to requantize into or None to keep the data, comfy_quant dict, weight_scale shape)``.
    Weights whose rotation ComfyUI cannot name (the pack's own 128-wide Sylvester rotation, a decoded
    asym_w4a8 weight, 4- or 6-bit) are requantized per channel with ConvRot 256 where K allows it, else
    with their own ConvRot group (an asym_w4a8 layer's, e.g. 16 or 64: ComfyUI reads any power of 4), else
    per channel unrotated."""
    conf = {"format": "int8_tensorwise"}
    if not layout.cast_first and (layout.rotation == 0 or (layout.regular and layout.per_row)):
        if layout.rotation:
            conf.update(convrot=True, convrot_groupsize=layout.rotation)
        return None, conf, (shape[0], 1) if layout.per_row else ()
    gs = DEFAULT_CONVROT if shape[1] % DEFAULT_CONVROT == 0 else 0
    if not gs and layout.regular and layout.rotation and shape[1] % layout.rotation == 0:
        gs = layout.rotation  # outlier columns stay spread out: unrotated per channel loses ~10 dB on them
    if gs:
        conf.update(convrot=True, convrot_groupsize=gs)
    return Int8(True, gs, bool(gs)), conf, (shape[0], 1)


def file_tensors(w) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """An Int8 QuantizedTensor as ``(weight, weight_scale, comfy_quant dict)`` in ComfyUI's
    ``int8_tensorwise`` form (see :func:`file_form`)."""
    target, conf, sshape = file_form(w.layout, tuple(w.qdata.shape))
    if target is None:
        return w.qdata, w.scale.reshape(sshape), conf
    q, s = target.quantize(w.dequantize(torch.float32))
    return q, s.reshape(sshape), conf
