"""A full disk or a failing write while saving: Save FP8 Model (quant.save), Save Engram Memory (its
table file writer) and the CLI converter give a clear error naming the file, leave no partial file
under the final name and no temporary file, and never touch the file that was there before.

Two ways to make a write fail:
- a real full disk: a small tmpfs mounted for the test (needs root; skipped with that reason
  elsewhere). With the free-space check the writers refuse up front; with that check told there is
  room, the kernel's own ENOSPC hits in the middle of the write;
- a mock, where the real thing cannot run: the writer's file object raises OSError(ENOSPC) after
  a set number of bytes (the bytes before it really reach the temporary file).
The server test saves through Save FP8 Model into an output subfolder that is a full tmpfs, then saves
elsewhere to show the server keeps working.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.host import missing_prerequisite
import torch

from fp8_engram.engram import table_file
from fp8_engram.quant import convert, formats, save
from fp8_engram.quant.quantize_model import quantize_state_dict
from helpers.graphs import sd3_txt2img

pytestmark = pytest.mark.integration


def float_sd(n: int = 256, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"blocks.{i}.mlp.fc.weight": torch.randn(n, n, generator=g).to(torch.bfloat16) for i in range(4)} | {
        "blocks.0.norm.weight": torch.ones(n, dtype=torch.bfloat16)}


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of `size` mounted at `path` for the block (the real full disk)."""
    if os.geteuid() != 0:
        missing_prerequisite("needs root to mount a small tmpfs (a real full disk)")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0777", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        missing_prerequisite(f"cannot mount a tmpfs here ({done.stderr.strip()})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


class _FailingFile:
    """Wraps a real file; write() passes bytes through until `limit`, then raises OSError(ENOSPC)."""

    def __init__(self, f, limit: int):
        self.f, self.limit, self.count = f, limit, 0

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        if self.count + n > self.limit:
            keep = self.limit - self.count
            if keep > 0:
                self.f.write(memoryview(data).cast("B")[:keep])
                self.count += keep
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.count += n
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.fixture
def disk_fills_after(monkeypatch):
    """Mock: every file opened with os.fdopen (how both writers open their temporary file) fails with
    ENOSPC after `limit` bytes."""

    def arm(limit: int):
        real = os.fdopen

        def fdopen(fd, *args, **kwargs):
            return _FailingFile(real(fd, *args, **kwargs), limit)

        monkeypatch.setattr(os, "fdopen", fdopen)

    return arm


def check_failure(exc: OSError, path: Path) -> None:
    assert exc.errno == errno.ENOSPC
    assert str(path) in str(exc) and ("disk is full" in str(exc) or "are free" in str(exc)), str(exc)


# ---- Save FP8 Model's writer ---------------------------------------------------------------------
def test_save_mid_write_failure_keeps_the_previous_file(tmp_path, disk_fills_after):
    qsd, _ = quantize_state_dict(float_sd())
    path = tmp_path / "model.safetensors"
    save.save_state_dict(qsd, path)
    before = path.read_bytes()
    disk_fills_after(100_000)  # mock: the file is about 270 KB
    with pytest.raises(save.SaveError) as info:
        save.save_state_dict(qsd, path, overwrite=True)
    check_failure(info.value, path)
    assert "writing failed after" in str(info.value) and "unchanged" in str(info.value)
    assert path.read_bytes() == before and listing(tmp_path) == ["model.safetensors"]
    with pytest.raises(save.SaveError, match="no file was created"):
        save.save_state_dict(qsd, tmp_path / "new.safetensors")
    assert listing(tmp_path) == ["model.safetensors"]


def test_save_on_a_full_disk(tmp_path):
    qsd, _ = quantize_state_dict(float_sd(512))  # about 1 MiB of FP8 weights
    with tmpfs(tmp_path / "fs", "768k") as fs:
        old = fs / "model.safetensors"
        save.save_state_dict(quantize_state_dict(float_sd(64))[0], old)
        before = old.read_bytes()
        with pytest.raises(save.SaveError) as info:  # the free-space check refuses up front
            save.save_state_dict(qsd, old, overwrite=True)
        check_failure(info.value, old)
        assert old.read_bytes() == before and listing(fs) == ["model.safetensors"]
        # Told there is room, the write runs into the kernel's ENOSPC part way.
        real_usage = shutil.disk_usage
        save.shutil.disk_usage = lambda p: real_usage(p)._replace(free=1 << 40)
        try:
            with pytest.raises(save.SaveError) as info:
                save.save_state_dict(qsd, old, overwrite=True)
        finally:
            save.shutil.disk_usage = real_usage
        assert "No space left on device" in str(info.value) and str(old) in str(info.value)
        assert old.read_bytes() == before and listing(fs) == ["model.safetensors"]
        assert shutil.disk_usage(fs).used < 256 * 1024  # the partial temporary file is gone


