"""Fixtures shared by every test.

Layout of the suite: tests/unit (pure torch, no ComfyUI), tests/integration (a real ComfyUI server
with this pack in custom_nodes/, driven over HTTP), tests/browser (the real frontend in headless
Chromium). Markers `unit`, `integration`, `browser` are applied by folder.

Fixtures for integration and browser tests:
- `comfy_server` (session): a real ComfyUI on a free loopback port, run by the tree's own python
  (both from scripts/comfyhost.py: COMFYUI_PATH, else the 0.3.75 tree in .host/comfyui), its own
  base directory (`comfy_server.base_dir`: models/, output/, input/, custom_nodes/fp8_engram).
- `comfy` (session): a `ComfyClient` for that server: `.run(graph)` -> history entry (raises
  `WorkflowError` with the node's exception text), `.submit(graph)` -> raw response (400 +
  node_errors for bad inputs), `.object_info()`, `.view(filename, subfolder, type)`, `.free()`.
- `models_dir` (session): `<base>/models`, holding the tiny models (tests may add files there:
  ComfyUI lists folders anew on each request).
- `output_dir` (session): `<base>/output`.
Fixtures for unit tests: `clip_tokenizer`, `t5_tokenizer` (the real tokenizers in ComfyUI's tree,
loaded with transformers).
Graph builders live in tests/helpers/graphs.py (`from helpers.graphs import sd3_txt2img`).
Any test may `import fp8_engram` (the pack as a library). Paths of the ComfyUI tree and its python come
from `comfyhost.comfyui_root()` / `comfyhost.comfyui_python()` only; `comfyui_tree` (session) is the tree.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOST = ROOT / ".host"

# `import fp8_engram` (the pack under its fixed name), `import comfyhost`, `import helpers`.
# comfyhost (and `requests`) is imported only by the fixtures that start ComfyUI, so the unit tests
# also run where only torch is installed (e.g. a GPU machine without this checkout's .venv).
(HOST / "pkg").mkdir(parents=True, exist_ok=True)
_pkg_link = HOST / "pkg" / "fp8_engram"
if not _pkg_link.exists():
    _pkg_link.symlink_to(ROOT, target_is_directory=True)
for path in (HOST / "pkg", ROOT / "scripts", ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

ARTIFACTS = ROOT / "test-artifacts"


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = Path(str(item.fspath)).relative_to(ROOT).parts
        if len(parts) > 1 and parts[0] == "tests" and parts[1] in ("unit", "integration", "browser"):
            item.add_marker(getattr(pytest.mark, parts[1]))
        # a test skipped without a GPU is a "cuda" test, marked or not (bench/gpu_check.sh selects them with -m cuda)
        if any(_needs_gpu(str(m.kwargs.get("reason", ""))) for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.cuda)


def _needs_gpu(reason: str) -> bool:
    return "CUDA" in reason or "GPU" in reason


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="session")
def comfyui_tree() -> Path:
    """The ComfyUI tree in use (COMFYUI_PATH, else .host/comfyui); skips where none is set up."""
    from comfyhost import comfyui_root

    from helpers.host import missing_tree

    try:
        return comfyui_root()
    except FileNotFoundError as exc:
        missing_tree(f"needs a ComfyUI tree: {exc}")


@pytest.fixture(scope="session")
def clip_tokenizer():
    """The real CLIP tokenizer ComfyUI ships (loaded with transformers, no ComfyUI import)."""
    from comfyhost import comfyui_root

    transformers = pytest.importorskip("transformers")
    return transformers.CLIPTokenizer.from_pretrained(str(comfyui_root() / "comfy" / "sd1_tokenizer"))


@pytest.fixture(scope="session")
def t5_tokenizer():
    """The real T5 tokenizer ComfyUI ships (SD3 and Flux text encoders)."""
    from comfyhost import comfyui_root

    transformers = pytest.importorskip("transformers")
    return transformers.T5TokenizerFast.from_pretrained(str(comfyui_root() / "comfy" / "text_encoders" / "t5_tokenizer"))


@pytest.fixture(scope="session")
def tiny_models_cache() -> Path:
    """The tiny random models, made once per machine (they are seeded, so always the same)."""
    from comfyhost import comfyui_root

    cache = HOST / "cache" / "models"
    try:
        comfyui_root()
    except FileNotFoundError as exc:
        pytest.fail(f"{exc}")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "tiny_models.py"), str(cache)], check=True)
    return cache


@pytest.fixture(scope="session")
def comfy_server(tmp_path_factory, tiny_models_cache):
    from helpers.host import start_server_with_tiny_models

    server = start_server_with_tiny_models(tmp_path_factory.mktemp("comfy_base"), tiny_models_cache)
    yield server
    server.stop()
    if os.environ.get("CI") or os.environ.get("KEEP_COMFY_LOG"):
        from comfyhost import comfyui_version

        ARTIFACTS.mkdir(exist_ok=True)
        version = ".".join(map(str, comfyui_version())) or "unknown"
        (ARTIFACTS / f"comfyui-{version}.log").write_text(server.log_tail(100000))


@pytest.fixture(scope="session")
def comfy(comfy_server):
    return comfy_server.client()


@pytest.fixture(scope="session")
def models_dir(comfy_server) -> Path:
    return comfy_server.base_dir / "models"


@pytest.fixture(scope="session")
def output_dir(comfy_server) -> Path:
    return comfy_server.base_dir / "output"


