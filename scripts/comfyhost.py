"""Run a real ComfyUI server with this pack and talk to it over its HTTP API.

Used by the demo (scripts/demo.py), the tests (tests/conftest.py) and the benchmarks. The server runs
from the ComfyUI tree set up by scripts/setup.sh (or COMFYUI_PATH) with `--base-directory` pointing at
a folder of its own, so models, outputs and custom_nodes never touch the user's ComfyUI: the pack is
linked into `<base>/custom_nodes/fp8_engram`.

The frontend is the one the tree's environment pins, unless FP8_ENGRAM_FRONTEND names another
release of `comfyui-frontend-package` (e.g. 1.58.1): scripts/setup.sh installs it into
`.host/frontends/` and the server serves it with `--front-end-root`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import requests

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
PACK_DIR_NAME = "fp8_engram"


class WorkflowError(RuntimeError):
    """A workflow was refused (HTTP 400 with node errors) or failed while executing."""

    def __init__(self, message: str, details: dict | None = None):
        super().__init__(message)
        self.details = details or {}


DEFAULT_TREE = ROOT / ".host" / "comfyui"
BASE_VENV = ROOT / ".venv"
TREE_ENVS = ROOT / ".host" / "envs"
FRONTENDS = ROOT / ".host" / "frontends"
FRONTEND_ENV = "FP8_ENGRAM_FRONTEND"


def comfyui_root() -> Path:
    """The ComfyUI tree every script and test uses: COMFYUI_PATH if set, else `.host/comfyui` (the
    0.3.75 tree scripts/setup.sh fetches). The one place that decides it."""
    if os.environ.get("COMFYUI_PATH"):
        tree = Path(os.environ["COMFYUI_PATH"]).resolve()
        if not (tree / "main.py").is_file():
            raise FileNotFoundError(f"COMFYUI_PATH={tree} is not a ComfyUI tree (no main.py)")
        return tree
    if (DEFAULT_TREE / "main.py").is_file():
        return DEFAULT_TREE.resolve()
    raise FileNotFoundError("no ComfyUI tree: run scripts/setup.sh (or set COMFYUI_PATH)")


def env_dir(tree: Path) -> Path:
    """The Python environment of a ComfyUI tree: `.venv` for the default tree, else
    `.host/envs/<folder name>-<hash of its path>` (made by scripts/setup.sh, layered over .venv)."""
    tree = Path(tree).resolve()
    if tree == DEFAULT_TREE.resolve():
        return BASE_VENV
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in tree.name) or "tree"
    return TREE_ENVS / f"{name}-{hashlib.sha256(str(tree).encode()).hexdigest()[:10]}"


def comfyui_python(tree: Path | None = None) -> Path:
    """The python that runs `tree` (default: comfyui_root()); raises if setup.sh has not made it."""
    tree = comfyui_root() if tree is None else Path(tree)
    python = env_dir(tree) / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"no Python environment for {tree} at {python.parent.parent}: run scripts/setup.sh"
                                + ("" if tree.resolve() == DEFAULT_TREE.resolve() else f" with COMFYUI_PATH={tree}"))
    return python


def comfyui_version(tree: Path | None = None) -> tuple[int, ...]:
    """The tree's version from its comfyui_version.py, e.g. (0, 3, 75); () when it has none."""
    tree = comfyui_root() if tree is None else Path(tree)
    text = (tree / "comfyui_version.py").read_text() if (tree / "comfyui_version.py").is_file() else ""
    for line in text.splitlines():
        if line.strip().startswith("__version__"):
            return tuple(int(p) for p in line.split("=", 1)[1].strip().strip("\"'").split(".") if p.isdigit())
    return ()


def frontend_version() -> str | None:
    """The frontend release asked for with FP8_ENGRAM_FRONTEND (e.g. "1.58.1"); None: the tree's own."""
    version = os.environ.get(FRONTEND_ENV, "").strip()
    if not version:
        return None
    if not all(part.isdigit() for part in version.split(".")) or version.count(".") != 2:
        raise ValueError(f"{FRONTEND_ENV}={version!r} is not a comfyui-frontend-package release such as 1.58.1")
    return version


def frontend_dir(version: str) -> Path:
    """Where scripts/setup.sh installs comfyui-frontend-package==`version` (pip --target, no dependencies)."""
    return FRONTENDS / f"comfyui-frontend-package-{version}"


