"""Engram engine and memory: pure torch, never imports ComfyUI.

Submodules are imported lazily so that `import fp8_engram.engram` stays cheap.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "RowStore": ".store",
    "LocalRowStore": ".store",
    "LocalEngramBuffer": ".buffer",
    "EngramGroup": ".group",
    "EngramWorkerError": ".group",
    "HostEngramBuffer": ".host_tier",
    "HostRowStore": ".host_tier",
    "TableFile": ".table_file",
    "TableFileError": ".table_file",
    "write_table_file": ".table_file",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
