"""Hostile files and names through the real server: a handful of the fuzz corruptions of FP8 model files
and engram table files, each loaded by the pack's node, fail with a node error naming the file; the
server keeps working (a good prompt runs after them). Save FP8 Model refuses filename prefixes that
leave the output folder, and Save Engram Memory refuses names that are not plain file names.

(The in-process fuzz, a few hundred cases, is tests/unit/test_fuzz_*.py.)
"""

from __future__ import annotations

import glob
import os
import random

import pytest
import torch
from safetensors.torch import load_file

from helpers import fp8_files
from helpers import fuzz_files as fz
from helpers.graphs import TINY_CLIP_L, TINY_UNET, fp8_loader

pytestmark = pytest.mark.integration


def load_fp8(name: str) -> dict:
    # weight-only: under "auto" a CPU with VNNI/AMX converts the weights to int8 at load, and the report shows int8
    return {"1": fp8_loader(name, "weight-only"),
            "2": {"class_type": "FP8Engram.WeightReport", "inputs": {"model": ["1", 0]}}}


def error_text(comfy, graph) -> str:
    with pytest.raises(Exception) as info:
        comfy.run(graph)
    return str(info.value)


def files_at(name: str) -> dict[str, tuple[int, int]]:
    """{path: (size, mtime in ns)} of the files at an absolute `name` and beside it under names that begin
    with it (a save adds a counter and an extension); empty for a relative name, which points nowhere by itself."""
    if not os.path.isabs(name):
        return {}
    out = {}
    for path in glob.glob(glob.escape(name) + "*"):
        st = os.lstat(path)
        out[path] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def hostile_fp8(models_dir):
    """Corrupted copies of FP8 files made from the tiny SD3: {file name: what the corruption is}."""
    sd = load_file(str(models_dir / "diffusion_models" / TINY_UNET))
    folder = models_dir / "diffusion_models"
    rng = random.Random(7)
    files = {}
    good = folder / "hostile_good_per_layer.safetensors"
    fp8_files.write_format(sd, good, "comfy_quant_per_layer")
    raw = good.read_bytes()
    header, _ = fz.split(raw)
    cq = sorted(k for k in header if k.endswith(".comfy_quant"))[0]
    scale = sorted(k for k in header if k.endswith(".weight_scale"))[0]
    picks = [
        fz.truncate_cases(rng, raw)[2],
        fz.Case("header_bytes", "header_deep_nesting", fz.header_replaced(raw, fz.HOSTILE_JSON["deep_nesting"])),
        next(c for c in fz.comfy_quant_cases(rng, raw, cq) if "oversized" in c.name),
        next(c for c in fz.scale_cases(rng, raw, scale) if "scale_nan" in c.name),
        next(c for c in fz.offsets_cases(random.Random(1), raw, 11) if "huge" in c.name),
    ]
    meta_src = folder / "hostile_good_metadata.safetensors"
    fp8_files.write_format(sd, meta_src, "comfy_quant_metadata")
    picks.append(fz.metadata_cases(rng, meta_src.read_bytes(), {"_quantization_metadata": [
        ("format_list", '{"layers": {"joint_blocks.0.x_block.attn.qkv": {"format": ["float8_e4m3fn"]}}}')]})[-1])
    for i, case in enumerate(picks):
        name = f"hostile_{i}_{case.name.split(':')[0]}.safetensors"
        (folder / name).write_bytes(case.data)
        files[name] = case.name
    return files, good.name


def test_hostile_fp8_files_give_node_errors_and_the_server_keeps_working(comfy, hostile_fp8):
    files, good = hostile_fp8
    for name, what in files.items():
        text = error_text(comfy, load_fp8(name))
        assert name in text and "FP8Engram.LoadFP8DiffusionModel" in text, (what, text)
        assert "FormatError" not in text or "diffusion_models/" in text
    hist = comfy.run(load_fp8(good))
    assert "float8_e4m3fn" in hist["outputs"]["2"]["text"][0]


def new_memory() -> dict:
    return {"class_type": "FP8Engram.NewEngramMemory", "inputs": {
        "clip": ["2", 0], "max_order": 2, "heads": 2, "rows_per_head": 257, "dtype": "bf16",
        "devices": "cpu", "cpu_ranks": 1, "context_gate": False, "seed": 3}}


def test_hostile_table_files_give_node_errors(comfy, models_dir):
    clip = {"class_type": "CLIPLoader", "inputs": {"clip_name": TINY_CLIP_L, "type": "sd3"}}
    comfy.run({"2": clip, "31": new_memory(),
               "50": {"class_type": "FP8Engram.SaveEngramMemory", "inputs": {"memory": ["31", 0], "name": "hostile_src"}}})
    folder = models_dir / "engram"
    raw = (folder / "hostile_src.safetensors").read_bytes()
    rng = random.Random(3)
    cases = [fz.truncate_cases(rng, raw)[2], fz.shape_cases(random.Random(2), raw, 13)[0]]
    cases += fz.metadata_cases(rng, raw, {"engram.geometry": [("deep", fz.HOSTILE_JSON["deep_object"])],
                                          "engram.hashing": [("long_int", fz.HOSTILE_JSON["long_int"])]})[2:]
    for i, case in enumerate(cases):
        name = f"hostile_{i}.safetensors"
        (folder / name).write_bytes(case.data)
        graph = {"2": clip, "51": {"class_type": "FP8Engram.LoadEngramMemory",
                                   "inputs": {"memory_name": name, "devices": "cpu", "cpu_ranks": 1}},
                 "52": {"class_type": "FP8Engram.SaveEngramMemory", "inputs": {"memory": ["51", 0], "name": f"hostile_copy_{i}"}}}
        text = error_text(comfy, graph)
        assert name in text and "LoadEngramMemory" in text, (case.name, text)
        assert not (folder / f"hostile_copy_{i}.safetensors").exists()


@pytest.mark.parametrize("prefix", ["../escaped", "fp8/../../escaped", "/tmp/fp8_engram_escaped", "..\\escaped"])
def test_save_fp8_model_refuses_prefixes_that_leave_the_output_folder(comfy, output_dir, prefix):
    graph = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": TINY_UNET, "weight_dtype": "default"}},
             "21": {"class_type": "FP8Engram.SaveFP8Model", "inputs": {"model": ["1", 0], "filename_prefix": prefix}}}
    before = files_at(prefix)
    text = error_text(comfy, graph)
    assert "Save FP8 Model: filename_prefix" in text and "inside the output folder" in text, text
    assert not list(output_dir.parent.glob("escaped*")) and not list(output_dir.parent.parent.glob("escaped*"))
    assert files_at(prefix) == before, f"something was written where the absolute prefix {prefix!r} points"


@pytest.mark.parametrize("name", ["../escaped", "/tmp/escaped", "sub/name", ".."])
def test_save_engram_memory_refuses_names_with_folders(comfy, models_dir, name):
    clip = {"class_type": "CLIPLoader", "inputs": {"clip_name": TINY_CLIP_L, "type": "sd3"}}
    graph = {"2": clip, "31": new_memory(),
             "50": {"class_type": "FP8Engram.SaveEngramMemory", "inputs": {"memory": ["31", 0], "name": name}}}
    before = files_at(name)
    text = error_text(comfy, graph)
    assert "must be a plain file name" in text, text
    assert not (models_dir / "escaped.safetensors").exists()
    assert files_at(name) == before, f"something was written where the absolute name {name!r} points"
