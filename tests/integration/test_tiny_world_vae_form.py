"""The tiny world's autoencoder (scripts/train_tiny.py) is written as a 16-channel TAESD that ComfyUI's own VAE
class detects, and computes there exactly what it computed in training: the narrow layers zero-padded
to TAESD's 64 channels and the zeroed blocks change nothing, and SD3's latent scale and shift cancel, so
the latent a sampler works in is the encoder's output itself."""

from __future__ import annotations

import pytest

from helpers.host import comfy_in_process

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def comfy_modules():
    comfy_in_process()
    import torch

    import comfy.latent_formats
    import comfy.sd
    import comfy.taesd.taesd as taesd

    import train_tiny  # scripts/ is on sys.path (tests/conftest.py)

    return torch, comfy, taesd, train_tiny


def randomized(module, torch, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 / max(1, p[0].numel()) ** 0.5 if p.dim() > 1 else 0.1))
    return module


def test_the_packed_autoencoder_is_a_taesd_that_decodes_and_encodes_as_trained(comfy_modules):
    torch, comfy, taesd, train_tiny = comfy_modules
    encoder, decoder = train_tiny.make_autoencoder(torch)
    randomized(encoder, torch, 1)
    randomized(decoder, torch, 2)
    sd = train_tiny.taesd_state_dict(encoder, decoder, taesd, torch)
    vae = comfy.sd.VAE(sd=sd)
    assert isinstance(vae.first_stage_model, taesd.TAESD) and vae.latent_channels == 16
    fmt = comfy.latent_formats.SD3()

    g = torch.Generator().manual_seed(3)
    latent = torch.randn(2, 16, 8, 8, generator=g)  # what the sampler holds (SD3's process_in space)
    with torch.inference_mode():
        ours = decoder(latent).clamp(0, 1)  # the training graph's picture
        theirs = vae.decode(fmt.process_out(latent))  # [B, H, W, 3] in [0, 1]
    assert theirs.shape == (2, 64, 64, 3)
    assert torch.allclose(theirs.float(), ours.permute(0, 2, 3, 1), atol=2e-3), (theirs.float() - ours.permute(0, 2, 3, 1)).abs().max()

    picture = torch.rand(2, 64, 64, 3, generator=g)
    with torch.inference_mode():
        z = fmt.process_in(vae.encode(picture))  # what VAE Encode gives a sampler
        mine = encoder(picture.permute(0, 3, 1, 2))
    assert torch.allclose(z.float(), mine, atol=2e-3), (z.float() - mine).abs().max()


def test_a_layer_wider_than_taesd_is_refused(comfy_modules):
    torch, _, taesd, train_tiny = comfy_modules
    encoder, decoder = train_tiny.make_autoencoder(torch)
    decoder[1] = torch.nn.Conv2d(16, 96, 3, padding=1)  # TAESD's layer has 64 channels
    with pytest.raises(ValueError, match="does not fit"):
        train_tiny.taesd_state_dict(encoder, decoder, taesd, torch)
