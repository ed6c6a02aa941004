#!/usr/bin/env bash
# README command one: set up everything from nothing, then run the demo (the tiny world's models come
# from their committed weights, scripts/tiny_world_cache.py, cached in .host/tiny-world/; extra options
# go to demo.py, e.g. --serve to keep ComfyUI up for a browser).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
# The python of the ComfyUI tree in use (COMFYUI_PATH, else .host/comfyui): scripts/comfyhost.py decides.
python="$("$root/.venv/bin/python" "$root/scripts/comfyhost.py" paths | sed -n 's/^python=//p')"
exec "$python" "$root/scripts/demo.py" "$@"
