"""What the engram nodes read from ComfyUI: the models/engram folder, files inside ComfyUI's input folder,
float and CONDITIONING inputs checked, the free memory placement weighs, worker pids, and the plain names
of the pack's errors."""

from __future__ import annotations

import math
import os
import sys

import torch

import comfy.model_management
import folder_paths

from ..engram.memory import EngramMemory, EngramMemoryError

# ----- plain error type names -----
#
# ComfyUI shows an error's type as `module.qualname` (execution.full_type_name, same in 0.3.75 and
# 0.29), and it imports a custom node pack under its folder's PATH as the module name, so the pack's
# own exceptions would read "/home/.../custom_nodes/fp8_engram.engram.group.EngramWorkerError". Their
# module is renamed to the pack's name, which is all a user needs to see: "fp8_engram.EngramWorkerError".
PACK_MODULE = "fp8_engram"
_PACK_ROOT = __name__.rsplit(".", 2)[0]  # this module is <pack>.nodes.engram_inputs


def plain_error_names(root: str = _PACK_ROOT, shown_as: str = PACK_MODULE) -> list[str]:
    """Give every exception class defined in the pack's loaded modules the module name `shown_as`."""
    renamed = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == root or name.startswith(root + ".")):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == name:
                value.__module__ = shown_as
                renamed.append(value.__qualname__)
    return renamed


FOLDER = "engram"

folder_paths.add_model_folder_path(FOLDER, os.path.join(folder_paths.models_dir, FOLDER), is_default=True)
_paths, _exts = folder_paths.folder_names_and_paths[FOLDER]
folder_paths.folder_names_and_paths[FOLDER] = (_paths, set(_exts) | {".safetensors"})


def engram_files() -> list[str]:
    return folder_paths.get_filename_list(FOLDER)


def device_free_bytes(devices: str) -> int:
    """Free memory where `device` placement would put the tables: every GPU's, or the machine's RAM."""
    if devices == "auto" and torch.cuda.is_available():
        return sum(int(comfy.model_management.get_free_memory(torch.device("cuda", i))) for i in range(torch.cuda.device_count()))
    return int(comfy.model_management.get_free_memory(torch.device("cpu")))


def worker_pids(memory: EngramMemory) -> list[int]:
    pids = getattr(memory.store, "worker_pids", None)  # EngramGroup: a property
    if callable(pids):
        pids = pids()
    return [int(p) for p in pids] if pids else []


def inside_input(name: str, what: str, relative_to: str | None = None) -> str:
    """The real path of `name` inside ComfyUI's input folder (a name there, optionally with ComfyUI's
    " [input]" annotation, or for files named by a pairs file, relative to that file's folder). Anything
    that resolves outside the input folder (absolute paths, "..", symlinks that leave it) is refused
    before it is opened, and so is anything but a regular file."""
    base = os.path.realpath(folder_paths.get_input_directory())
    plain, annotated_base = folder_paths.annotated_filepath(name.strip())
    if annotated_base is not None and os.path.realpath(annotated_base) != base:
        raise ValueError(f"{what} {name!r}: only files in ComfyUI's input folder can be used")
    if "\0" in plain:
        raise ValueError(f"{what} {name!r}: the name holds a NUL character")
    start = base if relative_to is None else relative_to
    path = os.path.realpath(os.path.join(start, plain)) if plain and not os.path.isabs(plain) else None
    if path is None or os.path.commonpath([base, path]) != base:
        raise ValueError(f"{what} {name!r} is not a file inside ComfyUI's input folder; put the file in the input "
                         "folder and give its name there (absolute paths, '..' and links that leave the folder are refused)")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} {name!r} does not exist in ComfyUI's input folder")
    if not os.path.isfile(path):
        raise ValueError(f"{what} {name!r} is not a regular file")
    return path


def finite_input(node: str, name: str, value, low: float, high: float) -> float:
    """A float input as a float, refused by name when it is not a finite number in [low, high].

    ComfyUI's validation compares a FLOAT input with the widget's min and max, and every comparison
    with NaN is false, so a raw JSON `NaN` in an API prompt reaches the node; it would turn every
    conditioning value it touches into NaN without an error."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{node}: input '{name}' must be a number, got {value!r}") from None
    if not math.isfinite(number) or not low <= number <= high:
        raise ValueError(f"{node}: input '{name}' is {number!r}; give a finite number from {low:g} to {high:g}")
    return number


def finite_conditioning(cond, what: str):
    """`cond` (a CONDITIONING tensor), refused with an error naming `what` (the node and its input) when
    it holds NaN or inf: written into the memory it would make every later prompt's conditioning NaN."""
    if isinstance(cond, torch.Tensor) and cond.is_floating_point() and not bool(torch.isfinite(cond).all()):
        bad = int((~torch.isfinite(cond)).sum())
        raise EngramMemoryError(f"{what} holds NaN or infinite values ({bad} of {cond.numel()}); nothing was written "
                                "into the memory. Give a finite conditioning")
    return cond
