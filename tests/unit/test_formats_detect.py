"""Format detection: every published FP8 format is recognised from its file alone, with the right
layout per layer and scales equal to the file's, and broken files are refused with errors that name
the file, the key and what was expected. (Reading into QuantizedTensor: test_formats_load.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from fp8_engram.quant import formats
from helpers import fp8_files

pytestmark = pytest.mark.unit


def float_sd() -> dict[str, torch.Tensor]:
    return fp8_files.small_float_sd(0, with_conv=True)


LINEAR = fp8_files.SMALL_LINEAR_KEYS


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return fp8_files.write_all(float_sd(), tmp_path_factory.mktemp("fmt"))


@pytest.mark.parametrize("fmt", fp8_files.FORMATS)
def test_each_format_is_detected_with_every_linear_layer(files, fmt):
    path, expected = files[fmt]
    det = formats.detect_format(path)
    assert det.report.format == fp8_files.DETECTED_AS[fmt]
    assert sorted(det.layers) == LINEAR
    assert det.report.layers_quantized == 3
    assert det.report.linear_weights == 3
    # the conv, the norm and the bias are not quantized layers
    assert "embed.proj.weight" not in det.layers


@pytest.mark.parametrize("fmt", fp8_files.FORMATS)
def test_detected_scales_decode_to_the_values_the_file_encodes(files, fmt):
    from safetensors import safe_open

    path, expected = files[fmt]
    det = formats.detect_format(path)
    with safe_open(str(path), framework="pt") as f:
        for key in LINEAR:
            info = det.layers[key]
            q = f.get_tensor(key).double()
            s = det.scales[key].double()
            if info.granularity == "block":
                r, c = info.block
                s = s.repeat_interleave(r, 0)[: q.shape[0]].repeat_interleave(c, 1)[:, : q.shape[1]]
            torch.testing.assert_close(q * s, expected[key], rtol=0, atol=0)


def test_granularity_per_format(files):
    def gran(fmt, key="blocks.0.mlp.fc1.weight"):
        info = formats.detect_format(files[fmt][0]).layers[key]
        return info.granularity, info.block

    assert gran("musubi_block64") == ("block", (1, 64))
    assert gran("musubi_block64", "blocks.0.mlp.fc2.weight") == ("row", None)  # musubi's fallback
    assert gran("musubi_channel") == ("row", None)
    assert gran("musubi_tensor") == ("tensor", None)
    assert gran("modelopt_channel") == ("row", None)
    assert gran("blockwise_scale_inv") == ("block", (128, 128))
    assert gran("comfy_quant_metadata") == ("tensor", None)


def test_fp8_matmul_permission_follows_the_marker(files):
    assert formats.detect_format(files["comfy_scaled_fp8"][0]).report.fp8_matmul_allowed
    rep = formats.detect_format(files["comfy_scaled_fp8_no_mm"][0]).report
    assert not rep.fp8_matmul_allowed
    assert all(i.full_precision_mm for i in rep.layers)


def test_input_scale_is_read_as_a_float32_scalar(files):
    det = formats.detect_format(files["modelopt_tensor"][0])
    s = det.input_scales["blocks.0.attn.qkv.weight"]
    assert s.dtype == torch.float32 and s.shape == () and float(s) == pytest.approx(0.05)


def test_report_counts_bytes_and_stock_readability(files):
    rep = formats.detect_format(files["comfy_quant_metadata"][0]).report
    n_float = sum(t.numel() for t in float_sd().values())
    assert rep.bytes_bf16 == 2 * n_float
    assert rep.bytes_on_disk < rep.bytes_bf16
    assert rep.stock_comfy_readable
    assert not formats.detect_format(files["musubi_block64"][0]).report.stock_comfy_readable
    s = rep.summary()
    json.dumps(s)  # JSON-able for the UI
    assert s["layers_quantized"] == 3 and s["format"] == "comfy_quant_metadata"
    assert "comfy_quant_metadata" in rep.text()


def test_text_encoder_prefixed_marker(tmp_path):
    sd = {f"text_encoders.clip_l.transformer.{k}": v for k, v in float_sd().items()}
    path = tmp_path / "te.safetensors"
    fp8_files.write_format(sd, path, "comfy_scaled_fp8", prefix_marker="text_encoders.clip_l.transformer.")
    det = formats.detect_format(path)
    assert det.report.format == "comfy_scaled_fp8"
    assert "text_encoders.clip_l.transformer.scaled_fp8" in det.consumed


def test_unquantized_file_is_reported_as_such(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "bf16.safetensors"
    save_file(float_sd(), str(path))
    rep = formats.detect_format(path).report
    assert rep.format == "unquantized" and rep.layers_quantized == 0


@pytest.mark.parametrize("kind", fp8_files.BAD_KINDS)
def test_bad_files_are_refused_naming_file_and_key(tmp_path, kind):
    path = tmp_path / f"bad_{kind}.safetensors"
    word = fp8_files.write_bad(float_sd(), path, kind)
    with pytest.raises(formats.FormatError) as info:
        formats.detect_format(path)
    msg = str(info.value)
    assert str(path) in msg
    assert word.lower() in msg.lower()
    assert "expected" in msg
    if kind not in ("truncated", "metadata_not_json"):
        assert "key '" in msg


def test_scale_for_a_non_fp8_weight_is_refused(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "odd.safetensors"
    save_file({"a.weight": torch.randn(8, 8), "a.weight_scale": torch.tensor(1.0)}, str(path))
    with pytest.raises(formats.FormatError, match="a.weight.*float8"):
        formats.detect_format(path)


def test_unsupported_scheme_is_refused(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "nvfp4.safetensors"
    save_file({"a.weight": torch.zeros(8, 4, dtype=torch.uint8), "a.weight_scale": torch.ones(8, 1),
               "a.weight_scale_2": torch.tensor(1.0)}, str(path))
    with pytest.raises(formats.FormatError, match="does not read"):
        formats.detect_format(path)


def test_orphan_scale_is_refused(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "orphan.safetensors"
    save_file({"a.weight": torch.zeros(8, 8).to(torch.float8_e4m3fn), "b.weight_scale": torch.tensor(1.0)}, str(path))
    with pytest.raises(formats.FormatError, match="b.weight_scale.*without a weight"):
        formats.detect_format(path)


def test_not_a_safetensors_file(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"PK\x03\x04 this is a zip file, not safetensors at all")
    with pytest.raises(formats.FormatError, match=str(path)):
        formats.read_header(path)
