"""A mixed int4 file (AWQ W4A16 and SVDQuant W4A4 layers, comfy-kitchen 0.2.40's forms) as a plain float32
model, every int4 layer read by comfy-kitchen's own code (a pinned release, in a subprocess), so a test's
reference does not come from the pack's reader.

- AWQ W4A16: kitchen's layout dequantization (``TensorCoreAWQW4A16Layout.dequantize``) to float32.
- SVDQuant W4A4: kitchen's own storage codecs untile and unpack the weight, its scales and ``proj_up``
  (``_tile_packed_*``, ``_unpack_int4_row_major``); the effective weight of the plain linear map is then formed
  in float32 as the comfy-quants spec defines it, ``(w * scale) / smooth + proj_up @ proj_down.T``. kitchen's
  own ``dequantize`` is not used: in 0.2.40 it runs only in the layer's dtype (bf16 here), a rounding the
  float32 reference must not have.
Every other floating tensor is written as float32; the ``comfy_quant`` entries are dropped.
"""

from __future__ import annotations

from pathlib import Path

from helpers.kitchen import run_kitchen

_DEQUANTIZE = r"""
import json, sys
import torch
from safetensors.torch import load_file, save_file
from comfy_kitchen.backends.eager import svdquant as eager
from comfy_kitchen.tensor.awq_w4a16 import TensorCoreAWQW4A16Layout as AWQ

src, out = sys.argv[1], sys.argv[2]
sd = load_file(src)
layers = {k[: -len(".comfy_quant")]: json.loads(bytes(v.tolist()).decode("utf-8"))
          for k, v in sd.items() if k.endswith(".comfy_quant")}
plain, done = {}, set()
for name, conf in layers.items():
    w = sd[name + ".weight"]
    if conf["format"] == "awq_w4a16":
        n, k = w.shape[0], w.shape[1] * 2
        p = AWQ.Params(scale=sd[name + ".weight_scale"], orig_dtype=torch.float32, orig_shape=(n, k),
                       zeros=sd[name + ".weight_zeros"], group_size=conf.get("group_size", 64))
        plain[name + ".weight"] = AWQ.dequantize(w, p).float()
        done |= {name + s for s in (".weight", ".weight_scale", ".weight_zeros", ".comfy_quant")}
    elif conf["format"] == "svdquant_w4a4":
        codes = eager._unpack_int4_row_major(eager._tile_packed_weight_to_row_major(w))
        scale = eager._tile_packed_scales_to_natural(sd[name + ".weight_scale"]).float()
        up = eager._tile_packed_lora_up_to_natural(sd[name + ".proj_up"]).float()
        down, smooth = sd[name + ".proj_down"].float(), sd[name + ".smooth_factor"].float()
        n, k = codes.shape
        wq = (codes.float().view(n, k // 64, 64) * scale.t().unsqueeze(-1)).view(n, k)
        plain[name + ".weight"] = wq / smooth[None, :] + up @ down.t()
        done |= {name + s for s in (".weight", ".weight_scale", ".smooth_factor", ".proj_down", ".proj_up",
                                    ".comfy_quant")}
    else:
        raise SystemExit(f"{src}: layer {name} has format {conf['format']!r}, not awq_w4a16 or svdquant_w4a4")
for key, t in sd.items():
    if key not in done:
        plain[key] = t.float() if t.is_floating_point() else t
save_file({k: v.contiguous() for k, v in plain.items()}, out)
print(json.dumps({c: sum(1 for v in layers.values() if v["format"] == c) for c in ("awq_w4a16", "svdquant_w4a4")}))
"""


def dequantize_with_kitchen(folder: Path, src: Path, out: Path) -> dict:
    """Write `src`'s model to `out` in float32, its int4 layers read by the comfy-kitchen in `folder` (see the
    module docstring); returns {format: layers read}."""
    import json

    done = run_kitchen(folder, _DEQUANTIZE, str(src), str(out))
    return json.loads(done.stdout.strip().splitlines()[-1])
