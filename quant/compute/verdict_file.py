"""The verdict file's rules: read bounded and only from a regular file, one format, writes locked and atomic.

Used by ``book.py``, which validates the entries. Pure Python; never imports ComfyUI.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import time
from pathlib import Path

from ...common import files

__all__ = ["FORMAT", "MAX_FILE_BYTES", "LOCK_WAIT_S", "read_bounded", "parse", "locked", "write_atomic"]

FORMAT = 2
MAX_FILE_BYTES = 4 << 20  # a verdict file larger than this is not read (a full one holds ~1 MiB)
LOCK_WAIT_S = 5.0  # how long a write waits for another process's lock before it gives up this time


def read_bounded(path: Path) -> bytes | None:
    """The file's bytes, or None where there is none; OSError/ValueError for one that must not be read
    (not a regular file: a FIFO or a device would block or never end; larger than MAX_FILE_BYTES)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size > MAX_FILE_BYTES:
            raise ValueError(f"{st.st_size:,} bytes, more than the {MAX_FILE_BYTES:,} a verdict file may hold")
        chunks, left = [], MAX_FILE_BYTES + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > MAX_FILE_BYTES:
            raise ValueError(f"more than the {MAX_FILE_BYTES:,} bytes a verdict file may hold")
        return data
    finally:
        os.close(fd)


def parse(data: bytes) -> dict:
    try:
        doc = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("stacks"), dict):
        raise ValueError(f"not a verdict file of format {FORMAT}")
    return doc


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive lock on ``path`` + ".lock" (a file of its own: the verdict file is renamed over), or
    TimeoutError after LOCK_WAIT_S."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(str(path) + ".lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                    raise TimeoutError(f"{path}.lock is held by another process") from exc
                time.sleep(0.02)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def write_atomic(path: Path, text: str) -> None:
    files.write_atomic(path, text)