def frontend_root() -> Path | None:
    """The folder the server serves the frontend from (`--front-end-root`): the static files of the
    release FP8_ENGRAM_FRONTEND names; None when it is unset (the tree's environment serves its own)."""
    version = frontend_version()
    if version is None:
        return None
    static = frontend_dir(version) / "comfyui_frontend_package" / "static"
    if not (static / "index.html").is_file():
        raise FileNotFoundError(f"{FRONTEND_ENV}={version}: the frontend is not installed at {static}: "
                                f"run scripts/setup.sh with {FRONTEND_ENV}={version} set")
    return static


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prepare_base_dir(base: Path) -> Path:
    """Create a ComfyUI base directory with the pack linked into its custom_nodes/."""
    for sub in ("custom_nodes", "models", "input", "output", "temp", "user"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    link = base / "custom_nodes" / PACK_DIR_NAME
    if link.is_symlink() or not link.exists():
        if link.is_symlink():
            link.unlink()
        link.symlink_to(ROOT, target_is_directory=True)
    return base


@dataclass
class ComfyServer:
    """One ComfyUI server process on a loopback port, with its own base directory."""

    base_dir: Path
    port: int = 0
    extra_args: list[str] = field(default_factory=list)
    log_path: Path | None = None
    python: str = ""  # default: comfyui_python(), the environment of the tree
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> "ComfyServer":
        root = comfyui_root()
        self.python = self.python or str(comfyui_python(root))
        prepare_base_dir(self.base_dir)
        self.port = self.port or free_port()
        self.log_path = self.log_path or self.base_dir / "comfyui.log"
        cmd = [
            self.python, str(root / "main.py"), "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
            "--base-directory", str(self.base_dir), "--disable-auto-launch", *self.extra_args,
        ]
        frontend = frontend_root()
        if frontend is not None and "--front-end-root" not in self.extra_args:
            cmd += ["--front-end-root", str(frontend)]
        logger.info("starting ComfyUI: %s (log: %s)", " ".join(cmd), self.log_path)
        log = open(self.log_path, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if not root.is_relative_to(ROOT / ".host"):
            env["PYTHONDONTWRITEBYTECODE"] = "1"  # a user's own tree: leave no __pycache__ behind in it
        # A session of its own, so stop() can end the server together with anything it started.
        # Run from the base directory: ComfyUI 0.29 writes comfyui_detail.log into the working directory.
        self.process = subprocess.Popen(cmd, cwd=self.base_dir, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with code {self.process.returncode}; see {self.log_path}:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/system_stats", timeout=2).ok:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"ComfyUI did not answer within {timeout:.0f} s; see {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 15.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=timeout)
        except ProcessLookupError:
            pass

    def client(self) -> "ComfyClient":
        return ComfyClient(self.url)


class ComfyClient:
    """The parts of ComfyUI's HTTP API that the demo and the tests use."""

    def __init__(self, url: str):
        self.url = url
        self.client_id = uuid.uuid4().hex

    def object_info(self, node_class: str | None = None) -> dict:
        path = f"/object_info/{node_class}" if node_class else "/object_info"
        response = requests.get(self.url + path, timeout=60)
        response.raise_for_status()
        return response.json()

    def submit(self, prompt: dict) -> requests.Response:
        """POST the API-format graph; returns the raw response (200 with prompt_id, or 400 with node_errors)."""
        return requests.post(self.url + "/prompt", json={"prompt": prompt, "client_id": self.client_id}, timeout=60)

    def queue(self, prompt: dict) -> str:
        response = self.submit(prompt)
        if response.status_code != 200:
            body = _json_or_text(response)
            raise WorkflowError(f"workflow refused (HTTP {response.status_code}): {json.dumps(body)[:2000]}", body if isinstance(body, dict) else {})
        return response.json()["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = 600.0) -> dict:
        """Poll /history until the prompt is done; returns its history entry or raises WorkflowError."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            response = requests.get(f"{self.url}/history/{prompt_id}", timeout=30)
            response.raise_for_status()
            entry = response.json().get(prompt_id)
            if entry and entry.get("status", {}).get("completed") is not None:
                status = entry["status"]
                if status.get("status_str") == "error":
                    raise WorkflowError(_execution_error_text(status), entry)
                return entry
            time.sleep(0.1)
        raise TimeoutError(f"prompt {prompt_id} did not finish within {timeout:.0f} s")

    def run(self, prompt: dict, timeout: float = 600.0) -> dict:
        """Queue a workflow and wait for it; returns the history entry (outputs per node id)."""
        return self.wait(self.queue(prompt), timeout)

    def view(self, filename: str, subfolder: str = "", folder_type: str = "output") -> bytes:
        response = requests.get(
            self.url + "/view", params={"filename": filename, "subfolder": subfolder, "type": folder_type}, timeout=60
        )
        response.raise_for_status()
        return response.content

    def free(self) -> None:
        """Ask ComfyUI to unload models and free memory (between unrelated workflows)."""
        requests.post(self.url + "/free", json={"unload_models": True, "free_memory": True}, timeout=30)


def _json_or_text(response: requests.Response):
    try:
        return response.json()
    except ValueError:
        return response.text


def _execution_error_text(status: dict) -> str:
    for kind, data in status.get("messages", []):
        if kind == "execution_error":
            return f"node {data.get('node_id')} ({data.get('node_type')}): {data.get('exception_type')}: {data.get('exception_message')}"
    return f"workflow failed: {json.dumps(status)[:2000]}"


def main(argv: list[str]) -> int:
    """`comfyhost.py paths`: the tree, python and frontend in use; `comfyhost.py env-dir TREE`: that
    tree's env; `comfyhost.py frontend-dir`: where FP8_ENGRAM_FRONTEND's release is installed (empty
    when unset)."""
    if argv[:1] == ["env-dir"] and len(argv) == 2:
        sys.stdout.write(f"{env_dir(Path(argv[1]))}\n")
        return 0
    if argv == ["frontend-dir"]:
        version = frontend_version()
        sys.stdout.write(f"{frontend_dir(version) if version else ''}\n")
        return 0
    if argv == ["paths"]:
        tree = comfyui_root()
        frontend = frontend_root()
        sys.stdout.write(f"comfyui={tree}\npython={comfyui_python(tree)}\nfrontend={frontend or 'the one its environment pins'}\n")
        return 0
    sys.stderr.write("usage: comfyhost.py paths | env-dir TREE | frontend-dir\n")
    return 2


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except (ValueError, FileNotFoundError) as exc:
        sys.stderr.write(f"comfyhost.py: {exc}\n")
        sys.exit(2)
