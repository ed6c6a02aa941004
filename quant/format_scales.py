"""How a file's scale tensors map to a layout, and the checks every scale passes before a weight is built.

The block shapes published formats use (``KNOWN_BLOCKS``), the grid a block gives over a weight, the
layout a scale shape describes, and the range checks (a scale that would overflow the compute dtype,
an NVFP4 tensor scale, a declared group size), and whether a layer without metadata has NVFP4's tensors. Floor 6 (file I/O).
"""

from __future__ import annotations

import math

import torch

from .format_report import FLOAT_DTYPES, _fp8_name
from .layouts.expert import PerExpert
from .layouts.nvfp4 import E2M1_MAX
from .safetensors_file import _err, _is_int, _short

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


def infer_bank_layout(path, scale_key: str, weight_shape, scale_shape, comfy_format=None):
    """Map a scale shape to (granularity, None, normalized scale shape, layout or None) for a 3-D FP8 expert bank
    [experts, rows, cols]: one scale ("tensor") or one per expert ("expert", PerExpert); others are refused."""
    n = weight_shape[0]
    sshape = tuple(scale_shape)
    if comfy_format not in (None, "float8_e4m3fn", "float8_e5m2"):
        raise _err(path, scale_key, f"expert bank of shape {list(weight_shape)} in format {comfy_format}",
                   "an FP8 expert bank (float8_e4m3fn or float8_e5m2) with a per-tensor or per-expert scale")
    if math.prod(sshape) == 1 and len(sshape) <= 3 and (n != 1 or sshape != (1,)):
        return "tensor", None, (), None
    if sshape in ((n,), (n, 1, 1)):
        return "expert", None, (n, 1, 1), PerExpert()
    raise _err(path, scale_key, f"scale shape {list(sshape)} fits no layout for the expert bank of shape "
               f"{list(weight_shape)}", f"[] or [1] (per tensor), or [{n}] or [{n}, 1, 1] (one scale per expert)")


def _check_scale_values(path, key: str, t: torch.Tensor) -> torch.Tensor:
    if t.dtype not in FLOAT_DTYPES:
        raise _err(path, key, f"scale has dtype {str(t.dtype).removeprefix('torch.')}",
                   "a float32, float16 or bfloat16 scale")
    t = t.to(torch.float32)
    if t.numel() == 0:
        raise _err(path, key, "scale is empty", "at least one element")
    if t.numel() == 1 and t.device.type == "cpu":  # one value (most files): checked as a number
        v = float(t.reshape(()))
        if math.isfinite(v) and v > 0:
            return t
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
    if not scale.numel():
        top = 0.0
    elif scale.numel() == 1:
        top = abs(float(scale.detach().reshape(())))
    else:
        top = float(scale.detach().abs().max())
    if top * fmax > limit:
        raise _err(path, key, f"scale {top:.4g} times {_fp8_name(fp8_dtype)}'s largest value {fmax:g} is "
                   f"{top * fmax:.4g}, beyond {_fp8_name(dtype)}'s range ({limit:.4g}): the weights would "
                   "dequantize to inf and every output to NaN",
                   f"scales of at most {limit / fmax:.4g} for {_fp8_name(dtype)} (a weight's absolute maximum "
                   f"divided by {fmax:g})")


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


def nvfp4_by_tensors(T: dict, name: str) -> str | None:
    """None when the layer `name` has the tensors of ComfyUI's NVFP4 form (a uint8 2-D `.weight`, a
    float8_e4m3fn 2-D `.weight_scale`, a one-value float32 `.weight_scale_2`), else what differs (for the
    message that refuses it). Their sizes are checked as for any NVFP4 layer, when it is read."""
    wk, sk, s2k = name + ".weight", name + ".weight_scale", name + ".weight_scale_2"
    if wk not in T:
        return f"it has no '{wk}'"
    if T[wk].dtype != torch.uint8 or len(T[wk].shape) != 2:
        return f"its weight is {_fp8_name(T[wk].dtype)} {list(T[wk].shape)}, not packed uint8 [out, in / 2]"
    if sk not in T:
        return f"it has no block scales '{sk}'"
    if T[sk].dtype != torch.float8_e4m3fn or len(T[sk].shape) != 2:
        return f"its block scales are {_fp8_name(T[sk].dtype)} {list(T[sk].shape)}, not 2-D float8_e4m3fn"
    if s2k in T and (T[s2k].dtype != torch.float32 or T[s2k].numel != 1):
        return f"its tensor scale is {_fp8_name(T[s2k].dtype)} {list(T[s2k].shape)}, not one float32 value"
    return None
