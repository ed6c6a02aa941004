"""A real ComfyUI server that takes one tiny architecture of tests/helpers/tiny_archs.py for what it is.

ComfyUI's detection fixes some sizes to the released models' (Qwen-Image: 24 heads of 128, whatever the
file's tensors say), so a tiny model of such a family loads only with those sizes set back
(`tiny_archs.detection_for`). A server gets that from a custom node of the test's own, which
`start_tiny_arch_server` writes into the server's custom_nodes beside the pack: imported by ComfyUI at start,
it enters `detection_for(arch)` for the life of the server. Stock UNETLoader and the pack's loader call the
same detection, so a comparison of the two is not affected by it. Only for a server of its own: every
diffusion model such a server loads is taken for that architecture.

The node also adds `FP8EngramTest.SeededConditioning` (seed -> CONDITIONING): seeded text conditioning of
the family's width and token count (`arch.text`), as most families have no tiny text encoder.
"""

from __future__ import annotations

from pathlib import Path

NODE_DIR = "fp8_engram_test_tiny_arch"
CONDITIONING_NODE = "FP8EngramTest.SeededConditioning"

_NODE = r'''
"""Test-only (written by tests/helpers/tiny_arch_server.py): ComfyUI's detection takes every diffusion model
for the tiny {name}, and a node gives seeded conditioning of its text shape."""
import importlib.util
import logging
import sys

import comfy.model_detection
import comfy.supported_models
import torch

_spec = importlib.util.spec_from_file_location("fp8_engram_test_tiny_archs", {path!r})
tiny_archs = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = tiny_archs  # dataclasses look their module up
_spec.loader.exec_module(tiny_archs)
ARCH = tiny_archs.BY_NAME[{name!r}]
_DETECTION = tiny_archs.detection_for(ARCH, comfy)
_DETECTION.__enter__()  # for the life of the server
logging.getLogger(__name__).info("test server: ComfyUI's detection takes diffusion models for the tiny %s", ARCH.name)


class SeededConditioning:
    @classmethod
    def INPUT_TYPES(cls):
        return {{"required": {{"seed": ("INT", {{"default": 0, "min": 0, "max": 2**31 - 1}})}}}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "fp8-engram-tests"

    def make(self, seed):
        g = torch.Generator().manual_seed(seed)
        return ([[torch.randn((1,) + tuple(ARCH.text), generator=g), {{}}]],)


NODE_CLASS_MAPPINGS = {{{node!r}: SeededConditioning}}
'''


def start_tiny_arch_server(base: Path, arch_name: str):
    """A started ComfyServer with its base directory at `base` whose detection takes diffusion models for
    `tiny_archs.BY_NAME[arch_name]`; put the models in `base / "models" / "diffusion_models"`. Stop it with
    `.stop()`."""
    from comfyhost import ComfyServer

    from helpers import tiny_archs

    if arch_name not in tiny_archs.BY_NAME:
        raise KeyError(f"no tiny architecture {arch_name!r} in tests/helpers/tiny_archs.py")
    node = base / "custom_nodes" / NODE_DIR
    node.mkdir(parents=True, exist_ok=True)
    (node / "__init__.py").write_text(_NODE.format(name=arch_name, path=str(Path(tiny_archs.__file__).resolve()),
                                                   node=CONDITIONING_NODE))
    return ComfyServer(base_dir=base).start()
