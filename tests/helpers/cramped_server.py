"""A real ComfyUI server in a mount namespace of its own: its /dev/shm is a small tmpfs and its
models/engram folder is read-only, while the machine's stay as they are.

The server's python is started through `unshare -m` (mounts private to the server's process tree), which
mounts the tmpfs over /dev/shm and bind-mounts models/engram read-only, then execs ComfyUI. Needs
util-linux's unshare and the right to mount (root or CAP_SYS_ADMIN); `namespace_unavailable()` says why
not, for a skip.
"""

from __future__ import annotations

import shutil
import stat
import subprocess
from pathlib import Path


def namespace_unavailable() -> str | None:
    """Why a process (a server, a test's child) cannot get a mount namespace with its own tmpfs here (None: it can)."""
    if shutil.which("unshare") is None:
        return "needs util-linux's unshare to give a process a small /dev/shm of its own"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"needs a mount namespace (root or CAP_SYS_ADMIN) to give a process a small /dev/shm: {probe.stderr.strip()}"
    return None


def start_cramped_server(base: Path, tiny_models_cache: Path, shm: str = "32m", filled_mib: int = 0):
    """A started ComfyServer (tiny models linked) whose /dev/shm is a `shm` tmpfs, `filled_mib` MiB of it
    taken by a file (another program's), and whose models/engram is read-only. Stop it with `.stop()`."""
    from comfyhost import ComfyServer, comfyui_python, comfyui_root

    for src in tiny_models_cache.rglob("*.safetensors"):
        dst = base / "models" / src.relative_to(tiny_models_cache)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.symlink_to(src)
    engram = base / "models" / "engram"
    engram.mkdir(parents=True, exist_ok=True)
    real_python = str(comfyui_python(comfyui_root()))
    wrapper = base / "python-in-namespace.sh"
    wrapper.write_text(
        "#!/bin/sh\n"
        "# ComfyUI with a private mount namespace: a small /dev/shm and a read-only models/engram\n"
        f"exec unshare -m sh -c 'mount -t tmpfs -o size={shm} tmpfs /dev/shm && "
        f"dd if=/dev/zero of=/dev/shm/another-program bs=1M count={filled_mib} status=none && "
        "mount --bind \"$1\" \"$1\" && mount -o remount,bind,ro \"$1\" && shift && exec \"$@\"' "
        f"sh '{engram}' '{real_python}' \"$@\"\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return ComfyServer(base_dir=base, python=str(wrapper)).start()
