"""When the loader nodes read a file's FP8 codes, in process with ComfyUI's own model building (no server).

The loaders read the large FP8 tensors after they return, in a background thread
(quant/safetensors_file.py ``DeferredReads``), and hold that thread back until ComfyUI has built the model
(``background_reads_held``) when the file is small: beside the build it slowed the build's parameter copies (on
two cores hunyuan-dit's tiny model built in 5.8 ms beside it, 3.4 ms without; a lower priority did not help).
Shown here for Load FP8 Diffusion Model, Load FP8 Text Encoder and Load FP8 Checkpoint (a checkpoint of the tiny
SD3, TAESD3 and CLIP-L), every FP8 tensor deferred (these files are small: a real load reads them at once):

- no background read runs while ComfyUI builds the model; they run after the node returns;
- the model computes with the file's codes: its output equals that of a load that read everything at once.

And the read moves the node's progress bar (ComfyUI's own `ProgressBar`, whose updates a server sends to the page)
by at most `PROGRESS_UPDATES` steps, up to the file's tensor count, where it was once per tensor (ComfyUI 0.29 and
later thin a bar's updates out themselves, by time and percent; 0.3.75 sends every one).
"""

from __future__ import annotations

import threading

import pytest
import torch
from safetensors.torch import load_file

from helpers import fp8_files, tiny_sd3
from helpers.host import comfy_in_process

pytestmark = pytest.mark.integration

UNET = "reads_sd3_fp8.safetensors"
CLIP = "reads_clip_l_fp8.safetensors"
CHECKPOINT = "reads_sd3_checkpoint_fp8.safetensors"


@pytest.fixture(scope="module")
def env(tiny_models_cache, tmp_path_factory):
    comfy_in_process()
    import comfy.model_management
    import comfy.sd
    import folder_paths

    from fp8_engram.quant.convert import convert_file

    folder = tmp_path_factory.mktemp("loader_reads_models")
    convert_file(tiny_models_cache / "diffusion_models" / "tiny_sd3.safetensors", folder / UNET, granularity="tensor")
    convert_file(tiny_models_cache / "text_encoders" / "tiny_clip_l.safetensors", folder / CLIP, granularity="tensor")
    parts = {"model.diffusion_model.": "diffusion_models/tiny_sd3.safetensors",
             "first_stage_model.": "vae/tiny_taesd3.safetensors",
             "text_encoders.clip_l.transformer.": "text_encoders/tiny_clip_l.safetensors"}
    sd = {prefix + k: v for prefix, rel in parts.items() for k, v in load_file(str(tiny_models_cache / rel)).items()}
    fp8_files.write_format(sd, folder / CHECKPOINT, "comfy_quant_metadata",
                           quantize=lambda k, t: fp8_files.default_quantize(k, t) and "embed" not in k.split(".")[-2])
    for kind in ("diffusion_models", "text_encoders", "checkpoints"):
        folder_paths.add_model_folder_path(kind, str(folder))
    from fp8_engram.nodes import fp8 as nodes

    yield nodes, comfy
    comfy.model_management.unload_all_models()


@pytest.fixture
def watched(monkeypatch, env):
    """Defers every FP8 tensor; records, for each background read, whether a model build was running."""
    from fp8_engram.quant import safetensors_file

    monkeypatch.setattr(safetensors_file, "DEFER_MIN_BYTES", 0)
    monkeypatch.setattr(safetensors_file, "DEFER_TENSOR_MIN_BYTES", 0)
    comfy = env[1]
    state = {"building": False, "reads": []}
    lock = threading.Lock()

    def building(fn):
        def wrapper(*args, **kwargs):
            state["building"] = True
            try:
                return fn(*args, **kwargs)
            finally:
                state["building"] = False
        return wrapper

    for name in ("load_diffusion_model_state_dict", "load_text_encoder_state_dicts", "load_state_dict_guess_config"):
        monkeypatch.setattr(comfy.sd, name, building(getattr(comfy.sd, name)))
    read = safetensors_file.DeferredReads._read

    def recorded(self, fill):
        with lock:
            state["reads"].append((threading.current_thread() is threading.main_thread(), state["building"]))
        read(self, fill)

    monkeypatch.setattr(safetensors_file.DeferredReads, "_read", recorded)
    yield state
    assert safetensors_file.background_reads_done(timeout=30)


def _background(state) -> list[bool]:
    """For each read made by the background thread: whether a model build was running."""
    return [during for on_main, during in state["reads"] if not on_main]


