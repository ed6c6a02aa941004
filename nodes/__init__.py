"""ComfyUI adapters: the only part of the pack that imports `comfy`. Node classes hold no math.

Each node module exposes `NODES`, a list of `io.ComfyNode` classes. A module that fails to import is
logged and skipped, so one broken feature group never hides the others.
"""

from __future__ import annotations

import importlib
import logging

from comfy_api.latest import ComfyExtension, io

logger = logging.getLogger(__name__)

PACK = "fp8-engram"
# Node ids are "FP8Engram.<Name>"; categories live under this root in the node library.
NODE_ID_PREFIX = "FP8Engram."
CATEGORY = "fp8-engram"

_NODE_MODULES = ("basic", "fp8", "engram")


def _collect_nodes() -> list[type[io.ComfyNode]]:
    nodes: list[type[io.ComfyNode]] = []
    for name in _NODE_MODULES:
        try:
            module = importlib.import_module(f".{name}", __name__)
        except Exception:
            logger.exception("%s: the %s nodes could not be loaded; the rest of the pack still works", PACK, name)
            continue
        nodes.extend(module.NODES)
    return nodes


class FP8EngramExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return _collect_nodes()
