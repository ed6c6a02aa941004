"""Scales that lie, and files that change under a loaded model.

- A block scale grid is read only with a block size published formats use (formats.KNOWN_BLOCKS) or
  the one the file declares; any other grid is refused with the scale's key, instead of being read
  as whatever block shape happens to fit it ([3, 7] on [128, 128] as "43x19").
- A scale whose product with the largest FP8 value overflows the compute dtype is refused with its key.
- `load_file` leaves nothing mapped to the file: truncating or replacing it after the load cannot
  crash the process (a mapped page past the new end is SIGBUS), and a file that shrinks during the
  load gives a named error.
- Files that are not safetensors (text behind a link) are called what they are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fp8_engram.quant import formats
from fp8_engram.quant.config import ComputeConfig
from fp8_engram.quant.tensor import QuantizedTensor
from helpers import fp8_files

pytestmark = pytest.mark.unit

E4M3 = torch.float8_e4m3fn
ROOT = Path(__file__).resolve().parents[2]


def fp8(shape, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 64).clamp(-448, 448).to(E4M3)


def write(path, layers: dict, metadata: dict | None = None) -> Path:
    """layers: {name: (weight shape, scale tensor, scale suffix)} -> a file with `.weight` + scale per layer."""
    sd = {}
    for i, (name, (shape, scale, suffix)) in enumerate(layers.items()):
        sd[f"{name}.weight"] = fp8(shape, i)
        sd[f"{name}{suffix}"] = scale
    save_file(sd, str(path), metadata=metadata)
    return Path(path)


def one_layer(tmp_path, shape, scale, suffix=".weight_scale", metadata=None, name="one.safetensors"):
    return write(tmp_path / name, {"blk.proj": (shape, scale, suffix)}, metadata)


def expected_weight(q: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """float64 reference of a block-scaled weight (written here, independently of quant.layouts)."""
    r, c = block
    out, inp = q.shape
    full = scale.double().reshape(-1, scale.shape[1]).repeat_interleave(r, 0)[:out].repeat_interleave(c, 1)[:, :inp]
    return q.double() * full


# ------------------------------------------------------------------------------------------------
# Block grids
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("wshape,sshape,implied", [((128, 128), (3, 7), "about 43 x about 19"),
                                                    ((64, 64), (3, 7), "about 22 x about 10"),
                                                    ((128, 99), (128, 3, 1), "1 x 33")])  # musubi form
def test_scale_grid_of_an_unpublished_block_is_refused_with_its_key(tmp_path, wshape, sshape, implied):
    path = one_layer(tmp_path, wshape, torch.full(sshape, 0.01))
    with pytest.raises(formats.FormatError) as info:
        formats.load_file(path)
    text = str(info.value)
    assert str(path) in text and "key 'blk.proj.weight_scale'" in text and "fits no layout" in text, text
    assert implied in text, text


def test_the_found_files_are_refused(tmp_path):
    """The hostile pass's files: a [3, 7] scale on a [128, 128] weight beside good layers, and an extra
    [64, 64] weight with a [3, 7] scale; both used to load as blocks 43x19 and 22x10."""
    good = {"a.qkv": ((384, 128), torch.tensor(0.01), ".weight_scale")}
    path = write(tmp_path / "f1.safetensors", {**good, "a.proj": ((128, 128), torch.full((3, 7), 0.01), ".weight_scale")})
    with pytest.raises(formats.FormatError, match=r"key 'a\.proj\.weight_scale'.*\[3, 7\] fits no layout"):
        formats.load_file(path)
    path = write(tmp_path / "f2.safetensors", {**good, "extra": ((64, 64), torch.full((3, 7), 0.01), ".weight_scale")})
    with pytest.raises(formats.FormatError, match=r"key 'extra\.weight_scale'.*\[3, 7\] fits no layout"):
        formats.load_file(path)


@pytest.mark.parametrize("wshape,sshape,suffix,block", [
    ((200, 300), (2, 3), ".weight_scale_inv", (128, 128)),  # DeepSeek, ragged edges (ceil)
    ((256, 256), (2, 2), ".weight_scale", (128, 128)),
    ((64, 96), (64, 3, 1), ".scale_weight", (1, 32)),  # musubi [out, n, 1], powers of two
    ((64, 256), (64, 4, 1), ".scale_weight", (1, 64)),
    ((64, 1024), (64, 1, 1), ".scale_weight", (1, 1024)),
    ((64, 256), (64, 2), ".weight_scale", (1, 128)),  # compressed-tensors group 128
    ((64, 96), (64, 6), ".weight_scale", (1, 16)),  # NVFP4-sized groups
    ((64, 100), (64, 4), ".weight_scale", (1, 32)),  # MXFP8-sized blocks, ragged (ceil)
])
def test_published_block_sizes_load_and_dequantize_right(tmp_path, wshape, sshape, suffix, block):
    g = torch.Generator().manual_seed(5)
    scale = torch.rand(sshape, generator=g) * 0.01 + 0.001
    path = one_layer(tmp_path, wshape, scale, suffix)
    sd, report = formats.load_file(path)
    qt = sd["blk.proj.weight"]
    assert isinstance(qt, QuantizedTensor) and report.layers[0].block == block
    ref = expected_weight(qt.qdata, scale.reshape(sshape[0], sshape[1]), block)
    torch.testing.assert_close(qt.dequantize(torch.float64), ref, rtol=0, atol=0)


def test_a_declared_block_size_is_read_as_declared(tmp_path):
    """The pack's own row/block files declare their block (quantization_config weight_block_size); a
    declared block wins where a published one gives the same grid: [64, 2] on [64, 64] is 1x48 blocks
    as declared (48 + 16 columns), not 1x32."""
    scale = torch.tensor([[0.01, 0.02]]).repeat(64, 1)
    meta = {"quantization_config": json.dumps({"quant_method": "fp8", "weight_block_size": [1, 48]})}
    path = one_layer(tmp_path, (64, 64), scale, metadata=meta)
    sd, report = formats.load_file(path)
    assert report.layers[0].block == (1, 48)
    qt = sd["blk.proj.weight"]
    torch.testing.assert_close(qt.dequantize(torch.float64), expected_weight(qt.qdata, scale, (1, 48)), rtol=0, atol=0)
    # declared, but the grid is not the declared block's: no guessing either
    path = one_layer(tmp_path, (128, 128), torch.full((3, 7), 0.01), metadata=meta, name="two.safetensors")
    with pytest.raises(formats.FormatError, match="declared 1x48"):
        formats.load_file(path)


def test_known_blocks_table_names_who_uses_each_block():
    for (r, c), (edges, who) in formats.KNOWN_BLOCKS.items():
        assert r >= 1 and c >= 1 and edges in ("ceil", "exact") and who
    assert (128, 128) in formats.KNOWN_BLOCKS and (1, 64) in formats.KNOWN_BLOCKS
    assert formats.block_grid((200, 300), (128, 128)) == (2, 3)
    assert formats.block_grid((64, 100), (1, 64), "exact") is None


# ------------------------------------------------------------------------------------------------
# Scale ranges
# ------------------------------------------------------------------------------------------------

def test_a_scale_that_overflows_float32_is_refused_with_its_key(tmp_path):
    """3e38 x 448 is beyond float32 (and bfloat16): every latent was NaN."""
    path = one_layer(tmp_path, (128, 128), torch.tensor(3e38))
    with pytest.raises(formats.FormatError) as info:
        formats.load_file(path)
    text = str(info.value)
    assert str(path) in text and "key 'blk.proj.weight_scale'" in text and "beyond float32's range" in text, text
    assert "NaN" in text


def test_one_overflowing_block_scale_is_enough(tmp_path):
    scale = torch.full((2, 2), 0.01)
    scale[1, 0] = 1e37
    path = one_layer(tmp_path, (256, 256), scale, ".weight_scale_inv")
    with pytest.raises(formats.FormatError, match=r"weight_scale_inv'.*scale 1e\+37"):
        formats.load_file(path)


def test_the_limit_follows_the_compute_dtype(tmp_path):
    """200 x 448 = 89,600 fits float32 but not float16 (65,504); the largest real-looking scale loads."""
    path = one_layer(tmp_path, (128, 128), torch.tensor(200.0))
    sd, _ = formats.load_file(path)
    assert torch.isfinite(sd["blk.proj.weight"].dequantize(torch.float32)).all()
    with pytest.raises(formats.FormatError, match="beyond float16's range"):
        formats.load_file(path, config=ComputeConfig(compute_dtype=torch.float16))
    ok = one_layer(tmp_path, (128, 128), torch.tensor(65504.0 / 448), name="edge.safetensors")
    sd, _ = formats.load_file(ok, config=ComputeConfig(compute_dtype=torch.float16))
    assert torch.isfinite(sd["blk.proj.weight"].dequantize(torch.float16)).all()


# ------------------------------------------------------------------------------------------------
# Nothing stays mapped to the file
# ------------------------------------------------------------------------------------------------

def mapped_paths() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}


@pytest.fixture()
def model_file(tmp_path):
    path = tmp_path / "model.safetensors"
    fp8_files.write_format(fp8_files.small_float_sd(2), path, "comfy_quant_per_layer")
    return path


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc/self/maps to list mappings")
def test_loaded_tensors_are_not_mapped_to_the_file(model_file):
    sd, _ = formats.load_file(model_file)
    assert str(model_file) not in mapped_paths()
    sd_mapped, _ = formats.load_file(model_file, mmap=True)  # the opt-in for scripts does map it
    assert str(model_file) in mapped_paths()
    for key, value in sd.items():  # and both read the same bytes
        a, b = (value.qdata, sd_mapped[key].qdata) if isinstance(value, QuantizedTensor) else (value, sd_mapped[key])
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), key


def run_child(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a child process: where a mapped page past the new end of a file is touched, the
    kernel kills the process with SIGBUS, which must not take the test run with it."""
    head = f"import sys\nsys.path[:0] = [{str(ROOT / '.host' / 'pkg')!r}]\n"
    return subprocess.run([sys.executable, "-c", head + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120)


def test_a_file_truncated_after_the_load_does_not_crash_the_process(model_file):
    """Load, truncate the file (as a download tool rewriting it in place does), then use every weight."""
    done = run_child(f"""
        import torch
        from fp8_engram.quant import formats
        path = {str(model_file)!r}
        sd, _ = formats.load_file(path)
        def sums():
            return {{k: (v.dequantize(torch.float32) if hasattr(v, "qdata") else v.float()).sum().item()
                    for k, v in sd.items()}}
        before = sums()
        with open(path, "r+b") as f:
            f.truncate(64)
        assert sums() == before
        print("ok", len(sd))
    """)
    assert done.returncode == 0 and done.stdout.startswith("ok"), (done.returncode, done.stderr[-2000:])


def test_a_file_that_shrinks_during_the_load_gives_a_named_error(model_file):
    done = run_child(f"""
        import os
        from fp8_engram.quant import formats
        path = {str(model_file)!r}
        def shrink(done, total):
            if done == 1:
                with open(path, "r+b") as f:
                    f.truncate(os.path.getsize(path) // 2)
        try:
            formats.load_file(path, progress=shrink)
        except formats.FormatError as exc:
            print(exc)
    """)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert str(model_file) in done.stdout and "truncated or rewritten while loading" in done.stdout, done.stdout


def test_a_file_replaced_during_the_load_is_read_whole_from_the_first_one(model_file, tmp_path):
    """Renaming a new file over the name while loading: the load keeps reading the file it opened."""
    other = tmp_path / "other.safetensors"
    fp8_files.write_format(fp8_files.small_float_sd(9), other, "comfy_quant_per_layer")
    ref, _ = formats.load_file(model_file)

    def replace(done, total):
        if done == 1:
            os.replace(other, model_file)

    sd, _ = formats.load_file(model_file, progress=replace)
    for key, value in ref.items():
        a, b = (value.qdata, sd[key].qdata) if isinstance(value, QuantizedTensor) else (value, sd[key])
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), key


# ------------------------------------------------------------------------------------------------
# Not a safetensors file
# ------------------------------------------------------------------------------------------------

def test_a_link_to_a_text_file_is_called_text_not_a_header_length(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello world, these are my notes\n" * 4)
    link = tmp_path / "model.safetensors"
    link.symlink_to(text)
    with pytest.raises(formats.FormatError) as info:
        formats.load_file(link)
    msg = str(info.value)
    assert str(link) in msg and "text (it begins 'hello wo')" in msg and "not a safetensors file" in msg, msg
    assert f"a link to {text}" in msg, msg
    number = int.from_bytes(b"hello wo", "little")
    assert str(number) not in msg and f"{number:,}" not in msg, msg


def test_a_pickle_checkpoint_is_called_what_it_is(tmp_path):
    path = tmp_path / "model.safetensors"
    torch.save({"w": torch.ones(4)}, path)
    with pytest.raises(formats.FormatError, match=r"zip archive \(a PyTorch \.ckpt/\.pt pickle\?\), not safetensors"):
        formats.load_file(path)
