"""The converter CLI: any readable file -> FP8 in the chosen granularity, streamed; --info prints a
format summary; existing outputs are refused; bad inputs give a clear error and exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fp8_engram.quant import convert, formats
from fp8_engram.quant.tensor import QuantizedTensor
from helpers import fp8_files
from helpers.numerics import sqnr

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def float_sd():
    g = torch.Generator().manual_seed(3)
    return {
        "blocks.0.attn.qkv.weight": torch.randn(384, 128, generator=g).bfloat16(),
        "blocks.0.mlp.fc1.weight": torch.randn(256, 128, generator=g).bfloat16(),
        "blocks.0.norm.weight": torch.ones(128).bfloat16(),
        "x_embedder.proj.weight": torch.randn(128, 64, generator=g).bfloat16(),
        "final_layer.linear.weight": torch.randn(64, 128, generator=g).bfloat16(),
    }


@pytest.fixture()
def src(tmp_path):
    p = tmp_path / "src.safetensors"
    save_file(float_sd(), str(p))
    return p


@pytest.mark.parametrize("gran,floor", [("tensor", 28.0), ("row", 29.0), ("block", 29.0)])
def test_convert_quantizes_linears_and_keeps_first_last(tmp_path, src, gran, floor, capsys):
    out = tmp_path / f"out_{gran}.safetensors"
    rc = convert.main([str(src), str(out), "--granularity", gran])
    assert rc == 0
    text = capsys.readouterr().out
    assert "2 layers quantized" in text and "SQNR" in text
    sd, rep = formats.load_file(out)
    ref = float_sd()
    for k in ("blocks.0.attn.qkv.weight", "blocks.0.mlp.fc1.weight"):
        assert isinstance(sd[k], QuantizedTensor)
        assert sqnr(ref[k], sd[k].dequantize(torch.float64)) > floor
    for k in ("x_embedder.proj.weight", "final_layer.linear.weight", "blocks.0.norm.weight"):
        assert torch.equal(sd[k], ref[k])
    assert rep.stock_comfy_readable == (gran == "tensor")


def test_convert_keep_pattern_and_e5m2(tmp_path, src):
    out = tmp_path / "o.safetensors"
    assert convert.main([str(src), str(out), "--dtype", "e5m2", "--keep", "*mlp*"]) == 0
    sd, rep = formats.load_file(out)
    assert isinstance(sd["blocks.0.attn.qkv.weight"], QuantizedTensor)
    assert sd["blocks.0.attn.qkv.weight"].qdata.dtype == torch.float8_e5m2
    assert not isinstance(sd["blocks.0.mlp.fc1.weight"], QuantizedTensor)


def test_convert_requantizes_an_fp8_input(tmp_path):
    src = tmp_path / "musubi.safetensors"
    fp8_files.write_format(float_sd(), src, "musubi_block64")
    out = tmp_path / "o.safetensors"
    assert convert.main([str(src), str(out), "--granularity", "tensor", "--no-default-keep"]) == 0
    sd, rep = formats.load_file(out)
    assert rep.format == "comfy_quant_metadata" and rep.layers_quantized == 4
    ref = float_sd()
    assert sqnr(ref["blocks.0.attn.qkv.weight"], sd["blocks.0.attn.qkv.weight"].dequantize(torch.float64)) > 25


def test_existing_output_is_refused(tmp_path, src, capsys):
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"keep me")
    assert convert.main([str(src), str(out)]) == 2
    assert "exists" in capsys.readouterr().err
    assert out.read_bytes() == b"keep me"


def test_info_prints_a_summary_and_errors_cleanly(tmp_path, capsys):
    f = tmp_path / "m.safetensors"
    fp8_files.write_format(float_sd(), f, "blockwise_scale_inv")
    assert convert.main(["--info", str(f), "--layers"]) == 0
    out = capsys.readouterr().out
    assert "blockwise_scale_inv" in out and "block 128x128" in out and "bytes on disk" in out
    bad = tmp_path / "bad.safetensors"
    fp8_files.write_bad(float_sd(), bad, "nan_scale")
    assert convert.main(["--info", str(bad)]) == 2
    assert "non-finite" in capsys.readouterr().err


def test_module_entry_point_runs(tmp_path, src):
    env_path = str(ROOT / ".host" / "pkg")
    r = subprocess.run([sys.executable, "-m", "fp8_engram.quant.convert", "--info", str(src)], capture_output=True,
                       text=True, env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "unquantized" in r.stdout
