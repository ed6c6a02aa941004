"""The ComfyUI tree in use, imported into the test process (for the in-process tests).

Which tree and which python: `scripts/comfyhost.py` decides (COMFYUI_PATH, else .host/comfyui); this
module only checks that the test process runs in that tree's environment, then puts the tree on
sys.path with ComfyUI in CPU mode.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest


def missing_prerequisite(message: str):
    """Skip a test whose prerequisite (a pinned package, root, a mount namespace) this machine lacks; under CI
    (CI set), fail instead: CI's machine has them all, so a missing one is a broken setup a skip would hide."""
    if os.environ.get("CI"):
        pytest.fail(f"{message} (CI is set: this prerequisite should be here)")
    pytest.skip(message)


def missing_tree(message: str):
    """Skip a test that needs a ComfyUI tree where none is set up; under CI (CI set), fail instead: there
    the setup makes every tree, so a missing one is a broken setup that a skip would turn green."""
    if os.environ.get("CI"):
        pytest.fail(f"{message} (CI is set: its setup should have made the tree)")
    pytest.skip(message)


def comfy_in_process() -> Path:
    """Make `import comfy.*` load the tree in use; returns the tree. Fails clearly when the test process
    is not that tree's python (its packages would not match the tree)."""
    from comfyhost import comfyui_root, env_dir

    try:
        tree = comfyui_root()
    except FileNotFoundError as exc:
        missing_tree(f"needs a ComfyUI tree: {exc}")
    env = env_dir(tree)
    if Path(sys.prefix).resolve() != env.resolve():
        pytest.fail(f"this test imports ComfyUI {tree} in process, so it must run with {env}/bin/python "
                    f"(scripts/test.sh picks it), not {sys.executable}")
    if str(tree) not in sys.path:
        sys.path.insert(0, str(tree))
    import comfy.cli_args

    comfy.cli_args.args.cpu = True  # keep model_management away from CUDA at import
    return tree


def start_server_with_tiny_models(base, tiny_models_cache):
    """A started ComfyServer whose base directory `base` links every tiny model of the cache."""
    from comfyhost import ComfyServer

    for src in tiny_models_cache.rglob("*.safetensors"):
        dst = base / "models" / src.relative_to(tiny_models_cache)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.symlink_to(src)
    return ComfyServer(base_dir=base).start()