def test_the_diffusion_loader_reads_after_the_build(env, watched, monkeypatch):
    from fp8_engram.quant import safetensors_file

    nodes = env[0]
    model = nodes.LoadFP8DiffusionModel.execute(UNET, "weight-only", "auto", "auto").result[0]
    assert safetensors_file.background_reads_done(timeout=30)
    during = _background(watched)
    assert during, "no FP8 tensor was read in the background"
    assert not any(during), f"{sum(during)} of {len(during)} background reads ran during ComfyUI's model build"
    out = tiny_sd3.apply(model, seed=3)
    monkeypatch.setattr(safetensors_file, "DEFERRED_READS", False)  # everything read at load
    eager = nodes.LoadFP8DiffusionModel.execute(UNET, "weight-only", "auto", "auto").result[0]
    assert torch.equal(tiny_sd3.apply(eager, seed=3), out)


def test_the_text_encoder_loader_reads_after_the_build(env, watched, monkeypatch):
    from fp8_engram.quant import safetensors_file

    nodes = env[0]
    clip = nodes.LoadFP8TextEncoder.execute(CLIP, "stable_diffusion", "weight-only", "auto", "auto").result[0]
    assert safetensors_file.background_reads_done(timeout=30)
    during = _background(watched)
    assert during and not any(during), during
    tokens = clip.tokenize("a photograph of a red fox")
    cond = clip.encode_from_tokens(tokens)
    monkeypatch.setattr(safetensors_file, "DEFERRED_READS", False)
    eager = nodes.LoadFP8TextEncoder.execute(CLIP, "stable_diffusion", "weight-only", "auto", "auto").result[0]
    assert torch.equal(eager.encode_from_tokens(eager.tokenize("a photograph of a red fox")), cond)


def test_the_checkpoint_loader_reads_after_the_build(env, watched, monkeypatch):
    from fp8_engram.quant import safetensors_file

    nodes = env[0]
    model, clip, _ = nodes.LoadFP8Checkpoint.execute(CHECKPOINT, "weight-only", "auto", "auto").result
    assert safetensors_file.background_reads_done(timeout=30)
    during = _background(watched)
    assert during and not any(during), during
    out, cond = tiny_sd3.apply(model, seed=3), clip.encode_from_tokens(clip.tokenize("a red apple"))
    monkeypatch.setattr(safetensors_file, "DEFERRED_READS", False)
    eager_model, eager_clip, _ = nodes.LoadFP8Checkpoint.execute(CHECKPOINT, "weight-only", "auto", "auto").result
    assert torch.equal(tiny_sd3.apply(eager_model, seed=3), out)
    assert torch.equal(eager_clip.encode_from_tokens(eager_clip.tokenize("a red apple")), cond)


def test_a_load_moves_the_progress_bar_in_at_most_a_hundred_steps(env, monkeypatch):
    import comfy.utils
    import folder_paths

    from fp8_engram.nodes.progress import PROGRESS_UPDATES
    from fp8_engram.quant import formats

    nodes, _ = env
    asked, shown = [], []
    update = comfy.utils.ProgressBar.update_absolute

    def recorded(bar, value, total=None, preview=None):
        asked.append((value, total))
        return update(bar, value, total, preview)

    monkeypatch.setattr(comfy.utils.ProgressBar, "update_absolute", recorded)
    monkeypatch.setattr(comfy.utils, "PROGRESS_BAR_HOOK",
                        lambda value, total, preview, node_id=None: shown.append((value, total)))
    tensors = len(formats.read_header(folder_paths.get_full_path_or_raise("checkpoints", CHECKPOINT)).tensors)
    assert tensors > PROGRESS_UPDATES, f"the checkpoint has {tensors} tensors: too few to show the bound"
    nodes.LoadFP8Checkpoint.execute(CHECKPOINT, "weight-only", "auto", "auto")
    values = [v for v, _ in asked]
    assert {t for _, t in asked} == {tensors}
    assert values[-1] == tensors and values == sorted(set(values)), values
    # every hundredth of the read is asked for, and no more
    assert PROGRESS_UPDATES <= len(values) <= PROGRESS_UPDATES + 1, len(values)
    # what ComfyUI's bar passed on to the server (0.3.75 all of it; 0.29 and later thin it out by time): the end
    assert shown and shown[-1] == (tensors, tensors) and len(shown) <= len(values), shown
