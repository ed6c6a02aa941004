"""One call of the tiny SD3 diffusion model (scripts/tiny_models.py) the way ComfyUI's sampler calls it, for the
in-process tests that compare two loads of it."""

from __future__ import annotations

import torch


def apply(model, seed: int) -> torch.Tensor:
    """`model` (a ModelPatcher of the tiny SD3) loaded by ComfyUI and called once on seeded inputs: an 8x8 latent,
    5 context tokens of T5's width and the pooled vector, at t = 0.5."""
    import comfy.model_management

    comfy.model_management.load_models_gpu([model])
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 16, 8, 8, generator=g)
    ctx = torch.randn(1, 5, 4096, generator=g)
    y = torch.randn(1, 2048, generator=g)
    with torch.inference_mode():
        return model.model.apply_model(x, torch.tensor([0.5]), c_crossattn=ctx, y=y)
