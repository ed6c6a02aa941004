#!/usr/bin/env bash
# README command two: set up everything from nothing (Chromium included), then run the whole test
# suite: unit, integration (real ComfyUI server) and browser (headless Chromium). Extra arguments go
# to pytest, e.g. `scripts/test.sh -m unit`. With COMFYUI_PATH set, the tests run on that ComfyUI tree,
# in its own environment (scripts/setup.sh makes it).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh" --browser
cd "$root"
paths="$("$root/.venv/bin/python" "$root/scripts/comfyhost.py" paths)"
echo "[test] $(echo "$paths" | tr '\n' ' ')" >&2
python="$(echo "$paths" | sed -n 's/^python=//p')"
exec "$python" -m pytest "$@"
