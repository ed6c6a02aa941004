"""The tiny world's committed weights (scripts/tiny_world_weights/, scripts/tiny_world_cache.py).

They stand in for ten minutes of training on a fresh clone, so they must be the training code's: their
key is the hash of that code, and a change to it without `tiny_world_cache.py --train --commit` fails
here. The cropped form must rebuild every tensor exactly and refuse a damaged file."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

import tiny_world_cache as cache
import train_tiny


def test_the_committed_weights_are_this_training_codes():
    report = json.loads((cache.COMMITTED / train_tiny.REPORT).read_text())
    key = cache.cache_key(train_tiny.Recipe(seed=0))
    assert report["key"] == key, (
        f"scripts/tiny_world_weights/ holds weights of training code {report['key']}, the code is now {key}: "
        "run `python scripts/tiny_world_cache.py --train --commit` (about 10 minutes) and commit the result")
    assert report["recipe"] == train_tiny.asdict(train_tiny.Recipe(seed=0))
    assert cache.committed_report(0) == report
    assert cache.committed_report(1) is None  # other seeds train


def test_the_committed_weights_stay_small():
    files = [cache.COMMITTED / n for n in cache.TRAINED_FILES]
    assert sum(f.stat().st_size for f in files) <= 5_000_000


def test_the_committed_files_rebuild_the_trained_models():
    unet = cache.unpack(cache.COMMITTED / train_tiny.UNET)
    vae = cache.unpack(cache.COMMITTED / train_tiny.VAE)
    # the shapes ComfyUI's loaders detect: the tiny SD3 MMDiT (hidden 128, 4096 context columns) and a
    # 16-channel TAESD
    assert unet["context_embedder.weight"].shape == (128, 4096) and unet["context_embedder.weight"].dtype == torch.bfloat16
    assert unet["context_embedder.weight"][:, train_tiny.CLIP_L_WIDTH:].abs().max() == 0
    assert vae["taesd_decoder.1.weight"].shape[1] == 16 and vae["taesd_decoder.1.weight"].dtype == torch.float32
    assert all(torch.isfinite(t.float()).all() for t in [*unet.values(), *vae.values()])
    assert sum(t.numel() for t in unet.values()) > 1_900_000


def test_crop_and_uncrop_round_trip_exactly():
    g = torch.Generator().manual_seed(0)
    padded = torch.zeros(6, 9, 3)
    padded[:4, :5, :2] = torch.randn(4, 5, 2, generator=g)
    cases = [padded, torch.zeros(5, 2), torch.tensor(2.5), torch.tensor(0.0), torch.randn(3, 4, generator=g).bfloat16(),
             torch.tensor([0.0, 0.0, 1e-40, 0.0])]  # a subnormal is not zero
    for t in cases:
        part = cache.crop(t)
        full = cache.uncrop(part, list(t.shape), t.dtype)
        assert cache.tensor_digest(full) == cache.tensor_digest(t), t
    assert cache.crop(padded).shape == (4, 5, 2) and cache.crop(torch.zeros(5, 2)) is None


def test_a_negative_zero_is_kept(tmp_path):
    t = torch.zeros(4)
    t[0], t[3] = 1.0, -0.0  # -0.0 == 0, but its bits are not +0.0's: the box must keep it
    assert cache.crop(t).shape == (4,)
    src = tmp_path / "negzero.safetensors"
    save_file({"w": t}, str(src))
    cache.pack(src, tmp_path / "packed.safetensors")
    back = cache.unpack(tmp_path / "packed.safetensors")["w"]
    assert torch.equal(back.view(torch.int32), t.view(torch.int32))


def test_a_damaged_committed_file_is_refused_naming_it(tmp_path):
    committed = tmp_path / "weights"
    shutil.copytree(cache.COMMITTED, committed)
    path = committed / train_tiny.VAE
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # one bit of the last stored tensor
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{train_tiny.VAE}: tensor .* does not rebuild to the recorded bytes"):
        cache.unpack(path)
    plain = tmp_path / "plain.safetensors"
    save_file({"w": torch.ones(2)}, str(plain))
    with pytest.raises(ValueError, match=r"plain\.safetensors: not a cropped weights file"):
        cache.unpack(plain)


def test_weights_of_other_training_code_are_not_used(tmp_path):
    committed = tmp_path / "weights"
    shutil.copytree(cache.COMMITTED, committed)
    report = json.loads((committed / train_tiny.REPORT).read_text())
    (committed / train_tiny.REPORT).write_text(json.dumps(dict(report, key="0" * 16)))
    assert cache.committed_report(0, committed) is None
    with pytest.raises(ValueError, match="no weights of seed 0 made by this training code"):
        cache.unpack_into(tmp_path / "out", 0, committed)