# ---- Save Engram Memory's writer -----------------------------------------------------------------
def tables(rows: int, hidden: int = 256):
    g = torch.Generator().manual_seed(rows)
    return [torch.randn(rows, hidden, generator=g).to(torch.bfloat16) for _ in range(2)]


def test_table_file_mid_write_failure_keeps_the_previous_file(tmp_path, disk_fills_after):
    path = tmp_path / "memory.safetensors"
    table_file.write_table_file(path, tables(64), hashing={"v": 1})
    before = path.read_bytes()
    disk_fills_after(50_000)
    with pytest.raises(table_file.TableFileWriteError) as info:
        table_file.write_table_file(path, tables(256), hashing={"v": 2})
    check_failure(info.value, path)
    assert "unchanged" in str(info.value)
    assert path.read_bytes() == before and listing(tmp_path) == ["memory.safetensors"]


def test_table_file_on_a_full_disk(tmp_path):
    with tmpfs(tmp_path / "fs", "512k") as fs:
        path = fs / "memory.safetensors"
        table_file.write_table_file(path, tables(64), hashing={"v": 1})
        before = path.read_bytes()
        with pytest.raises(table_file.TableFileWriteError) as info:
            table_file.write_table_file(path, tables(2048), hashing={"v": 2})  # 2 MiB
        check_failure(info.value, path)
        real_usage = shutil.disk_usage
        table_file.shutil.disk_usage = lambda p: real_usage(p)._replace(free=1 << 40)
        try:
            with pytest.raises(table_file.TableFileWriteError, match="No space left on device"):
                table_file.write_table_file(path, tables(2048), hashing={"v": 2})
        finally:
            table_file.shutil.disk_usage = real_usage
        assert path.read_bytes() == before and listing(fs) == ["memory.safetensors"]
        with table_file.TableFile(path) as f:
            assert f.hashing == {"v": 1}


# ---- the CLI converter ---------------------------------------------------------------------------
@pytest.fixture
def source_file(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "src.safetensors"
    save_file(float_sd(512), str(path))
    return path


def test_converter_on_a_full_disk(tmp_path, source_file):
    with tmpfs(tmp_path / "fs", "512k") as fs:
        out = fs / "out.safetensors"
        out.write_bytes(b"previous")
        done = subprocess.run([sys.executable, "-m", "fp8_engram.quant.convert", str(source_file), str(out), "--overwrite"],
                              capture_output=True, text=True, cwd=Path(save.__file__).parents[2])
        assert done.returncode == 2, done.stderr
        assert "error:" in done.stderr and str(out) in done.stderr and "free" in done.stderr
        assert "Traceback" not in done.stderr
        assert out.read_bytes() == b"previous" and listing(fs) == ["out.safetensors"]


def test_converter_mid_write_failure(tmp_path, source_file, disk_fills_after, capsys):
    out = tmp_path / "out.safetensors"
    disk_fills_after(200_000)
    assert convert.main([str(source_file), str(out)]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and str(out) in err and "disk is full" in err and "no file was created" in err
    assert not out.exists() and listing(tmp_path) == ["src.safetensors"]


# ---- through the server --------------------------------------------------------------------------
def test_save_fp8_model_on_a_full_output_folder(comfy, output_dir):
    graph = sd3_txt2img(save="latent", prefix="faults")
    graph["20"] = {"class_type": "FP8Engram.QuantizeModelToFP8",
                   "inputs": {"model": ["1", 0], "granularity": "tensor", "fp8_dtype": "e4m3fn", "keep_patterns": "*embed*"}}
    graph["21"] = {"class_type": "FP8Engram.SaveFP8Model", "inputs": {"model": ["20", 0], "filename_prefix": "full/model"}}
    with tmpfs(output_dir / "full", "512k") as full:
        (full / "model_00001_.safetensors").write_bytes(b"an earlier save")
        with pytest.raises(Exception) as info:
            comfy.run(graph)
        text = str(info.value)
        assert "SaveError" in text and "full/model_00002_.safetensors" in text and "free" in text, text
        assert listing(full) == ["model_00001_.safetensors"]
        assert (full / "model_00001_.safetensors").read_bytes() == b"an earlier save"
    graph["21"]["inputs"]["filename_prefix"] = "faults_after/model"
    hist = comfy.run(graph)
    assert "saved output/faults_after/" in hist["outputs"]["21"]["text"][0]
    saved = sorted((output_dir / "faults_after").glob("model_*.safetensors"))
    assert saved and formats.inspect_file(saved[-1]).layers_quantized > 0
