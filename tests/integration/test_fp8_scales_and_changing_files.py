"""Hostile FP8 files and names through the real server, second round.

- Scales that lie: a per-tensor scale of 3e38 (every latent was NaN), a [3, 7] scale on a [128, 128]
  weight and an extra [64, 64] weight with a [3, 7] scale (they loaded as "block 43x19" / "22x10")
  give a node error naming the file and the scale's key.
- A link in models/ to a text file is called a text file, not a number made of its first 8 bytes.
- Save FP8 Model with a 300-character name says which node and what to do.
- A model file truncated, then rewritten in place, while its model is loaded does not kill the server
  (it used to die with SIGBUS at the next sample): the next prompts run on the model already loaded.
  That test runs its own server, so a crash cannot take the shared one with it.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import fp8_files
from helpers.graphs import TINY_UNET, fp8_loader, saved_latent, sd3_txt2img

pytestmark = pytest.mark.integration

PROJ = "joint_blocks.0.x_block.attn.proj"  # a [128, 128] linear of the tiny SD3


def load_and_report(name: str) -> dict:
    # weight-only: under "auto" a CPU with VNNI/AMX converts the weights to int8 at load, and the report shows int8
    return {"1": fp8_loader(name, "weight-only"), "2": {"class_type": "FP8Engram.WeightReport", "inputs": {"model": ["1", 0]}}}


def error_text(comfy, graph) -> str:
    with pytest.raises(Exception) as info:
        comfy.run(graph)
    return str(info.value)


@pytest.fixture(scope="module")
def lying_files(models_dir):
    """{file name: scale key that lies}, made from the tiny SD3 in the modelopt `.weight_scale` form."""
    folder = models_dir / "diffusion_models"
    good = folder / "lying_good.safetensors"
    fp8_files.write_format(load_file(str(folder / TINY_UNET)), good, "modelopt_tensor")
    sd = load_file(str(good))
    assert tuple(sd[f"{PROJ}.weight"].shape) == (128, 128)
    scale = float(sd[f"{PROJ}.weight_scale"].reshape(-1)[0])
    cases = {
        "lying_huge_scale": ({f"{PROJ}.weight_scale": torch.tensor(3e38)}, f"{PROJ}.weight_scale"),
        "lying_grid_3x7": ({f"{PROJ}.weight_scale": torch.full((3, 7), scale)}, f"{PROJ}.weight_scale"),
        "lying_extra_64": ({"extra.weight": torch.ones(64, 64).to(torch.float8_e4m3fn),
                            "extra.weight_scale": torch.full((3, 7), scale)}, "extra.weight_scale"),
    }
    files = {}
    for name, (change, key) in cases.items():
        save_file({**sd, **change}, str(folder / f"{name}.safetensors"))
        files[f"{name}.safetensors"] = key
    return files, good.name


def test_scales_that_lie_give_node_errors_naming_the_key(comfy, lying_files):
    files, good = lying_files
    for name, key in files.items():
        text = error_text(comfy, load_and_report(name))
        assert "FP8Engram.LoadFP8DiffusionModel" in text and f"diffusion_models/{name}" in text, text
        assert f"key '{key}'" in text, text
    text = error_text(comfy, load_and_report("lying_huge_scale.safetensors"))
    assert "beyond float32's range" in text, text
    text = error_text(comfy, load_and_report("lying_grid_3x7.safetensors"))
    assert "[3, 7] fits no layout" in text and "about 43 x about 19" in text, text
    hist = comfy.run(load_and_report(good))  # the server keeps serving, and the honest file loads
    assert "float8_e4m3fn" in hist["outputs"]["2"]["text"][0]


def test_a_link_to_a_text_file_is_called_a_text_file(comfy, models_dir, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("# my model notes\nbest sampler: euler\n")
    link = models_dir / "diffusion_models" / "notes_link.safetensors"
    link.symlink_to(notes)
    try:
        text = error_text(comfy, load_and_report(link.name))
    finally:
        link.unlink()
    assert "diffusion_models/notes_link.safetensors" in text and "not a safetensors file" in text, text
    assert "text (it begins '# my mod')" in text and f"a link to {notes}" in text, text
    assert str(int.from_bytes(b"# my mod", "little")) not in text, text


def test_save_fp8_model_with_a_name_too_long_says_so(comfy, output_dir):
    prefix = "fp8/" + "x" * 300
    graph = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": TINY_UNET, "weight_dtype": "default"}},
             "21": {"class_type": "FP8Engram.SaveFP8Model", "inputs": {"model": ["1", 0], "filename_prefix": prefix}}}
    text = error_text(comfy, graph)
    assert "Save FP8 Model: filename_prefix" in text and "300 bytes long" in text and "shorten it" in text, text
    assert "File name too long" not in text, text
    assert not list(output_dir.rglob("xxxxxxxxxx*")), "a file or folder was written"


# ------------------------------------------------------------------------------------------------
# A model file that changes while its model is loaded
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def own_server(tmp_path_factory, tiny_models_cache):
    from helpers.host import start_server_with_tiny_models

    server = start_server_with_tiny_models(tmp_path_factory.mktemp("changing_files"), tiny_models_cache)
    yield server
    server.stop()


def latent(client, base, graph) -> torch.Tensor:
    return saved_latent(client.run(graph), base / "output")


def test_a_model_file_truncated_or_rewritten_while_loaded_does_not_kill_the_server(own_server, tiny_models_cache):
    client, base = own_server.client(), own_server.base_dir
    path = base / "models" / "diffusion_models" / "changing.safetensors"  # a real file, not a link
    fp8_files.write_format(load_file(str(tiny_models_cache / "diffusion_models" / TINY_UNET)), path,
                           "comfy_quant_per_layer")

    def graph(seed):
        return sd3_txt2img(model=fp8_loader(path.name), save="latent", seed=seed, prefix=f"changing{seed}")

    first = latent(client, base, graph(0))
    with open(path, "r+b") as f:  # what a download tool does before it writes the new bytes
        f.truncate(64)
    after_truncate = latent(client, base, graph(1))
    with open(path, "wb") as f:  # ...and then the new file, in place
        f.write(os.urandom(4096))
    after_rewrite = latent(client, base, graph(0))
    assert own_server.process.poll() is None, own_server.log_tail()
    assert torch.isfinite(after_truncate).all() and torch.equal(after_rewrite, first)
