#!/usr/bin/env bash
# README command two: set up everything from nothing (Chromium included), then run the whole test
# suite: unit, integration (real ComfyUI server) and browser (headless Chromium). Extra arguments go
# to pytest, e.g. `scripts/test.sh -m unit`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh" --browser
cd "$root"
exec "$root/.venv/bin/python" -m pytest "$@"
