"""Reading every FP8 format into QuantizedTensor weights: the dequantized weights equal the values the
file encodes, nothing is copied to full precision, and other tensors keep their stored dtype."""

from __future__ import annotations

import pytest
import torch

from fp8_engram.quant import formats
from fp8_engram.quant.config import ComputeConfig
from fp8_engram.quant.tensor import QuantizedTensor
from helpers import fp8_files
from helpers.numerics import sqnr

pytestmark = pytest.mark.unit

LINEAR = fp8_files.SMALL_LINEAR_KEYS


def float_sd() -> dict[str, torch.Tensor]:
    return fp8_files.small_float_sd(1)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return fp8_files.write_all(float_sd(), tmp_path_factory.mktemp("load"))


@pytest.mark.parametrize("fmt", fp8_files.FORMATS)
def test_dequantized_weights_equal_the_file_values(files, fmt):
    path, expected = files[fmt]
    sd, report = formats.load_file(path)
    for key in LINEAR:
        qt = sd[key]
        assert isinstance(qt, QuantizedTensor)
        assert qt.qdata.dtype in formats.FP8_DTYPES
        assert qt.shape == expected[key].shape
        torch.testing.assert_close(qt.dequantize(torch.float64), expected[key], rtol=0, atol=0)
    assert report.layers_quantized == len(LINEAR)
    # consumed keys are gone, the rest keeps its dtype
    assert not any(k.endswith(("_scale", ".scale_weight", ".comfy_quant", "scaled_fp8", ".input_scale", "_scale_inv"))
                   for k in sd)
    assert sd["blocks.0.norm.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("fmt", fp8_files.FORMATS)
def test_each_format_is_close_to_the_float_weights(files, fmt):
    """Quality of the encodings themselves (plain casts have no scale and lose the most)."""
    path, _ = files[fmt]
    sd, _ = formats.load_file(path)
    ref = float_sd()
    floor = 15.0 if fmt == "plain_e5m2" else 25.0
    for key in LINEAR:
        assert sqnr(ref[key], sd[key].dequantize(torch.float64)) > floor


def test_weights_stay_fp8_and_nothing_stays_mapped(files, tmp_path):
    """The weights keep one byte per element, and the loader reads them into memory: overwriting the
    file in place (as `cp` over it does) and deleting it afterwards changes nothing that was loaded."""
    import shutil

    path = tmp_path / "copy.safetensors"
    shutil.copy(files["comfy_quant_metadata"][0], path)
    sd, _ = formats.load_file(str(path))
    qt = sd["blocks.0.mlp.fc1.weight"]
    assert qt.qdata.dtype == torch.float8_e4m3fn
    assert qt.qdata.element_size() == 1
    assert qt.dtype == torch.bfloat16  # logical dtype = the file's float dtype
    before = {k: (v.qdata if isinstance(v, QuantizedTensor) else v).view(torch.uint8).clone() for k, v in sd.items()
              if (v.qdata if isinstance(v, QuantizedTensor) else v).numel()}
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.write(b"\xa5" * size)  # every byte of the file, header included, in place
    path.unlink()
    for key, raw in before.items():
        v = sd[key]
        assert torch.equal((v.qdata if isinstance(v, QuantizedTensor) else v).view(torch.uint8), raw), key


def test_config_and_input_scale_are_attached(files):
    cfg = ComputeConfig(path="weight_only")
    sd, _ = formats.load_file(files["modelopt_tensor"][0], config=cfg)
    qt = sd["blocks.0.attn.qkv.weight"]
    assert qt.config == cfg
    assert float(qt.input_scale) == pytest.approx(0.05)


def test_linear_on_loaded_weight_matches_reference(files):
    sd, _ = formats.load_file(files["musubi_block64"][0])
    qt = sd["blocks.0.mlp.fc1.weight"]
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    ref = x.double() @ qt.dequantize(torch.float64).t()
    out = torch.nn.functional.linear(x, qt)
    assert sqnr(ref, out) > 35


def test_progress_is_called_and_can_cancel(files):
    calls = []
    formats.load_file(files["plain_e4m3fn"][0], progress=lambda d, t: calls.append((d, t)))
    assert calls and calls[-1][0] == calls[-1][1]

    class Stop(Exception):
        pass

    def stop(d, t):
        raise Stop

    with pytest.raises(Stop):
        formats.load_file(files["plain_e4m3fn"][0], progress=stop)
