"""Files written whole or not at all: a new temporary file beside the destination, renamed into place."""

from __future__ import annotations

import contextlib
import os
import secrets


def new_temp_file(folder: str, prefix: str, suffix: str) -> tuple[int, str]:
    """(descriptor open for writing, path) of a new file in `folder` with the mode of any new file (0666
    less the umask, which the kernel applies): mkstemp would make it 0600, and reading the umask to widen
    it means changing it for every thread of the process meanwhile. The random name never collides with
    another writer's (O_EXCL)."""
    tmp = os.path.join(folder, f"{prefix}{secrets.token_hex(8)}{suffix}")
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), tmp


def write_atomic(path: str | os.PathLike, data: bytes | str) -> None:
    """Write `data` (str as UTF-8) to `path` through a temporary file in the same folder, flushed to disk
    and renamed over `path`: a reader sees the old file or the new one, never a part. The temporary file
    is removed on any failure; the error is raised as it came."""
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    fd, tmp = new_temp_file(folder, f".{name}.", ".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
