"""Digests of a package's source files: what changed code must invalidate (compiled graphs, verdicts)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def source_digest(root: str | Path, algorithm: str = "sha256", chars: int | None = None) -> str:
    """Hex digest of every `*.py` below `root`, each file's path relative to `root` and its bytes, in
    sorted order (the same tree gives the same digest on every machine); the first `chars` hex digits
    when given. Callers cache it: this reads every file."""
    root = Path(root)
    h = hashlib.new(algorithm)
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:chars] if chars is not None else h.hexdigest()
