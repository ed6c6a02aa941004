#!/usr/bin/env bash
# README command one: set up everything from nothing, then run the demo (extra options go to demo.py,
# e.g. --serve to keep ComfyUI up for a browser).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
exec "$root/.venv/bin/python" "$root/scripts/demo.py" "$@"
