"""What ComfyUI 0.33 itself does with comfy-kitchen 0.2.40's 6-bit ``asym_w4a8_int8`` ("W6A8") files, in
process with the tree in use (0.33 in CI's third leg; skipped on trees without the format).

- ComfyUI 0.33.0 with the comfy-kitchen it pins (0.2.31) loads a 6-bit layer but cannot run it: kitchen
  0.2.31 takes K as twice the row width and rejects the group scales on first use. This is why the pack
  does not write W6A8 (quant/quantize_model.py); should the tree's kitchen be 0.2.36 or newer, the test
  instead checks ComfyUI's dequantization equals the pack's, and says so.
- What Save FP8 Model writes for a loaded W6A8 layer (int8_tensorwise, per channel with ConvRot) loads
  in that ComfyUI and dequantizes to the pack's bits.
The 4-bit layer from the same kitchen release dequantizes alike in both, as a control.
"""

from __future__ import annotations

from importlib.metadata import version

import pytest
import torch

from helpers.host import comfy_in_process
from helpers.kitchen import kitchen_dir, write_asym_file
from helpers.numerics import sqnr

pytestmark = pytest.mark.integration

LAYERS = {"six": (24, 512, 16, 256, 6), "six_k96": (8, 96, 16, 16, 6), "four": (24, 512, 16, 256, 4)}


@pytest.fixture(scope="module")
def comfy_modules():
    comfy_in_process()
    import comfy.ops
    import comfy.quant_ops

    if "asym_w4a8_int8" not in comfy.quant_ops.QUANT_ALGOS:
        pytest.skip("this ComfyUI has no asym_w4a8_int8 format (it came with ComfyUI 0.33)")
    return comfy.ops, comfy.quant_ops


@pytest.fixture(scope="module")
def w6a8(tmp_path_factory):
    return write_asym_file(kitchen_dir("0.2.40"), LAYERS, tmp_path_factory.mktemp("comfy033_w6a8"))


def tree_kitchen() -> tuple[int, ...]:
    return tuple(int(p) for p in version("comfy-kitchen").split(".")[:3])


def comfy_linear(ops, sd: dict, name: str, n: int, k: int):
    """The layer `name` of `sd` loaded by the tree's own mixed-precision Linear (float32 compute)."""
    lin = ops.mixed_precision_ops(compute_dtype=torch.float32).Linear(k, n, bias=False, dtype=torch.float32)
    lin.load_state_dict({key[len(name) + 1:]: t for key, t in sd.items() if key.startswith(name + ".")}, strict=False)
    return lin


def test_comfyui_and_its_kitchen_on_w6a8_rows(comfy_modules, w6a8):
    from safetensors.torch import load_file

    from fp8_engram.quant import formats

    comfy_ops, quant_ops = comfy_modules
    path, refs = w6a8
    sd = load_file(str(path))
    ours, _ = formats.load_file(path, orig_dtype=torch.float32)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(3))
    for name, (n, k, _group, _rot, bits) in LAYERS.items():
        lin = comfy_linear(comfy_ops, sd, name, n, k)
        assert isinstance(lin.weight, quant_ops.QuantizedTensor), name  # it loads either way
        if bits == 6 and tree_kitchen() < (0, 2, 36):
            with pytest.raises(ValueError, match="s_rel"):
                lin.weight.dequantize()
            with pytest.raises(ValueError, match="s_rel"):
                lin(x[:, :k])
            continue
        theirs = lin.weight.dequantize()
        assert torch.equal(theirs, ours[name + ".weight"].dequantize(torch.float32)), name
        assert torch.equal(theirs, refs[name + ".float32"]), name


def test_saved_w6a8_loads_in_comfyui_with_the_packs_bits(comfy_modules, w6a8, tmp_path):
    from safetensors.torch import load_file

    from fp8_engram.quant import formats, save

    comfy_ops, quant_ops = comfy_modules
    path, refs = w6a8
    loaded, _ = formats.load_file(path)
    six = {key: w for key, w in loaded.items() if key.startswith("six")}
    save.save_state_dict(six, tmp_path / "saved.safetensors")
    sd = load_file(str(tmp_path / "saved.safetensors"))
    ours, report = formats.load_file(tmp_path / "saved.safetensors", orig_dtype=torch.float32)
    assert report.granularities == {"int8_tensorwise": len(six)}
    for key in six:
        name = key[: -len(".weight")]
        n, k = LAYERS[name][:2]
        lin = comfy_linear(comfy_ops, sd, name, n, k)
        assert isinstance(lin.weight, quant_ops.QuantizedTensor), name
        theirs = lin.weight.dequantize()
        assert torch.equal(theirs, ours[key].dequantize(torch.float32)), name
        # and it is still the W6A8 weight: the requantization keeps ~45 dB
        assert sqnr(refs[name + ".float32"], theirs) > 40.0, name
