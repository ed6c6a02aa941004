"""ComfyUI 0.29's own quantization (and newer trees': 0.33 adds NVFP4), used by tests to make the files
stock ComfyUI writes (in process)."""

from __future__ import annotations

import json

import torch

from helpers import fp8_files


def is_kitchen_era(tree) -> bool:
    """The tree quantizes with comfy-kitchen (ComfyUI 0.29 and newer), judged from its comfy/quant_ops.py."""
    ops = tree / "comfy" / "quant_ops.py"
    return ops.is_file() and "comfy_kitchen" in ops.read_text(errors="replace")


def stock_write(quant_ops, comfy_ops, sd: dict, fmt: str, quantize=fp8_files.default_quantize) -> tuple[dict, dict]:
    """Quantize the chosen weights of `sd` with 0.29's layout for `fmt` ("float8_e4m3fn", "float8_e5m2",
    "mxfp8"; "nvfp4" on 0.33 and newer) and serialize each with the tree's own mixed-precision Linear. Returns (the state dict as 0.29
    writes it, {weight key: 0.29's QuantizedTensor})."""
    layout = quant_ops.get_layout_class(quant_ops.QUANT_ALGOS[fmt]["comfy_tensor_layout"])
    ops = comfy_ops.mixed_precision_ops(compute_dtype=torch.bfloat16)
    out, theirs = {}, {}
    for key, w in sd.items():
        if not quantize(key, w):
            out[key] = w
            continue
        layer = key[: -len(".weight")]
        qdata, params = layout.quantize(w) if fmt == "mxfp8" else layout.quantize(w, scale="recalculate")
        lin = ops.Linear(w.shape[1], w.shape[0], bias=False)
        conf = torch.tensor(list(json.dumps({"format": fmt}).encode("utf-8")), dtype=torch.uint8)
        parts = {"weight": qdata, "weight_scale": params.scale, "comfy_quant": conf}
        if fmt == "nvfp4":  # block scales in weight_scale, the tensor scale in weight_scale_2
            parts.update(weight_scale=params.block_scale, weight_scale_2=params.scale)
        lin.load_state_dict(parts, strict=False)
        if not isinstance(lin.weight, quant_ops.QuantizedTensor):
            raise AssertionError(f"ComfyUI did not load its own quantized layer {layer}")
        theirs[key] = lin.weight
        for k, v in lin.state_dict().items():
            out[f"{layer}.{k}"] = v
    return out, theirs
