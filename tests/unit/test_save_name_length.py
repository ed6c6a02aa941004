"""File names too long for the file system: refused up front with what to do, and the longest name
accepted really saves (counter, extension and temporary suffix included)."""

from __future__ import annotations

import os

import pytest
import torch

from fp8_engram.quant import save
from fp8_engram.quant.layouts import PerTensor
from fp8_engram.quant.tensor import QuantizedTensor

pytestmark = pytest.mark.unit


def name_max(folder) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (AttributeError, OSError):
        pytest.skip("needs os.pathconf to read the file system's name limit")


def test_a_300_character_name_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError) as info:
        save.check_output_prefix("fp8/" + "x" * 300, tmp_path)
    text = str(info.value)
    assert "file name is 300 bytes long" in text and "shorten it" in text, text
    with pytest.raises(ValueError, match="folder name 'yyyy.*is 300 bytes long"):
        save.check_output_prefix("y" * 300 + "/model", tmp_path)
    assert not list(tmp_path.iterdir())


def test_the_longest_accepted_name_saves_even_when_it_needs_a_second_counter(tmp_path):
    """What the node does: ComfyUI's counter, then unique_path's when that name is taken."""
    room = name_max(tmp_path) - save.NAME_SUFFIX_BYTES
    prefix, folder = save.check_output_prefix("n" * room, tmp_path)
    with pytest.raises(ValueError):
        save.check_output_prefix("n" * (room + 1), tmp_path)
    first = os.path.join(folder, f"{prefix}_00001_.safetensors")
    open(first, "wb").close()
    path = save.unique_path(first)
    assert path.endswith("_00001__00001.safetensors")
    sd = {"l.weight": QuantizedTensor.from_float(torch.randn(16, 16), PerTensor()), "l.bias": torch.zeros(16)}
    result = save.save_state_dict(sd, path)
    assert os.path.getsize(result.path) == result.bytes_written


def test_a_name_the_file_system_refuses_gives_a_save_error_naming_the_file(tmp_path):
    """Past the prefix check (a library caller): the temporary file cannot be made -> SaveError, not a
    bare OSError from deep inside."""
    path = tmp_path / ("z" * (name_max(tmp_path) - 10) + ".safetensors")
    with pytest.raises(save.SaveError) as info:
        save.save_state_dict({"b": torch.zeros(4)}, path)
    assert str(path) in str(info.value) and "no file was created" in str(info.value)
